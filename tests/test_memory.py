"""The engine process's memory stays bounded: oneDNN's and ideep's primitive caches are capped
(each new GEMM row count used to keep ~600 KB for good, up to 1024 of them), free heap pages can
be handed back, and the figures /stats reports are the process's own."""

from __future__ import annotations

import os
import subprocess
import sys

from llmserve.engine.cpu_runtime import ONEDNN_CACHE_ENV
from llmserve.memory import memory_stats, release_free_memory

# 120 distinct row counts through two float32 packed linears (float32 packs on every x86-64 CPU;
# bf16 packs only where the CPU has native bf16): tens of MB of cached primitives uncapped
GROWTH = """
import sys, torch
from llmserve.engine import cpu_runtime
from llmserve.memory import memory_stats
cpu_runtime.ONEDNN_CACHE_ENTRIES = 8
if sys.argv[1] == "capped":
    cpu_runtime.bound_onednn_caches()
from llmserve.model.packed import pack_linears
torch.set_num_threads(1)
m = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
assert pack_linears(m, torch.float32) == 2, "float32 weights must pack here"
with torch.inference_mode():
    m(torch.randn(1, 576))
    before = memory_stats()["heap_in_use_bytes"]
    for rows in range(2, 122):
        m(torch.randn(rows, 576))
    print(memory_stats()["heap_in_use_bytes"] - before)
"""


def _growth(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_ENV}  # an engine in this process set them
    p = subprocess.run([sys.executable, "-c", GROWTH, mode], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return int(p.stdout.strip().splitlines()[-1])


def test_onednn_primitive_caches_are_capped():
    uncapped, capped = _growth("uncapped"), _growth("capped")
    assert uncapped > 30 << 20, uncapped  # what the cap is for (if this shrinks, revisit the cap)
    assert capped < 12 << 20 and capped < uncapped / 4, (capped, uncapped)


def test_memory_figures_and_trim():
    stats = memory_stats()
    with open("/proc/self/status") as f:
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(stats["rss_bytes"] - vm_rss) < 64 << 20
    assert stats["heap_in_use_bytes"] > 0 and stats["heap_free_bytes"] >= 0
    # 200 MB of freed small heap chunks, then a trim hands the pages back
    blocks = [bytearray(64 << 10) for _ in range(3200)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
    del blocks[::2]
    held = memory_stats()
    assert release_free_memory()
    after = memory_stats()
    assert after["rss_bytes"] < held["rss_bytes"] - (50 << 20), (held, after)
