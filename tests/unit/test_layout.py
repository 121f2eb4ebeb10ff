"""Dependency direction (STYLE rule 15), checked on the import statements of every module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    """A package's modules, or the one module a ``.py`` path names."""
    path = ROOT / package
    return [path] if path.suffix == ".py" and path.is_file() else sorted(path.rglob("*.py"))


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {name}" for p in modules(package) for name in imports_of(p)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


ENGINE_SERVICES = ("services.engine", "services.prefill", "services.decode", "services.encoder")
SERVING = ("grpc", "kvstore.transfer", "services.kvstore", "services.pb", "services.engine.serving")
"""What the engine core never imports: its serving shell (services/engine/serving) and below."""
ENGINE_INTERNALS = ("services.engine.engine", "services.engine.serving.async_engine",
                    "services.engine.scheduler", "services.engine.block_manager", "services.engine.model_runner")
"""What a worker never imports: it drives the engine through the EngineSeam."""


@pytest.mark.parametrize("package, forbidden", [
    ("kvstore", ("services",)),
    ("services/router", ("torch", "triton", *ENGINE_SERVICES)),
    # The router by concern: access (keys, limits) and errors know no protocol; the cluster side
    # knows no HTTP; policies and the simulator are pure (no gRPC, no live pools).
    ("services/router/access", ("services.router.api", "services.router.admin", "services.router.cluster")),
    ("services/router/errors.py", ("services.router.api", "services.router.access", "services.router.admin",
                                   "services.router.cluster")),
    ("services/router/cluster", ("services.router.api", "services.router.access", "services.router.admin",
                                 "fastapi", "starlette")),
    ("services/router/policies", ("grpc", "asyncio", "services.router.api", "services.router.access",
                                  "services.router.admin", "services.router.cluster")),
    ("services/router/sim", ("grpc", "services.router.api", "services.router.access", "services.router.admin",
                             "services.router.cluster")),
    ("services/engine", ("services.router", "services.prefill", "services.decode", "services.encoder")),
    # vLLM's adapter is an engine as epd's is: the services use it, it knows none of them.
    ("services/vllm_engine", ("services.router", "services.prefill", "services.decode", "services.encoder")),
    ("services/prefill", ("services.router", "services.decode", "services.encoder")),
    ("services/decode", ("services.router", "services.prefill", "services.encoder")),
    ("services/encoder", ("services.router", "services.prefill", "services.decode")),
    ("services/kvstore", ("torch", "triton", "services.router", *ENGINE_SERVICES)),
    ("services/common", ("torch", "services.engine", "services.router", "services.prefill",
                         "services.decode", "services.encoder")),
    # The workers reach their engine through the serving shell's EngineSeam only.
    ("services/prefill", ENGINE_INTERNALS),
    ("services/decode", ENGINE_INTERNALS),
])
def test_dependency_direction(package, forbidden):
    assert offenders(package, forbidden) == []


def test_the_engine_core_imports_nothing_of_serving():
    """The core (services/engine but its serving/ shell) imports no gRPC, no transfer code, no
    store client, nothing of the shell: its own tests drive it without any of them."""
    shell = ROOT / "services/engine/serving"
    core = [p for p in modules("services/engine") if shell not in p.parents]
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in core for name in imports_of(p)
           if any(name == f or name.startswith(f + ".") for f in SERVING)]
    assert core and bad == []


def test_importing_the_engine_core_loads_nothing_of_serving():
    """The same, transitively: what the core's imports import in turn."""
    import subprocess
    import sys

    code = ("import sys, services.engine.engine, services.engine.llm; "
            f"print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {SERVING!r})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_scheduling_core_is_torch_free():
    core = ["sequence.py", "block_manager.py", "scheduler.py", "config.py"]
    bad = [f"{name} imports {i}" for name in core for i in imports_of(ROOT / "services/engine" / name)
           if i == "torch" or i.startswith("torch.")]
    assert bad == []


def test_only_transfer_backends_in_kvstore_touch_torch():
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in modules("kvstore") for name in imports_of(p)
           if (name == "torch" or name.startswith("torch.")) and "transfer" not in p.parts]
    assert bad == []


def test_generated_grpc_stubs_are_fresh():
    # In a process of its own: protoc's libraries and NIXL's (its own gRPC / protobuf) crash one
    # process that loads both, and other tests may load NIXL.
    result = subprocess.run([sys.executable, "-m", "services.pb.generate", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"run: python -m services.pb.generate\n{result.stdout}{result.stderr}"


def test_every_package_a_rule_names_has_modules():
    """A rule over a misspelt or moved package would check nothing, and pass: each must exist."""
    [rules] = [mark.args[1] for mark in test_dependency_direction.pytestmark if mark.name == "parametrize"]
    assert [package for package, _ in rules if not modules(package)] == []


@pytest.mark.parametrize("servicer, base", [
    ("services.prefill.servicer:PrefillServicer", "services.pb.prefill_pb2_grpc:PrefillServicer"),
    ("services.decode.servicer:DecodeServicer", "services.pb.decode_pb2_grpc:DecodeServicer"),
    ("services.encoder.servicer:EncoderServicer", "services.pb.encoder_pb2_grpc:EncoderServicer"),
    ("services.kvstore.servicer:KVStoreServicer", "services.pb.kvstore_pb2_grpc:KVStoreServicer"),
])
def test_every_rpc_of_the_contract_is_implemented(servicer, base):
    """The generated base classes answer every RPC with NotImplementedError: ours override all."""
    import importlib

    def load(spec: str):
        module, name = spec.split(":")
        return getattr(importlib.import_module(module), name)

    ours, generated = load(servicer), load(base)
    rpcs = [name for name, value in vars(generated).items() if callable(value) and name[0].isupper()]
    assert rpcs and [name for name in rpcs if getattr(ours, name) is getattr(generated, name)] == []


def test_no_import_cycle():
    """No two of our modules import each other, directly or through others (imports inside
    functions count too: a cycle hidden in a function is still one)."""
    graph = _import_graph()
    assert _cycles(graph) == []


def _import_graph() -> dict[str, set[str]]:
    """Each of our modules (generated stubs aside) -> the modules of ours it imports."""
    paths = {}
    for p in [*modules("services"), *modules("kvstore")]:
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[:2] == ("services", "pb"):
            continue
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
