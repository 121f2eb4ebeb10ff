"""OpenBLAS's sgemm for the CPU's fp32 prompt products, on the CPUs where it beats MKL (torch's).

A prefill step's linear layers (thousands of rows) are most of its time, and on the CPU torch
runs them through MKL, which is Intel's: on an AMD EPYC (Zen 3, AVX2, 2 cores) it measured
~90-110 GFLOP/s on SmolLM2's shapes at 2,048 rows where OpenBLAS (its Haswell kernels) measured
~125-135, and the offline benchmark went from 73.3 / 74.1 s to 69.5 / 70.1 s (alternated) with
the same greedy tokens.
On Intel CPUs MKL stays: it is their vendor's, and it was the machine's peak there.

``EPD_CPU_BLAS`` (read when an engine starts):

    auto      OpenBLAS on CPUs not made by Intel, where it is installed (the default)
    mkl       torch's products everywhere
    openblas  OpenBLAS on any CPU (where installed)

OpenBLAS comes from the ``scipy-openblas32`` wheel (what NumPy and SciPy build against: its
symbols carry a ``scipy_`` prefix, so it never clashes with another BLAS in the process). It is
told to use one thread; ``blas_rows.c`` splits the rows across the engine's own OpenMP team
instead, so no second thread pool competes for the cores. The choice is a function of the CPU
(and the variable), never of a timing, so every engine on the same kind of machine computes the
same bits. The sums are in another order than MKL's: within float32 rounding of transformers'
(tests/integration/test_smollm2.py holds it to the same float64 contract); ``exact_prefill``
keeps MKL, transformers' own products.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from services.engine.kernels.cpu import CpuKernels

logger = logging.getLogger(__name__)
_LOADED: list[ctypes.CDLL] = []
"""The library, held for the life of the process (its sgemm is called by address)."""

BLAS_ENV = "EPD_CPU_BLAS"
CHOICES = ("auto", "mkl", "openblas")
K_CHUNK = 192
"""Each product sums k in chunks of this many terms, one sgemm call a chunk accumulating into the
output (beta 1): OpenBLAS's kernels sum each output in one long sequence, which measured further
from a float64 reference than transformers' (RMS 1.085x, largest error 1.6-2.0x on SmolLM2's
logits); in chunks of 192 RMS 1.03x and largest 1.3-1.5x (tests/integration/test_smollm2.py), for
~7% of the products' speed, still ahead of MKL's."""


@functools.cache
def sgemm_address() -> int | None:
    """The address of OpenBLAS's cblas_sgemm, OpenBLAS set to one thread; None where the wheel
    is not installed or does not load."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    try:
        lib = ctypes.CDLL(str(Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"))
        lib.scipy_openblas_set_num_threads(1)
        _LOADED.append(lib)
        return ctypes.cast(lib.scipy_cblas_sgemm, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        logger.warning("OpenBLAS did not load, prompt products stay on MKL: %s", e)
        return None


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD...), "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def choose(setting: str, vendor: str, is_installed: bool) -> str:
    """"openblas" or "mkl" for an ``EPD_CPU_BLAS`` value, a CPU vendor and whether OpenBLAS loads
    (the pure core)."""
    if setting not in CHOICES:
        raise ValueError(f"{BLAS_ENV}={setting!r}: must be one of {', '.join(CHOICES)}")
    if setting == "mkl" or not is_installed:
        return "mkl"
    return "openblas" if setting == "openblas" or vendor != "GenuineIntel" else "mkl"


def prompt_product(kernels: CpuKernels) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(x, weight) -> x W^T`` through OpenBLAS where it is chosen for this CPU, else None (MKL)."""
    setting = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
    if setting == "mkl":
        return None
    sgemm = sgemm_address()
    if choose(setting, cpu_vendor(), sgemm is not None) == "mkl":
        if setting == "openblas":
            logger.warning("%s=openblas but scipy-openblas32 is not installed: prompt products stay on MKL", BLAS_ENV)
        return None
    logger.info("prompt products through OpenBLAS (%s=%s, CPU vendor %r)", BLAS_ENV, setting, cpu_vendor())
    return functools.partial(kernels.blas_rows, sgemm, K_CHUNK)
