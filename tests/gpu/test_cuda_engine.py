"""The engine on CUDA: bf16 by default, same greedy tokens as fp32 on CUDA for a tiny model."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.factories import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_by_default_and_runs_a_mixed_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=512, max_num_batched_tokens=128)
    assert llm.engine.runner.dtype == torch.bfloat16
    assert llm.engine.runner.kv_cache.is_cuda
    outs = llm.generate(random_prompts(8, [5, 300, 17, 800, 33, 250, 64, 1200]),
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)


def test_fp32_on_cuda_matches_fp32_on_cpu(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = random_prompts(4, [5, 100, 17, 400], seed=3)
    cpu = LLM(str(tiny_llama_dir), num_kv_blocks=256, device="cpu").generate(prompts, params)
    gpu = LLM(str(tiny_llama_dir), num_kv_blocks=256, device="cuda", dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_seeded_sampling_on_cuda_is_batch_invariant(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, device="cuda", dtype="float32")
    prompts = random_prompts(3, [40, 7, 300], seed=1)
    seeded = SamplingParams(temperature=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded)[0].token_ids
    batch = llm.generate(prompts, [seeded, SamplingParams(temperature=1.0, max_tokens=16), seeded])
    assert batch[0].token_ids == alone
