"""A process that speaks NCCL RAS's client protocol on a local port and answers each STATUS with a report
read from a file: what a rank's NCCL does (run with a rank's variables, or inside a rank: gloo_job.py), or
what another user's listener on the same port does (run without).

    python ras_speaker.py PORT REPORT_FILE READY_FILE
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def serve_forever(server: socket.socket, report: Path) -> None:
    """Each connection: OK to every line (SERVER PROTOCOL 2 to the client's), then the report to STATUS."""
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as talk:
            for line in talk:
                word = line.decode().strip().upper()
                if word.endswith("STATUS"):
                    talk.write(report.read_bytes())
                    break
                talk.write(b"SERVER PROTOCOL 2\n" if word.startswith("CLIENT PROTOCOL") else b"OK\n")
                talk.flush()


def main() -> None:
    port, report, ready = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[-1])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(8)
    ready.write_text("listening")
    serve_forever(server, report)


if __name__ == "__main__":
    main()
