"""The disaggregated cluster on CUDA: 2 prefill + 2 decode instances (``--device cuda``) over each
``--kv-transport`` (in fp32; bf16 over ``auto``), answering as the offline engine on CUDA does.

A CUDA engine's KV pool is device memory, which the shm and tcp transports cannot reach, so
today prefill hands over no KV and decode recomputes the prompt (docs/ARCHITECTURE.md); the
hand-over is counted as ``none`` (a future device-to-device transport would count ``done``).
Either way the answers must be the offline engine's:

- fp32 (``EPD_PREFILL_DTYPE`` / ``EPD_DECODE_DTYPE``, which the children inherit): token for
  token, as ``tests/integration/test_cluster.py`` asserts on the CPU;
- bf16 (CUDA's default): differently shaped batches round differently, and a random model's
  near-uniform next-token distribution turns that into the odd flipped near-tie, so greedy
  continuations must agree over the same common-prefix share as ``test_bf16.py`` states.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.transfer.engine import TRANSPORT_CHOICES
from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.gpu.test_bf16 import GREEDY_MIN_AGREEMENT
from tests.integration.test_cluster import CHUNK, LENGTHS, completions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_TOKENS = 12
# bf16 only over the default transport: within a CUDA cluster the transport carries no KV yet,
# so one bf16 run covers the numerics, and make gpu-check has 8 minutes for everything.
SETUPS = [*((transport, "float32") for transport in TRANSPORT_CHOICES), ("auto", "bfloat16")]


@pytest.fixture(scope="module", params=SETUPS, ids=[f"{t}-{d}" for t, d in SETUPS])
def setup(request, tiny_chat_model_dir):
    """(running cluster, offline engine, dtype) for one transport and dtype."""
    transport, dtype = request.param
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPD_PREFILL_DTYPE", dtype)  # the children inherit it
        env.setenv("EPD_DECODE_DTYPE", dtype)
        with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=2, kv_cache_gib=0.05,
                             max_num_batched_tokens=CHUNK, device="cuda", kv_transport=transport) as running:
            offline = LLM(str(tiny_chat_model_dir), num_kv_blocks=1024, device="cuda", dtype=dtype)
            yield running, offline, dtype
            assert running.leftovers() == []


def common_prefix_fraction(expected: list[int], got: list[int]) -> float:
    k = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return k / len(expected)


def test_disaggregated_on_cuda_equals_monolithic(setup):
    cluster, offline, dtype = setup
    prompts = random_prompts(20, LENGTHS, vocab=49152, seed=5)
    before = {result: cluster.metric("decode", "epd_kv_transfers_total", result=result)
              for result in ("done", "none", "failed")}
    served = asyncio.run(completions(cluster.url, prompts, temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    expected = [o.token_ids for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))]
    assert all(len(tokens) == NUM_TOKENS for tokens in served)
    if dtype == "float32":
        assert served == expected
    else:
        fractions = [common_prefix_fraction(e, s) for e, s in zip(expected, served)]
        assert sum(fractions) / len(fractions) >= GREEDY_MIN_AGREEMENT, fractions
    moved = {result: cluster.metric("decode", "epd_kv_transfers_total", result=result) - before[result]
             for result in before}
    # Every prompt reached decode: by transfer (done) or, from a device pool, to recompute (none).
    assert moved["done"] + moved["none"] == len(prompts) and moved["failed"] == 0, moved
    assert cluster.leftovers() == []
