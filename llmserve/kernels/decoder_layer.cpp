// llmserve::decoder_layer(x, cos, sin, kv_cache, <a compiled step's attention metadata>, handle)
// -> [T, hidden]: one Llama decoder layer (model/llama.py DecoderLayer, without LoRA) in one op,
// over the layer registered under `handle` (decoder_layer_register):
//   h = rms_norm(x); q, k, v = qkv(h); q, k = rope(q), rope(k); cache <- k, v;
//   x = x + o(paged_attention(q, k, v)); x = x + down(silu(gate) * up), gate, up = gate_up(rms_norm(x))
// A compiled step otherwise runs a layer as about ten kernels and ops, each a call from the
// graph's wrapper through the dispatcher; here the linears (llmserve::qlinear or
// llmserve::onednn_linear), the cache write and the attention are direct calls, and the
// elementwise parts run on each row as it is produced (layer.h, in the process's ISA variant).
//
// Shapes: x [T, hidden], cos and sin [T, head_dim] (the rows' rotary tables, in x's dtype),
// kv_cache [2, num_blocks, block_size, kvh, hd], and the rest as llmserve::paged_attention takes
// them. x is float32 or bfloat16, like the norms' weights. Rows past live_rows(T) (gemv.h: a
// compiled step's padding) come out as zeros.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "handles.h"
#include "layer.h"
#include "ops.h"

namespace {

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden], in the activation dtype
  double eps;
  int64_t qkv, o, gate_up, down;       // linear handles ...
  bool qkv_q, o_q, gate_up_q, down_q;  // ... of llmserve::qlinear (true) or llmserve::onednn_linear
  int64_t heads, kv_heads, head_dim;
  double scale;
};

llmserve::HandleTable<Layer> table;

template <typename A>
float sv(A x) { return static_cast<float>(x); }
template <typename A>
A as(float x) { return static_cast<A>(x); }  // c10::BFloat16 rounds to nearest even, as torch does

template <typename A>
void rms_norm_portable(const void* xv, const void* wv, int64_t n, float eps, void* yv) {
  const A* x = static_cast<const A*>(xv);
  const A* w = static_cast<const A*>(wv);
  A* y = static_cast<A*>(yv);
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += sv(x[i]) * sv(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = as<A>(sv(w[i]) * sv(as<A>(sv(x[i]) * inv)));
}

template <typename A>
void rope_portable(const void* xv, int64_t x_stride, const void* cv, const void* sv_, int64_t heads, int64_t hd, void* yv) {
  const A* c = static_cast<const A*>(cv);
  const A* s = static_cast<const A*>(sv_);
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const A* x = static_cast<const A*>(xv) + h * x_stride;
    A* y = static_cast<A*>(yv) + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float lo = sv(x[i]), hi = sv(x[half + i]);
      y[i] = as<A>(lo * sv(c[i]) - hi * sv(s[i]));
      y[half + i] = as<A>(hi * sv(c[half + i]) + lo * sv(s[half + i]));
    }
  }
}

template <typename A>
void silu_mul_portable(const void* gv, const void* uv, int64_t n, void* yv) {
  const A* g = static_cast<const A*>(gv);
  const A* u = static_cast<const A*>(uv);
  A* y = static_cast<A*>(yv);
  for (int64_t i = 0; i < n; ++i) y[i] = as<A>(sv(g[i]) / (1.f + std::exp(-sv(g[i]))) * sv(u[i]));
}

template <typename A>
void add_portable(const void* av, const void* bv, int64_t n, void* yv) {
  const A* a = static_cast<const A*>(av);
  const A* b = static_cast<const A*>(bv);
  A* y = static_cast<A*>(yv);
  for (int64_t i = 0; i < n; ++i) y[i] = as<A>(sv(a[i]) + sv(b[i]));
}

template <typename A>
llmserve::LayerFns portable_fns() {
  return {&rms_norm_portable<A>, &rope_portable<A>, &silu_mul_portable<A>, &add_portable<A>};
}

llmserve::LayerFns pick_fns(bool bf16) {
  switch (llmserve::current_isa()) {
    case llmserve::kAvx512: return llmserve::layer_fns_avx512(bf16);
    case llmserve::kAvx2: return llmserve::layer_fns_avx2(bf16);
    default: return bf16 ? portable_fns<c10::BFloat16>() : portable_fns<float>();
  }
}

at::Tensor linear(const at::Tensor& x, int64_t handle, bool quantized) {
  return quantized ? llmserve::qlinear(x, handle) : llmserve::onednn_linear(x, handle);
}

// f(row) for the first `live` rows, a few rows to a thread; zeros in the rest of y
template <typename F>
void each_row(int64_t live, at::Tensor& y, const F& f) {
  at::parallel_for(0, live, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
  const int64_t row_bytes = y.stride(0) * y.element_size();
  std::memset(static_cast<char*>(y.data_ptr()) + live * row_bytes, 0, (y.size(0) - live) * row_bytes);
}

void decoder_layer_register(int64_t handle, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                            at::IntArrayRef linears, at::IntArrayRef quantized, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, double scale) {
  TORCH_CHECK(linears.size() == 4 && quantized.size() == 4, "decoder_layer_register: qkv, o, gate_up and down");
  TORCH_CHECK(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes() &&
                  post_norm.scalar_type() == input_norm.scalar_type(), "decoder_layer_register: norms [hidden]");
  TORCH_CHECK(head_dim % 2 == 0 && heads % kv_heads == 0, "decoder_layer_register: an even head_dim, whole KV groups");
  table.put(handle, Layer{input_norm.contiguous(), post_norm.contiguous(), eps, linears[0], linears[1], linears[2],
                          linears[3], quantized[0] != 0, quantized[1] != 0, quantized[2] != 0, quantized[3] != 0, heads,
                          kv_heads, head_dim, scale});
}

void decoder_layer_release(int64_t handle) { table.erase(handle); }

at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& context_len,
                         const at::Tensor& prefill_tables, int64_t handle) {
  const Layer L = table.get(handle, "decoder_layer");
  const int64_t t = x.size(0), hidden = x.size(1), hd = L.head_dim;
  const int64_t q_size = L.heads * hd, kv_size = L.kv_heads * hd;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && hidden == L.input_norm.size(0) &&
                  x.scalar_type() == L.input_norm.scalar_type(), "decoder_layer: x [T, hidden] contiguous, in the norms' dtype");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == t && cos.size(1) == hd && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == x.scalar_type(), "decoder_layer: cos, sin [T, head_dim] like x");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "decoder_layer: float32 or bfloat16 activations");
  const llmserve::LayerFns fns = pick_fns(bf16);
  const int64_t live = llmserve::live_rows(t), es = x.element_size();
  const auto row = [es](const at::Tensor& a, int64_t r) { return static_cast<char*>(a.data_ptr()) + r * a.stride(0) * es; };
  const float eps = static_cast<float>(L.eps);

  at::Tensor h = at::empty_like(x);
  each_row(live, h, [&](int64_t r) { fns.rms_norm(row(x, r), L.input_norm.data_ptr(), hidden, eps, row(h, r)); });
  const at::Tensor qkv = linear(h, L.qkv, L.qkv_q);  // [T, q + 2 kv]
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size && qkv.is_contiguous(), "decoder_layer: qkv_proj gives [T, q + 2 kv]");
  at::Tensor q = at::empty({t, L.heads, hd}, x.options()), k = at::empty({t, L.kv_heads, hd}, x.options());
  each_row(live, q, [&](int64_t r) {
    fns.rope(row(qkv, r), hd, row(cos, r), row(sin, r), L.heads, hd, row(q, r));
    fns.rope(row(qkv, r) + q_size * es, hd, row(cos, r), row(sin, r), L.kv_heads, hd, row(k, r));
  });
  if (live < t) k.narrow(0, live, t - live).zero_();
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, L.kv_heads, hd});
  llmserve::reshape_and_cache(k, v, kv_cache, slot_mapping);
  const at::Tensor attn = llmserve::paged_attention(q, k, v, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start,
                                                    query_len, context_len, prefill_tables, L.scale);
  const at::Tensor o = linear(attn.view({t, q_size}), L.o, L.o_q);
  at::Tensor mid = at::empty_like(x);
  each_row(live, mid, [&](int64_t r) {
    fns.add(row(x, r), row(o, r), hidden, row(mid, r));
    fns.rms_norm(row(mid, r), L.post_norm.data_ptr(), hidden, eps, row(h, r));
  });
  const at::Tensor gate_up = linear(h, L.gate_up, L.gate_up_q);  // [T, 2 inter]
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "decoder_layer: gate_up_proj gives [T, 2 inter]");
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::empty({t, inter}, x.options());
  each_row(live, act, [&](int64_t r) { fns.silu_mul(row(gate_up, r), row(gate_up, r) + inter * es, inter, row(act, r)); });
  const at::Tensor down = linear(act, L.down, L.down_q);
  at::Tensor out = at::empty_like(x);
  each_row(live, out, [&](int64_t r) { fns.add(row(mid, r), row(down, r), hidden, row(out, r)); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("decoder_layer_register(int handle, Tensor input_norm, Tensor post_norm, float eps, int[] linears, "
        "int[] quantized, int heads, int kv_heads, int head_dim, float scale) -> ()");
  m.def("decoder_layer_release(int handle) -> ()");
  m.def("decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start, Tensor query_len, Tensor context_len, "
        "Tensor prefill_tables, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
TORCH_LIBRARY_IMPL(llmserve, CatchAll, m) {
  m.impl("decoder_layer_register", &decoder_layer_register);
  m.impl("decoder_layer_release", &decoder_layer_release);
}
