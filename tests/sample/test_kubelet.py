"""The kubelet pod-resources client against a real gRPC server speaking the kubelet's proto on a unix
socket: the pod holding each GPU, time-sliced and shared GPUs, a kubelet that fails or hangs, and
answers that are not protobuf at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes.podresources import KubeletServer, generated
from tests.users import asleep
from watchdog.sample.kubelet import KubeletError, PodContainer, PodDirectory, PodResourcesClient, parse_list
from watchdog.sample.ranks import RankDiscovery
from watchdog.vocabulary.model import GpuSample, NodeSnapshot, Workload

UUID = [f"GPU-{n:08x}-aaaa-bbbb-cccc-{n:012x}" for n in range(8)]
PODS = [
    ("ml", "trainer-0", [("main", [("nvidia.com/gpu", UUID[0:4])]), ("sidecar", [])]),
    ("ml", "trainer-1", [("main", [("nvidia.com/gpu", UUID[4:6])])]),
    ("team-b", "notebook", [("jupyter", [("nvidia.com/gpu", [f"{UUID[6]}::0"])]),
                            ("other", [("nvidia.com/gpu", [f"{UUID[7]}::1"])])]),
    ("team-c", "shared", [("a", [("nvidia.com/gpu", [f"{UUID[7]}::2"])])]),
    ("kube-system", "no-gpu", [("pause", [("example.com/nic", ["nic0"])])]),
]


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # A unix socket path is limited to 108 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="kubelet-") as folder:
        yield Path(folder) / "kubelet.sock"


def test_the_client_reads_the_kubelets_answer_on_the_real_wire_format(socket_path: Path) -> None:
    with KubeletServer(socket_path, PODS):
        listing = PodResourcesClient(str(socket_path)).list()
    holders = {(c.namespace, c.pod, c.container): devices for c, devices in listing}
    assert holders[("ml", "trainer-0", "main")] == tuple(UUID[0:4])
    assert holders[("ml", "trainer-1", "main")] == tuple(UUID[4:6])
    assert holders[("kube-system", "no-gpu", "pause")] == ("nic0",)
    assert ("ml", "trainer-0", "sidecar") not in holders  # a container with no device lists none
    assert {c.resource for c, _ in listing} == {"nvidia.com/gpu", "example.com/nic"}


def test_the_directory_names_the_one_container_holding_a_gpu(socket_path: Path) -> None:
    with KubeletServer(socket_path, PODS):
        directory = PodDirectory(PodResourcesClient(str(socket_path)))
        assert directory.refresh()
    assert directory.holder([UUID[1]]) == PodContainer("ml", "trainer-0", "main", "nvidia.com/gpu")
    assert directory.holder(UUID[0:4]) == PodContainer("ml", "trainer-0", "main", "nvidia.com/gpu")
    assert directory.holder([UUID[6]]) == PodContainer("team-b", "notebook", "jupyter", "nvidia.com/gpu")  # time-sliced
    assert directory.holder([UUID[7]]) is None  # shared by two pods: naming one would be a guess
    assert directory.holder([UUID[3], UUID[4]]) is None  # a rank across two pods' GPUs: no single pod
    assert directory.holder(["GPU-unknown"]) is None
    assert directory.holder([]) is None


def test_a_failing_kubelet_is_reported_once_and_the_last_answer_kept(socket_path: Path) -> None:
    errors: list[str] = []
    oks: list[int] = []
    with KubeletServer(socket_path, PODS) as server:
        directory = PodDirectory(PodResourcesClient(str(socket_path)), on_error=errors.append, on_ok=oks.append)
        assert directory.refresh()
        server.fail = True
        assert not directory.refresh() and not directory.refresh()
        assert directory.holder([UUID[0]]) is not None  # the last good answer stays
        server.fail = False
        assert directory.refresh()
    assert len(errors) == 1 and "UNAVAILABLE" in errors[0] and "kubelet restarting" in errors[0]
    assert oks == [8, 8]  # 8 devices (the shared GPU names no one): the first answer, then the one after the failure


def test_a_hung_kubelet_costs_its_timeout_not_more(socket_path: Path) -> None:
    with KubeletServer(socket_path, PODS) as server:
        server.delay = 5.0
        client = PodResourcesClient(str(socket_path), timeout_seconds=0.5)
        with pytest.raises(KubeletError, match="DEADLINE_EXCEEDED"):  # its own deadline ended it, not the answer
            client.list()
        client.close()


def test_no_socket_is_a_clear_error(socket_path: Path) -> None:
    with pytest.raises(KubeletError, match="no such socket"):
        PodResourcesClient(str(socket_path)).list()


def test_the_thread_asks_again_when_a_new_gpu_is_not_named(socket_path: Path) -> None:
    with KubeletServer(socket_path, PODS[:1]) as server:
        directory = PodDirectory(PodResourcesClient(str(socket_path)), refresh_seconds=3600)
        directory.start()
        try:
            deadline = time.monotonic() + 60
            while not directory.answered and time.monotonic() < deadline:
                time.sleep(0.05)
            assert directory.holder([UUID[4]]) is None  # trainer-1 is not there yet: a miss asks again
            server.pods = PODS
            while directory.holder([UUID[4]]) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert directory.holder([UUID[4]]) == PodContainer("ml", "trainer-1", "main", "nvidia.com/gpu")
            assert server.calls <= 4  # asked again on the miss, at most once a second, not on every lookup
            asked = server.calls
            for _ in range(25):  # a GPU no pod holds: asked about once, then left to the regular refresh
                assert directory.holder(["GPU-no-pod"]) is None
                time.sleep(0.1)
            assert server.calls - asked <= 1
        finally:
            directory.close()


def test_a_real_rank_is_named_by_the_pod_holding_its_gpu(socket_path: Path) -> None:
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "3"}
    with asleep(env) as rank:
        with KubeletServer(socket_path, PODS):
            directory = PodDirectory(PodResourcesClient(str(socket_path)))
            directory.refresh()
        discovery = RankDiscovery(pods=directory)
        snapshot = NodeSnapshot(0.0, (GpuSample(index=5, uuid=UUID[5], pids=(rank.pid,)),))
        [info] = discovery.from_snapshot(snapshot)
    assert info.workload == Workload("ml", "trainer-1", "main", "777", "3", None)
    assert info.workload.describe() == ("pod ml/trainer-1 (container main), Slurm job 777 step 3 "
                                        "(as its environment says)")


def test_the_generated_message_round_trips_through_our_decoder() -> None:
    pb2, _ = generated()
    answer = pb2.ListPodResourcesResponse()
    pod = answer.pod_resources.add(name="p" * 300, namespace="ns")
    pod.containers.add(name="c").devices.add(resource_name="r", device_ids=["GPU-1", "GPU-2"])
    [(holder, devices)] = parse_list(answer.SerializeToString())
    assert holder == PodContainer("ns", "p" * 300, "c", "r") and devices == ("GPU-1", "GPU-2")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_fail_with_a_kubelet_error(raw: bytes) -> None:
    with contextlib.suppress(KubeletError):  # any other exception fails the test
        parse_list(raw)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=60), st.integers(min_value=0, max_value=59))
def test_a_cut_answer_fails_cleanly(tail: bytes, cut: int) -> None:
    pb2, _ = generated()
    answer = pb2.ListPodResourcesResponse()
    answer.pod_resources.add(name="trainer", namespace="ml").containers.add(name="main").devices.add(
        resource_name="nvidia.com/gpu", device_ids=[UUID[0]])
    raw = answer.SerializeToString() + tail
    with contextlib.suppress(KubeletError):
        parse_list(raw[:cut] if cut < len(raw) else raw)


def test_rank_labels_are_kept_until_the_processes_or_the_kubelets_answer_change(socket_path: Path) -> None:
    """The labels of a tick with the same processes on the same GPUs are the last tick's (no process described
    again); a new answer from the kubelet, or a pid whose start changed (another process), is read afresh."""
    from watchdog.plumbing.counters import Counters
    from watchdog.sample.rank_labels import RankLabels

    with asleep({**os.environ, "RANK": "1"}) as rank, KubeletServer(socket_path, PODS[:1]) as server:
        directory = PodDirectory(PodResourcesClient(str(socket_path)))
        assert directory.refresh()
        discovery = RankDiscovery(pods=directory)
        described: list[int] = []
        describe = discovery.describe

        def counted(pid: int, *args: object, **kwargs: object) -> object:
            described.append(pid)
            return describe(pid, *args, **kwargs)  # type: ignore[arg-type]

        discovery.describe = counted  # type: ignore[method-assign]
        starts = {rank.pid: 100}
        labels = RankLabels(discovery, starts.get, Counters(["component_errors_total"]))
        snapshot = NodeSnapshot(0.0, (GpuSample(index=5, uuid=UUID[5], pids=(rank.pid,)),))
        [first] = labels.of(snapshot)
        assert first.rank == 1 and first.workload.pod is None  # trainer-1 is not in the answer yet
        assert labels.of(snapshot) == [first] and described == [rank.pid]
        server.pods = PODS
        assert directory.refresh()
        [second] = labels.of(snapshot)
        assert second.workload.pod == "trainer-1" and described == [rank.pid]
        starts[rank.pid] = 200  # the pid is another process's now
        assert labels.of(snapshot) == [second] and described == [rank.pid, rank.pid]
        moved = NodeSnapshot(1.0, (GpuSample(index=4, uuid=UUID[4], pids=(rank.pid,)),))
        [third] = labels.of(moved)
        assert third.gpu == 4 and third.workload.pod == "trainer-1"


def test_settle_waits_for_the_first_answer_and_for_a_pod_that_just_started(socket_path: Path) -> None:
    with KubeletServer(socket_path, PODS[:1]) as server:
        server.delay = 1.0  # a slow first answer: a daemon that just started on a busy node
        directory = PodDirectory(PodResourcesClient(str(socket_path)), refresh_seconds=3600)
        directory.start()
        try:
            assert directory.holder([UUID[0]]) is None  # not answered yet: holder() never waits
            directory.settle([UUID[0]], timeout=30)
            assert directory.answered and directory.holder([UUID[0]]) == PodContainer("ml", "trainer-0", "main",
                                                                                       "nvidia.com/gpu")
            server.delay, server.pods = 0.0, PODS  # trainer-1 starts after that answer
            calls = server.calls
            directory.settle([UUID[4]], timeout=30)
            assert directory.holder([UUID[4]]) == PodContainer("ml", "trainer-1", "main", "nvidia.com/gpu")
            assert server.calls == calls + 1
            directory.settle(["GPU-no-pod"], timeout=30)  # asked once, named by no pod
            calls = server.calls
            for _ in range(5):  # then known to be unnamed: no more asking, no waiting
                directory.settle(["GPU-no-pod", UUID[0]], timeout=30)
            assert server.calls == calls
        finally:
            directory.close()


def test_settle_on_a_kubelet_that_never_answers_ends_at_its_timeout(socket_path: Path) -> None:
    errors: list[str] = []
    with KubeletServer(socket_path, PODS) as server:
        server.delay = 5.0
        directory = PodDirectory(PodResourcesClient(str(socket_path), timeout_seconds=0.3), refresh_seconds=3600,
                                 on_error=errors.append)
        directory.start()
        try:
            directory.settle([UUID[0]], timeout=30)  # the failed call counts as the answer tried
            assert not directory.answered and directory.holder([UUID[0]]) is None
            assert len(errors) == 1 and "DEADLINE_EXCEEDED" in errors[0]
        finally:
            directory.close()
