"""The Llama-family network (llama, mistral, qwen2) over KVCacheAttention.

Shapes: the batch is flat. input_ids/positions: [T]; hidden states: [T, hidden_size].
Weights are fused at load time: qkv_proj = [q; k; v], gate_up_proj = [gate; up].
With LoRA enabled (enable_lora), each fused linear has a LoRASlots beside it, and a step that
uses adapters passes a LoRABatch: its rows' deltas are added to the base linear's output.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.lora.layers import LoRABatch, LoRASlots
from llmserve.model.attention import AttentionMetadata, KVCacheAttention
from llmserve.model.config import ModelConfig
from llmserve.model.packed import PackedLinear
from llmserve.model.quantize import QuantLinear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, with llama3 rope scaling applied when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Rotary embeddings in the rotate-half layout used by Hugging Face checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, rope_inv_freq(cfg))  # [max_pos, hd/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per forward: cos, sin of shape [T, 1, head_dim] (shared by every layer)."""
        cos = self.cos[positions].repeat(1, 2)[:, None, :].to(dtype)
        sin = self.sin[positions].repeat(1, 2)[:, None, :].to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def with_lora(linear: nn.Module, slots: LoRASlots | None, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
    """linear(x), plus each row's adapter delta when the step has adapters."""
    y = linear(x)
    return y if lora is None or slots is None else slots(x, y, lora)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.hd, self.kvh * self.hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = KVCacheAttention(self.h, self.kvh, self.hd)
        self.qkv_lora: LoRASlots | None = None
        self.o_lora: LoRASlots | None = None

    def forward(self, x, rope, kv_cache, meta, lora=None):
        q, k, v = with_lora(self.qkv_proj, self.qkv_lora, x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = apply_rotary(q.view(t, self.h, self.hd), *rope)
        k = apply_rotary(k.view(t, self.kvh, self.hd), *rope)
        out = self.attn(q, k, v.view(t, self.kvh, self.hd), kv_cache, meta)
        return with_lora(self.o_proj, self.o_lora, out.reshape(t, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.gate_up_lora: LoRASlots | None = None
        self.down_lora: LoRASlots | None = None

    def forward(self, x, lora=None):
        gate, up = with_lora(self.gate_up_proj, self.gate_up_lora, x, lora).split(self.inter, dim=-1)
        return with_lora(self.down_proj, self.down_lora, F.silu(gate) * up, lora)


_LAYER_HANDLES = itertools.count(1)


def native_linear(linear: nn.Module) -> tuple[int, bool] | None:
    """(handle, quantized) of a linear layer that runs a native op by handle: llmserve::qlinear
    (QuantLinear) or llmserve::onednn_linear (PackedLinear); None for any other."""
    if not isinstance(linear, QuantLinear | PackedLinear) or not linear.native:
        return None
    return linear.handle, isinstance(linear, QuantLinear)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused = False  # compiled steps without adapters run llmserve::decoder_layer (fuse())
        self.fused_handle: int | None = None  # the layer's entry in that op's table, once registered

    def fuse(self) -> bool:
        """Register the layer with llmserve::decoder_layer, which then runs it in a compiled step
        without adapters as one op; False (and nothing registered) where a linear has no native
        handle or the layer cannot take the op."""
        attn, mlp = self.self_attn, self.mlp
        linears = [native_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        if None in linears or not attn.attn.native or self.input_layernorm.eps != self.post_attention_layernorm.eps:
            return False
        if norms[0].dtype not in (torch.float32, torch.bfloat16) or attn.hd % 2:
            return False
        handle = next(_LAYER_HANDLES) if self.fused_handle is None else self.fused_handle
        torch.ops.llmserve.decoder_layer_register(handle, norms[0].detach(), norms[1].detach(), self.input_layernorm.eps,
                                                  [h for h, _ in linears], [int(q) for _, q in linears], attn.h, attn.kvh,
                                                  attn.hd, attn.attn.scale)
        if self.fused_handle is None:
            weakref.finalize(self, torch.ops.llmserve.decoder_layer_release, handle)
        self.fused_handle, self.fused = handle, True
        return True

    def forward(self, x, rope, kv_cache, meta, lora=None):
        pb = meta.prefill_batch
        if self.fused and lora is None and pb is not None:  # a compiled step: the whole layer in one op
            t = x.shape[0]
            return torch.ops.llmserve.decoder_layer(
                x, rope[0].view(t, -1), rope[1].view(t, -1), kv_cache, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_seq_lens, pb.query_start, pb.query_len, pb.context_len, pb.block_tables, self.fused_handle)
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lora_slots: list[LoRASlots] = []  # set by enable_lora

    def use_native_attention(self, enabled: bool) -> None:
        """Decode attention and the KV-cache write through the native kernels (True) or pure torch."""
        for layer in self.layers:
            layer.self_attn.attn.native = bool(enabled)

    def use_fused_layers(self, enabled: bool) -> int:
        """Compiled steps without adapters run each decoder layer as one native op
        (llmserve::decoder_layer; True), or as its modules' ops; returns the layers fused."""
        for layer in self.layers:
            layer.fused = False
        return sum(layer.fuse() for layer in self.layers) if enabled else 0

    def use_native_lora(self, enabled: bool) -> None:
        """The LoRA deltas through llmserve::lora_add (True; CPU only) or torch ops."""
        for slots in self.lora_slots:
            slots.native = bool(enabled)

    def enable_lora(self, num_slots: int, max_rank: int) -> dict[tuple[int, str], LoRASlots]:
        """A LoRASlots beside every fused linear; (layer, fused layer name) -> its slots."""
        cfg, out = self.config, {}
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_lora = LoRASlots(cfg.hidden_size, [attn.q_size, attn.kv_size, attn.kv_size], num_slots, max_rank)
            attn.o_lora = LoRASlots(attn.q_size, [cfg.hidden_size], num_slots, max_rank)
            mlp.gate_up_lora = LoRASlots(cfg.hidden_size, [mlp.inter, mlp.inter], num_slots, max_rank)
            mlp.down_lora = LoRASlots(mlp.inter, [cfg.hidden_size], num_slots, max_rank)
            for name, slots in (("qkv_proj", attn.qkv_lora), ("o_proj", attn.o_lora), ("gate_up_proj", mlp.gate_up_lora),
                                ("down_proj", mlp.down_lora)):
                out[(i, name)] = slots.to(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)
        self.lora_slots = list(out.values())
        return out

    @property
    def lora_widths(self) -> tuple[int, ...]:
        """n * R of each kind of slots that takes the torch path: a mask each per step."""
        return tuple(sorted({s.width for s in self.lora_slots if not s.native}))

    @property
    def native_decode(self) -> bool:
        return self.layers[0].self_attn.attn.native

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,  # the rows' adapters, when the step has any
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, cache, meta, lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.lm_head(hidden).float()
