"""The fleet's two questions, asked of Prometheus where actions.fleet.prometheus_url is set:

- what share of the fleet's nodes acted on a hang lately? Every node's daemon exports
  stall_watchdog_actions_total, and deploy/prometheus/rules.yml records stall_watchdog:fleet_acted_ratio
  from it (the circuit breaker);
- when did other nodes act on this job? Every node exports its ledger as
  stall_watchdog_ledger_last_action_timestamp_seconds{ledger_key} (the job's Slurm job, pod, or user and
  command): a job requeued to another node is known there (the deterministic guard, the budget, the
  cooldown).

Each through the one HTTP client; no answer (unreachable, slow, not a query result) is None with the reason,
and the policy then does not act: a breaker that cannot see the fleet stays open.
"""

from __future__ import annotations

import json
import math
import urllib.parse

from watchdog.boundary import http_client
from watchdog.config import FleetConfig

RECORD = "stall_watchdog:fleet_acted_ratio"
LEDGER = "stall_watchdog_ledger_last_action_timestamp_seconds"


def acted_ratio(cfg: FleetConfig) -> tuple[float | None, str]:
    """(share of nodes that acted in the rules' window, '') or (None, why not). 0.0 without a breaker."""
    if cfg.prometheus_url is None:
        return 0.0, ""
    values, why = _query(cfg, RECORD)
    if values is None:
        return None, why
    if not values:
        return None, f"Prometheus has no {RECORD} (are deploy/prometheus/rules.yml loaded?)"
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None, f"{RECORD} is not a share"
    return max(values), ""


def actions_elsewhere(cfg: FleetConfig, *ledger_keys: str) -> tuple[list[float] | None, str]:
    """(each node's last action on the job known by any of `ledger_keys`, '') or (None, why not); [] without a
    fleet."""
    if cfg.prometheus_url is None:
        return [], ""
    found: list[float] = []
    for key in dict.fromkeys(ledger_keys):
        quoted = key.replace("\\", "\\\\").replace('"', '\\"')
        values, why = _query(cfg, f'{LEDGER}{{ledger_key="{quoted}"}}')
        if values is None:
            return None, why
        found += [v for v in values if math.isfinite(v) and v > 0 and v not in found]
    return found, ""


def _query(cfg: FleetConfig, query: str) -> tuple[list[float] | None, str]:
    assert cfg.prometheus_url is not None
    url = cfg.prometheus_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        answer = http_client.request("GET", url, timeout=cfg.timeout_seconds, max_bytes=256 * 1024)
    except (http_client.HttpError, ValueError) as exc:
        return None, f"Prometheus: {exc}"
    if answer.status != 200:
        return None, f"Prometheus answered HTTP {answer.status}"
    return _values(answer.body)


def _values(body: bytes) -> tuple[list[float] | None, str]:
    """The values of an instant-vector answer, or None and why: an answer that is not Prometheus's
    `{"status": "success", "data": {"resultType": "vector", "result": [...]}}` with numbers in it is no answer
    (an error status, `true`, a deep nesting: never a reason to act)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None, "Prometheus's answer is not JSON"
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(parsed, dict) or parsed.get("status") != "success" or not isinstance(data, dict):
        status = parsed.get("status") if isinstance(parsed, dict) else None
        return None, f"Prometheus answered status {str(status)[:40]!r}, not a query result"
    result = data.get("result")
    if data.get("resultType") != "vector" or not isinstance(result, list):
        return None, "Prometheus's answer is not an instant vector"
    values = []
    for series in result:
        sample = series.get("value") if isinstance(series, dict) else None
        if not (isinstance(sample, list) and len(sample) == 2 and isinstance(sample[1], str)):
            return None, "Prometheus's answer holds a sample that is not [time, \"value\"]"
        try:
            values.append(float(sample[1]))
        except ValueError:
            return None, "Prometheus's answer holds a value that is not a number"
    return values, ""
