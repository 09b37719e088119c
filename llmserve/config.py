"""Configuration records. CLI flags and LLMSERVE_* environment variables are read here, once.

Every EngineConfig/ServerConfig field is a `llmserve serve` flag (`max_num_seqs` -> `--max-num-seqs`)
and an environment variable (`LLMSERVE_MAX_NUM_SEQS`); flags win over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from dataclasses import dataclass, field, fields
from typing import Any

from llmserve.errors import InvalidRequestError


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class EngineConfig:
    model: str | None = _opt(None, "HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    served_model_name: str | None = _opt(None, "model name reported by the API (default: derived from --model)")
    device: str = _opt("auto", "where the model runs (auto: cpu until the CUDA path has been checked on a GPU; cuda: Triton attention, eager)", ("auto", "cpu", "cuda"))
    dtype: str = _opt("auto", "weights and activations dtype (auto: bfloat16 on a GPU and where the CPU computes it "
                      "natively, AVX-512 BF16 or AMX; float32 elsewhere)", ("auto", "float32", "bfloat16"))
    kv_cache_dtype: str = _opt("auto", "KV cache dtype (auto: the weights' dtype; where auto chose float32 weights, "
                               "whichever of float32 and bfloat16 measures faster here)", ("auto", "float32", "bfloat16"))
    block_size: int = _opt(16, "tokens per KV cache block")
    num_blocks: int | None = _opt(None, "KV cache size in blocks (overrides --kv-cache-memory)")
    kv_cache_memory: int | None = _opt(None, "KV cache size in bytes (default: 2 GiB on the CPU; on a GPU, "
                                       "--gpu-memory-utilization of its memory less what the model holds)")
    gpu_memory_utilization: float = _opt(0.9, "share of the GPU's memory the engine may use: weights, KV cache, "
                                         "activations (--device cuda)")
    max_num_seqs: int = _opt(64, "most sequences in one batch")
    max_num_batched_tokens: int = _opt(512, "token budget of one engine step (chunked prefill)")
    scheduling_policy: str = _opt("fcfs", "fcfs: first come, first served; priority: by each request's priority "
                                  "(lower first, ties by arrival), preempting the worst running request for a better one",
                                  ("fcfs", "priority"))
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    attention_backend: str = _opt(
        "auto", "decode attention: native C++ kernel (auto: when it builds here) or pure torch", ("auto", "torch"))
    compile: str = _opt(
        "auto", "compiled execution (auto: inductor where it measured faster; see the execution plan in the log)",
        ("auto", "none", "inductor", "tensorrt"))
    fused_layers: str = _opt(
        "auto", "compiled steps without LoRA adapters run each decoder layer as one native op (auto: with the native "
        "kernels); off runs its modules' ops", ("auto", "off"))
    enforce_eager: bool = _opt(False, "never run CUDA graphs: every step eager (--device cuda; the plan's "
                               "cudagraph_mode says so on the CPU too, where steps never run them)")
    quantize: str | None = _opt(None, "weight-only quantization of the linear layers, blocks of 32 along K: int8 (Q8_0 "
                                "layout), int4 (Q4_1); none dequantizes (default: as the checkpoint stores them, so a "
                                "GGUF file's Q8_0/Q4_0/Q4_1 weights are served as shipped)", ("none", "int8", "int4"))
    quant_large_steps: str = _opt(
        "auto", "block-quantized layers' steps of more rows than the quantized GEMV takes (prefill, large batches): "
        "packed runs a oneDNN-packed float copy of the weights (more memory), tiles dequantizes tiles into cache "
        "for each step (auto: packed where it measured faster and the copy costs at most a quarter of the RAM)",
        ("auto", "packed", "tiles"))
    seed: int = _opt(0, "seed of the engine's default random generator")
    num_threads: int | None = _opt(None, "torch intra-op threads (default: torch's choice)")
    speculative_method: str | None = _opt(None, "speculative decoding: ngram (prompt lookup; off by default)", ("ngram",))
    num_speculative_tokens: int = _opt(4, "draft tokens verified per step (speculative decoding)")
    prompt_lookup_min: int = _opt(2, "shortest suffix n-gram looked up in the sequence (speculative decoding)")
    prompt_lookup_max: int = _opt(4, "longest suffix n-gram looked up in the sequence (speculative decoding)")
    speculative_max_batch: int = _opt(8, "no speculation while more sequences than this run (compute-bound)")
    enable_lora: bool = _opt(False, "serve LoRA adapters over the base model (--lora-modules, or loaded at run time)")
    max_loras: int = _opt(4, "most distinct LoRA adapters in one batch")
    max_lora_rank: int = _opt(16, "largest LoRA rank served")
    max_cpu_loras: int | None = _opt(None, "LoRA adapters kept in memory, least recently used dropped (default: --max-loras)")
    redis_url: str | None = _opt(None, "Redis URL for the shared response cache and KV tier")
    redis_timeout: float = _opt(0.05, "seconds before a Redis call gives up (it counts as a miss)")


@dataclass(slots=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: str | None = _opt(None, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but /health")
    max_waiting: int = _opt(256, "most requests waiting for the engine before 429")
    max_waiting_tokens: int | None = _opt(None, "most prompt tokens waiting before 429")
    max_request_bytes: int = _opt(1 << 20, "largest request body accepted (413 above)")
    shutdown_timeout: float = _opt(30.0, "seconds in-flight streams may finish after SIGTERM")
    response_cache: bool = _opt(True, "cache whole responses of deterministic requests")
    response_cache_ttl: int = _opt(3600, "response cache TTL in seconds")
    response_cache_bytes: int = _opt(64 << 20, "in-process response cache bound in bytes")
    response_store_size: int = _opt(10000, "most stored /v1/responses kept in process (store: true; in Redis with --redis-url)")
    response_store_bytes: int = _opt(64 << 20, "in-process bound in bytes of the stored /v1/responses")
    embedding_backend: str = _opt("onnxruntime", "how the embedding model runs (/v1/embeddings, semantic cache)", ("onnxruntime", "torch"))
    semantic_cache: bool = _opt(False, "answer a question asked again in other words from the response cache")
    semantic_threshold: float = _opt(0.80, "least cosine of two questions for a semantic hit (their key terms must match too)")
    semantic_cache_size: int = _opt(10000, "most semantic cache entries (questions) kept")
    playground: bool = _opt(True, "serve the browser playground and dashboard at / and /dashboard")
    lora_modules: list[str] | None = _opt(None, "LoRA adapters to serve (with --enable-lora): name=path, or JSON "
                                          '{"name": ..., "path": ..., "base_model_name": ...}; several, space-separated '
                                          "(quoted as in a shell, in the environment variable)")
    allow_runtime_lora: bool = _opt(False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora)")
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))


@dataclass(slots=True)
class RayConfig:
    """`llmserve serve --ray`: the server as a Ray Serve application (llmserve/ray_serve/)."""

    ray: bool = _opt(False, "serve on Ray Serve: one ingress, engine replicas behind it (pip install 'llmserve[ray]')")
    ray_address: str | None = _opt(None, "Ray cluster to join (default: $RAY_ADDRESS, else a local Ray instance for this command)")
    ray_dashboard_port: int | None = _opt(None, "the local Ray instance's dashboard, on 127.0.0.1 (with ray[default] "
                                          "installed; `ray list actors` needs it); default: Ray's 8265, or the next "
                                          "free port; 0: none")
    num_replicas: int = _opt(1, "engine replicas (--ray)")
    min_replicas: int | None = _opt(None, "autoscale engine replicas from this many (--ray; with --max-replicas)")
    max_replicas: int | None = _opt(None, "autoscale engine replicas up to this many on ongoing requests (--ray)")
    target_ongoing_requests: int = _opt(16, "ongoing requests per engine replica the autoscaler aims at (--ray)")
    replica_cpus: float = _opt(1.0, "CPUs Ray reserves for each engine replica; its torch threads default to this (--ray)")
    request_router: str = _opt("prefix", "how the ingress picks an engine replica (--ray): prefix-aware, or Ray's "
                               "default (the less loaded of two random replicas)", ("prefix", "default"))
    router_prefix_blocks: int = _opt(4, "leading KV blocks of a prompt that key the prefix-aware router (--ray)")
    router_imbalance: int = _opt(32, "the prefix-aware router ignores the prefix when the preferred replica has this many "
                                 "more ongoing requests than the least loaded (--ray)")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _field_type(f: dataclasses.Field) -> type:
    t = str(f.type)
    if t.startswith("list"):
        return list
    if t.startswith("bool"):
        return bool
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field; defaults come from the environment, then the dataclass."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(f)
        help_ = f.metadata.get("help", "")
        if typ is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typ is list:
            parser.add_argument(flag, dest=f.name, nargs="+", default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=typ, default=None, choices=f.metadata.get("choices"), help=help_)


def from_sources(cls: type, args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **overrides: Any):
    """Build `cls` from defaults < LLMSERVE_* environment < CLI args < keyword overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in fields(cls):
        raw = env.get("LLMSERVE_" + f.name.upper())
        if raw is not None and raw != "":
            typ = _field_type(f)
            try:
                values[f.name] = _parse_bool(raw) if typ is bool else shlex.split(raw) if typ is list else typ(raw)
            except ValueError as e:
                raise InvalidRequestError(f"LLMSERVE_{f.name.upper()}: {e}") from None
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    names = {f.name for f in fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown {cls.__name__} option(s): {', '.join(sorted(unknown))}")
    values.update(overrides)
    return cls(**values)
