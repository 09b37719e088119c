"""Triton kernels for NVIDIA GPUs: a whole step's paged attention, and the KV-cache write.

They are the CUDA implementations of the ops the CPU kernels implement (register_cuda_ops), with
the same contracts (llmserve.model.attention):
- llmserve::reshape_and_cache(k, v, kv_cache, slot_mapping): k, v [T, kvh, hd] go to the slots
  slot_mapping [T] of kv_cache [2, num_blocks, block_size, kvh, hd], converted to its dtype; a
  negative slot writes nothing.
- llmserve::paged_attention(q, k, v, k_cache, v_cache, block_tables [D, mb], seq_lens [D],
  query_start [P], query_len [P], context_len [P], prefill_tables [P, mb'], scale): the first D
  rows of q [T, H, hd] are decode rows (row i sees seq_lens[i] tokens of its table), then P
  chunks (chunk j: rows query_start[j] ..+query_len[j], the last of context_len[j] tokens;
  query_len 0 is padding). K/V are read from the cache only (already written this step).
- llmserve::paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale): decode
  rows alone.

One kernel serves every row. A "query block" is up to BLOCK_Q consecutive query tokens of one
sequence (a decode row is a sequence of one token), times the G query heads that share a KV head:
BLOCK_M = BLOCK_Q * G rows (padded to a power of two) for tl.dot. The grid is (cdiv(T, BLOCK_Q) +
S, kvh), an upper bound on the query blocks that depends only on the step's shape, so a padded
step can be captured in a CUDA graph; the spare programs return at once. Each program walks its
sequence's KV positions up to its last query row in tiles of BLOCK_N, with an online softmax in
float32. A sequence of length 0 (a padded decode row) reads nothing and gives zeros.

Set TRITON_INTERPRET=1 before importing this module to run the kernels on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# integer arguments that vary with the step stay unspecialised: Triton would compile a variant
# for every value 1 and every multiple of 16 it meets
@triton.jit(do_not_specialize=["stride_k", "stride_v"])
def _cache_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v,
                        ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    # one program per token: its kvh * hd values of K and of V into its slot
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)  # a negative slot (a padded row) writes nothing
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(kc_ptr + slot * ROW + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_seqs", "stride_tab"])
def _paged_attention_kernel(
    out_ptr, q_ptr, kc_ptr, vc_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr, seq_of_block_ptr, first_block_ptr,
    scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_tab,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.load(seq_of_block_ptr + qb)
    if s >= num_seqs:  # a spare program of the shape-bound grid
        return
    q_len = tl.load(q_len_ptr + s)
    q0 = (qb - tl.load(first_block_ptr + s)) * BLOCK_Q  # this block's first query, within the sequence
    ctx = tl.load(ctx_ptr + s)
    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // G  # query index within the sequence's chunk
    row_ok = (rows < BLOCK_Q * G) & (qi < q_len)
    token = tl.load(q_start_ptr + s) + qi
    head = kv_head * G + rows % G
    d = tl.arange(0, HD_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx - q_len + qi  # each row's position: it sees keys 0..q_pos
    kv_end = tl.minimum(ctx, ctx - q_len + q0 + BLOCK_Q)  # past this block's last row: nothing to read
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
    table = tables_ptr + s.to(tl.int64) * stride_tab
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offs = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        k = tl.load(kc_ptr + offs[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
        scores = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + offs[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    t, kvh, hd = k.shape
    if t == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = kvh * hd
    _cache_write_kernel[(t,)](k, v, kv_cache[0], kv_cache[1], slot_mapping, k.stride(0), v.stride(0),
                              ROW=row, ROW_PAD=triton.next_power_of_2(row))


def paged_attention(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start, query_len, context_len,
                    prefill_tables, scale: float) -> torch.Tensor:
    """See the module's docstring. No host synchronisation: every step tensor stays on the device."""
    d, dev = block_tables.shape[0], q.device
    starts = torch.cat([torch.arange(d, device=dev, dtype=query_start.dtype), query_start])
    lens = torch.cat([torch.ones(d, device=dev, dtype=query_len.dtype), query_len])
    ctx = torch.cat([seq_lens.to(context_len.dtype), context_len])
    width = max(block_tables.shape[1], prefill_tables.shape[1])
    tables = torch.cat([F.pad(block_tables, (0, width - block_tables.shape[1])),
                        F.pad(prefill_tables.to(block_tables.dtype), (0, width - prefill_tables.shape[1]))])
    return _attend(q, k_cache, v_cache, tables, starts, lens, ctx, scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    d, dev = q.shape[0], q.device
    rows = torch.arange(d, device=dev)
    return _attend(q, k_cache, v_cache, block_tables, rows, torch.ones_like(rows), seq_lens, scale)


def _attend(q, k_cache, v_cache, tables, starts, lens, ctx, scale: float) -> torch.Tensor:
    """q [T, H, hd]; sequence s: rows starts[s] ..+lens[s], the last of ctx[s] tokens on tables[s]."""
    t, heads, hd = q.shape
    num_seqs, (_, block_size, kvh, _) = lens.shape[0], k_cache.shape
    out = torch.empty_like(q)
    if t == 0 or num_seqs == 0:
        return out.zero_()
    g = heads // kvh
    block_q = max(1, 16 // g)
    block_m = max(16, triton.next_power_of_2(block_q * g))
    counts = (lens + block_q - 1) // block_q  # query blocks per sequence
    ends = torch.cumsum(counts, 0)
    grid_blocks = triton.cdiv(t, block_q) + num_seqs
    seq_of_block = torch.searchsorted(ends, torch.arange(grid_blocks, device=q.device, dtype=ends.dtype), right=True)
    assert k_cache.stride(3) == 1 and q.stride(2) == 1
    _paged_attention_kernel[(grid_blocks, kvh)](
        out, q, k_cache, v_cache, tables, starts, lens, ctx, seq_of_block, ends - counts,
        scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        G=g, HEAD_DIM=hd, HD_PAD=max(16, triton.next_power_of_2(hd)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(block_size)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, kvh, hd] with each token's kvh * hd values contiguous (a view out of a fused qkv is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


_LIB: torch.library.Library | None = None
_META = {"reshape_and_cache": lambda k, v, kv_cache, slot_mapping: None,
         "paged_attention": lambda q, *rest: torch.empty_like(q),
         "paged_decode_attention": lambda q, *rest: torch.empty_like(q)}
SCHEMAS = {
    "reshape_and_cache": "reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
    "paged_attention": "paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
                       "Tensor block_tables, Tensor seq_lens, Tensor query_start, Tensor query_len, "
                       "Tensor context_len, Tensor prefill_tables, float scale) -> Tensor",
    "paged_decode_attention": "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                              "Tensor seq_lens, float scale) -> Tensor",
}


def register_cuda_ops() -> None:
    """These kernels as the CUDA implementations of torch.ops.llmserve.*. The native CPU library
    defines the ops where it builds (loaded first, so that it never meets a second definition);
    where it does not, the schemas are defined here, with shape-only Meta implementations."""
    global _LIB
    if _LIB is not None:
        return
    from llmserve import kernels

    kernels.load()
    _LIB = torch.library.Library("llmserve", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        if not hasattr(torch.ops.llmserve, name):
            _LIB.define(schema)
            _LIB.impl(name, _META[name], "Meta")
        _LIB.impl(name, globals()[name], "CUDA")
