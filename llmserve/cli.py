"""`llmserve serve | generate | make-model | quantize | profile | bench` — the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from llmserve.config import EngineConfig, RayConfig, ServerConfig, add_arguments, from_sources
from llmserve.errors import LLMServeError
from llmserve.extras import require


def _serve(args: argparse.Namespace) -> int:
    engine, server, ray = (from_sources(cls, args) for cls in (EngineConfig, ServerConfig, RayConfig))
    if ray.ray:
        require("ray.serve", "ray", "llmserve serve --ray")
        from llmserve.ray_serve.app import run_ray

        return run_ray(engine, server, ray)
    from llmserve.server.app import run_server

    return run_server(engine, server)


def _generate(args: argparse.Namespace) -> int:
    from llmserve.engine.llm import LLM
    from llmserve.sampling import SamplingParams

    config = from_sources(EngineConfig, args)
    llm = LLM(**{k: getattr(config, k) for k in config.__slots__})
    prompt = args.prompt
    if args.chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed)

    def show(o):
        sys.stdout.write(o.new_text)
        sys.stdout.flush()

    out = llm.generate([ids], params, on_output=show)[0]
    sys.stdout.write(f"\n[finish_reason={out.finish_reason} tokens={len(out.token_ids)}]\n")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from llmserve.model.presets import make_model

    print(make_model(args.preset, args.out, seed=args.seed))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from llmserve.profile_cmd import run_profile

    return run_profile(args)


def _bench_serve(args: argparse.Namespace) -> int:
    require("aiohttp", "bench", "llmserve bench serve")
    if args.plot:
        require("matplotlib", "bench", "--plot")
    from llmserve.bench.serve import run_bench

    return run_bench(args)


def _quantize(args: argparse.Namespace) -> int:
    from llmserve.model.config import ModelConfig
    from llmserve.model.loader import read_weights, weight_files
    from llmserve.model.quantize import quantize_checkpoint, save_quantized
    from llmserve.model.resolve import resolve_model

    src = resolve_model(args.model)
    cfg = ModelConfig.from_file(src / "config.json")
    files = weight_files(src)
    tensors, formats = quantize_checkpoint(read_weights(files, cfg), args.format, cfg.tie_word_embeddings)
    out = save_quantized(src, args.out, tensors, formats)
    before = sum(f.stat().st_size for f in files)
    after = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({args.format}): weights {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the HTTP server")
    add_arguments(s, EngineConfig)
    add_arguments(s, ServerConfig)
    add_arguments(s, RayConfig)
    s.set_defaults(func=_serve)

    g = sub.add_parser("generate", help="generate from one prompt, printing tokens as they come")
    g.add_argument("prompt")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_arguments(g, EngineConfig)
    g.set_defaults(func=_generate)

    m = sub.add_parser("make-model", help="write a seeded random-weight model folder from a preset")
    m.add_argument("preset")
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_make_model)

    from llmserve.bench.args import add_bench_arguments
    from llmserve.profile_cmd import add_profile_arguments

    pr = sub.add_parser("profile", help="profile the engine in process on a synthetic workload")
    add_profile_arguments(pr)
    pr.set_defaults(func=_profile)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="load-test any OpenAI-compatible server (like `vllm bench serve`)")
    add_bench_arguments(bs)
    bs.set_defaults(func=_bench_serve)
    q = sub.add_parser("quantize", help="write a block-quantized checkpoint (Q8_0 or Q4_1 layout) that llmserve serves as stored")
    q.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    q.add_argument("--out", required=True)
    q.add_argument("--format", choices=("int8", "int4"), default="int8",
                   help="int8: a float16 scale per 32 weights (Q8_0); int4: a scale and a minimum per 32 (Q4_1)")
    q.set_defaults(func=_quantize)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (getattr(args, "log_level", None) or "info").upper()
    if getattr(args, "verbose", None) is False:
        level = "WARNING"  # a load test's output is its progress bar and tables; --verbose shows library logs
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except LLMServeError as e:  # a clear message, no stack trace
        print(f"llmserve: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
