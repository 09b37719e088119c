"""Our network's logits equal transformers' on the same seeded random weights (float32, <= 1e-4)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve import kernels
from llmserve.model.attention import AttentionMetadata, PrefillSeq
from llmserve.model.loader import load_model
from llmserve.model.packed import pack_linears

TOL = 1e-4
PRESETS = ["tiny", "tiny-tied", "tiny-qwen2", "tiny-mistral"]  # GQA untied / MHA tied+llama3 rope / bias / mistral


class Paged:
    """Drives the model the way the model runner does: block tables, slot mapping, metadata."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 128):
        c = model.config
        self.model, self.bs = model, block_size
        self.caches = [torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
        self.next_block = 1  # block 0 is the null block
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, seq: int, start: int, n: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.bs < start + n:
            table.append(self.next_block)
            self.next_block += 1
        return [table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + n)]

    def run(self, chunks: list[tuple[int, list[int]]], lora=None) -> list[torch.Tensor]:
        """chunks: [(seq, new tokens)], decodes (1 token) first. Returns logits [n, vocab] per chunk.
        lora: the rows' LoRABatch, when the step has adapters."""
        ids, pos, slots, prefills, dec = [], [], [], [], []
        for seq, toks in chunks:
            start, n = self.lens.get(seq, 0), len(toks)
            q0 = len(ids)
            ids += toks
            pos += range(start, start + n)
            slots += self._slots(seq, start, n)
            self.lens[seq] = start + n
            if n == 1:
                dec.append(seq)
            else:
                prefills.append(PrefillSeq(q0, n, start + n, torch.tensor(self.tables[seq])))
        width = max([len(self.tables[s]) for s in dec], default=1)
        meta = AttentionMetadata(
            torch.tensor(slots), len(dec),
            torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in dec]).reshape(len(dec), width),
            torch.tensor([self.lens[s] for s in dec], dtype=torch.long), prefills,
        )
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta, lora))
        out, i = [], 0
        for _, toks in chunks:
            out.append(logits[i : i + len(toks)])
            i += len(toks)
        return out


@pytest.fixture(scope="module", params=PRESETS)
def loaded(request, model_factory):
    path = model_factory(request.param)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path, torch.float32), ref


WAYS = [  # (linear layers, attention)
    ("packed+gemv", "native"),  # the engine's default: oneDNN-packed, plain weights for few rows
    ("packed", "native"),
    ("packed", "torch"),
    ("plain", "native"),
    ("plain", "torch"),
]


@pytest.fixture(scope="module", params=WAYS, ids=["/".join(w) for w in WAYS])
def pair(request, loaded):
    """Every check runs five ways: oneDNN-packed linear layers, the same with plain weights for
    steps of few rows (llmserve::gemv, one of the native kernels), or nn.Linear, with the native
    decode-attention kernel or the pure-torch path."""
    linear, attention = request.param
    if attention == "native" and not kernels.load():
        pytest.skip("native kernels unavailable (no C++ compiler)")
    ours, ref = loaded
    ours = copy.deepcopy(ours)
    if linear.startswith("packed"):
        gemv = linear == "packed+gemv"
        assert pack_linears(ours, torch.float32, native=gemv, gemv=gemv) > 0
    ours.use_native_attention(attention == "native")
    return ours, ref


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill(pair):
    ours, ref = pair
    t = tokens(37, 1)
    (got,) = Paged(ours).run([(0, t)])
    assert (got - ref_logits(ref, t)).abs().max() <= TOL


def test_chunked_prefill(pair):
    ours, ref = pair
    t = tokens(41, 2)
    p = Paged(ours)
    got = torch.cat([p.run([(0, t[a:b])])[0] for a, b in [(0, 5), (5, 6), (6, 19), (19, 41)]])
    assert (got - ref_logits(ref, t)).abs().max() <= TOL


def test_decode_steps(pair):
    ours, ref = pair
    t = tokens(9, 3)
    p = Paged(ours)
    last = p.run([(0, t)])[0][-1]
    for _ in range(16):
        t.append(int(last.argmax()))
        last = p.run([(0, t[-1:])])[0][-1]
        assert (last - ref_logits(ref, t)[-1]).abs().max() <= TOL


def test_mixed_batch(pair):
    ours, ref = pair
    seqs = {0: tokens(23, 4), 1: tokens(7, 5), 2: tokens(30, 6), 3: tokens(12, 7)}
    p = Paged(ours)
    p.run([(0, seqs[0][:20]), (1, seqs[1][:6]), (2, seqs[2][:10])])
    # decodes of 0 and 1 at different positions, a continued prefill of 2, a fresh prefill of 3
    got = p.run([(0, seqs[0][20:21]), (1, seqs[1][6:7]), (2, seqs[2][10:30]), (3, seqs[3])])
    expect = [ref_logits(ref, seqs[0][:21])[-1:], ref_logits(ref, seqs[1])[-1:], ref_logits(ref, seqs[2])[10:], ref_logits(ref, seqs[3])]
    for g, e in zip(got, expect, strict=True):
        assert (g - e).abs().max() <= TOL


def test_sharded_checkpoint_loads_the_same(tiny_model, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    t = tokens(20, 8)
    a = Paged(load_model(tmp_path, torch.float32)).run([(0, t)])[0]
    b = Paged(load_model(tiny_model, torch.float32)).run([(0, t)])[0]
    assert torch.equal(a, b)
