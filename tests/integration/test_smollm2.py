"""The real default model, SmolLM2-135M-Instruct, end to end through the offline API."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import transformers

from services.common.sampling_params import StructuredOutput
from services.engine import LLM, SamplingParams
from services.engine.models.loader import load_model

CHAT = [{"role": "user", "content": "Write a short poem about the sea, then explain it."}]


@pytest.fixture(scope="module")
def llm():
    """fp32, the exact mode (auto would pick bf16 on a CPU that computes it natively)."""
    return LLM(kv_cache_gib=0.5, max_num_batched_tokens=256, dtype="float32")


@pytest.fixture(scope="module")
def hf():
    # Same weights: transformers reads the safetensors directory our loader converted the GGUF into.
    path = load_model(None).path
    return transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exact():
    """The opt-in mode whose prompts take transformers' exact arithmetic."""
    return LLM(kv_cache_gib=0.1, max_num_batched_tokens=256, exact_prefill=True)


def test_logits_and_64_greedy_tokens_match_transformers(llm, exact, hf):
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert torch.equal(exact.engine.prompt_logits(prompt), expected)  # transformers' own sums
    for engine in (llm.engine, exact.engine):
        for chunk_size in (None, 16):  # a fresh prompt, continued chunks: our attention kernel
            assert (engine.prompt_logits(prompt, chunk_size=chunk_size) - expected).abs().max().item() <= 1e-4
    ids = torch.tensor([prompt])
    # An explicit mask: the chat prompt contains <|im_end|>, which transformers would take for padding.
    hf_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert llm.generate(prompt, greedy)[0].token_ids == hf_ids
    assert exact.generate(prompt, greedy)[0].token_ids == hf_ids


def test_chat_answers_and_stops_on_eos(llm):
    out = llm.chat(CHAT[:0] + [{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=48))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stop_string_cuts_the_text(llm):
    free = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40))[0]
    word = free.text.split()[3]
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[word]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == free.text[:free.text.index(word)]


def test_seeded_chat_is_reproducible_and_prefix_cache_hits(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24)
    a = llm.chat(CHAT, params)[0]
    b = llm.chat(CHAT, params)[0]
    assert a.text == b.text and a.token_ids == b.token_ids
    assert b.num_cached_tokens == 16 * ((len(b.prompt_token_ids) - 1) // 16)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "country": {"type": "string", "maxLength": 16}},
                "required": ["city", "country"], "additionalProperties": False},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 2},
    "role": {"enum": ["student", "engineer", "artist", "other"]}},
    "required": ["name", "age", "address", "hobbies", "role"], "additionalProperties": False}


def test_json_schema_output_validates_for_ten_seeds(llm):
    chat = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, address, hobbies, role."}]
    structured = StructuredOutput("json_schema", json.dumps(PERSON))
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=80, structured=structured) for seed in range(10)]
    outs = llm.chat([chat] * 10, params)
    assert [o.finish_reason for o in outs] == ["stop"] * 10
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) >= 5


BF16_MAX_LOGIT_DIFF = 2.0
"""bf16's stated tolerance to fp32 on SmolLM2's logits (which reach ~38): measured 0.63-1.23 on
six chat prompts with their 64-token continuations, the continued-chunk kernel included (here: two
prompts, 48 tokens)."""
BF16_MIN_AGREEMENT = 0.95
"""Teacher-forced greedy agreement with fp32 (the same token at each position of fp32's own
continuation, so one early flip does not decide the rest): measured 0.987 (379 of 384)."""


def test_bf16_stays_within_its_tolerance_and_agrees_with_fp32s_greedy_tokens(llm):
    bf16 = LLM(kv_cache_gib=0.25, max_num_batched_tokens=256, dtype="bfloat16")
    assert bf16.engine.runner.attention_backend == llm.engine.runner.attention_backend
    chats = ["Explain how a hash table works.", "Write a Python function that reverses a string."]
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in chats]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    num_equal = num_tokens = 0
    for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
        tokens = prompt + out.token_ids
        exact = llm.engine.prompt_logits(tokens)[len(prompt) - 1:-1]
        for chunk_size in (None, 32):  # a fresh prompt (SDPA) and continued chunks (the bf16 kernel)
            got = bf16.engine.prompt_logits(tokens, chunk_size=chunk_size)[len(prompt) - 1:-1]
            assert (got - exact).abs().max().item() <= BF16_MAX_LOGIT_DIFF
            num_equal += (got.argmax(-1) == exact.argmax(-1)).sum().item()
            num_tokens += len(exact)
    assert num_equal / num_tokens >= BF16_MIN_AGREEMENT


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def test_fp32_logits_are_as_close_to_a_float64_reference_as_transformers_own(llm, exact, hf):
    """The exactness contract that leaves room for speed: against the same model in float64,
    our prompt logits (default mode, fresh and in chunks) are as far off as transformers' own
    fp32: the RMS error over the prompts within 10% of transformers', the largest within 2x
    transformers' largest (another summation order moves single errors either way. Measured: RMS
    1.00x, 0.99x in chunks, largest 1.19x on a Xeon with AVX-512; RMS 1.00x, largest 1.52x, on one
    of the four prompts, on an AMD Zen 3 with AVX2; RMS 0.95x, largest 0.72x on an AMD Zen 4, where
    the prefill kernel's one running sum of values had made it 2.41x). The exact mode is exactly as
    far off as transformers."""
    reference = transformers.LlamaForCausalLM.from_pretrained(load_model(None).path, torch_dtype=torch.float64).eval()
    chats = [CHAT, [{"role": "user", "content": "Explain how a hash table works, with an example in Python."}]]
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat)) for chat in chats]
    rng = torch.Generator().manual_seed(2)
    prompts += [torch.randint(100, llm.engine.model_config.vocab_size, (n,), generator=rng).tolist() for n in (300, 700)]
    errors = {"theirs": [], "ours": [], "ours_chunked": []}
    for prompt in prompts:
        with torch.no_grad():
            truth = reference(torch.tensor([prompt])).logits[0]
            errors["theirs"].append(hf(torch.tensor([prompt])).logits[0].double() - truth)
        errors["ours"].append(llm.engine.prompt_logits(prompt).double() - truth)
        errors["ours_chunked"].append(llm.engine.prompt_logits(prompt, chunk_size=16).double() - truth)
        assert torch.equal(exact.engine.prompt_logits(prompt).double() - truth, errors["theirs"][-1])
    theirs = torch.cat(errors.pop("theirs"))
    for name, error in errors.items():
        error = torch.cat(error)
        assert rms(error) <= 1.1 * rms(theirs), (name, rms(error), rms(theirs))
        assert error.abs().max().item() <= 2 * theirs.abs().max().item(), (name, error.abs().max(), theirs.abs().max())
