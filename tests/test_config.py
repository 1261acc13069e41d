from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from watchdog.config import Config, ConfigError, example_yaml, load_config, parse_config


def test_example_file_is_generated_from_the_defaults() -> None:
    checked_in = (REPO / "config.example.yaml").read_text()
    assert checked_in == example_yaml(), "regenerate it: make docs"
    assert load_config(REPO / "config.example.yaml") == Config()


def test_readme_reference_is_generated_from_the_model() -> None:
    from watchdog.config import reference_markdown

    assert reference_markdown() in (REPO / "docs" / "configuration.md").read_text(), "regenerate it: make docs"


def test_every_leaf_key_is_documented_in_the_example() -> None:
    text = example_yaml()
    for section in ("busy_spin", "zero_util", "waiting", "underuse", "throttle", "gpu_lost"):
        for key in type(getattr(Config().detectors, section)).model_fields:
            assert f"    {key}:" in text, f"detectors.{section}.{key} missing from the example"


@pytest.mark.parametrize(("data", "expected"), [
    ({"detectors": {"busy_spin": {"for_seconds": "30s"}}},
     "detectors.busy_spin.for_seconds: expected a number of seconds, got '30s'"),
    ({"detectors": {"busy_spin": {"for_seconds": -1}}},
     "detectors.busy_spin.for_seconds: expected a number >= 0, got -1"),
    ({"detectors": {"waiting": {"critical_after_seconds": 0}}},
     "detectors.waiting.critical_after_seconds: expected a number > 0, got 0"),
    ({"detectors": {"busy_spin": {"utilization_min_ratio": 99}}},
     "detectors.busy_spin.utilization_min_ratio: expected a number <= 1, got 99"),
    ({"detectors": {"busy_spin": {"min_legs": 1.5}}},
     "detectors.busy_spin.min_legs: expected a whole number, got 1.5"),
    ({"stacks": {"sample_rate_hz": 12.5}},  # py-spy's --rate takes whole numbers: 12.5 would stop every record
     "stacks.sample_rate_hz: expected a whole number, got 12.5"),
    ({"detectors": {"busy_spn": {}}},
     "detectors.busy_spn: unknown key; valid keys here: busy_spin, zero_util, waiting, underuse, throttle, gpu_lost"),
    ({"sample": {"interval_seconds": 1, "bogus": 2}}, "sample.bogus: unknown key; valid keys here:"),
    ({"job": 3}, "job: expected a mapping of keys, got int"),
    ({"bundles": {"max_bundle_bytes": 100}},  # a whole-number limit as written: it said 1.04858e+06
     "bundles.max_bundle_bytes: expected a number >= 1048576, got 100"),
    ({"bundles": {"max_total_bytes": 1000}},  # accepted, and then no bundle was ever kept
     "bundles.max_total_bytes: expected 0 (no disk budget) or at least 1048576"),
    ({"bundles": {"telemetry_window_seconds": 7 * 86400}},  # accepted: 3.4 GB of memory at 64 GPUs
     "bundles.telemetry_window_seconds: expected a number <= 3600, got 604800"),
    ({"bundles": None}, "bundles: empty; give its keys under it, or leave it out for its defaults"),  # 'NoneType'
    ({"bundles": {"directory": ""}}, "bundles.directory: string should have at least 1 character"),
    ({"sample": {"interval_seconds": "1e9"}},  # YAML 1.1 reads 1e9 as text
     "sample.interval_seconds: expected a number of seconds, got '1e9' (text to YAML: write it as 1000000000"),
    ({"detectors": {"gpu_lost": {"enabled": "maybe"}}}, "detectors.gpu_lost.enabled: expected true or false"),
])
def test_problems_name_the_key_path(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "config.yaml")
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems
    assert str(info.value).startswith("config.yaml: ")


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"detectors": {"busy_spin": {"for_seconds": "x", "window_seconds": 0}, "nope": 1}})
    assert len(info.value.problems) == 3


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("detectors:\n  busy_spin:\n    for_seconds: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "line " in info.value.problems[0] and "not valid YAML" in info.value.problems[0]


def test_missing_file_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == Config()


def test_overrides_apply_and_defaults_stay() -> None:
    config = parse_config({"detectors": {"waiting": {"critical_after_seconds": 60}}})
    assert config.detectors.waiting.critical_after_seconds == 60
    assert config.detectors.busy_spin == Config().detectors.busy_spin


def test_the_old_names_of_the_node_label_still_read(caplog: pytest.LogCaptureFixture) -> None:
    """alerts.instance became alerts.node (Prometheus's `instance` is the scrape address): an old config
    still starts, and says what to write instead."""
    caplog.set_level(logging.WARNING, logger="stall_watchdog")
    config = parse_config({"alerts": {"instance_env": "NODE_NAME"}})
    assert config.alerts.node_env == "NODE_NAME" and config.alerts.node is None
    assert "key=alerts.instance_env use=alerts.node_env" in caplog.text
    with pytest.raises(ConfigError, match="give node or node_env, not both"):
        parse_config({"alerts": {"instance": "a", "node_env": "NODE_NAME"}})


def test_every_generated_file_is_up_to_date() -> None:
    """`make docs` (tools/docs.py) regenerates what is made from a fact kept elsewhere; --check says what is stale."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "docs.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_readme_says_each_telemetry_only_wait_as_the_config_sets_it() -> None:
    """One truth per fact: when a pause or a wait seen on telemetry alone turns critical is said in the README's
    opening, in the zero_util bullet and in the episode table; each figure is read here from the configuration
    (the README once said 9 minutes, 10 minutes and, in replay, 15 for the same thing)."""
    import re

    from watchdog.config import Config

    readme = (REPO / "README.md").read_text()
    page = (REPO / "docs" / "how-it-works.md").read_text()
    detectors = Config().detectors
    zero = detectors.zero_util.critical_after_seconds / 60
    idle, busy = detectors.waiting.critical_after_seconds / 60, detectors.waiting.critical_after_busy_seconds / 60
    opening = readme[:readme.index("## ")]
    assert f"(at most {zero:g} minutes)" in opening
    bullet = page[page.index("- **zero_util**"):page.index("- **waiting**")]
    said = [float(n) for n in re.findall(r"(\d+) minutes", bullet)]
    assert said == [zero], said
    assert f"({idle:g} min; `critical_after_busy_seconds`, {busy:g} min," in page
    for doc in (readme, *(p.read_text() for p in (REPO / "docs").glob("*.md"))):
        assert "within 10 minutes" not in doc


@pytest.mark.parametrize(("data", "expected"), [
    ({"source": {"kind": "gpu"}}, ["source.kind: input should be 'nvml' or 'sim', got 'gpu'"]),
    ({"alerts": {"receivers": [{"name": "x"}]}}, ["alerts.receivers.0.type: field required"]),
    ({"coordinator": {"allow_nodes": ["a"] * 1025}}, ["coordinator.allow_nodes: list should have at most 1024 items"]),
    ({"coordinator": {"kubernetes": {"job_labels": []}}},
     ["coordinator.kubernetes.job_labels: list should have at least 1 item"]),
    ({"actions": {"slurm": {"drain_reason_prefix": "x" * 41}}},
     [f"actions.slurm.drain_reason_prefix: string should have at most 40 characters, got '{'x' * 41}'"]),
    ({"source": {"pids": {"a": 1}}},  # the key and the value, each said
     ["source.pids (key 'a'): expected a whole number, got 'a'", "source.pids.a: input should be a valid list, got 1"]),
    ({"sample": {"interval_seconds": float("inf")}},
     ["sample.interval_seconds: input should be a finite number, got inf"]),
    ({"stacks": {"native": 1}}, ["stacks.native: expected true or false, got 1"]),
])
def test_each_problem_of_a_kind_is_said_once_with_its_path(data: dict[str, object], expected: list[str]) -> None:
    """The configuration's own schema (config/schema.py) against the problems its kinds and limits can have."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, "config.yaml")
    assert info.value.problems == expected


def test_a_section_is_frozen_compared_by_value_and_copied_with_changes() -> None:
    from watchdog.config import StacksConfig

    config = parse_config({"source": {"pids": {"0": [10], 1: [11]}}, "sample": {"interval_seconds": 2}})
    assert config.source.pids == {0: [10], 1: [11]}  # a GPU's index as JSON writes a key, or as YAML does
    assert config.sample.interval_seconds == 2.0 and isinstance(config.sample.interval_seconds, float)
    with pytest.raises(AttributeError, match="frozen"):
        config.sample.interval_seconds = 3.0  # type: ignore[misc]
    assert config == parse_config(config.model_dump()) and hash(parse_config({}).sample) == hash(Config().sample)
    copied = config.stacks.model_copy(update={"native": True})
    assert copied.native and not config.stacks.native and copied.timeout_seconds == config.stacks.timeout_seconds
    assert StacksConfig(native=True) == copied and StacksConfig() != copied
    assert StacksConfig.model_fields["max_parallel"].default == 16 and not StacksConfig.model_fields[
        "max_parallel"].is_required()


def test_a_key_given_twice_is_a_problem_not_the_last_one_kept(tmp_path: Path) -> None:
    """YAML keeps the last of two keys without a word: 'sample:' given twice dropped its first half."""
    for text, said in (("sample: {interval_seconds: 1}\nsample: {interval_seconds: 2}\n",
                        "line 2: 'sample' given twice (first on line 1)"),
                       ("sample: {interval_seconds: 1, interval_seconds: 2}\n",
                        "line 1: 'interval_seconds' given twice (first on line 1)"),
                       ("a: \x00\n", "byte 3: not valid YAML (character U+0000 is not allowed)")):
        path = tmp_path / "twice.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert info.value.problems[0].startswith(said), info.value.problems
    path.write_text("base: &b {interval_seconds: 2}\n")  # anchors and merges still read
    with pytest.raises(ConfigError, match="base: unknown key"):
        load_config(path)


@pytest.mark.parametrize(("data", "expected"), [
    ({"sample": {"interval_seconds": "1e-9"}},  # it said 'write it as 1000000000 or 1.0e+9' for any value
     "sample.interval_seconds: expected a number of seconds, got '1e-9' (text to YAML: write it as 1.0e-09)"),
    ({"bundles": {"max_count": "1e3"}}, "bundles.max_count: expected a whole number, got '1e3' (text to YAML: write "
                                        "it as 1000)"),
    ({"detectors": {"busy_spin": {"for_seconds": "1e999"}}},
     "detectors.busy_spin.for_seconds: expected a number of seconds, got '1e999'"),
    ({"detectors": {"busy_spin": {"enabled": None}}}, "detectors.busy_spin.enabled: expected true or false, got null"),
    ({"stacks": {"max_parallel": True}}, "stacks.max_parallel: expected a whole number, got true"),
    ({"source": {"pids": {"x": [1]}}}, "source.pids (key 'x'): expected a whole number, got 'x'"),
    ({"alerts": {"runbook_url": "javascript:alert(1)"}}, "alerts.runbook_url: expected an http:// or https:// URL"),
    ({"alerts": {"receivers": [{"type": "webhook", "name": "a", "url": "http://x", "argv": ["ls"]}]}},
     "alerts.receivers.0: receiver 'a': argv is for a command receiver"),
    ({"alerts": {"receivers": [{"type": "webhook", "name": "b", "url": "http://x"},
                               {"type": "webhook", "name": "b", "url": "http://y"}]}},
     "alerts: receivers named twice: 'b'"),
    ({"alerts": {"receivers": [{"type": "webhook", "name": "", "url": "http://x"}]}},
     "alerts.receivers.0.name: string should have at least 1 character"),
])
def test_problems_say_what_was_written(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "config.yaml")
    assert info.value.problems[0] == expected or info.value.problems[0].startswith(expected), info.value.problems


def test_a_document_of_many_problems_says_twenty() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"sample": {f"k{n}": 1 for n in range(5000)}})
    assert len(info.value.problems) == 21 and info.value.problems[-1] == "and 4980 more problems"


def test_each_configuration_holds_lists_of_its_own_and_hashes() -> None:
    """The defaults' lists were one object in every configuration: appending to one changed the next loaded."""
    from watchdog.config import SampleConfig
    from watchdog.config.schema import ValidationError

    a, b = Config(), parse_config({})
    assert a.actions.do is not b.actions.do and a.alerts.receivers is not b.alerts.receivers
    a.alerts.receivers.append("junk")  # type: ignore[arg-type]
    assert parse_config({}).alerts.receivers == [] and hash(b) == hash(Config())
    with pytest.raises(ValidationError, match="1 problem: sample.interval_seconds: Input should be a valid number"):
        Config(sample={"interval_seconds": "x"})
    with pytest.raises(ValidationError, match="interval_seconds"):
        SampleConfig().model_copy(update={"interval_seconds": -5})
    with pytest.raises(ValidationError, match="bogus"):
        SampleConfig().model_copy(update={"bogus": 1})
