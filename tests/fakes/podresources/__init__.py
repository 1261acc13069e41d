"""A real kubelet pod-resources server for the tests: `api.proto` beside this file compiled with
grpc_tools (protoc) into a temporary folder, served by grpcio on a unix socket. Our client decodes the
answer on its own, so this checks it against the real wire format, not against itself."""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from grpc_tools import protoc

PROTO = Path(__file__).with_name("api.proto")
_compiled: tuple[ModuleType, ModuleType] | None = None
_lock = threading.Lock()


def generated() -> tuple[ModuleType, ModuleType]:
    """(api_pb2, api_pb2_grpc), compiled once per test session."""
    global _compiled
    with _lock:
        if _compiled is None:
            out = Path(tempfile.mkdtemp(prefix="podresources-proto-"))
            status = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out}", f"--grpc_python_out={out}",
                                  str(PROTO)])
            if status != 0:
                raise RuntimeError(f"protoc failed on {PROTO} ({status})")
            sys.path.insert(0, str(out))
            try:
                _compiled = importlib.import_module("api_pb2"), importlib.import_module("api_pb2_grpc")
            finally:
                sys.path.remove(str(out))
                shutil.rmtree(out, ignore_errors=True)  # imported: the modules need their files no more
        return _compiled


# A pod as the test describes it: (namespace, name, [(container, [(resource, [device ids])])]).
Pod = tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]


class KubeletServer:
    """Serves List with `pods` (settable while it runs); `fail` makes it answer UNAVAILABLE; `delay`
    holds each answer that many seconds. `calls` counts the Lists answered."""

    def __init__(self, socket_path: Path, pods: list[Pod] | None = None):
        self.socket_path = socket_path
        self.pods: list[Pod] = pods or []
        self.fail = False
        self.delay = 0.0
        self.calls = 0
        pb2, pb2_grpc = generated()
        outer = self

        class Lister(pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc,name-defined]
            def List(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's name)
                outer.calls += 1
                if outer.delay:
                    threading.Event().wait(outer.delay)
                if outer.fail:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
                return outer.answer()

        self._pb2 = pb2
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), self.server)
        self.server.add_insecure_port(f"unix://{socket_path}")

    def answer(self) -> Any:
        pb2 = self._pb2
        out = pb2.ListPodResourcesResponse()
        for namespace, name, containers in self.pods:
            pod = out.pod_resources.add(name=name, namespace=namespace)
            for container_name, devices in containers:
                container = pod.containers.add(name=container_name)
                container.cpu_ids.extend([2, 3, 130])  # packed varints the client must step over
                container.memory.add(memory_type="memory", size=2**34).topology.nodes.add(ID=1)
                claim = container.dynamic_resources.add(claim_name="c", claim_namespace=namespace)
                claim.claim_resources.add(driver_name="gpu.nvidia.com", pool_name="p", device_name="gpu-0"
                                          ).cdi_devices.add(name="k8s.gpu.nvidia.com/gpu=gpu-0")
                for resource, ids in devices:
                    entry = container.devices.add(resource_name=resource, device_ids=ids)
                    entry.topology.nodes.add(ID=0)
        return out

    def __enter__(self) -> KubeletServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)
