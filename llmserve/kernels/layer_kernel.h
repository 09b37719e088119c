// The elementwise parts of a decoder layer (layer.h) over Vec (vec.h), for the ISA variant that
// includes this header; A is float or uint16_t (bf16 bits). Tails shorter than a vector take the
// scalar path, which rounds as vstore does.

template <typename A>
void rms_norm_row(const void* xv, const void* wv, int64_t n, float eps, void* yv) {
  constexpr int W = Vec::W;
  const A* x = static_cast<const A*>(xv);
  const A* w = static_cast<const A*>(wv);
  A* y = static_cast<A*>(yv);
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (int64_t j = i; j < n; ++j) ss += scalar(x[j]) * scalar(x[j]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  // the normalised row is rounded to A before the weight multiplies it (model/llama.py RMSNorm)
  for (i = 0; i + W <= n; i += W) vstore(y + i, vmul(vload(x + i), vset(inv)));
  for (int64_t j = i; j < n; ++j) put(y + j, scalar(x[j]) * inv);
  for (i = 0; i + W <= n; i += W) vstore(y + i, vmul(vload(w + i), vload(y + i)));
  for (int64_t j = i; j < n; ++j) put(y + j, scalar(w[j]) * scalar(y[j]));
}

template <typename A>
void rope_rows(const void* xv, int64_t x_stride, const void* cv, const void* sv, int64_t heads, int64_t hd, void* yv) {
  constexpr int W = Vec::W;
  const A* c = static_cast<const A*>(cv);
  const A* s = static_cast<const A*>(sv);
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const A* x = static_cast<const A*>(xv) + h * x_stride;
    A* y = static_cast<A*>(yv) + h * hd;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const Vec lo = vload(x + i), hi = vload(x + half + i);
      vstore(y + i, vsub(vmul(lo, vload(c + i)), vmul(hi, vload(s + i))));
      vstore(y + half + i, vadd(vmul(hi, vload(c + half + i)), vmul(lo, vload(s + half + i))));
    }
    for (; i < half; ++i) {
      const float lo = scalar(x[i]), hi = scalar(x[half + i]);
      put(y + i, lo * scalar(c[i]) - hi * scalar(s[i]));
      put(y + half + i, hi * scalar(c[half + i]) + lo * scalar(s[half + i]));
    }
  }
}

// silu(g) = g * sigmoid(g); sigmoid from e = exp(-|g|) (vexp takes x <= 0): 1 / (1 + e) for
// g >= 0, e / (1 + e) below
inline Vec vsilu(Vec g) {
  const Vec e = vexp(vsub(vzero(), vabs(g)));
  const Vec sig = vdiv(vwhere_neg(g, e, vset(1.f)), vadd(vset(1.f), e));
  return vmul(g, sig);
}

template <typename A>
void silu_mul_row(const void* gv, const void* uv, int64_t n, void* yv) {
  constexpr int W = Vec::W;
  const A* g = static_cast<const A*>(gv);
  const A* u = static_cast<const A*>(uv);
  A* y = static_cast<A*>(yv);
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vmul(vsilu(vload(g + i)), vload(u + i)));
  for (; i < n; ++i) {
    const float x = scalar(g[i]);
    put(y + i, x / (1.f + std::exp(-x)) * scalar(u[i]));
  }
}

template <typename A>
void add_row(const void* av, const void* bv, int64_t n, void* yv) {
  constexpr int W = Vec::W;
  const A* a = static_cast<const A*>(av);
  const A* b = static_cast<const A*>(bv);
  A* y = static_cast<A*>(yv);
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vadd(vload(a + i), vload(b + i)));
  for (; i < n; ++i) put(y + i, scalar(a[i]) + scalar(b[i]));
}

inline llmserve::LayerFns layer_variant(bool bf16) {
  if (bf16) return {&rms_norm_row<uint16_t>, &rope_rows<uint16_t>, &silu_mul_row<uint16_t>, &add_row<uint16_t>};
  return {&rms_norm_row<float>, &rope_rows<float>, &silu_mul_row<float>, &add_row<float>};
}
