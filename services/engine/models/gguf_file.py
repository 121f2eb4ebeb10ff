"""Read a llama.cpp GGUF file: the architecture, fp32 weights under Hugging Face names, the tokenizer.

GGUF keeps everything in one file, laid out for llama.cpp rather than for transformers:

    metadata   "llama.block_count", "tokenizer.ggml.tokens", ...   -> ModelConfig, tokenizers.Tokenizer
    tensors    "blk.3.attn_q.weight" (Q4_1 blocks, rows permuted)  -> "model.layers.3.self_attn.q_proj.weight"

The loader converts a file once into an HF-style directory (see ``loader.py``); nothing here caches.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from services.common.errors import ModelNotFoundError
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp token types (llama_token_type): 3 CONTROL is a special token like <|im_end|>,
# 4 USER_DEFINED an added token like <think> that is matched whole but is not special.
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of HF tokenizer.json files whose pre-tokenizer is not plain GPT-2 ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers parameter name for a GGUF tensor, or None for one we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to llama Q/K weights and biases.

    HF rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs. The
    converter interleaves the halves so its RoPE works; we put them back:

        per head, gguf rows  [x0 y0 x1 y1 ... ]   (pairs)
               hf rows       [x0 x1 ... y0 y1 ...] (halves)
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as fp32 in numpy (row-major, HF) shape."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    out = np.asarray(values, dtype=np.float32).reshape(shape)
    # F32 comes back as a view of the read-only memory map, which torch must not wrap.
    return out if out.flags.writeable and out.flags.c_contiguous else out.copy()


class GGUFFile:
    """A parsed GGUF file. Parsing the metadata takes seconds for a 50k-token vocabulary."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as exc:  # bad magic, truncated file, ...
            raise ModelNotFoundError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.architecture = str(self.get("general.architecture"))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelNotFoundError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported "
                f"(expected one of {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self, key: str, default=None):
        return self.get(f"{self.architecture}.{key}", default)

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def model_config(self, name: str) -> ModelConfig:
        hidden = int(self._arch("embedding_length"))
        num_heads = int(self._arch("attention.head_count"))
        eos = self.get("tokenizer.ggml.eos_token_id")
        eot = self.get("tokenizer.ggml.eot_token_id")  # end of turn, also a stop token
        eos_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
        tokens = self.get("tokenizer.ggml.tokens")
        # GGUF shapes list the fastest dimension first: token_embd is [hidden, vocab].
        vocab_size = len(tokens) if tokens is not None else self._tensors["token_embd.weight"].shape[1]
        head_dim = int(self._arch("attention.key_length", hidden // num_heads))
        bos = self.get("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length")),
            num_layers=int(self._arch("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self._arch("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(self._arch("context_length", 2048)),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(head_dim),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            name=name,
            dtype=self._published_dtype(),
        )

    def _published_dtype(self) -> str:
        """float32 where the matrices are F32, float16 where F16; bfloat16 for BF16 and every
        quantized type (dequantized here to fp32, but published for 16-bit inference)."""
        matrix = next((t for t in self._tensors.values() if len(t.shape) == 2 and t.name != "token_embd.weight"),
                      None)
        if matrix is None or matrix.tensor_type == gguf.GGMLQuantizationType.F32:
            return "float32"
        return "float16" if matrix.tensor_type == gguf.GGMLQuantizationType.F16 else "bfloat16"

    def _rope_scaling(self, head_dim: int) -> dict | None:
        """HF rope_scaling from ``rope.scaling.*`` keys, or from llama 3's ``rope_freqs`` tensor."""
        kind = self._arch("rope.scaling.type")
        if kind not in (None, "none"):
            scaling = {"rope_type": kind, "factor": float(self._arch("rope.scaling.factor", 1.0))}
            original = self._arch("rope.scaling.original_context_length")
            if original is not None:
                scaling["original_max_position_embeddings"] = int(original)
            for key in ("yarn_beta_fast", "yarn_beta_slow"):
                if (value := self._arch(f"rope.scaling.{key}")) is not None:
                    scaling[key.removeprefix("yarn_")] = float(value)
            return scaling
        if "rope_freqs.weight" in self._tensors:
            return self._llama3_scaling(dequantize(self._tensors["rope_freqs.weight"]), head_dim)
        return None

    def _llama3_scaling(self, factors: np.ndarray, head_dim: int) -> dict:
        """llama.cpp stores llama 3 scaling only as per-frequency divisors; recover the parameters.

        Only ``factor`` varies between released llama 3.x models, so we assume the other three and
        check that they reproduce the stored divisors exactly rather than guess silently.
        """
        scaling = {
            "rope_type": "llama3",
            "factor": float(factors.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if not np.allclose(llama3_rope_factors(scaling, self._arch("rope.freq_base", 10000.0), head_dim), factors):
            raise ModelNotFoundError(f"{self.path}: rope_freqs do not match llama 3 rope scaling")
        return scaling

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as (HF name, fp32 tensor), Q/K un-permuted for llama."""
        for gguf_name, tensor in self._tensors.items():
            if gguf_name == "rope_freqs.weight":
                continue  # folded into config.rope_scaling
            name = hf_tensor_name(gguf_name)
            if name is None:
                raise ModelNotFoundError(f"{self.path}: unexpected tensor {gguf_name!r} for {self.architecture}")
            values = dequantize(tensor)
            if self.architecture == "llama" and ".self_attn.q_proj." in name:
                values = unpermute_rope(values, config.num_heads)
            elif self.architecture == "llama" and ".self_attn.k_proj." in name:
                values = unpermute_rope(values, config.num_kv_heads)
            yield name, torch.from_numpy(np.ascontiguousarray(values))

    def tokenizer(self) -> tuple[BackendTokenizer, dict] | None:
        """The tokenizer and its tokenizer_config.json entries, or None if we cannot build it."""
        kind = self.get("tokenizer.ggml.model")
        if kind != "gpt2":
            logger.warning("%s: tokenizer model %r is not supported; serving token ids only", self.path, kind)
            return None
        tokens = [str(t) for t in self.get("tokenizer.ggml.tokens")]
        token_types = [int(t) for t in self.get("tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = [str(m) for m in self.get("tokenizer.ggml.merges", [])]
        pre = str(self.get("tokenizer.ggml.pre", "default"))
        add_bos = bool(self.get("tokenizer.ggml.add_bos_token", False))
        bos_id = self.get("tokenizer.ggml.bos_token_id")
        backend = build_byte_level_bpe(tokens, token_types, merges, pre)
        if add_bos and bos_id is not None:
            bos = tokens[int(bos_id)]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
            )
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
            token_id = self.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None and int(token_id) < len(tokens):
                config[f"{name}_token"] = tokens[int(token_id)]
        if (template := self.get("tokenizer.chat_template")) is not None:
            config["chat_template"] = str(template)
        return backend, config


def llama3_rope_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight``."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low_wavelen = old_context / scaling["low_freq_factor"]
    high_wavelen = old_context / scaling["high_freq_factor"]
    out = []
    for freq in 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Split text the way the vocabulary's merges were learned (llama.cpp's ``tokenizer.ggml.pre``).

    "smollm" matches HF SmolLM2's tokenizer.json (StarCoder style): each digit alone, then the
    GPT-2 regex. Unknown names get plain GPT-2 byte-level splitting.
    """
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    split = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
             "llama3": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        if pre not in ("default", "gpt-2", "gpt2"):
            logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2 byte-level splitting", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def build_byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> BackendTokenizer:
    """A GPT-2 style byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary metadata."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # Llama 3's tokenizer.json sets ignore_merges: a whole word found in the vocab wins outright.
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre == "llama-bpe")
    backend = BackendTokenizer(bpe)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _CONTROL]
    # User-defined tokens (<think>) must be matched whole but are text, so decode keeps them.
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend
