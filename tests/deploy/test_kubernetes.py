"""deploy/kubernetes: the manifests validate against the Kubernetes API schemas (kubernetes-validate,
offline), and keep their promises: least privilege and no less, probes, limits, the ConfigMap made from
config.example.yaml and the PrometheusRule from rules.yml. The kustomize base renders with the real
`kubectl kustomize` (offline): namespace first, one image override for both containers, the Prometheus
Operator objects only when their component is asked for."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO, need_tool
from watchdog.config import Config, parse_config

KUBE = REPO / "deploy" / "kubernetes"
OPERATOR = KUBE / "prometheus-operator"
PLAIN = sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict)
    return document


def pod_spec() -> dict[str, Any]:
    return load(KUBE / "daemonset.yaml")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def main_container() -> dict[str, Any]:
    [container] = [c for c in pod_spec()["containers"] if c["name"] == "stall-watchdog"]
    return container


def pod_config() -> Config:
    return parse_config(yaml.safe_load(load(KUBE / "configmap.yaml")["data"]["config.yaml"]), "configmap.yaml")


@pytest.mark.parametrize("path", PLAIN, ids=[p.name for p in PLAIN])
def test_each_manifest_validates_against_the_kubernetes_api(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    assert tuple(map(int, version.split(".")[:2])) >= (1, 30)
    kubernetes_validate.validate(load(path), version, strict=True)


def test_the_validator_catches_a_broken_daemonset() -> None:
    broken = copy.deepcopy(load(KUBE / "daemonset.yaml"))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = "SYS_PTRACE"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(load(KUBE / "daemonset.yaml"))
    broken["spec"]["template"]["spec"]["hostPid"] = True  # a misspelt field, caught by strict validation
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_least_privilege_and_no_less() -> None:
    spec = pod_spec()
    assert spec["hostPID"] is True  # NVML's pids are the host's
    assert "hostNetwork" not in spec and "hostIPC" not in spec
    assert spec["runtimeClassName"] == "nvidia" and spec["automountServiceAccountToken"] is False
    for container in spec["containers"] + spec["initContainers"]:
        security = container["securityContext"]
        assert security.get("privileged", False) is False and security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
        requested = {**container["resources"].get("limits", {}), **container["resources"].get("requests", {})}
        assert not any(name.startswith("nvidia.com/") for name in requested)  # sees every GPU, holds none
    assert main_container()["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE", "DAC_READ_SEARCH"]
    assert "add" not in spec["initContainers"][0]["securityContext"]["capabilities"]  # the doctor needs none
    mounts = {m["name"]: m for m in main_container()["volumeMounts"]}
    assert mounts["sys"]["readOnly"] is True and mounts["sys"]["mountPath"] == "/sys"
    assert mounts["pod-resources"]["readOnly"] is True and mounts["config"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["bundles"]["hostPath"]["path"] == "/var/lib/stall-watchdog"
    assert {name for name, m in mounts.items() if not m.get("readOnly")} == {"bundles", "tmp"}


def test_the_doctor_never_keeps_the_daemon_from_starting(tmp_path: Path) -> None:
    [doctor] = pod_spec()["initContainers"]
    command = doctor["command"]
    assert command[:2] == ["/bin/sh", "-c"] and "stall-watchdog doctor" in command[2]
    fake = tmp_path / "stall-watchdog"
    fake.write_text("#!/bin/sh\necho 'error: P2P broken'\nexit 4\n")  # a node with an error finding
    fake.chmod(0o755)
    run = subprocess.run(command, capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert run.returncode == 0 and "doctor exited 4" in run.stdout


def test_probes_limits_and_ports_agree_with_the_config() -> None:
    container, config = main_container(), pod_config()
    [port] = container["ports"]
    host, _, listen = config.export.listen_address.rpartition(":")
    assert host == "0.0.0.0" and int(listen) == port["containerPort"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    # liveness gives a wedged loop a minute, well past the stale-sample limit of /healthz
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 3 * config.export.stale_after_seconds
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["memory"] == "512Mi" and requests["memory"] == "128Mi"
    # bench/daemon_cost.py: 51 MiB at 64 GPUs, plus py-spy captures of ~8 MiB each, all at once
    assert 51 + 8 * config.stacks.max_parallel <= int(limits["memory"].removesuffix("Mi"))
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(config.kubernetes.pod_resources_socket).parent) in mounts
    assert any(config.bundles.directory.startswith(m + "/") for m in mounts)
    assert Path("/etc/stall-watchdog/config.yaml").parent.as_posix() in mounts
    assert container["args"] == ["run", "--config", "/etc/stall-watchdog/config.yaml"]
    env = {e["name"]: e for e in container["env"]}
    assert config.alerts.node_env == "NODE_NAME"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_configmap_is_config_example_with_only_the_pod_keys_changed(tmp_path: Path) -> None:
    check = subprocess.run([sys.executable, str(KUBE / "render.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    ours, defaults = pod_config().model_dump(), Config().model_dump()
    changed = {(section, key) for section, values in ours.items() for key, value in values.items()
               if defaults[section][key] != value}
    assert changed == {("export", "listen_address"), ("alerts", "node_env")}
    extracted = tmp_path / "config.yaml"
    extracted.write_text(load(KUBE / "configmap.yaml")["data"]["config.yaml"])
    result = subprocess.run([sys.executable, "-m", "watchdog", "check-config", str(extracted)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_prometheus_rule_is_rules_yml(tmp_path: Path) -> None:
    rule = load(OPERATOR / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"] == yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run([need_tool("promtool"), "check", "rules", str(extracted)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_service_monitor_finds_the_pods_and_keeps_their_workload_labels() -> None:
    monitor, service = load(OPERATOR / "servicemonitor.yaml"), load(KUBE / "service.yaml")
    pod_labels = load(KUBE / "daemonset.yaml")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["honorLabels"] is True
    dropped = [r for r in endpoint["relabelings"] if r.get("action") == "labeldrop"]
    assert dropped and all(name in dropped[0]["regex"] for name in ("namespace", "pod", "container"))
    assert {"targetLabel": "job", "replacement": "stall-watchdog"} in endpoint["relabelings"]
    namespaces = {load(p)["metadata"].get("namespace") for p in [*PLAIN, *OPERATOR.glob("*.yaml")]
                  if p.name != "kustomization.yaml"}
    assert namespaces == {None, "stall-watchdog"}  # the Namespace itself has none


def kustomize(tmp: Path, overlay: str | None = None) -> list[dict[str, Any]]:
    """`kubectl kustomize` of the base, or of `overlay` (a kustomization.yaml) beside a copy of deploy/."""
    kubectl = need_tool("kubectl")
    if overlay is None:
        target = KUBE
    else:
        shutil.copytree(REPO / "deploy", tmp / "deploy")
        (tmp / "overlay").mkdir()
        (tmp / "overlay" / "kustomization.yaml").write_text(overlay)
        target = tmp / "overlay"
    done = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_kustomize_base_renders_namespace_first_and_validates(tmp_path: Path) -> None:
    objects = kustomize(tmp_path)
    assert [o["kind"] for o in objects][0] == "Namespace"
    assert {o["kind"] for o in objects} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
    version = kubernetes_validate.latest_version()
    for document in objects:
        kubernetes_validate.validate(document, version, strict=True)
    spec = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in term["matchExpressions"]
    assert {"key": "stall-watchdog.io/disabled", "operator": "DoesNotExist"} in term["matchExpressions"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_one_image_override_and_the_optional_prometheus_operator_component(tmp_path: Path) -> None:
    objects = kustomize(tmp_path, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                                  "resources: [../deploy/kubernetes]\n"
                                  "components: [../deploy/kubernetes/prometheus-operator,\n"
                                  "             ../deploy/kubernetes/grafana]\n"
                                  "images:\n  - name: ghcr.io/stall-watchdog/stall-watchdog\n"
                                  "    newName: registry.example/stall-watchdog\n    newTag: '1.2'\n")
    spec = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    assert images == {"registry.example/stall-watchdog:1.2"}
    assert {"ServiceMonitor", "PrometheusRule"} <= {o["kind"] for o in objects}
    [dashboard] = [o for o in objects if o["metadata"]["name"] == "stall-watchdog-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["stall-watchdog.json"]) == json.loads(
        (REPO / "deploy" / "grafana" / "stall-watchdog.json").read_text())
    kubernetes_validate.validate(dashboard, kubernetes_validate.latest_version(), strict=True)


def test_the_optional_actions_component_grants_the_kubernetes_action_exactly_what_it_uses(tmp_path: Path) -> None:
    """Off by default (the base has no role and mounts no token); with deploy/kubernetes/actions: a cluster
    role with pods get/delete and nodes get/patch bound to the daemon's account, and the token mounted."""
    base = kustomize(tmp_path)
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & {o["kind"] for o in base}
    objects = kustomize(tmp_path, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                                  "resources: [../deploy/kubernetes]\n"
                                  "components: [../deploy/kubernetes/actions]\n")
    version = kubernetes_validate.latest_version()
    for document in objects:
        kubernetes_validate.validate(document, version, strict=True)
    [role] = [o for o in objects if o["kind"] == "ClusterRole"]
    granted = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("pods", "get"), ("pods", "delete"), ("nodes", "get"), ("nodes", "patch")}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    [binding] = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "stall-watchdog", "namespace": "stall-watchdog"}]
    spec = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is True
    [daemon] = [c for c in spec["containers"] if c["name"] == "stall-watchdog"]
    assert daemon["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE", "DAC_READ_SEARCH", "KILL"]
    # The pause switch is the node's /run/stall-watchdog/actions.pause, as the ConfigMap's pause_file says.
    [pause] = [m for m in daemon["volumeMounts"] if m["name"] == "pause"]
    assert pause["readOnly"] is True and pause["mountPath"] == str(Path(pod_config().actions.pause_file or "").parent)
    [volume] = [v for v in spec["volumes"] if v["name"] == "pause"]
    assert volume["hostPath"] == {"path": "/run/stall-watchdog", "type": "DirectoryOrCreate"}
    # The code asks for no more than the role grants: every request the action makes is one of these.
    from watchdog.act import actions
    source = Path(actions.__file__).read_text()
    assert {m for m in ("GET", "DELETE", "PATCH", "POST", "PUT") if f'"{m}"' in source} == {"GET", "DELETE", "PATCH"}
