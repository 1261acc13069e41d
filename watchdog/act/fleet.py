"""The fleet circuit breaker's question: what share of the fleet's nodes acted on a hang lately?

Prometheus knows: every node's daemon exports stall_watchdog_actions_total, and deploy/prometheus/rules.yml
records stall_watchdog:fleet_acted_ratio from it. This asks for that one number, through the one HTTP
client; no answer (unreachable, slow, not a number) is None with the reason, and the policy then does not
act: a breaker that cannot see the fleet stays open.
"""

from __future__ import annotations

import json
import math
import urllib.parse

from watchdog import http_client
from watchdog.config import FleetConfig

RECORD = "stall_watchdog:fleet_acted_ratio"


def acted_ratio(cfg: FleetConfig) -> tuple[float | None, str]:
    """(share of nodes that acted in the rules' window, '') or (None, why not). 0.0 without a breaker."""
    if cfg.prometheus_url is None:
        return 0.0, ""
    url = cfg.prometheus_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": RECORD})
    try:
        answer = http_client.request("GET", url, timeout=cfg.timeout_seconds, max_bytes=256 * 1024)
    except (http_client.HttpError, ValueError) as exc:
        return None, f"Prometheus: {exc}"
    if answer.status != 200:
        return None, f"Prometheus answered HTTP {answer.status}"
    return _share(answer.body)


def _share(body: bytes) -> tuple[float | None, str]:
    """The largest value of an instant-vector answer, or None and why: an answer that is not Prometheus's
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
            return None, f"{RECORD} is not a number"
    if not values:
        return None, f"Prometheus has no {RECORD} (are deploy/prometheus/rules.yml loaded?)"
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None, f"{RECORD} is not a share"
    return max(values), ""
