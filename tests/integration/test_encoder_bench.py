"""The encoder benchmark runs end to end in its quick mode (figures not checked, only shape)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ("transfer_vs_encode", "batched_vs_single", "encode_ms_per_image", "transfer_ms_per_image",
            "inline_ms_per_image", "cache_hit_ms_per_image", "cache_miss_ms_per_image", "images_per_s_batch1",
            "images_per_s_batched", "batched_vs_single_home", "images_per_s_batch1_home",
            "images_per_s_batched_home")


# The shared ServeGen trace's format; the test brings its own lines (a clone has no ../shared).
TRACE_LINES = ['{"timestamp_s": 0.0, "text_tokens": 155, "image_tokens": [1131], "output_tokens": 2}',
               '{"timestamp_s": 0.1, "text_tokens": 50, "image_tokens": [16, 9], "output_tokens": 23}',
               '{"timestamp_s": 0.2, "text_tokens": 63, "image_tokens": [154], "output_tokens": 82}']


def test_the_quick_run_ends_with_one_json_line_of_positive_figures(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TRACE_LINES) + "\n")
    run = subprocess.run([sys.executable, "benchmarks/encoder.py", "--quick", "--trace", str(trace)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    figures = json.loads(lines[0])
    for key in HEADLINE:
        value = figures[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert figures["trace_images"] > 0 and "VisionTower" in figures["tower"]
    assert figures["batch_tower"].startswith("LLaVA") and figures["threads"] >= 1
