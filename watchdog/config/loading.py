"""The whole configuration, and loading it: unknown keys rejected, every problem reported at once with its key
path, e.g. `config.yaml: detectors.busy_spin.for_seconds: expected a number > 0, got '30s'`; the example
file and the reference in docs/configuration.md generated from the model."""

from __future__ import annotations

import datetime
import math
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from watchdog.boundary.rank_files import RankFileError, read_given
from watchdog.config.actions import ActionsConfig
from watchdog.config.base import _EXCERPT, _SECRET_KEYS, MAX_DEPTH, MAX_DOCUMENT_BYTES, MAX_NODES, _Section
from watchdog.config.coordinator import CoordinatorConfig
from watchdog.config.detectors import DetectorsConfig
from watchdog.config.outputs import AlertsConfig, BundlesConfig, DumpConfig, ExportConfig
from watchdog.config.sampling import JobConfig, KubernetesConfig, SampleConfig, SourceConfig, StacksConfig
from watchdog.config.schema import FieldInfo, Section, ValidationError, model_validator


class Config(_Section):
    sample: SampleConfig = SampleConfig()
    source: SourceConfig = SourceConfig()
    job: JobConfig = JobConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    stacks: StacksConfig = StacksConfig()
    export: ExportConfig = ExportConfig()
    dump: DumpConfig = DumpConfig()
    bundles: BundlesConfig = BundlesConfig()
    alerts: AlertsConfig = AlertsConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    actions: ActionsConfig = ActionsConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()

    @model_validator(mode="after")
    def _actions_can_see_ranks(self) -> Config:
        if self.actions.mode != "observe" and not self.bundles.capture_stacks:
            raise ValueError(f"actions.mode is {self.actions.mode} but bundles.capture_stacks is off: no rank would "
                             "ever be seen, so nothing would ever be done (turn capture_stacks on, or mode observe)")
        return self


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds one 'key.path: what is wrong' line each."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _valid_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys of the section at `loc`, through lists and optional sections (alerts.receivers.0 is a
    receiver)."""
    model: type[Section] = Config
    for part in loc:
        if isinstance(part, int):
            continue  # an item of the list the previous part named: `model` is already its type
        field_info = model.model_fields.get(str(part))
        inner = _section_type(field_info.annotation) if field_info is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _section_type(annotation: object) -> type[Section] | None:
    """The configuration section an annotation holds: itself, or the model inside list[...] or X | None."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for inner in typing.get_args(annotation):
        found = _section_type(inner)
        if found is not None:
            return found
    return None


MAX_PROBLEMS = 20  # said of one document; a file of 5,000 unknown keys is one mistake


def _excerpt(value: object) -> str:
    """A value as the document wrote it: true, null, 2024-01-01, 'text' (quoted, so that spaces show)."""
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, (datetime.date, datetime.datetime)):
        text = value.isoformat()
    else:
        text = repr(value)
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + f"... ({len(text)} characters)"


def _yaml_text_hint(given: object, whole: bool) -> str:
    """Where YAML read a number as text, how to write the number given: 1e9 is text to YAML 1.1, which wants a
    dot and a signed exponent (1.0e+9); '30' in quotes is text too."""
    if not isinstance(given, str):
        return ""
    try:
        number = float(given)
    except ValueError:
        return ""
    if not math.isfinite(number) or not any(c.isdigit() for c in given):
        return ""
    if "e" not in given.lower():
        return " (quoted: leave the quotes out)"
    if whole and number.is_integer():
        return f" (text to YAML: write it as {int(number)})"
    mantissa, e, exponent = f"{number:.15g}".partition("e")
    return f" (text to YAML: write it as {mantissa}{'' if '.' in mantissa else '.0'}{e}{exponent})"


def _where(loc: tuple[Any, ...]) -> str:
    """The key path of a problem: detectors.busy_spin.for_seconds; a mapping's key as source.pids (key 'x')."""
    if len(loc) >= 2 and loc[-1] == "[key]":
        return f"{'.'.join(map(str, loc[:-2]))} (key {_excerpt(loc[-2])})"
    return ".".join(str(part) for part in loc) or "(top level)"


def _describe(error: dict[str, Any]) -> str:
    path = _where(error["loc"])
    kind = error["type"]
    given = error.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown key; valid keys here: {', '.join(_valid_keys(error['loc'][:-1]))}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        limit = next(iter(error.get("ctx", {}).values()))
        limit = str(limit) if isinstance(limit, int) else f"{limit:g}"  # 1048576, not 1.04858e+06
        return f"{path}: expected a number {op} {limit}, got {_excerpt(given)}"
    if kind in ("float_parsing", "float_type", "int_parsing", "int_type", "int_from_float"):
        whole = "a whole number" if kind.startswith("int") else "a number"
        unit = " of seconds" if path.endswith("_seconds") else ""
        return f"{path}: expected {whole}{unit}, got {_excerpt(given)}{_yaml_text_hint(given, kind.startswith('int'))}"
    if kind in ("bool_parsing", "bool_type"):
        return f"{path}: expected true or false, got {_excerpt(given)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if given is None:  # `bundles:` with nothing under it
            return f"{path}: empty; give its keys under it, or leave it out for its defaults"
        return f"{path}: expected a mapping of keys, got {type(given).__name__}"
    message = error["msg"].removeprefix("Value error, ")
    # A whole section, or a value that may carry a secret (a URL with a key in it): the message names the
    # problem, never the value.
    key = str(error["loc"][-1] if error["loc"] else "")
    if isinstance(given, (dict, list)) or any(key == word or key.endswith("_" + word) for word in _SECRET_KEYS):
        return f"{path}: {message[0].lower()}{message[1:]}"
    return f"{path}: {message[0].lower()}{message[1:]}, got {_excerpt(given)}"


def parse_config(data: object, source: str = "config") -> Config:
    _check_size(data, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(top level): expected a mapping of sections, got {type(data).__name__}"])
    try:
        return Config.model_validate(data)  # strict (config/base.py): a number is a number, never "30" or true
    except ValidationError as exc:
        problems = [_describe(e) for e in exc.errors()]
        more = len(problems) - MAX_PROBLEMS
        raise ConfigError(source, problems[:MAX_PROBLEMS] + ([f"and {more} more problems"] if more > 0 else [])
                          ) from None


def load_config(path: str | Path | None) -> Config:
    """The defaults when path is None; otherwise the YAML file, validated. Every problem, whatever the
    file holds (bytes that are not UTF-8, a YAML alias bomb, a document 3000 levels deep), is a
    ConfigError: `check-config` reports it and a reload rejects it, exactly as `run` would."""
    if path is None:
        return Config()
    source = str(path)
    try:  # non-blocking, a regular file only: a FIFO or a device named as the configuration is an error, not a wait
        raw = read_given(path, MAX_DOCUMENT_BYTES, timeout_seconds=10.0)
    except RankFileError as exc:
        message = str(exc).removeprefix(f"{path}: ")
        if "-byte cap" in message:
            message = f"larger than {MAX_DOCUMENT_BYTES // 1024} KiB: not a configuration"
        elif not message.startswith(("cannot read", "not a regular")):
            message = f"cannot read: {message}"
        raise ConfigError(source, [message]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [f"byte {exc.start}: not UTF-8 text"]) from None
    try:
        data = yaml.load(text, Loader=_OnceEachLoader)  # noqa: S506  # a SafeLoader that refuses a key given twice
    except _KeyTwice as exc:
        raise ConfigError(source, [str(exc)]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, most control characters)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(source, [f"byte {exc.position}: not valid YAML (character U+{code:04X} is not allowed)"]
                          ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or "unreadable")
        shown = problem if len(problem) <= 2 * _EXCERPT else problem[:2 * _EXCERPT] + "..."
        raise ConfigError(source, [f"{where}not valid YAML ({shown})"]) from None
    except RecursionError:
        raise ConfigError(source, [f"nested deeper than {MAX_DEPTH} levels"]) from None
    return parse_config(data, source)  # which checks the size before anything walks the document


class _KeyTwice(yaml.YAMLError):
    """A mapping that names a key twice: YAML keeps the last and drops the first without a word."""


class _OnceEachLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that gives a key twice ('sample:' twice dropped the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[object, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in first:
                    raise _KeyTwice(f"line {key_node.start_mark.line + 1}: {_excerpt(key)} given twice (first on "
                                    f"line {first[key] + 1}): YAML would keep the last without a word")
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _check_size(data: object, source: str) -> None:
    """Refuse documents whose values, with every alias expanded, exceed MAX_NODES or MAX_DEPTH, before
    anything walks them (a 'billion laughs' document is a few lines that expand to billions of values)."""
    count = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(source, [f"more than {MAX_NODES} values (aliases expanded): not a configuration"])
        if depth > MAX_DEPTH:
            raise ConfigError(source, [f"nested deeper than {MAX_DEPTH} levels"])
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _keys(model: Section, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Section | None,
                                                                        str, str]]:
    """Every key of the configuration in order, depth first: (path, section or None for a leaf,
    the section's first doc line or the leaf's description, the leaf's default as flow YAML)."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, Section):
            doc = (type(value).__doc__ or "").strip().splitlines()
            yield (*path, name), value, doc[0] if doc else "", ""
            yield from _keys(value, (*path, name))
        else:
            shown = yaml.safe_dump(value, default_flow_style=True, width=4096).strip().removesuffix("...").strip()
            yield (*path, name), None, info.description or "", shown


def example_yaml() -> str:
    """config.example.yaml: every key at its default, each with its description. A test keeps the
    checked-in file identical to this, so the documented defaults cannot drift from the code."""
    lines = [
        "# stall-watchdog configuration: every key at its default.",
        "# Validate with: stall-watchdog check-config FILE",
        "# Units are in the key names: _seconds, _ratio (0-1), _bytes, _multiple.",
    ]
    for path, section, doc, shown in _keys(Config()):
        indent = "  " * (len(path) - 1)
        if doc:
            lines.append(f"{indent}# {doc}")
        lines.append(f"{indent}{path[-1]}:" if section is not None else f"{indent}{path[-1]}: {shown}")
    lines += [
        "# Receivers, for example (secrets from files or the environment, never in this file):",
        "#   receivers:",
        "#     - {type: alertmanager, name: am, url: 'http://alertmanager:9093'}",
        "#     - {type: webhook, name: slack, url_file: /etc/stall-watchdog/slack-url}",
        "#     - {type: command, name: page, argv: [/usr/local/bin/page-oncall, --team, ml-infra]}",
        "#     - {type: coordinator, name: coordinator, url: 'http://coordinator:9945',",
        "#        token_file: /etc/stall-watchdog/coordinator-token}",
    ]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The configuration reference of docs/configuration.md: every key, its default and meaning, from the model."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for path, section, doc, shown in _keys(Config()):
        if section is not None:
            continue
        rows.append(f"| `{'.'.join(path)}` | `{shown}` | {doc.replace('|', '/')} |")
        item = _section_type(_field_at(path).annotation)
        for name, info in (item.model_fields.items() if item is not None else ()):  # each item's keys, as a list's
            default = "required" if info.is_required() else yaml.safe_dump(
                info.default, default_flow_style=True, width=4096).strip().removesuffix("...").strip()
            rows.append(f"| `{'.'.join(path)}[].{name}` | `{default}` | {(info.description or '').replace('|', '/')} |")
    return "\n".join(rows)


def _field_at(path: tuple[str, ...]) -> FieldInfo:
    """The field a key path names, from the top of the configuration."""
    model: type[Section] = Config
    for part in path[:-1]:
        inner = _section_type(model.model_fields[part].annotation)
        assert inner is not None
        model = inner
    return model.model_fields[path[-1]]
