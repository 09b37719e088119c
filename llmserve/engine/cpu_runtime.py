"""Process-wide CPU runtime settings for the engine's hot loop.

Every decode step allocates tens of MB of short-lived tensors (gathered K/V, activations). By
default glibc serves buffers above its mmap threshold with fresh mmap()s and unmaps them on
free, so every step pays page faults on all of them. Raising the mmap and trim thresholds keeps
those buffers in the heap and reuses them (measured: 1.5-2x faster fp32 decode at batch 32).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("llmserve.engine")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def keep_large_allocations() -> bool:
    """Tune glibc malloc once per process; False (and nothing changed) where glibc is absent."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = all(mallopt(opt, val) == 1 for opt, val in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not ok:
        logger.debug("mallopt refused a setting; keeping glibc defaults")
    return ok
