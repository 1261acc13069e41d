"""The shape of a stack dump, however it was read (a live py-spy capture, a saved dump, a paste): frames
innermost first, a process's threads, and how reports name the process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Frame:
    function: str  # as the dump names it; py-spy's JSON qualifies methods ("Queue.get")
    file: str = ""  # empty where the dump names no file (a built-in, a digest)
    line: int | None = None

    @property
    def short(self) -> str:
        """'queue.get', 'Queue.get', 'broadcast': the name a person recognises."""
        if "." in self.function or not self.file:
            return self.function
        stem = self.file.rsplit("/", 1)[-1].removesuffix(".py")
        return f"{stem}.{self.function}" if stem and not stem.startswith("<") else self.function

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line is not None else self.file


@dataclass(frozen=True, slots=True)
class ThreadStack:
    thread_id: int | None
    name: str | None
    state: str | None  # "active" | "idle" | None when the dump does not say
    frames: tuple[Frame, ...]  # innermost first
    os_thread_id: int | None = None  # the kernel's id for it, where the dump gives one: the process's id is its main


@dataclass(frozen=True, slots=True)
class StackDump:
    """One process's threads, from a live capture or a saved dump. `member` is how reports name it:
    'rank 3' when the rank is known, else 'pid 688514' (or a digest's 'host#2')."""

    member: str
    threads: tuple[ThreadStack, ...]
    pid: int | None = None
    rank: int | None = None
    gpus: tuple[int, ...] = ()
    source: str = ""
    count: int = 1  # processes this dump stands for ("6 processes are in:" above one representative)
    node: str = ""  # where the process runs, when the dumps of several nodes are analysed together
    job: str = ""  # what it says it runs: a capture's training job, py-spy text's program; '' when unsaid

    @property
    def main_thread(self) -> ThreadStack | None:
        """The thread whose kernel id is the process's id (what it cannot choose), else the one named MainThread
        (a name any thread may take), else the first."""
        for thread in self.threads:
            if self.pid is not None and thread.os_thread_id == self.pid:
                return thread
        for thread in self.threads:
            if thread.name == "MainThread":
                return thread
        return self.threads[0] if self.threads else None


def member_id(pid: int | None, rank: int | None) -> str:
    return f"rank {rank}" if rank is not None else f"pid {pid}"
