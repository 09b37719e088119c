"""The three chat-shaped routes side by side over one server: /v1/chat/completions, /v1/responses
and /v1/messages, each --num-prompts streams of --input-len random words and exactly
--output-len tokens (EOS ignored), all at once. One `llmserve serve --no-response-cache` serves
all three; the routes take turns, --rounds times, in a rotated order, each on fresh prompts (so
none is answered from another's prefix blocks); each figure is the median over the rounds.
Prints output tok/s, TTFT and ITL per route, and the Responses and Messages routes against chat
completions: the targets are >= 0.97x its output tok/s and <= +2 ms on its TTFT p50.
Usage: python scripts/bench_apis.py [--model DIR] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import OverHTTP, _load, _median  # noqa: E402

from llmserve.bench.datasets import build_dataset  # noqa: E402
from llmserve.table import format_table  # noqa: E402

ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="random words per prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra `llmserve serve` flags")
    p.add_argument("--json", default=None, metavar="OUT.json")
    args = p.parse_args()
    args.server_env = []
    return args


def report(medians: dict[str, dict]) -> str:
    chat = medians[ROUTES[0]]
    rows = [[route, m["output_tok_s"], m["output_tok_s"] / chat["output_tok_s"], m["ttft_ms"]["p50"], m["ttft_ms"]["p50"] - chat["ttft_ms"]["p50"],
             m["itl_ms"]["p50"]] for route, m in medians.items()]
    return format_table(["route", "output tok/s", "vs chat", "TTFT p50 ms", "vs chat ms", "ITL p50 ms"], rows,
                        "the same workload on each route (medians over the rounds)") + \
        "\ntargets: output tok/s >= 0.97x chat completions'; TTFT p50 at most 2 ms above chat completions'"


def main() -> int:
    args = parse_args()
    server = OverHTTP(args, list(range(1, args.input_len + 1)))
    runs: dict[str, list[dict]] = {route: [] for route in ROUTES}
    try:
        for r in range(args.rounds):
            for k, route in enumerate(ROUTES[r % 3:] + ROUTES[: r % 3]):
                samples = build_dataset("random", args.num_prompts, args.input_len, args.output_len, seed=args.seed + 10 * r + k)
                runs[route].append(_load(server.url, [s.prompt for s in samples], args.output_len, None, route))
    finally:
        server.close()
    medians = {route: _median(figures) for route, figures in runs.items()}
    print(report(medians))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "medians": medians, "rounds": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
