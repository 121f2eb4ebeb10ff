"""Name -> ``"module:attribute"`` registries (STYLE rule 5): the module is imported only when its
name is chosen, so a process loads only what it runs (vLLM's engine, a GPU transport...)."""

from __future__ import annotations

import importlib
from typing import Any


def load(registry: dict[str, str], name: str) -> Any:
    """The attribute ``registry[name]`` names; ValueError listing the names for an unknown one."""
    if name not in registry:
        raise ValueError(f"unknown name {name!r}; known: {', '.join(sorted(registry))}")
    module, _, attribute = registry[name].partition(":")
    return getattr(importlib.import_module(module), attribute)
