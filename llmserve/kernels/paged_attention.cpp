// Decode attention straight from the paged KV cache: one query token per sequence, no gather.
// Below it, paged_attention: a whole flat batch (decode rows, then prefill chunks) in one op, for
// compiled steps.
//
// Shapes (q and out share a dtype, float32 or bfloat16; the cache may be either, independently):
//   q            [D, H, hd]            one query token per sequence
//   k_cache      [num_blocks, block_size, kvh, hd]   (v_cache likewise)
//   block_tables [D, max_blocks] int64  the sequence's blocks in order (padding is never read)
//   seq_lens     [D] int64              tokens to attend to, the new one included; 0 (a padded
//                                       row) reads nothing and gives zeros
//   out          [D, H, hd]
// Query heads h*g .. h*g+g-1 share KV head h (g = H / kvh). Scores, softmax and the weighted sum
// of V are computed in fp32. Work items are (sequence, KV head, split): when there are fewer
// (sequence, KV head) pairs than twice the threads, each sequence's blocks are split too and the
// partial results merged (flash-decoding), so batch 1 keeps every core busy.
//
// Variants (decode.h): AVX-512 and AVX2 + FMA builds of one kernel for head_dim 16, 32, 64 and
// 128, and a portable loop for everything else, in the ISA that isa.cpp keeps for the process.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode.h"
#include "gemv.h"
#include "ops.h"

namespace {

using llmserve::DecodeFn;
using llmserve::DecodeGeom;
using llmserve::DecodeItem;
using llmserve::KvType;

DecodeFn pick(int isa, KvType kv, bool q_bf16, int64_t hd) {
  if (isa == llmserve::kAvx512) {
    const bool dpbf16 = __builtin_cpu_supports("avx512bf16");
    return llmserve::pick_avx512(kv, q_bf16, dpbf16, hd);
  }
  return isa == llmserve::kAvx2 ? llmserve::pick_avx2(kv, hd) : nullptr;
}

inline float as_float(float x) { return x; }
inline float as_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float query(const DecodeItem& it, int64_t i) {
  return it.q_bf16 ? as_float(static_cast<const uint16_t*>(it.q)[i]) : static_cast<const float*>(it.q)[i];
}

// The portable loop, same contract as the variants (decode.h): any head_dim, plain arithmetic.
template <typename T>
void attend_portable(const DecodeItem& it, const DecodeGeom& geo) {
  const int64_t g = geo.g, hd = geo.hd, bs = geo.block_size;
  const T* kbase = static_cast<const T*>(it.k);
  const T* vbase = static_cast<const T*>(it.v);
  const int64_t t0 = it.first_block * bs, n_tok = std::min(it.end_block * bs, it.len) - t0;
  float* acc = it.partial;
  float* m = acc + g * hd;
  float* l = m + g;
  float* scores = it.scratch;  // [n_tok]
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t j = 0; j < g; ++j) {
    float mj = -INFINITY;
    for (int64_t i = 0; i < n_tok; ++i) {
      const int64_t t = t0 + i;
      const T* k = kbase + it.table[t / bs] * geo.block_stride + (t % bs) * geo.kv_stride;
      float s = 0.f;
      for (int64_t c = 0; c < hd; ++c) s += query(it, j * hd + c) * as_float(k[c]);
      scores[i] = s * geo.scale;
      mj = std::max(mj, scores[i]);
    }
    float lj = 0.f;
    float* a = acc + j * hd;
    for (int64_t i = 0; i < n_tok; ++i) {
      const int64_t t = t0 + i;
      const T* v = vbase + it.table[t / bs] * geo.block_stride + (t % bs) * geo.kv_stride;
      const float p = std::exp(scores[i] - mj);
      lj += p;
      for (int64_t c = 0; c < hd; ++c) a[c] += p * as_float(v[c]);
    }
    m[j] = n_tok > 0 ? mj : -INFINITY;
    l[j] = lj;
  }
}

constexpr int64_t kMinBlocksPerSplit = 4;
constexpr int64_t kMaxHeadDim = 512;

// Splits per sequence: 1 when the (sequence, KV head) pairs that span more than one block (a
// padded row of the compiled graph spans one) already give every thread two items.
int64_t choose_splits(const int64_t* lens, int64_t d, int64_t kvh, int64_t block_size, int64_t max_blocks) {
  const int64_t threads = at::get_num_threads();
  const int64_t items = kvh * std::count_if(lens, lens + d, [&](int64_t n) { return n > block_size; });
  if (items >= 2 * threads) return 1;
  const int64_t want = (2 * threads + std::max<int64_t>(items, 1) - 1) / std::max<int64_t>(items, 1);
  return std::max<int64_t>(1, std::min(want, max_blocks / kMinBlocksPerSplit));
}

void check_decode_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  for (const auto& t : {q, k_cache})
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                "paged_decode_attention supports float32 and bfloat16, not ", t.scalar_type());
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim ", q.size(2), " is over ", kMaxHeadDim);
  TORCH_CHECK(tables.dim() == 2 && lens.dim() == 1, "block_tables [D, max_blocks], seq_lens [D]");
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table per query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1), block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < lens.size(0); ++i) {
    TORCH_CHECK(lp[i] >= 0 && lp[i] <= width * block_size, "seq_lens[", i, "] = ", lp[i], " is outside [0, ",
                width * block_size, "]");
    for (int64_t b = 0; b < (lp[i] + block_size - 1) / block_size; ++b)  // every block that will be read
      TORCH_CHECK(tp[i * width + b] >= 0 && tp[i * width + b] < num_blocks, "block_tables[", i, ", ", b, "] = ",
                  tp[i * width + b], " is not a block of this cache (", num_blocks, " blocks)");
  }
}

// out[s, h*g + j] (T: out's dtype) for the item w = s * kvh + h: the merge of its splits' partials
// for query head j (decode.h), normalised
template <typename T>
void merge_item(const float* parts, int64_t splits, int64_t g, int64_t hd, T* out_rows) {
  const int64_t item = g * (hd + 2);
  for (int64_t j = 0; j < g; ++j) {
    T* out = out_rows + j * hd;
    if (splits == 1) {  // one partial: only the normalisation (l = 0: a row of length 0, acc 0)
      const float l = parts[g * hd + g + j];
      const float inv = l == 0.f ? 0.f : 1.f / l;
      for (int64_t c = 0; c < hd; ++c) out[c] = static_cast<T>(parts[j * hd + c] * inv);
      continue;
    }
    float mx = -INFINITY;
    for (int64_t k = 0; k < splits; ++k)
      if (parts[k * item + g * hd + g + j] > 0.f) mx = std::max(mx, parts[k * item + g * hd + j]);
    float total = 0.f;
    float o[kMaxHeadDim];
    std::fill(o, o + hd, 0.f);
    for (int64_t k = 0; k < splits; ++k) {
      const float* p = parts + k * item;
      const float lk = p[g * hd + g + j];
      if (!(lk > 0.f) && !std::isnan(lk)) continue;  // an empty split
      const float wk = std::exp(p[g * hd + j] - mx);
      total += wk * lk;
      for (int64_t c = 0; c < hd; ++c) o[c] += wk * p[j * hd + c];
    }
    const float inv = total == 0.f ? 0.f : 1.f / total;  // every split empty: a row of length 0
    for (int64_t c = 0; c < hd; ++c) out[c] = static_cast<T>(o[c] * inv);
  }
}

template <typename T>
void merge_into(const float* parts, int64_t splits, int64_t g, int64_t hd, at::Tensor& out, int64_t w) {
  merge_item(parts, splits, g, hd, out.data_ptr<T>() + w * g * hd);  // (s, h*g + j) is row w*g + j
}

// Decode attention into out [D, H, hd] (contiguous, q's dtype; may be rows of a larger tensor).
void decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor out) {
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  check_decode_args(q, k_cache, v_cache, tables, lens);
  const at::Tensor qc = q.contiguous();
  const int64_t d = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t block_size = k_cache.size(1), kvh = k_cache.size(2), g = heads / kvh, width = tables.size(1);
  const DecodeGeom geo{g, hd, block_size, kvh * hd, block_size * kvh * hd, static_cast<float>(scale)};
  const KvType kv = k_cache.scalar_type() == at::kFloat ? KvType::kFloat : KvType::kBFloat16;
  const DecodeFn fn = pick(llmserve::current_isa(), kv, q.scalar_type() == at::kBFloat16, hd);
  const DecodeFn portable = kv == KvType::kFloat ? &attend_portable<float> : &attend_portable<uint16_t>;

  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t max_blocks = d ? (*std::max_element(lp, lp + d) + block_size - 1) / block_size : 0;
  const int64_t splits = choose_splits(lp, d, kvh, block_size, max_blocks);
  const int64_t per_split = (max_blocks + splits - 1) / std::max<int64_t>(splits, 1);
  // Splits of one (sequence, KV head) are adjacent work items; with one split an item merges (normalises)
  // its own partial at once, else a second pass merges each item's splits.
  at::Tensor partials = at::empty({splits == 1 ? 0 : d * kvh * splits, g * (hd + 2)}, qc.options().dtype(at::kFloat));
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "decode_into: out must be contiguous, in q's dtype");
  const char* qp = static_cast<const char*>(qc.data_ptr());
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const auto merge = q_bf16 ? &merge_into<c10::BFloat16> : &merge_into<float>;
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const int64_t elem = k_cache.element_size();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // work item w = (s * kvh + h) * splits + k, dealt round-robin to the threads: a contiguous share
  // would give one thread every split of a lone long sequence and the other the padded rows
  const int64_t work = d * kvh * splits, lanes = std::min<int64_t>(work, at::get_num_threads());
  at::parallel_for(0, lanes, 1, [&](int64_t lane0, int64_t lane1) {
    std::vector<float> scratch(llmserve::scratch_floats(g, hd, per_split * block_size) + (splits == 1 ? g * (hd + 2) : 0));
    float* own = scratch.data() + (scratch.size() - g * (hd + 2));  // the partial of an unsplit item
    for (int64_t lane = lane0; lane < lane1; ++lane) {
      for (int64_t w = lane; w < work; w += lanes) {
        const int64_t s = w / (kvh * splits), h = (w / splits) % kvh, k = w % splits;
        const int64_t nb = (lp[s] + block_size - 1) / block_size, per = (nb + splits - 1) / splits;
        float* partial = splits == 1 ? own : partials.data_ptr<float>() + w * g * (hd + 2);
        const DecodeItem item{qp + (s * heads + h * g) * hd * qc.element_size(), q_bf16, kp + h * hd * elem,
                              vp + h * hd * elem, tp + s * width, std::min(k * per, nb), std::min((k + 1) * per, nb),
                              lp[s], partial, scratch.data()};
        (fn ? fn : portable)(item, geo);
        if (splits == 1) merge(partial, 1, g, hd, out, w);
      }
    }
  });
  if (splits > 1)
    at::parallel_for(0, d * kvh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) merge(partials.data_ptr<float>() + w * splits * g * (hd + 2), splits, g, hd, out, w);
    });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  decode_into(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  return out;
}

// One prefill chunk: queries [n, H, hd] at positions ctx-n .. ctx-1 of their sequence, attending
// causally to the sequence's first ctx tokens. A fresh prompt (ctx == n) reads its own new K/V; a
// continued one gathers its blocks from the cache (written before this call).
at::Tensor prefill_one(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& table, int64_t ctx, double scale) {
  const int64_t n = q.size(0), kvh = k_cache.size(2), hd = k_cache.size(3), block_size = k_cache.size(1);
  at::Tensor keys = k_new, vals = v_new;
  std::optional<at::Tensor> mask;
  if (ctx != n) {
    const at::Tensor blocks = table.narrow(0, 0, (ctx + block_size - 1) / block_size);
    keys = k_cache.index_select(0, blocks).view({-1, kvh, hd}).narrow(0, 0, ctx).to(q.scalar_type());
    vals = v_cache.index_select(0, blocks).view({-1, kvh, hd}).narrow(0, 0, ctx).to(q.scalar_type());
    const at::Tensor q_pos = at::arange(ctx - n, ctx, table.options());
    mask = at::arange(ctx, table.options()).unsqueeze(0) <= q_pos.unsqueeze(1);  // [n, ctx] bool
  }
  const at::Tensor out = at::scaled_dot_product_attention(
      q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0), mask,
      0.0, /*is_causal=*/ctx == n, scale, /*enable_gqa=*/kvh != q.size(1));
  return out.squeeze(0).transpose(0, 1);
}

}  // namespace

namespace llmserve {

// Attention for a whole flat batch (a compiled step): the first D rows of q are decode rows
// (block_tables [D, W], seq_lens [D], as paged_decode_attention); then prefill chunk p covers rows
// query_start[p] .. query_start[p] + query_len[p] - 1, with context_len[p] tokens after this step
// and its blocks in prefill_tables[p]. A chunk of query_len 0 is padding and is skipped. Every row
// is a decode row or lies in one chunk, so out needs no zeroing. k, v: [T, kvh, hd], this step's new K/V.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& context_len,
                           const at::Tensor& prefill_tables, double scale) {
  const int64_t d = block_tables.size(0), t = q.size(0);
  TORCH_CHECK(d <= t && k.size(0) == t && v.size(0) == t, "decode rows and new K/V must fit the batch");
  TORCH_CHECK(query_start.size(0) == query_len.size(0) && context_len.size(0) == query_len.size(0) &&
                  prefill_tables.size(0) == query_len.size(0), "one start, length, context and table per chunk");
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous: decode rows are written in place
  if (d) decode_into(q.narrow(0, 0, d), k_cache, v_cache, block_tables, seq_lens, scale, out.narrow(0, 0, d));
  const at::Tensor starts = query_start.contiguous(), lens = query_len.contiguous(), ctxs = context_len.contiguous();
  const int64_t block_size = k_cache.size(1);
  for (int64_t p = 0; p < lens.size(0); ++p) {
    const int64_t s = starts.data_ptr<int64_t>()[p], n = lens.data_ptr<int64_t>()[p], ctx = ctxs.data_ptr<int64_t>()[p];
    if (n == 0) continue;
    TORCH_CHECK(s >= d && s + n <= t && n <= ctx && ctx <= prefill_tables.size(1) * block_size,
                "prefill chunk ", p, " (start ", s, ", ", n, " tokens, context ", ctx, ") does not fit");
    out.narrow(0, s, n).copy_(prefill_one(q.narrow(0, s, n), k.narrow(0, s, n), v.narrow(0, s, n), k_cache, v_cache,
                                          prefill_tables[p], ctx, scale));
  }
  return out;
}

}  // namespace llmserve

TORCH_LIBRARY(llmserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start, Tensor query_len, Tensor context_len, Tensor prefill_tables, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention", &llmserve::paged_attention);
}
