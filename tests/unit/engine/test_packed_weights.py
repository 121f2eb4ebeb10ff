"""The CPU's product over packed weights (packed_gemm.c): used by steps that only decode, and by
steps with prompt tokens where it is chosen for them (EPD_CPU_BLAS, else MKL's products), with
the same greedy tokens either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.kernels import cpu
from services.engine.kernels import select as kernel_select
from services.engine.models.llama import Linear
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
    dense_llm.engine.runner.model.packed_tied_head = None
    dense = [o.token_ids for o in dense_llm.generate(prompts, params)]

    packed_rows: list[int] = []
    real = kernels.packed_gemm
    monkeypatch.setattr(cpu, "kernels", lambda: dataclasses.replace(
        kernels, packed_gemm=lambda x, *a, **kw: packed_rows.append(x.shape[0]) or real(x, *a, **kw)))
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    assert (model.packed_tied_head is not None) == tied and all(
        m.packed is not None for m in model.modules() if isinstance(m, Linear))
    assert [o.token_ids for o in llm.generate(prompts, params)] == dense
    # Only decode batches (at most 3 rows) went through the packed weights; prompt chunks of up
    # to 64 tokens never did. Per decode step: 5 products (qkv, o, gate, up, down) x 2 layers,
    # and the output layer.
    assert packed_rows and max(packed_rows) <= 3
    assert len(packed_rows) % 11 == 0

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
    rows: list[int] = []
    real = kernels.packed_gemm
    monkeypatch.setattr(cpu, "kernels", lambda: dataclasses.replace(
        kernels, packed_gemm=lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw)))
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    llm.engine.prompt_logits(list(range(3, 200)))
    assert rows == [197] * 11  # 5 products x 2 layers, and the output layer, for every token
