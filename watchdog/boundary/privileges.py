"""What this process may do to the ranks of other users, read from its own effective capabilities
(/proc/self/status `CapEff`), and which configured feature that leaves undone.

The shipped units run the daemon as a user of its own (systemd) or as root with every capability dropped
but a few (the DaemonSet), so neither is the ranks' user and each reach into a rank is a capability:

    CAP_SYS_PTRACE       py-spy reads a rank's memory; /proc/<pid>/environ passes the ptrace access check
    CAP_DAC_READ_SEARCH  /proc/<pid>/environ is mode 0400, owned by the rank's user: a file permission
                         check that CAP_SYS_PTRACE does not pass (without it a rank has no rank or job)
    CAP_KILL             terminate_ranks signals another user's process

Root with its full set (a manual run) has them all.
"""

from __future__ import annotations

from dataclasses import dataclass

CAP_DAC_READ_SEARCH = 2
CAP_KILL = 5
CAP_SYS_PTRACE = 19
NAMES = {CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH", CAP_KILL: "CAP_KILL", CAP_SYS_PTRACE: "CAP_SYS_PTRACE"}
_FIX = ("systemd: AmbientCapabilities and CapabilityBoundingSet in deploy/systemd (actions.conf for CAP_KILL); "
        "Kubernetes: securityContext.capabilities.add in the DaemonSet (the actions component adds KILL)")


def effective(status_path: str = "/proc/self/status") -> int | None:
    """The effective capability set of this process, or None where it cannot be read (not Linux)."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Shortfall:
    feature: str  # what the configuration asks for
    capability: int

    def text(self) -> str:
        effect = {
            CAP_SYS_PTRACE: "py-spy cannot read another user's ranks: no stacks, no confirmation of a hang",
            CAP_DAC_READ_SEARCH: "another user's ranks cannot be named: /proc/<pid>/environ is unreadable, so "
                                 "they have no rank and no job",
            CAP_KILL: "terminate_ranks cannot signal another user's ranks: every such action would fail",
        }[self.capability]
        return f"{self.feature}: this process lacks {NAMES[self.capability]}: {effect} (grant it: {_FIX})"


def shortfalls(stacks: bool, terminate: bool, caps: int | None = None) -> list[Shortfall]:
    """The capabilities the configured features need that this process lacks. `stacks`: stacks or rank
    identity are wanted (always, but for a daemon that never looks at a rank); `terminate`: terminate_ranks
    is among the actions of a mode other than observe. None read: nothing is said."""
    caps = effective() if caps is None else caps
    if caps is None:
        return []
    needed = []
    if stacks:
        needed += [("stacks", CAP_SYS_PTRACE), ("ranks", CAP_DAC_READ_SEARCH)]
    if terminate:
        needed.append(("actions.terminate_ranks", CAP_KILL))
    return [Shortfall(feature, cap) for feature, cap in needed if not caps & (1 << cap)]
