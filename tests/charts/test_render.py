"""Every value set lints clean and renders manifests that Kubernetes would accept.

kubernetes-validate has schemas for the built-in kinds only. HTTPRoute (Gateway API) and InferencePool (its
Inference Extension) are validated against the upstream CRDs' schemas and CEL rules (tests/helpers/gateway_api.py);
they, ServiceMonitor, PodMonitor, PrometheusRule (Prometheus operator) and ScaledObject (KEDA) are checked
structurally here, against the objects they point at; their PromQL metric names are checked against live scrapes
in test_dashboard.py.
"""

from __future__ import annotations

import re

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.helpers import gateway_api

KUBE_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
NOT_IN_KUBERNETES_VALIDATE = {
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
    "ScaledObject",
    "HTTPRoute",
    "InferencePool",
}


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind}/{name} among {[d['metadata']['name'] for d in of_kind(docs, kind)]}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_lint_clean(chart_dir, values):
    for kube in KUBE_VERSIONS:
        report = helm.lint(chart_dir, values, strict=True, kube_version=f"v{kube}")
        assert report["errors"] == [] and report["messages"] == [], (kube, report)


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_manifests_pass_kubernetes_validate_strict(manifests, kube):
    unvalidated = set()
    for doc in manifests:
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unvalidated.add(doc["kind"])
            if doc["kind"] in gateway_api.CRD_FILES:  # upstream's own CRD schemas and CEL rules
                assert gateway_api.problems(doc) == [], doc["metadata"]["name"]
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {kube} at {path}: {exc.message}")
    assert unvalidated <= NOT_IN_KUBERNETES_VALIDATE


def test_every_object_is_namespaced_and_labelled(manifests):
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    for doc in manifests:
        meta = doc["metadata"]
        assert len(meta["name"]) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"])
        assert (meta.get("namespace") is None) == (doc["kind"] in cluster_scoped), doc["kind"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "rs"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "ragserve"


def test_services_pdbs_and_policies_select_rendered_pods(manifests):
    pods = [w["spec"]["template"] for w in workloads(manifests)]
    for svc in of_kind(manifests, "Service"):
        matched = [p for p in pods if selects(svc["spec"]["selector"], p["metadata"]["labels"])]
        assert matched, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p["name"] for m in matched for c in m["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for doc in of_kind(manifests, kind):
            key = "selector" if kind == "PodDisruptionBudget" else "podSelector"
            matched = [p for p in pods if selects(doc["spec"][key]["matchLabels"], p["metadata"]["labels"])]
            assert matched, f"{kind} {doc['metadata']['name']} selects no pod"
            if kind == "NetworkPolicy":
                ports = {p["name"] for m in matched for c in m["spec"]["containers"] for p in c["ports"]}
                assert {p["port"] for rule in doc["spec"]["ingress"] for p in rule["ports"]} <= ports


def test_pods_are_locked_down(manifests):
    for w in workloads(manifests):
        pod = w["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False  # else Service env vars named RAGSERVE_* would set flags
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod["volumes"]} | {
                t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])
            }
        # Only the operator and a router watching pods talk to the Kubernetes API.
        if not pod.get("serviceAccountName", "").endswith(("-router", "-operator")):
            assert pod["automountServiceAccountToken"] is False, w["metadata"]["name"]


# The scenario that must render each kind the loops below check: without it they would pass on nothing.
RENDERED_BY = {
    "HorizontalPodAutoscaler": ("hpa", 2),
    "ScaledObject": ("keda", 1),
    "ServiceMonitor": ("monitoring", 2),
    "PodMonitor": ("monitoring", 1),
    "PrometheusRule": ("monitoring", 1),
    "HTTPRoute": ("ingress", 1),
    "InferencePool": ("inference-pool", 1),
}


def assert_checked_kinds_rendered(manifests: list[dict], scenario: str, *kinds: str) -> None:
    for kind in kinds:
        where, count = RENDERED_BY[kind]
        if scenario == where:
            assert len(of_kind(manifests, kind)) == count, (scenario, kind)


def test_scaling_objects_target_rendered_deployments(manifests, scenario):
    assert_checked_kinds_rendered(manifests, scenario, "HorizontalPodAutoscaler", "ScaledObject")
    deployments = {d["metadata"]["name"] for d in of_kind(manifests, "Deployment")}
    for hpa in of_kind(manifests, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] and hpa["spec"]["metrics"]
        assert "replicas" not in named(manifests, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])["spec"]
    for so in of_kind(manifests, "ScaledObject"):
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert spec["scaleTargetRef"]["name"] in deployments
        assert "replicas" not in named(manifests, "Deployment", spec["scaleTargetRef"]["name"])["spec"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert set(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]) == {"scaleUp", "scaleDown"}
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
            assert meta["serverAddress"].startswith("http") and float(meta["threshold"]) > 0
            assert f'pod=~"{spec["scaleTargetRef"]["name"]}-' in meta["query"], meta["query"]


def test_monitors_and_routes_point_at_rendered_objects(manifests, scenario):
    kinds = ("ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute", "InferencePool")
    assert_checked_kinds_rendered(manifests, scenario, *kinds)
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    pods = [w["spec"]["template"] for w in workloads(manifests)]
    for sm in of_kind(manifests, "ServiceMonitor"):
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        targets = [
            s for s in services.values() if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert len(targets) == 1, sm["metadata"]["name"]  # the HTTP / metrics Service, not the registry
        for endpoint in sm["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in targets)
    for pm in of_kind(manifests, "PodMonitor"):
        matched = [p for p in pods if selects(pm["spec"]["selector"]["matchLabels"], p["metadata"]["labels"])]
        assert matched and all(
            e["port"] in {p["name"] for c in m["spec"]["containers"] for p in c["ports"]}
            for e in pm["spec"]["podMetricsEndpoints"]
            for m in matched
        )
    pools = {p["metadata"]["name"] for p in of_kind(manifests, "InferencePool")}
    for route in of_kind(manifests, "HTTPRoute"):
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["spec"]["parentRefs"]
        for backend in (b for rule in route["spec"]["rules"] for b in rule["backendRefs"]):
            if backend.get("kind") == "InferencePool":
                assert backend["group"] == "inference.networking.k8s.io" and backend["name"] in pools
            else:
                assert backend["port"] in {p["port"] for p in services[backend["name"]]["spec"]["ports"]}
    for pool in of_kind(manifests, "InferencePool"):
        epp = pool["spec"]["endpointPickerRef"]
        assert epp["port"]["number"] in {p["port"] for p in services[epp["name"]]["spec"]["ports"]}
        members = [p for p in pods if selects(pool["spec"]["selector"]["matchLabels"], p["metadata"]["labels"])]
        ports = {p["containerPort"] for m in members for c in m["spec"]["containers"] for p in c["ports"]}
        assert members and {t["number"] for t in pool["spec"]["targetPorts"]} <= ports
    for svc in services.values():
        if svc["spec"].get("type", "ClusterIP") != "ClusterIP":  # only the HTTP API may leave the cluster
            assert [p["name"] for p in svc["spec"]["ports"]] == ["http"], svc["metadata"]["name"]
    for rule in (r for pr in of_kind(manifests, "PrometheusRule") for g in pr["spec"]["groups"] for r in g["rules"]):
        assert rule["alert"].startswith("Ragserve") and rule["labels"]["severity"] in ("warning", "critical")
        assert re.fullmatch(r"[0-9]+[smh]", rule["for"]) and rule["expr"].count("(") == rule["expr"].count(")")


def test_default_stack_is_the_local_stack(render):
    docs = render({})
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == sorted(
        ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service", "ServiceAccount", "StatefulSet"]
    )
    # Like `ragserve up`, the registry takes only engines that hold its generated token.
    assert [d["metadata"]["name"] for d in of_kind(docs, "Secret")] == ["rs-ragserve-registry-token"]
    names = {d["metadata"]["name"] for d in workloads(docs)}
    assert names == {"rs-ragserve-router", "rs-ragserve-engine-default", "rs-ragserve-cachestore"}
    assert not of_kind(docs, "HorizontalPodAutoscaler") and not of_kind(docs, "ScaledObject")


def test_release_named_like_the_chart(chart):
    out = chart.render({"operator": {"enabled": True}}, name="ragserve", namespace="ai")
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    names = {d["metadata"]["name"] for d in workloads(docs)}
    assert names == {"ragserve-router", "ragserve-engine-default", "ragserve-cachestore", "ragserve-operator"}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_shipped_crd_is_valid(chart, kube):
    crds = [yaml.safe_load(c["data"]) for c in chart.crds]
    assert sorted(c["spec"]["names"]["kind"] for c in crds) == ["RAGServe", "RAGServeEnginePool"]
    for crd in crds:
        kubernetes_validate.validate(crd, kube, strict=True)


def test_engine_torch_threads_follow_the_cpu_request(render):
    """OMP_NUM_THREADS from the pod's CPU request (rounded up by the kubelet), unless the pool's env sets it."""
    from_request = {"resourceFieldRef": {"containerName": "engine", "resource": "requests.cpu", "divisor": "1"}}
    engines = [
        {"name": "default", "model": "smollm2-135m"},
        {"name": "own", "model": "smollm2-135m", "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]},
    ]
    docs = render({"engines": engines})
    env = {}
    for pool in ("default", "own"):
        engine = named(docs, "Deployment", f"rs-ragserve-engine-{pool}")["spec"]["template"]["spec"]["containers"][0]
        env[pool] = [e for e in engine["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert env["default"] == [{"name": "OMP_NUM_THREADS", "valueFrom": from_request}]  # requests.cpu "2"
    assert env["own"] == [{"name": "OMP_NUM_THREADS", "value": "3"}]


def test_engine_compile_cache_volume(render):
    """compileCache: emptyDir (default) keeps the compiled graphs in the pod's /cache scratch; hostPath and pvc
    mount a shared volume over RAGSERVE_CACHE_DIR's inductor/ and extensions/ (docs/kernels.md, cold start)."""
    engines = [
        {"name": "pod", "model": "smollm2-135m"},
        {"name": "node", "model": "smollm2-135m", "compileCache": {"type": "hostPath"}},
        {"name": "shared", "model": "smollm2-135m", "compileCache": {"type": "pvc", "pvc": {"claimName": "graphs"}}},
    ]
    docs = render({"engines": engines})
    volumes, mounts = {}, {}
    for pool in ("pod", "node", "shared"):
        spec = named(docs, "Deployment", f"rs-ragserve-engine-{pool}")["spec"]["template"]["spec"]
        volumes[pool] = [v for v in spec["volumes"] if v["name"] == "compile-cache"]
        mounts[pool] = [(m["mountPath"], m["subPath"]) for m in spec["containers"][0]["volumeMounts"]
                        if m["name"] == "compile-cache"]  # fmt: skip
    assert volumes["pod"] == [] and mounts["pod"] == []
    assert volumes["node"] == [
        {"name": "compile-cache", "hostPath": {"path": "/var/cache/ragserve", "type": "DirectoryOrCreate"}}
    ]
    assert volumes["shared"] == [{"name": "compile-cache", "persistentVolumeClaim": {"claimName": "graphs"}}]
    expected = [("/cache/ragserve/inductor", "inductor"), ("/cache/ragserve/extensions", "extensions")]
    assert mounts["node"] == expected and mounts["shared"] == expected


def test_router_role_grants_only_the_pod_calls_it_makes(manifests):
    """router/k8s.py lists and watches pods (list_namespaced_pod and its watch); nothing more on them."""
    roles = [m for m in manifests if m["kind"] == "Role" and m["metadata"]["name"].endswith("-router")]
    for role in roles:
        pod_rules = [r for r in role["rules"] if "pods" in r["resources"]]
        assert [sorted(r["verbs"]) for r in pod_rules] == [["list", "watch"]], role["rules"]
