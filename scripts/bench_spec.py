#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup) on and off, side by side in one process.

Two engines over the same model (default: SmolLM2-135M-Instruct, bfloat16, the default
execution mode), one with --speculative-method ngram. Workloads, greedy, chat template:
  grounded: prompts that ask the model to repeat, lightly edit or reformat a passage or code
            block (the answer copies its input);
  random:   prompts of random words, which give n-gram lookup little to find.
At batch 1 the prompts run one after another; at batch B, B at a time (max(8, B) prompts). The two engines alternate
rounds, and every pair of outputs is checked to be identical, token for token.

    python scripts/bench_spec.py [--rounds 2] [--max-tokens 128] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import random
import time

from llmserve.engine.llm import LLM
from llmserve.sampling import SamplingParams
from llmserve.table import format_table

PASSAGE = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened "
    "the shutters of the shop on the square, and the first bus of the day turned round by the old "
    "bridge. By eight the market stalls were up: apples, cheese, honey in tall jars, and a man who "
    "sharpened knives while you waited."
)
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out'''
PEOPLE = "Alice Martin, engineer; Bob Chen, designer; Carla Diaz, manager; Dan Okafor, analyst; Eve Novak, intern"
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following text, replacing the word 'town' with 'village' and changing nothing else:\n\n{PASSAGE}",
    f"Here is a Python function. Rename the variable `total` to `running_sum` and return the whole function:\n\n```python\n{CODE}\n```",
    f"Convert this list into a JSON array of objects with the keys \"name\" and \"role\":\n{PEOPLE}",
    f"Copy this code block exactly as it is:\n\n```python\n{CODE}\n```",
    f"Fix the spelling and return the corrected text: {PASSAGE.replace('market', 'markett').replace('bridge', 'brigde')}",
    f"Put each sentence of this passage on its own line:\n\n{PASSAGE}",
    f"Add a type hint to every parameter of this function and return it:\n\n```python\n{CODE}\n```",
]
WORDS = ("sky orange violin harbor quantum pencil desert lantern meadow copper whisper glacier "
         "thunder velvet compass orchard puzzle canyon ember marble falcon ribbon tundra").split()


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Write a short story that uses these words: {' '.join(rng.sample(WORDS, 8))}." for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per prompt) with `batch` prompts at a time."""
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [o.token_ids for o in llm.generate(prompts[i : i + batch], params)]
    return time.perf_counter() - t0, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-max-batch", type=int, default=8)
    args = p.parse_args()
    common = {"dtype": args.dtype, "max_num_seqs": max(args.batches)}
    off = LLM(args.model, **common)
    on = LLM(args.model, speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
             speculative_max_batch=args.speculative_max_batch, **common)
    tok = off.engine.tokenizer
    n = max(len(GROUNDED), *args.batches)
    grounded = [f"Task {i + 1}. {GROUNDED[i % len(GROUNDED)]}" for i in range(n)]
    workloads = {name: [tok.apply_chat_template([{"role": "user", "content": t}], True) for t in texts]
                 for name, texts in (("grounded", grounded), ("random", random_prompts(n)))}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for llm in (off, on):  # warm-up: compiled graphs, oneDNN primitives
        run(llm, workloads["grounded"][:2], SamplingParams(max_tokens=16, temperature=0), 2)
    rows = []
    for name, prompts in workloads.items():
        for batch in args.batches:
            rows.append(measure(name, batch, prompts[: max(len(GROUNDED), batch)], params, off, on, args.rounds))
    print(format_table(["workload", "batch", "off tok/s", "on tok/s", "on/off", "acceptance", "accepted per row", "identical"], rows))


def measure(name: str, batch: int, prompts: list[list[int]], params: SamplingParams, off: LLM, on: LLM, rounds: int) -> list:
    t_off = t_on = 0.0
    tokens, identical = 0, True
    before = on.get_stats().spec_decode
    for _ in range(rounds):
        s_off, out_off = run(off, prompts, params, batch)
        s_on, out_on = run(on, prompts, params, batch)
        t_off, t_on = t_off + s_off, t_on + s_on
        tokens += sum(map(len, out_off))
        identical &= out_on == out_off
    after = on.get_stats().spec_decode
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    rows = after["num_drafts"] - before["num_drafts"]
    return [name, batch, f"{tokens / t_off:.1f}", f"{tokens / t_on:.1f}", f"{t_off / t_on:.2f}x",
            f"{accepted / drafted:.0%}" if drafted else "-", f"{accepted / rows:.2f}" if rows else "-", "yes" if identical else "NO"]


if __name__ == "__main__":
    main()
