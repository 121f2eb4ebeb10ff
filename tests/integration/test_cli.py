"""The ``epd`` command as a user runs it (a real child process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def epd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_chat_prints_an_answer_with_the_default_model():
    # "Answer in one word": the bare question's first token is a near tie for a 135M model ("The"
    # against "L'", 0.13 apart in bf16 on AMX's tiles), which bf16's rounding may flip.
    out = epd("chat", "What is the capital of France? Answer in one word.", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "SmolLM2-135M-Instruct" in out.stderr


def test_unknown_model_is_a_clear_error_not_a_traceback(tmp_path):
    out = epd("generate", "hello", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "epd: error:" in out.stderr and "missing" in out.stderr
    assert "Traceback" not in out.stderr


def test_invalid_sampling_value_is_a_clear_error(tiny_llama_dir):
    out = epd("generate", "hello", "--model", str(tiny_llama_dir), "--temperature", "-1")
    assert out.returncode == 2
    assert "temperature" in out.stderr and "Traceback" not in out.stderr
