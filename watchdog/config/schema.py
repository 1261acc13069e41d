"""The configuration's schema, written for it: a section is a class of annotated fields, each with its default,
its limits and its description; validating a document builds frozen sections, or one problem per wrong value,
each with its key path, its kind, what was given and the limit it passed (loading.py words them).

Strict, as a configuration should be: 30 is a number, but "30" and true are not; a key no section has is a
problem, not ignored. The kinds a field may have: bool, int, float, str, a Literal, X | None, list[X],
dict[K, V], another section; Annotated adds limits (Field(ge=..., le=...)). Validators: field_validator(name)
on a classmethod that returns the value or raises ValueError; model_validator(mode="after") on a method of the
built section, or mode="before" on a classmethod handed the raw mapping.

It costs what a configuration needs: a general validation library held 11 MiB of every daemon's memory."""

from __future__ import annotations

import copy
import math
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal, Union

_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "MISSING"})()


class FieldInfo:
    """A field's default (or its factory), description and limits, and once its class is complete its type."""

    __slots__ = ("allow_inf_nan", "annotation", "default", "default_factory", "description", "ge", "gt", "le", "lt",
                 "max_length", "min_length")

    def __init__(self, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None,
                 description: str | None = None, ge: float | None = None, gt: float | None = None,
                 le: float | None = None, lt: float | None = None, min_length: int | None = None,
                 max_length: int | None = None, allow_inf_nan: bool = True) -> None:
        self.default, self.default_factory, self.description = default, default_factory, description
        self.ge, self.gt, self.le, self.lt, self.min_length, self.max_length = ge, gt, le, lt, min_length, max_length
        self.allow_inf_nan, self.annotation = allow_inf_nan, None

    def is_required(self) -> bool:
        return self.default is _MISSING and self.default_factory is None

    def merged(self, other: FieldInfo) -> FieldInfo:
        """This field's limits with those `other` adds (an Annotated alias's, then the field's own)."""
        out = FieldInfo()
        for name in FieldInfo.__slots__:
            mine, theirs = getattr(self, name), getattr(other, name)
            unset = theirs is _MISSING if name == "default" else theirs is None or (
                name == "allow_inf_nan" and theirs is True)
            setattr(out, name, mine if unset else theirs)
        return out


def Field(default: Any = _MISSING, *, default_factory: Callable[[], Any] | None = None,  # noqa: N802
          description: str | None = None, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, min_length: int | None = None, max_length: int | None = None,
          allow_inf_nan: bool = True) -> Any:
    """A field's default and description, or (inside Annotated) its limits."""
    return FieldInfo(default, default_factory, description, ge, gt, le, lt, min_length, max_length, allow_inf_nan)


class LaxKeys:
    """In Annotated on a dict's key type: a whole number written as text ("0": a GPU's index as JSON keys it)."""


class _Check:
    def __init__(self, kind: str, names: tuple[str, ...], func: Any) -> None:
        self.kind, self.names = kind, names
        self.func = func.__func__ if isinstance(func, classmethod) else func


def field_validator(*names: str) -> Callable[[Any], Any]:
    """Checks the named fields once they have their kinds: a classmethod (cls, value) -> value, or ValueError."""
    return lambda func: _Check("field", names, func)


def model_validator(*, mode: Literal["before", "after"]) -> Callable[[Any], Any]:
    """after: a method of the built section, returning it or raising ValueError; before: a classmethod handed the
    raw mapping, returning the mapping to validate."""
    return lambda func: _Check(mode, (), func)


class ValidationError(ValueError):
    """Every problem of a document at once; errors() gives them as dicts: loc, type, msg, input, ctx."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        said = "; ".join(f"{'.'.join(map(str, p['loc'])) or '(top level)'}: {p['msg']}" for p in problems[:5])
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        super().__init__(f"{len(problems)} {'problem' if len(problems) == 1 else 'problems'}: {said}{more}")
        self._problems = problems

    def errors(self) -> list[dict[str, Any]]:
        return list(self._problems)


class _Invalid(Exception):
    """Inside validation: the problems found under one value."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        self.problems = problems


def _problem(loc: tuple[Any, ...], kind: str, msg: str, given: Any, **ctx: Any) -> _Invalid:
    return _Invalid([{"loc": loc, "type": kind, "msg": msg, "input": given, "ctx": ctx}])


class Section:
    """A frozen section of the configuration: Section(**values) validates them (ValidationError)."""

    model_fields: typing.ClassVar[dict[str, FieldInfo]] = {}
    _checks: typing.ClassVar[list[_Check]] = []
    _resolved: typing.ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = dict(cls.model_fields)  # a parent's first, in order
        checks = list(cls._checks)
        for name in list(vars(cls)):
            value = vars(cls)[name]
            if isinstance(value, _Check):
                checks.append(value)
                delattr(cls, name)
        for name in cls.__dict__.get("__annotations__", {}):
            if name.startswith("_") or name in ("model_fields",):
                continue
            given = vars(cls).get(name, _MISSING)
            fields[name] = given if isinstance(given, FieldInfo) else FieldInfo(default=given)
            if name in vars(cls):
                delattr(cls, name)
        cls.model_fields, cls._checks, cls._resolved = fields, checks, False

    @classmethod
    def _resolve(cls) -> None:
        """Each field's kind, from the annotations (text under `from __future__ import annotations`)."""
        if cls._resolved:
            return
        hints = typing.get_type_hints(cls, include_extras=True)  # each class's names from its own module
        for name, info in list(cls.model_fields.items()):
            kind = hints[name]
            limits = FieldInfo()
            while typing.get_origin(kind) is typing.Annotated:
                extra = kind.__metadata__
                kind = kind.__origin__
                for item in extra:
                    if isinstance(item, FieldInfo):
                        limits = limits.merged(item)
            resolved = limits.merged(info)
            resolved.annotation = kind
            cls.model_fields[name] = resolved
        cls._resolved = True

    def __init__(self, **values: Any) -> None:
        try:
            built = type(self)._build(values, ())
        except _Invalid as exc:
            raise ValidationError(exc.problems) from None
        object.__setattr__(self, "__dict__", built.__dict__)

    @classmethod
    def model_validate(cls, data: Any) -> Any:
        """The section `data` (a mapping) describes; ValidationError with every problem in it."""
        try:
            return cls._build(data, ())
        except _Invalid as exc:
            raise ValidationError(exc.problems) from None

    @classmethod
    def _build(cls, data: Any, loc: tuple[Any, ...]) -> Any:
        cls._resolve()
        for check in cls._checks:
            if check.kind == "before":
                data = check.func(cls, data)
        if not isinstance(data, dict):
            raise _problem(loc, "model_type", "Input should be a mapping", data)
        problems: list[dict[str, Any]] = []
        values: dict[str, Any] = {}
        for name, info in cls.model_fields.items():
            if name not in data:
                if info.is_required():
                    problems.append({"loc": (*loc, name), "type": "missing", "msg": "Field required",
                                     "input": data, "ctx": {}})
                else:  # a list or a mapping of its own for each section: a caller changing it changes no other
                    values[name] = info.default_factory() if info.default_factory else (
                        copy.deepcopy(info.default) if isinstance(info.default, (list, dict, Section))
                        else info.default)
                continue
            try:
                value = _value(info.annotation, data[name], (*loc, name), info)
                for check in cls._checks:
                    if check.kind == "field" and name in check.names:
                        try:
                            value = check.func(cls, value)
                        except ValueError as exc:
                            raise _problem((*loc, name), "value_error", f"Value error, {exc}", data[name]) from None
                values[name] = value
            except _Invalid as exc:
                problems += exc.problems
        problems += [{"loc": (*loc, key), "type": "extra_forbidden", "msg": "Extra inputs are not permitted",
                      "input": data[key], "ctx": {}} for key in data if key not in cls.model_fields]
        if problems:
            raise _Invalid(problems)
        built = object.__new__(cls)
        object.__setattr__(built, "__dict__", values)
        for check in cls._checks:
            if check.kind == "after":
                try:
                    built = check.func(built)  # type: ignore[arg-type]
                except ValueError as exc:
                    raise _problem(loc, "value_error", f"Value error, {exc}", data) from None
        return built

    def model_copy(self, update: dict[str, Any] | None = None) -> Any:
        """A copy with some fields replaced, validated as the section is (ValidationError)."""
        if not update:
            return self
        return type(self).model_validate({**self.__dict__, **update})

    def model_dump(self) -> dict[str, Any]:
        """The section as plain mappings and lists, every field in order."""
        return {name: _dumped(getattr(self, name)) for name in type(self).model_fields}

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be set")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be removed")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *map(_hashable, self.__dict__.values())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.__dict__.items())


def _hashable(value: Any) -> Any:
    """A field's value as a hash can take it: lists as tuples, mappings as sets of their pairs."""
    if isinstance(value, list):
        return tuple(map(_hashable, value))
    if isinstance(value, dict):
        return frozenset((k, _hashable(v)) for k, v in value.items())
    return value


def _dumped(value: Any) -> Any:
    if isinstance(value, Section):
        return value.model_dump()
    if isinstance(value, list):
        return [_dumped(v) for v in value]
    if isinstance(value, dict):
        return {k: _dumped(v) for k, v in value.items()}
    return value


def _value(kind: Any, given: Any, loc: tuple[Any, ...], info: FieldInfo | None = None) -> Any:
    """`given` as a value of `kind` within `info`'s limits, or _Invalid saying why not."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union or origin is types.UnionType:
        if given is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _value(rest[0], given, loc, info)
        raise TypeError(f"unsupported kind {kind!r}")  # pragma: no cover - a mistake in a section, not a document
    if origin is typing.Annotated:
        return _value(args[0], given, loc, info)
    if origin is Literal:
        if given in args and type(given) in {type(a) for a in args} and not isinstance(given, bool):
            return given
        shown = [repr(a) for a in args]
        words = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        raise _problem(loc, "literal_error", f"Input should be {words}", given, expected=words)
    if origin is list:
        if not isinstance(given, list):
            raise _problem(loc, "list_type", "Input should be a valid list", given)
        problems: list[dict[str, Any]] = []
        out = []
        for n, item in enumerate(given):
            try:
                out.append(_value(args[0], item, (*loc, n)))
            except _Invalid as exc:
                problems += exc.problems
        if problems:
            raise _Invalid(problems)
        return _sized(out, loc, info, "List", "item")
    if origin is dict:
        if not isinstance(given, dict):
            raise _problem(loc, "dict_type", "Input should be a valid dictionary", given)
        key_kind, lax = args[0], False
        if typing.get_origin(key_kind) is typing.Annotated:
            lax = any(m is LaxKeys or isinstance(m, LaxKeys) for m in key_kind.__metadata__)
            key_kind = key_kind.__origin__
        problems, mapped = [], {}
        for key, item in given.items():
            pair = []
            for part, kind, where in ((key, key_kind, (*loc, key, "[key]")), (item, args[1], (*loc, key))):
                if lax and part is key and isinstance(key, str) and key.strip().lstrip("+-").isdigit():
                    part = int(key)
                try:
                    pair.append(_value(kind, part, where))
                except _Invalid as exc:
                    problems += exc.problems
            if len(pair) == 2:
                mapped[pair[0]] = pair[1]
        if problems:
            raise _Invalid(problems)
        return mapped
    if isinstance(kind, type) and issubclass(kind, Section):
        if isinstance(given, kind):
            return given
        return kind._build(given, loc)
    if kind is bool:
        if not isinstance(given, bool):
            raise _problem(loc, "bool_type", "Input should be a valid boolean", given)
        return given
    if kind is int:
        if isinstance(given, bool) or not isinstance(given, int):
            raise _problem(loc, "int_type", "Input should be a valid integer", given)
        return _within(given, loc, info)
    if kind is float:
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise _problem(loc, "float_type", "Input should be a valid number", given)
        value = float(given)
        if info is not None and not info.allow_inf_nan and not math.isfinite(value):
            raise _problem(loc, "finite_number", "Input should be a finite number", given)
        return _within(value, loc, info, given)
    if kind is str:
        if not isinstance(given, str):
            raise _problem(loc, "string_type", "Input should be a valid string", given)
        return _sized(given, loc, info, "String", "character")
    if kind is object or kind is Any:
        return given
    raise TypeError(f"unsupported kind {kind!r}")  # pragma: no cover - a mistake in a section, not a document


def _sized(value: Any, loc: tuple[Any, ...], info: FieldInfo | None, what: str, unit: str) -> Any:
    """A string or list within the field's lengths, or the problem saying which it passes."""
    least, most = (info.min_length, info.max_length) if info is not None else (None, None)
    for limit, short, word in ((least, True, "at least"), (most, False, "at most")):
        if limit is not None and (len(value) < limit if short else len(value) > limit):
            kind = ("string_" if what == "String" else "") + ("too_short" if short else "too_long")
            raise _problem(loc, kind, f"{what} should have {word} {limit} {unit}{'' if limit == 1 else 's'}", value,
                           **{"min_length" if short else "max_length": limit})
    return value


def _within(value: float, loc: tuple[Any, ...], info: FieldInfo | None, given: Any = None) -> Any:
    """`value` inside the field's limits, or the problem naming the first it passes."""
    shown = value if given is None else given
    if info is not None:
        for limit, fails, kind, word in ((info.gt, lambda v, x: v <= x, "greater_than", "greater than"),
                                         (info.ge, lambda v, x: v < x, "greater_than_equal",
                                          "greater than or equal to"),
                                         (info.lt, lambda v, x: v >= x, "less_than", "less than"),
                                         (info.le, lambda v, x: v > x, "less_than_equal", "less than or equal to")):
            if limit is not None and fails(value, limit):
                key = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt",
                       "less_than_equal": "le"}[kind]
                raise _problem(loc, kind, f"Input should be {word} {limit}", shown, **{key: limit})
    return value
