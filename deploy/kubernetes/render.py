"""Writes the two manifests made from files kept elsewhere, so each fact has one home:

    configmap.yaml                          config.example.yaml, with the few keys a pod needs changed
    prometheus-operator/prometheusrule.yaml deploy/prometheus/rules.yml, as a PrometheusRule
    grafana/dashboard.yaml                  deploy/grafana/stall-watchdog.json, as a ConfigMap for Grafana's
                                            dashboard sidecar (label grafana_dashboard: "1")

    python deploy/kubernetes/render.py          # rewrite both
    python deploy/kubernetes/render.py --check  # exit 1 if either is out of date (the tests run this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HEADER = "# Made by deploy/kubernetes/render.py from {source}: edit that, then run the script.\n"

# (the line in config.example.yaml, the line in the pod's configuration)
POD_CONFIG = (
    ("  listen_address: 127.0.0.1:9944",
     "  listen_address: 0.0.0.0:9944  # Kubernetes: the pod's own address, for Prometheus to scrape"),
    ("  node_env: null",
     "  node_env: NODE_NAME  # Kubernetes: the DaemonSet sets it to the node's name"),
)


def configmap() -> str:
    text = (REPO / "config.example.yaml").read_text()
    for plain, pod in POD_CONFIG:
        if text.count(plain + "\n") != 1:
            raise SystemExit(f"render.py: config.example.yaml has no line {plain.strip()!r} to change; "
                             "update POD_CONFIG")
        text = text.replace(plain + "\n", pod + "\n")
    body = "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())
    return (HEADER.format(source="config.example.yaml")
            + "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: stall-watchdog\n  namespace: stall-watchdog\n"
            + "  labels:\n    app.kubernetes.io/name: stall-watchdog\ndata:\n  config.yaml: |\n" + body)


def prometheus_rule() -> str:
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "stall-watchdog", "namespace": "stall-watchdog",
                     "labels": {"app.kubernetes.io/name": "stall-watchdog"}},
        "spec": rules,
    }
    note = "# Give it the labels your Prometheus's ruleSelector asks for (kube-prometheus-stack: release: NAME).\n"
    return (HEADER.format(source="deploy/prometheus/rules.yml") + note
            + yaml.safe_dump(rule, sort_keys=False, width=120, allow_unicode=True))


def grafana_dashboard() -> str:
    """The dashboard as the ConfigMap Grafana's sidecar loads (kube-prometheus-stack and the Grafana chart
    watch for the label `grafana_dashboard: "1"` in every namespace by default)."""
    text = (REPO / "deploy" / "grafana" / "stall-watchdog.json").read_text()
    body = "".join(f"    {line}\n" for line in text.splitlines())
    return (HEADER.format(source="deploy/grafana/stall-watchdog.json")
            + "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: stall-watchdog-dashboard\n"
            + "  namespace: stall-watchdog\n  labels:\n    app.kubernetes.io/name: stall-watchdog\n"
            + '    grafana_dashboard: "1"\ndata:\n  stall-watchdog.json: |\n' + body)


OUTPUTS = {
    HERE / "configmap.yaml": configmap,
    HERE / "prometheus-operator" / "prometheusrule.yaml": prometheus_rule,
    HERE / "grafana" / "dashboard.yaml": grafana_dashboard,
}


def main(argv: list[str]) -> int:
    stale = [path for path, make in OUTPUTS.items() if not path.exists() or path.read_text() != make()]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(REPO)} is out of date: run python deploy/kubernetes/render.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(OUTPUTS[path]())
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
