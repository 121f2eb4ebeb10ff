"""The Helm chart helm/epd: lint, Kubernetes schemas, and what each examples file deploys.

Every values set is rendered once a session with a real `helm template` (conftest.py) and
checked as objects: exact counts, names, env and probes, not text.
"""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest

from tests.helm.conftest import CHART, EXAMPLES, NAMESPACE, RELEASE, ROOT, run_helm, template_args

K8S_SCHEMA_VERSION = "1.37.0"
"""The newest Kubernetes whose schemas kubernetes-validate ships (it has 1.37)."""
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
"""monitoring.coreos.com/v1 is a CRD, not in the Kubernetes schemas: checked by check_monitor."""
ALLOWED_ENV_EXCEPTIONS: frozenset[str] = frozenset()
"""Env names allowed without the EPD_ prefix: none (pod facts come in as EPD_* through the
downward API)."""
ROLES = ("router", "encoder", "prefill", "decode", "kvstore")
ENGINES = ("encoder", "prefill", "decode")

HPA_SETS = ("planner.mode=external", "prefill.autoscaling.mode=hpa", "decode.autoscaling.mode=hpa")
MONITORING_SETS = ("monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
                   "monitoring.grafanaDashboard.enabled=true", "networkPolicy.enabled=true")
INIT_SETS = ("model.initContainer.enabled=true", "model.path=SmolLM2-360M-Instruct",
             "model.initContainer.command={hf,download,HuggingFaceTB/SmolLM2-360M-Instruct,--local-dir,$(EPD_MODEL_DIR)}")
VARIANTS: dict[str, tuple] = {
    "default": (None,),
    **{name: (name,) for name in EXAMPLES},
    "hpa": ("autoscaling", *HPA_SETS),
    "monitoring": (None, *MONITORING_SETS),
    "init-container": ("cpu-minimal", *INIT_SETS),
}
UNSCHEMAED = {"gpu-cluster": {"ServiceMonitor"}, "monitoring": {"ServiceMonitor", "PodMonitor"}}
"""The kinds each variant renders that kubernetes-validate has no schema for."""


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind, name):
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def workload(objects, role):
    [found] = [o for o in workloads(objects) if o["spec"]["template"]["metadata"]["labels"]["epd.io/role"] == role]
    return found


def pod_containers(obj):
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def main_container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def env_values(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- helm itself ------------------------------------------------------------------------------

def test_helm_is_v3_or_v4(helm):
    out = run_helm(helm, "version", "--short").stdout
    assert re.match(r"v[34]\.\d+\.\d+", out), out


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_lint_strict(helm, values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CHART / "examples" / f"{values}.yaml")] if values else [])
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_examples_are_the_three_documented_ones():
    assert {"cpu-minimal", "gpu-cluster", "autoscaling"} <= set(EXAMPLES)


@pytest.mark.parametrize("sets, error", [
    (("prefill.replicas=-1",), "prefill.replicas: Must be greater than or equal to 0"),
    (("decode.replica=2",), "Additional property replica is not allowed"),
    (("planner.mode=auto",), "planner.mode must be one of the following"),
    (("prefill.env[0].name=HF_TOKEN", "prefill.env[0].value=x"), "prefill.env.0.name"),
])
def test_the_schema_rejects_bad_values(helm, sets, error):
    done = run_helm(helm, *template_args(None, *sets))
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert error in done.stderr


@pytest.mark.parametrize("sets, error", [
    (("prefill.autoscaling.enabled=true",), "prefill.autoscaling.mode=planner needs planner.mode=kubernetes"),
    (("planner.mode=kubernetes", "decode.autoscaling.enabled=true", "decode.autoscaling.mode=hpa"),
     "decode.autoscaling.mode=hpa needs planner.mode=external"),
    (("kvstore.autoscaling.enabled=true",), "kvstore.autoscaling.enabled: store nodes are listed by index"),
    (("kv.blockReplicas=2",), "kv.blockReplicas (2) is above kvstore.replicas (1)"),
    (("redis.enabled=false",), "auth: the router listens beyond its pod and would have no API keys"),
    (("prefill.config.port=7000",), "prefill.config.port: the chart sets it"),
])
def test_inconsistent_values_fail_with_a_message_naming_them(helm, sets, error):
    done = run_helm(helm, *template_args(None, *sets))
    assert done.returncode != 0
    assert error in done.stderr


# --- every rendered object ----------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_valid_kubernetes(render, variant):
    objects = render(*VARIANTS[variant])
    unschemaed = set()
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            check_monitor(obj, objects)
            unschemaed.add(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert unschemaed == UNSCHEMAED.get(variant, set())


def check_monitor(obj, objects):
    """A structural check of a ServiceMonitor / PodMonitor: it selects this release's Service
    (pods) of one role, on a port that Service (container) names, path /metrics."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    spec = obj["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == RELEASE
    if obj["kind"] == "ServiceMonitor":
        [endpoint] = spec["endpoints"]
        targets = [s for s in of_kind(objects, "Service") if labels_match(selector, s["metadata"]["labels"])]
        ports = {p["name"] for t in targets for p in t["spec"]["ports"]}
    else:
        [endpoint] = spec["podMetricsEndpoints"]
        targets = [w for w in workloads(objects) if labels_match(selector, w["spec"]["template"]["metadata"]["labels"])]
        ports = {p["name"] for t in targets for c in pod_containers(t) for p in c.get("ports", [])}
    assert len(targets) == 1, obj["metadata"]["name"]
    assert set(endpoint) == {"port", "path", "interval"}
    assert endpoint["path"] == "/metrics" and endpoint["port"] in ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_and_services_carry_the_role_and_standard_labels(render, variant):
    objects = render(*VARIANTS[variant])
    for obj in workloads(objects) + of_kind(objects, "Service"):
        labels = obj["spec"]["template"]["metadata"]["labels"] if "template" in obj["spec"] else obj["metadata"]["labels"]
        role = labels["epd.io/role"]
        assert labels["app.kubernetes.io/name"] == "epd"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] == role
        assert obj["metadata"]["name"] == f"{RELEASE}-{role}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_configuration_reaches_containers_only_as_epd_variables(render, variant):
    names = {e["name"] for w in workloads(render(*VARIANTS[variant])) for c in pod_containers(w)
             for e in c.get("env", [])}
    assert names and {n for n in names if not n.startswith("EPD_")} <= ALLOWED_ENV_EXCEPTIONS


def test_every_workload_comes_from_the_one_role_template():
    """Copy-pasted YAML per role is what the chart must not have: apart from Redis, only
    _workload.tpl spells out a Deployment or StatefulSet."""
    spelled = {p.name for p in (CHART / "templates").iterdir()
               if re.search(r"^kind: (Deployment|StatefulSet)", p.read_text(), re.M)}
    assert spelled == {"redis.yaml"}
    assert re.search(r"^kind: \{\{ \$spec\.kind \}\}$", (CHART / "templates" / "_workload.tpl").read_text(), re.M)


def test_the_dashboard_is_the_repositorys():
    assert (CHART / "dashboards" / "epd.json").read_bytes() == (ROOT / "dashboards" / "epd.json").read_bytes()


# --- cpu-minimal --------------------------------------------------------------------------------

def test_cpu_minimal_runs_one_of_each_role_without_gpus(render):
    objects = render("cpu-minimal")
    assert {(w["kind"], w["metadata"]["name"], w["spec"]["replicas"]) for w in workloads(objects)} == {
        ("Deployment", "epd-router", 1), ("Deployment", "epd-encoder", 1), ("Deployment", "epd-prefill", 1),
        ("Deployment", "epd-decode", 1), ("StatefulSet", "epd-kvstore", 1)}
    text = json.dumps(objects)
    assert "nvidia.com/gpu" not in text and "rdma/" not in text
    assert not [o for o in objects if "redis" in o["metadata"]["name"]]
    router = env_values(main_container(workload(objects, "router")))
    assert router["EPD_ROUTER_ALLOW_UNAUTHENTICATED"] == "true"
    assert "EPD_ROUTER_REDIS_URL" not in router


def test_cpu_minimal_moves_kv_over_tcp(render):
    objects = render("cpu-minimal")
    for role in ("prefill", "decode", "kvstore"):
        assert env_values(main_container(workload(objects, role)))[f"EPD_{role.upper()}_KV_TRANSPORT"] == "tcp"



@pytest.mark.parametrize("transport, expected", [("tcp", "tcp"), ("nixl", "auto")])
def test_the_encoder_lends_rows_from_its_data_port_and_dev_shm(render, transport, expected):
    """Prefill reads an image's embedding rows one-sided from the encoder (issue 20): its data
    server listens on the transfer port, is advertised at the pod's IP, open to the engines, and
    its region (cache_mib) lives in a memory-backed /dev/shm above the container's 64 MiB."""
    objects = render("cpu-minimal", f"kv.transport={transport}", "networkPolicy.enabled=true")
    encoder = workload(objects, "encoder")
    container = main_container(encoder)
    assert {"name": "transfer", "containerPort": 50052, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["EPD_ENCODER_TRANSFER_PORT"]["value"] == "50052"
    assert env["EPD_ENCODER_KV_TRANSPORT"]["value"] == expected  # the encoder lends over shm / TCP only
    assert env["EPD_ENCODER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    [shm] = [v for v in encoder["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"] == "512Mi"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    [policy] = [p["spec"] for p in of_kind(objects, "NetworkPolicy")
                if p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "encoder"]
    peers = policy["ingress"][0]
    assert "prefill" in policy_sources(peers) and [p["port"] for p in peers["ports"]] == ["grpc", "transfer"]

def test_grpc_roles_are_probed_with_the_standard_health_service(render):
    from services.launcher import _SERVICES

    objects = render("cpu-minimal")
    for role, service in _SERVICES.items():
        container = main_container(workload(objects, role))
        [grpc_port] = [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": grpc_port, "service": service}
    router = main_container(workload(objects, "router"))
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["tcpSocket"] == {"port": "http"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_startup_probes_allow_ten_minutes_for_model_load(render, variant):
    for w in workloads(render(*VARIANTS[variant])):
        if w["metadata"]["name"].endswith("-redis"):
            continue
        probe = main_container(w)["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, w["metadata"]["name"]


def test_cpu_minimal_role_services(render):
    objects = render("cpu-minimal")
    for role in ENGINES + ("kvstore",):
        service = named(objects, "Service", f"epd-{role}")
        assert service["spec"]["clusterIP"] == "None"
        assert [p["name"] for p in service["spec"]["ports"]] == ["grpc", "metrics"]
        assert service["metadata"]["labels"]["epd.io/role"] == role
    assert named(objects, "Service", "epd-kvstore")["spec"]["publishNotReadyAddresses"] is True
    router = named(objects, "Service", "epd-router")
    assert router["spec"]["type"] == "ClusterIP" and "clusterIP" not in router["spec"]
    assert router["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_the_router_discovers_instances_through_endpointslices(render):
    objects = render("cpu-minimal")
    container = main_container(workload(objects, "router"))
    env = {e["name"]: e for e in container["env"]}
    assert env["EPD_ROUTER_DISCOVERY"]["value"] == "kubernetes"
    assert env["EPD_ROUTER_K8S_LABEL_SELECTOR"]["value"] == f"app.kubernetes.io/instance={RELEASE}"
    assert env["EPD_ROUTER_K8S_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["EPD_ROUTER_PLANNER"]["value"] == "off"
    assert env["EPD_ROUTER_HOST"]["value"] == "0.0.0.0"
    pod = workload(objects, "router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "epd-router"
    [role] = of_kind(objects, "Role")
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]} in role["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in role["rules"]
    [binding] = of_kind(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "epd-router", "namespace": NAMESPACE}]


def test_instances_are_named_after_their_pod(render):
    objects = render("cpu-minimal")
    for role in ("prefill", "decode"):
        env = {e["name"]: e for e in main_container(workload(objects, role))["env"]}
        assert env[f"EPD_{role.upper()}_INSTANCE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env[f"EPD_{role.upper()}_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    env = {e["name"]: e for e in main_container(workload(objects, "kvstore"))["env"]}
    assert env["EPD_KVSTORE_NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["EPD_KVSTORE_ADVERTISE_HOST"]["value"] == (
        f"$(EPD_KVSTORE_NODE_ID).epd-kvstore.{NAMESPACE}.svc.cluster.local")
    names = [e["name"] for e in main_container(workload(objects, "kvstore"))["env"]]
    assert names.index("EPD_KVSTORE_NODE_ID") < names.index("EPD_KVSTORE_ADVERTISE_HOST")


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


def policy_sources(rule) -> set[str]:
    [peer] = rule["from"]
    [expression] = peer["podSelector"]["matchExpressions"]
    assert expression["key"] == "epd.io/role" and expression["operator"] == "In"
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    return set(expression["values"])


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
