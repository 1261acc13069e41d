"""A text as it was before it was pasted: line ends, a Markdown quote, a hard wrap at a fixed width undone before
any reader of `analyze` looks at it."""

from __future__ import annotations

import re
from collections import Counter

_QUOTED = re.compile(r"^[ \t]{0,3}>+[ \t]?", re.MULTILINE)
_BLANK = re.compile(r"^[ \t\r\f\v]*$", re.MULTILINE)


def pasted(text: str) -> str:
    """A text as it was before it was pasted: CRLF or CR line ends made LF, and a Markdown quote (`> ` before
    most lines, a mail reply or a GitHub comment quoting a log) taken off. A CR inside py-spy's `Process` or
    `Thread` line is the process's own (its command or a thread's name) and stays: made a line end, it would
    cut the line and hide that process."""
    text = text.replace("\r\n", "\n")
    if "\r" in text:
        lines = text.split("\n")
        text = "\n".join(line if len(lines) > 1 and line.lstrip().startswith(("Thread ", "Process ")) else
                          line.replace("\r", "\n") for line in lines)
    lines = [line for line in text[:1 << 22].splitlines()[:2000] if line.strip()]  # never a list of a whole log
    if lines and sum(1 for line in lines if line.lstrip().startswith(">")) >= 0.6 * len(lines):
        text = _QUOTED.sub("", text)
    return _unwrapped(text)


def _unwrapped(text: str) -> str:
    """A text a terminal or a mail client cut at a fixed width, mid-word: where many lines have the same length
    of 60 characters or more, each line of exactly that length is joined with the one after it."""
    head = text[:1 << 22].split("\n")[:20000]  # the decision on the first lines: a log is never split whole for it
    widths = Counter(len(line) for line in (head if len(text) <= 1 << 22 else head[:-1]) if len(line) >= 60)
    if not widths:
        return text
    width, count = widths.most_common(1)[0]
    if count < 3 or count < 0.2 * (text.count("\n") + 1 - sum(1 for _ in _BLANK.finditer(text))) or \
            max(widths) > width:
        return text  # a cut at a width leaves no line longer than it
    lines = text.split("\n")
    # ... and cuts words and numbers in two: at a third of the cuts or more, a letter or digit on both sides. Lines
    # a program wrote at one length (grep's output of one kind of line) end and start whole.
    cut = [n for n, line in enumerate(lines[:-1]) if len(line) == width]
    if sum(1 for n in cut if lines[n][-1:].isalnum() and lines[n + 1][:1].isalnum()) * 3 < len(cut):
        return text
    joined: list[str] = []
    carry = ""
    for line in lines:
        if len(line) == width:
            carry += line
            continue
        joined.append(carry + line)
        carry = ""
    if carry:
        joined.append(carry)
    return "\n".join(joined)
