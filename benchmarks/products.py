"""The linear layers' products on the CPU: the packed product against torch's, same run, same shapes.

SmolLM2-135M's four products of a layer (q/k/v fused 960 x 576, o 576 x 576, gate and up fused
3,072 x 576, down 576 x 1,536) at 2,048, 256, 32 and 1 rows (a prefill chunk, a small one, a
decode batch, one decode), in GFLOP/s summed over the four:

    fp32    packed_gemm.c (every step's, by default) against torch's (MKL on x86)
    bf16    packed_gemm_bf16.c on AMX's tiles (where the CPU has them; every step's, by default),
            the same product on AVX512_BF16's dot products, and torch's (oneDNN: AMX too where
            the CPU has it), where the CPU computes bf16 natively

Each figure is the median of --repeats timed passes, the columns alternating within a pass so a
machine that speeds up or slows down hits them alike. Every column also checks that a row's bits
do not depend on the rows around it (the packed products' contract; torch's are reported, not
required): ``row_independent``. Last line: JSON with the figures, per column and row count, and
the CPU.

    python benchmarks/products.py [--repeats 5] [--rows 2048,256,32,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import cpu_info  # noqa: E402
from services.engine.kernels import cpu  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""(outputs, inputs) of SmolLM2's products in one layer."""


def columns() -> dict[str, tuple[torch.dtype, object]]:
    """Column name -> (dtype, the kernels whose packed product it runs, or None: torch's)."""
    native = cpu.kernels()
    if native is None:
        raise SystemExit("the CPU kernels did not build (no C compiler?): nothing to compare")
    out: dict[str, tuple[torch.dtype, object]] = {"fp32_packed": (torch.float32, native), "fp32_torch": (torch.float32, None)}
    if native.packs_bf16:
        if native.bf16_product == "amx":
            out["bf16_packed_amx"] = (torch.bfloat16, native)
            os.environ[cpu.AMX_ENV] = "0"
            cpu.kernels.cache_clear()
            out["bf16_packed_avx512_bf16"] = (torch.bfloat16, cpu.kernels())
            del os.environ[cpu.AMX_ENV]
        else:
            out["bf16_packed_avx512_bf16"] = (torch.bfloat16, native)
        out["bf16_torch"] = (torch.bfloat16, None)
    return out


def product(kernels, weight: torch.Tensor):
    """``x -> x W^T`` through the packed product of ``kernels``, or torch's (None)."""
    if kernels is None:
        return lambda x: torch.nn.functional.linear(x, weight)
    packed = kernels.pack_weight(weight)
    return lambda x: kernels.packed_gemm(x, packed, None, weight.shape[0])


def row_independent(f, x: torch.Tensor) -> bool:
    whole = f(x)
    return all(torch.equal(f(x[i:i + n]), whole[i:i + n]) for i, n in ((0, 1), (3, 17), (len(x) - 33, 33)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="2048,256,32,1")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    info = cpu_info()
    print(f"CPU: {info['model']}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    cols = columns()
    weights = {dtype: [torch.randn(n, k).to(dtype) * 0.05 for n, k in SHAPES] for dtype in {d for d, _ in cols.values()}}
    products = {name: [product(kernels, w) for w in weights[dtype]] for name, (dtype, kernels) in cols.items()}
    independent = {}
    for name, (dtype, _) in cols.items():
        x = torch.randn(300, SHAPES[0][1]).to(dtype)
        independent[name] = row_independent(products[name][0], x)
    figures: dict[str, dict[str, float]] = {name: {} for name in cols}
    for m in rows:
        xs = {dtype: [torch.randn(m, k).to(dtype) for _, k in SHAPES] for dtype in weights}
        flops = sum(2 * m * n * k for n, k in SHAPES)
        reps = max(3, int(4e9 / flops))
        times: dict[str, list[float]] = {name: [] for name in cols}
        for _ in range(args.repeats):
            for name, (dtype, _) in cols.items():
                fs, inputs = products[name], xs[dtype]
                for f, x in zip(fs, inputs):
                    f(x)  # warm
                start = time.perf_counter()
                for _ in range(reps):
                    for f, x in zip(fs, inputs):
                        f(x)
                times[name].append((time.perf_counter() - start) / reps)
        for name in cols:
            figures[name][str(m)] = round(flops / statistics.median(times[name]) / 1e9, 1)
        print(f"{m:5d} rows: " + ", ".join(f"{name} {figures[name][str(m)]:.0f} GFLOP/s" for name in cols))
    print("row independent: " + ", ".join(f"{name} {ok}" for name, ok in independent.items()))
    print(json.dumps({"gflops": figures, "row_independent": independent, "rows": rows,
                      "stat": f"median of {args.repeats} passes, columns alternating", "cpu": info}))


if __name__ == "__main__":
    main()
