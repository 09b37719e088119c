"""The native attention kernels equal plain attention over each sequence's own K/V, in every ISA
variant this CPU can run (AVX-512, AVX2, the portable loop), the AVX2 one included on an AVX-512
machine."""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels


@pytest.fixture(scope="module")
def op(cpu_isa):
    return torch.ops.llmserve.paged_decode_attention


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Per sequence: its K/V rows in order, softmax(q K^T * scale) V in float64."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // kvh
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        rows = [int(tables[s, t // bs]) * bs + t % bs for t in range(n)]
        keys = k_cache.reshape(-1, kvh, k_cache.shape[3])[rows].double().repeat_interleave(g, dim=1)  # [n, H, hd]
        vals = v_cache.reshape(-1, kvh, v_cache.shape[3])[rows].double().repeat_interleave(g, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", probs, vals))
    return torch.stack(out)


def case(heads: int, kv_heads: int, head_dim: int, lens: list[int], dtype, block_size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never block 0
    width = max(-(-n // block_size) for n in lens) + 1  # one padding column at least
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for s, n in enumerate(lens):
        tables[s, : -(-n // block_size)] = torch.tensor([free.pop() for _ in range(-(-n // block_size))])
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 2).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


SHAPES = [
    (9, 3, 64),  # SmolLM2: GQA, 3 query heads per KV head (vectorised path)
    (32, 8, 128),  # Llama-style: 4 per KV head, head_dim 128
    (6, 2, 32),  # head_dim 32: the smallest the bf16 dot-product path takes
    (4, 4, 16),  # multi-head attention
    (8, 2, 24),  # head_dim not a multiple of 16 (portable path)
    (18, 2, 64),  # 9 per KV head: more than the vectorised variants (portable path)
]


DTYPES = [  # (query dtype, cache dtype, tolerance)
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float32, torch.bfloat16, 1e-5),  # --kv-cache-dtype bfloat16 under float32 weights
]


@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(op, shape, dtype, kv_dtype, tol):
    lens = [1, 15, 16, 17, 100, 333]  # inside, at and across block edges
    q, k, v, tables, seq_lens = case(*shape, lens, dtype)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    scale = shape[2] ** -0.5
    got = op(q, k, v, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k, v, tables, seq_lens, scale)
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPES)
@pytest.mark.parametrize("lens", [[2000], [1, 700], [64, 65]])
def test_long_contexts_split_over_blocks(op, lens, dtype, kv_dtype, tol):
    """Few sequences with long contexts: each is split over its blocks across threads and the
    partial softmaxes merged; the result is the whole context's attention."""
    q, k, v, tables, seq_lens = case(4, 1, 64, lens, dtype, seed=5)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    with threads(4):  # 1 (sequence, KV head) pair per sequence: split into up to 8
        got = op(q, k, v, tables, seq_lens, 0.125)
    want = reference(q, k, v, tables, seq_lens, 0.125)
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err
    with threads(1):  # unsplit: the same within rounding
        assert torch.allclose(op(q, k, v, tables, seq_lens, 0.125).float(), got.float(), atol=tol * 4, rtol=tol * 4)


class threads:
    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


@pytest.mark.parametrize("block_size", [8, 24])
def test_block_sizes_other_than_16(op, block_size):
    """Blocks smaller than the kernel's 16-token chunks, and blocks that end mid-chunk."""
    lens = [1, 7, 8, 9, 24, 25, 100]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v, tables, seq_lens = case(9, 3, 64, lens, dtype, block_size=block_size, seed=1)
        want = reference(q, k, v, tables, seq_lens, 0.125)
        err = (op(q, k, v, tables, seq_lens, 0.125).double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_blocks_are_never_read(op, dtype):
    q, k, v, tables, lens = case(9, 3, 64, [20, 5], dtype)
    before = op(q, k, v, tables, lens, 0.125)
    k[0].fill_(float("nan"))  # the null block, used as padding
    v[0].fill_(float("nan"))
    for s, n in enumerate(lens.tolist()):  # the unused rows of each sequence's last block
        k[tables[s, (n - 1) // 16], n % 16 or 16 :].fill_(float("nan"))
        v[tables[s, (n - 1) // 16], n % 16 or 16 :].fill_(float("nan"))
    assert torch.equal(op(q, k, v, tables, lens, 0.125), before)


def test_bad_lengths_and_block_ids_are_refused(op):
    q, k, v, tables, lens = case(9, 3, 64, [20], torch.float32)
    for bad in (-1, tables.shape[1] * 16 + 1):
        with pytest.raises(RuntimeError, match="seq_lens"):
            op(q, k, v, tables, torch.tensor([bad]), 0.125)
    for bad in (-1, k.shape[0], 1 << 40):  # a block id in the part of the table that is read
        t = tables.clone()
        t[0, 1] = bad
        with pytest.raises(RuntimeError, match="block_tables"):
            op(q, k, v, t, lens, 0.125)
    t = tables.clone()
    t[0, -1] = 1 << 40  # past seq_len: never read, so never checked
    assert torch.equal(op(q, k, v, t, lens, 0.125), op(q, k, v, tables, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,num_threads", [([0, 40, 0], 1), ([2000, 0], 4)])  # unsplit; split over blocks
def test_a_row_of_length_0_reads_nothing_and_gives_zeros(op, lens, num_threads, dtype):
    """A padded row of a CUDA graph's batch: seq_len 0 on a table naming no block of this cache;
    its output is zeros and the other rows' equal the reference."""
    q, k, v, tables, seq_lens = case(9, 3, 64, lens, dtype, seed=4)
    empty = seq_lens == 0
    tables[empty] = 1 << 40  # would fault if read
    with threads(num_threads):
        got = op(q, k, v, tables, seq_lens, 0.125)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    want = reference(q[~empty], k, v, tables[~empty], seq_lens[~empty], 0.125)
    assert (got[~empty].double() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2) * 4


def test_nan_in_a_query_stays_nan(op):
    q, k, v, tables, lens = case(9, 3, 64, [40, 40], torch.float32)
    q[0, 0, 0] = float("nan")
    out = op(q, k, v, tables, lens, 0.125)
    assert out[0, 0].isnan().all() and not out[1].isnan().any()


def test_without_a_working_compiler_the_engine_falls_back_to_torch(tmp_path, tiny_model):
    """A fresh cache and a compiler that fails: load() says False, logs why, and generation works."""
    import os
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from llmserve import LLM, SamplingParams, kernels\n"
        f"llm = LLM({tiny_model!r}, num_blocks=64)\n"
        "plan = llm.engine.plan\n"
        "assert kernels.load() is False and not llm.engine.model.native_decode\n"
        "assert plan.attention_backend.value == 'torch' and 'did not build' in plan.attention_backend.reason\n"
        "print(len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids))\n"
    )
    env = dict(os.environ, CXX="false", LLMSERVE_KERNEL_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "4"
    assert "native kernels unavailable" in proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_index_copy(op, dtype):
    """reshape_and_cache writes exactly what write_kv_cache (index_copy_) writes, from strided
    views of a fused qkv row and from another dtype; a negative slot (a padded row) writes
    nothing, in both; slots past the cache are refused."""
    from llmserve.model.attention import write_kv_cache

    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 9, 4, 3, 16, generator=g).to(dtype)
    qkv = torch.randn(6, 9 * 16 + 2 * 3 * 16, generator=g)  # [N, q | k | v] as the model splits it
    k = qkv[:, 144:192].view(6, 3, 16)
    v = qkv[:, 192:].view(6, 3, 16)
    slots = torch.tensor([4, 5, 35, 0, 17, 6])
    want = kv.clone()
    write_kv_cache(want, slots, k, v)
    torch.ops.llmserve.reshape_and_cache(k, v, kv, slots)
    assert torch.equal(kv, want)
    padded = torch.tensor([4, -1, 35, -1, 17, 6])
    before = kv.clone()
    write_kv_cache(want, padded, k, v)
    torch.ops.llmserve.reshape_and_cache(k, v, kv, padded)
    assert torch.equal(kv, want)
    keep = padded >= 0
    expect = before.view(2, 36, 3, 16).clone()
    expect[0, padded[keep]], expect[1, padded[keep]] = k[keep].to(dtype), v[keep].to(dtype)
    assert torch.equal(kv.view(2, 36, 3, 16), expect)  # rows 1 and 3 are nowhere
    for bad in (36, 1 << 40):
        with pytest.raises(RuntimeError, match="slot_mapping"):
            torch.ops.llmserve.reshape_and_cache(k, v, kv, torch.tensor([4, 5, 35, 0, 17, bad]))


def test_native_linear_op_runs_and_forgets_packed_weights(op):
    """onednn_linear(x, handle) equals F.linear on the packed layer's weights, and a handle whose
    layer is gone is refused instead of reading a freed weight."""
    import gc

    from llmserve.model.packed import PackedLinear

    g = torch.Generator().manual_seed(3)
    dense = torch.nn.Linear(64, 40, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(40, 64, generator=g))
        dense.bias.copy_(torch.randn(40, generator=g))
    layer = PackedLinear(dense, native=True)  # registered in the native op's table
    x = torch.randn(5, 64, generator=g)
    with torch.inference_mode():
        got = torch.ops.llmserve.onednn_linear(x, layer.handle)
    assert torch.allclose(got, torch.nn.functional.linear(x, dense.weight, dense.bias), atol=1e-4, rtol=1e-4)
    handle = layer.handle
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no weight is registered under handle"):
        torch.ops.llmserve.onednn_linear(x, handle)


def test_a_quantized_layer_is_registered_until_it_goes(op):
    """QuantLinear.use_native(True) puts the weight in llmserve::qlinear's table; registering it
    again replaces the entry (so a packed float copy added later takes the large steps: here it
    holds twice the weight, to tell it apart); the layer's release removes it."""
    import gc

    from torch import nn

    from llmserve.model.packed import PackedLinear
    from llmserve.model.quantize import QuantLinear, dequantize, quantize

    layer = QuantLinear(quantize(torch.randn(24, 64), "int8"), None)
    layer.use_native(True)
    x = torch.randn(6, 64)
    want = x.double() @ dequantize(layer.quantized).double().T
    dense = nn.Linear(64, 24, bias=False)
    dense.weight = nn.Parameter(2 * dequantize(layer.quantized), requires_grad=False)
    before = kernels.quant_max_rows()
    try:
        kernels.set_quant_max_rows(4)
        with torch.inference_mode():
            assert (torch.ops.llmserve.qlinear(x, layer.handle).double() - want).abs().max() <= 1e-4 * want.abs().max()
            copy = PackedLinear(dense, native=True)
            layer.packed = copy.handle
            layer.register_native()
            got = torch.ops.llmserve.qlinear(x, layer.handle).double()  # 6 rows: the copy
            assert (got - 2 * want).abs().max() <= 1e-4 * want.abs().max()
    finally:
        kernels.set_quant_max_rows(before)
    handle = layer.handle
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no weight is registered under handle"):
        torch.ops.llmserve.qlinear(x, handle)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gemv_equals_a_linear_layer(op, dtype, tol):
    """llmserve::gemv, the batch-1 linear over a plain weight: every row count it takes, input
    widths that end in a part step, a single vector or a scalar tail, with and without bias, with
    and without software prefetch (reading past the weight's end must not matter); more rows are
    refused, and so is a prefetch distance out of range."""
    g = torch.Generator().manual_seed(6)
    before = kernels.gemv_prefetch()
    try:
        for prefetch in (0, 64, 4096):
            kernels.set_gemv_prefetch(prefetch)
            assert kernels.gemv_prefetch() == prefetch
            for rows in (1, 2, 3, 4, 5, 11, 16):
                for out, width in ((37, 100), (7, 120), (960, 576), (5, 8)):
                    x = torch.randn(rows, width, generator=g).to(dtype)
                    w = torch.randn(out, width, generator=g).to(dtype)
                    bias = torch.randn(out, generator=g) if out != 5 else None
                    got = torch.ops.llmserve.gemv(x, w, bias)
                    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
                    assert got.dtype == dtype and got.shape == (rows, out)
                    err = (got.double() - want).abs().max().item()
                    assert err <= tol * max(1.0, want.abs().max().item()), (rows, out, width, prefetch, err)
        with pytest.raises(RuntimeError, match="0 to 65536 bytes"):
            kernels.set_gemv_prefetch(-1)
    finally:
        kernels.set_gemv_prefetch(before)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        torch.ops.llmserve.gemv(torch.ones(17, 8), torch.ones(3, 8), None)


def lora_reference(y, x, a, b, slots, out_slices):
    """y + each row's delta, in float64: t = A[slot] x, then slice j's columns += t_j B_j."""
    y, r = y.double().clone(), a.shape[1] // len(out_slices)
    starts = [sum(out_slices[:j]) for j in range(len(out_slices))]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            t = a[s].double() @ x[i].double()
            for j, (c0, width) in enumerate(zip(starts, out_slices, strict=True)):
                y[i, c0:c0 + width] += t[j * r:(j + 1) * r] @ b[s, j * r:(j + 1) * r, c0:c0 + width].double()
    return y


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_lora_add_equals_each_rows_own_delta(op, dtype, tol):
    """llmserve::lora_add over rows of several slots and none: column counts with part steps and
    scalar tails, one slice and three, one row and more rows of one slot than a block holds, and
    slots with enough rows to take GEMMs (some rows of the step, and all of them); a row without
    an adapter is left exactly as it was."""
    g = torch.Generator().manual_seed(7)
    for rows, width, out_slices, rank, slots in ((7, 100, [37, 13, 5], 3, 3), (32, 576, [576, 192, 192], 16, 4),
                                                 (1, 64, [3000], 8, 2), (11, 24, [8], 1, 1), (800, 40, [24, 9], 4, 2),
                                                 (200, 40, [24, 9], 4, 1)):
        x = torch.randn(rows, width, generator=g).to(dtype)
        y = torch.randn(rows, sum(out_slices), generator=g).to(dtype)
        a = torch.randn(slots, len(out_slices) * rank, width, generator=g).to(dtype)
        b = torch.randn(slots, len(out_slices) * rank, sum(out_slices), generator=g).to(dtype)
        row_slots = torch.randint(-1, slots, (rows,), generator=g) if rows != 200 else torch.zeros(rows, dtype=torch.long)
        row_slots[0] = -1 if 1 < rows != 200 else 0
        got = y.clone()
        torch.ops.llmserve.lora_add(got, x, a, b, row_slots, out_slices)
        want = lora_reference(y, x, a, b, row_slots, out_slices)
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (rows, out_slices, err)
        assert torch.equal(got[row_slots < 0], y[row_slots < 0])
    with pytest.raises(RuntimeError, match="is not a slot"):
        torch.ops.llmserve.lora_add(y, x, a, b, torch.full((rows,), slots), out_slices)


def test_packed_linear_takes_gemv_for_few_rows(op):
    """A layer packed with its plain weight kept: steps of at most gemv_max_rows rows run
    llmserve::gemv and more rows the packed oneDNN path, eager and through the native op, all
    equal to F.linear, and up to the limit bit-equal to llmserve::gemv itself."""
    from llmserve.model.packed import PackedLinear

    g = torch.Generator().manual_seed(7)
    dense = torch.nn.Linear(64, 40, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(40, 64, generator=g))
    layer = PackedLinear(dense, native=True, gemv=True)
    before = kernels.gemv_max_rows()
    try:
        for limit in (4, 12):
            kernels.set_gemv_max_rows(limit)
            for rows in (1, 4, 5, 12, 13, 32):
                x = torch.randn(rows, 64, generator=g)
                want = torch.nn.functional.linear(x, dense.weight, dense.bias)
                with torch.inference_mode():
                    for got in (layer(x), torch.ops.llmserve.onednn_linear(x, layer.handle)):
                        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (limit, rows)
                    if rows <= limit:
                        assert torch.equal(layer(x), torch.ops.llmserve.gemv(x, dense.weight, dense.bias)), (limit, rows)
        with pytest.raises(RuntimeError, match="0 to 16 rows"):
            kernels.set_gemv_max_rows(17)
    finally:
        kernels.set_gemv_max_rows(before)


def mixed_step(dtype, seed: int = 4):
    """A compiled step's attention inputs: 2 decode rows, a fresh 21-token prompt, a continued
    chunk of 6 tokens at context 40 and one padding chunk; every new K/V row already in the cache.
    Also, per flat row, the (table, length) its query attends to."""
    q, k_cache, v_cache, tables, lens = case(9, 3, 64, [33, 5, 21, 40], dtype, seed=seed)
    bs = k_cache.shape[1]
    decode = (tables[:2], lens[:2])
    chunks = [(2, 21, 21, tables[2]), (23, 6, 40, tables[3]), (29, 0, 0, tables[0])]  # (start, tokens, context, table)
    rows = [(tables[0], 33), (tables[1], 5)]
    rows += [(t, p + 1) for _, n, ctx, t in chunks for p in range(ctx - n, ctx)]
    slots = [int(t[(p - 1) // bs]) * bs + (p - 1) % bs for t, p in rows]  # each row's own token
    k = k_cache.flatten(0, 1)[slots]
    v = v_cache.flatten(0, 1)[slots]
    q = (torch.randn(len(rows), 9, 64, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    starts, ns, ctxs, ptables = (torch.stack([torch.as_tensor(c[i]) for c in chunks]) for i in range(4))
    args = (q, k, v, k_cache, v_cache, *decode, starts, ns, ctxs, ptables, 0.125)
    return args, rows


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_attention_covers_a_mixed_step(op, dtype, tol):
    """The whole-step op (native and pure torch) gives every row of decodes and prefill chunks
    attention over exactly its own sequence's tokens up to its position; padding chunks are skipped."""
    import llmserve.model.attention  # noqa: F401  (registers paged_attention_torch)

    args, rows = mixed_step(dtype)
    q, k_cache, v_cache = args[0], args[3], args[4]
    tables = torch.stack([torch.nn.functional.pad(t, (0, 4 - len(t))) for t, _ in rows])
    want = reference(q, k_cache, v_cache, tables, torch.tensor([n for _, n in rows]), 0.125)
    for impl in (torch.ops.llmserve.paged_attention, torch.ops.llmserve.paged_attention_torch):
        got = impl(*args)
        assert got.dtype == dtype and got.shape == q.shape
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (impl, err)


def test_paged_attention_refuses_a_chunk_that_does_not_fit(op):
    args, _ = mixed_step(torch.float32)
    ctxs = args[9].clone()
    ctxs[1] = 5  # fewer tokens of context than the chunk's 6 queries
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.llmserve.paged_attention(*args[:9], ctxs, *args[10:])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_quant_linear_equals_its_dequantized_weights(op, fmt, dtype, tol):
    """llmserve::quant_linear over Q8_0/Q4_1 blocks equals x @ dequantize(w)^T in float64: the
    in-register gemv (up to quant_max_rows rows) and the dequantized-tile GEMM (more rows), input
    widths that end in a part block or a part vector step, with and without bias; the padding
    bytes of a part block (poisoned here) are never read into a result."""
    from llmserve.model.quantize import dequantize, quantize

    g = torch.Generator().manual_seed(9)
    before = kernels.quant_max_rows()
    try:
        for limit in (0, 4, 16):
            kernels.set_quant_max_rows(limit)
            for rows in (1, 3, 4, 5, 16, 40):
                for out, width in ((37, 33), (8, 77), (960, 576), (3, 16), (70, 1536)):
                    w = quantize(torch.randn(out, width, generator=g), fmt)
                    poison(w, width)
                    x = torch.randn(rows, width, generator=g).to(dtype)
                    bias = torch.randn(out, generator=g).to(dtype) if out % 2 == 0 else None
                    got = torch.ops.llmserve.quant_linear(x, w.q, w.d, w.m, bias, width)
                    want = x.double() @ dequantize(w).double().T + (bias.double() if bias is not None else 0)
                    assert got.dtype == dtype and got.shape == (rows, out)
                    err = (got.double() - want).abs().max().item()
                    assert err <= tol * max(1.0, want.abs().max().item()), (limit, rows, out, width, err)
    finally:
        kernels.set_quant_max_rows(before)


def poison(w, width: int) -> None:
    """Fill the bytes of a part last block past `width` with values that would show."""
    pad = w.q.shape[1] * (2 if w.m is not None else 1) - width  # weights of padding
    if pad == 0:
        return
    if w.m is None:
        w.q[:, width:] = 127
    else:
        tail = w.q[:, -16:]  # the last block: byte j holds weights j (low) and j + 16 (high)
        for j in range(32 - pad, 32):
            tail[:, j % 16] |= 0x0F if j < 16 else 0xF0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_sends_large_steps_to_its_packed_copy(op, dtype):
    """A layer with a oneDNN-packed float copy (quant_large_steps packed) runs steps of more than
    quant_max_rows rows on it, fewer on the quantized bytes: both equal x @ dequantize(w)^T. The
    copy is told apart by its weights: it holds twice the dequantized weight."""
    from torch import nn

    from llmserve.model.packed import PackedLinear
    from llmserve.model.quantize import dequantize, quantize

    g = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(48, 96, generator=g), "int4")
    dense = nn.Linear(96, 48, bias=False)
    dense.weight = nn.Parameter((2 * dequantize(w)).to(dtype), requires_grad=False)
    with torch.inference_mode():
        copy = PackedLinear(dense, native=True)
    before = kernels.quant_max_rows()
    try:
        kernels.set_quant_max_rows(4)
        for rows, scale in ((3, 1), (4, 1), (5, 2), (40, 2)):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            got = torch.ops.llmserve.quant_linear(x, w.q, w.d, w.m, None, 96, copy.handle).double()
            want = scale * (x.double() @ dequantize(w).double().T)
            assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (rows, dtype)
    finally:
        kernels.set_quant_max_rows(before)


@pytest.mark.parametrize("fmt", ["int8", "int4", "float32", "bfloat16"])
def test_gemvs_skip_the_rows_past_live_rows(op, fmt):
    """Under kernels.live_rows(n) (a compiled step's padding) the GEMVs, quantized and plain,
    compute the first n rows as without it and write zeros into the others; larger steps and the
    rows after the block are untouched."""
    from llmserve.model.quantize import QuantLinear, dequantize, quantize

    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=g)
    if fmt in ("int8", "int4"):
        layer = QuantLinear(quantize(w, fmt), torch.randn(40, generator=g))
        layer.use_native(True)
        ref = dequantize(layer.quantized).double()
        run = layer
    else:
        dtype = getattr(torch, fmt)
        ref = w.to(dtype).double()
        def run(x):
            return torch.ops.llmserve.gemv(x, w.to(dtype), None)
    bias = layer.bias.double() if fmt in ("int8", "int4") else 0
    x = torch.randn(3, 96, generator=g)
    before = kernels.quant_max_rows()
    try:
        kernels.set_quant_max_rows(4)  # 3 rows: the quantized GEMV
        with torch.inference_mode():
            with kernels.live_rows(1):
                got = run(x).double()
            after = run(x).double()
    finally:
        kernels.set_quant_max_rows(before)
    want = x.double() @ ref.T + bias
    assert (got[0] - want[0]).abs().max() <= 1e-4 * want.abs().max()
    assert not got[1:].any()
    assert (after - want).abs().max() <= 1e-4 * want.abs().max()  # every row again once the block ends


def test_quant_linear_refuses_what_does_not_fit(op):
    from llmserve.model.quantize import quantize

    w = quantize(torch.randn(8, 64), "int4")
    ql = torch.ops.llmserve.quant_linear
    with pytest.raises(RuntimeError, match=r"x \[M, 64\]"):
        ql(torch.ones(2, 63), w.q, w.d, w.m, None, 64)
    with pytest.raises(RuntimeError, match="inputs take"):
        ql(torch.ones(2, 96), w.q, w.d, w.m, None, 96)
    with pytest.raises(RuntimeError, match="int4 weights are uint8"):
        ql(torch.ones(2, 64), w.q.view(torch.int8), w.d, w.m, None, 64)
    with pytest.raises(RuntimeError, match="m is like d"):
        ql(torch.ones(2, 64), w.q, w.d, w.d[:1], None, 64)
    with pytest.raises(RuntimeError, match="bias"):
        ql(torch.ones(2, 64), w.q, w.d, w.m, torch.ones(3), 64)
    with pytest.raises(RuntimeError, match="0 to 16"):
        kernels.set_quant_max_rows(17)
