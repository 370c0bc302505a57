"""The Helm chart (charts/rtx-serve): lint, render and validate offline, for the default values and the blue/green,
canary and KEDA variants in charts/rtx-serve/ci/.

Core kinds are validated strictly against the Kubernetes OpenAPI schemas bundled with kubernetes-validate, for the
oldest Kubernetes the chart supports and the newest the package knows. Custom resources (ServiceMonitor, Rollout,
AnalysisTemplate, ScaledObject, ExternalSecret, PrometheusRule) have no schema there, so their required fields are
checked here.
helm comes from scripts/setup.sh (.tools/bin/helm).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from rtxcore.cli.main import build_parser
from rtxcore.cli.serve import fleet_settings
from rtxcore.server.serve_config import load_serve_config
from tests.helpers import REPO

CHART = REPO / "charts" / "rtx-serve"
HELM = REPO / ".tools" / "bin" / "helm"
BROKEN_VALUES = REPO / "tests" / "charts" / "helm-values" / "canary-weight-150.yaml"
VARIANTS = ("default", "bluegreen", "canary", "keda")
# The chart's kubeVersion floor, and the newest schemas kubernetes-validate bundles.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CORE_API_GROUPS = ("v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1")
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    # Its rules are checked by promtool (tests/charts/test_alert_rules.py).
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("argoproj.io/v1alpha1", "Rollout"),
    ("argoproj.io/v1alpha1", "AnalysisTemplate"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("external-secrets.io/v1", "ExternalSecret"),
}


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.is_file():
        pytest.fail(f"helm is not installed at {HELM}: run scripts/setup.sh")
    return HELM


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], check=False, capture_output=True, text=True, timeout=120)


def render(helm: Path, variant: str, *sets: str) -> list[dict]:
    args = ["template", "rtx", str(CHART), "--namespace", "serving", "-f", str(CHART / "ci" / f"{variant}-values.yaml")]
    for s in sets:
        args += ["--set", s]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return by_kind(docs, "Deployment") + by_kind(docs, "Rollout")


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- lint and schemas --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint(helm, variant):
    result = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(CHART / "ci" / f"{variant}-values.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_core_kinds_validate_against_kubernetes_schemas(helm, variant):
    docs = render(helm, variant)
    core = [d for d in docs if d["apiVersion"] in CORE_API_GROUPS]
    assert {(d["apiVersion"], d["kind"]) for d in docs} - {(d["apiVersion"], d["kind"]) for d in core} <= CRD_KINDS
    for version in K8S_VERSIONS:
        for doc in core:
            # strict: a misspelt or misplaced field is an error, not silently dropped by the API server.
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_manifests_pass_yamllint(helm, variant):
    result = run_helm(helm, "template", "rtx", str(CHART), "-f", str(CHART / "ci" / f"{variant}-values.yaml"))
    config = YamlLintConfig("extends: default\nrules: {line-length: disable, document-start: disable, "
                            "indentation: {indent-sequences: whatever}, comments: {min-spaces-from-content: 1}}")
    problems = [p for p in linter.run(result.stdout, config) if p.level == "error"]
    assert not problems, "\n".join(f"{p.line}:{p.column} {p.message}" for p in problems)


def test_values_schema_rejects_canary_weight_over_100(helm):
    for command in ("lint", "template"):
        result = run_helm(helm, command, "rtx", str(CHART), "-f", str(BROKEN_VALUES)) if command == "template" \
            else run_helm(helm, command, str(CHART), "-f", str(BROKEN_VALUES))
        assert result.returncode != 0
        assert "at '/canary/weight': maximum: got 150, want 100" in result.stdout + result.stderr


@pytest.mark.parametrize("bad, where", [
    ("strategy=blue", "/strategy"),
    ("apiKeys.keys=tenant=secret", "/apiKeys"),  # keys in clear have no place in values
    ("signing.requireSignedModels=true", "/signing/publicKeySecret"),
    ("autoscaling.mode=cpu", "/autoscaling/mode"),
    ("canary.extraSteps={50,0}", "/canary/extraSteps/1"),
    ("server.forwardedAllowIps={ingress-nginx}", "/server/forwardedAllowIps/0"),
])
def test_values_schema_names_the_bad_value(helm, bad, where):
    result = run_helm(helm, "template", "rtx", str(CHART), "--set", bad)
    assert result.returncode != 0
    assert f"at '{where}'" in result.stderr


# -- the workload ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_container_args_are_accepted_by_rtx_serve(helm, variant):
    for workload in workloads(render(helm, variant)):
        args = build_parser().parse_args(container(workload)["args"])
        assert args.command == "serve" and args.host == "0.0.0.0"
        assert args.config == "/etc/rtx-serve/config/serve.toml"


def test_trusted_proxies_reach_rtx_serve(helm):
    """Behind the Ingress, per-address limits need the clients' own addresses (docs/deployment.md)."""
    (workload,) = workloads(render(helm, "default", "server.forwardedAllowIps={10.0.0.0/8,fd00::/8}"))
    args = build_parser().parse_args(container(workload)["args"])
    assert args.forwarded_allow_ips == ["10.0.0.0/8,fd00::/8"]
    (default,) = workloads(render(helm, "default"))
    assert build_parser().parse_args(container(default)["args"]).forwarded_allow_ips is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_ask_for_gpus_probe_ready_and_health_and_outlast_the_drain(helm, variant):
    for workload in workloads(render(helm, variant)):
        pod = workload["spec"]["template"]["spec"]
        c = container(workload)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["affinity"]["podAntiAffinity"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        args: argparse.Namespace = build_parser().parse_args(c["args"])
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop + args.shutdown_grace


def test_serving_config_map_is_a_valid_serve_config(helm, tmp_path):
    config_map = one(render(helm, "default"), "ConfigMap", "rtx-rtx-serve-config")
    path = tmp_path / "serve.toml"
    path.write_text(config_map["data"]["serve.toml"])
    config = load_serve_config(path)  # the server's own parser: unknown sections or settings raise
    assert config.lanes["realtime"].ttft_target_s == 0.5
    assert "brownout" in config.scheduler_options


def test_pod_disruption_budget_and_metrics_scrape_cover_every_pod(helm):
    for variant in VARIANTS:
        docs = render(helm, variant)
        for workload in workloads(docs):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert any(labels_match(p["spec"]["selector"]["matchLabels"], labels)
                       for p in by_kind(docs, "PodDisruptionBudget"))
            metrics_service = one(docs, "Service", "rtx-rtx-serve-metrics")
            assert labels_match(metrics_service["spec"]["selector"], labels)
        monitor = one(docs, "ServiceMonitor")
        assert labels_match(monitor["spec"]["selector"]["matchLabels"], one(docs, "Service", "rtx-rtx-serve-metrics")
                            ["metadata"]["labels"])
        assert monitor["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}


# -- blue/green --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("active, idle", [("blue", "green"), ("green", "blue")])
def test_blue_green_service_selects_the_active_colour(helm, active, idle):
    docs = render(helm, "bluegreen", f"blueGreen.activeColor={active}")
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    assert set(deployments) == {"rtx-rtx-serve-blue", "rtx-rtx-serve-green"}
    for service_name, colour in (("rtx-rtx-serve", active), ("rtx-rtx-serve-preview", idle)):
        selector = one(docs, "Service", service_name)["spec"]["selector"]
        selected = [name for name, d in deployments.items()
                    if labels_match(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert selected == [f"rtx-rtx-serve-{colour}"]
    assert container(deployments["rtx-rtx-serve-blue"])["image"].endswith(":0.1.0")
    assert container(deployments["rtx-rtx-serve-green"])["image"].endswith(":0.2.0")
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == f"rtx-rtx-serve-{active}"
    # The idle colour stays warm at idleReplicas; the active one always states its count (see deployment.yaml).
    assert deployments[f"rtx-rtx-serve-{idle}"]["spec"]["replicas"] == 2
    assert deployments[f"rtx-rtx-serve-{active}"]["spec"]["replicas"] >= 2


# -- canary ------------------------------------------------------------------------------------------------------


def test_canary_rollout_steps_and_analysis(helm):
    docs = render(helm, "canary")
    assert not by_kind(docs, "Deployment")
    rollout = one(docs, "Rollout")
    assert rollout["apiVersion"] == "argoproj.io/v1alpha1"
    spec = rollout["spec"]
    assert labels_match(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
    canary = spec["strategy"]["canary"]
    weights = [s["setWeight"] for s in canary["steps"] if "setWeight" in s]
    assert weights == [10, 25, 50, 75]
    assert all("duration" in s["pause"] for s in canary["steps"] if "pause" in s)
    services = {s["metadata"]["name"] for s in by_kind(docs, "Service")}
    assert {canary["stableService"], canary["canaryService"]} <= services
    assert canary["trafficRouting"]["nginx"]["stableIngress"] == one(docs, "Ingress")["metadata"]["name"]

    template = one(docs, "AnalysisTemplate", canary["analysis"]["templates"][0]["templateName"])
    assert {a["name"] for a in template["spec"]["args"]} == {a["name"] for a in canary["analysis"]["args"]}
    metrics = {m["name"]: m for m in template["spec"]["metrics"]}
    assert set(metrics) == {"ttft-p95-ratio", "error-ratio-increase"}
    for metric in metrics.values():
        query = metric["provider"]["prometheus"]["query"]
        # The canary's series against stable's, told apart by the pod-template hash the ServiceMonitor copies.
        assert '"{{args.canary-hash}}"' in query and '"{{args.stable-hash}}"' in query
        assert metric["successCondition"] and metric["failureCondition"] and metric["failureLimit"] >= 1
    assert "rtx_time_to_first_token_seconds_bucket" in metrics["ttft-p95-ratio"]["provider"]["prometheus"]["query"]
    assert metrics["ttft-p95-ratio"]["failureCondition"] == "result[0] > 1.2"
    assert "rollouts-pod-template-hash" in one(docs, "ServiceMonitor")["spec"]["podTargetLabels"]
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"] == {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": rollout["metadata"]["name"]}


# -- autoscaling -------------------------------------------------------------------------------------------------


def test_hpa_scales_on_queue_depth_and_p95_through_the_shipped_adapter_rules(helm):
    docs = render(helm, "default")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {"rtx_num_requests_waiting", "rtx_ttft_p95_seconds"}
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 60
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]

    rules = yaml.safe_load(one(docs, "ConfigMap", "rtx-rtx-serve-adapter-rules")["data"]["config.yaml"])["rules"]
    assert {r["name"]["as"] for r in rules} == names
    p95 = next(r for r in rules if r["name"]["as"] == "rtx_ttft_p95_seconds")
    assert p95["seriesQuery"].startswith("rtx_time_to_first_token_seconds_bucket{")
    assert p95["metricsQuery"].startswith("histogram_quantile(0.95,")


def test_hpa_can_follow_one_lanes_latency(helm):
    docs = render(helm, "default", "autoscaling.latencyLane=realtime")
    rules = yaml.safe_load(one(docs, "ConfigMap", "rtx-rtx-serve-adapter-rules")["data"]["config.yaml"])["rules"]
    p95 = next(r for r in rules if r["name"]["as"] == "rtx_ttft_p95_seconds")
    assert p95["seriesQuery"].startswith("rtx_lane_time_to_first_token_seconds_bucket{")
    assert 'lane="realtime"' in p95["metricsQuery"]


@pytest.mark.parametrize(("variant", "mode"), [("default", "hpa"), ("keda", "keda"), ("bluegreen", "hpa")])
def test_every_pods_dashboard_reads_the_peers_the_autoscaler_counts(helm, variant, mode):
    docs = render(helm, variant)
    peers = one(docs, "Service", "rtx-rtx-serve-peers")
    assert peers["spec"]["clusterIP"] == "None"
    # The pods the autoscaler scales: for blue/green, the active colour's only.
    target = one(docs, "Deployment") if variant != "bluegreen" else one(docs, "Deployment", "rtx-rtx-serve-blue")
    assert labels_match(peers["spec"]["selector"], target["spec"]["template"]["metadata"]["labels"])
    for workload in workloads(docs):
        args = build_parser().parse_args(container(workload)["args"])
        settings = fleet_settings(args)  # the server's own reading of the flags: a bad one raises
        assert settings.peers == ("rtx-rtx-serve-peers",) and settings.mode == mode
        assert (settings.min_replicas, settings.max_replicas) == (2, 8)
        assert settings.target_queue_depth == 4 and settings.target_ttft_p95_s == 2
    docs = render(helm, "default", "autoscaling.enabled=false")
    assert not [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-peers")]
    assert "--fleet-peers" not in " ".join(container(one(docs, "Deployment"))["args"])


def test_keda_scaled_object(helm):
    docs = render(helm, "keda")
    assert not by_kind(docs, "HorizontalPodAutoscaler")
    scaled = one(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert spec["minReplicaCount"] == 2 and spec["maxReplicaCount"] == 8
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"queue-depth", "ttft-p95"}
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
        float(trigger["metadata"]["threshold"])
    assert "rtx_num_requests_waiting" in triggers["queue-depth"]["metadata"]["query"]
    p95_query = triggers["ttft-p95"]["metadata"]["query"]
    assert "rtx_lane_time_to_first_token_seconds_bucket" in p95_query and 'lane="realtime"' in p95_query


# -- secrets -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_secrets_are_only_referenced(helm, variant):
    docs = render(helm, variant)
    assert not by_kind(docs, "Secret"), "the chart must never carry secret material"
    for workload in workloads(docs):
        env = {e["name"]: e for e in container(workload).get("env", [])}
        if "RTX_API_KEYS" in env:
            assert set(env["RTX_API_KEYS"]) == {"name", "valueFrom"}
            assert env["RTX_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "RTX_API_KEYS"


def test_api_keys_from_an_external_secret_store(helm):
    docs = render(helm, "keda")
    external = one(docs, "ExternalSecret")
    spec = external["spec"]
    assert spec["secretStoreRef"] == {"name": "vault", "kind": "ClusterSecretStore"}
    assert spec["data"] == [{"secretKey": "RTX_API_KEYS",
                             "remoteRef": {"key": "rtx-serve/api-keys", "property": "RTX_API_KEYS"}}]
    ref = {e["name"]: e for e in container(one(docs, "Deployment"))["env"]}["RTX_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == spec["target"]["name"]


def test_signing_public_key_comes_from_a_secret_and_strict_mode_is_passed_on(helm):
    docs = render(helm, "canary")
    workload = one(docs, "Rollout")
    args = build_parser().parse_args(container(workload)["args"])
    assert args.require_signed_models
    assert args.signing_public_key == "/etc/rtx-serve/signing/signing-key.pub"
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["signing-key"]["secret"]["secretName"] == "rtx-model-signing"
    # Without strict mode, a configured key still makes unsigned models load with a warning.
    args = build_parser().parse_args(container(one(render(helm, "keda"), "Deployment"))["args"])
    assert not args.require_signed_models and args.signing_public_key


def test_tls_and_mutual_tls_reach_both_servers_probes_and_the_scrape(helm):
    docs = render(helm, "default", "tls.secretName=rtx-tls", "authFiles.configMap=rtx-jwks")
    workload = one(docs, "Deployment")
    c = container(workload)
    args = build_parser().parse_args(c["args"])
    assert (args.ssl_certfile, args.ssl_keyfile, args.ssl_cert_reqs) == (
        "/etc/rtx-serve/tls/tls.crt", "/etc/rtx-serve/tls/tls.key", "none")
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS" and c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "rtx-tls"
    assert volumes["auth-files"]["configMap"]["name"] == "rtx-jwks"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["auth-files"] == "/etc/rtx-serve/auth" and mounts["tls"] == "/etc/rtx-serve/tls"
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["scheme"] == "https"
    # Client certificates required: the CA goes to the server, and the kubelet (no certificate) probes the port.
    docs = render(helm, "default", "tls.secretName=rtx-tls", "tls.clientCertificates=required")
    c = container(one(docs, "Deployment"))
    args = build_parser().parse_args(c["args"])
    assert (args.ssl_ca_certs, args.ssl_cert_reqs) == ("/etc/rtx-serve/tls/ca.crt", "required")
    assert "tcpSocket" in c["readinessProbe"] and "httpGet" not in c["livenessProbe"]
    # Required client certificates without a certificate of the server's own: refused by the values schema.
    result = run_helm(helm, "template", "rtx", str(CHART), "--set", "tls.clientCertificates=required")
    assert result.returncode != 0 and "/tls/secretName" in result.stderr


# -- dashboard ---------------------------------------------------------------------------------------------------


def test_grafana_dashboard_uses_only_documented_metrics(helm):
    dashboard_map = one(render(helm, "default"), "ConfigMap", "rtx-rtx-serve-dashboard")
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_map["data"]["rtx-serve.json"])
    documented = set(re.findall(r"`(rtx_[a-z0-9_]+)`", (REPO / "docs" / "metrics.md").read_text()))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\brtx_[a-z0-9_]+", e)}
    assert used and used <= documented, used - documented
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert titles == {"Latency and traffic", "Lanes", "Brownout", "Autoscaling", "KV cache", "KV cache tiers"}


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "rtx-serve"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
