"""The router overhead benchmark runs end to end in its quick mode (figures not checked, only shape)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ("epd_rps", "sglang_router_rps", "rps_vs_sglang_router", "grpc_client_floor_rps",
            "grpc_client_floor_cores")
ADDED = ("epd_added_ms_p50", "epd_added_ms_p99")
"""Through the router minus direct, each timed on its own: in a short run on a busy machine the
direct p99 can come out the higher (CI saw -1.4 ms), so only their shape is checked."""


def test_the_quick_run_ends_with_one_json_line_of_figures():
    run = subprocess.run([sys.executable, "benchmarks/router_overhead.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    figures = json.loads(lines[0])
    for key in HEADLINE + ADDED:
        value = figures[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and (value > 0 or key in ADDED), (key, value)
    for name in ("epd", "sglang"):
        for concurrency in (1, 64, 256):
            assert figures[f"{name}_c{concurrency}_rps"] > 0
            assert figures[f"{name}_c{concurrency}_ms_p50"] > 0
            assert figures[f"{name}_c{concurrency}_errors"] == 0
    assert math.isclose(figures["rps_vs_sglang_router"], figures["epd_rps"] / figures["sglang_router_rps"],
                        rel_tol=1e-2)
