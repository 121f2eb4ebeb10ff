"""The disaggregated path with the real model: 2 prefill + 2 decode SmolLM2 instances answer 20
chat requests exactly as the offline engine does, greedy and seeded-sampled, and each request
sent alone exactly as it came among the 20: in each precision the machine computes natively
(tests/factories.machine_dtypes), and with ``--batch-invariant`` required."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import machine_dtypes

TOPICS = ["the sea", "volcanoes", "bread", "the moon", "trains", "bees", "snow", "libraries", "chess",
          "rivers", "clocks", "owls", "glass", "maps", "tea", "bridges", "deserts", "violins", "salt"]
QUESTIONS = [f"In two sentences, tell me something surprising about {t}." for t in TOPICS]
# One prompt long enough to take several 64-token prefill chunks.
QUESTIONS.append("Summarise this list in one line: " + ", ".join(f"item {i} is {t}" for i, t in enumerate(TOPICS * 3)))
CASES = [dict(temperature=0), dict(temperature=0.7, seed=42)]
MODES = [(dtype, False) for dtype in machine_dtypes()] + [("auto", True)]


@pytest.fixture(scope="module", params=MODES, ids=[f"{d}{'-batch-invariant' if b else ''}" for d, b in MODES])
def cluster(request):
    dtype, batch_invariant = request.param
    with running_cluster("", encoders=0, prefills=2, decodes=2, kv_cache_gib=0.1, max_num_batched_tokens=64,
                         device="cpu", dtype=dtype, batch_invariant=batch_invariant) as running:
        yield running, dtype


async def ask(url: str, questions: list[str], **params) -> list[list[int]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": q}], max_tokens=16,
            extra_body={"return_token_ids": True}, **params) for q in questions))
    return [r.choices[0].model_extra["token_ids"] for r in replies]


@pytest.mark.slow
@pytest.mark.parametrize("params", CASES, ids=["greedy", "seeded"])
def test_smollm2_disaggregated_equals_monolithic_batched_and_alone(cluster, params):
    cluster, dtype = cluster
    served = asyncio.run(ask(cluster.url, QUESTIONS, **params))
    llm = LLM(None, kv_cache_gib=0.1, dtype=dtype)
    expected = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(max_tokens=16, **params))
    assert served == [o.token_ids for o in expected]
    alone = [asyncio.run(ask(cluster.url, [q], **params))[0] for q in QUESTIONS[::4]]
    assert alone == served[::4]
    assert cluster.metric("decode", "epd_kv_transfers_total", result="failed") == 0
