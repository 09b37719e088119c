// llmserve::gemv(x [M, in], w [out, in], bias [out]?) -> [M, out]: a linear layer for M <= 16 rows
// over a plain weight (float32 or bfloat16), bound by reading the weight once. Output rows are
// split across threads in contiguous runs; each runs the ISA variant (gemv.h) or the portable loop.
// Rows past live_rows() (gemv.h) are zeros, not computed.
// Batch-1 decode steps take it (model/packed.py keeps a plain copy of each weight for them): on an
// AVX2 machine the packed oneDNN path read SmolLM2's float32 weights at about 42 GB/s, against 73
// for a plain streaming read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <optional>

#include "gemv.h"

namespace {

using llmserve::GemvFn;
using llmserve::KvType;

template <typename T>
void gemv_portable(const float* x, int64_t m, const void* wv, const float* bias, int64_t in, int64_t o0, int64_t o1,
                   float* y, int64_t out, int64_t /*pf*/) {
  const T* w = static_cast<const T*>(wv);
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r = 0; r < m; ++r) {
      float s = bias ? bias[o] : 0.f;
      for (int64_t i = 0; i < in; ++i) {
        float wf;
        if constexpr (sizeof(T) == 2) {
          const uint32_t bits = static_cast<uint32_t>(w[o * in + i]) << 16;
          __builtin_memcpy(&wf, &bits, sizeof(wf));
        } else {
          wf = w[o * in + i];
        }
        s += x[r * in + i] * wf;
      }
      y[r * out + o] = s;
    }
}

GemvFn pick(KvType weight) {
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::pick_gemv_avx512(weight);
    case llmserve::kAvx2: return llmserve::pick_gemv_avx2(weight);
    default: return weight == KvType::kFloat ? &gemv_portable<float> : &gemv_portable<uint16_t>;
  }
}

std::atomic<int64_t> prefetch_bytes{0};  // set by the plan (set_gemv_prefetch); 0: none

void set_gemv_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (1 << 16), "set_gemv_prefetch: 0 to 65536 bytes, not ", bytes);
  prefetch_bytes.store(bytes);
}

int64_t gemv_prefetch() { return prefetch_bytes.load(); }

std::atomic<int64_t> max_rows{4};  // packed layers' steps of at most this many rows take gemv

void set_gemv_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= llmserve::kGemvMaxRows, "set_gemv_max_rows: 0 to ", llmserve::kGemvMaxRows,
              " rows, not ", rows);
  max_rows.store(rows);
}

int64_t gemv_max_rows() { return max_rows.load(); }

std::atomic<int64_t> live{-1};  // -1: every row is live

void set_live_rows(int64_t rows) {
  TORCH_CHECK(rows >= -1, "set_live_rows: a row count, or -1 for all, not ", rows);
  live.store(rows);
}

}  // namespace

namespace llmserve {

int64_t gemv_row_limit() { return max_rows.load(std::memory_order_relaxed); }
int64_t gemv_prefetch_bytes() { return prefetch_bytes.load(std::memory_order_relaxed); }

int64_t live_rows(int64_t m) {
  const int64_t n = live.load(std::memory_order_relaxed);
  return n < 0 ? m : std::min(m, n);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, in] and w [out, in]");
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "gemv: at most ", kGemvMaxRows, " rows, not ", x.size(0));
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "gemv: float32 or bfloat16 weights");
  TORCH_CHECK(w.is_contiguous(), "gemv: the weight must be contiguous");
  const int64_t rows = x.size(0), m = live_rows(rows), in = w.size(1), out = w.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bf = bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  TORCH_CHECK(!bf || bf->numel() == out, "gemv: bias [out]");
  at::Tensor y = at::empty({rows, out}, xf.options());
  std::memset(y.data_ptr<float>() + m * out, 0, (rows - m) * out * sizeof(float));  // rows past live_rows()
  const GemvFn fn = pick(w.scalar_type() == at::kFloat ? KvType::kFloat : KvType::kBFloat16);
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf ? bf->data_ptr<float>() : nullptr;
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
  if (m > 0) {
    const int64_t grain = std::max<int64_t>(16, out / (4 * at::get_num_threads()));
    const int64_t pf = prefetch_bytes.load(std::memory_order_relaxed);
    at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) { fn(xp, m, wp, bp, in, o0, o1, yp, out, pf); });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace llmserve

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("set_gemv_prefetch(int bytes) -> ()");
  m.def("gemv_prefetch() -> int");
  m.def("set_gemv_max_rows(int rows) -> ()");
  m.def("gemv_max_rows() -> int");
  m.def("set_live_rows(int rows) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("gemv", &llmserve::gemv); }

TORCH_LIBRARY_IMPL(llmserve, CatchAll, m) {
  m.impl("set_gemv_prefetch", &set_gemv_prefetch);
  m.impl("gemv_prefetch", &gemv_prefetch);
  m.impl("set_gemv_max_rows", &set_gemv_max_rows);
  m.impl("gemv_max_rows", &gemv_max_rows);
  m.impl("set_live_rows", &set_live_rows);
}
