"""The process's memory figures (RSS and glibc's heap), for /stats and the soak test, and
handing free heap pages back to the OS. Without glibc the heap figures are absent and nothing is
released."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


LIBC = _libc()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def heap_stats() -> dict[str, int]:
    """glibc's view of the C heap, in bytes: in_use (allocated from the heap arenas), free (held
    by the arenas but unused: what retention costs) and mmapped (large blocks outside the arenas).
    {} where glibc's mallinfo2 is absent."""
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"heap_in_use_bytes": m.uordblks, "heap_free_bytes": m.fordblks, "mmapped_bytes": m.hblkhd}


def memory_stats() -> dict[str, int]:
    return {"rss_bytes": rss_bytes(), **heap_stats()}


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc malloc_trim); False where absent."""
    trim = getattr(LIBC, "malloc_trim", None)
    return bool(trim is not None and trim(0))
