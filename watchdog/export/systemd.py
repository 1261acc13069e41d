"""systemd's notify protocol (sd_notify): READY=1 once serving, WATCHDOG=1 from the loop itself so a
wedged loop gets the service restarted, STOPPING=1 on the way out. A datagram to $NOTIFY_SOCKET; a
no-op when systemd did not start us."""

from __future__ import annotations

import os
import socket


class SystemdNotifier:
    def __init__(self, socket_path: str | None = None):
        path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET")
        if path and path.startswith("@"):
            path = "\0" + path[1:]  # abstract namespace
        self.address = path or None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(lines).encode())
            return True
        except OSError:  # systemd went away: nothing to tell, nothing to stop for
            return False

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
