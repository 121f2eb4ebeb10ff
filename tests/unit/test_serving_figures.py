"""benchmarks/serving.py's figures over repeats: counts summed, the rest medians, the ratios from
the medians and each repeat's own; the flags it refuses."""

from __future__ import annotations

import pytest

from benchmarks.serving import main, summarize


def one_run(name: str, tok_s: float, ttft_p99: float, itl: float, errors: int = 0) -> dict:
    return {f"{name}_requests": 48, f"{name}_errors": errors, f"{name}_wrong_lengths": 0,
            f"{name}_output_tok_s": tok_s, f"{name}_ttft_ms_p99": ttft_p99, f"{name}_itl_ms_mean": itl,
            f"{name}_processes_left": 0}


def test_repeats_give_medians_summed_counts_and_each_pairs_ratios():
    runs = {"epd": [one_run("epd", 60.0, 4000.0, 80.0), one_run("epd", 30.0, 9000.0, 120.0, errors=1),
                    one_run("epd", 66.0, 4500.0, 70.0)],
            "vllm": [one_run("vllm", 50.0, 5000.0, 160.0), one_run("vllm", 40.0, 6000.0, 150.0),
                     one_run("vllm", 45.0, 5500.0, 170.0)]}
    figures = summarize(runs)
    assert figures["epd_requests"] == figures["vllm_requests"] == 144
    assert figures["epd_errors"] == 1 and figures["vllm_errors"] == 0
    assert figures["epd_output_tok_s"] == 60.0 and figures["vllm_output_tok_s"] == 45.0
    assert figures["epd_ttft_ms_p99"] == 4500.0 and figures["vllm_itl_ms_mean"] == 160.0
    assert figures["throughput_vs_vllm"] == round(60.0 / 45.0, 4)
    assert figures["ttft_p99_vs_vllm"] == round(4500.0 / 5500.0, 4)
    assert figures["ttft_p99_vs_vllm_runs"] == [0.8, 1.5, round(4500.0 / 5500.0, 4)]
    assert figures["throughput_vs_vllm_runs"] == [1.2, 0.75, round(66.0 / 45.0, 4)]


def test_one_run_or_no_vllm_gives_no_pair_figures():
    alone = summarize({"epd": [one_run("epd", 60.0, 4000.0, 80.0)], "vllm": []})
    assert alone["epd_output_tok_s"] == 60.0 and alone["epd_requests"] == 48
    assert alone["throughput_vs_vllm"] is alone["ttft_p99_vs_vllm"] is alone["itl_vs_vllm"] is None
    assert not any(key.endswith("_runs") for key in alone)
    once = summarize({"epd": [one_run("epd", 60.0, 4000.0, 80.0)], "vllm": [one_run("vllm", 50.0, 5000.0, 160.0)]})
    assert once["throughput_vs_vllm"] == 1.2 and not any(key.endswith("_runs") for key in once)


@pytest.mark.parametrize("flags, says", [
    (["--client", "own", "--aiperf-rate", "200"], "--aiperf-rate paces the aiperf client"),
    (["--aiperf-rate", "0"], "--aiperf-rate paces the aiperf client"),
    (["--aiperf-rate", "inf"], "--aiperf-rate paces the aiperf client"),
    (["--keep", "{full}"], "not an empty directory"),
])
def test_flags_it_cannot_honour_are_refused_before_any_server_starts(flags, says, tmp_path, capsys):
    (tmp_path / "left-over").write_text("")
    with pytest.raises(SystemExit) as exited:
        main([flag.format(full=tmp_path) for flag in flags])
    assert exited.value.code == 2 and says in capsys.readouterr().err
