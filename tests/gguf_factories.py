"""Tiny GGUF files written with gguf.GGUFWriter, and ggml's reference dequantizers, for loader tests."""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.engine.models.config import ModelConfig
from services.engine.models.gguf_file import GGUFFile

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 256, 4, 2, 512, 2  # 256: the K-quant block length
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "e r"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (bytes_to_unicode), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


TOKENS = SPECIAL + gpt2_byte_chars() + [merge.replace(" ", "") for merge in MERGES]
TOKEN_TYPES = [3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL))
VOCAB = len(TOKENS)


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
        if arch == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{_TO_GGUF[rest]}.{kind}"
    return f"{_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: what a llama GGUF holds for q/k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch, weights, qtype_of=lambda name: Q.F32, raw=None, metadata=None, pre="smollm"):
    """A GGUF the way llama.cpp's converter lays one out; ``raw`` maps HF name -> (blocks, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in [
        ("block_count", LAYERS), ("context_length", 512), ("embedding_length", HIDDEN),
        ("feed_forward_length", INTER), ("head_count", HEADS), ("head_count_kv", KV_HEADS),
        ("rope_freq_base", 500000.0), ("layer_norm_rms_eps", 1e-6), ("rope_dimension_count", HEAD_DIM),
        ("tokenizer_model", "gpt2"), ("tokenizer_pre", pre), ("token_list", TOKENS), ("token_types", TOKEN_TYPES),
        ("token_merges", MERGES), ("bos_token_id", 1), ("eos_token_id", 2), ("add_bos_token", False),
        ("chat_template", TEMPLATE),
    ]:
        getattr(writer, f"add_{method}")(value)
    for write in (metadata or ()):
        write(writer)
    for name, value in weights.items():
        if name in (raw or {}):
            blocks, qtype = raw[name]
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=qtype)
            continue
        if arch == "llama" and "q_proj" in name:
            value = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and "k_proj" in name:
            value = llama_cpp_permute(value, KV_HEADS)
        qtype = qtype_of(name) if value.ndim == 2 else Q.F32
        writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_weights(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config(name="tiny")
    return config, dict(gguf_file.iter_weights(config))


# --- ggml's C dequantization (ggml-quants.c), ported loop for loop, as the K-quant oracle ---------

def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def ggml_dequantize_row_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _fp16(blocks, 0), _fp16(blocks, 2), blocks[:, 4:16], blocks[:, 16:144]

    def get_scale_min_k4(j):
        if j < 4:
            return scales[:, j] & 63, scales[:, j + 4] & 63
        return ((scales[:, j + 4] & 0xF) | ((scales[:, j - 4] >> 6) << 4),
                (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4))

    y = np.empty((blocks.shape[0], 256), np.float32)
    out, q, is_ = 0, 0, 0
    for _ in range(0, 256, 64):
        sc, m = get_scale_min_k4(is_)
        d1, m1 = d * sc, dmin * m
        sc, m = get_scale_min_k4(is_ + 1)
        d2, m2 = d * sc, dmin * m
        for lane in range(32):
            y[:, out + lane] = d1 * (qs[:, q + lane] & 0xF) - m1
            y[:, out + 32 + lane] = d2 * (qs[:, q + lane] >> 4) - m2
        out, q, is_ = out + 64, q + 32, is_ + 2
    return y


def ggml_dequantize_row_q6_k(blocks: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8), _fp16(blocks, 208)
    y = np.empty((blocks.shape[0], 256), np.float32)
    for half in (0, 1):
        l0, h0, s0, y0 = 64 * half, 32 * half, 8 * half, 128 * half
        for lane in range(32):
            is_ = lane // 16
            qh_l = qh[:, h0 + lane].astype(np.int32)
            q1 = ((ql[:, l0 + lane] & 0xF) | (((qh_l >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, l0 + lane + 32] & 0xF) | (((qh_l >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, l0 + lane] >> 4) | (((qh_l >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, l0 + lane + 32] >> 4) | (((qh_l >> 6) & 3) << 4)) - 32
            for offset, q, s in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                y[:, y0 + offset + lane] = d * sc[:, s0 + is_ + s] * q.astype(np.float32)
    return y


def random_k_blocks(rng, n_blocks: int, qtype: Q) -> np.ndarray:
    """Random K-quant blocks whose fp16 scales are sane numbers rather than random bit patterns."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scale_offsets = (0, 2) if qtype == Q.Q4_K else (208,)
    for offset in scale_offsets:
        blocks[:, offset:offset + 2] = rng.uniform(0.01, 0.1, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks


@contextlib.contextmanager
def transformers_gguf():
    """transformers refuses GGUF without accelerate, which it does not otherwise use on this path."""
    import transformers.modeling_utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        yield
