"""Structured output in the engine: every sampled token obeys the request's grammar.

A tiny random Llama that speaks through SmolLM2's tokenizer (49,152 tokens): its text is noise,
so the grammars here are bounded (enums, short patterns, maxItems) and a random model finishes
them within max_tokens; what is asserted is that the output matches, whatever the model wanted.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.sampling_params import StructuredOutput
from services.common.structured import structural_tag_spec
from services.engine import LLM, SamplingParams
from services.engine.serving.async_engine import AsyncEngine
from services.engine.grammar import GrammarMatchers, TokenBitmask
from services.engine.sampler import Sampler, SamplingRow
from tests.factories import random_prompts
from tests.unit.engine.test_handoff import prefill_then_decode, run

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "addr": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "n", "tags", "ok", "addr"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
EMAIL = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
SEEDS = range(6)


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode("Answer in the requested format:")


def sampled(structured: StructuredOutput, seed: int, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 64, "structured": structured,
                             **overrides})


def generate(llm, prompt, structured, seeds=SEEDS, **overrides):
    return llm.generate([prompt] * len(seeds), [sampled(structured, s, **overrides) for s in seeds])


def test_json_schema_output_validates_for_every_seed(llm, prompt):
    outs = generate(llm, prompt, JSON_SCHEMA)
    assert [o.finish_reason for o in outs] == ["stop"] * len(SEEDS)
    assert all(o.token_ids[-1] in llm.engine.eos_token_ids for o in outs)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # the seeds still matter


def test_greedy_rows_and_penalties_obey_the_grammar_too(llm, prompt):
    params = [SamplingParams(temperature=0, max_tokens=64, structured=JSON_SCHEMA),
              sampled(JSON_SCHEMA, 3, top_k=5, top_p=0.9, repetition_penalty=1.3, presence_penalty=1.0)]
    for out in llm.generate([prompt] * 2, params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_output_fullmatches(llm, prompt):
    for out in generate(llm, prompt, StructuredOutput("regex", EMAIL)):
        assert out.finish_reason == "stop" and re.fullmatch(EMAIL, out.text), out.text


def test_ebnf_grammar_output_matches(llm, prompt):
    grammar = 'root ::= answer " " digit digit? "!"\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    for out in generate(llm, prompt, StructuredOutput("grammar", grammar)):
        assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no) [0-9]{1,2}!", out.text), out.text


def test_json_object_output_parses_to_a_dict(llm, prompt):
    # Any object: a random model may ramble inside a string until max_tokens, so only the
    # finished ones must parse, and most must finish.
    outs = generate(llm, prompt, StructuredOutput("json_object"), seeds=range(8))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 5
    assert all(isinstance(json.loads(o.text), dict) for o in finished)
    assert all(o.text.startswith("{") for o in outs)


def test_max_tokens_cuts_a_grammar_short_with_length(llm, prompt):
    out = generate(llm, prompt, StructuredOutput("regex", "[a-z]{30}"), seeds=[0], max_tokens=3)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert re.fullmatch("[a-z]+", out.text)


def test_a_complete_grammar_wins_over_min_tokens(llm, prompt):
    # After "ok" only EOS is allowed; min_tokens cannot make anything else possible, so the first
    # EOS ends the request (not a run of EOS up to min_tokens).
    out = generate(llm, prompt, StructuredOutput("regex", "ok"), seeds=[0], min_tokens=8)[0]
    assert out.text == "ok" and out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids and len(out.token_ids) < 8
    assert [t for t in out.token_ids if t in llm.engine.eos_token_ids] == [out.token_ids[-1]]


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                         "required": ["city", "days"], "additionalProperties": False},
         "get_time": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
                      "additionalProperties": False}}
TOOL_SPEC = structural_tag_spec(
    [(f'<tool_call>{{"name": "{name}", "arguments": ', schema, "}</tool_call>") for name, schema in TOOLS.items()],
    ["<tool_call>"])


def test_structural_tag_text_outside_triggers_is_free(llm, prompt):
    structured = StructuredOutput("structural_tag", TOOL_SPEC)
    matcher = llm.engine.compile_grammar(structured).new_matcher()
    bits = GrammarMatchers(llm.engine.model_config.vocab_size).bitmask([(0, matcher)]).bits
    allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little").astype(bool)
    # Everything but special tokens other than EOS, and bytes no UTF-8 text starts with.
    special = set(llm.tokenizer.all_special_ids) - set(llm.engine.eos_token_ids)
    banned = {t for t in range(len(allowed)) if not allowed[t]}
    assert special <= banned and all(t in special or set(llm.tokenizer.decode([t])) == {"\ufffd"} for t in banned)
    assert len(banned) < 100
    greedy = dict(temperature=0, max_tokens=24)
    free = llm.generate(prompt, SamplingParams(**greedy))[0]
    tagged = llm.generate(prompt, SamplingParams(**greedy, structured=structured))[0]
    assert "<tool_call>" not in free.text and tagged.token_ids == free.token_ids


def test_structural_tag_body_after_the_trigger_matches_its_schema(llm, prompt):
    structured = StructuredOutput("structural_tag", TOOL_SPEC)
    # The tokens of "Sure. <tool_call>" as if already generated: the model is now inside a tag.
    started = llm.tokenizer.encode("Sure. <tool_call>")
    names = set()
    for seed in SEEDS:
        rid = llm.engine.add_request(prompt, sampled(structured, seed, max_tokens=48), output_token_ids=started)
        out = run(llm.engine)[rid]
        call = re.fullmatch(r'Sure\. <tool_call>(\{"name": "(\w+)", "arguments": (.*)\})</tool_call>.*',
                            out.text, re.DOTALL)
        assert call, out.text
        body = json.loads(call[1])
        assert body["name"] == call[2] and set(body) == {"name", "arguments"}
        jsonschema.validate(body["arguments"], TOOLS[call[2]])
        names.add(call[2])
    assert names == set(TOOLS)


def test_a_seed_with_a_grammar_gives_the_same_tokens_alone_and_in_a_batch(llm, prompt):
    params = sampled(JSON_SCHEMA, 11)
    alone = llm.generate(prompt, params)[0].token_ids
    assert llm.generate(prompt, params)[0].token_ids == alone
    others = [SamplingParams(temperature=1.0, max_tokens=20), sampled(StructuredOutput("regex", EMAIL), 5)]
    batch = llm.generate([prompt, prompt, llm.tokenizer.encode("other")], [others[0], params, others[1]])
    assert batch[1].token_ids == alone


def test_logprobs_are_those_of_the_raw_logits(llm, prompt):
    out = llm.generate(prompt, sampled(StructuredOutput("regex", EMAIL), 0, logprobs=2))[0]
    raw = torch.log_softmax(llm.engine.prompt_logits(prompt)[-1], dim=-1)
    first = out.logprobs[0]
    assert first.logprob == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-4)
    assert [t for t, _ in first.top] == raw.topk(2).indices.tolist()  # unconstrained alternatives


def test_matchers_are_dropped_when_requests_finish_or_abort(llm, prompt):
    engine, matchers = llm.engine, llm.engine.runner.grammars
    generate(llm, prompt, JSON_SCHEMA, seeds=range(3))
    assert len(matchers) == 0
    rid = engine.add_request(prompt, sampled(JSON_SCHEMA, 0))
    engine.step()
    engine.step()
    assert rid in matchers
    engine.abort_request(rid)
    assert len(matchers) == 0


def test_the_compile_cache_returns_the_same_grammar(llm):
    compiler = llm.engine.grammar_compiler
    structured = StructuredOutput("regex", "cache-[0-9]+")
    hits, misses = compiler.num_hits, compiler.num_misses
    first = compiler.compile(structured)
    assert (compiler.num_hits, compiler.num_misses) == (hits, misses + 1)
    assert compiler.compile(StructuredOutput("regex", "cache-[0-9]+")) is first
    assert (compiler.num_hits, compiler.num_misses) == (hits + 1, misses + 1)
    assert compiler.compile(StructuredOutput("grammar", 'root ::= "cache-" [0-9]+')) is not first


def test_the_compile_cache_evicts_the_least_recently_used(llm):
    from services.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids,
                               cache_size=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent; c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first_a
    misses = compiler.num_misses
    compiler.compile(b)
    assert compiler.num_misses == misses + 1


def test_warm_up_builds_the_tokenizer_view_once_and_leaves_errors_to_requests(llm):
    from services.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    compiler.warm_up()
    built = compiler._lltokenizer
    assert built is not None
    compiler.compile(StructuredOutput("regex", "a+"))
    assert compiler._lltokenizer is built
    narrow = GrammarCompiler(llm.tokenizer, 8, llm.engine.eos_token_ids)   # logits narrower than the vocabulary
    narrow.warm_up()
    with pytest.raises(InvalidRequestError, match="to fit the model's 8 logits"):
        narrow.compile(StructuredOutput("regex", "a+"))


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("json_schema", '{"type": "object",'), "not valid JSON"),
    (StructuredOutput("json_schema", '{"type": "objekt"}'), "not a valid JSON Schema"),
    (StructuredOutput("json_schema", '{"type": "object", "unevaluatedProperties": false}'), "unevaluatedProperties"),
    (StructuredOutput("regex", "(ab"), "unclosed group"),
    (StructuredOutput("grammar", 'root ::= "a" missing'), "Rule 'missing' not found"),
    (StructuredOutput("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<g>", "schema": {}, "end": ""}]}'),
     "starts with none of the triggers"),
])
def test_an_invalid_grammar_is_rejected_before_anything_is_queued(llm, prompt, structured, message):
    params = [SamplingParams(max_tokens=4), sampled(structured, 0)]
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.generate([prompt, prompt], params)
    assert not llm.engine.has_unfinished_requests()


def test_output_tokens_that_break_the_grammar_are_rejected(llm, prompt):
    with pytest.raises(InvalidRequestError, match="do not match the grammar"):
        llm.engine.add_request(prompt, sampled(StructuredOutput("regex", "[0-9]+"), 0),
                               output_token_ids=llm.tokenizer.encode("abc"))


def test_a_model_without_a_tokenizer_cannot_constrain(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=16).engine
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        engine.add_request([5, 6, 7], sampled(StructuredOutput("regex", "a"), 0))


def test_bitmask_masks_only_its_rows_before_greedy():
    vocab = 40  # two 32-bit words, the second one partly used
    logits = torch.arange(3 * vocab, dtype=torch.float32).view(3, vocab)
    bits = torch.zeros((2, 2), dtype=torch.int32)
    bits[0, 0] = 1 << 5                      # row 0: token 5 only
    bits[1, 1] = (1 << 1) | (1 << 3)         # row 2: tokens 33 and 35
    mask = TokenBitmask(rows=[0, 2], bits=bits)
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], None) for _ in range(3)]
    out = Sampler()(logits, rows, mask)
    assert out.token_ids == [5, vocab - 1, 35]
    assert logits[0, 39].item() == 39  # the raw logits are left alone (logprobs need them)
    masked = logits.clone()
    mask.apply_(masked)
    assert torch.isinf(masked[0]).sum().item() == vocab - 1 and torch.isinf(masked[1]).sum().item() == 0
    assert masked[2, 33].item() == logits[2, 33].item() and torch.isinf(masked[2]).sum().item() == vocab - 2
    # The path other devices take (torch ops on the logits' device) gives the same, also in bf16.
    for dtype in (torch.float32, torch.bfloat16):
        on_device = logits.to(dtype)
        mask._apply_torch_(on_device)
        assert torch.equal(on_device.float(), masked.to(dtype).float())


# ----- disaggregation: the decode instance rebuilds the grammar state from output_token_ids ---
@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir):
    prefill = LLM(str(tiny_chat_model_dir), num_kv_blocks=128, max_num_batched_tokens=128).engine
    decode = LLM(str(tiny_chat_model_dir), num_kv_blocks=128).engine
    return prefill, decode


@pytest.mark.parametrize("structured", [JSON_SCHEMA, StructuredOutput("regex", EMAIL)], ids=["json", "regex"])
def test_prefill_then_decode_equals_one_engine(llm, engines, prompt, structured):
    prefill, decode = engines
    prompts = [prompt, random_prompts(1, [300], vocab=llm.engine.model_config.vocab_size, seed=7)[0]]
    for i, p in enumerate(prompts):
        for seed in range(3):
            params = sampled(structured, seed)
            mono = llm.generate(p, params)[0]
            out = prefill_then_decode(prefill, decode, p, params, f"{structured.kind}-{i}-{seed}")
            assert out.token_ids == mono.token_ids and out.finish_reason == mono.finish_reason == "stop"
    assert len(prefill.runner.grammars) == len(decode.runner.grammars) == 0


def test_a_request_resumed_mid_document_continues_the_same_document(llm, prompt):
    params = sampled(JSON_SCHEMA, 4)
    mono = llm.generate(prompt, params)[0].token_ids
    for k in (1, 5, len(mono) // 2, len(mono) - 1):
        rid = llm.engine.add_request(prompt, params, output_token_ids=mono[:k])
        assert run(llm.engine)[rid].token_ids == mono, k


# ----- the async engine compiles off its step loop -------------------------------------------
def test_the_engine_keeps_stepping_while_a_grammar_compiles(llm, prompt, monkeypatch):
    started, release, done = threading.Event(), threading.Event(), threading.Event()
    real = llm.engine.grammar_compiler

    class SlowCompiler:
        def warm_up(self):
            real.warm_up()

        def compile(self, structured):
            started.set()
            release.wait(20)
            compiled = real.compile(structured)
            done.set()
            return compiled

    monkeypatch.setattr(llm.engine, "grammar_compiler", SlowCompiler())
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            adding = asyncio.create_task(engine.add(prompt, sampled(JSON_SCHEMA, 0), "json"))
            await asyncio.to_thread(started.wait, 20)
            free = await engine.add(prompt, free_params, "free")
            outs = [out async for out in free]  # all while the grammar is still compiling
            assert len(outs[-1].token_ids) == 12 and not done.is_set()
            release.set()
            constrained = [out async for out in await adding]
            with pytest.raises(InvalidRequestError, match="not valid JSON"):
                await engine.add(prompt, sampled(StructuredOutput("json_schema", "{"), 0), "bad")
            assert engine.num_open_streams == 0
            return constrained[-1]
        finally:
            release.set()
            await engine.stop()

    out = asyncio.run(main())
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(llm.engine.runner.grammars) == 0


def test_a_trigger_that_is_a_special_token_is_that_token(llm):
    spec = structural_tag_spec([("<filename>", {"enum": ["a.py", "b.py"]}, "<file_sep>")], ["<filename>"])
    matcher = llm.engine.compile_grammar(StructuredOutput("structural_tag", spec)).new_matcher()
    filename, file_sep = (llm.tokenizer.backend.token_to_id(t) for t in ("<filename>", "<file_sep>"))
    assert matcher.consume_tokens(llm.tokenizer.encode("see ") + [filename] + llm.tokenizer.encode('"a.py"'))
    assert matcher.compute_ff_tokens() == [file_sep]
