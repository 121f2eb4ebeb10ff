"""Which attention kernels the engine runs on a device: a pure choice over explicit inputs, and
the kernels for it.

* ``"triton"`` on CUDA where triton imports and ``EPD_ENGINE_TRITON`` is not ``0``
  (:mod:`.triton_attention`, :mod:`.triton_rope`);
* ``"cpu"`` on the CPU in fp32 or bf16 where the C kernels build (:mod:`.cpu`,
  ``EPD_CPU_KERNELS=0`` turns them off);
* ``"torch"`` otherwise: attention's own torch path, the reference of both.

Triton is imported only when chosen, so the engine imports without it.

On the CPU every product of every step goes through the packed weights (``packed_gemm.c`` in
fp32, ``packed_gemm_bf16.c`` in bf16), whose result for a row never depends on the other rows:
that is what keeps a request's output the same alone or in any batch (see model_runner). MKL's
and oneDNN's products do depend on the batch (an fp32 row alone differs from the same row among
others; oneDNN's bf16 rows differ at some row counts), so they are the default nowhere.
``EPD_CPU_BLAS`` (read when an engine starts) chooses for steps with prompt tokens:

    auto      the packed product (the default)
    packed    the same
    mkl       torch's products (MKL in fp32, oneDNN in bf16): batch-dependent; ``exact_prefill``
              keeps them too (transformers' own arithmetic)

Measured on SmolLM2's shapes, 2 cores, GFLOP/s at 2,048 / 256 / 32 rows (benchmarks/products.py):
an Intel Xeon (Sapphire Rapids, AMX) fp32 packed 241 / 247 / 203 against MKL's 224 / 240 / 128;
bf16 on AMX tiles 709 / 851 / 813 against oneDNN's (AMX too) 896 / 683 / 369, and AVX512_BF16's
dot products 150 / 155 / 149 there. An AMD EPYC Zen 4: fp32 packed ~200-215 at 2,048 rows, ahead
of MKL's ~180-200; bf16 AVX512_BF16 ~400 against oneDNN's ~380.

The bf16 packed product runs on AMX tiles where the CPU has them (:func:`bf16_product`), else on
AVX512_BF16's dot products; without either every bf16 product is oneDNN's. Whether bf16 pays
over fp32 (``--dtype auto``, :func:`bf16_pays`) follows from the figures above: on AMX, and on
AVX512_BF16 where it is not Intel's (Zen 4: ~1.8x fp32's generated tokens); Intel's AVX512_BF16
alone is slower than its fp32.
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


def choose_prompt_products(setting: str) -> str:
    """"packed" or "mkl" for an ``EPD_CPU_BLAS`` value (the pure core)."""
    if setting not in BLAS_CHOICES:
        raise ValueError(f"{BLAS_ENV}={setting!r}: must be one of {', '.join(BLAS_CHOICES)}")
    return "packed" if setting == "auto" else setting


def packed_prompts() -> bool:
    """Whether the products of steps with prompt tokens use the packed weights (see the module
    docstring); raises ValueError for an unknown ``EPD_CPU_BLAS``."""
    setting = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
    return choose_prompt_products(setting) == "packed"


def bf16_pays(bf16_product: str, vendor: str) -> bool:
    """Whether bf16 runs faster than fp32 on a CPU whose packed bf16 product is ``bf16_product``
    (``"amx"``, ``"avx512_bf16"`` or ``""``: none) and whose vendor is ``vendor`` (the pure core;
    the figures in the module docstring)."""
    return bf16_product == "amx" or (bf16_product == "avx512_bf16" and vendor != "GenuineIntel")
