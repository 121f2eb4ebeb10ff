"""The architecture description a model runner needs, read from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """"llama" or "qwen2" (Llama family with q/k/v bias)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    """HF-style rope_scaling dict (rope_type linear / dynamic / llama3 / yarn) or None."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    """Served model name (directory or file stem)."""
    image_token_id: int | None = None
    """The placeholder token of an image (a LLaVA directory's ``image_token_id`` /
    ``image_token_index``); None: the checkpoint is text-only."""
    sliding_window: int | None = None
    """Tokens a sliding-window layer's query sees (itself and the W - 1 before it)."""
    layer_types: tuple[str, ...] = ()
    """Per layer, "full_attention" or "sliding_attention" (transformers' ``layer_types``); ()
    is every layer full."""
    dtype: str = "float32"
    """The precision the checkpoint was published in: config.json's ``torch_dtype`` (``dtype``
    from transformers 5); a GGUF's is float32 only where its matrices are F32 (16-bit or
    quantized ones: bfloat16 / float16). ``--dtype auto`` reads it (model_runner.resolve_dtype)."""

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert not self.layer_types or len(self.layer_types) == self.num_layers, "one layer type per layer"
        assert set(self.layer_types) <= {"full_attention", "sliding_attention"}, self.layer_types
        assert self.sliding_window is None or self.sliding_window > 0

    def window(self, layer: int) -> int:
        """The sliding window of ``layer``; 0 for a full-attention layer."""
        is_sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if is_sliding and self.sliding_window else 0

    @property
    def is_hybrid(self) -> bool:
        return any(self.window(layer) for layer in range(self.num_layers))

    @property
    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers whose KV share one block pool: for a model that mixes both kinds, the
        full-attention layers (group 0) and the sliding-window ones (group 1, which keeps only
        each sequence's window); otherwise one group of every layer, as a plain model has. A model
        whose every layer slides keeps one pool too (nothing to pair the window pool with)."""
        full = tuple(layer for layer in range(self.num_layers) if not self.window(layer))
        sliding = tuple(layer for layer in range(self.num_layers) if self.window(layer))
        return (full, sliding) if full and sliding else (tuple(range(self.num_layers)),)

    @property
    def replay_tokens(self) -> int:
        """Tokens a prefix hit whose sliding windows are gone computes again (bounded replay) so
        that the windows' KV is rebuilt exactly: a query that misses keys before the replay start
        is wrong, and each sliding-window layer carries that on at most W - 1 positions further,
        so n_sliding * (W - 1) (W - 1 for one such layer; SPEC's reference would need 2,540).
        0 for a model without a window pool."""
        if not self.has_window_pool:
            return 0
        return len(self.kv_groups[1]) * (self.sliding_window - 1)

    @property
    def has_window_pool(self) -> bool:
        """Sliding-window layers keep their KV apart, only the window of each sequence."""
        return len(self.kv_groups) > 1

    def kv_group_of(self, layer: int) -> tuple[int, int]:
        """(group, index of ``layer`` within it): where the layer's KV lies in the pools."""
        for group, layers in enumerate(self.kv_groups):
            if layer in layers:
                return group, layers.index(layer)
        raise IndexError(layer)

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (LlamaConfig / MistralConfig / Qwen2Config,
        or a LlavaConfig, whose ``text_config`` is the language model prefill and decode run)."""
        if "text_config" in cfg:
            return dataclasses.replace(cls.from_hf_dict(cfg["text_config"], name), image_token_id=llava_image_token_id(cfg))
        arch = cfg.get("model_type", "llama")
        if arch == "mistral":  # Llama's arithmetic; only a sliding window would differ
            if cfg.get("sliding_window") and cfg["sliding_window"] < cfg.get("max_position_embeddings", 2048):
                raise KeyError(f"sliding_window={cfg['sliding_window']} (sliding-window attention is not supported)")
            arch = "llama"
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window, layer_types = _sliding_window(cfg, arch)
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers >= 5 moves theta/scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default") else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            sliding_window=window,
            layer_types=layer_types,
            dtype=checkpoint_dtype(cfg),
        )

    def to_hf_dict(self) -> dict:
        """The config.json transformers needs to load the same weights (oracle tests, cache)."""
        cfg = {
            "model_type": self.architecture,
            "architectures": ["Qwen2ForCausalLM" if self.architecture == "qwen2" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.dtype,
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        if self.is_hybrid:
            cfg.update(use_sliding_window=True, sliding_window=self.sliding_window, layer_types=list(self.layer_types))
        return cfg

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def checkpoint_dtype(cfg: dict) -> str:
    """A config.json's published precision: float32, bfloat16 or float16 (float32 when unstated)."""
    value = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    return value if value in ("bfloat16", "float16") else "float32"


def _sliding_window(cfg: dict, arch: str) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types) of a config.json: Qwen2's ``layer_types`` (transformers >= 4.53
    writes them; older ones mean ``max_window_layers``: layers from that index on slide)."""
    window = cfg.get("sliding_window")
    if arch != "qwen2" or not cfg.get("use_sliding_window") or not window:
        return None, ()
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return (int(window), tuple(types)) if "sliding_attention" in types else (None, ())


def llava_image_token_id(cfg: dict) -> int:
    """The image placeholder id of a LLaVA config.json (transformers 5 writes ``image_token_index``
    and reads either name); KeyError when neither is there."""
    for key in ("image_token_id", "image_token_index"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    raise KeyError("image_token_id / image_token_index")


def is_llava_dir(model: str | None) -> bool:
    """Whether ``model`` is a directory holding a LLaVA config.json (vision and text configs):
    the encoder then runs its vision half. Torch-free, for the launcher too."""
    path = Path(model).expanduser() / "config.json" if model else None
    if path is None or not path.is_file():
        return False
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(cfg, dict) and "vision_config" in cfg and "text_config" in cfg
