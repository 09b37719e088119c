"""Offline throughput: llmserve's LLM.generate vs transformers' generate vs a bare forward loop.

Workload (seeded): N requests, prompt lengths uniform in [32, 512], output lengths uniform in
[32, 256], ignore_eos. Everything runs in this one process, side by side, per dtype:
  1. transformers generate, one request at a time (on the first --hf-single requests)
  2. transformers generate, static batches of 16 with left padding (useful tokens counted)
  3. llmserve LLM.generate with all N at once
  4. a bare forward loop of our model doing the same work: the same prompt tokens as 512-token
     prefill forwards, and the same output tokens as decode steps at llmserve's average decode
     batch size and average context. No scheduler, sampler or detokenizer: the ceiling
Usage: python scripts/bench_offline.py [--model DIR] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention import AttentionMetadata, PrefillSeq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    return prompts, [rng.randint(32, 256) for _ in range(n)]


def hf_generate(model, prompts: list[list[int]], lens: list[int], pad_id: int) -> float:
    """Static batch with left padding; returns seconds. Every row runs max(lens) steps."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return time.perf_counter() - t


def bare_forward(llm: LLM, batch: int, context: int, prompt_tokens: int, output_tokens: int, steps: int = 20) -> float:
    """Output tokens/s of the model alone doing the workload's prefill and decode forwards."""
    model, runner = llm.engine.model, llm.engine.runner
    bs, chunk = runner.block_size, llm.engine.config.max_num_batched_tokens
    nblocks = runner.kv_caches[0].shape[1] - 1
    per_seq = -(-(context + 1) // bs)
    tables = (torch.arange(batch * per_seq) % nblocks + 1).reshape(batch, per_seq)
    slots = tables[:, context // bs] * bs + context % bs
    decode = AttentionMetadata(slots, batch, tables, torch.full((batch,), context + 1), [])
    table = torch.arange(1, -(-chunk // bs) + 1)
    prefill = AttentionMetadata(table.repeat_interleave(bs)[:chunk] * bs + torch.arange(chunk) % bs, 0,
                                torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                [PrefillSeq(0, chunk, chunk, table)])

    def timed(ids, pos, meta, reps: int) -> float:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, runner.kv_caches, meta)[-batch:]).argmax(-1)  # warm-up
            t = time.perf_counter()
            for _ in range(reps):
                model.compute_logits(model(ids, pos, runner.kv_caches, meta)[-batch:]).argmax(-1)
        return (time.perf_counter() - t) / reps

    step_s = timed(torch.randint(100, 1000, (batch,)), torch.full((batch,), context), decode, steps)
    chunk_s = timed(torch.randint(100, 1000, (chunk,)), torch.arange(chunk), prefill, 3)
    total_s = prompt_tokens / chunk * chunk_s + output_tokens / batch * step_s
    return output_tokens / total_s


def run(dtype: str, args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, dtype=dtype, max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens)
    prompts, lens = workload(args.num_requests, llm.engine.model_config.vocab_size, args.seed)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    llm.generate(prompts[:2], params[:2])  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
    decode = [r for r in llm.engine.step_records if r.num_prefill_tokens == 0 and r.num_decode_seqs]
    avg_batch = round(sum(r.num_decode_seqs for r in decode) / max(1, len(decode)))
    avg_ctx = int(sum(map(len, prompts)) / len(prompts) + sum(lens) / len(lens) / 2)
    ceiling = bare_forward(llm, avg_batch, avg_ctx, sum(map(len, prompts)), sum(lens))

    ref = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=DTYPES[dtype]).eval()
    pad = llm.tokenizer.eos_token_id or 0
    k = args.hf_single
    single = sum(lens[:k]) / sum(hf_generate(ref, [p], [n], pad) for p, n in zip(prompts[:k], lens[:k], strict=True))
    nb = args.hf_batches * 16
    batched = sum(lens[:nb]) / sum(hf_generate(ref, prompts[i:i + 16], lens[i:i + 16], pad) for i in range(0, nb, 16))
    return {"hf_single": single, "hf_batch16": batched, "llmserve": ours, "bare_forward": ceiling,
            "avg_decode_batch": avg_batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-single", type=int, default=6, help="requests measured one at a time (slow)")
    ap.add_argument("--hf-batches", type=int, default=2, help="static batches of 16 measured")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| dtype | (1) HF one-at-a-time | (2) HF batch 16 | (3) llmserve | (4) bare forward | (3)/(1) | (3)/(2) | (3)/(4) |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        r = run(dtype, args)
        print(f"| {dtype} | {r['hf_single']:.1f} | {r['hf_batch16']:.1f} | {r['llmserve']:.1f} | "
              f"{r['bare_forward']:.1f} (decode batch {r['avg_decode_batch']}) | {r['llmserve'] / r['hf_single']:.1f}x | "
              f"{r['llmserve'] / r['hf_batch16']:.2f}x | {r['llmserve'] / r['bare_forward']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
