"""`make gpu-check`: everything that needs a GPU, in one run of under 8 minutes, one JSON line.

Steps, each a subprocess with its own timeout (cut further to what is left of the whole run's
TOTAL_BUDGET_S), run one after another on one GPU:

    gpu_tests           pytest -m gpu tests/gpu (the engine on CUDA, bf16 vs fp32), pass/fail counts
    cluster             the disaggregated-equals-monolithic test with CUDA prefill and decode
                        (tests/gpu/test_cuda_cluster.py), once per --kv-transport choice of
                        TRANSPORT_CHOICES in fp32, and over auto in bf16; figures: the counts
                        and each setup's outcome (e.g. "tcp-float32": "passed")
    engine_throughput   benchmarks/engine_throughput.py --quick (the engine on CUDA, bf16; the
                        transformers columns stay fp32 on the CPU), its JSON figures
    kv_transfer         benchmarks/kv_transfer.py --quick, its JSON figures

engine_throughput compares our tokens with transformers' fp32 CPU tokens and exits 1 when they
differ, which bf16 makes likely: with its figures printed, that is a "warning", not a failure.
kv_transfer's transports move host memory only (a CUDA engine's pool is device memory they cannot
reach, see docs/ARCHITECTURE.md) and it fills its blocks through a CPU engine, so it runs with
CUDA hidden; it has no device-to-device columns yet.

Without CUDA it prints one line and exits 0. Otherwise the last line is JSON: overall status,
seconds, the device, and per step its status (passed / warning / failed / timeout), seconds and
figures. Exit status 1 when a step failed or timed out.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOTAL_BUDGET_S = 470.0
"""The whole run: under 8 minutes, with room for starting Python and printing the summary."""
SKIP_LINE = "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check"
FAILING = ("failed", "timeout")
THROUGHPUT_MISMATCH = "FAIL: transformers' greedy outputs differ"


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    kind: str
    """"pytest" (figures: the outcome counts) or "bench" (figures: the last JSON line)."""
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass
class StepResult:
    name: str
    status: str
    """passed, warning (ran, figures kept, see note), failed or timeout."""
    seconds: float
    figures: dict = field(default_factory=dict)
    note: str = ""


def steps() -> list[Step]:
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    return [
        Step("gpu_tests", [*pytest, "tests/gpu", "--ignore=tests/gpu/test_cuda_cluster.py"], 150, "pytest"),
        # One process for every cluster (each starts 2 prefill, 2 decode, a store node and a
        # router, ~15 s, then serves 20 prompts): no second pytest start-up, one shared deadline.
        Step("cluster", [*pytest, "-rA", "tests/gpu/test_cuda_cluster.py"], 210, "pytest"),
        Step("engine_throughput", [python, "benchmarks/engine_throughput.py", "--quick"], 60, "bench"),
        Step("kv_transfer", [python, "benchmarks/kv_transfer.py", "--quick"], 50, "bench",
             env={"CUDA_VISIBLE_DEVICES": ""},
             note="host-memory transports, CUDA hidden: no device-to-device columns exist yet"),
    ]


def parse_pytest_counts(output: str) -> dict[str, int]:
    """{"passed": 5, "failed": 1, ...} from pytest's final summary line ("5 passed, 1 failed in 3.2s")."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    if not lines:
        return {}
    counts = {}
    for number, outcome in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", lines[-1]):
        counts["errors" if outcome.startswith("error") else outcome] = int(number)
    return counts


def parse_outcomes(output: str) -> dict[str, str]:
    """{"tcp-float32": "passed", ...}: each parametrised test's outcome, from pytest's -rA lines."""
    return {test_id: outcome.lower() for outcome, test_id in
            re.findall(r"^(PASSED|FAILED|ERROR) \S+\[([^\]]+)\]", output, flags=re.MULTILINE)}


def last_json_line(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def classify(step: Step, returncode: int | None, stdout: str, stderr: str, seconds: float) -> StepResult:
    """A finished (or, with ``returncode`` None, timed-out) step's result."""
    if returncode is None:
        return StepResult(step.name, "timeout", seconds, note=f"killed after {step.timeout_s:.0f} s")
    if step.kind == "pytest":
        counts: dict = {**parse_pytest_counts(stdout), **parse_outcomes(stdout)}
        is_ok = (returncode == 0 and counts.get("passed", 0) > 0
                 and not counts.get("failed") and not counts.get("errors"))
        note = "" if is_ok else tail(stdout + stderr) or "no test ran"
        return StepResult(step.name, "passed" if is_ok else "failed", seconds, counts, note)
    figures = last_json_line(stdout)
    if returncode == 0 and figures is not None:
        return StepResult(step.name, "passed", seconds, figures, step.note)
    if figures is not None and THROUGHPUT_MISMATCH in stderr:
        return StepResult(step.name, "warning", seconds, figures,
                          "bf16 on CUDA: our greedy tokens differ from transformers' fp32 CPU tokens")
    return StepResult(step.name, "failed", seconds, figures or {}, tail(stdout + stderr))


def tail(text: str, num_chars: int = 600) -> str:
    return text.strip()[-num_chars:]


def run_step(step: Step, timeout_s: float) -> StepResult:
    """Run in its own process group, so a timeout also ends what the step started (cluster children)."""
    start = time.monotonic()
    process = subprocess.Popen(step.argv, cwd=ROOT, env={**os.environ, **step.env}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    print(f"gpu-check: {step.name} (up to {timeout_s:.0f} s): {' '.join(step.argv[1:])}", file=sys.stderr, flush=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        returncode = None
    result = classify(step, returncode, stdout, stderr, time.monotonic() - start)
    print(f"gpu-check: {step.name}: {result.status} in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    return result


def build_summary(results: list[StepResult], seconds: float, device: str) -> dict:
    is_failed = any(r.status in FAILING for r in results)
    return {
        "gpu_check": "failed" if is_failed else "passed",
        "seconds": round(seconds, 1),
        "device": device,
        "steps": {r.name: {"status": r.status, "seconds": round(r.seconds, 1), "figures": r.figures,
                           **({"note": r.note} if r.note else {})} for r in results},
    }


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    start = time.monotonic()
    results = []
    for step in steps():
        left = TOTAL_BUDGET_S - (time.monotonic() - start)
        if left < 5:
            results.append(StepResult(step.name, "timeout", 0.0, note="not started: the run's time was spent"))
            continue
        results.append(run_step(step, min(step.timeout_s, left)))
    summary = build_summary(results, time.monotonic() - start, torch.cuda.get_device_name(0))
    print(json.dumps(summary))
    return 1 if summary["gpu_check"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
