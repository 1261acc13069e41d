"""Where a training job runs (Prometheus; Slurm in scheduler.py) and what each of its nodes says (their
daemons' /v1/dump).

Both go through the package's HTTP client (watchdog/boundary/http_client.py): no redirects (the node token goes to
the node named and nowhere else), one deadline per exchange, bodies read up to a cap. Instance labels go
into URLs only when they are host:port."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import json
import resource
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from watchdog.boundary import http_client, untrusted_data
from watchdog.boundary.http_client import valid_instance

MAX_ANSWER_BYTES = 16 * 2**20  # one node's /v1/dump answer
MAX_JOB_BYTES = 256 * 2**20  # every node's answers to one investigation, together
MAX_PROMETHEUS_BYTES = 24 * 2**20  # the placement of MAX_NODES nodes of 8 ranks (about 190 bytes a rank)
# The objects one answer (a node's, or Prometheus's) may build when parsed: answers are parsed one at a time,
# so this bounds what a node sending 16 MiB of `[],` could cost (about 350 MiB of lists unchecked).
BUILT_BYTES = 128 * 2**20
MAX_NODES = 16_384  # a 12,500-node job (100,000 GPUs) and room
# Nodes asked at once: every node of the largest job (a node's dump takes seconds, so rounds would multiply
# them), within the file descriptors the process may open (one connection each).
MAX_PARALLEL = MAX_NODES


class PrometheusError(Exception):
    """Prometheus could not be asked or answered something we cannot read."""


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal for any label value."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass(frozen=True)
class Placement:
    """Where a job's ranks run: the instances of the daemons' scrape job exporting them (sorted), and for each
    rank the instances exporting it (what each node's answer may speak for), as Prometheus says; or the
    daemons of the nodes the scheduler runs the job on (`source`), which place no rank."""

    instances: list[str]
    ranks: dict[int, frozenset[str]] = field(default_factory=dict)
    note: str | None = None  # what was left out of the job, and why (ranks that run as another user)
    source: str = "prometheus"  # who said it: prometheus, slurm, kubernetes; none: nobody could

    def to_json(self) -> dict[str, list[int]]:
        """instance -> its ranks, as the job bundle keeps it for `analyze`."""
        out: dict[str, list[int]] = {}
        for rank, instances in sorted(self.ranks.items()):
            for instance in sorted(instances):
                out.setdefault(instance, []).append(rank)
        return out

    @classmethod
    def from_json(cls, data: object) -> Placement:
        """A job bundle's placement (what to_json wrote); anything else read as none known."""
        ranks: dict[int, set[str]] = {}
        for instance, numbers in (data.items() if isinstance(data, dict) else ()):
            for rank in numbers if isinstance(numbers, list) else ():
                if isinstance(rank, int) and not isinstance(rank, bool) and valid_instance(str(instance)):
                    ranks.setdefault(rank, set()).add(str(instance))
        return cls(sorted({i for found in ranks.values() for i in found}),
                   {r: frozenset(i) for r, i in ranks.items()})


def placement_of(prometheus: str, job: str, scrape_job: str, timeout_seconds: float = 10.0) -> Placement:
    """The instances of scrape job `scrape_job` (the daemons: Prometheus's `job` label) exporting proven ranks of
    `job` (stall_watchdog_rank_info with `proof`), and the ranks each exports. Only they are asked, and given the
    node token: another exporter scraped by the same Prometheus may publish such a series too. A job's name is a
    claim: its ranks are those of the user most of its proven ranks run as (`uid`); ranks of another user that
    claim the name are left out (their nodes are not asked unless they hold the job's ranks too) and said so.
    Labels that are not host:port are left out (and named in the error when nothing else is left)."""
    expr = (f"count by (instance, rank, uid) (stall_watchdog_rank_info{{training_job={promql_string(job)}, "
            f"job={promql_string(scrape_job)}, proof!=\"\"}})")
    url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        answer = http_client.request("GET", url, timeout=timeout_seconds, max_bytes=MAX_PROMETHEUS_BYTES)
        data = untrusted_data.loads_json(answer.body, "Prometheus's answer", BUILT_BYTES)
    except (http_client.HttpError, ValueError, RecursionError) as exc:
        raise PrometheusError(f"{prometheus}: {exc}") from None
    if not isinstance(data, dict) or data.get("status") != "success":
        raise PrometheusError(f"{prometheus}: query failed (HTTP {answer.status}): {str(data)[:200]}")
    try:
        rows = [(str(r["metric"]["instance"]), str(r["metric"].get("rank", "")), str(r["metric"].get("uid", "")))
                for r in data["data"]["result"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise PrometheusError(f"{prometheus}: unexpected answer shape ({exc})") from None
    owner, note = _owner(rows)
    rows = [row for row in rows if row[2] == owner]
    found = sorted({instance for instance, _, _ in rows})
    bad = [i for i in found if not valid_instance(i)]
    if bad and len(bad) == len(found):
        raise PrometheusError(f"{prometheus}: no instance label is host:port (e.g. {bad[0][:80]!r})")
    instances = [i for i in found if valid_instance(i)][:MAX_NODES]
    kept = set(instances)
    ranks: dict[int, set[str]] = {}
    for instance, rank, _ in rows:
        if instance in kept and rank.isdigit() and len(rank) < 10:
            ranks.setdefault(int(rank), set()).add(instance)
    return Placement(instances, {r: frozenset(i) for r, i in ranks.items()}, note)


def _owner(rows: Sequence[tuple[str, str, str]]) -> tuple[str, str | None]:
    """The user a job's proven ranks run as: the one most of them run as (on a tie, the one running the lowest
    rank); and what is said of the others."""
    count: Counter[str] = Counter(uid for _, _, uid in rows)
    if len(count) <= 1:
        return (next(iter(count)) if count else ""), None
    lowest = {uid: min((int(r) for _, r, u in rows if u == uid and r.isdigit() and len(r) < 10), default=1 << 40)
              for uid in count}
    owner = min(count, key=lambda uid: (-count[uid], lowest[uid]))
    others = sorted(set(count) - {owner})
    where = sorted({instance for instance, _, uid in rows if uid != owner})
    claimants = sum(count[u] for u in others)
    return owner, (f"{claimants} {'rank claiming this job runs' if claimants == 1 else 'ranks claiming this job run'}"
                   f" as another user (uid "
                   f"{', '.join(others[:4])}, on {', '.join(where[:4])}{' and more' if len(where) > 4 else ''}) than "
                   f"its {count[owner]} ranks (uid {owner}): said as claimed, never asked or blamed")


class NodeAllowList:
    """The nodes the coordinator may ask (and give the node token): each entry a host, a host:port or an
    IP network (10.0.0.0/8); empty, every instance of the daemons' scrape job."""

    def __init__(self, entries: Sequence[str] = ()):
        self.entries = tuple(entries)
        self._hosts: set[str] = set()
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            if "/" in entry:
                try:
                    self._networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"{entry!r} is not an IP network (10.0.0.0/8)") from None
            elif valid_instance(entry) or valid_instance(entry + ":1"):
                self._hosts.add(entry.lower())
            else:
                raise ValueError(f"{entry!r} is not a host, host:port or IP network")

    def allows(self, instance: str) -> bool:
        if not self.entries:
            return True
        host = instance.rsplit(":", 1)[0]
        if instance.lower() in self._hosts or host.lower() in self._hosts:
            return True
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(address in network for network in self._networks)


@dataclass
class NodeAnswer:
    instance: str
    status: int | None  # HTTP status; None when the node could not be reached
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    raw: bytes | None = None  # the answer as it came (UTF-8 JSON), for the job bundle; None: not kept
    size: int = 0  # its bytes as it came (0: not read from a node)

    @property
    def answered(self) -> bool:
        """It answered, and what it said can be read."""
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, object]:
        return {"instance": self.instance, "status": self.status, "error": self.error,
                "seconds": round(self.seconds, 3), "node": self.body.get("node"), "bundle": self.body.get("bundle")}


def parallel() -> int:
    """Nodes asked at once: MAX_PARALLEL, within the process's file descriptors (one connection each, and
    _SPARE_FDS left for the service itself: its listening socket, Prometheus, the bundle being written)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PARALLEL
    return max(1, min(MAX_PARALLEL, soft - _SPARE_FDS))


_SPARE_FDS = 128


def raise_fd_limit() -> None:
    """Lift the soft limit on file descriptors to what MAX_PARALLEL nodes asked at once need, within the hard
    limit (a service started with the common default of 1,024 would otherwise ask fewer nodes at once)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_PARALLEL + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard),
                                                        hard))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a job's answers are read and judged: each parse makes
    hundreds of thousands of containers that the read drops again at once (reference counting frees them),
    and the collector would scan them, and everything kept so far, over and over (resumed after each answer,
    an eighth of the reading time at 1,024 nodes was its; resumed before the verdict, half the verdict's
    time at 2,048). Whoever paused it first resumes it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _parsed(instance: str, status: int, raw: bytes, seconds: float) -> NodeAnswer:
    """An answer parsed as strict JSON in UTF-8 (no NaN: the bundle keeps these bytes as they came), with
    msgspec: a thousand nodes' answers are hundreds of MB, and it parses them twice as fast as json."""
    try:
        untrusted_data.check_json(raw, "the answer", BUILT_BYTES)
    except untrusted_data.TooMuchData as exc:
        return NodeAnswer(instance, status, error=str(exc), seconds=seconds)
    try:
        body = msgspec.json.decode(raw) if raw else {}
    except (ValueError, RecursionError):  # msgspec.DecodeError and UnicodeDecodeError are ValueErrors
        return NodeAnswer(instance, status, error="the answer is not JSON", seconds=seconds)
    body = body if isinstance(body, dict) else {}
    if status != 200:
        return NodeAnswer(instance, status, {}, str(body.get("error") or f"HTTP {status}")[:300], seconds)
    return NodeAnswer(instance, status, body, None, seconds, raw, len(raw))


@dataclass(frozen=True)
class NodeClient:
    """How to reach the daemons: scheme, a bearer token (dump.token_file on the nodes), a CA to trust, and
    the nodes that may be asked at all."""

    scheme: str = "http"
    token: str | None = None
    ca_file: str | None = None
    timeout_seconds: float = 60.0
    allowed: NodeAllowList = field(default_factory=NodeAllowList)

    def ask(self, instance: str, job: str, max_bytes: int = MAX_ANSWER_BYTES) -> NodeAnswer:
        return self.ask_all([instance], job, max_bytes=max_bytes)[0]

    def _refusal(self, instance: str) -> str | None:
        """Why a node is not asked at all; None: it may be."""
        if not valid_instance(instance):
            return "not a host:port instance label; not asked"
        if not self.allowed.allows(instance):
            return "not on the allow-list (--allow-node); not asked"
        return None

    def ask_all(self, instances: list[str], job: str, read: Callable[[NodeAnswer], NodeAnswer] | None = None,
                max_bytes: int | None = None) -> list[NodeAnswer]:
        """Every node at once (a node's dump takes seconds, so asking in rounds would multiply them), up to
        parallel() connections open; each answer (or its failure) within the timeout, the whole job's answers
        within MAX_JOB_BYTES (each node gets its share, at most MAX_ANSWER_BYTES, unless `max_bytes` says
        otherwise). `read` takes each answer as it arrives and returns what is kept of it. Answers are parsed and
        read one at a time as they arrive whole, in this thread, while the others wait in their sockets
        (http_client.request_each)."""
        if not instances:
            return []
        share = max_bytes or max(1 << 20, min(MAX_ANSWER_BYTES, MAX_JOB_BYTES // len(instances)))
        out: list[NodeAnswer | None] = [None] * len(instances)
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        body = json.dumps({"training_job": job}).encode()
        asked: list[int] = []
        for n, instance in enumerate(instances):
            refusal = self._refusal(instance)
            if refusal is None:
                asked.append(n)
            else:
                out[n] = NodeAnswer(instance, None, error=refusal)
        calls = [http_client.Call("POST", urllib.parse.urlsplit(f"{self.scheme}://{instances[n]}/v1/dump"), body,
                                  headers) for n in asked]

        def answered(index: int, result: http_client.Response | http_client.HttpError) -> None:
            instance = instances[asked[index]]
            if isinstance(result, http_client.HttpError):
                answer = NodeAnswer(instance, None, error=f"cannot reach {instance}: {result.reason}")
            elif result.redirect:
                answer = NodeAnswer(instance, result.status, error=f"HTTP {result.status}: redirects are not "
                                    "followed", seconds=result.seconds)
            else:
                answer = _parsed(instance, result.status, result.body, result.seconds)
            out[asked[index]] = read(answer) if read is not None else answer

        with collector_paused():
            for n, refused in enumerate(out):
                if refused is not None and read is not None:
                    out[n] = read(refused)  # the nodes not asked
            http_client.request_each(calls, answered, self.timeout_seconds, share, self.ca_file, parallel())
        return [answer for answer in out if answer is not None]
