"""What the daemon gives out: the metrics endpoint, dumps on request, incident bundles, alerts and their
receivers."""

from __future__ import annotations

from typing import Annotated, Literal

from watchdog.config.base import Seconds, _http_url, _listen_address, _Section
from watchdog.config.schema import Field, field_validator, model_validator
from watchdog.plumbing import logfmt
from watchdog.vocabulary.alert_identity import RUNBOOK_URL


class ExportConfig(_Section):
    """The Prometheus endpoint (/metrics, /healthz)."""

    listen_address: str = Field("127.0.0.1:9944", description="host:port to serve on. Loopback by default.")
    tls_cert_file: str | None = Field(None, description="Serve HTTPS with this certificate (PEM).")
    tls_key_file: str | None = Field(None, description="The certificate's private key (PEM).")
    basic_auth_user: str | None = Field(None, description="Require HTTP basic auth with this user name.")
    basic_auth_password_file: str | None = Field(None, description="File holding the basic auth password.")
    basic_auth_password_env: str | None = Field(None, description="Environment variable holding the password.")
    stale_after_seconds: Seconds = Field(10.0, description="/healthz fails when the last sample is older than this.")
    series: Literal["standard", "beside_dcgm", "full"] = Field(
        "standard", description="Which series /metrics serves (docs/metrics.md lists each one's). standard: at most "
        "12 a GPU and 30 a node when healthy, facts as labels of gpu_info, an episode's state only while it is open. "
        "beside_dcgm: for a node that already runs dcgm-exporter, only what it lacks (verdicts, host progress, "
        "ranks, power as a share of the limit). full: every reading, every episode state.")

    _address = field_validator("listen_address")(classmethod(lambda cls, value: _listen_address(value)))

    @model_validator(mode="after")
    def _all_or_none(self) -> ExportConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        has_password = self.basic_auth_password_file is not None or self.basic_auth_password_env is not None
        if self.basic_auth_user is not None and not has_password:
            raise ValueError("basic_auth_user needs basic_auth_password_file or basic_auth_password_env")
        if self.basic_auth_user is None and has_password:
            raise ValueError("a basic auth password without basic_auth_user would serve without auth: set the user")
        if self.basic_auth_password_file is not None and self.basic_auth_password_env is not None:
            raise ValueError("give basic_auth_password_file or basic_auth_password_env, not both")
        return self


class DumpConfig(_Section):
    """`POST /v1/dump` on the endpoint: capture a job's stacks now (for Alertmanager and the coordinator)."""

    enabled: bool = Field(True, description="Serve POST /v1/dump.")
    token_file: str | None = Field(
        None, description="File holding a bearer token that POST /v1/dump requires (besides basic auth, if set). "
        "Dumps are refused unless this or export.basic_auth_user is set (or open_on_loopback).")
    open_on_loopback: bool = Field(
        False, description="Serve POST /v1/dump without credentials when the endpoint listens on loopback. Only "
        "on a node whose every local user may read every job's stacks: loopback is no trust boundary on a "
        "shared node.")
    cooldown_seconds: Annotated[float, Field(ge=0, le=3600)] = Field(
        30.0, description="A request for a job dumped less than this ago gets that dump's answer again.")
    max_per_minute: Annotated[int, Field(ge=1, le=600)] = Field(
        6, description="Dumps started per minute at most; more get 429 with Retry-After.")
    max_body_bytes: Annotated[int, Field(ge=1024, le=16 * 2**20)] = Field(
        1 * 2**20, description="Largest request body accepted (Alertmanager payloads with many alerts).")


class BundlesConfig(_Section):
    """Incident bundles: one folder per fired episode, with everything an on-call engineer needs."""

    directory: str = Field("/var/lib/stall-watchdog/incidents", min_length=1,
                           description="Where bundles are written (mode 0700).")
    max_total_bytes: Annotated[int, Field(ge=0)] = Field(
        1 << 30, description="Disk budget: the oldest bundles are removed to stay under it (0: none; otherwise at "
        "least 1048576, 1 MiB, since no bundle larger than it is kept).")
    max_count: Annotated[int, Field(ge=1)] = Field(200, description="Keep at most this many bundles.")
    max_bundle_bytes: Annotated[int, Field(ge=1 << 20)] = Field(
        64 << 20, description="One bundle's budget: a write that would pass it is refused before it reaches the "
        "disk and the bundle is not kept (nothing a rank makes the daemon write can grow past it). At least "
        "1048576 (1 MiB).")
    telemetry_window_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = Field(
        300.0, description="Telemetry kept before the onset, in the bundle: at most 3600 (an hour of 64 GPUs: tens "
        "of MiB of the daemon's memory, about 48 MiB of the bundle's budget).")
    capture_stacks: bool = Field(True, description="Capture the affected job's stacks with py-spy when an episode "
                                 "fires.")

    @field_validator("max_total_bytes")
    @classmethod
    def _budget(cls, value: int) -> int:
        if 0 < value < 1 << 20:
            raise ValueError("expected 0 (no disk budget) or at least 1048576 (1 MiB): no bundle larger than the "
                             "budget is kept")
        return value


class ReceiverConfig(_Section):
    """One alert receiver."""

    type: Literal["webhook", "alertmanager", "command", "coordinator"] = Field(
        description="Which kind of receiver. coordinator: `stall-watchdog coordinate`'s base URL, told at once of "
        "each critical hang of a known training job (with its proven Slurm job or pod), so the job's nodes are dumped "
        "without waiting for a scrape, the rules and Alertmanager; its token_file is the coordinator's "
        "--token-file.")
    name: str = Field(min_length=1, description="Name used in logs and the alerts_total metric, each receiver its own.")
    url: str | None = Field(None, description="webhook / alertmanager / coordinator: the URL (no secrets here: use "
                            "url_file); coordinator: its base URL, http://HOST:9945.")
    url_file: str | None = Field(None, description="File holding the URL (for URLs that carry a key).")
    url_env: str | None = Field(None, description="Environment variable holding the URL.")
    token_file: str | None = Field(None, description="File holding a bearer token sent as Authorization.")
    token_env: str | None = Field(None, description="Environment variable holding a bearer token.")
    argv: list[str] | None = Field(None, description="command: the program and its arguments; no shell. The alert "
                                   "JSON comes on standard input, the bundle path as the last argument.")
    timeout_seconds: Seconds = Field(10.0, description="One delivery attempt is abandoned after this long.")
    min_severity: Literal["warning", "critical"] = Field("warning", description="Send only alerts at least this "
                                                         "severe.")

    _inline_url = field_validator("url")(classmethod(lambda cls, value: _http_url(value)))

    @model_validator(mode="after")
    def _complete(self) -> ReceiverConfig:
        sources = [v for v in (self.url, self.url_file, self.url_env) if v is not None]
        if self.type == "command":
            if not self.argv or not self.argv[0]:
                raise ValueError(f"receiver {self.name!r}: a command receiver needs argv (the program first)")
            if sources:
                raise ValueError(f"receiver {self.name!r}: a command receiver takes argv, not a URL")
        elif self.argv is not None:
            raise ValueError(f"receiver {self.name!r}: argv is for a command receiver; a {self.type} one takes a URL")
        elif len(sources) != 1:
            raise ValueError(f"receiver {self.name!r}: give exactly one of url, url_file, url_env")
        if self.token_file is not None and self.token_env is not None:
            raise ValueError(f"receiver {self.name!r}: give token_file or token_env, not both")
        return self


class AlertsConfig(_Section):
    """Alert delivery. Deliveries run off the loop; a dead receiver is counted and logged, nothing waits on it."""

    receivers: list[ReceiverConfig] = Field(default_factory=list, description="Where alerts go (several at once).")
    max_attempts: Annotated[int, Field(ge=1, le=20)] = Field(4, description="Attempts per alert, with backoff.")
    backoff_seconds: Seconds = Field(2.0, description="First retry delay; doubles each attempt.")
    rate_limit_per_minute: Annotated[int, Field(ge=1)] = Field(
        20, description="At most this many alerts per receiver per minute; the rest are counted as dropped.")
    node: str | None = Field(None, description="The `node` label on alerts (the shipped rules give it the same "
                             "value, from the episode_alert_info series); default: this host's name.")
    node_env: str | None = Field(
        None, description="Take the `node` label from this environment variable instead (Kubernetes: NODE_NAME, "
        "set from spec.nodeName, since a pod's host name is the pod's).")
    runbook_url: str = Field(RUNBOOK_URL, description="Where the runbook lives; each alert links to its section "
                             "(`#stallwatchdogbusyspin`, ...). Point it, and the rules' runbook_url, at your copy.")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        """`instance` and `instance_env` are the old names of `node` and `node_env` (Prometheus's `instance`
        is the scrape address, not the host): still read, with a warning."""
        if isinstance(data, dict):
            for old, new in (("instance", "node"), ("instance_env", "node_env")):
                if old in data and new not in data:
                    data = {**{k: v for k, v in data.items() if k != old}, new: data[old]}
                    logfmt.event("config_key_renamed", level=logfmt.WARNING, key=f"alerts.{old}",
                                 use=f"alerts.{new}")
        return data

    _runbook = field_validator("runbook_url")(classmethod(lambda cls, value: _http_url(value)))

    @model_validator(mode="after")
    def _one_node(self) -> AlertsConfig:
        if self.node is not None and self.node_env is not None:
            raise ValueError("give node or node_env, not both")
        names = [r.name for r in self.receivers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"receivers named twice: {', '.join(map(repr, twice))} (each name is its own "
                             "alerts_total series and log lines)")
        return self
