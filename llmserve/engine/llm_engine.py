"""LLMEngine: step() = schedule -> run the model on one mixed batch -> update requests. The
offline LLM and `llmserve profile` drive it in process; EngineCore (engine/engine_core.py) drives
it in the engine-core process.

Not thread-safe: one thread drives it (the engine-core process's loop, or LLM.generate).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo, make_core_request
from llmserve.engine.block_manager import KVCacheManager
from llmserve.engine.cpu_runtime import bound_onednn_caches, keep_large_allocations
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.model_runner import ModelRunner, RunnerOutput, kv_bytes_per_block
from llmserve.engine.outputs import EngineStats, RequestOutput
from llmserve.engine.request import Request, RequestStatus, Timeline
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmserve.engine.spec_decode import NgramProposer, SpecConfig
from llmserve.errors import InvalidRequestError
from llmserve.lora.layers import num_slots
from llmserve.lora.manager import LoRAManager, base_shapes
from llmserve.lora.request import LoRARequest
from llmserve.memory import memory_stats
from llmserve.model.compile import check_tensorrt
from llmserve.model.config import ModelConfig
from llmserve.model.loader import fingerprint, load_model
from llmserve.model.quantize import weight_formats
from llmserve.plan import plan_for
from llmserve.profiling import StepRecord
from llmserve.sampling import SamplingParams
from llmserve.structured import COMPILE_TIMEOUT_S, GrammarCompiler, grammar_of
from llmserve.tokenizer import Tokenizer, eos_token_ids, read_generation_config

logger = logging.getLogger("llmserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from llmserve.model.resolve import resolve_model

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_large_allocations()
        bound_onednn_caches()
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_file(self.model_dir / "config.json")
        # decided before the (slow) model load, so a refusal comes at once
        self.plan = plan_for(config, self.model_config)
        logger.info("%s", self.plan.describe())
        if self.plan.compile.value == "tensorrt":
            check_tensorrt()
        self.dtype, self.kv_dtype = self.plan.torch_dtype, self.plan.kv_torch_dtype
        self.device = self.plan.torch_device
        weights = self.plan.weights.value
        self.model = load_model(self.model_dir, self.dtype, "none" if weights == "float" else config.quantize).to(self.device)
        self.tokenizer = Tokenizer(self.model_dir)
        self.generation_config = read_generation_config(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.generation_config)
        self.max_model_len = min(config.max_model_len or 1 << 30, self.model_config.max_position_embeddings)
        dtype, kv_dtype = self.plan.dtype.value, self.plan.kv_cache_dtype.value
        kv = "" if kv_dtype == dtype else f"-kv-{kv_dtype}"  # outputs and KV blocks differ with the cache's dtype
        on = "" if self.device.type == "cpu" else f"-{self.device.type}"  # and with the device's kernels
        # the weights' format keys prefix blocks, the Redis KV tier and the response cache
        self.fingerprint = f"{fingerprint(self.model_dir)}-{dtype}-{weight_formats(self.model)}{kv}{on}"
        num_blocks = self._num_blocks()
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            namespace=f"{self.fingerprint}:{config.block_size}",
        )
        self.proposer = self._proposer(config)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.proposer, self.max_model_len,
                                   config.scheduling_policy, config.max_loras if config.enable_lora else 0)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.kv_dtype, config.seed, self.device)
        self.lora = self._lora_manager(config)
        self.runner.lora = self.lora
        self.runner.setup_execution(self.plan)
        self.kv_store = self._connect_kv_store(config)
        self.info = EngineInfo(
            self.model_name, str(self.model_dir), self.fingerprint, self.model_config.vocab_size, self.max_model_len,
            config.block_size, self.kv.pool.num_usable, tuple(self.eos_token_ids), os.getpid(), self.plan.as_dict(),
            config.scheduling_policy, config.max_loras if config.enable_lora else 0, config.max_lora_rank,
            base_shapes(self.model_config) if config.enable_lora else None,
        )
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.pending: list[RequestOutput] = []  # abort outputs, returned by the next step
        self.grammars = GrammarCompiler(self.tokenizer.fast.to_str(), self.model_config.vocab_size, tuple(self.eos_token_ids))
        self.compiling: list[tuple[Request, Future]] = []  # structured requests whose matcher is being built
        self._grammar_pool: ThreadPoolExecutor | None = None
        self.step_records: deque[StepRecord] = deque(maxlen=100_000)
        self._detok_s = 0.0  # this step's detokenization time, summed by _append
        self.num_steps = 0

    def close(self) -> None:
        """Send (or drop, counted and logged) the Redis tier's queued writes and close its
        connections. Idempotent; the engine takes no requests afterwards."""
        if self.kv.connector is not None:
            self.kv.connector.close()  # after any load in flight (bounded by its budget)
        if self.kv_store is not None:
            self.kv_store.close()
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect_kv_store(self, config: EngineConfig):
        """The Redis tier behind the local prefix cache, when --redis-url is set."""
        if not (config.redis_url and config.enable_prefix_caching):
            return None
        from llmserve.cache.kv_store import KVConnector, RedisKVStore

        c = self.model_config
        shape = (c.num_hidden_layers, 2, config.block_size, c.num_key_value_heads, c.head_dim)
        namespace = self.kv.namespace.replace(":", "-")
        store = RedisKVStore(config.redis_url, namespace, shape, self.kv_dtype, timeout_s=config.redis_timeout)
        self.kv.connector = KVConnector(store, self.runner.kv_caches)
        return store

    def _lora_manager(self, config: EngineConfig) -> LoRAManager | None:
        """--enable-lora: adapter slots beside every linear layer (before the step graph compiles)."""
        if not config.enable_lora:
            return None
        if config.max_loras < 1 or config.max_lora_rank < 1:
            raise InvalidRequestError("--max-loras and --max-lora-rank must be at least 1", "max_loras")
        slots = self.model.enable_lora(num_slots(config.max_loras), config.max_lora_rank)
        return LoRAManager(slots, base_shapes(self.model_config), config.max_loras, config.max_cpu_loras or config.max_loras,
                           config.max_lora_rank)

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        running, waiting = self.scheduler.lora_counts()
        return {"running": running, "waiting": waiting, "max_lora": self.config.max_loras}

    @staticmethod
    def _proposer(config: EngineConfig) -> NgramProposer | None:
        if config.speculative_method != "ngram":
            return None
        return NgramProposer(SpecConfig(config.num_speculative_tokens, config.prompt_lookup_min,
                                        config.prompt_lookup_max, config.speculative_max_batch))

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.config.model and Path(self.config.model).name or "SmolLM2-135M-Instruct"

    def _num_blocks(self) -> int:
        c = self.config
        per_block = kv_bytes_per_block(self.model_config, c.block_size, self.kv_dtype)
        useful = c.max_num_seqs * -(-self.max_model_len // c.block_size)  # enough for every slot full
        n = c.num_blocks or max(2, min(self._kv_cache_memory() // per_block, useful + 1))
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            n - 1, c.block_size, (n - 1) * c.block_size, n * per_block / 2**20, self.plan.kv_cache_dtype.value,
        )
        return n

    def _kv_cache_memory(self) -> int:
        """Bytes for the KV cache: --kv-cache-memory, else 2 GiB on the CPU; on a GPU, the
        --gpu-memory-utilization share of its memory less what is in use (the weights) and a
        reserve for one step's activations and logits."""
        c = self.config
        if c.kv_cache_memory is not None:
            return c.kv_cache_memory
        if self.device.type != "cuda":
            return 2 << 30
        if not 0 < c.gpu_memory_utilization <= 1:
            raise InvalidRequestError(f"--gpu-memory-utilization {c.gpu_memory_utilization}: expected a share in (0, 1]")
        free, total = torch.cuda.mem_get_info(self.device)
        width = self.model_config.hidden_size * 16 + self.model_config.vocab_size * 2  # fp32 activations, logits
        reserve = c.max_num_batched_tokens * width * 4 + (256 << 20)
        budget = int(total * c.gpu_memory_utilization) - (total - free) - reserve
        if budget <= 0:
            raise InvalidRequestError(f"--gpu-memory-utilization {c.gpu_memory_utilization}: no GPU memory is left for "
                                      f"the KV cache ({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use)")
        return budget

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate (typed errors, a grammar that does not compile among them) and queue a
        request; the live Request, for in-process callers."""
        arrival = time.time() if arrival_time is None else arrival_time
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        return self.add(make_core_request(self.info, request_id, prompt_token_ids, params, arrival, priority, lora_request))

    def add(self, core: EngineCoreRequest) -> Request:
        """Queue a request already checked against self.info (make_core_request). Its adapter is
        read now, if it is not in memory yet: one that cannot be read is a typed error here."""
        lora, adapter = core.lora_request, None
        if lora is not None:  # the request holds the weights read now; its blocks are keyed by their hash
            adapter = self.lora.adapter(lora)  # type: ignore[union-attr]
            lora = dataclasses.replace(lora, content_hash=adapter.content_hash)
        req = Request(core.request_id, core.prompt_token_ids, core.sampling_params, core.max_tokens,
                      self.eos_token_ids, Timeline(core.arrival_time), priority=core.priority, lora_request=lora,
                      lora_adapter=adapter)
        self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params)
        so = req.sampling_params.structured_outputs
        if so is None:
            self.scheduler.add_request(req)
        else:  # scheduled once its matcher is built, off the step loop
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="llmserve-grammar")
            self.compiling.append((req, self._grammar_pool.submit(lambda: self.grammars.matcher(grammar_of(so)))))
        return req

    def _admit_compiled(self) -> None:
        """Structured requests whose matcher is ready go to the scheduler; a grammar that fails
        (or takes over COMPILE_TIMEOUT_S) ends its request."""
        still = []
        for req, fut in self.compiling:
            if not fut.done() and time.time() - req.timeline.arrival < COMPILE_TIMEOUT_S:
                still.append((req, fut))
                continue
            error = "the grammar took too long to compile" if not fut.done() else None
            if error is None:
                try:
                    req.matcher = fut.result()
                    error = req.matcher.get_error() if req.matcher.is_error() else None
                except Exception as e:  # checked before it came here: not expected
                    error = getattr(e, "message", str(e))
            if error is None:
                self.scheduler.add_request(req)
            else:
                logger.warning("request %s: structured output unavailable: %s", req.request_id, error)
                req.status, req.stop_reason = RequestStatus.FINISHED_ABORTED, error
                self.pending.append(self._output(req, [], "", [], time.time()))
                self._forget(req.request_id)
        self.compiling = still

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        else:  # maybe still waiting for its grammar
            req = next((r for r, _ in self.compiling if r.request_id == request_id), None)
            if req is None:
                return
            self.compiling = [(r, f) for r, f in self.compiling if r is not req]
            req.status = RequestStatus.FINISHED_ABORTED
        self.pending.append(self._output(req, [], "", [], time.time()))
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending or self.compiling)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        start = time.time()
        if self.compiling:
            self._admit_compiled()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        outputs, self.pending = self.pending, []
        if sched.empty:  # nothing to run but grammars being built or prefixes loading: do not spin
            if self.compiling:
                wait([f for _, f in self.compiling], timeout=0.005, return_when=FIRST_COMPLETED)
            elif self.scheduler.loading and self.kv.connector is not None:
                self.kv.connector.wait(0.005)
            return outputs
        run = self.runner.execute(sched)
        t2 = time.perf_counter()
        new, detok_s = self._update(sched, run)
        outputs += new
        self._record(start, sched, run, t1 - t0, time.perf_counter() - t2 - detok_s, detok_s)
        return outputs

    def _update(self, sched: SchedulerOutput, run: RunnerOutput) -> tuple[list[RequestOutput], float]:
        """Append sampled tokens, detokenize, check stops; (outputs, seconds spent detokenizing)."""
        self.scheduler.advance(sched)
        now = time.time()
        outputs = []
        self._detok_s = 0.0
        for s in sched.scheduled:
            sampled = run.sampled.get(s.request.request_id)
            if sampled is not None:  # None: a prefill chunk that has not reached the end yet
                outputs.append(self._append(s, *sampled, now))
        return outputs, self._detok_s

    def _append(self, s: ScheduledRequest, tokens: list[int], lps: list, now: float) -> RequestOutput:
        """One row's new tokens (several when drafts were accepted), each checked for a stop as
        if it came alone: the first stop drops the rest."""
        req, detok = s.request, self.detokenizers[s.request.request_id]
        emitted, text = [], ""
        for token, lp in zip(tokens, lps, strict=True):
            req.append_output_token(token)
            if req.matcher is not None:
                req.matcher.consume_token(token)
            if lp is not None:
                req.logprobs.append(lp)
            req.timeline.token_times.append(now)
            emitted.append(token)
            t = time.perf_counter()
            text += detok.add_token(token)
            self._detok_s += time.perf_counter() - t
            status = self._check_stop(req, token, detok)
            if status is not None:
                text += detok.flush()
                self.scheduler.finish(req, status)
                self._forget(req.request_id)
                break
        if s.spec_token_ids:
            self.proposer.record(req.request_id, len(s.spec_token_ids), len(tokens) - 1)  # type: ignore[union-attr]
            if not req.status.finished:  # the last known token and the accepted drafts now have K/V
                self.scheduler.commit(req, len(tokens))
        return self._output(req, emitted, text, [lp for lp in lps[: len(emitted)] if lp is not None], now)

    def _check_stop(self, req: Request, token: int, detok: IncrementalDetokenizer) -> RequestStatus | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if detok.stop_string is not None:
            req.stop_reason = detok.stop_string
            return RequestStatus.FINISHED_STOPPED
        if req.matcher is not None:
            if req.matcher.is_error():  # a parser limit hit mid-way (masked tokens never break it)
                req.stop_reason = f"structured output failed: {req.matcher.get_error()}"
                logger.warning("request %s: %s", req.request_id, req.stop_reason)
                return RequestStatus.FINISHED_ABORTED
            if req.matcher.is_stopped():  # the structure is complete
                return RequestStatus.FINISHED_STOPPED
        if n_out >= p.min_tokens:
            if token in req.eos_token_ids and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.runner.sampler.forget(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def _output(self, req: Request, tokens: list[int], text: str, lps: list, now: float) -> RequestOutput:
        """A copied record: prompt logprobs ride on the first token, the timeline on the last."""
        n_out = len(req.output_token_ids)
        first = bool(tokens) and n_out == len(tokens)
        prompt_lps = list(req.prompt_logprobs) if first and req.sampling_params.prompt_logprobs is not None else None
        tl = req.timeline
        timeline = Timeline(tl.arrival, tl.first_scheduled, list(tl.token_times), tl.finished) if req.status.finished else None
        return RequestOutput(
            req.request_id, tokens, text, lps, req.status.finished, req.finish_reason, req.stop_reason,
            req.num_prompt_tokens, n_out, req.num_cached_tokens, now, prompt_lps, timeline,
        )

    def _record(
        self, start: float, sched: SchedulerOutput, run: RunnerOutput, schedule_s: float, update_s: float, detok_s: float
    ) -> None:
        self.num_steps += 1
        record = StepRecord(start, sched.num_prefill_tokens, sched.num_decode_seqs, schedule_s,
                            run.prepare_s, run.forward_s, run.sample_s, update_s, detok_s)
        self.step_records.append(record)
        if self.proposer is not None and sched.num_prefill_tokens == 0:  # what a decode row costs
            self.proposer.observe_step(sched.num_decode_seqs + sched.num_spec_tokens, record.duration_s)

    def get_stats(self, memory: bool = False) -> EngineStats:
        """The engine's figures; with `memory`, also the process's memory (mallinfo2 and /proc
        reads: for stats asked for, not for the per-step ones)."""
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_blocks_total=pool.num_usable,
            num_blocks_free=pool.num_free,
            num_blocks_used=pool.num_usable - pool.num_free,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            kv_store=self.kv_store.stats.as_dict() if self.kv_store else {},
            memory=memory_stats() if memory else {},
            spec_decode=self.proposer.stats.as_dict() if self.proposer else {},
            by_priority=self.scheduler.counts_by_priority(),
            lora=self._lora_stats(),
        )
