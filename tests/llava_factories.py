"""Tiny random LLaVA checkpoints, saved the way transformers ships them (issue 20).

``make_tiny_llava_dir(path, "clip")``: a ``LlavaForConditionalGeneration`` with a 3-layer CLIP
tower (56x56 images, 14x14 patches: 16 patches + CLS, "default" drops the CLS, layer -2), a
2-layer Llama language model, ``save_pretrained`` + the CLIP image processor's config.
``"siglip"``: a SigLIP tower (no CLS, "full", layers [-3, -1] concatenated) and a Qwen2 language
model, with SigLIP's processor (squash to 56x56, mean/std 0.5); ``text`` picks another language
model (llama, mistral, qwen2). With ``tokenizer_dir`` the
language model speaks through that tokenizer (its vocabulary, chat template), as the cluster
tests need.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False, initializer_range=0.05)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
              patch_size=14)
NUM_IMAGE_TOKENS = {"clip": 16, "siglip": 16}
"""Rows per image: CLIP 16 patches + CLS - CLS ("default"); SigLIP 16 patches ("full")."""


def make_tiny_llava_dir(path: Path, tower: str = "clip", seed: int = 0, tokenizer_dir: Path | None = None,
                        text: str | None = None) -> Path:
    """A random tiny LLaVA model directory under ``path``; its image token is the last id."""
    import transformers as tf

    vocab_size = 512
    if tokenizer_dir is not None:
        vocab_size = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    text = text or {"clip": "llama", "siglip": "qwen2"}[tower]
    text_classes = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}
    text_config = text_classes[text](vocab_size=vocab_size, **TEXT)
    if tower == "clip":
        vision = tf.CLIPVisionConfig(**VISION, projection_dim=32)
        processor = tf.CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
        layer, strategy = -2, "default"
    else:
        vision = tf.SiglipVisionConfig(**VISION)
        processor = tf.SiglipImageProcessor(size={"height": 56, "width": 56})
        layer, strategy = [-3, -1], "full"
    config = tf.LlavaConfig(vision_config=vision, text_config=text_config, image_token_id=vocab_size - 1,
                            vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                            image_seq_length=NUM_IMAGE_TOKENS[tower])
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") and ("vision_tower" in name or "projector" in name or "q_proj" in name):
                param.normal_(0, 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def png_data_uri(seed: int, size: tuple[int, int] = (80, 60)) -> str:
    """A random RGB picture as a PNG data URI."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
