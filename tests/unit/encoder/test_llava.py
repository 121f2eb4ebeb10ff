"""Oracle tests of the LLaVA family (issue 20) against Hugging Face transformers.

For a tiny random LLaVA with a CLIP tower and one with a SigLIP tower, saved by
``save_pretrained``: the encoder's image features equal ``get_image_features`` within 1e-5 (the
pixels are the model's own processor's); the prompt logits of an image + text prompt, computed by
the offline engine with the encoder's rows spliced in, equal ``LlavaForConditionalGeneration``'s
within 1e-4; 32 greedy tokens are identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from services.common.errors import ModelNotFoundError
from services.encoder.images import decode_data_uri, to_rgb
from services.encoder.llava import LlavaVision, is_llava_dir
from services.encoder.worker import EncoderWorker
from services.engine import LLM, SamplingParams
from services.engine.models.loader import load_model_config
from services.engine.sequence import MultiModalInput
from tests.factories import random_prompts
from tests.llava_factories import NUM_IMAGE_TOKENS, make_tiny_llava_dir, png_data_uri

VARIANTS = {"clip": ("clip", "llama"), "siglip": ("siglip", "qwen2"), "clip-mistral": ("clip", "mistral")}
"""Name -> (vision tower, language model)."""


@pytest.fixture(scope="module", params=list(VARIANTS))
def llava(request, tmp_path_factory):
    """(tower, model dir, transformers' model, the encoder worker)."""
    tower, text = VARIANTS[request.param]
    path = make_tiny_llava_dir(tmp_path_factory.mktemp(f"llava-{request.param}"), tower, seed=7, text=text)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    worker = EncoderWorker(device="cpu", model=LlavaVision(path))
    return tower, path, hf, worker


def hf_pixels(path, uris: list[str]) -> torch.Tensor:
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    return processor(images=[to_rgb(decode_data_uri(u)) for u in uris], return_tensors="pt")["pixel_values"]


def image_prompt(image_token_id: int, num_rows: int, seed: int) -> tuple[list[int], int]:
    """Text, then one image's placeholder rows, then text: (token ids, the image's position)."""
    before, after = random_prompts(2, [9, 14], vocab=500, seed=seed)
    return before + [image_token_id] * num_rows + after, len(before)


def test_features_equal_get_image_features(llava):
    tower, path, hf, worker = llava
    uris = [png_data_uri(1), png_data_uri(2, size=(40, 90)), png_data_uri(1)]
    ours = worker.encode(uris)
    with torch.no_grad():
        expected = hf.get_image_features(hf_pixels(path, uris)).pooler_output
    assert worker.num_patches_per_image == NUM_IMAGE_TOKENS[tower] == expected[0].shape[0]
    for image, reference in zip(ours, expected):
        assert image.embeddings.shape == reference.shape
        assert (image.embeddings - reference).abs().max().item() <= 1e-5
    # The same picture, the same hash; another picture, another hash.
    assert ours[0].image_hash == ours[2].image_hash != ours[1].image_hash


def test_prompt_logits_and_greedy_equal_transformers(llava):
    tower, path, hf, worker = llava
    config = load_model_config(str(path))
    assert config.image_token_id == hf.config.image_token_id
    [image] = worker.encode([png_data_uri(3)])
    prompt, position = image_prompt(config.image_token_id, image.num_patches, seed=4)
    pixels = hf_pixels(path, [png_data_uri(3)])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
    ours = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=64)
    mm = [MultiModalInput(position, image.embeddings, image.image_hash.hex())]
    logits = ours.engine.prompt_logits(prompt, mm_inputs=mm)
    assert (logits - expected).abs().max().item() <= 1e-4
    chunked = ours.engine.prompt_logits(prompt, chunk_size=8, mm_inputs=mm)  # the image spans chunks
    assert (chunked - expected).abs().max().item() <= 1e-4
    with torch.no_grad():
        generated = hf.generate(input_ids=torch.tensor([prompt]), pixel_values=pixels, max_new_tokens=32,
                                min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    rid = ours.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                  mm_inputs=mm)
    outputs = {}
    while ours.engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in ours.engine.step() if o.finished})
    assert outputs[rid].token_ids == generated[0, len(prompt):].tolist()


def test_loader_reads_the_language_model_only(llava):
    tower, path, hf, _ = llava
    config = load_model_config(str(path))
    text = hf.config.text_config
    assert (config.architecture, config.hidden_size, config.num_layers, config.vocab_size) == (
        "qwen2" if text.model_type == "qwen2" else "llama", text.hidden_size, text.num_hidden_layers, text.vocab_size)
    assert is_llava_dir(str(path)) and not is_llava_dir("") and not is_llava_dir(str(path / "nowhere"))


def test_a_sparse_text_config_gets_transformers_defaults(tmp_path):
    """llava-hf's config.json leaves the text model's defaults out (hidden_size 4096, ...)."""
    import json

    from services.engine.models.loader import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llava", "image_token_index": 32000, "vision_config": {"model_type": "clip_vision_model"},
        "text_config": {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096}}))
    cfg = read_hf_config(tmp_path)
    assert cfg["text_config"]["hidden_size"] == 4096 and cfg["text_config"]["vocab_size"] == 32064
    from services.engine.models.config import ModelConfig
    config = ModelConfig.from_hf_dict(cfg)
    assert (config.image_token_id, config.num_layers, config.num_kv_heads) == (32000, 32, 32)


def test_vision_weights_that_do_not_fit_are_a_clear_error(tmp_path):
    import safetensors.torch

    path = make_tiny_llava_dir(tmp_path / "m", "clip")
    weights = safetensors.torch.load_file(path / "model.safetensors")
    del weights["multi_modal_projector.linear_2.weight"]
    safetensors.torch.save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelNotFoundError, match="missing.*projector.linear_2.weight"):
        LlavaVision(path)


def test_hash_covers_tower_identity_and_settings(tmp_path):
    """The same picture through another tower (other weights), or another processor setting,
    hashes differently: their embeddings differ, so their KV must not be shared."""
    uri = png_data_uri(5)
    a = LlavaVision(make_tiny_llava_dir(tmp_path / "a", "clip", seed=1))
    b = LlavaVision(make_tiny_llava_dir(tmp_path / "b", "clip", seed=2))
    image = decode_data_uri(uri)
    assert a.prepare(image)[1] == a.prepare(decode_data_uri(uri))[1]
    assert a.prepare(image)[1] != b.prepare(image)[1]
    a.settings = a.settings.replace(b"0.48145466", b"0.5")
    assert a.prepare(image)[1] != LlavaVision(tmp_path / "a").prepare(image)[1]


def test_model_config_round_trip_keeps_text_models_text_only(tiny_llama_dir):
    config = load_model_config(str(tiny_llama_dir))
    assert config.image_token_id is None
    assert dataclasses.replace(config, image_token_id=5).image_token_id == 5


def test_a_mistral_sliding_window_is_refused_by_name():
    from services.engine.models.config import ModelConfig

    cfg = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict({**cfg, "sliding_window": None}).architecture == "llama"
    with pytest.raises(KeyError, match="sliding_window=4096"):
        ModelConfig.from_hf_dict({**cfg, "sliding_window": 4096})
