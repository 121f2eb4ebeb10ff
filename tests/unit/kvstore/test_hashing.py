"""The block hash is a contract: these vectors must never change by accident."""

import subprocess
import sys

from kvstore.hashing import block_hashes, chain_hash, root_hash

ROOT = root_hash(model="m", block_size=4, dtype="float32")


def test_golden_vectors():
    assert ROOT.hex() == "b5056499a5daa82c3382db2a6b4cbc080f0ff45b1d389f70484acef028e44f1f"
    assert [h.hex() for h in block_hashes(list(range(10)), 4, ROOT)] == [
        "c865b0f8efa7d134065826711e3fd1c207e6b115b898581e87bc9e4c8dc60f1b",
        "af4281b29b729dfddec3dbe12ea6f073e2879d9ca56c45fe710f89dc3a331e75",
    ]
    assert chain_hash(ROOT, [1, 2, 3, 4], ["img:abc"]).hex() == (
        "2b33eb3609dd2cb81b146d47fa550bab4ea9efae6bddff1e4dee7aeeb29c896e")


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(7)), 4, ROOT)) == 1
    assert block_hashes([1, 2, 3], 4, ROOT) == []


def test_chaining_depends_on_every_earlier_token():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert a[1] != b[1]


def test_incremental_hashing_equals_full():
    tokens = list(range(100, 140))
    full = block_hashes(tokens, 4, ROOT)
    tail = block_hashes(tokens, 4, ROOT, start=3, parent=full[2])
    assert full[3:] == tail


def test_extra_keys_separate_tenants_models_and_images():
    tokens = [1, 2, 3, 4]
    base = block_hashes(tokens, 4, ROOT)
    assert block_hashes(tokens, 4, root_hash(model="m", block_size=4, dtype="float32", salt="t1")) != base
    assert block_hashes(tokens, 4, root_hash(model="m2", block_size=4, dtype="float32")) != base
    assert block_hashes(tokens, 4, root_hash(model="m", block_size=4, dtype="bfloat16")) != base
    assert block_hashes(tokens, 4, ROOT, extra_keys=[["img:1"]]) != base
    # Length prefixes keep ("ab",) and ("a", "b") apart.
    assert chain_hash(ROOT, tokens, ["ab"]) != chain_hash(ROOT, tokens, ["a", "b"])


def test_stable_across_processes():
    # Python's hash() is randomised per process; ours must not be.
    code = ("from kvstore.hashing import *; r = root_hash(model='m', block_size=4, dtype='float32');"
            "print(block_hashes(list(range(8)), 4, r)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random"}, cwd=str(__import__("pathlib").Path(__file__).parents[3]))
    assert out.stdout.strip() == block_hashes(list(range(8)), 4, ROOT)[1].hex()
