// llmserve::lora_add(y, x, lora_a, lora_b, row_slots, out_slices): adds each row's LoRA delta to
// y in place, for a batch whose rows use different adapters (or none), with no per-row copy of
// any adapter's weights.
//
// Shapes (one dtype for all but row_slots: float32 or bfloat16):
//   x          [T, in]         the linear layer's input
//   y          [T, out]        its output (rows contiguous), updated in place
//   lora_a     [S, n * R, in]  per slot, the n slices' A matrices stacked on the rank
//   lora_b     [S, n * R, out] per slot, their B matrices transposed: slice j's R rows are used
//                              only over its own out_slices[j] columns (those after slice j - 1's)
//   row_slots  [T] int64       each row's slot; -1: no adapter (the row is left alone)
// Rows are grouped by slot. A slot with at least kGemmRows rows (a prefill) takes two GEMMs; the
// others go in blocks of up to kLoraMaxRows rows, and a block is one work item of the kernel
// (lora.h: its ISA variants in lora_kernel.h), the blocks spread over the threads:
//   t = x_rows @ lora_a[slot]^T                                      (the shrink)
//   y_rows[:, slice j] += t[:, jR:(j+1)R] @ lora_b[slot][jR:(j+1)R, slice j]   (the expand)
// A decode step's delta is a few million multiply-adds per layer. As torch ops it took three
// calls per linear at a fixed 25-60 us each (oneDNN's floor at these sizes); this pass costs
// 15-40 us in all at 32 rows (bf16, 2 threads), bound by its FMAs. (AVX512-BF16 dot products
// measured no faster: they issue on one port where FMAs issue on two.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "gemv.h"  // current_isa
#include "lora.h"

namespace {

using llmserve::KvType;

using llmserve::LoraBlockFn;

// A slot with this many rows in one call takes GEMMs instead of the kernel: the measured
// crossover over SmolLM2's four fused linears in bf16 (a decode step has one row per sequence).
constexpr int64_t kGemmRows = 192;

template <typename T>
void lora_block_portable(const llmserve::LoraBlock& blk, const llmserve::LoraGeom& geo) {
  const T* a = static_cast<const T*>(blk.a);
  const T* b = static_cast<const T*>(blk.b);
  float* t = blk.scratch;
  for (int64_t m = 0; m < blk.m; ++m) {
    const T* x = static_cast<const T*>(blk.x[m]);
    T* y = static_cast<T*>(blk.y[m]);
    for (int64_t r = 0; r < geo.width; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < geo.in; ++i) s += static_cast<float>(x[i]) * static_cast<float>(a[r * geo.in + i]);
      t[r] = s;
    }
    for (int64_t j = 0, c0 = 0; j < geo.n; c0 += geo.slices[j++])
      for (int64_t c = c0; c < c0 + geo.slices[j]; ++c) {
        float s = static_cast<float>(y[c]);
        for (int64_t r = j * geo.rank; r < (j + 1) * geo.rank; ++r) s += t[r] * static_cast<float>(b[r * geo.out + c]);
        y[c] = static_cast<T>(s);
      }
  }
}

LoraBlockFn pick_block(KvType weight) {
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::pick_lora_avx512(weight);
    case llmserve::kAvx2: return llmserve::pick_lora_avx2(weight);
    default: return weight == KvType::kFloat ? &lora_block_portable<float> : &lora_block_portable<c10::BFloat16>;
  }
}

struct Block {
  int64_t slot, first, count;  // rows order[first, first + count) all use `slot`
};

// The rows grouped by slot (a counting sort): slot s's rows are order[start[s], start[s + 1]);
// rows without an adapter are left out.
struct SlotRows {
  std::vector<int64_t> order, start;

  SlotRows(const int64_t* slots, int64_t rows, int64_t num_slots) : start(num_slots + 1, 0) {
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(slots[i] >= -1 && slots[i] < num_slots, "lora_add: row_slots[", i, "] = ", slots[i],
                  " is not a slot (", num_slots, ") or -1");
      if (slots[i] >= 0) ++start[slots[i] + 1];
    }
    for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
    order.resize(start[num_slots]);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < rows; ++i)
      if (slots[i] >= 0) order[next[slots[i]]++] = i;
  }
  int64_t count(int64_t s) const { return start[s + 1] - start[s]; }
};

// A slot's rows by GEMMs, for a slot with many rows (a prefill), where they beat the kernel:
// t = x_rows @ A^T, then per slice y_rows[:, slice j] += t_j @ B_j.
void add_by_gemm(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t slot,
                 const SlotRows& rows, at::IntArrayRef out_slices) {
  const int64_t rank = a.size(1) / static_cast<int64_t>(out_slices.size());
  const bool all = rows.count(slot) == x.size(0);  // every row: no gather
  const at::Tensor idx = all ? at::Tensor() : at::tensor(at::ArrayRef<int64_t>(rows.order.data() + rows.start[slot], rows.count(slot)));
  const at::Tensor t = at::mm(all ? x : x.index_select(0, idx), a[slot].t());
  at::Tensor delta = all ? y : at::empty({rows.count(slot), y.size(1)}, y.options());
  for (int64_t j = 0, c0 = 0; j < static_cast<int64_t>(out_slices.size()); c0 += out_slices[j++]) {
    const at::Tensor tj = t.narrow(1, j * rank, rank), bj = b[slot].narrow(0, j * rank, rank).narrow(1, c0, out_slices[j]);
    at::Tensor dj = delta.narrow(1, c0, out_slices[j]);
    all ? dj.addmm_(tj, bj) : at::mm_out(dj, tj, bj);
  }
  if (!all) y.index_add_(0, idx, delta);
}

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_slots,
              at::IntArrayRef out_slices) {
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_add: float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == dtype && a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_add: x, y, lora_a and lora_b must share one dtype");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && y.stride(1) == 1,
              "lora_add: x [T, in] and y [T, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "lora_add: lora_a [S, n * R, in] and lora_b [S, n * R, out], contiguous");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == x.size(0) && row_slots.scalar_type() == at::kLong,
              "lora_add: row_slots [T] int64");
  const int64_t n = static_cast<int64_t>(out_slices.size()), width = a.size(1), in = x.size(1), out = y.size(1);
  TORCH_CHECK(n > 0 && width % n == 0, "lora_add: n * R rows of A for n out_slices");
  int64_t total = 0;
  for (const int64_t o : out_slices) total += o;
  TORCH_CHECK(total == out, "lora_add: out_slices must add up to y's width");
  const at::Tensor slots = row_slots.contiguous();
  const SlotRows rows(slots.data_ptr<int64_t>(), slots.size(0), a.size(0));
  std::vector<Block> blocks;
  for (int64_t s = 0; s < a.size(0); ++s) {
    if (rows.count(s) >= kGemmRows) {
      add_by_gemm(y, x, a, b, s, rows, out_slices);
      continue;
    }
    for (int64_t k = rows.start[s]; k < rows.start[s + 1]; k += llmserve::kLoraMaxRows)
      blocks.push_back({s, k, std::min<int64_t>(llmserve::kLoraMaxRows, rows.start[s + 1] - k)});
  }
  if (blocks.empty()) return;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const LoraBlockFn fn = pick_block(dtype == at::kFloat ? KvType::kFloat : KvType::kBFloat16);
  const llmserve::LoraGeom geo{in, out, width, width / n, out_slices.data(), n};
  const int64_t esize = y.element_size();
  const char* ap = static_cast<const char*>(a.data_ptr());
  const char* bp = static_cast<const char*>(b.data_ptr());
  const char* xp = static_cast<const char*>(xc.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(llmserve::kLoraMaxRows * (in + width));
    llmserve::LoraBlock blk{};
    blk.scratch = scratch.data();
    for (int64_t k = b0; k < b1; ++k) {
      blk.m = blocks[k].count;
      blk.a = ap + blocks[k].slot * width * in * esize;
      blk.b = bp + blocks[k].slot * width * out * esize;
      for (int64_t m = 0; m < blk.m; ++m) {
        const int64_t row = rows.order[blocks[k].first + m];
        blk.x[m] = xp + row * xc.stride(0) * esize;
        blk.y[m] = yp + row * y.stride(0) * esize;
      }
      fn(blk, geo);
    }
  });
}

void lora_add_meta(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   at::IntArrayRef) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, int[] out_slices) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("lora_add", &lora_add); }
TORCH_LIBRARY_IMPL(llmserve, Meta, m) { m.impl("lora_add", &lora_add_meta); }
