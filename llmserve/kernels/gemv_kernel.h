// The GEMV kernel (gemv.h), written once over Vec (vec.h) and compiled once per ISA; included by
// isa_avx2.cpp and isa_avx512.cpp inside their pragma region and anonymous namespace.
// One output row at a time, read front to back: each thread's rows are one contiguous run of the
// weight, a single sequential stream (several rows read side by side measured 15-20% slower). U
// vectors of the row are taken per step, so the M * U accumulators are independent FMA chains.
// pf > 0: each step also prefetches (into L1) the lines pf bytes ahead of what it reads. Whether
// that pays depends on the machine: on an Intel Xeon 4-8 KB ahead took a batch-1 step from 32 to
// 23 ms (AVX2, float32) and from 19 to 9 ms (bf16), while on a Zen 5 software prefetch measured
// slower; the plan measures it once per machine (llmserve.plan.measured_gemv_prefetch).

// vectors per step for M input rows: M * U accumulators beside the U weight vectors
template <int M>
constexpr int kGemvU = M == 1 ? 4 : 2;

template <typename T, int M>
inline void gemv_row(const float* x, const T* wr, float b, int64_t in, float* y, int64_t out, int64_t pf) {
  constexpr int W = Vec::W, U = kGemvU<M>;
  constexpr int kStepBytes = U * W * static_cast<int>(sizeof(T));
  Vec acc[M][U];
  LLMSERVE_UNROLL for (int m = 0; m < M; ++m) LLMSERVE_UNROLL for (int u = 0; u < U; ++u) acc[m][u] = vzero();
  int64_t i = 0;
  for (; i + U * W <= in; i += U * W) {
    if (pf > 0) {
      const char* ahead = reinterpret_cast<const char*>(wr + i) + pf;
      LLMSERVE_UNROLL for (int l = 0; l < kStepBytes; l += 64) __builtin_prefetch(ahead + l, 0, 3);
    }
    Vec wv[U];
    LLMSERVE_UNROLL for (int u = 0; u < U; ++u) wv[u] = vload(wr + i + u * W);
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m)
      LLMSERVE_UNROLL for (int u = 0; u < U; ++u) acc[m][u] = vfma(vload(x + m * in + i + u * W), wv[u], acc[m][u]);
  }
  for (; i + W <= in; i += W) {
    const Vec wv = vload(wr + i);
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[m][0] = vfma(vload(x + m * in + i), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    Vec a = acc[m][0];
    LLMSERVE_UNROLL for (int u = 1; u < U; ++u) a = vadd(a, acc[m][u]);
    float s = vsum(a) + b;
    for (int64_t j = i; j < in; ++j) s += x[m * in + j] * scalar(wr[j]);
    y[m * out] = s;
  }
}

template <typename T, int M>
void gemv_m(const float* x, const void* wv, const float* bias, int64_t in, int64_t o0, int64_t o1, float* y,
            int64_t out, int64_t pf = 0) {
  const T* w = static_cast<const T*>(wv);
  for (int64_t o = o0; o < o1; ++o) gemv_row<T, M>(x, w + o * in, bias ? bias[o] : 0.f, in, y + o, out, pf);
}

template <typename T>
void gemv(const float* x, int64_t m, const void* wv, const float* bias, int64_t in, int64_t o0, int64_t o1, float* y,
          int64_t out, int64_t pf) {
  switch (m) {
    case 1: return gemv_m<T, 1>(x, wv, bias, in, o0, o1, y, out, pf);
    case 2: return gemv_m<T, 2>(x, wv, bias, in, o0, o1, y, out, pf);
    case 3: return gemv_m<T, 3>(x, wv, bias, in, o0, o1, y, out, pf);
    case 4: return gemv_m<T, 4>(x, wv, bias, in, o0, o1, y, out, pf);
    default: break;
  }
  // more than 4 rows: per weight row, groups of 4 input rows; the first group reads the row from
  // memory, the others from the core's cache (a row is a few KB)
  const T* w = static_cast<const T*>(wv);
  for (int64_t o = o0; o < o1; ++o) {
    const float b = bias ? bias[o] : 0.f;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) gemv_row<T, 4>(x + r * in, w + o * in, b, in, y + r * out + o, out, r == 0 ? pf : 0);
    switch (m - r) {
      case 1: gemv_row<T, 1>(x + r * in, w + o * in, b, in, y + r * out + o, out, 0); break;
      case 2: gemv_row<T, 2>(x + r * in, w + o * in, b, in, y + r * out + o, out, 0); break;
      case 3: gemv_row<T, 3>(x + r * in, w + o * in, b, in, y + r * out + o, out, 0); break;
      default: break;
    }
  }
}

inline GemvFn gemv_variant(KvType weight) { return weight == KvType::kFloat ? &gemv<float> : &gemv<uint16_t>; }
