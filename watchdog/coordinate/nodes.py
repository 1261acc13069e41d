"""Where a training job runs (Prometheus) and what each of its nodes says (their daemons' /v1/dump)."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

MAX_ANSWER_BYTES = 64 * 2**20


class PrometheusError(Exception):
    """Prometheus could not be asked or answered something we cannot read."""


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal for any label value."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def instances_of(prometheus: str, job: str, timeout_seconds: float = 10.0) -> list[str]:
    """The `instance` labels of the daemons exporting ranks of `job` (stall_watchdog_rank_info), sorted."""
    expr = f"count by (instance) (stall_watchdog_rank_info{{training_job={promql_string(job)}}})"
    url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
            data = json.loads(response.read(MAX_ANSWER_BYTES))
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"{prometheus}: {exc}") from None
    if not isinstance(data, dict) or data.get("status") != "success":
        raise PrometheusError(f"{prometheus}: query failed: {str(data)[:200]}")
    try:
        return sorted(str(r["metric"]["instance"]) for r in data["data"]["result"])
    except (KeyError, TypeError) as exc:
        raise PrometheusError(f"{prometheus}: unexpected answer shape ({exc})") from None


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

    def ask(self, instance: str, job: str) -> NodeAnswer:
        started = time.monotonic()
        url = f"{self.scheme}://{instance}/v1/dump"
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, data=json.dumps({"training_job": job}).encode(), headers=headers,
                                         method="POST")
        context = ssl.create_default_context(cafile=self.ca_file) if self.scheme == "https" else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds, context=context) as response:
                status, raw = response.status, response.read(MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read(MAX_ANSWER_BYTES)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            why = getattr(reason, "strerror", None) or str(reason)
            return NodeAnswer(instance, None, error=f"cannot reach {url}: {why}",
                              seconds=time.monotonic() - started)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return NodeAnswer(instance, status, error="the answer is not JSON", seconds=time.monotonic() - started)
        body = body if isinstance(body, dict) else {}
        error = None if status == 200 else str(body.get("error") or f"HTTP {status}")
        return NodeAnswer(instance, status, body, error, time.monotonic() - started)

    def ask_all(self, instances: list[str], job: str) -> list[NodeAnswer]:
        """Every node at once; each answer (or its failure) within the timeout."""
        if not instances:
            return []
        with ThreadPoolExecutor(max_workers=min(64, len(instances)), thread_name_prefix="fanout") as pool:
            return list(pool.map(lambda instance: self.ask(instance, job), instances))
