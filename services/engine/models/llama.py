"""Llama-family decoder (Llama, SmolLM, Qwen2) over the paged KV pool.

Matches Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` numerics (the oracle tests
hold it to 1e-4 in fp32): RMSNorm in fp32, RoPE in the rotate-half layout, GQA, SwiGLU.
Inputs are a flat batch of tokens from many sequences; :mod:`services.engine.attention` knows
which token belongs where. q/k/v are fused into one matmul (on the CPU one pass of RoPE and the
K/V store follows it); gate and up stay two.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import InvalidRequestError
from services.engine.attention import AttentionMetadata, paged_attention, store_kv
from services.engine.kernels.cpu import CpuKernels
from services.engine.models.config import ModelConfig


def _packed_product(kernels: CpuKernels, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(kernels.packed_gemm, packed=kernels.pack_weight(weight), bias=bias,
                             num_out=weight.shape[0])


class Linear(nn.Module):
    """``nn.Linear`` without its random init: every weight comes from a checkpoint, and the init
    of a whole model costs seconds on the CPU.

    ``forward(x, packed=True)`` uses the CPU's product over a packed copy of the weight made by
    :meth:`pack` (see :meth:`LlamaForCausalLM.pack`), when there is one; every product does where
    it was packed for every step; other products are torch's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.packed_every_step = False

    def pack(self, kernels: CpuKernels, every_step: bool = False) -> None:
        self.packed = _packed_product(kernels, self.weight, self.bias)
        self.packed_every_step = every_step

    def forward(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        if self.packed is not None and (packed or self.packed_every_step) and x.dim() == 2:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream, with the add that updates the stream before it:
    ``forward(x, residual)`` -> (the norm of x + residual, x + residual); residual None: of x.

    In torch (Hugging Face's arithmetic), or fused in one C pass where :meth:`fuse` gave it the
    CPU's kernel, which then writes x + residual into x (a sublayer's fresh output)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: Callable[..., torch.Tensor] | None = None

    def fuse(self, kernels: CpuKernels) -> None:
        self.fused = kernels.add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            x = x.contiguous()  # written in place (residual given): a fresh tensor either way
            return self.fused(x, residual, self.weight, self.eps), x
        if residual is not None:
            x = x + residual
        dtype, h = x.dtype, x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), x


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise InvalidRequestError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths scaled, short kept, a smooth band.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.window(layer)
        """Sliding-window layers' window (0: full attention)."""
        self.group, self.index = cfg.kv_group_of(layer)
        """The KV group whose pool holds this layer's KV, and the layer's index in that pool."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttentionMetadata]) -> torch.Tensor:
        kv_cache, meta = kv_caches[self.group], metas[self.group]
        packed = meta.packed_products
        qkv = self.qkv_proj(x, packed)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if meta.kernels is not None:
            # One pass: q and k rotated, k and v stored (the torch lines below, bit for bit).
            q, k = meta.kernels.rope_store(qkv, cos, sin, kv_cache, meta.slot_rows,
                                           *meta.token_row_offsets(self.index), self.num_heads)
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            store_kv(k, v, kv_cache, self.index, meta)
        o = paged_attention(q, k, v, kv_cache, self.index, meta, self.scale, self.window)
        return self.o_proj(o.reshape(-1, self.q_size), packed)


class MLP(nn.Module):
    """SwiGLU. ``forward(x, packed)`` as :class:`Linear`'s: where :meth:`pack` gave it the CPU's
    gated product, gate and up are one pass over their weights packed together, SiLU and the
    product in its epilogue (``packed_gemm.c``), so neither [tokens, intermediate] output is
    written: 35 against 46 ms for SmolLM2's at 2,048 rows on an AMD Zen 4. Its two sums are
    the packed products'; its SiLU is a few ulps from torch's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Two products, not one fused: SiLU, the product and the down projection then read
        # contiguous rows (10% faster for this MLP at 2,048 tokens than halves of one output).
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.gated: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gated_every_step = False

    def pack(self, kernels: CpuKernels, every_step: bool = False) -> None:
        self.gated = functools.partial(kernels.packed_gemm_gated, num_out=self.gate_proj.weight.shape[0],
                                       packed=kernels.pack_gated(self.gate_proj.weight, self.up_proj.weight))
        self.gated_every_step = every_step
        self.down_proj.pack(kernels, every_step)

    def forward(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        if self.gated is not None and (packed or self.gated_every_step) and x.dim() == 2:
            return self.down_proj(self.gated(x), packed)
        gate, up = self.gate_proj(x, packed), self.up_proj(x, packed)
        # In place on the fresh matmul output: no [tokens, intermediate] temporaries.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up), packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, kv_caches, metas):
        """x: the last sublayer's output (the embeddings, residual None, at the first layer) ->
        this layer's MLP output and the residual stream before it."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_caches, metas), residual)
        return self.mlp(h, metas[0].packed_products), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # An explicit (uninitialised) weight skips nn.Embedding's random init.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.packed_tied_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.packed_every_step = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch of tokens -> final hidden states [T, hidden]. ``kv_caches`` and ``metas``:
        one pool and one step's metadata per KV group (ModelConfig.kv_groups). ``inputs_embeds``
        replaces the token embeddings (images spliced in at their placeholder positions)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv_caches, metas)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, packed: bool = False) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden, packed)
        if self.packed_tied_head is not None and (packed or self.packed_every_step):
            return self.packed_tied_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    @torch.no_grad()
    def pack(self, kernels: CpuKernels, every_step: bool) -> None:
        """Give every linear layer and the output layer a packed copy of its weight for the
        CPU's product (``kernels.packed_gemm``; gate and up packed together, see :class:`MLP`),
        fp32 on the CPU, after loading: used by steps that only decode (``packed=True``) and,
        ``every_step``, by steps with prompt tokens too (else torch's products: MKL,
        transformers' own sums). The copies double the memory of the weights.

        30 layers' linear products for 32 rows (weights cold in cache) took 32 ms against
        oneDNN's 40 and MKL's 46 on an Intel Xeon, 36.9 ms against 44.1 and 75.2 on an AMD EPYC
        Zen 4, as a panel's weights are read from memory once, for all rows, while the next panel
        is prefetched; at 2,048 rows it runs ~200-215 GFLOP/s there, ahead of MKL
        (kernels/select.py).
        """
        for layer in self.layers:
            layer.self_attn.qkv_proj.pack(kernels, every_step)
            layer.self_attn.o_proj.pack(kernels, every_step)
            layer.mlp.pack(kernels, every_step)
        if self.lm_head is not None:
            self.lm_head.pack(kernels, every_step)
        else:  # tied: the lookup keeps the dense table
            self.packed_tied_head = _packed_product(kernels, self.embed_tokens.weight, None)
        self.packed_every_step = every_step

    def fuse_norms(self, kernels: CpuKernels) -> None:
        """Every RMSNorm, with the residual add before it, in one pass of the CPU's kernel
        (``rms_norm.c``: 3.4x torch's six passes at 2,048 rows; a few ulps from their bits)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fuse(kernels)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
        loaded: set[str] = set()
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target_mod, index = fused[parts[-2]]
                target = ".".join(parts[:-2] + [target_mod, parts[-1]])
                offset, size = self._qkv_slice(index)
                params[target][offset:offset + size].copy_(tensor)
                loaded.add(f"{target}#{index}")
            elif name in params:
                params[name].copy_(tensor)
                loaded.add(name)
            else:
                raise RuntimeError(f"unexpected weight {name!r} for {self.cfg.architecture}")
        expected = self._expected_weight_keys(params)
        missing = sorted(expected - loaded)
        if missing:
            raise RuntimeError(f"checkpoint is missing weights: {missing[:5]}")

    def _qkv_slice(self, index: int) -> tuple[int, int]:
        q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][index]

    def _expected_weight_keys(self, params: dict) -> set[str]:
        expected: set[str] = set()
        for name in params:
            if ".qkv_proj." in name:
                expected.update(f"{name}#{i}" for i in range(3))
            else:
                expected.add(name)
        return expected
