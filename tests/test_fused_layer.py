"""llmserve::decoder_layer, a whole decoder layer of a compiled step in one native op, computes
what the layer's own modules compute (their native ops: the linears, the cache write and the
whole-step attention), for float, int8 and int4 linears, float32 and bfloat16 activations, a
mixed step of decode rows and prefill chunks, widths that end in part vectors, and every ISA
variant this CPU runs; it writes the same K/V into the cache and leaves a compiled step's
padding rows zero."""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels
from llmserve.model.attention import AttentionMetadata, PrefillBatch
from llmserve.model.config import ModelConfig
from llmserve.model.llama import DecoderLayer, Rotary
from llmserve.model.packed import pack_linears, packs_correctly
from llmserve.model.quantize import quantize_model, use_native_quant

# (hidden, heads, kv heads, head_dim, intermediate): vector-wide rows; and rows, heads and halves
# of heads that end in part vectors (rotary halves of 12)
SHAPES = [(128, 4, 2, 64, 192), (88, 4, 2, 24, 100)]
BLOCK = 16


def layer_of(shape, weights: str, dtype: torch.dtype, seed: int = 0) -> tuple[DecoderLayer, ModelConfig]:
    hidden, heads, kvh, hd, inter = shape
    cfg = ModelConfig("llama", 64, hidden, inter, 1, heads, kvh, hd, 256, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    layer = DecoderLayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    layer = layer.to(dtype)
    if weights == "float":
        if not packs_correctly(dtype):
            pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
        assert pack_linears(layer, dtype, native=True, gemv=True) == 4
    else:
        quantize_model(layer, weights)
        assert use_native_quant(layer, True) == 4
    layer.self_attn.attn.native = True
    return layer, cfg


def mixed_step(cfg: ModelConfig, dtype: torch.dtype, seed: int = 1):
    """Two decode rows (contexts of 20 and 5 tokens, their pasts already cached) and two prefill
    chunks (a fresh prompt of 6 tokens, and 3 tokens continuing a context of 10), then a padding
    chunk: x [11, hidden], rope, the cache and the metadata of a compiled step."""
    g = torch.Generator().manual_seed(seed)
    kvh, hd = cfg.num_key_value_heads, cfg.head_dim
    cache = torch.randn(2, 12, BLOCK, kvh, hd, generator=g).to(dtype)
    decode_tables = torch.tensor([[3, 5], [7, 0]])
    decode_lens = torch.tensor([20, 5])
    chunk_tables = torch.tensor([[9, 0], [2, 0], [0, 0]])
    starts, lens, contexts = torch.tensor([2, 8, 0]), torch.tensor([6, 3, 0]), torch.tensor([6, 10, 0])
    positions = torch.tensor([19, 4, *range(6), 7, 8, 9])
    slots = torch.tensor([5 * BLOCK + 3, 7 * BLOCK + 4, *(9 * BLOCK + p for p in range(6)), *(2 * BLOCK + p for p in (7, 8, 9))])
    meta = AttentionMetadata(slots, 2, decode_tables, decode_lens, [],
                             prefill_batch=PrefillBatch(starts, lens, contexts, chunk_tables))
    x = torch.randn(len(positions), cfg.hidden_size, generator=g).to(dtype)
    rope = Rotary(cfg).cos_sin(positions, dtype)
    return x, rope, cache, meta


def both_ways(layer: DecoderLayer, x, rope, cache, meta):
    """(the modules' output and cache, the fused op's output and cache), from the same cache."""
    caches = [cache.clone(), cache.clone()]
    with torch.inference_mode():
        layer.fused = False
        want = layer(x, rope, caches[0], meta)
        assert layer.fuse()
        got = layer(x, rope, caches[1], meta)
    return (want, caches[0]), (got, caches[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fused_layer_equals_the_layers_own_ops(cpu_isa, shape, weights, dtype, tol):
    layer, cfg = layer_of(shape, weights, dtype)
    x, rope, cache, meta = mixed_step(cfg, dtype)
    (want, want_cache), (got, got_cache) = both_ways(layer, x, rope, cache, meta)
    assert got.dtype == dtype and got.shape == x.shape
    scale = want.double().abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= tol * scale
    # the same K/V in the same slots, nothing else touched
    assert (got_cache.double() - want_cache.double()).abs().max().item() <= tol * want_cache.double().abs().max().item()
    untouched = torch.ones(2, 12 * BLOCK, dtype=torch.bool)
    untouched[:, meta.slot_mapping] = False
    assert torch.equal(got_cache.flatten(1, 2)[untouched], cache.flatten(1, 2)[untouched])


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_padding_rows_of_a_compiled_step_come_out_zero(cpu_isa, weights):
    """Under kernels.live_rows(1) (a batch-1 decode step padded to two rows) the real row is as
    without it and the padding row is zeros, whatever its input."""
    layer, cfg = layer_of(SHAPES[0], weights, torch.float32)
    x, rope, cache, meta = mixed_step(cfg, torch.float32)
    two = AttentionMetadata(meta.slot_mapping[:2], 2, meta.decode_block_tables, meta.decode_seq_lens, [],
                            prefill_batch=PrefillBatch(*(torch.zeros(2, dtype=torch.long) for _ in range(3)),
                                                       torch.zeros(2, 2, dtype=torch.long)))
    rope2 = (rope[0][:2], rope[1][:2])
    (want, _), _ = both_ways(layer, x[:2], rope2, cache, two)
    with torch.inference_mode(), kernels.live_rows(1):
        got = layer(x[:2], rope2, cache.clone(), two)
    assert (got[0] - want[0]).abs().max() <= 1e-4 * want[0].abs().max()
    assert not got[1].any()


def test_a_layer_without_native_linears_is_not_fused():
    """A layer whose linears run nn.Linear (no native handle) keeps its modules' ops."""
    assert kernels.load()
    hidden, heads, kvh, hd, inter = SHAPES[0]
    layer = DecoderLayer(ModelConfig("llama", 64, hidden, inter, 1, heads, kvh, hd, 256))
    layer.self_attn.attn.native = True
    assert not layer.fuse() and not layer.fused and layer.fused_handle is None


def test_the_op_refuses_a_layer_it_does_not_know():
    assert kernels.load()
    x = torch.zeros(2, 8)
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no weight is registered under handle"):
        torch.ops.llmserve.decoder_layer(x, torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 1, 16, 1, 4), z,
                                         z.view(2, 1), z, z, z, z, z.view(2, 1), 10**9)
