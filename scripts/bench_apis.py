"""The three chat-shaped routes side by side over one server: /v1/chat/completions, /v1/responses
and /v1/messages, each --num-prompts streams of --input-len random words and exactly
--output-len tokens (EOS ignored), all at once (c32); then --c1-prompts such requests one at a
time (c1), where TTFT is the route's own cost rather than the wait for 31 other prefills. One
`llmserve serve --no-response-cache --no-enable-prefix-caching` serves all three, so the routes
take the very same prompts (fresh each round) without one reading another's prefix blocks; they
take turns, --rounds times, in a rotated order; each figure is the median over the rounds. Prints output tok/s, TTFT and ITL per route, and the
Responses and Messages routes against chat completions: the targets are >= 0.97x its c32 output
tok/s and <= +2 ms on its TTFT p50.
Usage: python scripts/bench_apis.py [--model DIR] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import OverHTTP, _load, _median  # noqa: E402

from llmserve.bench.args import add_workload_arguments  # noqa: E402
from llmserve.bench.datasets import build_dataset  # noqa: E402
from llmserve.table import format_table  # noqa: E402

ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p, "random words per prompt")
    p.add_argument("--c1-prompts", type=int, default=8, help="requests of the concurrency-1 run (0: skip it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="--no-enable-prefix-caching", help="extra `llmserve serve` flags")
    p.add_argument("--json", default=None, metavar="OUT.json")
    args = p.parse_args()
    args.server_env = []
    return args


def report(medians: dict[str, dict[str, dict]]) -> str:
    out = []
    for w, title in (("c32", "all at once"), ("c1", "one at a time")):
        if w not in medians[ROUTES[0]]:
            continue
        chat = medians[ROUTES[0]][w]
        rows = [[route, m[w]["output_tok_s"], m[w]["output_tok_s"] / chat["output_tok_s"], m[w]["ttft_ms"]["p50"],
                 m[w]["ttft_ms"]["p50"] - chat["ttft_ms"]["p50"], m[w]["itl_ms"]["p50"]] for route, m in medians.items()]
        out.append(format_table(["route", "output tok/s", "vs chat", "TTFT p50 ms", "vs chat ms", "ITL p50 ms"], rows,
                                f"{w}: the same workload on each route, {title} (medians over the rounds)"))
    out.append("targets: c32 output tok/s >= 0.97x chat completions'; TTFT p50 at most 2 ms above chat completions'")
    return "\n".join(out)


def main() -> int:
    args = parse_args()
    server = OverHTTP(args, list(range(1, args.input_len + 1)))
    workloads = {"c32": (args.num_prompts, None), **({"c1": (args.c1_prompts, 1)} if args.c1_prompts else {})}
    runs: dict[str, dict[str, list[dict]]] = {route: {w: [] for w in workloads} for route in ROUTES}
    try:
        for r in range(args.rounds):
            for w, (n, concurrency) in workloads.items():
                samples = build_dataset("random", n, args.input_len, args.output_len, seed=args.seed + 10 * r + (w == "c1"))
                for route in ROUTES[r % 3:] + ROUTES[: r % 3]:
                    runs[route][w].append(_load(server.url, [s.prompt for s in samples], args.output_len, concurrency, route))
    finally:
        server.close()
    medians = {route: {w: _median(figures) for w, figures in by_w.items()} for route, by_w in runs.items()}
    print(report(medians))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "medians": medians, "rounds": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
