"""The encoder worker: batching, determinism, hashes, errors, and the wire bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.encoder.images import decode_data_uri, image_hash, preprocess
from services.encoder.vision import VisionConfig
from services.encoder.worker import EncoderWorker, from_bytes, to_bytes
from tests.unit.encoder.images_factory import image_uri, noise_image

SMALL = VisionConfig(out_hidden_size=48, image_size=32, patch_size=8, hidden_size=32, num_layers=2,
                     num_heads=2)

# Odd sizes, alpha, grayscale, lossy: the mix a chat client sends.
URIS = [image_uri(noise_image(301, 199, seed=1)),
        image_uri(noise_image(17, 90, seed=2, mode="RGBA")),
        image_uri(noise_image(64, 48, seed=3).convert("L"), "JPEG")]


@pytest.fixture(scope="module")
def worker() -> EncoderWorker:
    return EncoderWorker(VisionConfig(out_hidden_size=64), device="cpu")


def test_default_worker_gives_196_fp32_cpu_rows_per_image(worker):
    [emb] = worker.encode(URIS[:1])
    assert worker.num_patches_per_image == emb.num_patches == 196
    assert emb.embeddings.shape == (196, 64)
    assert emb.embeddings.dtype == torch.float32 and emb.embeddings.device.type == "cpu"
    assert emb.image_hash == image_hash(preprocess(decode_data_uri(URIS[0]), 224))
    assert 0.02 < emb.embeddings.std().item() < 0.05


def test_a_batch_equals_each_image_alone():
    # More images than preparing threads (as many as torch uses), so every thread prepares some.
    uris = URIS + [image_uri(noise_image(40 + i, 30, seed=10 + i)) for i in range(3)]
    worker = EncoderWorker(SMALL, device="cpu")
    batch = worker.encode(uris)
    assert len(batch) == 6 and len({e.image_hash for e in batch}) == 6
    for uri, emb in zip(uris, batch):
        [alone] = worker.encode([uri])
        assert alone.image_hash == emb.image_hash
        torch.testing.assert_close(alone.embeddings, emb.embeddings, atol=1e-5, rtol=1e-5)


def test_same_seed_same_bits_other_seed_differs():
    a = EncoderWorker(SMALL, device="cpu").encode(URIS)
    b = EncoderWorker(SMALL, device="cpu").encode(URIS)
    c = EncoderWorker(VisionConfig(**{**SMALL.__dict__, "seed": 1}), device="cpu").encode(URIS)
    assert all(torch.equal(x.embeddings, y.embeddings) for x, y in zip(a, b))
    assert not any(torch.allclose(x.embeddings, z.embeddings) for x, z in zip(a, c))
    assert [x.image_hash for x in a] == [z.image_hash for z in c]  # content, not model


def test_a_fresh_process_agrees_on_hashes_and_embeddings():
    code = ("import sys, torch; from services.encoder.vision import VisionConfig;"
            "from services.encoder.worker import EncoderWorker, to_bytes;"
            "from tests.unit.encoder.test_worker import SMALL, URIS;"
            "[e] = EncoderWorker(SMALL, device='cpu').encode(URIS[:1]);"
            "sys.stdout.write(e.image_hash.hex() + ' ' + to_bytes(e.embeddings).data.hex())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    [e] = EncoderWorker(SMALL, device="cpu").encode(URIS[:1])
    assert fresh.stdout == e.image_hash.hex() + " " + to_bytes(e.embeddings).data.hex()


def test_duplicates_in_a_call_share_hash_and_rows():
    first, again, other = EncoderWorker(SMALL, device="cpu").encode([URIS[0], URIS[0], URIS[1]])
    assert first.image_hash == again.image_hash != other.image_hash
    assert torch.equal(first.embeddings, again.embeddings)


def test_empty_call_and_bad_image_named_by_position():
    worker = EncoderWorker(SMALL, device="cpu")
    assert worker.encode([]) == []
    with pytest.raises(InvalidRequestError, match="image 1: remote image URLs are not fetched"):
        worker.encode([URIS[0], "https://example.com/a.png"])


def test_of_several_bad_images_the_first_is_named():
    # The images of a call are prepared side by side; the error is still the first by position.
    worker = EncoderWorker(SMALL, device="cpu")
    uris = [URIS[0], "data:image/png;base64,AAAA", "https://example.com/a.png", URIS[1]]
    with pytest.raises(InvalidRequestError, match="image 1: image data is not a PNG"):
        worker.encode(uris)


def test_bf16_compute_still_returns_fp32_close_to_fp32():
    fp32 = EncoderWorker(SMALL, device="cpu").encode(URIS[:1])[0].embeddings
    bf16 = EncoderWorker(SMALL, device="cpu", dtype="bfloat16").encode(URIS[:1])[0].embeddings
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, atol=0.01, rtol=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="tpu"), "encoder device='tpu': must be auto, cpu or cuda"),
    (dict(dtype="float64"), "encoder dtype='float64': must be auto, float32, bfloat16 or float16"),
])
def test_bad_device_or_dtype(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        EncoderWorker(SMALL, **kwargs)


def test_wire_bytes_round_trip():
    rows = torch.randn(196, 64, generator=torch.Generator().manual_seed(0))
    raw = to_bytes(rows)
    assert (raw.shape, raw.dtype, len(raw.data)) == ((196, 64), "float32", 196 * 64 * 4)
    assert raw.data[:4] == rows[0, 0].numpy().astype("<f4").tobytes()  # little-endian fp32
    assert torch.equal(from_bytes(*raw), rows)
    half = to_bytes(rows, "bfloat16")
    assert len(half.data) == 196 * 64 * 2
    back = from_bytes(half.data, half.shape, half.dtype)
    assert back.dtype == torch.float32 and torch.equal(back, rows.to(torch.bfloat16).float())
    assert from_bytes(b"", (0, 64), "float32").shape == (0, 64)


@pytest.mark.parametrize("args, message", [
    ((b"\0" * 12, (2, 2), "float32"), "shape \\(2, 2\\) in float32 needs 16 bytes, got 12"),
    ((b"\0" * 8, (2, 2), "float16"), "wire dtype 'float16': must be one of"),
])
def test_inconsistent_wire_bytes_are_rejected(args, message):
    with pytest.raises(InvalidRequestError, match=message):
        from_bytes(*args)


def test_rows_are_ordinary_tensors_with_their_own_storage():
    a, b = EncoderWorker(SMALL, device="cpu").encode(URIS[:2])
    assert not a.embeddings.is_inference() and a.embeddings.is_contiguous()
    assert a.embeddings.untyped_storage().nbytes() == a.embeddings.numel() * 4
    assert a.embeddings.untyped_storage().data_ptr() != b.embeddings.untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    cpu = EncoderWorker(SMALL, device="cpu").encode(URIS)
    fp32 = EncoderWorker(SMALL, device="cuda", dtype="float32").encode(URIS)
    bf16 = EncoderWorker(SMALL, device="auto").encode(URIS)  # auto: CUDA, bf16
    for c, g, h in zip(cpu, fp32, bf16):
        assert g.embeddings.device.type == h.embeddings.device.type == "cpu"
        assert c.image_hash == g.image_hash == h.image_hash
        torch.testing.assert_close(g.embeddings, c.embeddings, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(h.embeddings, c.embeddings, atol=0.01, rtol=0.1)
