"""Where a training job runs (Prometheus) and what each of its nodes says (their daemons' /v1/dump).

Both go through the package's HTTP client (watchdog/http_client.py): no redirects (the node token goes to
the node named and nowhere else), one deadline per exchange, bodies read up to a cap. Instance labels go
into URLs only when they are host:port."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from watchdog import http_client

MAX_ANSWER_BYTES = 16 * 2**20  # one node's /v1/dump answer
MAX_JOB_BYTES = 256 * 2**20  # every node's answers to one investigation, together
MAX_PROMETHEUS_BYTES = 8 * 2**20
MAX_NODES = 4096


class PrometheusError(Exception):
    """Prometheus could not be asked or answered something we cannot read."""


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal for any label value."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_INSTANCE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]):\d{1,5}$")


def valid_instance(text: str) -> bool:
    """An `instance` label we put into a URL: host:port (a name, an IPv4 address or [IPv6]) and nothing
    else: no path, no user info, no scheme."""
    return bool(_INSTANCE.match(text)) and 0 < int(text.rsplit(":", 1)[1]) <= 65535


def instances_of(prometheus: str, job: str, timeout_seconds: float = 10.0) -> list[str]:
    """The `instance` labels of the daemons exporting ranks of `job` (stall_watchdog_rank_info), sorted.
    Labels that are not host:port are left out (and named in the error when nothing else is left)."""
    expr = f"count by (instance) (stall_watchdog_rank_info{{training_job={promql_string(job)}}})"
    url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        answer = http_client.request("GET", url, timeout=timeout_seconds, max_bytes=MAX_PROMETHEUS_BYTES)
        data = json.loads(answer.body)
    except (http_client.HttpError, ValueError, RecursionError) as exc:
        raise PrometheusError(f"{prometheus}: {exc}") from None
    if not isinstance(data, dict) or data.get("status") != "success":
        raise PrometheusError(f"{prometheus}: query failed (HTTP {answer.status}): {str(data)[:200]}")
    try:
        found = sorted({str(r["metric"]["instance"]) for r in data["data"]["result"]})
    except (KeyError, TypeError) as exc:
        raise PrometheusError(f"{prometheus}: unexpected answer shape ({exc})") from None
    bad = [i for i in found if not valid_instance(i)]
    if bad and len(bad) == len(found):
        raise PrometheusError(f"{prometheus}: no instance label is host:port (e.g. {bad[0][:80]!r})")
    return [i for i in found if valid_instance(i)][:MAX_NODES]


@dataclass
class NodeAnswer:
    instance: str
    status: int | None  # HTTP status; None when the node could not be reached
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    @property
    def answered(self) -> bool:
        return self.status == 200

    def to_json(self) -> dict[str, object]:
        return {"instance": self.instance, "status": self.status, "error": self.error,
                "seconds": round(self.seconds, 3), "node": self.body.get("node"), "bundle": self.body.get("bundle")}


@dataclass(frozen=True)
class NodeClient:
    """How to reach the daemons: scheme, a bearer token (dump.token_file on the nodes), a CA to trust."""

    scheme: str = "http"
    token: str | None = None
    ca_file: str | None = None
    timeout_seconds: float = 60.0

    def ask(self, instance: str, job: str, max_bytes: int = MAX_ANSWER_BYTES) -> NodeAnswer:
        started = time.monotonic()
        if not valid_instance(instance):
            return NodeAnswer(instance, None, error="not a host:port instance label; not asked")
        url = f"{self.scheme}://{instance}/v1/dump"
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            answer = http_client.request("POST", url, json.dumps({"training_job": job}).encode(), headers,
                                         self.timeout_seconds, max_bytes, self.ca_file)
        except http_client.HttpError as exc:
            return NodeAnswer(instance, None, error=f"cannot reach {instance}: {exc.reason}",
                              seconds=time.monotonic() - started)
        status, raw = answer.status, answer.body
        if answer.redirect:
            return NodeAnswer(instance, status, error=f"HTTP {status}: redirects are not followed",
                              seconds=time.monotonic() - started)
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            return NodeAnswer(instance, status, error="the answer is not JSON", seconds=time.monotonic() - started)
        body = body if isinstance(body, dict) else {}
        error = None if status == 200 else str(body.get("error") or f"HTTP {status}")[:300]
        return NodeAnswer(instance, status, body if status == 200 else {}, error, time.monotonic() - started)

    def ask_all(self, instances: list[str], job: str) -> list[NodeAnswer]:
        """Every node at once; each answer (or its failure) within the timeout, the whole job's answers
        within MAX_JOB_BYTES (each node gets its share, at most MAX_ANSWER_BYTES)."""
        if not instances:
            return []
        share = max(1 << 20, min(MAX_ANSWER_BYTES, MAX_JOB_BYTES // len(instances)))
        with ThreadPoolExecutor(max_workers=min(64, len(instances)), thread_name_prefix="fanout") as pool:
            return list(pool.map(lambda instance: self.ask(instance, job, share), instances))
