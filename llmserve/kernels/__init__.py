"""Native CPU kernels, built once per machine and loaded as torch ops (torch.ops.llmserve.*).

The C++ sources live next to this file. `load()` builds them with torch.utils.cpp_extension (ninja
compiles the files in parallel and rebuilds only what changed, headers included, against the
installed torch's headers and ABI flags) into $LLMSERVE_KERNEL_CACHE (default:
llmserve.paths.cache_dir("kernels"), ~/.cache/llmserve/kernels), one folder per torch version and
version of the sources.

One library serves every x86-64 CPU: the decode-attention and GEMV kernels are compiled once per
ISA (AVX2 + FMA in isa_avx2.cpp, AVX-512 in isa_avx512.cpp) under per-file target pragmas, with no
-march flag, and the ISA is chosen at run time (select_isa, from the execution plan; isa.cpp). Where no compiler or ninja is available, load() says
False and logs why once; the execution plan then runs pure-torch attention.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch

from llmserve.paths import cache_dir

logger = logging.getLogger("llmserve.kernels")
NAMES = ("isa.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "paged_attention.cpp", "gemv.cpp", "cache_write.cpp",
         "packed_linear.cpp", "lora.cpp", "quant_linear.cpp", "decoder_layer.cpp")
SOURCES = tuple(Path(__file__).with_name(name) for name in NAMES)
# no -march: each ISA variant names its own target (-mtune only schedules for this CPU, and the
# library runs on any x86-64); at::parallel_for needs OpenMP
CFLAGS = ("-O3", "-mtune=native", "-fopenmp")


def build_directory() -> Path:
    """One folder per torch version and kernel sources: another llmserve version (another
    checkout, say) builds beside this one instead of over it."""
    root = Path(os.environ.get("LLMSERVE_KERNEL_CACHE") or cache_dir("kernels"))
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for src in sorted(Path(__file__).parent.glob("*.[ch]*")):
        if src.suffix in (".cpp", ".h"):
            h.update(src.name.encode() + src.read_bytes())
    return root / f"torch-{torch.__version__}-{h.hexdigest()[:12]}"


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs `ninja` from PATH; the pip package's binary is not there when the venv
    is not activated (e.g. `.venv/bin/python -m pytest`), nor in a venv that reaches the package
    through a path entry, where it lies under the package's own prefix (prefix/lib/pythonX.Y/site-packages/ninja -> prefix/bin)."""
    try:
        import ninja
    except ImportError:
        yield
        return
    dirs = [d for d in (ninja.BIN_DIR, str(Path(ninja.__file__).parents[4] / "bin")) if d and Path(d, "ninja").is_file()]
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*dirs, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _build_and_load(where: Path) -> None:
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    # cpp_extension's own lock is a file that a killed build leaves behind, and every later load
    # would wait on it forever; a flock dies with its process. Whoever holds ours may clear theirs.
    with open(where / "llmserve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (where / "lock").unlink(missing_ok=True)
        logger.info("building native kernels if needed (once per machine): %s", where)
        with _ninja_on_path():
            cpp_extension.load("llmserve_kernels", [str(s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                               build_directory=str(where), is_python_module=False, verbose=False)


@cache
def load() -> bool:
    """True when the torch.ops.llmserve.* native kernels are usable in this process."""
    try:
        _build_and_load(build_directory())
        _register_fake()
    except Exception as e:  # no compiler or ninja, no headers, a read-only home: run without the kernels
        logger.warning("native kernels unavailable, using pure-torch attention (slower): %s", str(e)[-2000:])
        return False
    return True


def select_isa(isa: str) -> None:
    """The decode kernel's ISA variant from now on in this process: avx512, avx2 or portable."""
    torch.ops.llmserve.select_cpu_isa(isa)


def selected_isa() -> str:
    return torch.ops.llmserve.cpu_isa()


def set_gemv_prefetch(nbytes: int) -> None:
    """llmserve::gemv's software prefetch distance from now on in this process (0: none)."""
    torch.ops.llmserve.set_gemv_prefetch(nbytes)


def gemv_prefetch() -> int:
    return torch.ops.llmserve.gemv_prefetch()


def set_gemv_max_rows(rows: int) -> None:
    """Packed layers with a plain weight run steps of at most `rows` rows through llmserve::gemv."""
    torch.ops.llmserve.set_gemv_max_rows(rows)


def gemv_max_rows() -> int:
    return torch.ops.llmserve.gemv_max_rows()


def set_quant_max_rows(rows: int) -> None:
    """Quantized layers run steps of at most `rows` rows through the quantized GEMV, larger ones
    through their packed float copy where they have one, else a dequantized tile and the GEMM
    (kernels/quant_linear.cpp)."""
    torch.ops.llmserve.set_quant_max_rows(rows)


def quant_max_rows() -> int:
    return torch.ops.llmserve.quant_max_rows()


@contextlib.contextmanager
def live_rows(rows: int):
    """Within: the GEMVs (llmserve::gemv, llmserve::quant_linear's) compute the first `rows` rows
    of a step and write zeros into the others, which are padding (model/compile.py)."""
    torch.ops.llmserve.set_live_rows(rows)
    try:
        yield
    finally:
        torch.ops.llmserve.set_live_rows(-1)


def _register_fake() -> None:
    """Shape-only implementation, so torch.compile can trace through the op."""

    @torch.library.register_fake("llmserve::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("llmserve::quant_linear")
    def _(x, q, d, m, bias, in_features, packed=-1):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("llmserve::paged_attention")
    def _(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start, query_len, context_len, prefill_tables, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("llmserve::decoder_layer")
    def _(x, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, query_start, query_len, context_len,
          prefill_tables, handle):
        return torch.empty_like(x)
