"""Alert delivery: a generic JSON webhook (with a Slack-compatible `text`), Alertmanager's v2 API, a local
command, and the job-wide coordinator (told of a critical hang so the job's nodes are dumped at once). Each
receiver has its own worker and queue, so a dead one delays only itself; the loop only enqueues. Alerts are
deduplicated (the same episode and status goes out once), rate limited, retried with exponential backoff, and
resolved when the episode ends. URLs and tokens can come from files or environment variables and never appear
in a log line or an error (receivers are named).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from watchdog.boundary import children, http_client, secrets
from watchdog.config import AlertsConfig, ReceiverConfig
from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.vocabulary.alert_identity import AlertIdentity, alert_name
from watchdog.vocabulary.model import Severity, Workload
from watchdog.vocabulary.words import iso_time

_SEVERITY_RANK = {"warning": 1, "critical": 2}


@dataclass(frozen=True)
class Alert:
    key: str  # one per episode: the same key fires, escalates and resolves
    status: str  # firing | resolved
    identity: AlertIdentity  # its name and labels, shared with the shipped rules (alert_identity.py)
    severity: Severity
    gpus: tuple[int, ...]
    culprit_gpus: tuple[int, ...]
    summary: str  # the verdict sentence, as the bundle, the report and the log have it
    onset: float
    at: float
    culprit: str = ""  # "GPU 4 (rank 4, pid 812)": what the others wait on, where that is known
    bundle: str | None = None
    runbook_url: str = ""
    action: str = ""  # the actions policy's decision once it said one (act, dry_run, deterministic...): a new fact

    @property
    def signature(self) -> str:
        return self.identity.signature.value

    @property
    def alertname(self) -> str:
        return alert_name(self.identity.signature)

    def labels(self) -> dict[str, str]:
        return self.identity.labels(self.severity)

    def to_json(self) -> dict[str, object]:
        return {"key": self.key, "status": self.status, "alertname": self.alertname, "signature": self.signature,
                "severity": self.severity.value, "labels": self.labels(), "gpus": list(self.gpus),
                "culprit_gpus": list(self.culprit_gpus), "culprit": self.culprit, "summary": self.summary,
                "onset": iso_time(self.onset), "at": iso_time(self.at), "node": self.identity.node,
                "training_job": self.identity.training_job, "bundle": self.bundle,
                "runbook_url": self.runbook_url, "workload": self.identity.workload.to_json(),
                **({"action": self.action} if self.action else {})}

    def text(self) -> str:
        """The Slack-style line. Its parts carry text a rank chose (function and file names, job names):
        `&`, `<` and `>` are escaped as Slack asks, so none of it becomes a mention (`<!channel>`) or a
        link, and control characters become spaces."""
        head = "RESOLVED" if self.status == "resolved" else self.severity.value.upper()
        workload = self.identity.workload
        scheduler = f" [{workload.describe()}]" if workload else ""
        job = f" training job {self.identity.training_job}" if self.identity.training_job != "unknown" else ""
        culprit = f" Culprit: {self.culprit}." if self.culprit and self.status == "firing" else ""
        where = f" Bundle: {self.bundle}" if self.bundle else ""
        return _slack_escape(f"[{head}] {self.identity.node}{job}{scheduler}: {self.summary}.{culprit}{where}")


def _slack_escape(text: str) -> str:
    text = "".join(c if c.isprintable() else " " for c in text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class DeliveryError(Exception):
    """One attempt failed; the message names no secret."""


class Receiver(Protocol):
    name: str
    min_severity: str

    def send(self, alert: Alert) -> None: ...


def _target(cfg: ReceiverConfig, url: str) -> urllib.parse.SplitResult:
    """The receiver's URL, checked where it enters (the config, a file or the environment). The message
    names the receiver and the key, never the value: a URL may carry a key."""
    where = "url_file" if cfg.url_file else "url_env" if cfg.url_env else "url"
    try:
        return http_client.split(url)
    except ValueError as exc:
        raise ValueError(f"receiver {cfg.name}: {where}: {exc}") from None


def _post(target: urllib.parse.SplitResult, body: object, token: str | None, timeout: float) -> None:
    """One POST through the package's HTTP client (one deadline, no redirects: a 3xx is a failure)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        answer = http_client.request("POST", target, json.dumps(body).encode(), headers, timeout, 64 * 1024)
    except http_client.HttpError as exc:
        raise DeliveryError(f"unreachable ({exc.reason})") from None
    if answer.redirect:
        raise DeliveryError(f"HTTP {answer.status}: redirects are not followed")
    if not 200 <= answer.status < 300:
        raise DeliveryError(f"HTTP {answer.status}")


class _HttpReceiver:
    """A receiver reached over HTTP: its URL and bearer token, from the config, a file or the environment."""

    def __init__(self, cfg: ReceiverConfig):
        self.name, self.timeout = cfg.name, cfg.timeout_seconds
        self.min_severity: str = cfg.min_severity
        try:
            url = secrets.read(cfg.url_file, cfg.url_env, f"receiver {cfg.name}: url") or cfg.url
            token = secrets.read(cfg.token_file, cfg.token_env, f"receiver {cfg.name}: token")
            where = "token_file" if cfg.token_file else "token_env"
            self._token = secrets.one_line_token(token, f"receiver {cfg.name}: {where}") if token else None
        except secrets.SecretError as exc:
            raise ValueError(str(exc)) from None
        if not url:
            raise ValueError(f"receiver {cfg.name}: a {cfg.type} receiver needs url, url_file or url_env")
        self._url = _target(cfg, url)


class WebhookReceiver(_HttpReceiver):
    def send(self, alert: Alert) -> None:
        _post(self._url, {"text": alert.text(), "alert": alert.to_json()}, self._token, self.timeout)


class AlertmanagerReceiver(_HttpReceiver):
    """POST /api/v2/alerts, with the labels the shipped rules give the same incident (one alert in
    Alertmanager whichever reports it). A firing alert is sent again every `refresh_seconds` with an end
    `expire_seconds` ahead, as Prometheus does: Alertmanager resolves an alert nobody refreshes, so a hang
    must not read as over because the daemon said it once, and a dead daemon's alerts end by themselves
    (StallWatchdogDown says why). A new severity is a new alert: the old one is resolved first."""

    refresh_seconds = 60.0
    expire_seconds = 300.0

    def __init__(self, cfg: ReceiverConfig):
        super().__init__(cfg)
        self._url = self._url._replace(path=self._url.path.rstrip("/") + "/api/v2/alerts")
        self._labels: dict[str, dict[str, str]] = {}  # each firing episode's labels as last sent

    def send(self, alert: Alert) -> None:
        labels = alert.labels()
        annotations = {"summary": alert.summary, "culprit": alert.culprit, "bundle": alert.bundle or "",
                       "runbook_url": alert.runbook_url, **({"action": alert.action} if alert.action else {})}
        body: list[dict[str, object]] = []
        before = self._labels.get(alert.key)
        if before is not None and before != labels:  # escalated: end the warning, then fire the critical
            body.append({"labels": before, "annotations": annotations, "startsAt": iso_time(alert.onset),
                         "endsAt": iso_time(alert.at)})
        ends = alert.at if alert.status == "resolved" else time.time() + self.expire_seconds
        body.append({"labels": labels, "annotations": {k: v for k, v in annotations.items() if v},
                     "startsAt": iso_time(alert.onset), "endsAt": iso_time(ends)})
        _post(self._url, body, self._token, self.timeout)
        if alert.status == "resolved":
            self._labels.pop(alert.key, None)
        else:
            self._labels[alert.key] = labels


class CoordinatorReceiver(_HttpReceiver):
    """`stall-watchdog coordinate`'s POST /v1/alerts, told once of each critical hang of a known training job:
    `{"training_job": ..., "slurm_job_id": ...}` (or "namespace" and "pod"), the ids this daemon proved
    (slurmstepd's cgroup, the kubelet; never what a rank's environment claims). The coordinator finds the job's
    nodes (from Slurm or Kubernetes with them) and dumps them all without waiting for a scrape, the rules'
    evaluation and Alertmanager's group_wait. Its own cooldown makes the pages of a job's other nodes one
    investigation."""

    def __init__(self, cfg: ReceiverConfig):
        super().__init__(cfg)
        base = self._url.path.rstrip("/").removesuffix("/v1/alerts")  # the base URL, or its endpoint given whole
        self._url = self._url._replace(path=base + "/v1/alerts")

    @staticmethod
    def wants(alert: Alert) -> bool:
        return (alert.status == "firing" and alert.severity is Severity.CRITICAL and alert.identity.gpu is None
                and alert.identity.training_job != "unknown")

    def send(self, alert: Alert) -> None:
        _post(self._url, {"training_job": alert.identity.training_job, **self.ids(alert.identity.workload)},
              self._token, self.timeout)

    @staticmethod
    def ids(workload: Workload) -> dict[str, str]:
        """The workload's proven ids the coordinator asks a scheduler with: its Slurm job; its pod and namespace."""
        proven = {name: value for name, value in workload.label_values().items() if name not in workload.claimed}
        pod = {"namespace": proven["namespace"], "pod": proven["pod"]} if "namespace" in proven and "pod" in proven \
            else {}
        return {**({"slurm_job_id": proven["slurm_job_id"]} if "slurm_job_id" in proven else {}), **pod}


class CommandReceiver:
    """Runs argv (no shell) with the alert JSON on stdin and the bundle path as the last argument, in an
    environment without the daemon's secrets (watchdog/boundary/children.py)."""

    def __init__(self, cfg: ReceiverConfig):
        self.name, self.timeout = cfg.name, cfg.timeout_seconds
        self.min_severity: str = cfg.min_severity
        if not cfg.argv:
            raise ValueError(f"receiver {cfg.name}: a command needs argv")
        self.argv = list(cfg.argv)

    def send(self, alert: Alert) -> None:
        """In a session of its own, so a timeout kills the command and every child it started."""
        try:
            children.run([*self.argv, alert.bundle or ""], json.dumps(alert.to_json()), self.timeout)
        except children.CommandError as exc:
            raise DeliveryError(str(exc)) from None


def build_receiver(cfg: ReceiverConfig) -> Receiver:
    if cfg.type == "webhook":
        return WebhookReceiver(cfg)
    if cfg.type == "alertmanager":
        return AlertmanagerReceiver(cfg)
    if cfg.type == "coordinator":
        return CoordinatorReceiver(cfg)
    return CommandReceiver(cfg)


def build_receivers(cfg: AlertsConfig) -> list[Receiver]:
    return [build_receiver(r) for r in cfg.receivers]


class _Lane:
    """One receiver's queue and worker."""

    def __init__(self, receiver: Receiver, cfg: AlertsConfig, counters: Counters, stop: threading.Event):
        self.receiver, self.cfg, self.counters, self.stop = receiver, cfg, counters, stop
        self.queue: queue.Queue[Alert | None] = queue.Queue(maxsize=256)
        self.sent: set[tuple[str, str, str, str]] = set()  # (key, status, severity, action) already accepted
        self.recent: deque[float] = deque()
        self.up = True  # the receiver's guard: False after its last delivery raised something unexpected
        self.thread = threading.Thread(target=self._work, name=f"alerts-{receiver.name}", daemon=True)
        self.thread.start()

    def offer(self, alert: Alert) -> None:
        name = self.receiver.name
        if _SEVERITY_RANK[alert.severity.value] < _SEVERITY_RANK[self.receiver.min_severity]:
            return
        wants: Callable[[Alert], bool] | None = getattr(self.receiver, "wants", None)
        if wants is not None and not wants(alert):
            return
        identity = (alert.key, alert.status, alert.severity.value, alert.action)
        if identity in self.sent:
            self.counters.inc("alerts_total", name, "deduplicated")
            return
        now = time.monotonic()
        while self.recent and now - self.recent[0] > 60:
            self.recent.popleft()
        if alert.status == "firing" and len(self.recent) >= self.cfg.rate_limit_per_minute:
            self.counters.inc("alerts_total", name, "rate_limited")
            logfmt.event("alert_dropped", level=logfmt.WARNING, receiver=name, reason="rate limit", key=alert.key)
            return
        try:
            self.queue.put_nowait(alert)
        except queue.Full:
            self.counters.inc("alerts_total", name, "dropped")
            return
        self.sent.add(identity)
        self.recent.append(now)

    def _work(self) -> None:
        refresh: float | None = getattr(self.receiver, "refresh_seconds", None)
        firing: dict[str, Alert] = {}  # what this receiver is told again every `refresh` seconds
        due = time.monotonic() + refresh if refresh else None
        while True:
            try:
                alert = self.queue.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:
                self._refresh(list(firing.values()))
                due = time.monotonic() + (refresh or 0.0)
                continue
            if alert is None:
                return
            if refresh:
                if alert.status == "firing":
                    firing[alert.key] = alert
                else:
                    firing.pop(alert.key, None)
            self._guarded(self._deliver, alert)

    def _guarded(self, deliver: Callable[[Alert], bool], alert: Alert) -> None:
        try:
            self.up = deliver(alert)
        except Exception as exc:  # the receiver's guard: a bug costs this alert, never the worker
            self.up = False
            self.counters.inc("alerts_total", self.receiver.name, "failed")
            self.counters.inc("component_errors_total", f"receiver_{self.receiver.name}")
            logfmt.event("alert_failed", level=logfmt.ERROR, receiver=self.receiver.name, key=alert.key,
                         error=type(exc).__name__)

    def _refresh(self, alerts: list[Alert]) -> None:
        """Tell the receiver again of every alert still firing: one attempt each, counted as refreshed."""
        for alert in alerts:
            if self.stop.is_set():
                return
            self._guarded(self._send_again, alert)

    def _send_again(self, alert: Alert) -> bool:
        try:
            self.receiver.send(alert)
        except DeliveryError as exc:
            self.counters.inc("alerts_total", self.receiver.name, "failed")
            logfmt.event("alert_refresh_failed", level=logfmt.WARNING, receiver=self.receiver.name, key=alert.key,
                         error=str(exc))
            return False
        self.counters.inc("alerts_total", self.receiver.name, "refreshed")
        return True

    def _deliver(self, alert: Alert) -> bool:
        name = self.receiver.name
        delay = self.cfg.backoff_seconds
        for attempt in range(1, self.cfg.max_attempts + 1):
            try:
                self.receiver.send(alert)
            except DeliveryError as exc:
                logfmt.event("alert_attempt_failed", level=logfmt.WARNING, receiver=name, key=alert.key,
                             status=alert.status, attempt=attempt, error=str(exc))
                if attempt == self.cfg.max_attempts or self.stop.wait(delay):
                    break
                delay *= 2
                continue
            self.counters.inc("alerts_total", name, "sent")
            logfmt.event("alert_sent", receiver=name, key=alert.key, status=alert.status,
                         severity=alert.severity.value)
            return True
        self.counters.inc("alerts_total", name, "failed")
        logfmt.event("alert_failed", level=logfmt.ERROR, receiver=name, key=alert.key, status=alert.status)
        return False


class AlertDispatcher:
    def __init__(self, cfg: AlertsConfig, counters: Counters, receivers: list[Receiver] | None = None):
        self._stop = threading.Event()
        self.lanes = [_Lane(r, cfg, counters, self._stop) for r in (receivers if receivers is not None
                                                                    else build_receivers(cfg))]

    def receiver_up(self) -> dict[str, bool]:
        """Each receiver's guard, for component_up{component="receiver_<name>"}."""
        return {f"receiver_{lane.receiver.name}": lane.up for lane in self.lanes}

    def submit(self, alert: Alert) -> None:
        """Never blocks: each receiver's lane takes it or counts it as dropped."""
        for lane in self.lanes:
            lane.offer(alert)

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued within `timeout`, then stop retrying."""
        for lane in self.lanes:
            with contextlib.suppress(queue.Full):
                lane.queue.put_nowait(None)
        deadline = time.monotonic() + timeout
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
