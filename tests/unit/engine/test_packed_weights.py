"""The CPU's product over packed weights (packed_gemm.c), and its gated form for SwiGLU: used by
steps that only decode, and by steps with prompt tokens where it is chosen for them
(EPD_CPU_BLAS, else MKL's products), with the same greedy tokens either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.kernels import cpu
from services.engine.kernels import select as kernel_select
from services.engine.models.llama import MLP, Linear
from tests.factories import make_tiny_model_dir


@pytest.mark.parametrize("num_in, num_out, bias", [
    (96, 200, True), (64, 32, False), (37, 5, True),
    (576, 960, False), (1000, 37, True),  # k in several chunks (192 terms), one a short one
])
def test_a_packed_linear_computes_the_same_product(kernels, num_in, num_out, bias):
    torch.manual_seed(num_out)
    layer = Linear(num_in, num_out, bias=bias)
    layer.weight.normal_()
    if bias:
        layer.bias.normal_()
    layer.pack(kernels)
    for rows in (1, 7, 8, 9, 32, 70, 333):  # one block of rows up to 96 (AVX-512), then blocks of 48
        x = torch.randn(rows, num_in)
        dense = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), dense)
        assert (layer(x, packed=True) - dense).abs().max().item() <= 1e-5 * dense.abs().max().item()
        # Rows that lie apart (a column slice of a wider tensor) give the same bits.
        wide = torch.randn(rows, 2 * num_in)
        wide[:, :num_in] = x
        assert torch.equal(layer(wide[:, :num_in], packed=True), layer(x, packed=True))


def test_a_row_gets_the_same_bits_alone_and_in_a_batch(kernels):
    torch.manual_seed(1)
    layer = Linear(576, 960, bias=True)
    layer.weight.normal_()
    layer.bias.normal_()
    layer.pack(kernels)
    x = torch.randn(300, 576)
    batch = layer(x, packed=True)  # several blocks of rows, split between the threads
    for i in (0, 7, 8, 28, 47, 48, 299):
        assert torch.equal(layer(x[i:i + 1], packed=True)[0], batch[i])
        assert torch.equal(layer(x[i:i + 13], packed=True)[0], batch[i])
        assert torch.equal(layer(x[i:], packed=True)[0], batch[i])


@pytest.mark.parametrize("num_in, num_out", [(576, 1536), (100, 37), (250, 1000)])
def test_the_gated_product_is_silu_of_the_gate_times_up(kernels, num_in, num_out):
    torch.manual_seed(num_out)
    gate, up = torch.randn(num_out, num_in) * 0.1, torch.randn(num_out, num_in) * 0.1
    packed_gate, packed_up = kernels.pack_weight(gate), kernels.pack_weight(up)
    packed = kernels.pack_gated(gate, up)
    x = torch.randn(300, num_in) * 3
    batch = kernels.packed_gemm_gated(x, packed, num_out)
    for rows in (1, 9, 32, 97, 300):  # one block of rows, then several
        got = kernels.packed_gemm_gated(x[:rows], packed, num_out)
        assert torch.equal(got, batch[:rows])  # a row's bits do not depend on the rest
        # The packed products' sums, SiLU within a few ulps of float64's.
        g = kernels.packed_gemm(x[:rows], packed_gate, None, num_out).double()
        want = torch.nn.functional.silu(g) * kernels.packed_gemm(x[:rows], packed_up, None, num_out).double()
        assert ((got.double() - want).abs() <= 4e-7 * want.abs()).all()
    assert torch.equal(kernels.packed_gemm_gated(x[5:6], packed, num_out)[0], batch[5])
    # Rows that lie apart give the same bits; no rows give none.
    wide = torch.randn(300, 2 * num_in)
    wide[:, :num_in] = x
    assert torch.equal(kernels.packed_gemm_gated(wide[:, :num_in], packed, num_out), batch)
    assert kernels.packed_gemm_gated(x[:0], packed, num_out).shape == (0, num_out)


def test_the_gated_silu_is_exact_at_the_ends(kernels):
    """Large gates of either sign (e^-x would overflow for x < -88), zeros and a NaN; below
    x = -87, where SiLU is under 1e-36, it gives zero."""
    x = torch.tensor([[1.0]])
    values = torch.tensor([-1e4, -100.0, -88.5, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 88.5, 100.0, 1e4, float("nan")])
    gate = values[:, None].clone()
    packed = kernels.pack_gated(gate, torch.ones_like(gate))
    got = kernels.packed_gemm_gated(x, packed, len(values))[0]
    want = torch.nn.functional.silu(values.double())
    assert torch.allclose(got.double(), want, rtol=4e-7, atol=1e-36, equal_nan=True)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_steps_use_the_packed_weights_and_prompt_steps_do_not(tmp_path, monkeypatch, tied, kernels):
    """Where torch's products are chosen for prompt tokens (MKL on Intel's CPUs)."""
    monkeypatch.setenv(kernel_select.BLAS_ENV, "mkl")
    path = make_tiny_model_dir(tmp_path / "m", "llama", seed=3, tie_word_embeddings=tied)
    prompts = [[(5 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate([9, 70, 200])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    dense_llm = LLM(str(path), num_kv_blocks=128)
    for module in dense_llm.engine.runner.model.modules():
        if isinstance(module, Linear):
            module.packed = None
        if isinstance(module, MLP):
            module.gated = None
    dense_llm.engine.runner.model.packed_tied_head = None
    dense = [o.token_ids for o in dense_llm.generate(prompts, params)]

    packed_rows = counted(monkeypatch, kernels)
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    gates_and_ups = {id(p) for m in mlps for p in (m.gate_proj, m.up_proj)}
    assert (model.packed_tied_head is not None) == tied and all(m.gated is not None for m in mlps) and all(
        (m.packed is None) == (id(m) in gates_and_ups) for m in model.modules() if isinstance(m, Linear))
    assert [o.token_ids for o in llm.generate(prompts, params)] == dense
    # Only decode batches (at most 3 rows) went through the packed weights; prompt chunks of up
    # to 64 tokens never did. Per decode step: 4 products (qkv, o, gate and up, down) x 2
    # layers, and the output layer.
    assert packed_rows and max(packed_rows) <= 3
    assert len(packed_rows) % 9 == 0

    packed_rows.clear()
    llm.engine.prompt_logits(prompts[0])
    assert packed_rows == []


def test_engines_choose_their_prompt_products_by_the_setting(tiny_llama_dir, monkeypatch, kernels):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 300])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for setting in ("mkl", "packed"):
        monkeypatch.setenv(kernel_select.BLAS_ENV, setting)
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=96)
        assert llm.engine.runner.prompt_products == ("torch" if setting == "mkl" else setting)
        outputs[setting] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["packed"] == outputs["mkl"]
    # The exact mode keeps transformers' products whatever the setting.
    assert LLM(str(tiny_llama_dir), num_kv_blocks=64, exact_prefill=True).engine.runner.prompt_products == "torch"
    monkeypatch.setenv(kernel_select.BLAS_ENV, "openblas")
    with pytest.raises(ValueError, match="must be one of auto, mkl, packed"):
        LLM(str(tiny_llama_dir), num_kv_blocks=64)


def test_packed_prompt_steps_put_every_product_through_the_packed_weights(tiny_llama_dir, monkeypatch, kernels):
    monkeypatch.setenv(kernel_select.BLAS_ENV, "packed")
    rows = counted(monkeypatch, kernels)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    llm.engine.prompt_logits(list(range(3, 200)))
    assert rows == [197] * 9  # 4 products (gate and up one) x 2 layers, and the output layer, for every token


def counted(monkeypatch, kernels) -> list[int]:
    """The rows of every packed product (plain and gated) the engines made from here on make."""
    rows: list[int] = []
    plain, gated = kernels.packed_gemm, kernels.packed_gemm_gated
    monkeypatch.setattr(cpu, "kernels", lambda: dataclasses.replace(
        kernels, packed_gemm=lambda x, *a, **kw: rows.append(x.shape[0]) or plain(x, *a, **kw),
        packed_gemm_gated=lambda x, *a, **kw: rows.append(x.shape[0]) or gated(x, *a, **kw)))
    return rows
