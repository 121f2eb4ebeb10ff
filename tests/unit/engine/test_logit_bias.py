"""logit_bias: carried on the wire, added to the logits after the grammar mask, never to logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common import wire
from services.common.errors import InvalidRequestError
from services.common.sampling_params import SamplingParams
from services.engine import LLM
from services.engine.grammar import TokenBitmask
from services.engine.sampler import Sampler, SamplingRow
from tests.factories import random_prompts

PROMPT = random_prompts(1, [12])[0]


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [], [], None)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64)


def greedy(llm, max_tokens=4, **params) -> list[int]:
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params))
    return out.token_ids


def test_plus_100_makes_a_token_come_out_and_minus_100_bans_one(llm):
    plain = greedy(llm)
    forced = next(t for t in range(3, 512) if t not in plain)
    assert greedy(llm, logit_bias={forced: 100}) == [forced] * 4
    banned = greedy(llm, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0] and plain[0] not in banned
    assert greedy(llm, logit_bias={forced: 0.0}) == plain  # a zero bias changes nothing


def test_logprobs_stay_those_of_the_raw_logits(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0].logprobs[0]
    forced = next(t for t in range(3, 512) if t not in (plain.token_id, *dict(plain.top)))
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                  logit_bias={forced: 100}))
    [biased] = out.logprobs
    assert biased.token_id == forced and biased.top == plain.top  # the raw distribution's top
    assert biased.logprob < plain.top[-1][1]  # the raw logprob of a token that was not in the top


def test_bias_comes_after_the_grammar_mask():
    logits = torch.zeros(2, 40)
    bits = torch.zeros((1, 2), dtype=torch.int32)
    bits[0, 0] = (1 << 5) | (1 << 6)  # row 0 may only say 5 or 6
    mask = TokenBitmask(rows=[0], bits=bits)
    rows = [row(temperature=0, logit_bias={7: 100, 6: 1}), row(temperature=0, logit_bias={7: 100, 39: 100})]
    out = Sampler()(logits, rows, mask)
    assert out.token_ids == [6, 7]  # +100 cannot lift a token the grammar forbids
    assert torch.equal(logits, torch.zeros(2, 40))  # the raw logits are left alone


def test_sampled_rows_and_ids_past_the_logits_width():
    logits = torch.zeros(3, 16)
    rows = [row(temperature=1.0, seed=s, logit_bias={3: 100, 99: 100}) for s in range(3)]
    assert Sampler()(logits, rows).token_ids == [3, 3, 3]  # id 99 (padding, another vocab) is skipped
    rows = [row(temperature=1.0, seed=s, logit_bias={t: -100 for t in range(15)}) for s in range(3)]
    assert Sampler()(logits, rows).token_ids == [15, 15, 15]


def test_sampling_params_check_and_normalise_the_bias():
    params = SamplingParams(logit_bias={9: 1, 2: -100.0})
    assert params.logit_bias == ((2, -100.0), (9, 1.0))
    assert SamplingParams(logit_bias=((9, 1), (2, -100))) == params
    for bad in ({1: 100.5}, {1: math.nan}, {-1: 0}, {2**31: 0}, ((1, 0), (1, 1)), {1: "x"}):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("bias", [{}, {0: -100.0, 7: 0.125, 2**31 - 1: 100.0, 5: 1e-300}])
def test_logit_bias_round_trips_the_wire_exactly(bias):
    params = SamplingParams(temperature=0, logit_bias=bias)
    assert wire.params_from_proto(wire.params_to_proto(params)) == params
