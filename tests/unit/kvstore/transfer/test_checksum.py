from __future__ import annotations

import numpy as np
import pytest

from kvstore.transfer.checksum import checksum


def random_bytes(num_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def test_golden_values():
    # Pins the definition: a change here invalidates every handle in flight between versions.
    assert checksum(b"") == 0
    assert checksum(b"abc") == 0xDAA66D2C7E42D6A0
    assert checksum(bytes(range(256)) * 32) == 0x034333E5436E8000


@pytest.mark.parametrize("num_bytes", [1, 7, 8, 13, 4095, 4096, 4104, 8192, 737280])
def test_matches_a_plain_python_reading_of_the_definition(num_bytes):
    data = random_bytes(num_bytes)
    padded = data.tobytes() + bytes(-num_bytes % 8)
    words = [int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8)]
    sums = [sum(words[j:j + 512]) for j in range(0, len(words), 512)]
    expected = (sum((2 * j + 1) * s for j, s in enumerate(sums)) + num_bytes * 0x9E3779B97F4A7C15) % 2**64
    assert checksum(data) == expected


def test_accepts_bytes_memoryview_and_arrays_alike():
    data = random_bytes(10_000)
    assert checksum(data) == checksum(data.tobytes()) == checksum(memoryview(data))


@pytest.mark.parametrize("position", [0, 1, 4095, 4096, 30_000, 65_535])
@pytest.mark.parametrize("bit", [0, 7])
def test_detects_any_single_bit_flip(position, bit):
    data = random_bytes(65_536)
    flipped = data.copy()
    flipped[position] ^= 1 << bit
    assert checksum(flipped) != checksum(data)


def test_detects_the_top_bit_of_the_last_chunk():
    # An even chunk weight would shift this flip out of 64 bits; the odd weights keep it.
    data = np.zeros(65_536, dtype=np.uint8)
    flipped = data.copy()
    flipped[-1] ^= 0x80
    assert checksum(flipped) != checksum(data)


def test_detects_swapped_chunks():
    data = random_bytes(16_384)
    swapped = np.concatenate([data[4096:8192], data[:4096], data[8192:]])
    assert checksum(swapped) != checksum(data)


def test_detects_truncation_even_of_zeros():
    data = np.zeros(8192, dtype=np.uint8)
    assert checksum(data[:4096]) != checksum(data)
    assert checksum(data[:8191]) != checksum(data)


def test_numpy_fast_path_equals_the_generic_path():
    from kvstore.transfer.checksum import CHUNK_BYTES, checksum

    data = np.random.default_rng(3).integers(0, 256, 5 * CHUNK_BYTES, dtype=np.uint8)
    assert checksum(data) == checksum(bytes(data)) == checksum(memoryview(data))
