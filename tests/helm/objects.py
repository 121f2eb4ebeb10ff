"""What the chart tests share: the values sets they render (VARIANTS) and how they look into the
rendered objects."""

from __future__ import annotations

from tests.helm.conftest import EXAMPLES, RELEASE

K8S_SCHEMA_VERSION = "1.37.0"
"""The newest Kubernetes whose schemas kubernetes-validate ships (it has 1.37)."""
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
"""monitoring.coreos.com/v1 is a CRD, not in the Kubernetes schemas: checked by check_monitor."""
ALLOWED_ENV_EXCEPTIONS: frozenset[str] = frozenset()
"""Env names allowed without the EPD_ prefix: none (pod facts come in as EPD_* through the
downward API)."""
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


def policy_sources(rule) -> set[str]:
    [peer] = rule["from"]
    [expression] = peer["podSelector"]["matchExpressions"]
    assert expression["key"] == "epd.io/role" and expression["operator"] == "In"
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    return set(expression["values"])
