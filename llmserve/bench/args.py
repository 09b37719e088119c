"""Command-line options of `llmserve bench serve` / scripts/loadtest.py (names follow `vllm bench serve`)."""

from __future__ import annotations

import argparse


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    s.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"))
    s.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=("random", "prefix-repetition", "jsonl"))
    d.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\": ..., \"max_tokens\"?: N} per line")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=128, help="random: prompt words; prefix-repetition: suffix words")
    d.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    d.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: words in each shared prefix")
    d.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: distinct shared prefixes")
    d.add_argument("--seed", type=int, default=0)

    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson; lower: burstier)")
    r.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    r.add_argument("--num-warmups", type=int, default=1, help="requests sent (and not measured) first")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM / llmserve extension)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    r.add_argument("--max-duration", type=float, default=3600.0, help="seconds the whole run may take")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")

    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="OUT.json", help="summary and per-request records")
    o.add_argument("--plot", default=None, metavar="OUT.png", help="TTFT and ITL CDFs, throughput over time")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--verbose", action="store_true", help="log what libraries log (e.g. one line per HTTP request)")


def add_workload_arguments(p: argparse.ArgumentParser, input_help: str = "prompt tokens") -> None:
    """The model and the workload the side-by-side benchmark scripts share (scripts/bench_*.py)."""
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine (default: its own default)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help=input_help)
    p.add_argument("--output-len", type=int, default=128)
