"""C kernels for the CPU, built on first use by the system's C compiler and called through ctypes.

Plain C with OpenMP, no Python or torch headers, so a build takes under a second. The shared
object is cached under ``$EPD_CACHE_DIR/kernels`` (else ``~/.cache/epd/kernels``) by a hash of
the source, the flags, the compiler and this CPU's model and feature flags (it is built with
``-march=native``), and written under a temporary name then renamed, so processes that build at
once do not collide. It needs ``libgomp.so.1``, the soname of the OpenMP runtime torch ships and
has already loaded, so the kernels and torch share one thread pool.

``-ffast-math`` applies to the compile step only: linking a shared object with it (gcc < 13)
would set flush-to-zero for the whole process when the object loads.

No compiler, a failed build, or ``EPD_CPU_KERNELS=0``: :func:`paged_decode` returns None and
attention keeps its torch path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from services.engine.models.loader import CACHE_ENV

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11")
LINK_FLAGS = ("-shared", "-fopenmp")
SPECIALISED_HEAD_DIMS = (64, 128)
"""head_dims with an entry point of their own (``paged_decode_f32_d64``...)."""

DecodeKernel = Callable[..., None]


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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path = SOURCE, cache_dir: Path | None = None) -> Path:
    """Compile ``source`` to a shared object (or reuse the cached one); its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    directory = cache_dir or _cache_dir()
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in ([cc, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                    [cc, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
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
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ["paged_decode_f32"] + [f"paged_decode_f32_d{d}" for d in SPECIALISED_HEAD_DIMS]:
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 6 + [i64] * 8 + [ctypes.c_float, ctypes.c_int]
        fn.restype = None
    return lib


@functools.cache
def paged_decode() -> DecodeKernel | None:
    """The decode-attention kernel (see ``paged_decode.c``), or None where it cannot be built.

    ``kernel(q, out, kv_cache, layer, rows, tables, lengths, scale)``: float32 CPU tensors, all
    contiguous; rows / tables / lengths int64 (see the C source for shapes). Writes ``out``.
    """
    lib = _library()
    if lib is None:
        return None

    def kernel(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int,
               rows: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float) -> None:
        num_layers, block_size, num_kv_heads, head_dim = (kv_cache.shape[1], kv_cache.shape[3],
                                                          kv_cache.shape[4], kv_cache.shape[5])
        for t in (q, out, kv_cache, rows, tables, lengths):
            assert t.is_contiguous() and t.device.type == "cpu", "the CPU kernel takes contiguous CPU tensors"
        assert q.dtype == out.dtype == kv_cache.dtype == torch.float32
        assert rows.dtype == tables.dtype == lengths.dtype == torch.int64
        fn = (getattr(lib, f"paged_decode_f32_d{head_dim}") if head_dim in SPECIALISED_HEAD_DIMS
              else lib.paged_decode_f32)
        fn(q.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), rows.data_ptr(), tables.data_ptr(),
           lengths.data_ptr(), rows.shape[0], tables.shape[1], layer, num_layers, block_size,
           q.shape[1], num_kv_heads, head_dim, scale, torch.get_num_threads())

    return kernel
