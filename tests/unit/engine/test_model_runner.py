"""The model runner's process settings."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from services.engine.model_runner import keep_heap_pages
    assert keep_heap_pages()
def step():  # two activations freed together, as a step's are
    a = torch.empty(5 << 20); a.fill_(1.0)
    b = torch.empty(5 << 20); b.fill_(1.0)
    del a, b
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_freed_activations_are_reused_instead_of_faulted_in_again():
    def page_faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(done.stdout)

    default, kept = page_faults("default"), page_faults("keep")
    # 10 steps of 2 x 20 MiB: by default glibc gives one of them back and faults it in again each
    # step (~5K pages a step); kept, the pages stay mapped.
    assert default > 20_000 and kept < default / 4
