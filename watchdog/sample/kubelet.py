"""The kubelet's pod-resources API: which pod and container hold each device on this node.

`v1.PodResourcesLister/List` over gRPC on a unix socket (`/var/lib/kubelet/pod-resources/kubelet.sock`),
the way dcgm-exporter maps GPU UUIDs to pods. This module is the only one that speaks gRPC; it needs
`grpcio` (`pip install 'stall-watchdog[kubernetes]'`). The answer is small and its shape fixed, so it
is decoded here from the protobuf wire format: no generated code, no protobuf runtime to match.

    ListPodResourcesResponse  1: repeated PodResources
    PodResources              1: name  2: namespace  3: repeated ContainerResources
    ContainerResources        1: name  2: repeated ContainerDevices  (3-5: CPUs, memory, DRA: skipped)
    ContainerDevices          1: resource_name  2: repeated device_ids  (3: topology: skipped)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.config import KubernetesConfig
from watchdog.plumbing import logfmt

_METHOD = "/v1.PodResourcesLister/List"
_MAX_ANSWER_BYTES = 16 * 2**20  # a node of a few hundred pods answers in tens of KiB


class KubeletError(Exception):
    """The pod-resources API could not be asked or answered nonsense; the message says which."""


@dataclass(frozen=True)
class PodContainer:
    namespace: str
    pod: str
    container: str
    resource: str  # the extended resource the device was allocated as: nvidia.com/gpu, nvidia.com/mig-1g.10gb


# -- the protobuf wire format: just what the answer above needs ------------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise KubeletError("pod-resources answer: a number runs past the end of its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of one message: an int for a varint, bytes for a length-delimited
    field; fixed-width fields (none in this answer) are skipped."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise KubeletError("pod-resources answer: a field runs past the end of its message")
            yield number, data[pos:pos + length]
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise KubeletError(f"pod-resources answer: wire type {wire} is not protobuf 3")
    if pos != end:
        raise KubeletError("pod-resources answer: the last field runs past the end")


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise KubeletError("pod-resources answer: a number where a string belongs")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise KubeletError("pod-resources answer: a string that is not UTF-8") from None


def _messages(data: bytes, number: int) -> Iterator[bytes]:
    for field, value in _fields(data):
        if field == number:
            if not isinstance(value, bytes):
                raise KubeletError("pod-resources answer: a number where a message belongs")
            yield value


def _strings(data: bytes, *numbers: int) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {n: [] for n in numbers}
    for field, value in _fields(data):
        if field in found:
            found[field].append(_text(value))
    return found


def _last(strings: dict[int, list[str]], number: int) -> str:
    """A singular string field: protobuf keeps the last value given, '' when none was."""
    return strings[number][-1] if strings[number] else ""


def parse_list(answer: bytes) -> list[tuple[PodContainer, tuple[str, ...]]]:
    """Each container's devices, from a ListPodResourcesResponse."""
    out = []
    for pod in _messages(answer, 1):
        names = _strings(pod, 1, 2)
        for container in _messages(pod, 3):
            container_name = _last(_strings(container, 1), 1)
            for devices in _messages(container, 2):
                found = _strings(devices, 1, 2)
                holder = PodContainer(_last(names, 2), _last(names, 1), container_name, _last(found, 1))
                out.append((holder, tuple(found[2])))
    return out


def device_map(listing: Iterable[tuple[PodContainer, tuple[str, ...]]]) -> dict[str, PodContainer]:
    """Device id -> the container holding it. A time-sliced GPU is listed as `<uuid>::<replica>`: that is
    the GPU `<uuid>`. A device held by more than one container (time slicing, sharing) names none."""
    holders: dict[str, set[PodContainer]] = {}
    for holder, devices in listing:
        for device in devices:
            holders.setdefault(device.partition("::")[0], set()).add(holder)
    return {device: next(iter(found)) for device, found in holders.items() if len(found) == 1}


# -- the call ---------------------------------------------------------------------------------------------
def _grpc() -> Any:
    # gRPC's core logs reconnects to stderr at INFO; the daemon reports what matters in its own log lines.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        import grpc  # the optional dependency: only for Kubernetes nodes
    except ImportError:
        raise KubeletError("the pod-resources API needs grpcio: pip install 'stall-watchdog[kubernetes]'") from None
    return grpc


class PodResourcesClient:
    """Asks the kubelet's List; one channel, reconnected by gRPC as needed."""

    def __init__(self, socket_path: str, timeout_seconds: float = 2.0):
        self.socket_path = socket_path
        self.timeout_seconds = timeout_seconds
        self._call: Callable[..., bytes] | None = None
        self._channel: Any = None

    def list(self) -> list[tuple[PodContainer, tuple[str, ...]]]:
        grpc = _grpc()
        if not Path(self.socket_path).exists():
            raise KubeletError(f"{self.socket_path}: no such socket (mount the kubelet's pod-resources folder)")
        if self._call is None:
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket_path}", options=[("grpc.max_receive_message_length", _MAX_ANSWER_BYTES)])
            self._call = self._channel.unary_unary(
                _METHOD, request_serializer=lambda _: b"", response_deserializer=lambda raw: raw)
        try:
            answer = self._call(None, timeout=self.timeout_seconds)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", "error")
            details = exc.details() if hasattr(exc, "details") else ""
            raise KubeletError(f"{self.socket_path}: List answered {name}"
                               + (f": {details}" if details else "")) from None
        return parse_list(answer)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel, self._call = None, None


class PodDirectory:
    """The devices' holders, kept fresh off the sampling loop: a thread asks the kubelet every
    `refresh_seconds`, and sooner (at most once a second) after `holder()` was asked for a device the last
    answer did not name (a pod that just started). A device still unnamed after that (a GPU no pod was
    allocated, or one shared) waits for the regular refresh. `holder()` never waits on the kubelet;
    `settle()` does, for an incident's look, which names its ranks' pods once. A kubelet that does not
    answer costs one failed call per refresh, reported through `on_error` when the reason changes; the last
    good answer is kept."""

    def __init__(self, client: PodResourcesClient, refresh_seconds: float = 30.0,
                 on_error: Callable[[str], None] | None = None, on_ok: Callable[[int], None] | None = None):
        self.client = client
        self.refresh_seconds = refresh_seconds
        self.on_error = on_error
        self.on_ok = on_ok  # called with the number of devices after a good answer that follows a failure
        self.last_error: str | None = None
        self.answered = False  # at least one good answer
        self.answers = 0  # good answers so far: what was looked up in an earlier one may read otherwise now
        self._devices: Mapping[str, PodContainer] = {}
        self._asked: set[str] = set()  # devices looked up and not named, since the last answer
        self._unnamed: frozenset[str] = frozenset()  # looked up before the last answer, and not in it
        self._missed = threading.Event()
        self._stop = threading.Event()
        self._tries = 0  # refreshes done, good or not; under _tried
        self._tried = threading.Condition()
        self._thread: threading.Thread | None = None

    def holder(self, devices: Iterable[str]) -> PodContainer | None:
        """The one container holding these devices (a rank's GPUs), from the last answer; None when no
        container or more than one holds them."""
        known = self._devices
        wanted = [d for d in devices if d]
        found = {known[d] for d in wanted if d in known}
        new = [d for d in wanted if d not in known and d not in self._unnamed]
        if new:
            self._asked.update(new)
            self._missed.set()
        return next(iter(found)) if len(found) == 1 else None

    def settle(self, devices: Iterable[str], timeout: float) -> None:
        """Wait, at most `timeout` seconds, until the directory says what the kubelet can about these
        devices: its first answer tried (a daemon that just started), and those the last answer did not name
        asked once more (a pod that just started). A device asked before and still unnamed costs no wait."""
        deadline, wanted = time.monotonic() + timeout, [d for d in devices if d]
        with self._tried:
            self._tried.wait_for(lambda: self._tries > 0, timeout)
            known, unnamed = self._devices, self._unnamed
            if all(d in known or d in unnamed for d in wanted):
                return
            tries = self._tries
            self.holder(wanted)  # the miss wakes the thread
            self._tried.wait_for(lambda: self._tries > tries, max(0.0, deadline - time.monotonic()))

    def refresh(self) -> bool:
        """Ask the kubelet now; True on a good answer."""
        try:
            return self._refresh()
        finally:
            with self._tried:
                self._tries += 1
                self._tried.notify_all()

    def _refresh(self) -> bool:
        try:
            devices = device_map(self.client.list())
        except KubeletError as exc:
            message = str(exc)
            if message != self.last_error and self.on_error is not None:
                self.on_error(message)
            self.last_error = message
            return False
        asked, self._asked = self._asked, set()
        self._devices = devices
        self._unnamed = frozenset((self._unnamed | asked) - devices.keys())
        self.answers += 1
        if (self.last_error is not None or not self.answered) and self.on_ok is not None:
            self.on_ok(len(devices))
        self.last_error, self.answered = None, True
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._missed.clear()
            self.refresh()
            asked = time.monotonic()
            due = asked + self.refresh_seconds
            # A miss asks again, but not more than once a second, and not when the answer since named what was
            # missed (looked up while that answer was on its way).
            while not self._stop.is_set():
                self._missed.wait(max(0.0, due - time.monotonic()))
                self._stop.wait(max(0.0, 1.0 - (time.monotonic() - asked)))
                self._missed.clear()
                if time.monotonic() >= due or self._pending():
                    break

    def _pending(self) -> bool:
        """Devices looked up since the last answer that it does not name."""
        known = self._devices
        return any(d not in known for d in self._asked.copy())

    def close(self) -> None:
        self._stop.set()
        self._missed.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_seconds + 2)
        self.client.close()


def pod_directory(k: KubernetesConfig) -> PodDirectory | None:
    """The kubelet's answers on which pod holds each GPU, where this node has a kubelet (its pod-resources
    socket is there); None elsewhere. Refreshed by its own thread, started here."""
    if not k.pod_resources_socket or not Path(k.pod_resources_socket).exists():
        return None
    directory = PodDirectory(
        PodResourcesClient(k.pod_resources_socket, k.timeout_seconds), k.refresh_seconds,
        on_error=lambda problem: logfmt.event("pod_resources_failed", level=logfmt.WARNING, problem=problem,
                                              action="pods are named from each rank's cgroup and HOSTNAME"),
        on_ok=lambda devices: logfmt.event("pod_resources_ok", socket=k.pod_resources_socket, devices=devices))
    directory.start()
    return directory
