"""benchmarks/gpu_check.py: its one-line skip without CUDA, and how it reads and sums up steps."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up there
_spec.loader.exec_module(gpu_check)

PYTEST = gpu_check.Step("gpu_tests", ["python", "-m", "pytest"], 100, "pytest")
BENCH = gpu_check.Step("kv_transfer", ["python", "bench.py"], 50, "bench", note="host memory")
THROUGHPUT = gpu_check.Step("engine_throughput", ["python", "bench.py"], 60, "bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path needs a machine without CUDA")
def test_without_cuda_it_prints_one_line_and_exits_0():
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == gpu_check.SKIP_LINE + "\n"
    assert run.stdout == "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check\n"


def test_pytest_counts_come_from_the_final_summary_line():
    output = "....s.F\nFAILED tests/gpu/test_x.py::test_y - assert 1 == 2\n5 passed, 1 failed, 1 skipped in 12.34s\n"
    assert gpu_check.parse_pytest_counts(output) == {"passed": 5, "failed": 1, "skipped": 1}
    assert gpu_check.parse_pytest_counts("3 passed, 2 errors in 1.0s") == {"passed": 3, "errors": 2}
    assert gpu_check.parse_pytest_counts("no tests ran in 0.01s") == {}


def test_the_last_json_object_line_is_the_figures():
    assert gpu_check.last_json_line('noise\n{"a": 1}\n{"shm_gbps": 3.5}\n') == {"shm_gbps": 3.5}
    assert gpu_check.last_json_line('{"a": 1}\n{broken\n') == {"a": 1}
    assert gpu_check.last_json_line("[1, 2]\nno json\n") is None


def test_pytest_steps_pass_only_with_tests_passed_and_none_failed():
    ok = gpu_check.classify(PYTEST, 0, "4 passed, 1 skipped in 9.0s\n", "", 9.0)
    assert (ok.status, ok.figures, ok.note) == ("passed", {"passed": 4, "skipped": 1}, "")
    failed = gpu_check.classify(PYTEST, 1, "3 passed, 1 failed in 9.0s\n", "", 9.0)
    assert failed.status == "failed" and failed.figures == {"passed": 3, "failed": 1}
    assert "1 failed" in failed.note
    all_skipped = gpu_check.classify(PYTEST, 0, "7 skipped in 0.5s\n", "", 0.5)
    assert all_skipped.status == "failed"  # on a CUDA machine, nothing running is a failure
    assert gpu_check.classify(PYTEST, None, "", "", 100.0).status == "timeout"


def test_bench_steps_keep_their_figures_and_a_throughput_mismatch_is_a_warning():
    ok = gpu_check.classify(BENCH, 0, 'log\n{"shm_gbps": 3.5}\n', "", 20.0)
    assert (ok.status, ok.figures, ok.note) == ("passed", {"shm_gbps": 3.5}, "host memory")
    mismatch = gpu_check.classify(THROUGHPUT, 1, '{"ours_tok_s": 900.0}\n',
                                  "FAIL: transformers' greedy outputs differ from ours, ...", 30.0)
    assert (mismatch.status, mismatch.figures) == ("warning", {"ours_tok_s": 900.0})
    crashed = gpu_check.classify(BENCH, 1, "", "Traceback ...\nRuntimeError: boom", 3.0)
    assert crashed.status == "failed" and crashed.figures == {} and "boom" in crashed.note
    no_figures = gpu_check.classify(BENCH, 0, "no json here\n", "", 3.0)
    assert no_figures.status == "failed"


def test_the_summary_is_one_json_object_failed_if_any_step_failed_or_timed_out():
    results = [gpu_check.StepResult("gpu_tests", "passed", 61.23, {"passed": 9}),
               gpu_check.StepResult("engine_throughput", "warning", 30.04, {"ours_tok_s": 900.0}, "bf16"),
               gpu_check.StepResult("kv_transfer", "passed", 20.0, {"shm_gbps": 3.5})]
    summary = gpu_check.build_summary(results, 111.27, "NVIDIA H200")
    assert summary == {
        "gpu_check": "passed", "seconds": 111.3, "device": "NVIDIA H200",
        "steps": {"gpu_tests": {"status": "passed", "seconds": 61.2, "figures": {"passed": 9}},
                  "engine_throughput": {"status": "warning", "seconds": 30.0, "figures": {"ours_tok_s": 900.0},
                                        "note": "bf16"},
                  "kv_transfer": {"status": "passed", "seconds": 20.0, "figures": {"shm_gbps": 3.5}}}}
    assert json.loads(json.dumps(summary)) == summary
    for bad in ("failed", "timeout"):
        results[2] = gpu_check.StepResult("kv_transfer", bad, 50.0)
        assert gpu_check.build_summary(results, 140.0, "NVIDIA H200")["gpu_check"] == "failed"


def test_cluster_outcomes_are_kept_per_setup():
    output = ("..F\nPASSED tests/gpu/test_cuda_cluster.py::test_d[auto-float32]\n"
              "PASSED tests/gpu/test_cuda_cluster.py::test_d[tcp-float32]\n"
              "FAILED tests/gpu/test_cuda_cluster.py::test_d[auto-bfloat16] - AssertionError: 0.2\n"
              "2 passed, 1 failed in 80.0s\n")
    result = gpu_check.classify(gpu_check.Step("cluster", [], 210, "pytest"), 1, output, "", 80.0)
    assert result.status == "failed"
    assert result.figures == {"passed": 2, "failed": 1, "auto-float32": "passed", "tcp-float32": "passed",
                              "auto-bfloat16": "failed"}


def test_the_steps_and_their_timeouts_fit_the_budget():
    assert [s.name for s in gpu_check.steps()] == ["gpu_tests", "cluster", "engine_throughput", "kv_transfer"]
    assert sum(s.timeout_s for s in gpu_check.steps()) <= gpu_check.TOTAL_BUDGET_S < 8 * 60
