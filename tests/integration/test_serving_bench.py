"""The serving benchmark runs end to end against ``epd up`` in its quick mode, without vLLM and
with its own load client, so it needs nothing under .peers/ (figures not checked, only shape and
that epd served every request)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EPD_FIGURES = ("epd_output_tok_s", "epd_ttft_ms_p50", "epd_ttft_ms_p99", "epd_itl_ms_mean", "epd_itl_ms_p50")


@pytest.mark.slow
def test_the_quick_run_without_vllm_ends_with_one_json_line_of_epd_figures():
    argv = [sys.executable, "benchmarks/serving.py", "--quick", "--no-vllm", "--client", "own"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    figures = json.loads(lines[0])
    for key in EPD_FIGURES:
        value = figures[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert figures["epd_requests"] == figures["requests"] == 8
    assert figures["epd_errors"] == 0 and figures["epd_wrong_lengths"] == 0
    assert figures["epd_processes_left"] == 0
    assert figures["client"] == "own" and figures["vllm_absent"] == "--no-vllm"
    assert figures["throughput_vs_vllm"] is figures["ttft_p99_vs_vllm"] is figures["itl_vs_vllm"] is None
