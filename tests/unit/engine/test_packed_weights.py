"""oneDNN-packed weights on the CPU: used by steps that only decode, never by steps with prompt
tokens (whose sums must stay transformers' own), and the same greedy tokens either way."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.models import llama
from services.engine.models.llama import Linear, LlamaForCausalLM
from tests.factories import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def test_a_packed_linear_computes_the_same_product():
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True)
    layer.weight.normal_()
    layer.bias.normal_()
    layer.pack()
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, 96)
        dense = layer(x)
        assert torch.equal(dense, torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert (layer(x, packed=True) - dense).abs().max().item() <= 1e-5 * dense.abs().max().item()


@pytest.mark.parametrize("tied", [False, True])
def test_decode_steps_use_the_packed_weights_and_prompt_steps_do_not(tmp_path, monkeypatch, tied):
    path = make_tiny_model_dir(tmp_path / "m", "llama", seed=3, tie_word_embeddings=tied)
    prompts = [[(5 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate([9, 70, 200])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    monkeypatch.setattr(LlamaForCausalLM, "pack_for_decode", lambda self: False)
    dense = [o.token_ids for o in LLM(str(path), num_kv_blocks=128).generate(prompts, params)]
    monkeypatch.undo()

    packed_rows: list[int] = []
    real = llama._packed_linear
    monkeypatch.setattr(llama, "_packed_linear", lambda x, *a: packed_rows.append(x.shape[0]) or real(x, *a))
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    assert (model.packed_tied_head is not None) == tied and all(
        m.packed is not None for m in model.modules() if isinstance(m, Linear))
    assert [o.token_ids for o in llm.generate(prompts, params)] == dense
    # Only decode batches (at most 3 rows) went through the packed weights; prompt chunks of up
    # to 64 tokens never did. Per decode step: 4 linear layers x 2 layers + the output layer.
    assert packed_rows and max(packed_rows) <= 3
    assert len(packed_rows) % 9 == 0

    packed_rows.clear()
    llm.engine.prompt_logits(prompts[0])
    assert packed_rows == []
