#!/usr/bin/env python3
"""What structured output costs the engine.

1. Per-step cost of the token mask: decode steps at batch 32 where 16 rows are held to a JSON
   schema, against the same batch with no constrained row, in interleaved rounds on one engine.
   Reported as the ratio of median decode-step times (target <= 1.10x).
   The mask's own cost is also timed alone: filling and applying the bitmask of 16 matchers
   (mid-way through the schema) on [32, vocab] logits.
2. Grammar compile time for a 20-property JSON schema: cold (a new compiler, its tokenizer view
   built already) and cached (the same grammar again).

    python scripts/bench_structured.py [--model DIR] [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.engine.llm import LLM
from llmserve.sampling import SamplingParams, StructuredOutputsParams
from llmserve.structured import GrammarCompiler, apply_bitmask, fill_bitmask, grammar_of

# long structured output: the mask is computed at every step of every constrained row
LONG_JSON = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}},
             "required": ["items"], "additionalProperties": False}
WIDE_JSON = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(20)],
             "properties": {f"field_{i}": [{"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 0},
                                           {"type": "array", "items": {"type": "number"}}, {"enum": ["a", "b", "c"]}][i % 4]
                            for i in range(20)}}
PROMPT = "List as many English words as you can, as a JSON object."


def decode_step_ms(llm: LLM, constrained: int, batch: int, tokens: int, seed: int) -> float:
    """Median duration (ms) of the steps that decode the whole batch."""
    params = [SamplingParams(max_tokens=tokens, temperature=0.7, seed=seed + i, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=LONG_JSON) if i < constrained else None)
              for i in range(batch)]
    llm.engine.step_records.clear()
    outs = llm.generate([PROMPT] * batch, params)
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    steps = [r.duration_s for r in llm.engine.step_records if r.num_prefill_tokens == 0 and r.num_decode_seqs == batch]
    return statistics.median(steps) * 1000


def mask_ms(llm: LLM, constrained: int, batch: int, repeats: int = 50) -> float:
    """Median ms to fill and apply the bitmask of `constrained` rows of [batch, vocab] logits."""
    eng = llm.engine
    grammar = grammar_of(StructuredOutputsParams(json=LONG_JSON))
    matchers = [eng.grammars.matcher(grammar) for _ in range(constrained)]
    prefix = eng.tokenizer.encode('{"items": ["apple", "pear", "', add_special_tokens=False)
    for m in matchers:
        assert m.consume_tokens(prefix), m.get_error()
    vocab = eng.model_config.vocab_size
    times = []
    for _ in range(repeats):
        logits = torch.randn(batch, vocab)
        t = time.perf_counter()
        rows = logits[:constrained]
        apply_bitmask(rows, fill_bitmask(matchers, vocab))
        logits[:constrained] = rows
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def compile_ms(llm: LLM) -> tuple[float, float]:
    eng = llm.engine
    compiler = GrammarCompiler(eng.tokenizer.fast.to_str(), eng.model_config.vocab_size, tuple(eng.eos_token_ids))
    _ = compiler.tokenizer  # built once per process (~1 s); not part of a grammar's compile time
    grammar = grammar_of(StructuredOutputsParams(json=WIDE_JSON))
    t = time.perf_counter()
    compiler.matcher(grammar)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    compiler.matcher(grammar)
    return cold * 1000, (time.perf_counter() - t) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--constrained", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    decode_step_ms(llm, args.constrained, args.batch, 8, 0)  # warm-up: graphs, grammar cache, oneDNN primitives
    plain, masked = [], []
    for r in range(args.rounds):
        plain.append(decode_step_ms(llm, 0, args.batch, args.tokens, 100 * r))
        masked.append(decode_step_ms(llm, args.constrained, args.batch, args.tokens, 100 * r))
        print(f"round {r + 1}: unconstrained {plain[-1]:.1f} ms, {args.constrained} constrained {masked[-1]:.1f} ms "
              f"({masked[-1] / plain[-1]:.3f}x)", flush=True)
    a, b = statistics.median(plain), statistics.median(masked)
    print(f"\ndecode step at batch {args.batch} ({args.dtype}): unconstrained {a:.1f} ms, with {args.constrained} JSON-constrained "
          f"rows {b:.1f} ms: {b / a:.3f}x (target <= 1.10x)")
    m = mask_ms(llm, args.constrained, args.batch)
    print(f"the mask alone: {m:.2f} ms per step for {args.constrained} rows = {(a + m) / a:.3f}x of the unconstrained step")
    cold, cached = compile_ms(llm)
    print(f"compile of a 20-property JSON schema: cold {cold:.1f} ms, cached {cached:.2f} ms")


if __name__ == "__main__":
    main()
