"""The disaggregation seam: prefill detaches after the first token, decode continues from its KV.

Two engines in one process, the KV copied block by block (what the transfer engine does
between processes); the result must equal one engine doing everything.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.engine import LLMEngine
from tests.factories import random_prompts

LENGTHS = [5, 16, 17, 300, 64, 1000, 33]
CASES = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True,
                        presence_penalty=0.5)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    prefill = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=128).engine
    decode = LLM(str(tiny_llama_dir), num_kv_blocks=256).engine
    return prefill, decode


def run(engine: LLMEngine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
                        params: SamplingParams, rid: str, transfer_ok: bool = True):
    prefill.add_request(prompt, params, rid)
    while True:
        outs = [o for o in prefill.step() if o.request_id == rid]
        if outs:
            break
    handoff = prefill.detach(rid)
    assert handoff.prompt_token_ids == prompt and len(handoff.output_token_ids) == 1
    decode.add_request(prompt, params, rid, output_token_ids=handoff.output_token_ids, hold_for_kv=True)
    reservation = decode.reserve_kv(rid)
    assert reservation is not None and len(reservation.block_ids) == len(handoff.block_ids)
    if transfer_ok:
        for src, dst in list(zip(handoff.block_ids, reservation.block_ids))[reservation.num_local_blocks:]:
            decode.prefix.block_buffer(dst).copy_(prefill.prefix.block_buffer(src))
        decode.commit_kv(rid, handoff.num_cached_tokens)
    else:
        decode.recompute_kv(rid)
    prefill.release_handoff(handoff)
    return run(decode)[rid]


@pytest.mark.parametrize("params", CASES, ids=["greedy", "seeded"])
def test_prefill_then_decode_equals_one_engine(engines, tiny_llama_dir, params):
    prefill, decode = engines
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=3)
    mono = LLM(str(tiny_llama_dir), num_kv_blocks=256).generate(prompts, params)
    for i, prompt in enumerate(prompts):
        out = prefill_then_decode(prefill, decode, prompt, params, f"r{i}-{params.seed}")
        assert out.token_ids == mono[i].token_ids, f"prompt {i} ({len(prompt)} tokens)"


def test_prefill_then_decode_equals_one_engine_in_bf16(tiny_llama_dir):
    """bf16 on the CPU (its kernels): the hand-over moves bf16 blocks and decode continues with
    the same arithmetic as one engine."""
    prefill, decode = (LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=budget,
                           dtype="bfloat16").engine for budget in (128, 2048))
    assert prefill.runner.kv_cache.dtype == torch.bfloat16 and prefill.runner.attention_backend == "cpu"
    prompts = random_prompts(4, [5, 17, 300, 64], seed=5)
    mono = LLM(str(tiny_llama_dir), num_kv_blocks=256, dtype="bfloat16").generate(prompts, CASES[0])
    for i, prompt in enumerate(prompts):
        out = prefill_then_decode(prefill, decode, prompt, CASES[0], f"bf16-{i}")
        assert out.token_ids == mono[i].token_ids, f"prompt {i} ({len(prompt)} tokens)"


def test_failed_transfer_recomputes_the_same_tokens(engines, tiny_llama_dir):
    prefill, decode = engines
    params = CASES[1]
    prompt = random_prompts(1, [200], seed=11)[0]
    mono = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompt, params)[0]
    out = prefill_then_decode(prefill, decode, prompt, params, "failed", transfer_ok=False)
    assert out.token_ids == mono.token_ids


def test_second_request_reuses_local_blocks_and_abort_frees_held_ones(engines):
    prefill, decode = engines
    params = CASES[0]
    prompt = random_prompts(1, [100], seed=12)[0]
    prefill_then_decode(prefill, decode, prompt, params, "first")
    decode.add_request(prompt, params, "again", output_token_ids=[5], hold_for_kv=True)
    reservation = decode.reserve_kv("again")
    assert reservation.num_local_blocks == 100 // 16
    decode.abort_request("again")  # the autouse fixture checks that every block is free again


def test_resumed_request_must_have_something_left_to_generate(engines):
    _, decode = engines
    with pytest.raises(ValueError, match="nothing is left to generate"):
        decode.add_request([5, 6, 7], SamplingParams(max_tokens=1), "done", output_token_ids=[9])


def test_a_request_waits_for_blocks_lent_to_decode_instead_of_failing(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=20).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(random_prompts(1, [200], seed=1)[0], params, "lent")
    while not engine.step():
        pass
    handoff = engine.detach("lent")  # 13 of 20 blocks now wait for a decode instance
    engine.add_request(random_prompts(1, [150], seed=2)[0], params, "next")
    assert engine.step() == [] and engine.step() == []  # waits: the blocks come back on release
    engine.release_handoff(handoff)
    assert run(engine)["next"].finish_reason == "length"
    # (With nothing lent out, a request that can never fit is an error: test_engine.py.)
