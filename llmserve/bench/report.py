"""The load test's summary, with metrics as `vllm bench serve` defines them (successful requests only):
TTFT, TPOT = (E2EL - TTFT) / (output_tokens - 1) for requests with more than one output token,
ITL = every gap between token chunks, E2EL; request and token throughput over the whole run;
goodput = requests meeting every SLO (--goodput ttft:MS tpot:MS e2el:MS) per second.
"""

from __future__ import annotations

import math
from collections import Counter

from llmserve.bench.client import RequestRecord
from llmserve.errors import InvalidRequestError
from llmserve.profiling import LatencyStats
from llmserve.table import format_table

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in SLO_KEYS or value < 0:
            raise InvalidRequestError(f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}", "goodput")
        slos[key] = value / 1000
    return slos


def output_tokens(r: RequestRecord) -> int:
    """From usage; a server that sent none is credited one token per token chunk."""
    return r.output_tokens if r.output_tokens is not None else len(r.chunk_times_s)


def tpot_of(r: RequestRecord) -> float | None:
    n = output_tokens(r)
    if n <= 1 or r.latency_s is None or r.ttft_s is None:
        return None
    return (r.latency_s - r.ttft_s) / (n - 1)


def _good(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": tpot_of(r) or 0.0, "e2el": r.latency_s}
    return all(values[k] is not None and values[k] <= limit for k, limit in slos.items())


def _ms(values: list[float]) -> dict:
    s = LatencyStats.of(values).scaled(1000)
    return {k: _finite(getattr(s, k)) for k in ("mean", "p50", "p95", "p99", "max")}


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 3)


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_tokens or 0 for r in ok)
    n_out = sum(output_tokens(r) for r in ok)
    dur = max(duration_s, 1e-9)
    summary = {
        "num_prompts": len(records),
        "successes": len(ok),
        "failures": len(records) - len(ok),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "missing_usage": sum(r.output_tokens is None for r in ok),
        "request_throughput": len(ok) / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _ms([t for r in ok if (t := tpot_of(r)) is not None]),
        "itl_ms": _ms([g for r in ok for g in r.itl_s]),
        "e2el_ms": _ms([r.latency_s for r in ok if r.latency_s is not None]),
        "errors": dict(Counter(r.error or "incomplete stream" for r in records if not r.success).most_common(10)),
    }
    if slos:
        summary["goodput_slos_ms"] = {k: v * 1000 for k, v in slos.items()}
        summary["request_goodput"] = sum(_good(r, slos) for r in ok) / dur
    return summary


def format_summary(s: dict) -> str:
    lines = [
        f"successful requests: {s['successes']} / {s['num_prompts']} ({s['failures']} failed)",
        f"duration: {s['duration_s']:.2f} s",
        f"input tokens: {s['total_input_tokens']}, output tokens: {s['total_output_tokens']}",
        f"request throughput: {s['request_throughput']:.2f} req/s",
        f"output token throughput: {s['output_throughput']:.2f} tok/s",
        f"total token throughput: {s['total_token_throughput']:.2f} tok/s",
    ]
    if "request_goodput" in s:
        lines.append(f"request goodput: {s['request_goodput']:.2f} req/s (SLOs ms: {s['goodput_slos_ms']})")
    rows = [[name.upper(), *(_nan(s[key][k]) for k in ("mean", "p50", "p95", "p99", "max"))]
            for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2el_ms"))]
    out = "\n".join(lines) + "\n\n" + format_table(["(ms)", "mean", "p50", "p95", "p99", "max"], rows)
    for msg, n in s["errors"].items():
        out += f"\nerror x{n}: {msg}"
    return out


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x
