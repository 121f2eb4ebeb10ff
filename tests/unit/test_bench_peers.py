"""The benchmarks' peer processes are stopped with every process they started, whatever way the
benchmark ends: a peer's children that outlive it (vLLM's engine core and workers) once kept the
cores busy and halved the next run's figures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers import cpu_info, cpu_ranges, start_process, stop_group
from benchmarks.peers import session_pids as group_members  # a peer leads its own session and group

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_peer_leads_its_own_group_and_stop_takes_its_children_too():
    process = start_process(["bash", "-c", "sleep 300 & sleep 300 & wait"])
    assert wait_for(lambda: len(group_members(process.pid)) == 3)
    assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
    stop_group(process, 0)
    assert process.returncode is not None
    assert wait_for(lambda: group_members(process.pid) == [])


def test_children_that_outlive_the_peer_are_killed_after_it_exits():
    # The leader exits at once and leaves its child behind, as vLLM's driver can leave its engine core.
    with start_process(["bash", "-c", "sleep 300 & echo started; exit 0"], stdout=subprocess.PIPE) as process:
        assert process.stdout.readline() == b"started\n"
        stop_group(process, 5)
    assert process.returncode == 0
    # SIGKILL is delivered, and the orphan reaped by init, a moment after killpg returns
    assert wait_for(lambda: group_members(process.pid) == [])


def test_a_peer_dies_with_the_benchmark_even_when_the_benchmark_is_killed():
    starter = ("from benchmarks.peers import start_process; import sys, time; "
               "p = start_process(['sleep', '300']); print(p.pid, flush=True); time.sleep(300)")
    with subprocess.Popen([sys.executable, "-c", starter], cwd=ROOT, stdout=subprocess.PIPE) as benchmark:
        try:
            peer = int(benchmark.stdout.readline())
            assert group_members(peer) == [peer]
            benchmark.send_signal(signal.SIGKILL)   # no finally, no atexit: only the kernel can stop the peer
            benchmark.wait()
            assert wait_for(lambda: group_members(peer) == [])
        finally:
            benchmark.kill()


def test_cpu_facts_and_ranges():
    cpu = cpu_info()
    assert cpu["num_usable_cpus"] == len(os.sched_getaffinity(0)) >= 1
    assert isinstance(cpu["native_bf16"], bool) and isinstance(cpu["avx2"], bool)
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_our_column_runs_in_its_own_process_and_answers_what_the_engine_computes(tiny_llama_dir):
    """Ours is timed in a process of its own, as each peer is: its outputs are LLM.generate's, a
    bad engine argument makes it unavailable with the reason, and close leaves no process."""
    from benchmarks.peers import PeerUnavailable
    from benchmarks.peers.epd import Epd
    from services.engine import LLM, SamplingParams
    from tests.factories import random_prompts

    prompts = random_prompts(3, [5, 30, 70], seed=4)
    expected = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    column = Epd("test-epd.log", str(tiny_llama_dir), num_kv_blocks=64)
    try:
        assert column.vocab_size > 0
        seconds, token_ids = column.run(prompts, 6)
        assert seconds > 0 and token_ids == [list(o.token_ids) for o in expected]
    finally:
        column.close()
    assert column.driver.process.returncode is not None and group_members(column.driver.process.pid) == []
    with pytest.raises(PeerUnavailable, match="num_kv_blocks"):
        Epd("test-epd.log", str(tiny_llama_dir), num_kv_blocks=-1)
