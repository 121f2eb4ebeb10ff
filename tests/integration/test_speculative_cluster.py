"""Speculative decoding and batch-invariant mode through the cluster.

The decodes draft (``EPD_DECODE_SPECULATIVE_CONFIG``, n-gram) and every engine is batch-invariant
(``EPD_{PREFILL,DECODE}_BATCH_INVARIANT``); the offline engine is batch-invariant and does not
draft. Prompts repeat a phrase, so drafts exist and many are kept (the metric says so). Tokens
must be the offline engine's, and with batch invariance so must every logprob, bit for bit,
though the first token comes from a prefill instance, the rest from a decode instance, in other
batches and in verify steps of several tokens.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.integration.test_cluster import completions

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
PROMPTS = [phrase * 5 for phrase in random_prompts(6, [4, 7, 9, 12, 20, 31], seed=5)]


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPD_DECODE_SPECULATIVE_CONFIG", SPEC)
        mp.setenv("EPD_PREFILL_BATCH_INVARIANT", "true")
        mp.setenv("EPD_DECODE_BATCH_INVARIANT", "true")
        with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=2, kv_cache_gib=0.05,
                             device="cpu") as running:
            yield running


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), num_kv_blocks=1024, batch_invariant=True)


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.05, top_k=40, seed=77)])
def test_answers_equal_the_offline_engine_without_speculation(cluster, offline, params):
    drafted = cluster.metric("decode", "epd_spec_decode_draft_tokens_total")
    accepted = cluster.metric("decode", "epd_spec_decode_accepted_tokens_total")
    got = asyncio.run(completions(cluster.url, PROMPTS, max_tokens=48, ignore_eos=True, **params))
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True, **params))
    assert got == [o.token_ids for o in want]
    assert cluster.metric("decode", "epd_spec_decode_draft_tokens_total") > drafted
    assert cluster.metric("decode", "epd_spec_decode_accepted_tokens_total") > accepted
    assert cluster.leftovers() == []


def test_logprobs_are_the_offline_engines_bit_for_bit(cluster, offline):
    want = offline.generate(PROMPTS[:3], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0, logprobs=5))
    for prompt, expected in zip(PROMPTS[:3], want):
        reply = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
            "model": "tiny-chat0", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 5,
            "ignore_eos": True, "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in expected.logprobs]
    assert cluster.leftovers() == []
