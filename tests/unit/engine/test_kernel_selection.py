"""Which kernels the engine runs where (services.engine.kernels.select), checked without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.engine.kernels import cpu
from services.engine.kernels import select as kernel_select

CUDA = torch.device("cuda")  # a device value only: nothing here touches a GPU


@pytest.mark.parametrize("device_type, dtype, is_triton_usable, is_cpu_usable, expected", [
    ("cuda", torch.bfloat16, True, False, "triton"),
    ("cuda", torch.float32, True, True, "triton"),
    ("cuda", torch.bfloat16, False, True, "torch"),  # no triton, or turned off
    ("cpu", torch.float32, False, True, "cpu"),
    ("cpu", torch.float32, True, False, "torch"),    # no C compiler, or turned off
    ("cpu", torch.bfloat16, True, True, "cpu"),      # the C kernels are built for fp32 and bf16
    ("cpu", torch.float16, True, True, "torch"),     # but not fp16
    ("mps", torch.float32, True, True, "torch"),
])
def test_choose(device_type, dtype, is_triton_usable, is_cpu_usable, expected):
    assert kernel_select.choose(device_type, dtype, is_triton_usable=is_triton_usable,
                                is_cpu_usable=is_cpu_usable) == expected


def test_cuda_gets_triton_unless_it_is_missing_or_turned_off(monkeypatch):
    monkeypatch.setattr(kernel_select, "triton_installed", lambda: True)
    monkeypatch.delenv(kernel_select.TRITON_ENV, raising=False)
    assert kernel_select.attention_backend(CUDA, torch.bfloat16) == "triton"
    assert kernel_select.attention_backend(CUDA, torch.float32) == "triton"
    monkeypatch.setenv(kernel_select.TRITON_ENV, "0")
    assert kernel_select.attention_backend(CUDA, torch.bfloat16) == "torch"
    monkeypatch.setenv(kernel_select.TRITON_ENV, "1")
    monkeypatch.setattr(kernel_select, "triton_installed", lambda: False)
    assert kernel_select.attention_backend(CUDA, torch.bfloat16) == "torch"


def test_the_cpu_keeps_its_c_kernels(monkeypatch):
    monkeypatch.setattr(kernel_select, "triton_installed", lambda: True)
    expected = "torch" if cpu._compiler() is None else "cpu"
    assert kernel_select.attention_backend(torch.device("cpu"), torch.float32) == expected
    assert kernel_select.attention_backend(torch.device("cpu"), torch.bfloat16) == expected
    assert kernel_select.attention_backend(torch.device("cpu"), torch.float16) == "torch"
    assert kernel_select.kernels_for(expected) is cpu.kernels()
    monkeypatch.setenv("EPD_CPU_KERNELS", "0")
    cpu.kernels.cache_clear()
    try:
        assert kernel_select.attention_backend(torch.device("cpu"), torch.float32) == "torch"
        assert kernel_select.kernels_for("torch") is None
    finally:
        cpu.kernels.cache_clear()


def test_the_engine_imports_without_importing_triton():
    code = ("import sys; import services.engine.model_runner, services.engine.kernels.select; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert done.returncode == 0, done.stderr


def test_triton_kernels_are_imported_only_when_chosen():
    pytest.importorskip("triton", reason="triton is not installed (it is pinned in requirements.txt)")
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; "
            "from services.engine.kernels import select; "
            "k = select.kernels_for('triton'); "
            "assert type(k).__name__ == 'TritonKernels' and 'triton' in sys.modules; "
            "assert callable(k.paged_decode) and callable(k.paged_prefill) and callable(k.rope_store)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("setting, expected", [
    ("auto", "packed"),   # on every CPU: a row's bits never depend on the batch (MKL's do)
    ("packed", "packed"),
    ("mkl", "mkl"),
])
def test_prompt_products_are_chosen_by_the_setting(setting, expected):
    assert kernel_select.choose_prompt_products(setting) == expected


def test_an_unknown_blas_setting_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="EPD_CPU_BLAS='openblas': must be one of auto, mkl, packed"):
        kernel_select.choose_prompt_products("openblas")


@pytest.mark.parametrize("product, vendor, pays", [
    ("amx", "GenuineIntel", True),            # AMX's tiles: ~3x the fp32 product's GFLOP/s
    ("avx512_bf16", "AuthenticAMD", True),    # Zen 4: ~2x
    ("avx512_bf16", "GenuineIntel", False),   # Intel's dot products alone: below its fp32 product
    ("", "AuthenticAMD", False),              # not built: torch would emulate bf16
])
def test_bf16_pays_where_its_packed_product_outruns_fp32(product, vendor, pays):
    assert kernel_select.bf16_pays(product, vendor) is pays
