"""The CPU KV pool's memory: zero-filled, its own mapping, advised to huge pages (the kernel's own
record of the mapping), and the engine's pool really in it."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from services.engine import LLM, host_memory


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


needs_advice = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists()
    or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="no MADV_HUGEPAGE, /proc/self/smaps or transparent huge pages in this kernel")


@needs_advice
def test_a_large_array_is_zeroed_and_advised_to_huge_pages():
    pool = host_memory.huge_page_zeros((4, 3, 1 << 18), torch.float32)  # 12 MiB
    assert pool.shape == (4, 3, 1 << 18) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert not pool.any()
    pool[3, 2, -1] = 7.0  # writable, to its last element
    assert pool.sum().item() == 7.0
    assert "hg" in _vm_flags(pool.data_ptr())


def test_a_small_array_is_an_ordinary_tensor():
    small = host_memory.huge_page_zeros((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and small.dtype == torch.bfloat16 and not small.any()


@needs_advice
def test_the_engines_cpu_kv_pool_is_in_advised_memory(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=4096, device="cpu")
    pool = llm.engine.runner.kv_cache
    assert pool.numel() * pool.element_size() >= host_memory.HUGE_PAGE
    assert "hg" in _vm_flags(pool.data_ptr())
