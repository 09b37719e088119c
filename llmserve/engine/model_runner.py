"""ModelRunner: a SchedulerOutput -> flat tensors -> one forward pass -> sampled tokens.

Flat batch layout: decode tokens first (one per sequence), then each prefill chunk contiguously.
A decode with drafts (speculative decoding) is 1 + len(drafts) decode rows at consecutive
positions, all on its block table, row i seeing start + i + 1 tokens: all the rows' K/V are
written before attention, so the rows are causal among themselves, and the step stays a decode
batch (the native kernel, the compiled graph, the same numerics as a plain decode). Every one
of its rows is sampled (Sampler.verify).
KV cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (block 0 = null block).
On a GPU (the plan's device) the weights, the KV cache and the step's tensors live there; the
step is prepared on the host and copied over, and the sampled rows' logits come back to the
host sampler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from llmserve import kernels
from llmserve.engine.request import Request, TokenLogprobs
from llmserve.engine.sampler import Sampler, top_logprobs
from llmserve.engine.scheduler import SchedulerOutput
from llmserve.lora.layers import MIN_SLOTS, LoRABatch
from llmserve.lora.manager import LoRAManager
from llmserve.model.attention import AttentionMetadata, PrefillBatch, PrefillSeq
from llmserve.model.compile import StepGraph
from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.packed import pack_linears, pack_quantized_copies
from llmserve.model.quantize import use_native_quant
from llmserve.plan import ExecutionPlan

logger = logging.getLogger("llmserve.engine")


@dataclass(slots=True)
class LoRAInput:
    row_slots: torch.Tensor  # [T] the LoRA slot of each row, -1: the base model
    num_slots: int  # K: the step's adapters sit in slots [0, K)

    def batch(self, dtype: torch.dtype, widths: tuple[int, ...]) -> LoRABatch:
        return LoRABatch.of(self.row_slots, torch.arange(self.num_slots, device=self.row_slots.device), dtype, widths)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat index of the last token of each sampling sequence
    sample_requests: list[Request]
    prompt_rows: list[tuple[Request, int, int]]  # (request, flat index, next prompt token)
    spec_rows: list[tuple[Request, int, list[int]]] = field(default_factory=list)  # (request, first flat index, drafts)
    lora: LoRAInput | None = None  # the rows' adapters, when any row has one

    @property
    def logit_rows(self) -> list[int]:
        """The sampling rows, then every row of each verified decode."""
        return self.sample_rows + [q0 + i for _, q0, drafts in self.spec_rows for i in range(len(drafts) + 1)]


@dataclass(slots=True)
class RunnerOutput:
    # request id -> (new tokens: one, or with drafts the accepted ones and the correction; their logprobs)
    sampled: dict[str, tuple[list[int], list[TokenLogprobs | None]]] = field(default_factory=dict)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


def kv_bytes_per_block(c: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype, seed: int = 0,
                 device: torch.device | str = "cpu"):
        c = model.config
        self.device = torch.device(device)
        self.model = model
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        # torch.zeros writes every page now, so the whole cache is resident from start-up. A lazily
        # mapped cache (calloc) halved start-up RSS but cost about 30% of serving throughput at 32
        # streams: every fresh block then pays first-touch page faults on the step that writes it.
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(c.num_hidden_layers)
        ]
        self.sampler = Sampler(seed)
        self.step_graph: StepGraph | None = None  # set by setup_execution for --compile inductor
        self.float_copies: list = []  # quantized layers' packed float copies (plan.quant_large_steps packed)
        self.unified_attention = False  # every step's rows through llmserve::paged_attention (the Triton kernels)
        self.lora: LoRAManager | None = None  # --enable-lora: places each step's adapters in the model's slots

    def setup_execution(self, plan: ExecutionPlan) -> None:
        """Carry out the plan: the attention backend (and the native kernel's ISA variant), linear
        weights packed for oneDNN (int8 layers are left alone), and with `inductor` the step graph
        compiled over those same packed weights. tensorrt is refused before the model loads. On
        CUDA: the Triton kernels as the attention ops' CUDA implementations."""
        if plan.attention_backend.value == "triton":
            from llmserve.kernels.triton_attention import register_cuda_ops

            if plan.cudagraph_mode.value != "none":  # where a graph runner would capture (engine/cuda_graphs.py)
                raise NotImplementedError(f"cudagraph_mode {plan.cudagraph_mode.value}: the CUDA graph capture is not built")

            register_cuda_ops()
            self.model.use_native_attention(True)
            self.unified_attention = True
            return
        if plan.native:
            kernels.select_isa(plan.cpu_isa.value)
            kernels.set_gemv_prefetch(int(plan.gemv_prefetch.value))
            kernels.set_gemv_max_rows(int(plan.gemv_max_rows.value))
            kernels.set_quant_max_rows(int(plan.quant_max_rows.value))
        quantized = use_native_quant(self.model, plan.native)
        if quantized:
            logger.info("block-quantized linear layers (%s): %d", plan.weights.value, quantized)
        if plan.native and plan.quant_large_steps.value == "packed":  # before the graph compiles: it holds the handles
            self.float_copies = pack_quantized_copies(self.model, plan.torch_dtype)
            logger.info("block-quantized layers with a packed %s copy for large steps: %d", plan.dtype.value,
                        len(self.float_copies))
        self.model.use_native_attention(plan.native)
        self.model.use_native_lora(plan.native)
        linear = plan.linear_backend.value
        if linear.startswith("onednn-packed"):
            packed = pack_linears(self.model, plan.torch_dtype, plan.native, gemv=linear.endswith("+gemv"))
            logger.info("linear layers packed for oneDNN: %d", packed)
        if plan.fused_layers.value == "on":  # before the graph compiles: it holds the layers' handles
            logger.info("decoder layers fused into llmserve::decoder_layer: %d of %d", self.model.use_fused_layers(True),
                        len(self.model.layers))
        if plan.compile.value == "inductor":
            graph = StepGraph(self.model)
            logger.info("compiled step graph ready in %.1f s", graph.warm_up(self.kv_caches, lora=self.lora is not None))
            self.step_graph = graph

    def forward(self, inp: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden [T, hidden] or None, logits [len(logit_rows), vocab] fp32 or None). With a
        compiled graph every step runs it (logits only), except those that score prompt tokens,
        which need the hidden states."""
        g, rows = self.step_graph, inp.logit_rows
        if g is not None and not inp.prompt_rows:
            lora = (inp.lora.row_slots, inp.lora.num_slots) if inp.lora is not None else None
            logits = g(inp.input_ids, inp.positions, self.kv_caches, inp.meta, rows, lora)  # writes the cache even with no rows
            return None, logits if rows else None
        lora = inp.lora.batch(self.model.embed_tokens.weight.dtype, self.model.lora_widths) if inp.lora is not None else None
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, lora)
        logits = self.model.compute_logits(hidden[rows]) if rows else None
        return hidden, logits

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        decodes = [s for s in out.scheduled if s.num_tokens == 1 or s.spec_token_ids]
        prefills = [s for s in out.scheduled if s.num_tokens > 1 and not s.spec_token_ids]
        tables, seq_lens = [], []  # per decode row
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows, sample_reqs, prompt_rows, spec_rows = [], [], [], []
        prefill_seqs = []
        bs = self.block_size
        for s in decodes + prefills:
            start, n, req = s.num_computed_tokens, s.num_tokens, s.request
            q0 = len(ids)
            drafts = s.spec_token_ids
            ids.extend(req.all_token_ids[start : start + n - len(drafts)] + drafts)
            pos.extend(range(start, start + n))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1 or drafts:
                tables += [s.block_ids] * n
                seq_lens += range(start + 1, start + n + 1)
            else:
                table = torch.tensor(s.block_ids[: -(-(start + n) // bs)], dtype=torch.long)
                prefill_seqs.append(PrefillSeq(q0, n, start + n, table))
            if drafts:
                spec_rows.append((req, q0, drafts))
            elif s.samples:
                sample_rows.append(q0 + n - 1)
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None:
                # rows predicting prompt tokens not scored yet (a preempted request recomputes)
                first, last = max(start, len(req.prompt_logprobs) - 1), min(start + n, req.num_prompt_tokens - 1)
                prompt_rows += [(req, q0 + p - start, req.prompt_token_ids[p + 1]) for p in range(first, last)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_on(dev, slots),
            num_decodes=len(seq_lens),
            decode_block_tables=_pad_tables(tables).to(dev, non_blocking=True),
            decode_seq_lens=_on(dev, seq_lens),
            prefills=prefill_seqs,
        )
        if self.unified_attention:  # every row through the one Triton kernel
            meta.prefills, meta.prefill_batch = [], _prefill_batch(prefill_seqs, dev)
        lora = self._lora_input(decodes + prefills) if self.lora is not None else None
        return ModelInput(_on(dev, ids), _on(dev, pos), meta, sample_rows, sample_reqs, prompt_rows, spec_rows, lora)

    def _lora_input(self, scheduled: list) -> LoRAInput | None:
        """Each row's slot, with the step's adapters placed in the first slots; None when no row has one."""
        active = {s.request.lora_request.lora_int_id: s.request.lora_adapter for s in scheduled if s.request.lora_request is not None}
        if not active:
            return None
        slot_of = self.lora.prepare(active)  # type: ignore[union-attr]
        row_slots: list[int] = []
        for s in scheduled:
            lora = s.request.lora_request
            row_slots += [slot_of[lora.lora_int_id] if lora is not None else -1] * s.num_tokens
        return LoRAInput(_on(self.device, row_slots), max(MIN_SLOTS, len(active)))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        inp = self.prepare(out)
        t1 = time.perf_counter()
        hidden, logits = self.forward(inp)
        if logits is not None and logits.device.type != "cpu":
            logits = logits.cpu()  # the sampler runs on the host
        t2 = time.perf_counter()
        result = RunnerOutput(prepare_s=t1 - t0, forward_s=t2 - t1)
        if inp.prompt_rows:
            self._prompt_logprobs(hidden, inp.prompt_rows)
        if inp.sample_rows:
            s = self.sampler(logits[: len(inp.sample_rows)], inp.sample_requests)  # type: ignore[index]
            for req, tok, lp in zip(inp.sample_requests, s.token_ids, s.logprobs, strict=True):
                result.sampled[req.request_id] = ([tok], [lp])
        row = len(inp.sample_rows)
        for req, _, drafts in inp.spec_rows:
            result.sampled[req.request_id] = self.sampler.verify(logits[row : row + len(drafts) + 1], req, drafts)  # type: ignore[index]
            row += len(drafts) + 1
        result.sample_s = time.perf_counter() - t2
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
        logp = torch.log_softmax(self.model.compute_logits(hidden[[r[1] for r in rows]]), dim=-1).cpu()
        for i, (req, _, target) in enumerate(rows):
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first prompt token has no logprob
            req.prompt_logprobs.append(top_logprobs(logp[i], target, req.sampling_params.prompt_logprobs or 0))


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """[len(values)] int64 on `device` (built on the host, copied once)."""
    t = torch.tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _prefill_batch(chunks: list[PrefillSeq], device: torch.device) -> PrefillBatch:
    """The prefill chunks as the tensors of llmserve::paged_attention, on `device`."""
    starts, lens, contexts = ([getattr(p, f) for p in chunks] for f in ("query_start", "query_len", "context_len"))
    tables = _pad_tables([p.block_table.tolist() for p in chunks])
    return PrefillBatch(_on(device, starts), _on(device, lens), _on(device, contexts), tables.to(device, non_blocking=True))


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """[num_seqs, max_blocks] int64, padded with the null block 0."""
    width = max((len(t) for t in tables), default=1)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).reshape(len(tables), width)


