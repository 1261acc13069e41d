"""Where a job runs, in its scheduler's own words: the coordinator's way to a job's nodes that neither waits for
Prometheus (a scrape, then its rules, then Alertmanager's group_wait) nor needs it up.

Slurm: squeue is asked in a fixed format whose fields no user chose (the job's id, its state and its node list: a
job's name or comment could hold "NodeList=..."), and `scontrol show hostnames` expands the node list. Each
node becomes the instance its daemon serves on by `instance` (`{node}:9944`). Both run through children.run:
a deadline, bounded output, no secret of the coordinator's in their environment.

Kubernetes: the API server is asked for the paging rank's pod, the pods that share its job label
(`batch.kubernetes.io/job-name`, a JobSet's, a PyTorchJob's: the first of `job_labels` the pod carries), and
the daemons' own pods (a DaemonSet: one a node); the job's nodes are its pods' nodes, each reached at its
daemon pod's address (an IP address). Lists are read in pages (`limit`, `continue`), each bounded in bytes,
their number and time bounded too, through the one HTTP client (no redirects, one deadline an exchange); the
service account token is read at each placement (projected tokens are renewed).
"""

from __future__ import annotations

import ipaddress
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from watchdog.boundary import children, http_client, secrets, untrusted_data
from watchdog.config import JOB_LABELS
from watchdog.vocabulary.model import K8S_NAME, SLURM_JOB_ID

from .nodes import MAX_NODES, Placement, valid_instance

MAX_OUTPUT_BYTES = 2 * 2**20  # `scontrol show hostnames` of a 16,384-node job, a name of up to 127 bytes a line
RUNNING = ("RUNNING", "SUSPENDED", "COMPLETING")  # states whose nodes still hold the job's ranks


class SchedulerError(Exception):
    """The scheduler could not be asked, or does not place the job on any node now (the message says which)."""


@dataclass(frozen=True)
class SlurmNodes:
    """How the coordinator asks Slurm: the instance of each node's daemon (`{node}` is Slurm's NodeName), the
    slurm.conf to use (None: Slurm's own default or configless lookup), the commands and their deadline."""

    instance: str = "{node}:9944"
    conf: str | None = None
    squeue: str = "squeue"
    scontrol: str = "scontrol"
    timeout_seconds: float = 10.0

    def placement(self, slurm_job_id: str) -> Placement:
        """The daemons of the nodes Slurm runs job `slurm_job_id` on (sorted); which rank runs where is left to
        the nodes' answers (each node's daemon proves its own ranks from slurmstepd's cgroup)."""
        if not SLURM_JOB_ID.match(slurm_job_id):
            raise SchedulerError(f"{slurm_job_id!r} is not a Slurm job id")
        shown = self._run(self.squeue, "--noheader", "--states=all", "--jobs", slurm_job_id, "--format", "%A|%T|%N")
        rows = [[part.strip() for part in line.split("|")] for line in shown.splitlines() if line.strip()]
        mine = [row for row in rows if len(row) == 3 and row[0] == slurm_job_id]
        if not mine:
            raise SchedulerError(f"Slurm has no job {slurm_job_id}")
        _, state, node_list = mine[0]
        if state not in RUNNING:
            raise SchedulerError(f"Slurm says job {slurm_job_id} is {state or 'in no state'}, on no node now")
        if not node_list or node_list == "(null)":
            raise SchedulerError(f"Slurm gives job {slurm_job_id} no nodes")
        nodes = self._run(self.scontrol, "show", "hostnames", node_list).split()
        instances = sorted({i for node in nodes if valid_instance(i := self.instance.format(node=node))})
        if not instances:
            raise SchedulerError(f"no node of Slurm job {slurm_job_id} makes a host:port with {self.instance!r} "
                                 f"(its nodes: {node_list[:200]})")
        notes = []
        if len(nodes) > len(instances):
            notes.append(f"{len(nodes) - len(instances)} of its {len(nodes)} node names make no host:port instance "
                         f"with {self.instance!r}; not asked")
        if len(instances) > MAX_NODES:
            notes.append(f"{len(instances) - MAX_NODES} of its nodes are past the {MAX_NODES} asked of one job; not "
                         "asked")
        return Placement(instances[:MAX_NODES], source="slurm", note="; ".join(notes) or None)

    def _run(self, *argv: str) -> str:
        try:
            return children.run(argv, timeout=self.timeout_seconds,
                                env={"SLURM_CONF": self.conf} if self.conf else None, max_output=MAX_OUTPUT_BYTES)
        except children.CommandError as exc:
            raise SchedulerError(str(exc)) from None


PAGE = 100  # objects a list page asks for: a pod's object is a few KiB, with managedFields some tens
MAX_PAGE_BYTES = 8 * 2**20  # one page (100 pods of 26 KiB: 2.6 MiB)
BUILT_BYTES = 128 * 2**20  # the objects one page may build when parsed (about 17 times its bytes)
MAX_PAGES = 2 * MAX_NODES * 8 // PAGE  # a job's pods (8 a node at most, and room), or the daemons' (one a node)
LIST_SECONDS = 60.0


@dataclass(frozen=True)
class KubernetesNodes:
    """How the coordinator asks the Kubernetes API: where, with which token and CA; where the daemons run (their
    namespace, label selector and port); the labels that name a pod's job."""

    api_url: str
    token_file: str | None = None  # read at each placement: a projected service account token is renewed
    ca_file: str | None = None
    daemon_namespace: str = "stall-watchdog"
    daemon_selector: str = "app.kubernetes.io/name=stall-watchdog"
    daemon_port: int = 9944
    job_labels: tuple[str, ...] = JOB_LABELS
    timeout_seconds: float = 10.0

    def placement(self, namespace: str, pod: str) -> Placement:
        """The daemons of the nodes the job of pod `namespace/pod` runs on (sorted)."""
        if not (K8S_NAME.match(namespace) and K8S_NAME.match(pod)):
            raise SchedulerError(f"{namespace}/{pod} is not a Kubernetes namespace and pod")
        try:
            token = self.read_token()
        except secrets.SecretError as exc:
            raise SchedulerError(str(exc)) from None
        started = time.monotonic()
        shown = self._get(f"/api/v1/namespaces/{namespace}/pods/{pod}", token)
        labels = _object(_object(shown, "metadata"), "labels")
        label = next((name for name in self.job_labels if isinstance(labels.get(name), str)), None)
        if label is None:
            raise SchedulerError(f"pod {namespace}/{pod} carries none of the job labels ({', '.join(self.job_labels)})")
        selector = f"{label}={labels[label]}"
        nodes = {node for item in self._list(f"/api/v1/namespaces/{namespace}/pods", selector, token, started)
                 if isinstance(node := _object(item, "spec").get("nodeName"), str) and K8S_NAME.match(node)}
        if not nodes:
            raise SchedulerError(f"no pod of {namespace} with {selector} is on a node")
        daemons: dict[str, str] = {}
        for item in self._list(f"/api/v1/namespaces/{self.daemon_namespace}/pods", self.daemon_selector, token,
                               started):
            node, status = _object(item, "spec").get("nodeName"), _object(item, "status")
            address = _address(status.get("podIP"))
            if isinstance(node, str) and node in nodes and address and status.get("phase") == "Running":
                daemons[node] = f"[{address}]:{self.daemon_port}" if ":" in address else f"{address}:{self.daemon_port}"
        instances = sorted(daemons.values())[:MAX_NODES]
        if not instances:
            raise SchedulerError(f"no daemon runs on the {len(nodes)} nodes of {namespace} {selector} (pods of "
                                 f"{self.daemon_namespace} with {self.daemon_selector})")
        missing = sorted(nodes - set(daemons))
        note = (f"{len(missing)} nodes of the job run no daemon with an IP address ({', '.join(missing[:4])}"
                f"{' and more' if len(missing) > 4 else ''}); not asked") if missing else None
        return Placement(instances, source="kubernetes", note=note)

    def read_token(self) -> str | None:
        """The service account token as its file holds it now (secrets.SecretError if it cannot be read)."""
        if self.token_file is None:
            return None
        what = "coordinator.kubernetes.token_file (set in the `coordinator:` section of --config)"
        return secrets.one_line_token(secrets.read_file(self.token_file, what), what)

    def _list(self, path: str, selector: str, token: str | None, started: float) -> Iterator[dict[str, Any]]:
        """A list's items, page by page: at most MAX_PAGES pages, within LIST_SECONDS of the placement's start, and
        each `continue` token once (an API server that sends the same one again, or pages without end, is left)."""
        seen: set[str] = set()
        after = ""
        for _ in range(MAX_PAGES):
            if time.monotonic() - started > LIST_SECONDS:
                raise SchedulerError(f"Kubernetes API: listing {path} took over {LIST_SECONDS} s")
            query = {"labelSelector": selector, "limit": str(PAGE), **({"continue": after} if after else {})}
            page = self._get(f"{path}?{urllib.parse.urlencode(query)}", token)
            items = page.get("items")
            for item in items if isinstance(items, list) else ():
                if isinstance(item, dict):
                    yield item
            after = _object(page, "metadata").get("continue") or ""
            if not isinstance(after, str) or not after:
                return
            if after in seen or len(after) > 4096:
                raise SchedulerError(f"Kubernetes API: listing {path} gave a continue token it gave before")
            seen.add(after)
        raise SchedulerError(f"Kubernetes API: listing {path} went past {MAX_PAGES} pages of {PAGE}")

    def _get(self, path: str, token: str | None) -> dict[str, Any]:
        headers = {"Accept": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        try:
            answer = http_client.request("GET", self.api_url.rstrip("/") + path, None, headers, self.timeout_seconds,
                                         MAX_PAGE_BYTES, self.ca_file)
        except (http_client.HttpError, ValueError, OSError) as exc:  # OSError: a CA file that cannot be read
            raise SchedulerError(f"Kubernetes API: {exc}") from None
        if answer.redirect:
            raise SchedulerError(f"Kubernetes API: HTTP {answer.status} for {path.split('?')[0]}: redirects are not "
                                 "followed")
        try:
            data = untrusted_data.loads_json(answer.body, "the Kubernetes API's answer", BUILT_BYTES)
        except (ValueError, RecursionError) as exc:
            raise SchedulerError(f"Kubernetes API: HTTP {answer.status} for {path.split('?')[0]}: not a JSON "
                                 f"answer ({str(exc)[:200]})") from None
        if answer.status != 200 or not isinstance(data, dict):
            said = data.get("message") if isinstance(data, dict) else None
            raise SchedulerError(f"Kubernetes API: HTTP {answer.status} for {path.split('?')[0]}"
                                 + (f": {str(said)[:200]}" if said else ""))
        return data


def _address(value: object) -> str | None:
    """An IP address as a pod's status gives it (`podIP`), else None: no host name, no zone, no "0.0.0.0"."""
    if not isinstance(value, str):
        return None
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return None
    return None if address.is_unspecified or address.is_multicast else str(address)


def _object(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """parent[key] where it is an object; {} where it is missing or anything else."""
    value = parent.get(key)
    return value if isinstance(value, dict) else {}
