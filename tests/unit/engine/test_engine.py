"""Engine behaviour on a tiny random Llama: batching, chunking, caching, preemption, the seam."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError
from services.engine import LLM, SamplingParams
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = [5, 1500, 17, 800, 33, 250, 64, 1200, 9, 400, 128, 700, 6, 999, 48, 300]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=1024)


@pytest.fixture(scope="module")
def solo_outputs(llm):
    """Each prompt run alone, with the default (large) step budget."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in random_prompts(16, LENGTHS)]


def test_mixed_batch_with_chunked_prefill_equals_each_alone(tiny_llama_dir, solo_outputs):
    small = LLM(str(tiny_llama_dir), num_kv_blocks=1024, max_num_batched_tokens=96)
    outs = small.generate(random_prompts(16, LENGTHS), GREEDY)
    assert [o.token_ids for o in outs] == solo_outputs
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)


def test_preemption_by_recompute_keeps_outputs(tiny_llama_dir, solo_outputs):
    # 1500 + 1200 + 999 + 800 tokens do not fit 200 blocks of 16 at once: requests get preempted.
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=200, max_num_batched_tokens=512)
    outs = tight.generate(random_prompts(16, LENGTHS), GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == solo_outputs


def test_seeded_sample_is_the_same_alone_and_in_a_batch(llm):
    prompts = random_prompts(6, [40, 7, 300, 90, 12, 500], seed=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=10, ignore_eos=True), GREEDY,
              SamplingParams(temperature=1.2, min_p=0.05, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=99, max_tokens=5, ignore_eos=True)]
    batch = llm.generate(prompts[1:3] + [prompts[0]] + prompts[3:], others[:2] + [seeded] + others[2:])
    assert batch[2].token_ids == alone
    again = llm.generate(prompts[0], seeded)[0].token_ids
    assert again == alone
    other_seed = llm.generate(prompts[0], SamplingParams(**{**seeded.__dict__, "seed": 4321}))[0]
    assert other_seed.token_ids != alone


def test_prefix_cache_hit_gives_the_same_output_as_a_miss(tiny_llama_dir):
    prompt = random_prompts(1, [300], seed=3)[0]
    cold = LLM(str(tiny_llama_dir), num_kv_blocks=256, enable_prefix_caching=False)
    miss = cold.generate(prompt, GREEDY)[0]
    warm = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    first = warm.generate(prompt, GREEDY)[0]
    hit = warm.generate(prompt, GREEDY)[0]
    assert miss.num_cached_tokens == first.num_cached_tokens == 0
    assert hit.num_cached_tokens == 288  # 18 full blocks; the last token is always computed
    assert miss.token_ids == first.token_ids == hit.token_ids
    # A prompt that shares only a prefix hits that prefix's full blocks.
    branch = prompt[:100] + random_prompts(1, [50], seed=4)[0]
    assert warm.generate(branch, GREEDY)[0].num_cached_tokens == 96


def test_export_import_continues_exactly_where_the_first_engine_stopped(tiny_llama_dir):
    prompt = random_prompts(1, [203], seed=5)[0]
    reference = LLM(str(tiny_llama_dir), num_kv_blocks=128).generate(prompt, GREEDY)[0].token_ids
    prefill = LLM(str(tiny_llama_dir), num_kv_blocks=128)
    first = prefill.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].token_ids
    assert first == reference[:1]
    export = prefill.engine.prefix.export_kv(prompt)
    assert export.num_tokens == 192 and len(export.blocks) == 12
    k0 = export.blocks[0].data[0, 0]  # layer 0's K view of the first block
    assert k0.shape == (16, 2, 16) and k0.abs().sum() > 0
    decode = LLM(str(tiny_llama_dir), num_kv_blocks=128)
    assert decode.engine.prefix.import_kv(export.blocks) == 12
    assert decode.engine.prefix.import_kv(export.blocks) == 0  # already there
    prefill.engine.prefix.release(export)
    # The decode side continues from prompt + first token; only the tail block is recomputed.
    out = decode.generate(prompt + first, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))[0]
    assert out.num_cached_tokens == 192
    assert first + out.token_ids == reference


def test_a_prefix_read_into_reserved_blocks_is_hit_and_salts_keep_caches_apart(tiny_llama_dir):
    """The KV store's seam: reserve_prefix, fill the blocks, fill_prefix; then a request hits them."""
    prompt = random_prompts(1, [150], seed=7)[0]
    reference = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompt, GREEDY)[0].token_ids
    source = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    source.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    hashes, num_local = source.engine.prefix.prompt_hashes(prompt)
    assert len(hashes) == 9 and num_local == 9
    salted, num_salted_local = source.engine.prefix.prompt_hashes(prompt, cache_salt="tenant-b")
    assert num_salted_local == 0 and not set(salted) & set(hashes)
    export = source.engine.prefix.export_kv(prompt, hashes)

    target = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    target.generate(prompt[:40], SamplingParams(temperature=0, max_tokens=1))  # 2 blocks cached locally
    reservation = target.engine.prefix.reserve_prefix(prompt, hashes, 9)
    assert reservation.num_local_blocks == 2 and len(reservation.block_ids) == 9
    for block_id, source_id in zip(reservation.block_ids[2:8], export.block_ids[2:8]):  # 6 of the 7 arrive
        target.engine.prefix.block_buffer(block_id).copy_(source.engine.prefix.block_buffer(source_id))
    target.engine.prefix.fill_prefix(reservation, prompt, hashes, range(2, 8))
    source.engine.prefix.release(export)
    assert target.engine.prefix.prompt_hashes(prompt)[1] == 8  # the 9th never arrived: not findable
    out = target.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 8 * 16 and out.token_ids == reference
    engine = target.engine
    engine.add_request(prompt, GREEDY, request_id="tenant-b", cache_salt="tenant-b")
    other = None
    while engine.has_unfinished_requests():
        other = next((o for o in engine.step() if o.finished), other)
    assert other.num_cached_tokens == 0 and other.token_ids == reference  # same tokens, no shared KV


def test_pinned_blocks_that_starve_a_request_raise_instead_of_hanging(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), num_kv_blocks=8)
    prompt = random_prompts(1, [100], seed=8)[0]
    small.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    export = small.engine.prefix.export_kv(prompt)  # pins 6 of the 8 blocks
    with pytest.raises(RuntimeError, match="pinned by exports"):
        small.generate(random_prompts(1, [60], seed=9)[0], GREEDY)
    small.engine.prefix.release(export)
    assert len(small.generate(random_prompts(1, [60], seed=9)[0], GREEDY)[0].token_ids) == 16


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts(1, [20], seed=6)[0]
    free = llm.generate(prompt, GREEDY)[0].token_ids
    stop_at = free[3]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free[:free.index(stop_at) + 1]
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at],
                                               min_tokens=6))[0]
    assert len(late.token_ids) >= 6 and stop_at not in late.token_ids[:6]


def test_logprobs_are_returned_per_token(llm):
    prompt = random_prompts(1, [20], seed=7)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.top[0][0] == token_id  # greedy takes the top token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


@pytest.mark.parametrize("prompt, params, error, message", [
    ([], SamplingParams(), InvalidRequestError, "empty"),
    ("text", SamplingParams(), InvalidRequestError, "no tokenizer"),
    ([5] * 5000, SamplingParams(), PromptTooLongError, "5000 tokens"),
    ([5, 100000], SamplingParams(), InvalidRequestError, "outside the vocabulary"),
    ([5, 6], SamplingParams(stop=["x"]), InvalidRequestError, "stop strings need a tokenizer"),
])
def test_bad_input_is_a_clear_error(llm, prompt, params, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompt, params)


def test_one_bad_prompt_in_a_batch_runs_nothing(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[5, 6, 7], []], GREEDY)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"temperature": float("nan")}, "temperature"),
    ({"logprobs": 50}, "logprobs"),
])
def test_invalid_sampling_values_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"))


def test_the_stop_token_is_in_token_ids_but_not_in_the_text(tiny_chat_model_dir):
    chat = LLM(str(tiny_chat_model_dir), num_kv_blocks=64)
    free = chat.generate("Once upon a time", GREEDY)[0]
    stop_at = free.token_ids[3]
    index = free.token_ids.index(stop_at)
    out = chat.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16,
                                                           stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free.token_ids[:index + 1]
    assert out.text == chat.tokenizer.decode(free.token_ids[:index]) and out.text != free.text
