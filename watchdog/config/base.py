"""The units every section shares (seconds, ratios), the one URL rule, and the base of every section."""

from __future__ import annotations

from typing import Annotated

from watchdog.config.schema import Field, Section

# Every duration is finite and at most a week: `.inf` or `1e10` would be accepted and then overflow a timer.
Seconds = Annotated[float, Field(gt=0, le=7 * 86400, allow_inf_nan=False)]
SecondsOrZero = Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)]
Interval = Annotated[float, Field(ge=0.05, le=3600, allow_inf_nan=False)]  # a loop period: 50 ms to an hour
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
# The built-in scenarios of sample/sim.py (a test keeps the two lists equal; config imports nothing else).
SCENARIO_NAMES = ("healthy", "checkpoint", "spin_hang", "startup_spin", "zero_util_hang", "odd_rank", "underuse",
                  "throttle", "straggler", "xid_then_spin", "gpu_lost", "tp_small_batch", "t4_spin")
MAX_DOCUMENT_BYTES = 1 << 20  # a configuration is a few KiB; more is a mistake or an attack
MAX_NODES = 20_000  # values in the document, aliases counted each time they are used
MAX_DEPTH = 32
_EXCERPT = 60  # characters of an offending value quoted in an error
_SECRET_KEYS = {"url", "token", "password"}


def _http_url(value: str | None) -> str | None:
    """A URL given inline: http or https (the one rule for every URL key)."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError("expected an http:// or https:// URL")
    return value


def _prometheus_url(value: str | None) -> str | None:
    """An API's base URL (Prometheus's, the Kubernetes API server's): http or https with a host, and nothing
    that would be sent nowhere or logged: no user or password (they are not sent; the URL is shown in logs and
    bundles), no query or fragment (the API path is appended to it)."""
    if _http_url(value) is None:
        return None
    assert value is not None
    rest = value.split("://", 1)[1]
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        raise ValueError("expected a URL without a user or password: they would not be sent, and the URL is "
                         "shown in logs and bundles")
    if "?" in rest or "#" in rest:
        raise ValueError("expected a base URL without a query or fragment (the API path is added to it)")
    if not authority.split("?")[0] or authority.startswith(":"):
        raise ValueError("expected an http:// or https:// URL with a host")
    return value


def _listen_address(value: str) -> str:
    """host:port to listen on (the one rule for every listening key)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port with a port from 1 to 65535 (0: any free port)")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError("expected [IPv6]:port")
    return value


class _Section(Section):
    """Every section: frozen, strict (30 is a number; "30", true are not), no key it does not name."""
