"""What naming pods costs: the kubelet's pod-resources List answered by a real gRPC server (the kubelet's
proto, tests/fakes/podresources) for a node of many pods, decoded by our client, and the lookup the
daemon does per rank and tick. The List runs on its own thread every kubernetes.refresh_seconds.

    python bench/pod_resources.py [--pods 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.podresources import KubeletServer  # noqa: E402
from watchdog.sample.kubelet import PodDirectory, PodResourcesClient, parse_list  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=300, help="pods on the node, 8 GPUs each (default 300)")
    args = parser.parse_args()
    pods = [(f"team-{i % 7}", f"trainer-{i}",
             [("main", [("nvidia.com/gpu", [f"GPU-{i:06d}-{g}" for g in range(8)])]), ("sidecar", [])])
            for i in range(args.pods)]
    with tempfile.TemporaryDirectory(prefix="kubelet-") as folder:
        socket_path = Path(folder) / "kubelet.sock"
        with KubeletServer(socket_path, pods) as server:
            answer = server.answer().SerializeToString()
            client = PodResourcesClient(str(socket_path))
            client.list()  # connect
            calls = []
            for _ in range(50):
                started = time.perf_counter()
                client.list()
                calls.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(50):
                parse_list(answer)
            decode = (time.perf_counter() - started) / 50
            directory = PodDirectory(client)
            directory.refresh()
            started = time.perf_counter()
            for _ in range(100_000):
                directory.holder(("GPU-000007-3",))
            lookup = (time.perf_counter() - started) / 100_000
            client.close()
    print(f"pod-resources List: {args.pods} pods, {8 * args.pods} GPUs, answer {len(answer) / 1024:.0f} KiB")
    print(f"  List + decode: median {statistics.median(calls) * 1e3:.1f} ms, max {max(calls) * 1e3:.1f} ms "
          f"(decode alone {decode * 1e3:.1f} ms), once per refresh, off the loop")
    print(f"  holder lookup (per rank per tick, on the loop): {lookup * 1e6:.2f} us")


if __name__ == "__main__":
    main()
