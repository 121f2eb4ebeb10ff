"""GGUF reading and model loading: tiny GGUF files written here, then SmolLM2 against transformers.

Oracles, strongest first: transformers' own GGUF loader (SmolLM2 and the tiny files), transformers'
torch dequantization kernels, a line-by-line port of ggml's C dequantization for the K-quants, and
the weights the tiny files were written from.
"""

from __future__ import annotations

import json
import os
import time

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
from gguf import GGMLQuantizationType as Q

from services.common.errors import ModelNotFoundError
from services.engine.models import loader
from services.engine.models.config import ModelConfig
from services.engine.models.gguf_file import dequantize
from services.engine.models.loader import load_model
from tests.gguf_factories import (
    HIDDEN,
    HEADS,
    KV_HEADS,
    INTER,
    LAYERS,
    HEAD_DIM,
    VOCAB,
    hf_weights,
    write_gguf,
    read_weights,
    ggml_dequantize_row_q4_k,
    ggml_dequantize_row_q6_k,
    random_k_blocks,
    transformers_gguf,
)


# --- tiny files -----------------------------------------------------------------------------------

def test_f32_llama_weights_are_exact_and_unpermuted(tmp_path):
    original = hf_weights("llama", tied=False)
    _, ours = read_weights(write_gguf(tmp_path / "tiny.gguf", "llama", original))
    assert sorted(ours) == sorted(original)
    for name, value in original.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], torch.from_numpy(value)), name


def test_config_from_metadata(tmp_path):
    config, _ = read_weights(write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights("llama", tied=False)))
    assert config == ModelConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=LAYERS,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512,
        rms_norm_eps=float(np.float32(1e-6)), rope_theta=500000.0, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=1, eos_token_ids=(2,), name="tiny",
    )
    assert config.rope_scaling is None


# Worst error per element relative to the tensor's largest magnitude: half a step, or a whole one
# where Q4_0 clips the extreme of the opposite sign.
QUANT_TOLERANCE = {Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.13, Q.Q4_1: 0.13}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_quantized_weights_dequantize_and_unpermute(tmp_path, qtype):
    original = hf_weights("llama", tied=False)
    _, ours = read_weights(write_gguf(tmp_path / "tiny.gguf", "llama", original, qtype_of=lambda name: qtype))
    for name, value in original.items():
        if value.ndim == 1:
            assert torch.equal(ours[name], torch.from_numpy(value)), name
            continue
        # Quantization works row by row, so it commutes with the row permutation of q/k.
        expected = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
        assert torch.equal(ours[name], torch.from_numpy(np.asarray(expected, np.float32))), name
        error = (ours[name] - torch.from_numpy(value)).abs().max().item()
        assert error <= QUANT_TOLERANCE[qtype] * np.abs(value).max(), name


def k_quant_file(tmp_path, seed=0):
    """A tiny llama with every quantization type we promise: K-quants as hand-built blocks."""
    rng = np.random.default_rng(seed)
    original = hf_weights("llama", tied=False, seed=seed)
    raw, expected = {}, dict(original)
    for i in range(LAYERS):
        up, down = f"model.layers.{i}.mlp.up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"
        up_blocks, down_blocks = random_k_blocks(rng, INTER, Q.Q4_K), random_k_blocks(rng, HIDDEN * 2, Q.Q6_K)
        raw[up] = (up_blocks, Q.Q4_K)
        raw[down] = (down_blocks.reshape(HIDDEN, -1), Q.Q6_K)
        expected[up] = ggml_dequantize_row_q4_k(up_blocks).reshape(INTER, HIDDEN)
        expected[down] = ggml_dequantize_row_q6_k(down_blocks).reshape(HIDDEN, INTER)
    qtypes = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.F16, "gate_proj": Q.BF16}

    def qtype_of(name):
        return next((q for part, q in qtypes.items() if part in name), Q.Q8_0)

    path = write_gguf(tmp_path / "tiny-k.gguf", "llama", original, qtype_of=qtype_of, raw=raw)
    return path, expected, raw


def test_k_quants_match_ggml_reference_and_transformers_kernels(tmp_path):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    path, expected, raw = k_quant_file(tmp_path)
    _, ours = read_weights(path)
    for name, (blocks, qtype) in raw.items():
        assert torch.equal(ours[name], torch.from_numpy(expected[name])), name
        theirs = hf_dequantize(torch.from_numpy(blocks.reshape(-1)), int(qtype)).reshape(ours[name].shape)
        assert torch.equal(ours[name], theirs), name


def test_qwen2_keeps_biases_and_is_not_permuted(tmp_path):
    original = hf_weights("qwen2", tied=True)
    config, ours = read_weights(write_gguf(tmp_path / "tiny-qwen.gguf", "qwen2", original, pre="qwen2"))
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, True)
    assert "lm_head.weight" not in ours and "model.layers.1.self_attn.k_proj.bias" in ours
    assert sorted(ours) == sorted(original)
    for name, value in original.items():
        assert torch.equal(ours[name], torch.from_numpy(value)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_reads_tiny_files_as_we_do(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    if arch == "llama":
        path, _, _ = k_quant_file(tmp_path)
    else:
        path = write_gguf(tmp_path / "tiny-qwen.gguf", "qwen2", hf_weights("qwen2", tied=True), pre="qwen2",
                          qtype_of=lambda name: Q.Q8_0)
    _, ours = read_weights(path)
    with transformers_gguf():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    theirs = model.state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def _write_llama3_freqs(factor):
    def write(writer):
        freqs = 1.0 / 500000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        wavelen = 2 * np.pi / freqs
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        mid = 1 / ((1 - smooth) / factor + smooth)
        values = np.where(wavelen < 8192 / 4.0, 1.0, np.where(wavelen > 8192 / 1.0, factor, mid))
        writer.add_tensor("rope_freqs.weight", values.astype(np.float32), raw_dtype=Q.F32)
    return write


def test_rope_scaling_from_metadata_and_llama3_freqs(tmp_path):
    linear = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), lambda w: w.add_rope_scaling_factor(2.0)]
    config, _ = read_weights(write_gguf(tmp_path / "a.gguf", "llama", hf_weights("llama", True), metadata=linear))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}

    config, weights = read_weights(write_gguf(tmp_path / "b.gguf", "llama", hf_weights("llama", True),
                                              metadata=[_write_llama3_freqs(32.0)]))
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert not any("rope_freqs" in name for name in weights)


# --- the loader ---------------------------------------------------------------------------------

def test_unknown_model_raises_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)  # a directory, but not a model
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="weights.bin"):
        load_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match="broken.gguf"):
        load_model(str(tmp_path / "broken.gguf"), cache_dir=tmp_path)


def test_gguf_is_converted_once_then_read_from_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EPD_CACHE_DIR", str(cache))
    conversions = []
    convert = loader.convert_gguf
    monkeypatch.setattr(loader, "convert_gguf", lambda *args: conversions.append(args) or convert(*args))
    original = hf_weights("llama", tied=True)
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", original)

    first = load_model(str(path))
    second = load_model(str(path))
    assert len(conversions) == 1
    assert first.path == second.path and first.path.startswith(str(cache / "tiny-llama-"))
    assert sorted(os.listdir(first.path)) == ["config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json"]
    # No temporary directory left behind (.digests remembers the file's content digest).
    assert sorted(os.listdir(cache)) == [".digests", os.path.basename(first.path)]
    assert first.config == second.config and first.config.name == "tiny-llama"
    for name, value in original.items():
        assert torch.equal(second.weights[name], torch.from_numpy(value)), name
    assert second.tokenizer is not None and second.tokenizer.eos_token_ids == (2,)
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n"

    copy = tmp_path / "elsewhere" / "tiny-llama.gguf"  # the same file elsewhere (another venv): no new conversion
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert load_model(str(copy)).path == first.path and len(conversions) == 1
    os.utime(path, ns=(1, 1))  # touched, same content: still the same conversion
    assert load_model(str(path)).path == first.path and len(conversions) == 1

    changed = dict(original, **{"model.norm.weight": original["model.norm.weight"] + 1})
    write_gguf(path, "llama", changed)  # replaced in place: a new conversion
    replaced = load_model(str(path))
    assert len(conversions) == 2 and replaced.path != first.path
    assert torch.equal(replaced.weights["model.norm.weight"], torch.from_numpy(changed["model.norm.weight"]))


def test_hf_directory_with_shards(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    original = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in hf_weights("qwen2", tied=True).items()}
    original["lm_head.weight"] = original["model.embed_tokens.weight"].clone()  # tied, but stored anyway
    names = sorted(original)
    weight_map = {}
    for index, shard in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file_name = f"model-0000{index + 1}-of-00002.safetensors"
        safetensors.torch.save_file({k: original[k] for k in shard}, model_dir / file_name)
        weight_map |= {k: file_name for k in shard}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Some repos also ship the same weights consolidated under other names; the index leaves it out.
    safetensors.torch.save_file({"consolidated.w": torch.zeros(1)}, model_dir / "consolidated.safetensors")
    config = ModelConfig(architecture="qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, tie_word_embeddings=True, attention_bias=True,
                         eos_token_ids=(2,))
    (model_dir / "config.json").write_text(json.dumps(config.to_hf_dict()))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))

    loaded = load_model(str(model_dir), cache_dir=tmp_path / "unused")
    assert loaded.tokenizer is None and loaded.path == str(model_dir)
    assert loaded.config.name == "my-model" and loaded.config.eos_token_ids == (2, 5)
    assert loaded.config.attention_bias and loaded.config.architecture == "qwen2"
    assert sorted(loaded.weights) == sorted(set(names) - {"lm_head.weight"})
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name].float()), name
    assert not (tmp_path / "unused").exists()


# --- SmolLM2, the model the package ships ---------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    converted = load_model(cache_dir=cache)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPD_CACHE_DIR", str(cache))
        # The second load must read the cache, never convert again (asserted, not timed).
        patch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted the GGUF twice"))
        start = time.perf_counter()
        cached = load_model("smollm2")
        print(f"SmolLM2 cached load: {time.perf_counter() - start:.3f} s")
    return converted, cached


def test_smollm2_config(smollm2):
    converted, cached = smollm2
    assert converted.config == cached.config == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=float(np.float32(1e-5)), rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), name="SmolLM2-135M-Instruct", dtype="bfloat16",  # Q4_1
    )
    assert "lm_head.weight" not in cached.weights and len(cached.weights) == 272


def test_smollm2_cached_load_reads_the_same_weights(smollm2):
    converted, cached = smollm2
    assert cached.path == converted.path
    for name, tensor in converted.weights.items():
        assert torch.equal(tensor, cached.weights[name]), name


def test_smollm2_dequantization_matches_transformers_kernels():
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    reader = gguf.GGUFReader(loader.default_gguf_path())
    quantized = [t for t in reader.tensors if t.tensor_type in (Q.Q4_1, Q.Q8_0)]
    assert {t.tensor_type for t in quantized} == {Q.Q4_1, Q.Q8_0}
    for tensor in quantized[:40]:
        theirs = hf_dequantize(torch.from_numpy(np.array(tensor.data).reshape(-1)), int(tensor.tensor_type))
        assert torch.equal(torch.from_numpy(dequantize(tensor)).reshape(-1), theirs), tensor.name


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2):
    from transformers import LlamaForCausalLM

    _, cached = smollm2
    gguf_path = loader.default_gguf_path()
    with transformers_gguf():
        model = LlamaForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    theirs = model.state_dict()
    assert set(theirs) - set(cached.weights) == {"lm_head.weight"}  # tied: transformers lists it anyway
    for name, tensor in cached.weights.items():
        assert torch.equal(tensor, theirs[name]), name
