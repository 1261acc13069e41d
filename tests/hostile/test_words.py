"""Nothing said that is not so, as a new user meets it: the doctor's claims within what it read (and
--strict failing a GPU node whose driver does not start, with the real CLI and the Slurm prolog), a lost
GPU said as lost, the runbook's files and the packaging's warnings, the demo's folder, a replay of a
folder of folders, and every generated sentence grammatical for 1 and many GPUs, ranks and seconds."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_engine
from tests.doctor.test_checks import UP, finding, node_tree, rank
from tests.stacks.test_analysis import LOADER, SAVE, WAIT, dumps
from watchdog.config import Config
from watchdog.detect.pauses import PauseMemory
from watchdog.detect.severity import judge
from watchdog.detect.summary import summarize
from watchdog.doctor.checks import examine
from watchdog.doctor.facts import Interface, gather
from watchdog.doctor.finding import ERROR, OK, UNKNOWN
from watchdog.doctor.text import render as render_doctor
from watchdog.export import report
from watchdog.sample import sim
from watchdog.sample.nvml_inventory import GpuFacts, Inventory
from watchdog.sample.ranks import HostActivity
from watchdog.stacks.analysis import analyze
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.model import (
    EventKind,
    Finding,
    GpuSample,
    NodeSnapshot,
    Progress,
    Severity,
    Signature,
    Verdict,
)

START = 1_767_225_600.0

# What a sentence must never say: a count of one with a plural noun, a plural subject with a singular verb
# and the other way round, "all 1", "for 0 s", an odd few spoken of as one.
UNGRAMMATICAL = [
    re.compile(r"\b1 (GPUs|ranks|processes|GPU pairs|pairs|links|bridges|ports|nodes|errors|warnings|seconds)\b"),
    re.compile(r"\bGPU \d+ (spin|wait|are|have|were)\b"),
    re.compile(r"\bGPUs \d+(?:(?:, |-)\d+)* (spins|waits|is|has|was)\b"),
    re.compile(r"\b[Aa]ll 1\b"),
    re.compile(r"\brank \d+ (wait|are|have|were)\b"),
    re.compile(r"\b1 (GPU|rank|process) (are|wait|spin|have)\b"),
    re.compile(r"\bfor 0 s\b"),
    re.compile(r"\ba 8\b|\ba 8-|\ba 11\b|\ba 18\b"),
    re.compile(r"\bodd ranks\b[^.]*\bon it\b"),
    re.compile(r"\bodd GPUs\b[^.]*\b(its|it is)\b"),
    re.compile(r"\(s\)"),
]


def grammar(text: str) -> list[str]:
    return [m.group(0) for pattern in UNGRAMMATICAL for m in pattern.finditer(text)]


# -- 1. the doctor: unknown is never ok; --strict fails a GPU node whose driver does not start ----------------
def no_driver() -> Inventory:
    raise RuntimeError("NVML Shared Library Not Found")


def nvidia_on_the_bus(sys_root: Path, bus: str = "0000:17:00.0", vendor: str = "0x10de",
                      pci_class: str = "0x030200") -> None:
    """A PCI function as Linux lists it: vendor and class files under /sys/bus/pci/devices/<bus>."""
    device = sys_root / "bus" / "pci" / "devices" / bus
    device.mkdir(parents=True, exist_ok=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(pci_class + "\n")


def test_a_job_check_whose_facts_were_not_read_is_unknown(tmp_path: Path) -> None:
    sys_root, proc_root = node_tree(tmp_path, [])
    facts = gather(no_driver, sys_root, proc_root, lambda: UP, dev_root=tmp_path / "dev")
    found = examine(facts, [rank({})])
    assert finding(found, "p2p").severity is UNKNOWN
    assert finding(found, "p2p_settings").severity is UNKNOWN, finding(found, "p2p_settings")
    assert "? " not in render_doctor(found, "t") or " ok   p2p_settings" not in render_doctor(found, "t")
    assert not [f for f in found if f.severity is OK and "GPU" in f.evidence]


def test_interfaces_not_read_make_the_interface_checks_unknown_not_an_error(tmp_path: Path) -> None:
    sys_root, proc_root = node_tree(tmp_path, [])

    def unreadable() -> list[Interface]:
        raise PermissionError(13, "Permission denied")

    facts = gather(no_driver, sys_root, proc_root, unreadable, dev_root=tmp_path / "dev")
    found = examine(facts, [rank({"NCCL_SOCKET_IFNAME": "eth0"})])
    assert finding(found, "socket_ifname").severity is UNKNOWN, finding(found, "socket_ifname")
    assert finding(found, "network").severity is UNKNOWN, finding(found, "network")


@pytest.mark.parametrize("seen_by", ["pci", "dev", "proc"])
def test_nvml_that_cannot_start_on_a_node_with_gpus_is_an_error(tmp_path: Path, seen_by: str) -> None:
    sys_root, proc_root = node_tree(tmp_path, [])
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    if seen_by == "pci":
        nvidia_on_the_bus(sys_root)
    elif seen_by == "dev":
        os.mknod(dev_root / "nvidia0", 0o666 | 0o020000, os.makedev(195, 0))  # a character device, as the driver's
        (dev_root / "nvidiactl").write_text("")  # not a GPU's node
    else:
        (proc_root / "driver" / "nvidia" / "gpus" / "0000:17:00.0").mkdir(parents=True)
    facts = gather(no_driver, sys_root, proc_root, lambda: UP, dev_root=dev_root)
    driver = finding(examine(facts), "driver")
    assert driver.severity is ERROR, driver
    assert "NVML Shared Library Not Found" in driver.evidence and "NVIDIA GPU" in driver.evidence and driver.fix


def test_a_node_without_an_nvidia_gpu_stays_unknown(tmp_path: Path) -> None:
    sys_root, proc_root = node_tree(tmp_path, [])
    nvidia_on_the_bus(sys_root, "0000:17:00.1", pci_class="0x040300")  # a GPU's HDMI audio function alone
    nvidia_on_the_bus(sys_root, "0000:03:00.0", vendor="0x1a03", pci_class="0x030000")  # a BMC's VGA
    nvidia_on_the_bus(sys_root, "0000:05:00.0", pci_class="0x068000")  # an NVSwitch
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia-uvm").write_text("")
    facts = gather(no_driver, sys_root, proc_root, lambda: UP, dev_root=dev)
    assert finding(examine(facts), "driver").severity is UNKNOWN


def in_a_node_with_an_nvidia_gpu_and_no_driver(command: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`command` in a mount namespace of its own whose /sys/bus/pci/devices lists one NVIDIA 3D controller and
    nothing else (this machine has no NVIDIA driver, so NVML cannot start): a GPU node with a broken driver."""
    script = tmp_path / "node.sh"
    script.write_text(
        "set -e\nmount -t tmpfs tmpfs /sys/bus/pci/devices\n"
        "mkdir /sys/bus/pci/devices/0000:17:00.0\n"
        "echo 0x10de > /sys/bus/pci/devices/0000:17:00.0/vendor\n"
        "echo 0x030200 > /sys/bus/pci/devices/0000:17:00.0/class\n"
        "set +e\n" + command + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "31337"}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", str(script)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_doctor_strict_and_the_prolog_fail_a_gpu_node_whose_driver_does_not_start(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    doctor = in_a_node_with_an_nvidia_gpu_and_no_driver(f"{sys.executable} -m watchdog doctor --strict", tmp_path)
    assert doctor.returncode == 4, doctor.stdout + doctor.stderr
    assert re.search(r"ERROR driver\s+NVML cannot start", doctor.stdout), doctor.stdout
    prolog = in_a_node_with_an_nvidia_gpu_and_no_driver(
        f"/bin/sh {REPO / 'deploy' / 'slurm' / 'prolog.sh'}", tmp_path)  # the stall-watchdog on PATH: this venv's
    assert prolog.returncode == 1, prolog.stderr
    assert "doctor found an error: draining" in prolog.stderr and "NVML cannot start" in prolog.stderr


# -- 2. a lost GPU is gpu_lost, said with true durations ---------------------------------------------------
def test_a_lost_gpu_is_gpu_lost_and_not_an_odd_gpu_the_job_waits_on() -> None:
    events = run_engine(sim.run(sim.SCENARIOS["gpu_lost"], start_seconds=START))
    texts = [e.summary for e in events]
    assert not [t for t in texts if "checkpoint or evaluation" in t], texts
    assert not [e for e in events if 5 in e.culprit_gpus], texts
    lost = [e for e in events if e.signature is Signature.GPU_LOST]
    assert lost[0].severity is Severity.CRITICAL and lost[0].gpus == (5,)
    assert "for 0 s" not in lost[0].summary and "GPU 5 stopped answering NVML" in lost[0].headline, lost[0]
    assert lost[0].summary.count("stopped answering NVML") == 1 and "drain the node" in lost[0].summary, lost[0]
    (hang,) = [e for e in events if e.signature is not Signature.GPU_LOST and e.event is EventKind.FIRED]
    assert hang.severity is Severity.CRITICAL and hang.gpus == (0, 1, 2, 3, 4, 6, 7), hang
    assert "GPU 5" in hang.summary and "lost" in hang.summary, hang.summary


def test_a_lost_gpu_that_comes_back_says_how_long_it_was_gone() -> None:
    scenario = dataclasses.replace(sim.SCENARIOS["gpu_lost"], timeline=sim.SCENARIOS["healthy"].timeline
                                   + ((300, (5,), "lost"), (320, (5,), "train")))
    events = run_engine(sim.run(scenario, start_seconds=START))
    (resolved,) = [e for e in events if e.event is EventKind.RESOLVED]
    assert "stopped answering NVML for 20 s" in resolved.summary, resolved.summary


# -- 3. the docs, the packaging, the demo's folder, replay of a folder of folders ---------------------------
def test_every_file_the_runbook_opens_is_one_a_bundle_holds() -> None:
    runbook = (REPO / "docs" / "runbook.md").read_text()
    named = set(re.findall(r"`([\w.-]+\.(?:txt|json|jsonl|html))`", runbook))
    bundle_files = set(re.findall(r"^\s{4}([\w.-]+\.(?:txt|json|jsonl|html))\b",
                                  (REPO / "watchdog" / "act" / "bundles.py").read_text(), re.M))
    assert "report.html" in bundle_files and "summary.json" in bundle_files
    assert named <= bundle_files, f"the runbook names files no bundle holds: {sorted(named - bundle_files)}"


def test_the_package_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    """What setuptools says while `make run` installs the package: nothing deprecated."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "watchdog", tmp_path / "watchdog", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "meta").mkdir()
    result = subprocess.run([sys.executable, "-W", "always", "-c", "import setuptools.build_meta as b; "
                             "b.prepare_metadata_for_build_wheel('meta')"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Deprecat" not in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    metadata = next((tmp_path / "meta").glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text()


def test_the_demo_says_where_its_folder_stays(tmp_path: Path) -> None:
    """A demo stopped early (here after a second) leaves its temporary folder and says so, with how to remove it."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run([sys.executable, "-m", "watchdog", "demo", "--duration-seconds", "1", "--port", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "TMPDIR": str(temp)})
    (folder,) = list(temp.iterdir())
    assert folder.name.startswith("stall-watchdog-demo-")
    assert f"the demo's files stay in {folder}" in result.stdout, result.stdout[-2000:]
    assert f"rm -r {folder}" in result.stdout


def test_replay_of_a_folder_reads_its_subfolders(tmp_path: Path) -> None:
    nested = tmp_path / "logs" / "node-a" / "day-1"
    nested.mkdir(parents=True)
    recorded = subprocess.run([sys.executable, "-m", "watchdog", "record", "--simulate", "spin_hang",
                               "--duration-seconds", "400", "--out", str(nested / "spin.jsonl")],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
    assert recorded.returncode == 0, recorded.stderr
    (tmp_path / "logs" / "top.txt").write_text("not a trace at all\n")
    result = subprocess.run([sys.executable, "-m", "watchdog", "replay", str(tmp_path / "logs" / "node-a"), "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert '"busy_spin"' in result.stdout


# -- 4. every sentence grammatical for 1 and many --------------------------------------------------------
GPU_SETS = {"one": ((3,), (3,)), "two": ((2, 5), (5,)), "many": (tuple(range(8)), (4, 6))}
FACTS: dict[str, float | str] = {"power_watts": 150.0, "power_limit_watts": 700.0, "idle_watts": 120.0,
                                 "culprit_state": "0% util, 56.0 GiB held", "memory_used_bytes": 6e10,
                                 "mean_utilization": 0.2, "window_seconds": 1800.0, "reasons": "hw_slowdown",
                                 "clock_ratio": 0.4, "temperature_celsius": 91.0, "errors": "GPU is lost"}


def findings_for(signature: Signature, gpus: tuple[int, ...], culprits: tuple[int, ...]) -> list[Finding]:
    facts = dict(FACTS)
    if signature is Signature.ZERO_UTIL and len(gpus) > 1:
        facts["spinning"] = str(gpus[0])
    if signature in (Signature.GPU_LOST, Signature.THROTTLE):
        gpus = gpus[:1]
    odd = culprits if signature is Signature.WAITING else ()
    return [Finding(signature, Severity.WARNING, gpus, 0.0, culprit_gpus=odd, facts=facts, progress=progress,
                    still_seconds=still) for progress, still in ((Progress.UNKNOWN, 0.0), (Progress.MOVING, 1.0),
                                                                (Progress.STILL, 61.0))]


@pytest.mark.parametrize("signature", list(Signature))
@pytest.mark.parametrize("size", list(GPU_SETS))
def test_each_signatures_headline_and_summary_are_grammatical(signature: Signature, size: str) -> None:
    gpus, culprits = GPU_SETS[size]
    config = Config()
    said = []
    for found in findings_for(signature, gpus, culprits):
        for seconds in (0.2, 1.0, 45.0, 61.0, 3 * 3600.0):
            judged = judge(found, 0.0, seconds, getattr(config.detectors, signature.value), config, None,
                           PauseMemory(), culprits_busy=seconds > 60)
            reason = judged.reason if judged else ""
            for severity in (Severity.WARNING, Severity.CRITICAL):
                said += list(summarize(found, seconds, severity, reason, unbroken_seconds=seconds / 2))
    assert said
    assert not {text: bad for text in said if (bad := grammar(text))}


def test_the_sentences_about_one_gpu_read_as_written() -> None:
    (spin, *_) = findings_for(Signature.BUSY_SPIN, (0,), ())
    head, _ = summarize(spin, 45.0, Severity.CRITICAL, "a collective that will not finish")
    assert head == "HANG (critical): GPU 0 spins at 100% util doing no work for 45 s"
    (wait, *_) = findings_for(Signature.WAITING, (2, 5), (5,))
    head, _ = summarize(wait, 45.0, Severity.WARNING)
    assert head == "WAITING (warning): GPU 2 waits on GPU 5 for 45 s"


@pytest.mark.parametrize("groups", [
    ((1, WAIT),), ((2, WAIT),), ((8, WAIT),), ((1, SAVE),), ((3, SAVE),), ((1, LOADER),),
    ((1, WAIT), (1, LOADER)), ((7, WAIT), (1, LOADER)), ((2, WAIT), (1, SAVE), (1, LOADER)),
    ((1, LOADER), (1, SAVE)), ((4, LOADER), (4, SAVE)), ((6, WAIT), (2, LOADER)),
])
def test_the_stacks_sentences_are_grammatical_for_one_and_many_ranks(groups: tuple[tuple[int, list], ...]) -> None:
    picture = dumps(*groups)
    analysis = analyze(picture)
    still = {d.member: HostActivity(cpu_seconds=0.0, read_bytes=0, write_bytes=0) for d in picture}
    busy = {d.member: HostActivity(cpu_seconds=5.0, read_bytes=0, write_bytes=1 << 20) for d in picture}
    said = []
    for host in (None, still, busy):
        for remote in (False, True):
            found = verdict(analysis, host, 1.0, spans_other_nodes=remote)
            said += [found.headline, found.sentence]
            for signature in (Signature.BUSY_SPIN, Signature.WAITING):
                (first, *_) = findings_for(signature, tuple(range(len(picture))) or (0,), (0,))
                said += list(summarize(first, 30.0, Severity.CRITICAL, "", stacks=Verdict(
                    found.kind, found.severity, found.sentence, found.headline)))
    assert not {text: bad for text in said if (bad := grammar(text))}


def test_the_doctors_sentences_are_grammatical_for_one_and_many(tmp_path: Path) -> None:
    said = []
    for count in (1, 8):
        tree = tmp_path / str(count)
        gpus = [GpuFacts(index=n, name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{n}", bus_id=f"0000:{0x10 + n:02x}:00.0",
                         persistence_mode=False, pcie_width=(8, 16), pcie_gen=(1, 5), nvlinks=(True, False))
                for n in range(count)]
        pairs = {(i, j): "chipset not supported" for i in range(count) for j in range(i + 1, count)}

        def inventory(gpus: list[GpuFacts] = gpus, pairs: dict[tuple[int, int], str] = pairs) -> Inventory:
            return Inventory(driver_version="550.54.15", nvml_version="12.550", cuda_driver_version="12.4", gpus=gpus,
                             p2p=pairs, topology={})

        sys_root, proc_root = node_tree(tree, [(g.bus_id, 0) for g in gpus], bridge_acs=0x001D, kernel="4.18.0",
                                        ib=[("1: DOWN", "3: Disabled")])
        facts = gather(inventory, sys_root, proc_root, lambda: UP, dev_root=tree / "dev")
        found = examine(facts, [rank({})])
        said += [f.evidence for f in found] + [render_doctor(found, "doctor")]
    assert not {text: bad for text in said if (bad := grammar(text))}


def snapshots(peak_utilization: float, peak_watts: float) -> list[NodeSnapshot]:
    return [NodeSnapshot(START + t, (GpuSample(index=0, utilization_ratio=min(t / 60, 1) * peak_utilization,
                                               power_watts=peak_watts * min(t / 60, 1), sm_clock_hertz=1.98e9),))
            for t in range(0, 120, 5)]


def axis_labels(page: str, field_name: str) -> list[float]:
    panel = page.split(f'data-field="{field_name}"', 1)[1].split("</svg>", 1)[0]
    return sorted(float(v) for v in re.findall(r'text-anchor="end">([\d.]+)</text>', panel))


@pytest.mark.parametrize(("utilization", "watts"), [(1.0, 700.0), (0.37, 143.0), (1.0, 61.0)])
def test_the_reports_axes_are_labelled_with_round_numbers(utilization: float, watts: float) -> None:
    page = report.render(report.ReportData("t", report.Drawn(snapshots(utilization, watts))))
    percent = axis_labels(page, "utilization_ratio")
    assert percent[-1] <= 100 and percent[-1] >= utilization * 100, percent
    for field_name, peak in (("utilization_ratio", utilization * 100), ("power_watts", watts)):
        labels = axis_labels(page, field_name)
        top = labels[-1]
        assert top >= peak and top < 2 * peak + 1, labels
        mantissa = top / 10 ** int(f"{top:e}".split("e")[1])
        assert mantissa in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8), labels
        assert all(float(v).is_integer() for v in labels), labels


def test_the_reports_heading_and_table_agree_on_how_long(tmp_path: Path) -> None:
    """A bundle's page after the episode resolved: the heading is the verdict as it fired (45 s in); the page
    says so, and the table shows both that and how long the episode lasted."""
    onset = START + 60
    episode = {"signature": "busy_spin", "severity": "critical", "onset": onset, "at": onset + 45,
               "end": onset + 370, "headline": "HANG (critical): GPUs 0-7 spin at 100% util doing no work for 45 s",
               "summary": "", "culprit_gpus": []}
    page = report.render(report.ReportData("t", report.Drawn(snapshots(1.0, 700.0)), [episode],
                                           verdict=episode["headline"], severity="critical",
                                           headline=episode["headline"]))
    text = re.sub(r"<[^>]+>", " ", page.split("<h2>Timeline", 1)[0] + page.split("<h2>Episodes", 1)[1])
    said = set(re.findall(r"\d+ min \d+ s|\d+ s\b", text))
    assert {"45 s", "6 min 10 s"} <= said, text
    assert re.search(r"45 s into the episode", text) and "lasted 6 min 10 s" in text, text


def test_a_name_is_left_as_it_is_only_when_nothing_in_it_needs_escaping() -> None:
    """one_line skips the translation for a name Python calls printable: every character it escapes must be
    unprintable, or a name holding one would pass through raw."""
    from watchdog.boundary.untrusted_data import CONTROL_ESCAPES, one_line

    assert not [hex(c) for c in CONTROL_ESCAPES if chr(c).isprintable()]
    for c in CONTROL_ESCAPES:
        assert chr(c) not in one_line(f"rank{chr(c)}3"), hex(c)
    assert one_line("train_step (megatron/training.py)") == "train_step (megatron/training.py)"
    assert one_line("日本語 ünïcode") == "日本語 ünïcode"
