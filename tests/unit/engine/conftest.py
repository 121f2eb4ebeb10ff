"""Fixtures of the engine's unit tests."""

from __future__ import annotations

import os

import pytest

# The Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen
# before triton is first imported, by whichever test imports it first (the GPU tests run in
# their own session, `make gpu-check`, where triton compiles for the device).
os.environ.setdefault("TRITON_INTERPRET", "1")

from services.engine.kernels import cpu


@pytest.fixture
def kernels() -> cpu.CpuKernels:
    """The CPU's kernels; tests that take them are skipped where no C compiler exists."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler: the engine uses its torch path, tested elsewhere")
    k = cpu.kernels()
    assert k is not None, "a C compiler is present but the kernels did not build (see the log)"
    return k
