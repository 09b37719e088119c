"""--plot: TTFT and ITL distributions (CDFs) and output-token throughput over time, one PNG."""

from __future__ import annotations

import math

from llmserve.bench.client import RequestRecord
from llmserve.bench.report import output_tokens


def plot(records: list[RequestRecord], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in records if r.success]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, title in (
        (a, [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], "TTFT"),
        (b, [g * 1000 for r in ok for g in r.itl_s], "ITL"),
    ):
        xs = np.sort(np.asarray(values, dtype=float))
        if xs.size:
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
        ax.set(title=f"{title} CDF ({xs.size} samples)", xlabel="ms", ylabel="fraction ≤ x")
        ax.grid(alpha=0.3)
    # each token chunk carries output_tokens / chunks tokens (1 when the server streams per token)
    times, weights = [], []
    for r in ok:
        if r.chunk_times_s:
            times += r.chunk_times_s
            weights += [output_tokens(r) / len(r.chunk_times_s)] * len(r.chunk_times_s)
    span = max(times, default=0.0)
    width = min(1.0, span / 50) if span > 0 else 1.0  # 1 s bins, finer for a short run
    if times:
        counts, edges = np.histogram(times, bins=max(1, math.ceil(span / width)), range=(0.0, span or width), weights=weights)
        c.stairs(counts / width, edges)
    c.set(title=f"output throughput ({width:.3g} s bins)", xlabel="s since start", ylabel="tokens/s")
    c.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
