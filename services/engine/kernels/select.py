"""Which attention kernels the engine runs on a device: a pure choice over explicit inputs, and
the kernels for it.

* ``"triton"`` on CUDA where triton imports and ``EPD_ENGINE_TRITON`` is not ``0``
  (:mod:`.triton_attention`, :mod:`.triton_rope`);
* ``"cpu"`` on the CPU in fp32 or bf16 where the C kernels build (:mod:`.cpu`,
  ``EPD_CPU_KERNELS=0`` turns them off);
* ``"torch"`` otherwise: attention's own torch path, the reference of both.

Triton is imported only when chosen, so the engine imports without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from services.engine.kernels import cpu

TRITON_ENV = "EPD_ENGINE_TRITON"


def triton_enabled() -> bool:
    return os.environ.get(TRITON_ENV, "1") != "0"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose(device_type: str, dtype: torch.dtype, *, is_triton_usable: bool, is_cpu_usable: bool) -> str:
    """The backend for a device and dtype given what is usable there (the pure core)."""
    if device_type == "cuda" and is_triton_usable:
        return "triton"
    if device_type == "cpu" and dtype in cpu.DTYPES and is_cpu_usable:
        return "cpu"
    return "torch"


def attention_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """``"triton"``, ``"cpu"`` or ``"torch"`` for ``device`` (see the module docstring). Builds
    the C kernels on the CPU if they are not built yet."""
    is_cuda, is_cpu = device.type == "cuda", device.type == "cpu" and dtype in cpu.DTYPES
    return choose(device.type, dtype,
                  is_triton_usable=is_cuda and triton_enabled() and triton_installed(),
                  is_cpu_usable=is_cpu and cpu.kernels() is not None)


def kernels_for(backend: str):
    """The kernels of a backend (``CpuKernels``, ``TritonKernels``), None for ``"torch"``."""
    if backend == "triton":
        from services.engine.kernels.triton_attention import TritonKernels
        return TritonKernels()
    if backend == "cpu":
        return cpu.kernels()
    assert backend == "torch", backend
    return None
