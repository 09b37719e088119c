"""KVCacheAttention: attention over a paged KV cache, for a flattened mixed batch.

A batch is flattened as in vLLM: T tokens in one row, decode tokens first (one per sequence),
then the prefill chunks of the remaining sequences, each contiguous.

Cache layout (per layer): kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in slot block_table[t // block_size] * block_size + t % block_size.
Block 0 is the null block: it is never handed to a sequence, so padded rows write there.

Decode attention has two backends with one contract: the native kernel
(torch.ops.llmserve.paged_decode_attention, llmserve/kernels), which reads K/V straight from the
blocks, and a pure-torch path that gathers each sequence's blocks first. The cache write likewise:
the native reshape_and_cache (one memcpy a row) or write_kv_cache (index_copy_). The engine picks
one at start-up with LlamaForCausalLM.use_native_attention(), as the execution plan says (llmserve.plan).
The cache may hold another dtype than q (--kv-cache-dtype): K/V are converted as they are written
and read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    query_start: int  # index of this sequence's first query token in the flat batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens in the cache after this step (computed before + query_len)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(slots=True)
class PrefillBatch:
    """The prefill chunks of a step as tensors, for a compiled graph: [P] int64 each (a chunk of
    query_len 0 is padding), and block_tables [P, max_blocks] int64 (null-block padded)."""

    query_start: torch.Tensor
    query_len: torch.Tensor
    context_len: torch.Tensor
    block_tables: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    num_decodes: int  # the first num_decodes tokens are single decode tokens
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (null-block padded)
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, context length incl. the new token
    prefills: list[PrefillSeq]
    decode_bias: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks*block_size] fp32: 0 or -inf
    prefill_batch: PrefillBatch | None = None  # in a compiled step, `prefills` as tensors (and `prefills` empty)

    def prepare_decode_bias(self, block_size: int) -> None:
        """Build the padding mask (fp32) once per forward; every layer shares it."""
        if self.num_decodes and self.decode_bias is None:
            width = self.decode_block_tables.shape[1] * block_size
            pad = torch.arange(width)[None, :] >= self.decode_seq_lens[:, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))
            self.decode_bias = bias[:, None, None, :]


class KVCacheAttention(torch.nn.Module):
    """Writes new K/V through the slot mapping, reads each sequence's past through its block table."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.native = False  # the native kernels: paged_decode_attention and reshape_and_cache

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        # an opaque in-place op: a compiled graph writes the cache where it lies (traced as plain
        # index_copy_ on a view, inductor copied the whole cache every layer)
        if self.native:
            torch.ops.llmserve.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        else:
            torch.ops.llmserve.write_kv_cache(kv_cache, meta.slot_mapping, k, v)
        pb = meta.prefill_batch
        if pb is None:
            return attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.native)
        # a compiled step: every row in one opaque op, whatever the mix of decodes and chunks
        op = torch.ops.llmserve.paged_attention if self.native else torch.ops.llmserve.paged_attention_torch
        return op(q, k, v, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                  pb.query_start, pb.query_len, pb.context_len, pb.block_tables, self.scale)


def attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, native: bool) -> torch.Tensor:
    """q [T, H, hd], new k/v [T, kvh, hd] (already in the cache) -> [T, H, hd]. Every row is a
    decode row or lies in one prefill chunk (padding rows of a compiled step are decode rows)."""
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale, native)
    for p in meta.prefills:
        sl = slice(p.query_start, p.query_start + p.query_len)
        out[sl] = _prefill(q[sl], k[sl], v[sl], k_cache, v_cache, p, scale)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, native: bool) -> torch.Tensor:
    # q: [D, H, hd]; each sequence's blocks gathered: [D, L = max_blocks*block_size, kvh, hd].
    # A row of length 0 (a padded row) reads nothing and gives zeros, as in the native kernel.
    if native:
        return torch.ops.llmserve.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    out = _decode_torch(q, k_cache, v_cache, meta, scale)
    return out.masked_fill_((meta.decode_seq_lens == 0)[:, None, None], 0.0)  # their softmax saw only -inf


def _decode_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    meta.prepare_decode_bias(k_cache.shape[1])  # built by the first layer, shared by the rest
    d, heads, hd = q.shape
    kvh = k_cache.shape[2]
    keys = _gather(k_cache, meta.decode_block_tables).to(q.dtype)  # the cache's dtype may differ (--kv-cache-dtype)
    vals = _gather(v_cache, meta.decode_block_tables).to(q.dtype)
    if q.dtype == torch.float32:  # the CPU flash kernel is the fastest fp32 path
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=meta.decode_bias,
            scale=scale, enable_gqa=kvh != heads,
        )
        return out[:, :, 0, :]
    # bf16: that kernel is slow for a single query; bf16 matmuls with an fp32 softmax are not
    scores = torch.matmul(q.view(d, kvh, -1, hd), keys.permute(0, 2, 3, 1)).float()  # [D, kvh, g, L]
    probs = torch.softmax(scores * scale + meta.decode_bias, dim=-1).to(vals.dtype)
    return torch.matmul(probs, vals.transpose(1, 2)).reshape(d, heads, hd)


def _prefill(q, k_new, v_new, k_cache, v_cache, p: PrefillSeq, scale: float) -> torch.Tensor:
    # q: [n, H, hd]; a fresh prompt attends to its own K/V, a continued one reads the cache.
    n, heads, hd = q.shape
    kvh = k_cache.shape[2]
    if p.context_len == n:
        keys, vals, mask, causal = k_new, v_new, None, True
    else:
        keys = _gather(k_cache, p.block_table).view(-1, kvh, hd)[: p.context_len]
        vals = _gather(v_cache, p.block_table).view(-1, kvh, hd)[: p.context_len]
        q_pos = torch.arange(p.context_len - n, p.context_len, device=q.device)
        mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.to(q.dtype).transpose(0, 1)[None],
        vals.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=kvh != heads,
    )
    return out[0].transpose(0, 1)


def paged_attention_torch(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start, query_len, context_len,
                          prefill_tables, scale: float) -> torch.Tensor:
    """The pure-torch llmserve::paged_attention (a whole compiled step's attention; see the kernel)."""
    chunks = zip(query_start.tolist(), query_len.tolist(), context_len.tolist(), prefill_tables, strict=True)
    prefills = [PrefillSeq(s, n, c, table) for s, n, c, table in chunks if n]
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), block_tables.shape[0], block_tables, seq_lens, prefills)
    return attend(q, k, v, k_cache, v_cache, meta, scale, native=False)


def write_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, kvh, hd]; k, v [T, kvh, hd] go to slots slot_mapping [T];
    a negative slot (a padded row) writes nothing."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    flat = kv_cache.view(2, -1, k.shape[1], k.shape[2])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


# Registered through the low-level library API: a call costs about as much as the plain function
# (torch.library.custom_op's wrapper adds ~12 us, 30 times per step).
_LIB = torch.library.Library("llmserve", "FRAGMENT")
_LIB.define("write_kv_cache(Tensor(a!) kv_cache, Tensor slot_mapping, Tensor k, Tensor v) -> ()")
_LIB.impl("write_kv_cache", write_kv_cache, "CPU")
_LIB.impl("write_kv_cache", lambda kv_cache, slot_mapping, k, v: None, "Meta")
_LIB.define(
    "paged_attention_torch(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor query_start, Tensor query_len, Tensor context_len, Tensor prefill_tables, "
    "float scale) -> Tensor")
_LIB.impl("paged_attention_torch", paged_attention_torch, "CPU")
_LIB.impl("paged_attention_torch", lambda q, *rest: torch.empty_like(q), "Meta")


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, kvh, hd], tables [..., n] -> [..., n*block_size, kvh, hd].
    index_select over whole blocks (rows) is a plain row copy, much faster than fancy indexing."""
    nb, bs, kvh, hd = cache.shape
    rows = cache.view(nb, -1).index_select(0, tables.flatten())
    return rows.view(*tables.shape[:-1], tables.shape[-1] * bs, kvh, hd)
