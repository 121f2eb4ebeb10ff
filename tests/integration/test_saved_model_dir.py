"""A model directory as transformers' ``save_pretrained`` writes it today, served by a real cluster:
the chat template is in chat_template.jinja (no longer in tokenizer_config.json), and the router,
whose tokenizer comes from the instances' ModelInfo, must still find it (it once answered every
chat request with 400 "this model has no chat template")."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import openai
import pytest
import transformers

from services.pb import common_pb2, prefill_pb2_grpc
from tests.cluster import running_cluster
from tests.factories import make_tiny_model_dir

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama and SmolLM2's tokenizer, each saved by transformers' save_pretrained."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    path = make_tiny_model_dir(tmp_path_factory.mktemp("saved") / "tiny-saved", vocab_size=len(tokenizer),
                               tie_word_embeddings=True)
    tokenizer.save_pretrained(path)
    return path


def test_a_transformers_saved_directory_serves_chat(saved_dir, smollm2_dir):
    template = (saved_dir / "chat_template.jinja").read_text()
    assert template == json.loads((Path(smollm2_dir) / "tokenizer_config.json").read_text())["chat_template"]
    assert "chat_template" not in json.loads((saved_dir / "tokenizer_config.json").read_text())
    reference = transformers.AutoTokenizer.from_pretrained(saved_dir)
    prompt = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    with running_cluster(str(saved_dir), encoders=0, prefills=1, decodes=1, kvstores=0, kv_cache_gib=0.05,
                         device="cpu") as cluster:
        [address] = cluster.addresses("prefill")
        with grpc.insecure_channel(address) as channel:
            info = prefill_pb2_grpc.PrefillStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
        assert json.loads(info.tokenizer_config_json)["chat_template"] == template
        with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            reply = client.chat.completions.create(model="tiny-saved", messages=MESSAGES, max_tokens=3,
                                                   temperature=0)
    assert reply.usage.prompt_tokens == len(reference.encode(prompt, add_special_tokens=False))
    assert reply.usage.completion_tokens == 3
