"""Speculative decoding on decode instances: the cluster's answers stay the offline engine's.

The decodes get ``EPD_DECODE_SPECULATIVE_CONFIG`` (n-gram drafting); the offline engine runs
without it. Prompts repeat a phrase, so drafts exist and many are kept (the metric says so).
"""

from __future__ import annotations

import asyncio
import json

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
        with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=2, kv_cache_gib=0.05,
                             device="cpu") as running:
            yield running


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), num_kv_blocks=1024)


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
