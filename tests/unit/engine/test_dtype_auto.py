"""``--dtype auto``: bf16 where it pays (a model published in 16 bits, a CPU with native bf16
products, or CUDA), fp32 elsewhere and for the modes that need it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.engine import LLM
from services.engine import model_runner
from services.engine.models.config import ModelConfig
from services.engine.models.loader import load_model_config
from services.engine.model_runner import resolve_dtype
from tests.gguf_factories import hf_weights, write_gguf

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-native-bf16"])
def native(request, monkeypatch):
    monkeypatch.setattr(model_runner, "cpu_computes_bf16", lambda: request.param)
    return request.param


def test_auto_is_bf16_on_the_cpu_only_for_16_bit_models_with_native_bf16(native):
    expected = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", CPU, "bfloat16") == expected
    assert resolve_dtype("auto", CPU, "float16") == expected
    assert resolve_dtype("auto", CPU, "float32") == torch.float32   # published in fp32: stays
    assert resolve_dtype("auto", CPU, "bfloat16", exact=True) == torch.float32  # exact prefill
    assert resolve_dtype("auto", CUDA, "float32") == torch.bfloat16
    for name in ("float32", "bfloat16", "float16"):   # a stated dtype is taken as it is
        assert resolve_dtype(name, CPU, "bfloat16") == getattr(torch, name)


@pytest.mark.parametrize("cfg, expected", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),             # transformers 5's key
    ({"torch_dtype": "float32"}, "float32"),
    ({}, "float32"),                               # unstated
    ({"torch_dtype": "float8_e4m3fn"}, "float32"),  # nothing the engine runs: the exact mode
])
def test_the_published_dtype_comes_from_config_json(cfg, expected):
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "vocab_size": 100}
    assert ModelConfig.from_hf_dict(base | cfg).dtype == expected


@pytest.mark.parametrize("qtype, expected", [(Q.F32, "float32"), (Q.F16, "float16"), (Q.Q8_0, "bfloat16")])
def test_a_gguf_is_published_in_its_matrices_type(tmp_path, qtype, expected):
    path = write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights("llama", tied=True), qtype_of=lambda name: qtype)
    config = load_model_config(str(path), cache_dir=tmp_path / "cache")
    assert config.dtype == expected   # through the converted directory's config.json


def test_the_default_model_is_published_in_bf16():
    assert load_model_config(None).dtype == "bfloat16"   # a Q4_1 GGUF


def test_an_engine_on_a_bf16_model_runs_bf16_where_the_cpu_computes_it(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "bf16-model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    expected = torch.bfloat16 if model_runner.cpu_computes_bf16() else torch.float32
    assert LLM(str(model_dir), num_kv_blocks=16, device="cpu").engine.runner.dtype == expected
    assert LLM(str(tiny_llama_dir), num_kv_blocks=16, device="cpu").engine.runner.dtype == torch.float32
    exact = LLM(str(model_dir), num_kv_blocks=16, device="cpu", exact_prefill=True)
    assert exact.engine.runner.dtype == torch.float32
    # batch invariance holds in bf16 wherever auto picks it (the packed bf16 product)
    assert LLM(str(model_dir), num_kv_blocks=16, device="cpu", batch_invariant=True).engine.runner.dtype == expected
