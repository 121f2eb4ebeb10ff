"""Every wire dataclass survives the trip through its protobuf unchanged."""

from __future__ import annotations

import pytest

from kvstore.transfer.descriptors import BlockDesc, Endpoint, KVHandle, RegionDesc
from services.common import wire
from services.common.sampling_params import SamplingParams, TokenLogprobs


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.3,
                   frequency_penalty=-0.2, repetition_penalty=1.1, max_tokens=99, min_tokens=3,
                   seed=2**40, stop=("END", "\n\n"), stop_token_ids=(7, 8), ignore_eos=True,
                   logprobs=5, skip_special_tokens=False),
    SamplingParams(temperature=0, seed=0, logprobs=0, num_speculative_tokens=0),
    SamplingParams(num_speculative_tokens=3),
    # The ends of what SamplingParams accepts fit the wire's types.
    SamplingParams(seed=2**63 - 1, top_k=2**31 - 1, max_tokens=2**31 - 1, stop_token_ids=(2**31 - 1,)),
    SamplingParams(seed=-2**63),
])
def test_sampling_params_round_trip_exactly(params):
    # Doubles on the wire: 0.7 must stay 0.7, or seeded sampling would diverge.
    assert wire.params_from_proto(wire.params_to_proto(params)) == params


def test_request_spec_with_images_round_trips():
    spec = wire.RequestSpec("r1", (1, 2, 3, 4), SamplingParams(seed=3), (
        wire.ImageInput(b"\x01" * 32, 1, wire.TensorBytes((2, 4), "float32", bytes(32))),))
    assert wire.spec_from_proto(wire.spec_to_proto(spec)) == spec


def test_kv_handle_round_trips():
    handle = KVHandle("lease-1", Endpoint("host-a", "10.0.0.1:7000", nixl='{"agent": "a"}'),
                      (RegionDesc("r", "/dev/shm/epd-kv-1-r", 4096),),
                      (BlockDesc("r", 0, 1024, 2**64 - 1), BlockDesc("r", 1024, 512, 0)))
    assert wire.kv_handle_from_proto(wire.kv_handle_to_proto(handle)) == handle


@pytest.mark.parametrize("reason", [None, "STOP", 17])
def test_stop_reason_round_trips(reason):
    assert wire.stop_reason_from_proto(wire.stop_reason_to_proto(reason)) == reason


def test_load_report_and_model_info_round_trip():
    report = wire.LoadReport("p-0", "prefill", 1, 2, 3, 4, 5, 6, 7, 8, (0.5, 0.25), True, 9, 1.25)
    assert wire.load_from_proto(wire.load_to_proto(report)) == report
    for image_token_id in (None, 0, 42):
        info = wire.ModelInfo("m", 4096, 512, 16, (2, 3), "{}", '{"a": 1}', image_token_id, 64)
        assert wire.model_info_from_proto(wire.model_info_to_proto(info)) == info


HANDLE = KVHandle("lease-2", Endpoint("host-b", ""), (RegionDesc("r", "", 2048),), (BlockDesc("r", 1024, 1024, 5),))
LOGPROBS = TokenLogprobs(7, -0.5, ((7, -0.5), (3, -1.25)))  # (the wire's logprobs are 32-bit floats)


@pytest.mark.parametrize("reply", [
    wire.PrefillResponse(12, None, None, 32, HANDLE, LOGPROBS),
    wire.PrefillResponse(2, "stop", 2, 0, None),
    wire.PrefillResponse(0, "stop", "END", 16, None, TokenLogprobs(0, 0.0, ())),
    wire.PrefillResponse(5, "length", None, 0, None),
])
def test_prefill_response_round_trips(reply):
    assert wire.prefill_response_from_proto(wire.prefill_response_to_proto(reply)) == reply


@pytest.mark.parametrize("request_", [
    wire.DecodeRequest(wire.RequestSpec("r", (1, 2, 3), SamplingParams(seed=1)), (9,), HANDLE, 16, "10.0.0.2:50061"),
    wire.DecodeRequest(wire.RequestSpec("r", (1, 2), SamplingParams()), (9, 8, 7), None, 0, "", num_migrations=2),
])
def test_decode_request_round_trips(request_):
    assert wire.decode_request_from_proto(wire.decode_request_to_proto(request_)) == request_


@pytest.mark.parametrize("chunk", [
    wire.TokenChunk(()),  # a heartbeat
    wire.TokenChunk((4, 5), num_cached_tokens=32, logprobs=(LOGPROBS, TokenLogprobs(5, -2.0, ((5, -2.0),)))),
    wire.TokenChunk((6,), "stop", "\n\n", 32, kv_recomputed=True),
    wire.TokenChunk((), "length", None, 0),
    wire.TokenChunk((2,), "stop", 2),
])
def test_token_chunk_round_trips(chunk):
    assert wire.token_chunk_from_proto(wire.token_chunk_to_proto(chunk)) == chunk


REMOTE = wire.RemoteEmbeddings(
    KVHandle("lease-e", Endpoint("host-e", "127.0.0.1:7001"), (RegionDesc("emb", "/dev/shm/epd-kv-2-emb", 1 << 20),),
             (BlockDesc("emb", 0, 65536, 11), BlockDesc("emb", 131072, 96, 12))), (257, 64), "bfloat16")


@pytest.mark.parametrize("image", [
    wire.ImageInput(b"\x02" * 32, 5, remote=REMOTE),
    wire.ImageInput(b"\x03" * 32, 0, num_rows=196),
    wire.ImageInput(b"\x04" * 32, 9, wire.TensorBytes((1, 2), "float32", bytes(8)), num_rows=1),
])
def test_image_inputs_round_trip_inline_remote_or_hash_only(image):
    assert wire.image_from_proto(wire.image_to_proto(image)) == image
    spec = wire.RequestSpec("r2", (1,) * 300, SamplingParams(), (image,))
    assert wire.spec_from_proto(wire.spec_to_proto(spec)) == spec


def test_image_rows_and_the_readers_view_without_embeddings():
    assert wire.ImageInput(b"h", 5, remote=REMOTE).rows == 257
    assert wire.ImageInput(b"h", 5, wire.TensorBytes((3, 2), "float32", bytes(24))).rows == 3
    bare = wire.ImageInput(b"h", 5, remote=REMOTE).without_embeddings()
    assert bare == wire.ImageInput(b"h", 5, num_rows=257) and bare.rows == 257


@pytest.mark.parametrize("encoded", [
    wire.EncodedImage(b"\x05" * 32, remote=REMOTE, is_cached=True),
    wire.EncodedImage(b"\x06" * 32, wire.TensorBytes((2, 2), "float32", bytes(16))),
])
def test_encoded_images_round_trip(encoded):
    assert wire.encoded_image_from_proto(wire.encoded_image_to_proto(encoded)) == encoded
