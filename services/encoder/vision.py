"""The vision tower: a small ViT whose patch features are projected into the LM's hidden size.

One image becomes ``num_patches`` rows, one per image placeholder token of the prompt::

    pixels [B, 3, S, S]
      | patch_embed   conv, kernel = stride = P          -> [B, (S/P)^2, H]   (row-major patches)
      | + pos_embed   learned, one per patch
      | blocks x L    pre-norm: x + attn(norm1(x)); x + mlp(norm2(x))
      | norm          final LayerNorm
      | projector     fc1 -> GELU -> fc2                  -> [B, (S/P)^2, out_hidden_size]

Weights are either local safetensors (names are this module's ``state_dict`` names) or a
deterministic random init from ``seed``: every process that builds the same config gets the
same weights bit for bit, so encoders replicas agree and a test can pin their output.

Real vision-language models are served by ``llava.py`` (a LLaVA directory's own CLIP / SigLIP
tower, projector and image processor). This tower stays for what has no such model: the
encoder of a *text* model (SmolLM2 and the tiny test Llamas, which tests, benchmarks and
``epd up --encoders N`` use to exercise the image path: decoding, limits, hashing, the splice,
the service and its balancer) with no download and no transformers at run time. What a text
model says about its rows means nothing; only the plumbing is real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from services.common.errors import InvalidRequestError, ModelNotFoundError
from services.encoder.images import image_hash, preprocess

PROJECTOR_OUTPUT_STD = 0.03
"""Std the random projector is scaled to give: the size of a small LM's token embeddings, so
random image rows neither drown out nor vanish beside the text rows they sit among."""


@dataclass(frozen=True)
class VisionConfig:
    out_hidden_size: int
    """Hidden size of the language model the embeddings are spliced into."""
    image_size: int = 224
    """Side of the square every image is resized to, in pixels."""
    patch_size: int = 16
    """Side of one patch; each patch becomes one embedding row (one placeholder token)."""
    hidden_size: int = 192
    """Width of the ViT's residual stream."""
    num_layers: int = 4
    num_heads: int = 3
    mlp_ratio: int = 4
    """The ViT MLP's inner width is ``mlp_ratio * hidden_size``."""
    seed: int = 0
    """Seed of the deterministic random init (ignored when ``weights`` is given)."""
    weights: str | None = None
    """Local .safetensors file with this tower's state_dict; None is the random init."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise InvalidRequestError(f"vision config {name}={getattr(self, name)!r}: {why}")

        for name in ("out_hidden_size", "image_size", "patch_size", "hidden_size", "num_layers",
                     "num_heads", "mlp_ratio"):
            check(getattr(self, name) > 0, name, "must be > 0")
        check(self.image_size % self.patch_size == 0, "image_size", "must be a multiple of patch_size")
        check(self.hidden_size % self.num_heads == 0, "hidden_size", "must be a multiple of num_heads")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, N, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional: every patch sees all
        return self.proj(out.transpose(1, 2).reshape(batch, length, hidden))


class Block(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, eps=1e-6)
        self.fc1 = nn.Linear(hidden_size, mlp_ratio * hidden_size)
        self.fc2 = nn.Linear(mlp_ratio * hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Projector(nn.Module):
    """Two layers into the LM's space, the LLaVA-1.5 way."""

    def __init__(self, in_size: int, out_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_size, out_size)
        self.fc2 = nn.Linear(out_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        # Built on the meta device: nn's default init would burn time and draw from the global
        # RNG (shifting everyone else's random stream); every value is set below instead.
        with torch.device("meta"):
            self.patch_embed = nn.Conv2d(3, c.hidden_size, c.patch_size, stride=c.patch_size)
            self.pos_embed = nn.Parameter(torch.empty(1, c.num_patches, c.hidden_size))
            self.blocks = nn.ModuleList(
                Block(c.hidden_size, c.num_heads, c.mlp_ratio) for _ in range(c.num_layers))
            self.norm = nn.LayerNorm(c.hidden_size, eps=1e-6)
            self.projector = Projector(c.hidden_size, c.out_hidden_size)
        self.to_empty(device="cpu")
        if c.weights is None:
            self.init_weights(c.seed)
        else:
            self.load_weights(c.weights)

    @property
    def num_image_tokens(self) -> int:
        """Rows per image (the encoder worker's model interface, as ``llava.LlavaVision``)."""
        return self.config.num_patches

    def prepare(self, image: Image.Image) -> tuple[torch.Tensor, bytes]:
        """Normalised pixels ``[3, S, S]`` and their hash (see ``images.py``)."""
        pixels = preprocess(image, self.config.image_size)
        return pixels, image_hash(pixels)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` normalised pixels -> ``[B, num_patches, out_hidden_size]``."""
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # [B, H, S/P, S/P] -> [B, N, H]
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.projector(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: one CPU generator, parameters visited in ``named_parameters`` order."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif ".norm" in f".{name}":  # LayerNorm gains (norm1, norm2, the final norm)
                param.fill_(1.0)
            else:
                std = self._init_std(name, param)
                nn.init.trunc_normal_(param, std=std, a=-2 * std, b=2 * std, generator=generator)

    def _init_std(self, name: str, param: torch.Tensor) -> float:
        if name == "projector.fc1.weight":
            # Unit-variance pre-activations from the unit-variance LayerNorm output (0.88 undoes
            # the std lost to truncating at two sigma).
            return 1.0 / (0.88 * math.sqrt(param.shape[1]))
        if name == "projector.fc2.weight":
            # E[gelu(z)^2] = 0.425 for z ~ N(0, 1).
            return PROJECTOR_OUTPUT_STD / (0.88 * math.sqrt(0.425 * param.shape[1]))
        return 0.02  # ViT / BERT convention for every other matrix and the position table

    def load_weights(self, path: str | Path) -> None:
        """Fill every parameter from a safetensors file; any missing, extra or misshapen tensor fails."""
        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"vision weights {path}: no such file")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ModelNotFoundError(f"vision weights {path}: not a safetensors file ({exc})") from exc
        expected = self.state_dict()
        missing = sorted(expected.keys() - tensors.keys())
        extra = sorted(tensors.keys() - expected.keys())
        misshapen = [f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}"
                     for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
        if missing or extra or misshapen:
            raise ModelNotFoundError(
                f"vision weights {path} do not fit {self.config}: missing {missing[:5]}, "
                f"unexpected {extra[:5]}, wrong shape {misshapen[:5]}")
        self.load_state_dict(tensors)

    def save_weights(self, path: str | Path) -> None:
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path))
