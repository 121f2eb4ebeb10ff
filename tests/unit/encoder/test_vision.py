"""The vision tower: shapes, deterministic init, output scale, safetensors weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidRequestError, ModelNotFoundError
from services.encoder.vision import PROJECTOR_OUTPUT_STD, VisionConfig, VisionTower

SMALL = dict(out_hidden_size=48, image_size=32, patch_size=8, hidden_size=32, num_layers=2,
             num_heads=2)


def pixels(batch: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def run(tower: VisionTower, x: torch.Tensor) -> torch.Tensor:
    return tower.eval()(x)


@pytest.fixture(scope="module")
def default_output() -> torch.Tensor:
    return run(VisionTower(VisionConfig(out_hidden_size=576)), pixels(2, 224))


def test_default_shape_is_one_row_per_patch(default_output):
    assert VisionConfig(out_hidden_size=576).num_patches == 196
    assert default_output.shape == (2, 196, 576)


def test_output_scale_is_that_of_lm_embeddings(default_output):
    # Measured: std 0.030 for out_hidden_size 576, 960 and 2048 (mean ~1e-4, max |x| ~0.16).
    assert 0.02 < default_output.std().item() < 0.05
    assert abs(default_output.mean().item()) < 0.005 and default_output.abs().max().item() < 0.5
    assert default_output.std().item() == pytest.approx(PROJECTOR_OUTPUT_STD, rel=0.2)


def test_same_seed_same_bits_other_seed_other_weights():
    a, b = VisionTower(VisionConfig(**SMALL)), VisionTower(VisionConfig(**SMALL))
    c = VisionTower(VisionConfig(**SMALL, seed=1))
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.pos_embed, c.pos_embed)


def test_init_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    VisionTower(VisionConfig(**SMALL))
    assert torch.equal(torch.rand(3), expected)


def test_every_parameter_is_initialised_sensibly():
    tower = VisionTower(VisionConfig(**SMALL))
    for name, param in tower.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("bias"):
            assert (param == 0).all(), name
        elif "norm" in name:
            assert (param == 1).all(), name
        else:
            assert 0 < param.std().item() < 0.3, name


def test_safetensors_round_trip_gives_identical_output(tmp_path):
    original = VisionTower(VisionConfig(**SMALL, seed=5))
    original.save_weights(tmp_path / "vision.safetensors")
    loaded = VisionTower(VisionConfig(**SMALL, seed=6, weights=str(tmp_path / "vision.safetensors")))
    x = pixels(3, 32)
    assert torch.equal(run(loaded, x), run(original, x))


def test_weights_that_do_not_fit_are_named(tmp_path):
    path = tmp_path / "vision.safetensors"
    VisionTower(VisionConfig(**SMALL)).save_weights(path)
    with pytest.raises(ModelNotFoundError, match=r"wrong shape \['pos_embed \(1, 16, 32\) != \(1, 4, 32\)'"):
        VisionTower(VisionConfig(**{**SMALL, "patch_size": 16}, weights=str(path)))
    state = load_file(path)
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(1)
    save_file(state, path)
    with pytest.raises(ModelNotFoundError, match=r"missing \['norm.weight'\], unexpected \['extra.weight'\]"):
        VisionTower(VisionConfig(**SMALL, weights=str(path)))


def test_missing_or_garbage_weights_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        VisionTower(VisionConfig(**SMALL, weights=str(tmp_path / "nope.safetensors")))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelNotFoundError, match="not a safetensors file"):
        VisionTower(VisionConfig(**SMALL, weights=str(tmp_path / "junk.safetensors")))


@pytest.mark.parametrize("override, message", [
    (dict(image_size=30), "image_size=30: must be a multiple of patch_size"),
    (dict(hidden_size=33), "hidden_size=33: must be a multiple of num_heads"),
    (dict(out_hidden_size=0), "out_hidden_size=0: must be > 0"),
    (dict(num_layers=-1), "num_layers=-1: must be > 0"),
])
def test_config_validation_names_the_field(override, message):
    with pytest.raises(InvalidRequestError, match=message):
        VisionConfig(**{**SMALL, **override})
