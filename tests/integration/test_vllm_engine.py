"""vLLM as the engine of the prefill and decode services (``epd up --engine vllm``), with real
vLLM processes from ``.venv-vllm`` (``make setup-vllm``, which ``make test`` runs): 1 prefill + 1
decode of SmolLM2 in fp32, the prompt's KV handed over through epd's connector and transfer
engine, answering 20 chat prompts greedy, and seeded ones one at a time, token for token as
vLLM's own offline ``LLM`` with the same settings; a stream's shape and usage; nothing held
after (no lease, no staging slot, no request in either engine). Then a model epd's own engine
does not run, a tiny random Qwen3-MoE: refused by epd's engine with the reason, served
disaggregated by vLLM's as vLLM's offline LLM serves it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.peers import VLLM_READY, VLLM_VENV
from benchmarks.peers.driver import LineDriver
from services.common.errors import ModelNotFoundError
from services.common.tokenizer import Tokenizer, read_tokenizer_config
from services.engine import LLM
from services.engine.models.loader import resolve_model_dir
from tests.cluster import running_cluster
from tests.factories import TINY_MOE, make_tiny_chat_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "volcanoes", "bread", "the moon", "trains", "bees", "snow", "libraries", "chess", "rivers",
          "clocks", "owls", "glass", "maps", "tea", "bridges", "deserts", "violins", "salt", "kites"]
QUESTIONS = [f"In two sentences, tell me something surprising about {t}." for t in TOPICS]
MAX_TOKENS = 16
EAGER = json.dumps({"enforce_eager": True})
OFFLINE = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "vllm_offline.py"


@pytest.fixture(scope="module")
def venv():
    if not VLLM_READY.exists():
        pytest.fail(f"{VLLM_READY} missing: `make test` builds vLLM's venv first (make setup-vllm)")
    return VLLM_VENV


def offline_llm(venv: Path, model_dir: Path) -> LineDriver:
    """vLLM's offline LLM with the cluster's settings (fp32, blocks of 128, prefix caching, eager:
    torch.compile's warm-up takes ~90 s a process on 2 cores)."""
    return LineDriver("vLLM", [str(venv / "bin" / "python"), str(OFFLINE), "--model", str(model_dir),
                               "--dtype", "float32", "--block-size", "128", "--enable-prefix-caching",
                               "--enforce-eager"],
                      f"test-vllm-offline-{model_dir.name}.log", 600, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.fixture(scope="module")
def offline(venv):
    driver = offline_llm(venv, resolve_model_dir(None)[0])
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def cluster(venv):
    with running_cluster("", engine="vllm", engine_args=EAGER, encoders=0, prefills=1, decodes=1, kvstores=0,
                         kv_cache_gib=0.25, dtype="float32", device="cpu", startup_timeout_s=600) as running:
        yield running


def chat_prompt(question: str, model_dir: Path | None = None) -> list[int]:
    """The token ids the router makes of a one-message chat (SmolLM2's template)."""
    model_dir = model_dir or resolve_model_dir(None)[0]
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.json", read_tokenizer_config(model_dir))
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [chat_prompt(q) for q in QUESTIONS]


async def ask(url: str, questions: list[str], model: str = MODEL, **params) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        return await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS,
            extra_body={"return_token_ids": True, "ignore_eos": True}, **params) for q in questions))


def token_ids(reply) -> list[int]:
    return reply.choices[0].model_extra["token_ids"]


def test_twenty_greedy_chats_equal_vllms_offline_llm(cluster, offline, prompts):
    served = asyncio.run(ask(cluster.url, QUESTIONS, temperature=0))
    want = offline.ask({"prompts": prompts, "max_tokens": MAX_TOKENS}, 600)["token_ids"]
    assert [token_ids(r) for r in served] == want
    assert all(r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == MAX_TOKENS
               for r, p in zip(served, prompts))
    # (These prompts are shorter than a block of 128: decode computes them; the next test's moves KV.)
    assert cluster.metric("decode", "epd_vllm_first_token_mismatches_total") == 0


def test_a_long_prompt_moves_its_kv_and_answers_like_vllm(cluster, offline):
    question = "Summarise this list in one line: " + ", ".join(f"item {i} is {t}" for i, t in enumerate(TOPICS * 4))
    ids = chat_prompt(question)
    assert len(ids) > 256  # two full blocks of 128 move from prefill to decode
    before = cluster.metric("decode", "epd_kv_transfers_total", result="done")
    served = asyncio.run(ask(cluster.url, [question], temperature=0))[0]
    assert served.usage.prompt_tokens == len(ids)
    want = offline.ask({"prompts": [ids], "max_tokens": MAX_TOKENS}, 600)["token_ids"][0]
    assert token_ids(served) == want
    assert cluster.metric("decode", "epd_kv_transfers_total", result="done") == before + 1
    assert cluster.metric("decode", "epd_kv_handover_path_total", path="staged") >= 1


def test_seeded_chats_one_at_a_time_equal_vllms(cluster, offline, prompts):
    for i, seed in ((0, 7), (5, 42), (9, 1234)):
        served = asyncio.run(ask(cluster.url, [QUESTIONS[i]], temperature=0.8, seed=seed))[0]
        want = offline.ask({"prompts": [prompts[i]], "max_tokens": MAX_TOKENS,
                            "params": {"temperature": 0.8, "seed": seed}}, 600)["token_ids"][0]
        assert token_ids(served) == want, (i, seed)


def test_a_stream_has_the_shape_and_usage_of_the_whole_reply(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    whole = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=300).json()
    text, usage, finishes = "", None, []
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    finishes += [choice["finish_reason"]] if choice.get("finish_reason") else []
                usage = event.get("usage") or usage
    assert text == whole["choices"][0]["message"]["content"]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_nothing_is_held_after_the_requests(cluster):
    assert cluster.leftovers() == []
    assert cluster.metric("prefill", "epd_kv_staging_slots_in_use") == 0
    assert cluster.metric("decode", "epd_kv_staging_slots_in_use") == 0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-moe"), smollm2_dir, seed=3, arch="qwen3_moe",
                                    **TINY_MOE)


def test_epds_engine_refuses_a_mixture_of_experts_naming_it(moe_dir):
    with pytest.raises(ModelNotFoundError, match=r"model_type 'qwen3_moe' \(Qwen3MoeForCausalLM\) is not an "
                                                 r"architecture epd's engine runs.*--engine vllm"):
        LLM(str(moe_dir), num_kv_blocks=16)


def test_a_mixture_of_experts_served_disaggregated_by_vllm_equals_its_offline_llm(venv, moe_dir):
    questions = QUESTIONS[:6] + ["Summarise this list in one line: " + ", ".join(
        f"item {i} is {t}" for i, t in enumerate(TOPICS * 3))]  # a prompt of more than a block: KV moves
    driver = offline_llm(venv, moe_dir)
    try:
        want = driver.ask({"prompts": [chat_prompt(q, moe_dir) for q in questions], "max_tokens": MAX_TOKENS},
                          600)["token_ids"]
    finally:
        driver.close()
    with running_cluster(str(moe_dir), engine="vllm", engine_args=EAGER, encoders=0, prefills=1, decodes=1,
                         kvstores=0, kv_cache_gib=0.1, dtype="float32", device="cpu", startup_timeout_s=600) as moe:
        served = asyncio.run(ask(moe.url, questions, temperature=0, model=moe_dir.name))
        assert [token_ids(r) for r in served] == want
        assert moe.metric("decode", "epd_kv_transfers_total", result="done") >= 1
        assert moe.leftovers() == []
