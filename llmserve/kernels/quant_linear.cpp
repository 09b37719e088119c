// llmserve::quant_linear(x [M, in], q, d, m?, bias?, in) -> [M, out]: a linear layer over a
// block-quantized weight (quant.h: int8 = Q8_0, int4 = Q4_1), read as stored.
//   M <= quant_max_rows(): the quantized GEMV (the ISA variant, or the portable loop), output rows
//       split across threads in contiguous runs; bound by reading the packed bytes once. Up to
//       kQDotMaxRows rows of bf16 activations are read and written as bf16 by the kernel (for
//       int4 weights, by the AVX512-BF16 dot product where the CPU has it: quant_dpbf16.h). Rows
//       past live_rows() (gemv.h: a compiled step's padding) are zeros, not computed.
//   more rows (prefill, large batches), where the layer has a oneDNN-packed float copy (packed:
//       its handle, llmserve.model.packed; the plan's quant_large_steps): llmserve::onednn_linear.
//   more rows otherwise: each thread dequantizes a tile of output rows into a
//       buffer that stays in its cache (fp32, or bf16 for bf16 activations) and runs the BLAS GEMM
//       on it: tile [n, in] x x^T -> rows of y^T.
// llmserve::qlinear(x, handle): the same, over a weight registered once (quant_register) in a
// process-wide table, as packed_linear.cpp keeps packed weights: a model's layers call it, so a
// compiled graph takes an int a layer instead of three or four tensors (each one an input the
// graph's caller fetches, checks and passes on every step).
// llmserve::quant_dequant(q, d, m?, in, bf16) -> [out, in]: the dequantized weight (the same
// values every path computes with).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <cmath>
#include <optional>

#include "gemv.h"
#include "handles.h"
#include "ops.h"
#include "quant.h"

namespace {

using llmserve::kQBlock;
using llmserve::QWeight;

template <bool Q4>
float portable_weight(const QWeight& w, int64_t o, int64_t k) {
  const uint8_t* qr = w.q + o * w.row_bytes;
  const int64_t b = k / kQBlock, j = k % kQBlock;
  const float d = llmserve::half_to_float(w.d[o * w.kb + b]);
  if constexpr (Q4) {
    const uint8_t byte = qr[b * 16 + (j & 15)];
    return std::fma(static_cast<float>(j < 16 ? byte & 15 : byte >> 4), d, llmserve::half_to_float(w.m[o * w.kb + b]));
  } else {
    return static_cast<float>(reinterpret_cast<const int8_t*>(qr)[k]) * d;
  }
}

template <bool Q4>
void qgemv_portable(const float* x, int64_t m, const QWeight& w, const float* bias, int64_t o0, int64_t o1, float* y,
                    int64_t out, int64_t /*pf*/) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r = 0; r < m; ++r) {
      float s = bias ? bias[o] : 0.f;
      for (int64_t k = 0; k < w.in; ++k) s += x[r * w.in + k] * portable_weight<Q4>(w, o, k);
      y[r * out + o] = s;
    }
}

void qdequant_portable(const QWeight& w, int64_t o0, int64_t o1, void* dst, bool bf16) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t k = 0; k < w.in; ++k) {
      const float v = w.int4() ? portable_weight<true>(w, o, k) : portable_weight<false>(w, o, k);
      if (bf16) {  // round to nearest even, as torch rounds
        uint32_t bits;
        __builtin_memcpy(&bits, &v, sizeof(bits));
        static_cast<uint16_t*>(dst)[(o - o0) * w.in + k] =
            v != v ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
      } else {
        static_cast<float*>(dst)[(o - o0) * w.in + k] = v;
      }
    }
}

llmserve::QGemvFn pick_gemv(bool int4) {
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::pick_qgemv_avx512(int4);
    case llmserve::kAvx2: return llmserve::pick_qgemv_avx2(int4);
    default: return int4 ? &qgemv_portable<true> : &qgemv_portable<false>;
  }
}

llmserve::QDequantFn pick_dequant() {
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::pick_qdequant_avx512();
    case llmserve::kAvx2: return llmserve::pick_qdequant_avx2();
    default: return &qdequant_portable;
  }
}

std::atomic<int64_t> max_rows{4};  // steps of at most this many rows take the quantized GEMV

void set_quant_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= llmserve::kGemvMaxRows, "set_quant_max_rows: 0 to ", llmserve::kGemvMaxRows,
              " rows, not ", rows);
  max_rows.store(rows);
}

int64_t quant_max_rows() { return max_rows.load(); }

QWeight checked(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t in) {
  const bool int4 = m.has_value();
  TORCH_CHECK(in > 0 && q.dim() == 2 && d.dim() == 2, "quant_linear: q [out, bytes] and d [out, blocks]");
  const int64_t out = q.size(0), kb = (in + kQBlock - 1) / kQBlock;
  TORCH_CHECK(q.scalar_type() == (int4 ? at::kByte : at::kChar), "quant_linear: int4 weights are uint8, int8 weights int8");
  TORCH_CHECK(q.size(1) == kb * (int4 ? 16 : 32), "quant_linear: ", in, " inputs take ", kb * (int4 ? 16 : 32),
              " bytes a row, not ", q.size(1));
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.size(0) == out && d.size(1) == kb, "quant_linear: d is float16 [out, ", kb, "]");
  TORCH_CHECK(!int4 || (m->scalar_type() == at::kHalf && m->sizes() == d.sizes()), "quant_linear: m is like d");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && (!int4 || m->is_contiguous()), "quant_linear: contiguous tensors");
  return QWeight{static_cast<const uint8_t*>(q.data_ptr()), static_cast<const uint16_t*>(d.data_ptr()),
                 int4 ? static_cast<const uint16_t*>(m->data_ptr()) : nullptr, in, kb, q.size(1)};
}

// bf16 activations, few rows, an ISA variant: the GEMV reads and writes bf16 itself
llmserve::QGemvBf16Fn pick_bf16_gemv(const at::Tensor& x, const QWeight& w) {
  if (x.scalar_type() != at::kBFloat16 || x.size(0) > llmserve::kQDotMaxRows) return nullptr;
  static const bool dpbf16 = __builtin_cpu_supports("avx512bf16");
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::pick_qgemv_bf16_avx512(w.int4(), dpbf16);
    case llmserve::kAvx2: return llmserve::pick_qgemv_bf16_avx2(w.int4());
    default: return nullptr;
  }
}

at::Tensor gemv_path(const at::Tensor& x, const QWeight& w, int64_t out, const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), m = llmserve::live_rows(rows);
  const llmserve::QGemvBf16Fn bf16_fn = pick_bf16_gemv(x, w);
  const bool dot = bf16_fn != nullptr;  // reads and writes bf16; the others fp32
  const at::Tensor xc = dot ? x.contiguous() : x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bf = bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  at::Tensor y = at::empty({rows, out}, x.options().dtype(dot ? at::kBFloat16 : at::kFloat));
  std::memset(static_cast<char*>(y.data_ptr()) + m * out * y.element_size(), 0, (rows - m) * out * y.element_size());
  if (m == 0) return x.scalar_type() == y.scalar_type() ? y : y.to(x.scalar_type());
  const float* bp = bf ? bf->data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(16, out / (4 * at::get_num_threads()));
  const int64_t pf = llmserve::gemv_prefetch_bytes();
  if (dot) {
    const llmserve::QGemvBf16Fn fn = bf16_fn;
    const uint16_t* xp = static_cast<const uint16_t*>(xc.data_ptr());
    uint16_t* yp = static_cast<uint16_t*>(y.data_ptr());
    at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) { fn(xp, m, w, bp, o0, o1, yp, out, pf); });
    return y;
  }
  const llmserve::QGemvFn fn = pick_gemv(w.int4());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) { fn(xp, m, w, bp, o0, o1, yp, out, pf); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor tile_path(const at::Tensor& x, const QWeight& w, int64_t out, const std::optional<at::Tensor>& bias) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::ScalarType dt = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xt = x.to(dt).contiguous().t();  // [in, M]
  at::Tensor yt = at::empty({out, x.size(0)}, x.options().dtype(dt));
  // tiles of about 256 KB dequantized (a core's cache), and at least two a thread
  const int64_t elem = bf16 ? 2 : 4, threads = at::get_num_threads();
  int64_t n = std::max<int64_t>(16, (256 << 10) / (w.in * elem)) / 16 * 16;
  n = std::max<int64_t>(16, std::min(n, (out + 2 * threads - 1) / (2 * threads)));
  const int64_t tiles = (out + n - 1) / n;
  const llmserve::QDequantFn dequant = pick_dequant();
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the workers take the caller's
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::Tensor tile = at::empty({n, w.in}, x.options().dtype(dt));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o0 = t * n, rows = std::min(n, out - o0);
      dequant(w, o0, o0 + rows, tile.data_ptr(), bf16);
      at::Tensor dst = yt.narrow(0, o0, rows);
      at::mm_out(dst, tile.narrow(0, 0, rows), xt);
    }
  });
  at::Tensor y = yt.t().contiguous();
  if (bias) y.add_(*bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

at::Tensor run(const at::Tensor& x, const QWeight& w, int64_t out, const std::optional<at::Tensor>& bias,
               int64_t packed) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in, "quant_linear: x [M, ", w.in, "]");
  if (x.size(0) == 0) return at::empty({0, out}, x.options());
  if (x.size(0) <= max_rows.load(std::memory_order_relaxed)) return gemv_path(x, w, out, bias);
  return packed >= 0 ? llmserve::onednn_linear(x, packed) : tile_path(x, w, out, bias);
}

struct Registered {
  at::Tensor q, d;  // held, so that w's pointers stay valid
  std::optional<at::Tensor> m, bias;
  QWeight w;
  int64_t packed;
};

llmserve::HandleTable<Registered> table;

void quant_register(int64_t handle, const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m,
                    const std::optional<at::Tensor>& bias, int64_t in, int64_t packed) {
  const QWeight w = checked(q, d, m, in);
  TORCH_CHECK(!bias || bias->numel() == q.size(0), "quant_register: bias [out]");
  table.put(handle, Registered{q, d, m, bias, w, packed});
}

void quant_release(int64_t handle) { table.erase(handle); }

}  // namespace

namespace llmserve {

at::Tensor qlinear(const at::Tensor& x, int64_t handle) {
  const Registered r = table.get(handle, "qlinear");
  return run(x, r.w, r.q.size(0), r.bias, r.packed);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m,
                        const std::optional<at::Tensor>& bias, int64_t in, int64_t packed) {
  TORCH_CHECK(!bias || bias->numel() == q.size(0), "quant_linear: bias [out]");
  return run(x, checked(q, d, m, in), q.size(0), bias, packed);
}

at::Tensor quant_dequant(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t in,
                         bool bf16) {
  const QWeight w = checked(q, d, m, in);
  at::Tensor dst = at::empty({q.size(0), in}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const QDequantFn fn = pick_dequant();
  at::parallel_for(0, q.size(0), 64, [&](int64_t o0, int64_t o1) {
    fn(w, o0, o1, static_cast<char*>(dst.data_ptr()) + o0 * in * (bf16 ? 2 : 4), bf16);
  });
  return dst;
}

}  // namespace llmserve

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor d, Tensor? m, Tensor? bias, int in_features, int packed=-1) -> Tensor");
  m.def("quant_register(int handle, Tensor q, Tensor d, Tensor? m, Tensor? bias, int in_features, int packed) -> ()");
  m.def("quant_release(int handle) -> ()");
  m.def("qlinear(Tensor x, int handle) -> Tensor");
  m.def("quant_dequant(Tensor q, Tensor d, Tensor? m, int in_features, bool bf16) -> Tensor");
  m.def("set_quant_max_rows(int rows) -> ()");
  m.def("quant_max_rows() -> int");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("quant_linear", &llmserve::quant_linear);
  m.impl("quant_dequant", &llmserve::quant_dequant);
  m.impl("qlinear", &llmserve::qlinear);
}

TORCH_LIBRARY_IMPL(llmserve, CatchAll, m) {
  m.impl("set_quant_max_rows", &set_quant_max_rows);
  m.impl("quant_max_rows", &quant_max_rows);
  m.impl("quant_register", &quant_register);
  m.impl("quant_release", &quant_release);
}
