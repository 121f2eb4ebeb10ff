"""Speculative decoding: the drafter and draft length alone, then the engine with and without it."""

from __future__ import annotations

import json

import pytest

from services.common.config import ConfigError
from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from services.engine.speculative import DraftLength, DraftState, NgramDrafter, NgramIndex, SpeculativeConfig
from tests.factories import random_prompts

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})


# ----- the drafter ---------------------------------------------------------------------------

def test_the_index_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # The suffix [2, 3] last occurred at 5..6, followed by 7 at 7; [5, 2, 3] never did before.
    assert index.match(tokens) == 7
    tokens += [7]
    # [2, 3, 7] occurred at 5..7, followed by 5 at 8.
    assert index.match(tokens) == 8
    assert NgramIndex(2, 3).match([4, 5, 6]) is None
    # The suffix never finds itself: a sequence with no repeat has no match.
    assert NgramIndex(1, 4).match([1, 2, 3, 4]) is None


def test_the_index_follows_appends_and_a_cut_sequence():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3, 1]
    assert index.match(tokens) is None
    tokens.append(2)
    assert index.match(tokens) == 2
    assert index.match([5, 6, 5]) is None  # shorter than what was indexed: rebuilt from scratch
    assert index.match([5, 6, 5, 6]) == 2


def test_the_drafter_caps_drafts_at_k_and_at_the_room_left():
    state = DraftState(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert NgramDrafter().propose(tokens, state, 10) == [2, 3, 4]
    assert NgramDrafter().propose(tokens, state, 2) == [2, 3]
    assert NgramDrafter().propose(tokens, state, 0) == []


def test_draft_length_grows_on_full_accepts_shrinks_on_rejects_and_cools_down_after_misses():
    k = DraftLength(4)
    assert k.k == 4
    k.observe(4, 1)
    assert k.k == 2
    k.observe(2, 2)
    assert k.k == 3
    k.observe(3, 0)
    assert k.k == 1
    k.observe(1, 0)  # two misses in a row: drafting pauses
    assert k.k == 0
    for _ in range(DraftLength.cooldown - 1):
        k.observe(0, 0)
        assert k.k == 0
    k.observe(0, 0)
    assert k.k == 1


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle"}', "must be one of ngram"),
    ('{"num_speculative_tokens": 0}', "1 to 16"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "min <= max"),
    ('{"num_speculative_tokens": "4"}', "must be int"),
    ('{"draft_model": "x"}', "unknown field"),
    ('[1]', "JSON object"),
    ('{', "not JSON"),
])
def test_bad_speculative_configs_say_what_is_wrong(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        SpeculativeConfig.parse(text)


def test_the_engine_config_names_the_field_of_a_bad_speculative_config(tiny_llama_dir):
    with pytest.raises(ConfigError, match="speculative_config: .*must be one of ngram"):
        LLM(str(tiny_llama_dir), speculative_config='{"method": "medusa"}')


CODE = """def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
"""


# ----- the engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=512, speculative_config=SPEC)


def repetitive_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: the n-gram drafter has something to find."""
    return [phrase * 4 for phrase in random_prompts(n, [5 + 3 * i for i in range(n)], seed=7)]


def run(llm: LLM, prompts, params):
    before = (llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens)
    outs = llm.generate(prompts, params)
    drafted = llm.engine.num_draft_tokens - before[0]
    accepted = llm.engine.num_accepted_tokens - before[1]
    return outs, drafted, accepted


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
    # A random model's distribution is flat: at a low temperature its drafts get accepted.
    SamplingParams(temperature=0.05, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=33, min_tokens=20, frequency_penalty=0.5),
], ids=["greedy", "greedy-penalty-logprobs", "seeded-top-p", "seeded-min-tokens"])
def test_outputs_are_the_same_with_and_without_speculation(plain, spec, params):
    prompts = repetitive_prompts(8) + random_prompts(4, [7, 30, 100, 250], seed=3)
    expected, _, _ = run(plain, prompts, params)
    outs, drafted, accepted = run(spec, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
    if params.logprobs:
        for got, want in zip(outs, expected):
            assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
            # each verified row is computed as a plain decode is: the same bits where the CPU's
            # kernels run (torch's products, without them, depend on the rows around)
            exact = spec.engine.runner.attention_backend == "cpu"
            assert [lp.logprob for lp in got.logprobs] == (
                [lp.logprob for lp in want.logprobs] if exact else
                pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4))
    assert drafted > 0, drafted
    # At temperature 1 a random model's tokens are near uniform over its vocabulary: no draft
    # survives, which must not change the output either.
    assert accepted > 0 or params.temperature == 1.0, (drafted, accepted)
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_bf16_outputs_and_logprobs_are_the_same_bits_with_and_without_speculation(tiny_llama_dir, kernels):
    """In bf16 a verified row whose attention summed in another order than a decode's would
    round to other bf16 activations, whole units apart in the logits (greedy tokens flipped).
    Needs the packed bf16 product (oneDNN's rows depend on the batch)."""
    if not kernels.packs_bf16:
        pytest.skip("the packed bf16 product needs AVX512_BF16")
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=256, dtype="bfloat16", device="cpu")
    spec = LLM(str(tiny_llama_dir), num_kv_blocks=256, dtype="bfloat16", device="cpu", speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = repetitive_prompts(6)
    expected, _, _ = run(plain, prompts, params)
    outs, drafted, accepted = run(spec, prompts, params)
    assert accepted > 0, (drafted, accepted)
    for got, want in zip(outs, expected):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_drafts_beside_new_prompts_and_in_big_steps_keep_plain_decodings_bits(tiny_llama_dir, kernels):
    """Drafted decodes in a step with new prompts (admitted as others finish) and in steps of more
    than 64 rows (16 sequences, 4 drafts each) still attend as plain decodes. The budget keeps
    every prompt one chunk, so both engines prefill alike. Where prompt steps keep MKL's products
    (Intel's CPUs), such steps' rows are not the packed product's: there the tokens only."""
    kwargs = dict(num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=4096)
    plain = LLM(str(tiny_llama_dir), **kwargs)
    spec = LLM(str(tiny_llama_dir), **kwargs, speculative_config=SPEC)
    prompts = repetitive_prompts(20) + random_prompts(4, [40, 90, 150, 200], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 6), ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert spec.engine.num_accepted_tokens > 0
    every_step_packed = spec.engine.runner.prompt_products == "packed"
    for got, want in zip(outs, expected):
        assert got.token_ids == want.token_ids
        if every_step_packed:
            assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_a_batch_of_one_greedy_request_decodes_in_fewer_steps(plain, spec):
    prompt = repetitive_prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    counts = []
    for llm in (plain, spec):
        engine = llm.engine
        engine.add_request(prompt, params)
        num_steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
        counts.append(num_steps)
    assert counts[1] < counts[0], counts



def test_a_request_sets_its_own_number_of_drafts_or_none(plain, spec, monkeypatch):
    """num_speculative_tokens per request: 0 drafts nothing for it, 1 at most one a step; the
    tokens are the plain engine's either way."""
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected, _, _ = run(plain, prompts, params)
    off, drafted, _ = run(spec, prompts, SamplingParams(**{**vars(params), "num_speculative_tokens": 0}))
    assert drafted == 0 and [o.token_ids for o in off] == [o.token_ids for o in expected]
    scheduler = spec.engine.scheduler
    schedule, drafts_per_chunk = scheduler.schedule, []

    def spied():
        out = schedule()
        drafts_per_chunk.extend(len(c.draft_token_ids) for c in (out.chunks if out else ()))
        return out

    monkeypatch.setattr(scheduler, "schedule", spied)
    one, drafted, _ = run(spec, prompts, SamplingParams(**{**vars(params), "num_speculative_tokens": 1}))
    assert drafted > 0 and max(drafts_per_chunk) == 1
    assert [o.token_ids for o in one] == [o.token_ids for o in expected]


def test_stop_strings_and_stop_tokens_end_at_the_same_token(plain, spec):
    prompts = repetitive_prompts(6)
    reference, _, _ = run(plain, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # Stop on the 9th output token of each (it is reached inside a verified run of drafts).
    for prompt, ref in zip(prompts, reference):
        stop_id = ref.token_ids[8]
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
        want, _, _ = run(plain, [prompt], params)
        got, _, _ = run(spec, [prompt], params)
        assert got[0].token_ids == want[0].token_ids
        assert got[0].finish_reason == want[0].finish_reason == "stop"
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_max_tokens_and_a_small_pool_bound_the_drafts(tiny_llama_dir, plain):
    prompts = repetitive_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    expected, _, _ = run(plain, prompts, params)
    # 40 blocks of 16 for 12 sequences of ~100 tokens: drafts compete with preemption for room.
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=40, speculative_config=SPEC)
    outs, drafted, _ = run(tight, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(len(o.token_ids) == 37 for o in outs)
    assert drafted > 0
    assert tight.engine.block_manager.num_free_blocks == tight.engine.block_manager.num_blocks


def test_smollm2_repeating_code_keeps_most_drafts_and_the_greedy_answer(smollm2_dir):
    """The real model asked to repeat code with one change: its answer copies, so most drafts
    are kept (> 0.5), and the answer is the plain engine's, token for token."""
    chats = [[{"role": "user", "content": f"Repeat this code exactly, but {change}:\n\n{CODE}"}]
             for change in ("rename the function to merge_lists", "rename b to other")]
    chats.append([{"role": "user", "content": "Explain why the sky is blue to a ten-year-old."}])
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(str(smollm2_dir), kv_cache_gib=0.1)
    spec = LLM(str(smollm2_dir), kv_cache_gib=0.1, speculative_config=SPEC.replace('"prompt_lookup_min": 1',
                                                                                   '"prompt_lookup_min": 2'))
    want = plain.chat(chats, params)
    got = spec.chat(chats[:2], params)
    engine = spec.engine
    assert engine.num_draft_tokens > 0
    assert engine.num_accepted_tokens / engine.num_draft_tokens > 0.5, (engine.num_accepted_tokens,
                                                                        engine.num_draft_tokens)
    got += spec.chat(chats[2:], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_stop_string_inside_a_run_of_kept_drafts_ends_the_answer_there(tiny_chat_model_dir):
    """The text after a stop string is dropped even when the tokens after it arrived in the
    same verify step: the answer, its tokens and its reason are the plain engine's."""
    plain = LLM(str(tiny_chat_model_dir), num_kv_blocks=512)
    spec = LLM(str(tiny_chat_model_dir), num_kv_blocks=512, speculative_config=SPEC)
    prompts = [phrase * 4 for phrase in random_prompts(4, [6, 9, 11, 14], vocab=49152, seed=8)]
    free_run = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    num_checked = 0
    for prompt, ref in zip(prompts, free_run):
        stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        want = plain.generate([prompt], params)[0]
        got = spec.generate([prompt], params)[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop" and got.stop_reason == stop
        num_checked += 1
    assert num_checked >= 2 and spec.engine.num_accepted_tokens > 0
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks
