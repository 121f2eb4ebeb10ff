"""SamplingParams normalises what clients send and is immutable once built."""

import dataclasses

import pytest

from services.common.errors import InvalidRequestError
from services.common.sampling_params import SamplingParams


def test_normalises_stop_and_top_k():
    p = SamplingParams(stop="END", stop_token_ids=[7, 8], top_k=-1)
    assert p.stop == ("END",) and p.stop_token_ids == (7, 8) and p.top_k == 0


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy


def test_is_frozen_and_hashable():
    p = SamplingParams(max_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 4
    assert hash(p) == hash(SamplingParams(max_tokens=3))


@pytest.mark.parametrize("kwargs, message", [
    ({"stop": ["ok", ""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    # Past what the wire's int32 / int64 fields hold (the proto conversion would fail later).
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"top_k": 2**31}, "top_k"),
    ({"max_tokens": 2**31}, "max_tokens"), ({"stop_token_ids": [1, 2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_rejects_with_the_field_named(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
