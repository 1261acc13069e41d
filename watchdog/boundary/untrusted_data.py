"""Untrusted JSON and pickles (a rank's dump, a RAS reply, py-spy's output, a file given to `analyze`) read into
plain Python values, bounded in the objects they build and not only in the bytes they hold.

A cap on bytes is not a cap on memory: 16 MiB of `[],[],...` makes json.loads build 5.6 million lists, and
16 MiB of the pickle opcode `]` (an empty list, one byte each) 16 million: over a GiB either way. So the
objects a reader would build are estimated and charged against one budget, `MAX_BUILT_BYTES`, before they
are built (JSON: its structural characters counted first) or as they are built (pickles: each opcode
charged), and input over it is refused with `TooMuchData` (a ValueError) saying how much it would build.

The estimate is the bytes of a new object with the reference that holds it (`OBJECT_BYTES`, a small list or
dict in CPython is 56-64 bytes), `REFERENCE_BYTES` for a reference to one that exists (a memo lookup, None),
and the characters of text. It is kept above what CPython spends on real dumps, so what passes fits.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable
from typing import Any

MAX_BUILT_BYTES = 48 * 2**20  # a daemon of ~75 MiB stays under 150 MiB with the input's own bytes beside it
OBJECT_BYTES = 64
REFERENCE_BYTES = 8
ENTRY_BYTES = 32  # a number, or an entry of a dict or set (its slot, and the table's growth)


# C0 and C1 control characters (new lines and tabs too) as \xNN: for text a reader keeps as one name or one line,
# and for what the verbs print (cli/common.py's shown keeps new lines and tabs).
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0))}
# ... and the characters that reorder or break what follows on a terminal or a page: bidirectional controls
# (a right-to-left override makes "rank 3" read as another) and Unicode's line and paragraph separators.
CONTROL_ESCAPES.update({c: f"\\u{c:04x}" for c in (0x061c, 0x200e, 0x200f, 0x2028, 0x2029, *range(0x202a, 0x202f),
                                                   *range(0x2066, 0x206a))})


def one_line(text: str) -> str:
    """`text` as one line of printable characters: a function or thread name from a rank keeps no new line
    (which would forge the next line of a report), no escape sequence, no carriage return."""
    # Every character escaped is one Python calls unprintable (tests/hostile): most names have none, and the
    # scan for one costs a fraction of the translation (a 4,096-node job's answers are millions of names).
    return text if text.isprintable() else text.translate(CONTROL_ESCAPES)


class TooMuchData(ValueError):
    """Input that would build more than the budget; the message says what and how much."""


def _refusal(what: str, budget: int, built: int | None = None) -> TooMuchData:
    """`built`: the estimate made before reading (JSON); None: past the budget while reading (a pickle, whose
    every opcode is counted, so that one of many opcodes that build nothing is refused too)."""
    much = f"about {built / 2**20:.0f} MiB of Python objects, over" if built is not None else "more than"
    steps = "" if built is not None else f", or take more than {budget // REFERENCE_BYTES:,} steps"
    return TooMuchData(f"{what} would build {much} the {budget / 2**20:.0f} MiB of objects a reader may build"
                       f"{steps} (a dump or report of real ranks takes a fraction of it); not read")


def json_values(data: bytes | str) -> int:
    """How many values parsing `data` would build at most: one per `[`, `{`, `,` and `:` (a dict's key and
    its value), counted in C over the raw text; text inside strings counts too, so the count is never low."""
    if isinstance(data, str):
        return data.count("[") + data.count("{") + data.count(",") + data.count(":") + 1
    return len(data) - len(data.translate(None, b"[{,:")) + 1  # one pass in C (four counts take 2.6 times as long)


def check_json(data: bytes | str, what: str = "JSON", budget: int = MAX_BUILT_BYTES) -> None:
    """TooMuchData where parsing `data` would build more than `budget` (for a caller with a parser of its own)."""
    built = json_values(data) * OBJECT_BYTES + len(data)
    if built > budget:
        raise _refusal(what, budget, built)


def loads_json(data: bytes | str, what: str = "JSON", budget: int = MAX_BUILT_BYTES) -> Any:
    """json.loads, after checking what it would build: TooMuchData over `budget`. json's own errors
    (ValueError, RecursionError) pass through for the caller to word."""
    check_json(data, what, budget)
    return json.loads(data)


def starts_as_json(text: str, probe: int = 1 << 16) -> bool:
    """Whether `text` reads as JSON as far as its first `probe` characters go: a log whose first line begins
    with `[rank0]:` fails within its first bytes, JSON cut short runs out. Builds what those characters hold."""
    head = text[:probe]
    try:
        json.loads(head)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(head.rstrip()) - 1 or exc.msg.startswith("Unterminated string")
    except RecursionError:
        return True  # nested past Python's stack: JSON's shape, not a log's
    except ValueError:
        return False
    return True


# -- pickles -------------------------------------------------------------------------------------------
_OP = {name: code[0] for name, code in vars(pickle).items()
       if name.isupper() and isinstance(code, bytes) and len(code) == 1}
# An object that exists (CPython keeps the integers up to 256), and the opcodes that build nothing: every opcode
# costs at least a reference, so the budget bounds the time a pickle takes too (6 million opcodes, seconds).
_REFERENCES = ("NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "BINGET", "LONG_BINGET", "GET", "DUP", "BININT1",
               "PROTO", "FRAME", "STOP", "POP", "POP_MARK")
_SMALL = ("BININT", "BININT2", "BINFLOAT", "LONG1", "BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE")  # a number; a memo entry
# per item since the mark (a dict entry is two items)
_PER_ITEM = {"APPENDS": REFERENCE_BYTES, "SETITEMS": ENTRY_BYTES // 2, "ADDITEMS": ENTRY_BYTES}
_ONE_ITEM = {"APPEND": REFERENCE_BYTES, "SETITEM": ENTRY_BYTES}
_PAYLOAD = ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING", "STRING",
            "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "LONG", "LONG1", "LONG4", "INT")


def _size(value: object) -> int:
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    return value.bit_length() // 8 if isinstance(value, int) else 0


# The opcodes that hash what they put in a dict or a set: where on the stack its keys are (the items since
# the mark are the whole stack then: MARK moves the rest aside).
_KEYS: dict[str, Callable[[int], range]] = {
    "SETITEM": lambda n: range(n - 2, n - 1), "SETITEMS": lambda n: range(0, n, 2), "DICT": lambda n: range(0, n, 2),
    "ADDITEMS": lambda n: range(n), "FROZENSET": lambda n: range(n)}
_FLAT = (str, bytes, int, float, bool, type(None))


class Unreadable:
    """What stands for a dict key or set member that is neither text, a number nor a flat tuple of them: a
    tuple of tuples that share themselves through the memo is tiny to write and exponential to hash (80
    levels of `(t, t)` in 170 bytes would hash for ever, holding the interpreter's lock: every thread of the
    daemon stopped), and a million nested ones overflow the C stack when hashed (the process dies). Each is
    its own key, hashed by identity; readers drop keys that are not text or numbers."""

    __slots__ = ()


def _flat(key: object) -> bool:
    return isinstance(key, _FLAT) or (isinstance(key, tuple) and all(isinstance(k, _FLAT) for k in key))


def _charged(handler: Callable[[Any], None], name: str) -> Callable[[Any], None]:
    cost = (REFERENCE_BYTES if name in _REFERENCES else ENTRY_BYTES if name in _SMALL
            else _ONE_ITEM.get(name, OBJECT_BYTES))
    per_item = _PER_ITEM.get(name, 0)
    payload = name in _PAYLOAD

    keys = _KEYS.get(name)

    def run(self: DataUnpickler) -> None:
        self.charge(cost + per_item * len(self.stack))
        if keys is not None:
            stack = self.stack
            for at in keys(len(stack)):
                if not _flat(stack[at]):
                    stack[at] = Unreadable()
        handler(self)
        if payload:
            self.charge(_size(self.stack[-1]))
    return run


class DataUnpickler(pickle._Unpickler):
    """Python's own unpickler, not the C one, with every opcode charged to a budget (module docstring) and
    every class refused: the input holds only dicts, lists, tuples, strings and numbers, and a file in /tmp
    must never run code in a daemon that may run as root. Python's memo is a dict, so `LONG_BINPUT
    4294967295` in a 9-byte pickle costs one entry, not a 64 GiB table. Slower than C; a dump is a few MB."""

    stack: list[Any]  # pickle's own, set by load()
    dispatch = {code: _charged(pickle._Unpickler.dispatch[code], name) for name, code in _OP.items()
                if code in pickle._Unpickler.dispatch}

    def __init__(self, data: bytes, what: str, budget: int = MAX_BUILT_BYTES):
        super().__init__(io.BytesIO(data))
        self.what, self.budget, self.left = what, budget, budget

    def charge(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise _refusal(self.what, self.budget)

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: {self.what} holds only data")


def loads_pickle(data: bytes, what: str = "a pickle", budget: int = MAX_BUILT_BYTES) -> Any:
    """The plain values a pickle holds; TooMuchData past `budget`, pickle's own errors for the rest."""
    return DataUnpickler(data, what, budget).load()
