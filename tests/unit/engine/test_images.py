"""Image embeddings spliced at placeholder positions: they change the output, and their hash keeps
cached prefixes from mixing images."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from services.engine.sequence import MultiModalInput
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128).engine


def image(seed: int, rows: int = 20, hidden: int = 64) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))


def run(engine, prompt, mm_inputs=()):
    rid = engine.add_request(prompt, GREEDY, mm_inputs=mm_inputs)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out


def test_image_changes_output_and_same_image_hits_the_cache(engine):
    prompt = random_prompts(1, [80], seed=1)[0]
    plain = run(engine, prompt)
    cat = [MultiModalInput(10, image(1), "aa" * 32)]
    with_cat = run(engine, prompt, cat)
    assert with_cat.token_ids != plain.token_ids
    again = run(engine, prompt, cat)
    assert again.token_ids == with_cat.token_ids and again.num_cached_tokens == 64
    # The same placeholder tokens with another image: no block that holds the image may hit.
    dog = run(engine, prompt, [MultiModalInput(10, image(2), "bb" * 32)])
    assert dog.num_cached_tokens == 0 and dog.token_ids != with_cat.token_ids


def test_image_in_later_chunk_equals_one_chunk(tiny_llama_dir, engine):
    prompt = random_prompts(1, [200], seed=2)[0]
    mm = [MultiModalInput(30, image(3, rows=70), "cc" * 32)]
    whole = run(engine, prompt, mm)
    chunked = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_batched_tokens=32).engine
    assert run(chunked, prompt, mm).token_ids == whole.token_ids


@pytest.mark.parametrize("mm, message", [
    ([MultiModalInput(0, image(1, hidden=32), "aa")], "do not fit the model"),
    ([MultiModalInput(70, image(1), "aa")], "fall outside"),
])
def test_bad_image_inputs_are_clear_errors(engine, mm, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(random_prompts(1, [80])[0], GREEDY, mm_inputs=mm)
