"""`stall-watchdog coordinate`'s section: the job-wide service's Prometheus, listener, node credentials and
limits. Its flags, where given, override these; both are checked by the same bounds."""

from __future__ import annotations

import re
from typing import Literal

from watchdog.boundary.http_client import valid_instance
from watchdog.config.base import _listen_address, _prometheus_url, _Section
from watchdog.config.schema import Field, field_validator, model_validator
from watchdog.vocabulary.model import K8S_NAME

# The labels that name a pod's job: a Job's, a JobSet's, a Kubeflow PyTorchJob's, a LeaderWorkerSet's.
JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name", "jobset.sigs.k8s.io/jobset-name",
              "training.kubeflow.org/job-name", "leaderworkerset.sigs.k8s.io/name")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DAEMON_SCRAPE_JOB = "stall-watchdog"  # the scrape job deploy/ gives the daemons (Prometheus's `job` label)


class KubernetesLookupConfig(_Section):
    """Where the coordinator asks Kubernetes for a job's nodes (a page that names a pod of the job)."""

    api_url: str | None = Field(None, description="The API server (in a pod: https://kubernetes.default.svc); "
                                "unset: Kubernetes is not asked.")
    token_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/token", description="The service "
                            "account token; its role must get and list pods (the job's namespaces, the daemons').")
    ca_file: str | None = Field("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                                description="The API server's CA bundle (null: the system's).")
    daemon_namespace: str = Field("stall-watchdog", min_length=1, max_length=63,
                                  description="Where the daemons' DaemonSet runs.")
    daemon_selector: str = Field("app.kubernetes.io/name=stall-watchdog", min_length=1, max_length=500,
                                 description="The label selector of the daemons' pods.")
    daemon_port: int = Field(9944, ge=1, le=65535, description="The port of each daemon pod's endpoint "
                             "(export.listen_address).")
    job_labels: list[str] = Field(
        list(JOB_LABELS), min_length=1, max_length=32, description="The labels that name a pod's job, the first a "
        "pod carries used: its job's pods are those with the same value.")

    _url = field_validator("api_url")(classmethod(lambda cls, value: _prometheus_url(value)))

    @field_validator("daemon_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not K8S_NAME.match(value):
            raise ValueError("expected a Kubernetes namespace name (lower-case letters, digits, '-' and '.')")
        return value

    @field_validator("job_labels")
    @classmethod
    def _label_keys(cls, value: list[str]) -> list[str]:
        for key in value:
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a Kubernetes label key (an optional prefix/ and a name)")
        return value


class CoordinatorConfig(_Section):
    """The job-wide coordinator (`stall-watchdog coordinate`); its command-line flags override these keys."""

    prometheus_url: str | None = Field(
        None, description="Prometheus base URL (its HTTP API), asked which daemons export a job's ranks; "
        "required to coordinate (here or --prometheus) unless slurm_instance or kubernetes.api_url is set.")
    slurm_instance: str | None = Field(
        None, max_length=300, description="Ask Slurm (squeue, scontrol) for the nodes of a job whose request names "
        "its Slurm job (a node's own page does), and reach each node's daemon at this host:port, `{node}` standing "
        "for Slurm's NodeName: `{node}:9944`. Neither a scrape nor Prometheus is waited for; Prometheus is still "
        "asked where Slurm cannot answer. Unset: Slurm is not asked.")
    slurm_conf: str | None = Field(None, description="The slurm.conf squeue and scontrol read (SLURM_CONF); unset: "
                                   "Slurm's own default.")
    kubernetes: KubernetesLookupConfig = Field(default_factory=KubernetesLookupConfig,
                                               description="Asking Kubernetes for a job's nodes.")
    listen_address: str = Field("127.0.0.1:9945", description="Where POST /v1/alerts is served (HOST:PORT).")
    out_directory: str = Field("/var/lib/stall-watchdog/jobs", min_length=1, description="Job bundles go here.")
    node_scheme: Literal["http", "https"] = Field(
        "http", description="How the daemons' endpoints (their export.listen_address) are reached.")
    node_token_file: str | None = Field(None, description="Bearer token for the daemons' POST /v1/dump "
                                        "(their dump.token_file).")
    node_ca_file: str | None = Field(None, description="CA bundle to trust with node_scheme https.")
    scrape_job: str = Field(DAEMON_SCRAPE_JOB, min_length=1, max_length=200,
                            description="The daemons' Prometheus scrape job (its `job` label): only its instances "
                            "are asked, and given the node token.")
    allow_nodes: list[str] = Field(
        [], max_length=1024, description="Ask only these nodes: a host, a host:port or an IP network such as "
        "10.0.0.0/8 each (empty: every instance of scrape_job).")
    token_file: str | None = Field(None, description="Bearer token callers (Alertmanager's "
                                   "http_config.authorization) must present; this or basic_auth_user is "
                                   "required with node_token_file, and off loopback.")
    basic_auth_user: str | None = Field(None, description="Basic auth user for callers (with "
                                        "basic_auth_password_file).")
    basic_auth_password_file: str | None = Field(None, description="The basic auth password, from this file.")
    max_per_minute: int = Field(30, ge=1, le=10_000, description="Investigations started a minute at most; more "
                                "are answered 429.")
    timeout_seconds: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False,
                                   description="How long one node may take to answer, the whole exchange.")
    cooldown_seconds: float = Field(120.0, ge=0, le=86_400, allow_inf_nan=False,
                                    description="A job investigated this recently is not investigated again.")

    _url = field_validator("prometheus_url")(classmethod(lambda cls, value: _prometheus_url(value)))
    _address = field_validator("listen_address")(classmethod(lambda cls, value: _listen_address(value)))

    @field_validator("scrape_job")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError("expected a Prometheus job name of printable characters")
        return value

    @field_validator("slurm_instance")
    @classmethod
    def _instance_template(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value.count("{node}") != 1 or not valid_instance(value.replace("{node}", "node-1")):
            raise ValueError("expected host:port, {node} in the host once (Slurm's node name), a port from 1 to "
                             "65535: {node}:9944 or {node}.cluster.example:9944 (no scheme, user or path)")
        return value

    @model_validator(mode="after")
    def _both_halves(self) -> CoordinatorConfig:
        if bool(self.basic_auth_user) != bool(self.basic_auth_password_file):
            raise ValueError("basic_auth_user and basic_auth_password_file go together")
        return self
