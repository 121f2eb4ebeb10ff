"""Which attention kernels the engine runs on a device: a pure choice over explicit inputs, and
the kernels for it.

* ``"triton"`` on CUDA where triton imports and ``EPD_ENGINE_TRITON`` is not ``0``
  (:mod:`.triton_attention`, :mod:`.triton_rope`);
* ``"cpu"`` on the CPU in fp32 or bf16 where the C kernels build (:mod:`.cpu`,
  ``EPD_CPU_KERNELS=0`` turns them off);
* ``"torch"`` otherwise: attention's own torch path, the reference of both.

Triton is imported only when chosen, so the engine imports without it.

On the CPU in fp32 the products of steps with prompt tokens (:func:`packed_prompts`) go through
the same packed product as decode steps (``packed_gemm.c``) on CPUs not made by Intel, MKL's
(torch's) on Intel's. ``EPD_CPU_BLAS`` (read when an engine starts) overrides the choice:

    auto      the packed product on CPUs not made by Intel, MKL on Intel's (the default)
    mkl       torch's products for prompt tokens everywhere
    packed    the packed product everywhere

On an AMD EPYC Zen 4 (AVX-512, 2 cores) the packed product runs SmolLM2's shapes at 2,048 rows
at ~200-215 GFLOP/s, ahead of MKL's (~180-200), with the same bits as OpenBLAS's product in
chunks of k (which it replaces there), and the offline benchmark went from 40.5 / 38.9 s
(OpenBLAS, alternated) to 35.5 / 36.8 s with the same tokens. On Intel's
CPUs MKL stays: it is their vendor's, and it was the machine's peak there. The choice is a
function of the CPU (and the variable), never of a timing, so every engine on the same kind of
machine computes the same bits. ``exact_prefill`` keeps MKL, transformers' own products.

In bf16 the same choice holds for the bf16 packed product (``packed_gemm_bf16.c``, built where
the CPU has AVX512_BF16: on the Zen 4 ~400 GFLOP/s at 2,048 rows against oneDNN's ~380, 1.3-1.7x
oneDNN's at 32 rows); on Intel's CPUs prompt steps keep oneDNN's bf16 products (AMX where the
CPU has it). Without AVX512_BF16 every bf16 product is oneDNN's.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from services.engine.kernels import cpu

TRITON_ENV = "EPD_ENGINE_TRITON"
BLAS_ENV = "EPD_CPU_BLAS"
BLAS_CHOICES = ("auto", "mkl", "packed")


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


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD...), "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def choose_prompt_products(setting: str, vendor: str) -> str:
    """"packed" or "mkl" for an ``EPD_CPU_BLAS`` value and a CPU vendor (the pure core)."""
    if setting not in BLAS_CHOICES:
        raise ValueError(f"{BLAS_ENV}={setting!r}: must be one of {', '.join(BLAS_CHOICES)}")
    if setting != "auto":
        return setting
    return "mkl" if vendor == "GenuineIntel" else "packed"


def packed_prompts() -> bool:
    """Whether the products of steps with prompt tokens use the packed weights on this CPU
    (see the module docstring); raises ValueError for an unknown ``EPD_CPU_BLAS``."""
    setting = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
    return choose_prompt_products(setting, cpu_vendor()) == "packed"
