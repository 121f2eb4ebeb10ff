"""The Helm chart helm/epd: lint, Kubernetes schemas, what every values set renders, and what
the cpu-minimal example deploys (the other examples and values sets: test_chart_clusters.py).

Every values set is rendered once a session with a real `helm template` (conftest.py) and
checked as objects: exact counts, names, env and probes, not text.
"""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest

from tests.helm.conftest import CHART, EXAMPLES, NAMESPACE, RELEASE, ROOT, run_helm, template_args
from tests.helm.objects import (ALLOWED_ENV_EXCEPTIONS, CRD_KINDS, ENGINES, K8S_SCHEMA_VERSION, UNSCHEMAED, VARIANTS,
                                env_values, labels_match, main_container, named, of_kind, pod_containers,
                                policy_sources, workload, workloads)


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
