"""What the daemon writes and reads as root: a bundle past its budget, many dumps at once, a link planted
where `report` writes, secrets that are FIFOs or empty, a configuration whose secrets `run` would refuse,
command lines full of credentials, alert text with markup."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.hostile.test_files import event, store
from watchdog.act.alerts import Alert
from watchdog.act.bundles import Incident
from watchdog.boundary import private_files, secrets
from watchdog.sample.ranks import REDACTED, redact_arguments
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import Severity, Signature


def test_a_bundle_past_its_budget_is_refused_before_it_reaches_the_disk(tmp_path: Path) -> None:
    bundles = store(tmp_path / "incidents", max_bundle_bytes=1 << 20)
    big = {"node": "n", "jobs": [{"ranks": ["x" * 1000] * 2000}]}  # about 2 MB of JSON
    assert bundles.write_dump("20260101T000000Z-dump-gpu0", big, []) is None
    assert bundles.disk_bytes() == 0 and not list((tmp_path / "incidents").iterdir())
    assert bundles.write_dump("20260101T000000Z-dump-gpu0", {"node": "n"}, []) is not None


def test_concurrent_dumps_each_get_their_bundle(tmp_path: Path) -> None:
    bundles = store(tmp_path / "incidents")
    written: list[Path | None] = []
    threads = [threading.Thread(target=lambda: written.append(
        bundles.write_dump("20260101T000000Z-dump-gpu0", {"node": "n", "payload": "x" * 100_000}, [])))
        for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert None not in written and len({str(p) for p in written}) == 20
    assert len(bundles.bundles()) == 20


def test_report_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    bundle = store(tmp_path / "incidents").write(Incident(event(1.9e9), []))
    assert bundle is not None
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (bundle / "report.html").unlink(missing_ok=True)
    (bundle / "report.html").symlink_to(victim)
    done = subprocess.run([sys.executable, "-m", "watchdog", "report", str(bundle)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "keep me" and not (bundle / "report.html").is_symlink()
    assert (bundle / "report.html").stat().st_mode & 0o777 == 0o600


def test_the_private_writer_refuses_links_and_existing_files(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        private_files.write_text(tmp_path / "link", "x")
    assert not (tmp_path / "elsewhere").exists()
    budget = private_files.Budget(10)
    private_files.write_text(tmp_path / "a", "12345", budget)
    with pytest.raises(private_files.OverBudget):
        private_files.write_text(tmp_path / "b", "123456", budget)
    assert not (tmp_path / "b").exists()


def test_secrets_are_regular_small_files(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").write_text("\n")
    for name, why in (("fifo", "not a regular file"), ("empty", "is empty"), ("missing", "cannot read")):
        with pytest.raises(secrets.SecretError, match=why) as caught:
            secrets.read_file(str(tmp_path / name), "dump.token_file")
        assert "dump.token_file" in str(caught.value)
    with pytest.raises(secrets.SecretError):
        secrets.read_file("/dev/zero", "x")


def test_check_config_reads_the_secrets_run_would_refuse(tmp_path: Path) -> None:
    (tmp_path / "url").write_text("hooks.example.com/T0KEN\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"alerts: {{receivers: [{{type: webhook, name: hook, url_file: '{tmp_path / 'url'}'}}]}}\n"
                      f"export: {{basic_auth_user: prom, basic_auth_password_file: '{tmp_path / 'nope'}'}}\n")
    done = subprocess.run([sys.executable, "-m", "watchdog", "check-config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "receiver hook: url_file: expected an http:// or https:// URL" in done.stderr
    assert "export.basic_auth_password_file" in done.stderr and "T0KEN" not in done.stderr


@pytest.mark.parametrize("argv", [
    ["--data", "s3://AKIA:SeCrEt@bucket/x"], ["--auth", "user:SeCrEt"], ["-p", "SeCrEt"],
    ["--wandb-key=SeCrEt"], ["--passphrase=SeCrEt"], ["--db", "postgres://u:SeCrEt@h/db"],
    ["--hf-token", "SeCrEt"], ["HF_TOKEN=SeCrEt"], ["--cache", "redis://:SeCrEt@h:6379/0"],
    ["--mysql-pwd=SeCrEt"], ["--bearer=SeCrEt"], ["--jwt=SeCrEt"], ["--signature=SeCrEt"],
    ["--cookie=session=SeCrEt"], ["-H", "Authorization: Bearer SeCrEt"], ["--header", "Cookie: a=SeCrEt"],
    ["--token:SeCrEt"], ["-pSeCrEt"], ["--db", "admin:SeCrEt@db.example:5432"],
])
def test_secret_arguments_are_redacted(argv: list[str]) -> None:
    kept = redact_arguments(["train.py", *argv, "--lr", "0.1"])
    assert "SeCrEt" not in " ".join(kept) and REDACTED in " ".join(kept) and kept[-2:] == ("--lr", "0.1")


def test_alert_text_carries_no_markup_a_rank_chose() -> None:
    alert = Alert("k", "firing", AlertIdentity(Signature.WAITING, "node-a", "run:<!here>"), Severity.CRITICAL, (0,),
                  (1,), "rank 1 idle in <!channel> <http://evil.example|docs> & co\x1b[2J", 0.0, 0.0,
                  culprit="GPU 1 (rank 1, pid 5) <@U123>")
    text = alert.text()
    assert "<" not in text and ">" not in text and "\x1b" not in text and "&lt;!channel&gt;" in text
    assert "&lt;!here&gt;" in text and "&lt;@U123&gt;" in text


def test_a_file_written_a_piece_at_a_time_stops_at_its_budget_and_leaves_nothing(tmp_path: Path) -> None:
    budget = private_files.Budget(100)
    private_files.write_text(tmp_path / "first", "x" * 40, budget)
    with pytest.raises(private_files.OverBudget), private_files.text_file(tmp_path / "piecewise", budget) as f:
        for _ in range(10):
            f.write("y" * 20)  # the fourth piece would pass the 100 bytes
    assert not (tmp_path / "piecewise").exists()
    assert budget.spent == 40  # what the removed file took is given back
    with private_files.text_file(tmp_path / "again", budget) as f:
        f.write("é" * 30)  # 60 bytes of UTF-8: the budget counts bytes, not characters
    assert (tmp_path / "again").read_text() == "é" * 30 and budget.spent == 100
    assert (tmp_path / "again").stat().st_mode & 0o777 == 0o600


def test_a_file_written_a_piece_at_a_time_never_opens_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "telemetry.jsonl").symlink_to(victim)
    with pytest.raises(FileExistsError), private_files.text_file(tmp_path / "telemetry.jsonl") as f:
        f.write("planted")
    assert victim.read_text() == "keep me" and (tmp_path / "telemetry.jsonl").is_symlink()
