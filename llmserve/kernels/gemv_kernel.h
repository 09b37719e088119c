// The GEMV kernel (gemv.h), written once over Vec (vec.h) and compiled once per ISA; included by
// isa_avx2.cpp and isa_avx512.cpp inside their pragma region and anonymous namespace.
// R output rows at a time, each weight row read once for all M (<= 4) input rows: R * M
// accumulators, the R weight vectors and one input vector in registers. The rows are contiguous,
// so the rows kAheadRows further on are prefetched as these are read (prefetching past the weight's end is harmless).

// rows at a time for M input rows: R * M accumulators fit beside R weight vectors (AVX2 has 16)
#if defined(LLMSERVE_AVX512)
template <int M>
constexpr int kGemvR = 4;
#else
template <int M>
constexpr int kGemvR = M <= 2 ? 4 : 2;
#endif
constexpr int64_t kAheadRows = 8;  // prefetch distance, in rows

template <typename T, int M, int R>
inline void gemv_rows(const float* x, const T* w, const float* bias, int64_t in, int64_t o, float* y, int64_t out) {
  constexpr int W = Vec::W;
  const int64_t vin = in / W * W;
  Vec acc[R][M];
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t i = 0; i < vin; i += W) {
    Vec wr[R];
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
      if ((i * static_cast<int64_t>(sizeof(T))) % 64 == 0)  // the next R rows' same line, one line a step
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + kAheadRows + r) * in + i), _MM_HINT_T0);
      wr[r] = vload(w + (o + r) * in + i);
    }
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
      const Vec xv = vload(x + m * in + i);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][m] = vfma(xv, wr[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[r][m]) + (bias ? bias[o + r] : 0.f);
      for (int64_t i = vin; i < in; ++i) s += x[m * in + i] * scalar(w[(o + r) * in + i]);
      y[m * out + o + r] = s;
    }
}

template <typename T, int M>
void gemv_m(const float* x, const void* wv, const float* bias, int64_t in, int64_t o0, int64_t o1, float* y,
            int64_t out) {
  const T* w = static_cast<const T*>(wv);
  int64_t o = o0;
  for (; o + kGemvR<M> <= o1; o += kGemvR<M>) gemv_rows<T, M, kGemvR<M>>(x, w, bias, in, o, y, out);
  for (; o < o1; ++o) gemv_rows<T, M, 1>(x, w, bias, in, o, y, out);
}

template <typename T>
void gemv(const float* x, int64_t m, const void* w, const float* bias, int64_t in, int64_t o0, int64_t o1, float* y,
          int64_t out) {
  switch (m) {
    case 1: return gemv_m<T, 1>(x, w, bias, in, o0, o1, y, out);
    case 2: return gemv_m<T, 2>(x, w, bias, in, o0, o1, y, out);
    case 3: return gemv_m<T, 3>(x, w, bias, in, o0, o1, y, out);
    default: return gemv_m<T, 4>(x, w, bias, in, o0, o1, y, out);
  }
}

inline GemvFn gemv_variant(KvType weight) { return weight == KvType::kFloat ? &gemv<float> : &gemv<uint16_t>; }
