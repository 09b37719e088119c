"""llmserve on a GPU, side by side with transformers.generate on the same device, in one run.

1. The device: copy bandwidth (read plus write) and a bf16 matmul rate.
2. SmolLM2-135M's shape (seeded random weights), bf16: one sequence of 128 in / 256 out, and
   --num-requests requests of 128 in / 128 out all at once, through llmserve's offline LLM;
   transformers.generate (eager, dynamic cache) at batch 1 and at batch 32.
Prints one table and writes it as JSON (--json). `--device cpu --quick` is a dry run of the script
itself on a machine without a GPU (small sizes; its figures mean nothing).
Usage: python scripts/bench_gpu.py [--device cuda] [--json OUT.json] [--num-requests 256] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.presets import make_model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Best seconds of `reps` calls (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def device_rates(device: str, quick: bool) -> dict[str, float]:
    n = (64 << 20) if quick else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, 5)
    m = 512 if quick else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = timed(lambda: a @ b, device, 5)
    return {"copy_GBps": 2 * n / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / mm_s / 1e12}


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def ours(llm: LLM, ps: list[list[int]], out_len: int, device: str) -> float:
    """Output tok/s of LLM.generate over all of `ps` at once (a warm-up run first)."""
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    warm = prompts(2, len(ps[0]), llm.engine.model_config.vocab_size, seed=99)  # not a prefix-cache hit for `ps`
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(ps, params)
    sync(device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def hf(model, ps: list[list[int]], out_len: int, device: str) -> float:
    """Output tok/s of transformers.generate on equal-length prompts, one batch."""
    ids = torch.tensor(ps, device=device)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        sync(device)
        t = time.perf_counter()
        model.generate(ids, **kw)
        sync(device)
    return len(ps) * out_len / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes: a dry run of the script")
    args = ap.parse_args()
    dev, quick = args.device, args.quick
    in_len, one_out, many_out = (16, 16, 8) if quick else (128, 256, 128)
    n = 4 if quick else args.num_requests
    rows: dict[str, float] = device_rates(dev, quick)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model("tiny" if quick else "smollm2-135m-shape", Path(tmp) / "m", dtype="bfloat16")
        dtype = "float32" if dev == "cpu" else "bfloat16"
        llm = LLM(str(path), device=dev, dtype=dtype, max_num_seqs=max(n, 1), max_num_batched_tokens=2048)
        vocab = llm.engine.model_config.vocab_size
        rows["llmserve_1x_tok_s"] = ours(llm, prompts(1, in_len, vocab), one_out, dev)
        rows[f"llmserve_{n}x_tok_s"] = ours(llm, prompts(n, in_len, vocab, 1), many_out, dev)
        del llm
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(dev)
        rows["transformers_1x_tok_s"] = hf(model, prompts(1, in_len, vocab), one_out, dev)
        rows["transformers_32x_tok_s"] = hf(model, prompts(min(n, 32), in_len, vocab, 1), many_out, dev)
    rows["llmserve_1x_over_transformers"] = rows["llmserve_1x_tok_s"] / rows["transformers_1x_tok_s"]
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    print(f"bench_gpu on {name} ({time.strftime('%Y-%m-%d')}):")
    for key, value in rows.items():
        print(f"  {key:<32} {value:12.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": name, **rows}, indent=1))


if __name__ == "__main__":
    main()
