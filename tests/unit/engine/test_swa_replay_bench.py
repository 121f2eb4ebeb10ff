"""benchmarks/swa_replay.py runs end to end in its quick mode (shape and correctness, not speed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KEYS = ("replay_vs_cold", "hit_vs_cold", "ttft_cold_s", "ttft_replay_s", "ttft_hit_s", "tokens_computed",
        "replay_tokens", "prompt_tokens", "window", "layers", "outputs_identical", "goal_replay_vs_cold",
        "meets_goal")


def test_the_quick_run_ends_with_one_json_line_and_replays_less_than_cold(capsys):
    spec = importlib.util.spec_from_file_location("swa_replay", ROOT / "benchmarks" / "swa_replay.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in KEYS:
        assert key in figures, key
    assert figures["outputs_identical"] is True
    computed = figures["tokens_computed"]
    assert computed["hit"] < computed["replay"] < computed["cold"] == figures["prompt_tokens"]
    assert computed["replay"] <= figures["replay_tokens"] + 2 * 16
