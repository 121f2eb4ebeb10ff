"""The vision half of a LLaVA model directory: what the encoder service runs for it.

A ``LlavaForConditionalGeneration`` directory (config.json with ``vision_config`` and
``text_config``, safetensors, preprocessor_config.json) splits in two: prefill and decode load its
language model (``services/engine/models/loader.py``), the encoder loads this::

    PIL image (decoded, EXIF-upright, alpha over white -> RGB)  --pixel_hash-->  image hash
      | processor      the directory's own image processor (AutoImageProcessor, PIL backend)
      v
    pixel_values float32 [3, H, W]
      | vision tower   CLIP or SigLIP (vision_config.model_type), hidden_states[vision_feature_layer]
      | select         "default": drop row 0 (CLIP's CLS); "full": keep every row
      | projector      linear_1 -> act -> linear_2
      v
    [num_image_tokens, text hidden size]: one row per image placeholder token of the prompt

Preprocessing and the tower are transformers' own, not re-written here: the engine has its own
Llama because it needs paged KV, but a vision tower is one dense forward over a batch, which the
maintained implementation computes exactly as the model's authors do. The PIL backend of the
processor is asked for explicitly, so every host computes the same pixels whether torchvision is
installed there or not. Layers past the deepest ``vision_feature_layer`` (and SigLIP's pooling
head) are not built: their output is never used.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path

import safetensors
import torch
from PIL import Image
from torch import nn

from services.common.errors import ModelNotFoundError
from services.encoder.images import pixel_hash, to_rgb
from services.engine.models.config import is_llava_dir

__all__ = ["LlavaVision", "is_llava_dir"]

TOWERS = {"clip_vision_model": 1, "siglip_vision_model": 0}
"""Supported vision towers -> the leading non-patch rows (CLS) of their hidden states."""
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
"""Checkpoint names -> module names: the llava-hf checkpoints and transformers 5's save_pretrained
write the second (or fourth) form, transformers 5's in-memory names are the first (or third)."""


class LlavaVision(nn.Module):
    """Vision tower + projector of one LLaVA directory, behind the encoder worker's model
    interface: ``num_image_tokens``, ``prepare(image) -> (pixels, hash)``, ``forward(batch)``."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        try:  # only a LLaVA encoder needs it: the processor and the tower are transformers' own
            from transformers import AutoConfig, AutoImageProcessor, AutoModel
            from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        except ImportError as exc:
            raise ModelNotFoundError(f"{path}: serving a LLaVA model's vision tower needs transformers "
                                     f"(pip install 'transformers>=5'): {exc}") from exc

        self.path = Path(path).expanduser()
        config = AutoConfig.from_pretrained(self.path)
        vision = config.vision_config
        if vision.model_type not in TOWERS:
            raise ModelNotFoundError(f"{self.path}: vision tower {vision.model_type!r} is not supported "
                                     f"({', '.join(TOWERS)})")
        self.config = config
        self.feature_layers = _feature_layers(config.vision_feature_layer, vision.num_hidden_layers)
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ModelNotFoundError(f"{self.path}: vision_feature_select_strategy {self.select_strategy!r} "
                                     f"is not supported (default, full)")
        with _no_random_init():  # every parameter is loaded (or the load fails): 9 s -> 2 s for CLIP-L
            self.tower = AutoModel.from_config(_truncated(vision, max(self.feature_layers)))
            self.projector = LlavaMultiModalProjector(config)
        self.identity = self._load_weights()
        self.processor = _processor(AutoImageProcessor, self.path)
        self.settings = self.processor.to_json_string().encode()
        """The preprocessing settings every image hash covers."""
        num_patches = (vision.image_size // vision.patch_size) ** 2
        self.num_image_tokens = num_patches + TOWERS[vision.model_type] - (self.select_strategy == "default")
        """Rows per image, one placeholder token each: patches, plus CLS kept by "full"."""
        self._check_pixel_size(vision.image_size)

    def prepare(self, image: Image.Image) -> tuple[torch.Tensor, bytes]:
        """The processor's float32 pixels ``[3, H, W]`` and the image's hash (decoded pixels,
        preprocessing settings, tower identity)."""
        rgb = to_rgb(image)
        pixels = self.processor(images=rgb, return_tensors="pt")["pixel_values"][0]
        return pixels.float(), pixel_hash(rgb, self.settings, self.identity)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` -> ``[B, num_image_tokens, text hidden]``, as transformers'
        ``LlavaForConditionalGeneration.get_image_features``."""
        hidden = self.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        layers = [hidden[i] for i in self.feature_layers]
        if self.select_strategy == "default":
            layers = [h[:, 1:] for h in layers]
        features = self.projector(layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1))
        assert features.shape[1] == self.num_image_tokens, (features.shape, self.num_image_tokens)
        return features

    def _load_weights(self) -> bytes:
        """Fill the tower and projector from the safetensors; the identity (sha256 of the
        config and every tensor used) that image hashes carry. A missing tensor fails here."""
        wanted = {**{f"tower.{k}": v for k, v in self.tower.state_dict().items()},
                  **{f"projector.{k}": v for k, v in self.projector.state_dict().items()}}
        loaded: dict[str, torch.Tensor] = {}
        for shard in _shards(self.path):
            with safetensors.safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    name = _module_name(key)
                    if name in wanted:
                        loaded[name] = f.get_tensor(key)
        missing = sorted(wanted.keys() - loaded.keys())
        misshapen = [f"{k} {tuple(loaded[k].shape)} != {tuple(v.shape)}"
                     for k, v in wanted.items() if k in loaded and loaded[k].shape != v.shape]
        if missing or misshapen:
            raise ModelNotFoundError(f"{self.path}: the vision weights do not fit the config: missing "
                                     f"{missing[:5]}, wrong shape {misshapen[:5]}")
        identity = hashlib.sha256(b"llava-vision-v1|")
        identity.update(json.dumps([self.config.vision_config.to_dict(), self.feature_layers, self.select_strategy,
                                    self.config.projector_hidden_act], sort_keys=True, default=str).encode())
        with torch.no_grad():
            for name in sorted(wanted):
                wanted[name].copy_(loaded[name])
                identity.update(name.encode())
                identity.update(loaded[name].contiguous().view(torch.uint8).numpy().tobytes())
        return identity.digest()

    def _check_pixel_size(self, image_size: int) -> None:
        probe = self.processor(images=Image.new("RGB", (7, 5)), return_tensors="pt")["pixel_values"]
        if tuple(probe.shape[-2:]) != (image_size, image_size):
            raise ModelNotFoundError(f"{self.path}: the image processor gives {tuple(probe.shape[-2:])} pixels, "
                                     f"the vision tower takes {image_size}x{image_size}")


def _feature_layers(layer: int | list[int], num_layers: int) -> list[int]:
    """``vision_feature_layer`` (an index into the tower's ``num_layers + 1`` hidden states,
    negative from the end; or a list of them, concatenated) as non-negative indices."""
    layers = [layer] if isinstance(layer, int) else list(layer)
    resolved = [i if i >= 0 else num_layers + 1 + i for i in layers]
    if not layers or not all(0 <= i <= num_layers for i in resolved):
        raise ModelNotFoundError(f"vision_feature_layer {layer!r} is outside the tower's {num_layers + 1} hidden states")
    return resolved


def _truncated(vision_config, num_layers: int):
    """The tower's config with only the layers whose output is used (hidden state i is the
    output of layer i; 0 is the embeddings) and no pooling head."""
    vision_config = copy.deepcopy(vision_config)
    vision_config.num_hidden_layers = max(1, num_layers)
    if hasattr(vision_config, "vision_use_head"):
        vision_config.vision_use_head = False
    return vision_config


def _no_random_init():
    """transformers' own switch for skipping the random init of a model about to be loaded
    (a no-op context where this transformers has none)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _module_name(key: str) -> str | None:
    for prefixes, module in ((_TOWER_PREFIXES, "tower."), (_PROJECTOR_PREFIXES, "projector.")):
        for prefix in prefixes:
            if key.startswith(prefix):
                return module + key.removeprefix(prefix)
    return None


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelNotFoundError(f"{path}: no *.safetensors")
    return shards


def _processor(auto_class, path: Path):
    if not (path / "preprocessor_config.json").is_file() and not (path / "processor_config.json").is_file():
        raise ModelNotFoundError(f"{path}: no preprocessor_config.json (the image processor's settings)")
    return auto_class.from_pretrained(path, backend="pil")

