"""The CPU's bf16 product over packed weights (packed_gemm_bf16.c, built where the CPU has
AVX512_BF16; on AMX's tiles where the CPU has them, tested both ways there): float sums of exact
bf16 products rounded once, a row's bits independent of the batch, and a bf16 engine's every
product through it."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM
from tests.unit.engine.test_packed_weights import counted


@pytest.fixture
def bf16_kernels(kernels):
    if not kernels.packs_bf16:
        pytest.skip("the bf16 product needs AVX512_BF16 (this CPU, the compiler or the build target lacks it)")
    return kernels


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The exact sums of the bf16 inputs (float64), rounded once to bf16."""
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).to(torch.bfloat16)


@pytest.mark.parametrize("num_in, num_out, bias", [
    (576, 960, False), (576, 100, True), (1536, 576, False),
    (129, 70, True), (1, 33, False),   # an odd k (its last term alone), one term
])
def test_the_bf16_product_rounds_the_float_sums_once(bf16_kernels, num_in, num_out, bias):
    torch.manual_seed(num_in)
    w = torch.randn(num_out, num_in).bfloat16()
    b = torch.randn(num_out).bfloat16() if bias else None
    packed = bf16_kernels.pack_weight(w)
    x = torch.randn(300, num_in).bfloat16()
    batch = bf16_kernels.packed_gemm(x, packed, b, num_out)
    want = reference(x, w, b)
    # float sums rounded once: a bf16 rounding step from the exact result at most, plus the float
    # sum's own error (bounded by the terms' magnitudes) where they cancel
    terms = x.double().abs() @ w.double().abs().T
    assert ((batch.double() - want.double()).abs() <= want.double().abs() * 2.0 ** -7 + terms * 2.0 ** -20).all()
    assert (batch == want).float().mean().item() > 0.9
    for rows in (1, 5, 6, 7, 16, 17, 32, 33, 97):   # one tile, several, one block, several blocks (AMX: 16, 32)
        for start in (0, 3, 300 - rows):
            got = bf16_kernels.packed_gemm(x[start:start + rows], packed, b, num_out)
            assert torch.equal(got, batch[start:start + rows])   # a row's bits do not depend on the rest
    wide = torch.randn(300, 2 * num_in).bfloat16()
    wide[:, :num_in] = x
    assert torch.equal(bf16_kernels.packed_gemm(wide[:, :num_in], packed, b, num_out), batch)
    assert bf16_kernels.packed_gemm(x[:0], packed, b, num_out).shape == (0, num_out)


@pytest.mark.parametrize("num_in, num_out", [(576, 1536), (101, 37)])
def test_the_gated_bf16_product_is_silu_of_the_gate_times_up(bf16_kernels, num_in, num_out):
    torch.manual_seed(num_out)
    gate, up = (torch.randn(num_out, num_in) * 0.1).bfloat16(), (torch.randn(num_out, num_in) * 0.1).bfloat16()
    packed = bf16_kernels.pack_gated(gate, up)
    x = (torch.randn(200, num_in) * 3).bfloat16()
    batch = bf16_kernels.packed_gemm_gated(x, packed, num_out)
    g, u = x.double() @ gate.double().T, x.double() @ up.double().T
    want = torch.nn.functional.silu(g) * u
    # SiLU and the product of float sums, rounded once: within a bf16 rounding, plus the float
    # sums' own errors carried through (SiLU's slope is under 1.1)
    tg, tu = x.double().abs() @ gate.double().abs().T, x.double().abs() @ up.double().abs().T
    carried = (1.1 * tg * u.abs() + torch.nn.functional.silu(g).abs() * tu) * 2.0 ** -20
    assert ((batch.double() - want).abs() <= want.abs() * 2.0 ** -8 * 1.01 + carried + 1e-30).all()
    for rows in (1, 6, 13, 200):
        assert torch.equal(bf16_kernels.packed_gemm_gated(x[:rows], packed, num_out), batch[:rows])


def test_a_bf16_engine_puts_every_product_through_the_packed_bf16_weights(tiny_llama_dir, monkeypatch,
                                                                            bf16_kernels):
    rows = counted(monkeypatch, bf16_kernels)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, dtype="bfloat16", device="cpu")
    assert llm.engine.runner.prompt_products == "packed"
    llm.engine.prompt_logits(list(range(3, 200)))
    assert rows == [197] * 9  # 4 products (gate and up one) x 2 layers, and the output layer
    rows.clear()
    exact = LLM(str(tiny_llama_dir), num_kv_blocks=64, dtype="bfloat16", device="cpu", exact_prefill=True)
    exact.engine.prompt_logits(list(range(3, 200)))
    assert rows == [] and exact.engine.runner.prompt_products == "torch"
