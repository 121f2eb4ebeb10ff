"""C kernels for the CPU, built on first use by the system's C compiler and called through ctypes.

Plain C with OpenMP, no Python or torch headers, so a build takes about a second. The sources
are linked into one shared object, cached under ``$EPD_CACHE_DIR/kernels`` (else
``~/.cache/epd/kernels``) by a hash of the sources, the flags, the compiler and this CPU's model
and feature flags (it is built with ``-march=native``), and written under a temporary name then
renamed, so processes that build at once do not collide. It needs ``libgomp.so.1``, the soname of the OpenMP runtime torch ships and
has already loaded, so the kernels and torch share one thread pool.

Flags are per source: the attention kernels use ``-ffast-math`` (vector ``expf``, reassociated
sums), the RoPE kernel no contracted FMAs either (it reproduces torch's bits). ``-ffast-math`` applies to the compile
step only: linking a shared object with it (gcc < 13) would set flush-to-zero for the whole
process when the object loads.

``EPD_CPU_MARCH`` builds for another instruction set than this CPU's own (gcc's ``-march``):
``x86-64-v3`` (AVX2 and FMA) runs the AVX2 paths on an AVX-512 CPU, as the tests do there.

No compiler, a failed build, or ``EPD_CPU_KERNELS=0``: :func:`kernels` returns None and the
model and attention keep their torch path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from services.engine.models.loader import CACHE_ENV

logger = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=gnu11")
MARCH_ENV = "EPD_CPU_MARCH"
AMX_ENV = "EPD_CPU_AMX"
"""``0``: the bf16 product keeps to AVX512_BF16's dot products where the CPU has AMX too (to
compare the two; the default uses AMX's tiles)."""
"""The instruction set to build for (``-march``): this CPU's own (``native``) unless set."""
BF16 = ("-DEPD_BF16",)
"""Builds a source for bfloat16 elements (element.h): its names end in _bf16, not _f32."""
SOURCES = tuple((Path(__file__).with_name(name), flags) for name, flags in (
    ("paged_decode.c", ("-ffast-math",)),
    ("paged_decode.c", ("-ffast-math", *BF16)),
    ("paged_prefill.c", ("-ffast-math",)),
    ("paged_prefill.c", ("-ffast-math", *BF16)),
    # torch's bits exactly: every operation rounded on its own, none fused into an FMA.
    ("rope_store.c", ("-ffp-contract=off",)),
    ("rope_store.c", ("-ffp-contract=off", *BF16)),
    ("rms_norm.c", ()),
    ("rms_norm.c", BF16),
    ("packed_gemm.c", ()),
    ("packed_gemm_bf16.c", ()),
    ("threads.c", ()),
))
"""Each source with the flags it adds to COMPILE_FLAGS (a source may be built more than once)."""
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""The element types the attention and RoPE kernels are built for, by their names' suffix."""
HEADERS = (Path(__file__).with_name("vector.h"), Path(__file__).with_name("element.h"))
"""Included by the sources: part of the build's identity."""
LINK_FLAGS = ("-shared", "-fopenmp")
SPECIALISED_HEAD_DIMS = (64, 128)
"""head_dims with an entry point of their own (``paged_decode_f32_d64``...)."""

DecodeKernel = Callable[..., None]
PrefillKernel = Callable[..., None]


@dataclass(frozen=True)
class CpuKernels:
    paged_decode: DecodeKernel
    """``(q, out, kv_cache, layer, rows, tables, lengths, scale, window=0)``: single-token decodes
    (``window`` > 0: a sliding-window layer's)."""
    paged_prefill: PrefillKernel
    """``(q, out, kv_cache, layer, spans, tables, scale, window=0)``: chunks of new tokens, causal."""
    rope_store: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``(qkv, cos, sin, kv_cache, slot_rows, k_offset, v_offset, num_heads) -> (q, k)``: RoPE
    on the fused projection's q and k, k and v stored at token rows ``slot_rows + offset``."""
    pack_weight: Callable[[torch.Tensor], torch.Tensor]
    """``(weight [N, K]) -> packed``: a linear layer's weight in :attr:`packed_gemm`'s panels."""
    packed_gemm: Callable[..., torch.Tensor]
    """``(x [M, K], packed, bias | None, N) -> x W^T + bias``: in x's dtype, a row's result
    independent of the other rows (fp32 ``packed_gemm.c``, bf16 ``packed_gemm_bf16.c``)."""
    pack_gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(gate [N, K], up [N, K]) -> packed``: SwiGLU's two weights, packed together for
    :attr:`packed_gemm_gated`."""
    packed_gemm_gated: Callable[..., torch.Tensor]
    """``(x [M, K], packed, N) -> silu(x Wg^T) * (x Wu^T)``: the two products' sums as
    :attr:`packed_gemm` makes them, SiLU and the product in its epilogue."""
    add_rms_norm: Callable[..., torch.Tensor]
    """``(x, residual | None, weight, eps) -> out``: ``x += residual`` in place, then RMSNorm
    of x into a new tensor (``rms_norm.c``)."""
    packs_bf16: bool
    """Whether the bf16 product was built (the compiler targets AVX512_BF16): without it the
    packing and products take fp32 only."""
    bf16_product: str
    """What computes the bf16 product: ``"amx"`` (AMX's tiles, where the CPU and the compiler have
    them and ``EPD_CPU_AMX`` is not ``0``), ``"avx512_bf16"`` (its dot products) or ``""`` (not built)."""
    bind_threads: Callable[[list[int]], int]
    """``(cpus) -> failures``: the calling thread's OpenMP team, ``len(cpus)`` threads, thread
    i bound to ``cpus[i]`` (see ``threads.c``); how many could not be bound."""


def enabled() -> bool:
    return os.environ.get("EPD_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "epd") / "kernels"


def _cpu_identity() -> str:
    """This CPU's model and feature flags: a -march=native build is valid on this CPU only."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def cpu_model() -> str:
    """/proc/cpuinfo's model name, "" where there is none."""
    lines = [ln for ln in _cpu_identity().splitlines() if ln.startswith("model name")]
    return lines[0].split(":", 1)[1].strip() if lines else ""


def march() -> str:
    return os.environ.get(MARCH_ENV) or "native"


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags (/proc/cpuinfo's: avx2, avx512f, avx512_bf16...); None where the
    system does not list them."""
    lines = [ln for ln in _cpu_identity().splitlines() if ln.startswith("flags")]
    return frozenset(lines[0].split(":", 1)[1].split()) if lines else None


def _missing_features(cc: str, target: str) -> list[str]:
    """The vector extensions the compiler's ``-march=target`` assumes and this CPU lacks (its
    kernels would die of an illegal instruction here): the target's feature macros (``__AVX2__``,
    ``__AVX512BF16__``...) against :func:`cpu_flags`, underscores aside. None where the system
    lists no flags and nothing can be said."""
    flags = cpu_flags()
    if flags is None:
        return []
    done = subprocess.run([cc, f"-march={target}", "-dM", "-E", "-"], input="", capture_output=True, text=True)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines() or [f"{cc} exited with {done.returncode}"]
        raise RuntimeError(f"{MARCH_ENV}={target}: {said[0][:300]}")
    wanted = [w.lower() for w in re.findall(r"#define __((?:AVX|AMX|FMA|F16C|BMI)\w*)__ 1", done.stdout)]
    have = {f.replace("_", "") for f in flags} | ({"bmi"} if "bmi1" in flags else set())  # gcc's __BMI__
    return sorted(w for w in wanted if w.replace("_", "") not in have)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(sources: tuple[tuple[Path, tuple[str, ...]], ...] = SOURCES, cache_dir: Path | None = None) -> Path:
    """Compile ``sources`` (each with its own flags) into one shared object, or reuse the cached
    one; its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    missing = [] if march() == "native" else _missing_features(cc, march())
    if missing:
        raise RuntimeError(f"{MARCH_ENV}={march()} uses {', '.join(missing)}, which this CPU lacks")
    parts = [text for s, flags in sources for text in (s.name, s.read_text(), *flags)]
    parts += [h.read_text() for h in HEADERS]
    compile_flags = (*COMPILE_FLAGS, f"-march={march()}")
    key = hashlib.sha256("\0".join([*parts, *compile_flags, *LINK_FLAGS, version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    directory = cache_dir or _cache_dir()
    target = directory / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        objects = [str(Path(tmp) / f"{i}-{s.stem}.o") for i, (s, _) in enumerate(sources)]
        lib = Path(tmp) / "kernels.so"
        commands = [[cc, *compile_flags, *flags, "-c", str(s), "-o", o]
                    for (s, flags), o in zip(sources, objects)]
        for cmd in commands + [[cc, *LINK_FLAGS, *objects, "-o", str(lib), "-lm"]]:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)
    logger.info("built CPU kernel %s", target)
    return target


def _library() -> ctypes.CDLL | None:
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable, using the torch path: %s", e)
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for suffix in DTYPES.values():
        for kind, num_ptrs, num_ints, restype in (("decode", 6, 9, None), ("prefill", 5, 9, i32)):
            for name in [f"paged_{kind}_{suffix}"] + [f"paged_{kind}_{suffix}_d{d}" for d in SPECIALISED_HEAD_DIMS]:
                fn = getattr(lib, name)
                fn.argtypes = [ptr] * num_ptrs + [i64] * num_ints + [f32, i32]
                fn.restype = restype
        rope = getattr(lib, f"rope_store_{suffix}")
        rope.argtypes = [ptr] * 7 + [i64] * 6 + [i32]
        rope.restype = None
        norm = getattr(lib, f"add_rms_norm_{suffix}")
        norm.argtypes = [ptr] * 4 + [i64] * 2 + [f32, i32]
        norm.restype = None
    lib.packed_gemm_bf16_available.argtypes = []
    lib.packed_gemm_bf16_available.restype = i32
    lib.packed_gemm_bf16_amx_ready.argtypes = []
    lib.packed_gemm_bf16_amx_ready.restype = i32
    for product in ["packed_gemm"] + (["packed_gemm_bf16"] if lib.packed_gemm_bf16_available() else []):
        for name, argtypes, restype in (
                ("_size", [i64, i64], i64), ("_pack", [ptr, ptr, i64, i64, i32], None),
                ("", [ptr, i64, ptr, ptr, ptr] + [i64] * 4 + [i32], None),
                ("_pack_gated", [ptr, ptr, ptr, i64, i64, i32], None),
                ("_gated", [ptr, i64, ptr, ptr] + [i64] * 4 + [i32], None)):
            fn = getattr(lib, product + name)
            fn.argtypes, fn.restype = argtypes, restype
    # Asks Linux for AMX's tile state once, here, before any thread computes on it.
    if lib.packed_gemm_bf16_amx_ready():
        for like in ("packed_gemm_bf16", "packed_gemm_bf16_gated"):
            amx = getattr(lib, like.replace("bf16", "bf16_amx"))
            amx.argtypes, amx.restype = getattr(lib, like).argtypes, None
    lib.bind_threads.argtypes = [ptr, i32]
    lib.bind_threads.restype = i32
    return lib


def _check_elements(*tensors: torch.Tensor) -> None:
    """Contiguous CPU tensors of one element type the kernels are built for."""
    for t in tensors:
        assert t.is_contiguous() and t.device.type == "cpu", "the CPU kernels take contiguous CPU tensors"
    assert len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in DTYPES


def _check(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, *index: torch.Tensor) -> None:
    _check_elements(q, out, kv_cache)
    for t in index:
        assert t.is_contiguous() and t.device.type == "cpu" and t.dtype == torch.int64


def _entry(lib: ctypes.CDLL, kind: str, dtype: torch.dtype, head_dim: int | None = None):
    name = f"{kind}_{DTYPES[dtype]}"
    return getattr(lib, f"{name}_d{head_dim}" if head_dim in SPECIALISED_HEAD_DIMS else name)


@functools.cache
def kernels() -> CpuKernels | None:
    """The kernels (see ``paged_decode.c``, ``paged_prefill.c``, ``rope_store.c``, ``rms_norm.c``), or None
    where they cannot be built. They take float32 or bfloat16 CPU tensors (one dtype a call;
    the packed product bfloat16 only where ``packs_bf16``), all contiguous, and int64 index
    tensors (see the C sources for shapes).
    """
    lib = _library()
    if lib is None:
        return None

    def paged_decode(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     rows: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                     window: int = 0) -> None:
        _check(q, out, kv_cache, rows, tables, lengths)
        num_layers, block_size, num_kv_heads, head_dim = kv_cache.shape[1], *kv_cache.shape[3:]
        _entry(lib, "paged_decode", q.dtype, head_dim)(
            q.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), rows.data_ptr(), tables.data_ptr(),
            lengths.data_ptr(), rows.shape[0], tables.shape[1], window, layer, num_layers, block_size,
            q.shape[1], num_kv_heads, head_dim, scale, torch.get_num_threads())

    def paged_prefill(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                      spans: torch.Tensor, tables: torch.Tensor, scale: float, window: int = 0) -> None:
        _check(q, out, kv_cache, spans, tables)
        num_layers, block_size, num_kv_heads, head_dim = kv_cache.shape[1], *kv_cache.shape[3:]
        status = _entry(lib, "paged_prefill", q.dtype, head_dim)(
            q.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), spans.data_ptr(), tables.data_ptr(),
            spans.shape[0], tables.shape[1], window, layer, num_layers, block_size, q.shape[1],
            num_kv_heads, head_dim, scale, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the CPU prefill kernel could not allocate its work list")

    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                   slot_rows: torch.Tensor, k_offset: int, v_offset: int,
                   num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_kv_heads, head_dim = kv_cache.shape[4:]
        num_tokens = qkv.shape[0]
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        assert cos.numel() == sin.numel() == num_tokens * head_dim
        q = qkv.new_empty(num_tokens, num_heads, head_dim)
        k = qkv.new_empty(num_tokens, num_kv_heads, head_dim)
        _check(qkv, q, kv_cache, slot_rows)
        _check(cos, sin, k)
        _entry(lib, "rope_store", qkv.dtype)(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), kv_cache.data_ptr(),
            slot_rows.data_ptr(), k_offset, v_offset, num_tokens, num_heads, num_kv_heads, head_dim,
            torch.get_num_threads())
        return q, k

    packs_bf16 = bool(lib.packed_gemm_bf16_available())
    on_amx = bool(lib.packed_gemm_bf16_amx_ready()) and os.environ.get(AMX_ENV, "1") != "0"
    bf16_product = "amx" if on_amx else "avx512_bf16" if packs_bf16 else ""
    # The packed product's entry points by element type: (size, pack, product, pack gated, gated);
    # bf16's products on AMX's tiles where they run (the same packing).
    products = {dtype: tuple(getattr(lib, prefix + name) for name in ("_size", "_pack", "", "_pack_gated", "_gated"))
                for dtype, prefix in ((torch.float32, "packed_gemm"), (torch.bfloat16, "packed_gemm_bf16"))
                if dtype == torch.float32 or packs_bf16}
    if on_amx:
        size, pack, _, pack_gated, _ = products[torch.bfloat16]
        products[torch.bfloat16] = (size, pack, lib.packed_gemm_bf16_amx, pack_gated, lib.packed_gemm_bf16_amx_gated)

    def _product(t: torch.Tensor):
        assert t.dtype in products and t.device.type == "cpu", f"no packed product for {t.dtype} on {t.device}"
        return products[t.dtype]

    def pack_weight(weight: torch.Tensor) -> torch.Tensor:
        size, pack, *_ = _product(weight)
        assert weight.is_contiguous()
        num_out, num_in = weight.shape
        packed = weight.new_empty(size(num_out, num_in))
        pack(weight.data_ptr(), packed.data_ptr(), num_out, num_in, torch.get_num_threads())
        return packed

    def packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, num_out: int) -> torch.Tensor:
        # Rows may lie apart (a column slice of a wider tensor), as long as each is contiguous.
        size, _, product, *_ = _product(x)
        assert x.dim() == 2 and x.stride(1) == 1 and packed.dtype == x.dtype
        num_rows, num_in = x.shape
        assert packed.numel() == size(num_out, num_in)
        assert bias is None or (bias.is_contiguous() and bias.numel() == num_out and bias.dtype == x.dtype)
        y = x.new_empty(num_rows, num_out)
        product(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), num_out, num_rows, num_out, num_in, torch.get_num_threads())
        return y

    def pack_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        size, _, _, pack, _ = _product(gate)
        assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape and gate.dtype == up.dtype
        num_out, num_in = gate.shape
        packed = gate.new_empty(2 * size(num_out, num_in))
        pack(gate.data_ptr(), up.data_ptr(), packed.data_ptr(), num_out, num_in, torch.get_num_threads())
        return packed

    def packed_gemm_gated(x: torch.Tensor, packed: torch.Tensor, num_out: int) -> torch.Tensor:
        size, *_, product = _product(x)
        assert x.dim() == 2 and x.stride(1) == 1 and packed.dtype == x.dtype
        num_rows, num_in = x.shape
        assert packed.numel() == 2 * size(num_out, num_in)
        y = x.new_empty(num_rows, num_out)
        product(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), num_out, num_rows, num_out, num_in,
                torch.get_num_threads())
        return y

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        _check_elements(x, out, weight, *(() if residual is None else (residual,)))
        assert residual is None or residual.shape == x.shape
        _entry(lib, "add_rms_norm", x.dtype)(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
        return out

    def bind_threads(cpus: list[int]) -> int:
        ids = torch.tensor(cpus, dtype=torch.int64)
        return lib.bind_threads(ids.data_ptr(), len(cpus))

    return CpuKernels(paged_decode=paged_decode, paged_prefill=paged_prefill, rope_store=rope_store,
                      pack_weight=pack_weight, packed_gemm=packed_gemm, pack_gated=pack_gated,
                      packed_gemm_gated=packed_gemm_gated, add_rms_norm=add_rms_norm, packs_bf16=packs_bf16,
                      bf16_product=bf16_product,
                      bind_threads=bind_threads)
