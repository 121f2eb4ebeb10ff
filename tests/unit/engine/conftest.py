"""Fixtures of the engine's unit tests."""

from __future__ import annotations

import os

import pytest

# The Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen
# before triton is first imported, by whichever test imports it first (the GPU tests run in
# their own session, `make gpu-check`, where triton compiles for the device).
os.environ.setdefault("TRITON_INTERPRET", "1")

from services.engine.kernels import cpu


# The instruction sets the kernels are tested for: this CPU's own; on an AMX CPU its own without
# AMX too (the bf16 product on AVX512_BF16's dot products, as on a Zen 4); and on an AVX-512 CPU,
# AVX2 (x86-64-v3): its paths (8-float vectors, other tiles, the generic exp) run there as well.
_FLAGS = cpu.cpu_flags() or set()
ISAS = (["native"] + (["native-no-amx"] if "amx_bf16" in _FLAGS else [])
        + (["x86-64-v3"] if {"avx512f", "avx2", "fma", "bmi2"} <= _FLAGS else []))


@pytest.fixture(params=ISAS)
def kernels(request, monkeypatch) -> cpu.CpuKernels:
    """The CPU's kernels, built for each of ISAS in turn (``cpu.kernels()`` too, so an engine
    packs and computes with the same build); tests that take them are skipped where no C
    compiler exists."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler: the engine uses its torch path, tested elsewhere")
    if request.param != "native":
        if request.param == "native-no-amx":
            monkeypatch.setenv(cpu.AMX_ENV, "0")
        else:
            monkeypatch.setenv(cpu.MARCH_ENV, request.param)
        cpu.kernels.cache_clear()
        request.addfinalizer(cpu.kernels.cache_clear)  # this CPU's own build for the tests after
    k = cpu.kernels()
    assert k is not None, "a C compiler is present but the kernels did not build (see the log)"
    assert request.param != "native-no-amx" or k.bf16_product == "avx512_bf16"
    return k
