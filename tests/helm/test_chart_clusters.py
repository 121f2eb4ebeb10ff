"""The Helm chart helm/epd, continued from test_chart.py: the gpu-cluster and autoscaling
examples, the other values sets, and whether the services accept every setting the chart makes.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helm.conftest import CHART, NAMESPACE, RELEASE, ROOT, run_helm
from tests.helm.objects import (CRD_KINDS, ENGINES, VARIANTS, env_values, main_container, named, of_kind,
                                policy_sources, workload, workloads)


# --- gpu-cluster --------------------------------------------------------------------------------

def test_gpu_cluster_sizes(render):
    objects = render("gpu-cluster")
    assert workload(objects, "prefill")["spec"]["replicas"] == 64
    assert workload(objects, "decode")["spec"]["replicas"] == 64
    assert workload(objects, "router")["spec"]["replicas"] == 4
    store = workload(objects, "kvstore")
    assert store["kind"] == "StatefulSet" and store["spec"]["replicas"] == 8
    assert store["spec"]["serviceName"] == "epd-kvstore"
    [claim] = store["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "3Ti"
    assert claim["spec"]["storageClassName"] == "local-nvme"
    mounts = {m["name"]: m["mountPath"] for m in main_container(store)["volumeMounts"]}
    assert mounts["data"] == env_values(main_container(store))["EPD_KVSTORE_DISK_DIR"]
    assert not workload_names(objects, "encoder")


def workload_names(objects, role):
    return [w["metadata"]["name"] for w in workloads(objects) if w["metadata"]["name"] == f"epd-{role}"]


def test_gpu_cluster_spreads_each_role_over_hosts(render):
    objects = render("gpu-cluster")
    for role in ("router", "prefill", "decode", "kvstore"):
        [constraint] = workload(objects, role)["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert constraint["topologyKey"] == "kubernetes.io/hostname"
        assert constraint["labelSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "epd", "app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": role}


def test_names_follow_the_release(helm):
    import yaml

    done = run_helm(helm, "template", "prod", str(CHART), "--namespace", "llm", "--set", "kvstore.replicas=2")
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    prefill = env_values(main_container(workload(objects, "prefill")))
    assert prefill["EPD_PREFILL_KVSTORE"] == ",".join(
        f"prod-epd-kvstore-{i}.prod-epd-kvstore.llm.svc.cluster.local:50081" for i in range(2))
    router = env_values(main_container(workload(objects, "router")))
    assert router["EPD_ROUTER_K8S_LABEL_SELECTOR"] == "app.kubernetes.io/instance=prod"
    assert router["EPD_ROUTER_REDIS_URL"] == "redis://prod-epd-redis:6379/0"
    assert {w["metadata"]["name"] for w in workloads(objects)} == {
        "prod-epd-router", "prod-epd-prefill", "prod-epd-decode", "prod-epd-kvstore", "prod-epd-redis"}


def test_gpu_cluster_engines_get_gpus_and_rdma(render):
    objects = render("gpu-cluster")
    for role in ("prefill", "decode"):
        resources = main_container(workload(objects, role))["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 1
        assert resources["limits"]["rdma/hca"] == 1
        assert env_values(main_container(workload(objects, role)))[f"EPD_{role.upper()}_DEVICE"] == "cuda"
    store = main_container(workload(objects, "kvstore"))["resources"]
    assert store["limits"]["rdma/hca"] == 1 and "nvidia.com/gpu" not in store["limits"]


def test_gpu_cluster_shm_is_memory_backed(render):
    objects = render("gpu-cluster")
    for role in ("prefill", "decode", "kvstore"):
        w = workload(objects, role)
        [shm] = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in main_container(w)["volumeMounts"]
    assert named(objects, "StatefulSet", "epd-kvstore")["spec"]["template"]["spec"]["volumes"][0]["emptyDir"][
        "sizeLimit"] == "136Gi"


def test_gpu_cluster_engines_list_every_store_node(render):
    objects = render("gpu-cluster")
    expected = [f"epd-kvstore-{i}.epd-kvstore.{NAMESPACE}.svc.cluster.local:50081" for i in range(8)]
    for role in ("prefill", "decode"):
        env = env_values(main_container(workload(objects, role)))
        assert env[f"EPD_{role.upper()}_KVSTORE"].split(",") == expected
        assert env[f"EPD_{role.upper()}_KVSTORE_REPLICAS"] == "2"


def test_gpu_cluster_model_comes_read_only_from_the_pvc(render):
    objects = render("gpu-cluster")
    for role in ("prefill", "decode"):
        w = workload(objects, role)
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "epd-models", "readOnly": True}
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main_container(w)["volumeMounts"]
        assert env_values(main_container(w))[f"EPD_{role.upper()}_MODEL"] == "/models/Llama-3.1-8B-Instruct"


def test_gpu_cluster_pdbs(render):
    objects = render("gpu-cluster")
    pdbs = {p["metadata"]["name"]: p["spec"] for p in of_kind(objects, "PodDisruptionBudget")}
    assert set(pdbs) == {"epd-router", "epd-prefill", "epd-decode", "epd-kvstore"}
    assert pdbs["epd-prefill"]["maxUnavailable"] == "10%"
    assert pdbs["epd-kvstore"]["maxUnavailable"] == 1
    assert pdbs["epd-decode"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"


def test_gpu_cluster_secrets_reach_the_router_by_reference(render):
    objects = render("gpu-cluster")
    env = {e["name"]: e for e in main_container(workload(objects, "router"))["env"]}
    assert env["EPD_ROUTER_API_KEYS"]["valueFrom"] == {"secretKeyRef": {"name": "epd-api-keys", "key": "api-keys"}}
    assert env["EPD_ROUTER_ADMIN_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "epd-admin-token", "key": "admin-token"}}
    assert env["EPD_ROUTER_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "epd-redis", "key": "redis-url"}}
    assert not of_kind(objects, "Secret")


def test_gpu_cluster_network_policies(render):
    objects = render("gpu-cluster")
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p["spec"]
                for p in of_kind(objects, "NetworkPolicy")}
    assert set(policies) == {"router", "prefill", "decode", "kvstore"}
    [api, metrics] = policies["router"]["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}  # no `from`: any client
    for role in ("prefill", "decode"):
        peers, store_reads, metrics = policies[role]["ingress"]
        assert policy_sources(peers) == {"router", "planner", "encoder", "prefill", "decode"}
        assert [p["port"] for p in peers["ports"]] == ["grpc", "transfer"]
        assert policy_sources(store_reads) == {"kvstore"}
        assert [p["port"] for p in store_reads["ports"]] == ["transfer"]
        assert metrics["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    peers, metrics = policies["kvstore"]["ingress"]
    assert policy_sources(peers) == {"prefill", "decode", "kvstore"}
    assert all(p["policyTypes"] == ["Ingress"] for p in policies.values())


def test_redis_is_reached_only_by_routers_and_store_nodes(render):
    objects = render(*VARIANTS["monitoring"])
    policy = named(objects, "NetworkPolicy", "epd-redis")["spec"]
    [rule] = policy["ingress"]
    assert policy_sources(rule) == {"router", "planner", "kvstore"}
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


# --- autoscaling --------------------------------------------------------------------------------

def test_autoscaling_runs_one_planner_that_scales_deployments(render):
    objects = render("autoscaling")
    planner = named(objects, "Deployment", "epd-planner")
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"] == {"type": "Recreate"}
    env = env_values(main_container(planner))
    assert env["EPD_ROUTER_PLANNER"] == "kubernetes"
    assert env["EPD_ROUTER_DISCOVERY"] == "kubernetes"
    assert env_values(main_container(workload(objects, "router")))["EPD_ROUTER_PLANNER"] == "off"
    config_path = env["EPD_ROUTER_PLANNER_CONFIG"]
    mounts = {m["name"]: m["mountPath"] for m in main_container(planner)["volumeMounts"]}
    assert config_path == f"{mounts['planner-config']}/planner.json"
    config = json.loads(named(objects, "ConfigMap", "epd-planner")["data"]["planner.json"])
    assert config == {"interval_s": 30, "ttft_s": 1, "tpot_s": 0.04, "roles": {
        "prefill": {"min_replicas": 2, "max_replicas": 16}, "decode": {"min_replicas": 2, "max_replicas": 16}}}
    from services.router.planner import PlannerConfig

    parsed = PlannerConfig.from_json(named(objects, "ConfigMap", "epd-planner")["data"]["planner.json"])
    assert parsed.scaled_roles == ("prefill", "decode") and parsed.roles["decode"].max_replicas == 16
    service = named(objects, "Service", "epd-planner")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "planner"


def test_autoscaling_rbac_lets_only_the_planner_scale(render):
    objects = render("autoscaling")
    scale = named(objects, "Role", "epd-planner-scale")
    assert {"apiGroups": ["apps"], "resources": ["deployments/scale", "statefulsets/scale"],
            "verbs": ["get", "patch", "update"]} in scale["rules"]
    assert {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"],
            "verbs": ["get", "list", "watch"]} in scale["rules"]
    binding = named(objects, "RoleBinding", "epd-planner-scale")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "epd-planner", "namespace": NAMESPACE}]
    assert named(objects, "Deployment", "epd-planner")["spec"]["template"]["spec"]["serviceAccountName"] == "epd-planner"
    discovery = named(objects, "RoleBinding", "epd-discovery")
    assert {s["name"] for s in discovery["subjects"]} == {"epd-router", "epd-planner"}


@pytest.mark.parametrize("variant", ["autoscaling", "hpa"])
def test_scaled_workloads_leave_replicas_to_their_scaler(render, variant):
    objects = render(*VARIANTS[variant])
    assert "replicas" not in workload(objects, "prefill")["spec"]
    assert "replicas" not in workload(objects, "decode")["spec"]
    assert workload(objects, "router")["spec"]["replicas"] == 1
    assert workload(objects, "kvstore")["spec"]["replicas"] == 2


def test_hpa_mode_follows_the_planners_metric(render):
    objects = render(*VARIANTS["hpa"])
    hpas = {h["metadata"]["name"]: h["spec"] for h in of_kind(objects, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"epd-prefill", "epd-decode"}
    for role in ("prefill", "decode"):
        spec = hpas[f"epd-{role}"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"epd-{role}"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 16)
        [metric] = spec["metrics"]
        assert metric == {"type": "External", "external": {
            "metric": {"name": "epd_planner_desired_replicas", "selector": {"matchLabels": {"role": role}}},
            "target": {"type": "AverageValue", "averageValue": "1"}}}
    assert env_values(main_container(named(objects, "Deployment", "epd-planner")))["EPD_ROUTER_PLANNER"] == "external"
    assert not [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == "epd-planner-scale"]


# --- other values sets --------------------------------------------------------------------------

def test_monitoring_objects_and_dashboard(render):
    objects = render(*VARIANTS["monitoring"])
    monitors = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in CRD_KINDS}
    roles = ("router", "prefill", "decode", "kvstore")  # the default values: no encoder, no planner
    assert monitors == {(kind, f"epd-{r}") for kind in CRD_KINDS for r in roles}
    dashboard = named(objects, "ConfigMap", "epd-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["epd.json"]) == json.loads((ROOT / "dashboards" / "epd.json").read_text())


def test_default_values_keep_the_api_closed_with_keys_in_redis(render):
    objects = render(None)
    env = env_values(main_container(workload(objects, "router")))
    assert env["EPD_ROUTER_REDIS_URL"] == "redis://epd-redis:6379/0"
    assert "EPD_ROUTER_ALLOW_UNAUTHENTICATED" not in env
    assert env_values(main_container(workload(objects, "kvstore")))["EPD_KVSTORE_REDIS_URL"] == "redis://epd-redis:6379/0"
    assert named(objects, "Deployment", "epd-redis")["spec"]["replicas"] == 1


def test_auth_values_become_a_secret(render):
    objects = render(None, "auth.apiKeys.values={team-a:sk-1,sk-2}", "auth.adminToken.value=t0ken")
    [secret] = of_kind(objects, "Secret")
    assert secret["metadata"]["name"] == "epd-auth"
    assert secret["stringData"] == {"api-keys": "team-a:sk-1,sk-2", "admin-token": "t0ken"}
    env = {e["name"]: e for e in main_container(workload(objects, "router"))["env"]}
    assert env["EPD_ROUTER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "epd-auth", "key": "api-keys"}
    assert env["EPD_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "epd-auth", "key": "admin-token"}
    assert "checksum/auth" in workload(objects, "router")["spec"]["template"]["metadata"]["annotations"]


def test_model_from_an_init_container(render):
    objects = render(*VARIANTS["init-container"])
    for role in ENGINES:
        w = workload(objects, role)
        [init] = w["spec"]["template"]["spec"]["initContainers"]
        assert init["command"][:2] == ["hf", "download"] and init["command"][-1] == "$(EPD_MODEL_DIR)"
        assert env_values(init)["EPD_MODEL_DIR"] == "/models"
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"] == {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}}
        assert env_values(main_container(w))[f"EPD_{role.upper()}_MODEL"] == "/models/SmolLM2-360M-Instruct"
    assert "initContainers" not in workload(objects, "kvstore")["spec"]["template"]["spec"]


# --- the services accept what the chart sets ----------------------------------------------------

PENDING_ROUTER_FIELDS = {"planner", "planner_config"}
"""Router settings another change is adding (running the planner). Until RouterConfig has
`planner`, these names are let through unchecked; from then on both must exist."""
POD_FACTS = {"metadata.name": "epd-prefill-5d9f7c-x2x9q", "status.podIP": "10.1.2.3", "metadata.namespace": NAMESPACE}


def config_classes():
    from services.decode.config import DecodeConfig
    from services.encoder.config import EncoderConfig
    from services.kvstore.config import KVStoreConfig
    from services.prefill.config import PrefillConfig
    from services.router.config import RouterConfig
    return {"services.router": (RouterConfig, "router"), "services.encoder": (EncoderConfig, "encoder"),
            "services.prefill": (PrefillConfig, "prefill"), "services.decode": (DecodeConfig, "decode"),
            "services.kvstore": (KVStoreConfig, "kvstore")}


def resolved_env(container, files: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet would hand it over (downward API and Secret
    values made up), $(NAME) references expanded; paths in ``files`` replaced."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            value = POD_FACTS[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            value = {"EPD_ROUTER_API_KEYS": "team-a:sk-test", "EPD_ROUTER_ADMIN_TOKEN": "t0ken"}.get(
                entry["name"], "redis://redis.example:6379/0")
        env[entry["name"]] = files.get(value, value)
    return env


@pytest.mark.parametrize("variant", ["cpu-minimal", "gpu-cluster", "autoscaling", "init-container"])
def test_every_setting_the_chart_makes_is_a_real_field_and_parses(render, variant, tmp_path):
    import dataclasses

    from services.common.config import env_prefix, parse_config

    objects = render(*VARIANTS[variant])
    files = {}
    for cm in of_kind(objects, "ConfigMap"):
        if "planner.json" in cm["data"]:
            (tmp_path / "planner.json").write_text(cm["data"]["planner.json"])
            files["/etc/epd/planner/planner.json"] = str(tmp_path / "planner.json")
    classes = config_classes()
    for w in workloads(objects):
        container = main_container(w)
        if container["name"] == "redis":
            continue
        module, *argv = container["args"]
        cls, service = classes[module]
        fields = {f.name for f in dataclasses.fields(cls)}
        prefix = env_prefix(service)
        env = {k: v for k, v in resolved_env(container, files).items() if k.startswith(prefix)}
        unknown = {k[len(prefix):].lower() for k in env} - fields
        if service == "router" and "planner" not in fields:
            unknown -= PENDING_ROUTER_FIELDS
        assert not unknown, f"{w['metadata']['name']} sets no such {service} setting: {sorted(unknown)}"
        env = {k: v for k, v in env.items() if k[len(prefix):].lower() in fields}
        config = parse_config(cls, argv, service, env=env)
        assert config.host == "0.0.0.0"
