"""A training log's own step counter: the one positive sign of progress a pasted log can hold.

`iteration=  2/317892`, `iter=9, loss=...`, `step=2, skipped=0`, `Step 6/50`, a Hugging Face Trainer's
`{'loss': 1.2, ..., 'epoch': 0.59}`, a progress bar's `115/128 [01:02<00:07, 1.8it/s]` (tqdm, Lightning): a
counter seen at two or more increasing values shows the job stepping at the time the log covers. It says
nothing about after the log's last line, and never outweighs a timeout, a dead rank or a stuck stack in the
same evidence.
"""

from __future__ import annotations

import re

_COUNTER = re.compile(r"(?<![\w/])(?P<name>iteration|iter|step|global_step|epoch)\s{0,4}[=:]?\s{0,8}(?P<n>\d{1,12})"
                      r"(?:\s{0,4}/\s{0,4}(?P<of>\d{1,12}))?(?![\w.])", re.IGNORECASE)
# A Trainer's fractional epoch, and a progress bar's count before its elapsed time ("45/100 [00:10<00:12").
_EPOCH = re.compile(r"""['"]epoch['"]\s{0,4}:\s{0,4}(?P<n>\d{1,9}(?:\.\d{1,12})?)""")
_BAR = re.compile(r"(?<![\w/.])(?P<n>\d{1,9})/(?P<of>\d{1,9})\s{0,2}\[\d{1,4}:\d\d(?::\d\d)?\s{0,2}<")
MAX_LINES = 2_000_000
# Words a log uses when something went wrong: a counter that rose before them says nothing about after them.
_TROUBLE = re.compile(r"\b(?:time[ds]?[ _-]?out|timing out|hang(?:s|ing)?|hung|stuck|deadlock(?:ed)?|killed|"
                      r"terminat\w*|abort\w*|not responding|no step)\b|Traceback|watchdog caught|"
                      r"(?-i:\b[A-Z]\w*(?:Error|Exception)\b|\bERROR\b|\bSIG[A-Z]{2,6}\b)", re.IGNORECASE)


def trouble(text: str) -> str | None:
    """The first line that says something went wrong, quoted short; None for a log that shows nothing wrong."""
    found = _TROUBLE.search(text)
    if found is None:
        return None
    start = text.rfind("\n", 0, found.start()) + 1
    end = text.find("\n", found.end())
    line = " ".join(text[start:end if end >= 0 else len(text)].split())
    return f"'{line[:120]}{'...' if len(line) > 120 else ''}'"


def steps(text: str) -> str | None:
    """'iteration went from 1 to 2' when a counter increases across the text's lines; None otherwise."""
    seen: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        values = seen.setdefault(name, [])
        if not values or values[-1] != value:
            values.append(value)

    for line in text.splitlines()[:MAX_LINES]:
        line = line[:4096]
        for m in _COUNTER.finditer(line):
            add(m["name"].lower(), int(m["n"]))
        for m in _EPOCH.finditer(line):
            add("epoch", float(m["n"]))
        for m in _BAR.finditer(line):
            if int(m["n"]) <= int(m["of"]):  # a bar counts up to its total
                add("progress bar", int(m["n"]))
    for name, values in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        rising = sum(1 for a, b in zip(values, values[1:]) if b > a)
        if rising and rising >= len(values) - 1 - rising:  # mostly increasing, not a counter that repeats
            return f"{name} went from {values[0]:g} to {max(values):g} in the log's lines"
    return None
