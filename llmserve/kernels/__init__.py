"""Native CPU kernels, compiled once per machine and loaded as torch ops (torch.ops.llmserve.*).

The C++ sources live next to this file. `load()` builds them with the system C++ compiler
against the installed torch (-O3 -march=native), caches the shared library under
$LLMSERVE_KERNEL_CACHE (default: llmserve.paths.cache_dir("kernels"), ~/.cache/llmserve/kernels) keyed by a hash of the sources, torch
version, compiler flags and this CPU's feature flags, and loads it. Concurrent processes build
under a file lock. Where no compiler is available the engine falls back to pure-torch attention
and says so once in the log; LLMSERVE_KERNELS=0 forces that fallback.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from llmserve.paths import cache_dir

logger = logging.getLogger("llmserve.kernels")
SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "cache_write.cpp", "packed_linear.cpp"))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
BUILD_TIMEOUT_S = 600


def cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "g++"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _compile_command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    cxx = _compiler()
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx, *FLAGS, abi, *includes, *map(str, SOURCES), *libs, *rpath, "-lc10", "-ltorch_cpu", "-o", str(out)]


def _library_path() -> Path:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join((torch.__version__, str(torch.version.git_version), *FLAGS, cpu_flags())).encode())
    h.update(_compiler_version(_compiler()).encode())
    root = Path(os.environ.get("LLMSERVE_KERNEL_CACHE") or cache_dir("kernels"))
    return root / f"llmserve_kernels-{h.hexdigest()[:16]}.so"


def _build(lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if lib.exists():
            return
        tmp = lib.with_suffix(f".tmp{os.getpid()}.so")
        logger.info("building native kernels (once per machine): %s", lib.name)
        proc = subprocess.run(_compile_command(tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(proc.stderr.strip()[-2000:] or f"compiler exited with {proc.returncode}")
        tmp.replace(lib)


@cache
def load() -> bool:
    """True when torch.ops.llmserve.paged_decode_attention is usable in this process."""
    if os.environ.get("LLMSERVE_KERNELS", "1") == "0":
        return False
    try:
        lib = _library_path()
        if not lib.exists():
            _build(lib)
        try:
            torch.ops.load_library(str(lib))
        except OSError:  # a damaged cached file: build it again, once
            lib.unlink(missing_ok=True)
            _build(lib)
            torch.ops.load_library(str(lib))
        _register_fake()
    except Exception as e:  # no compiler, no headers, a read-only home: run without the kernels
        logger.warning("native kernels unavailable, using pure-torch attention (slower): %s", e)
        return False
    return True


def _register_fake() -> None:
    """Shape-only implementation, so torch.compile can trace through the op."""

    @torch.library.register_fake("llmserve::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("llmserve::paged_attention")
    def _(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start, query_len, context_len, prefill_tables, scale):
        return torch.empty_like(q)
