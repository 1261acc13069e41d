"""Which process listens on a local TCP port: /proc/net/tcp and tcp6 give each listening socket's inode, and
/proc/<pid>/fd of a process names the socket inodes it holds (`socket:[N]`). A local service's answer is
believed only when the process that listens is the one that should (NCCL RAS: a rank of the job asked about),
since any user may listen on a free port.

The tables are those of the daemon's own network namespace, the one its connections go through. Reads are
bounded: at most MAX_SOCKETS table lines and MAX_FDS descriptors a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

MAX_SOCKETS = 200_000
MAX_FDS = 65_536
_LISTEN = "0A"


class ListenerUnknown(Exception):
    """Who listens could not be read (no /proc/net/tcp, or a rank's descriptors are not ours to read)."""


def listening_inodes(port: int, proc_root: str | Path = "/proc") -> set[int]:
    """The inodes of the sockets listening on TCP `port`, any address, IPv4 and IPv6."""
    found: set[int] = set()
    tables = 0
    for name in ("tcp", "tcp6"):
        try:
            with open(Path(proc_root) / "net" / name, "rb") as table:
                tables += 1
                table.readline()  # the header
                for number, line in enumerate(table):
                    if number >= MAX_SOCKETS:
                        break
                    fields = line.split(None, 10)  # sl local rem st tx:rx tr:when retrnsmt uid timeout inode
                    if len(fields) < 10 or fields[3].decode() != _LISTEN:
                        continue
                    if int(fields[1].rpartition(b":")[2], 16) == port:
                        found.add(int(fields[9]))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ListenerUnknown(f"/proc/net/{name}: {exc.strerror or exc}") from None
    if not tables:
        raise ListenerUnknown("no /proc/net/tcp to read")
    return found


def held_by(inodes: set[int], pids: Iterable[int], proc_root: str | Path = "/proc") -> set[int]:
    """Those of `inodes` that one of `pids` holds open."""
    held: set[int] = set()
    for pid in pids:
        folder = Path(proc_root) / str(pid) / "fd"
        try:
            with os.scandir(folder) as entries:
                for number, entry in enumerate(entries):
                    if number >= MAX_FDS:
                        break
                    try:
                        target = os.readlink(entry.path)
                    except OSError:
                        continue  # closed meanwhile
                    if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                        held.add(int(target[8:-1]))
        except PermissionError:
            raise ListenerUnknown(f"pid {pid}'s descriptors are not readable (CAP_SYS_PTRACE)") from None
        except OSError:
            continue  # the process is gone
    return held


def with_siblings(pids: Iterable[int], proc_root: str | Path = "/proc") -> set[int]:
    """`pids` and the other children of their parents that run as the same user: the job's processes on this
    node where a picture holds only some of its ranks (those on one GPU), as its launcher started them."""
    root = Path(proc_root)
    found: set[int] = set()
    for pid in pids:
        found.add(pid)
        try:
            uid = (root / str(pid)).stat().st_uid
            stat = (root / str(pid) / "stat").read_bytes()
            parent = int(stat[stat.rindex(b")") + 2:].split(None, 2)[1])
            if parent <= 1:
                continue
            with os.scandir(root / str(parent) / "task") as tasks:
                children = [int(c) for number, task in enumerate(tasks) if number < MAX_FDS
                            for c in (root / str(parent) / "task" / task.name / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue  # gone, or no children list in this kernel
        for child in children[:MAX_FDS]:
            try:
                if (root / str(child)).stat().st_uid == uid:
                    found.add(child)
            except OSError:
                continue
    return found


def strangers(port: int, pids: Iterable[int], proc_root: str | Path = "/proc") -> str | None:
    """Why an answer on `port` would not come from the processes of `pids`' job (themselves, and their launcher's
    other children of their user), or None when every socket listening there is theirs (or none listens:
    asking then fails on its own)."""
    try:
        inodes = listening_inodes(port, proc_root)
        others = inodes - held_by(inodes, sorted(with_siblings(pids, proc_root)), proc_root)
    except ListenerUnknown as exc:
        return f"who listens on port {port} is unknown ({exc})"
    if others:
        return f"a process that is not one of this job's listens on port {port}"
    return None
