// The quantized GEMV and row dequantization (quant.h), written once over Vec (vec.h) and compiled
// once per ISA; included by isa_avx2.cpp and isa_avx512.cpp after gemv_kernel.h, inside their
// pragma region and anonymous namespace.
// Steps of at most 4 rows dequantize each block of 32 weights in registers (one FMA a vector)
// and use it for every row: the packed bytes are read once, front to back, one output row at a
// time (as gemv_kernel.h reads a plain weight); int8 weights at one row take each block's dot
// product with the int8 values first and scale it once (the loop is bound by its instructions a
// block where the weights come from the cache). Steps of 5 to 16 rows dequantize the weight row
// once into an L1 buffer and run the float GEMV over it, four input rows at a time.

constexpr int kQV = static_cast<int>(llmserve::kQBlock) / Vec::W;  // vectors a block: 2 (AVX-512), 4 (AVX2)

template <bool Q4>
constexpr int64_t kQBlockBytes = Q4 ? 16 : 32;

// one block's 32 weights, dequantized: w[c] holds weights c * W .. c * W + W - 1
template <bool Q4>
inline void qblock(const uint8_t* q, float d, float m, Vec* w) {
  const Vec dv = vset(d);
  if constexpr (Q4) {
    const Vec mv = vset(m);
    LLMSERVE_UNROLL for (int c = 0; c < kQV / 2; ++c) {
      Vec lo, hi;
      vload_nibbles(q + c * Vec::W, lo, hi);
      w[c] = vfma(lo, dv, mv);
      w[c + kQV / 2] = vfma(hi, dv, mv);
    }
  } else {
    LLMSERVE_UNROLL for (int c = 0; c < kQV; ++c) w[c] = vmul(vload_i8(reinterpret_cast<const int8_t*>(q) + c * Vec::W), dv);
  }
}

// weight k of a row (the partial last block)
template <bool Q4>
inline float qscalar(const uint8_t* qr, const uint16_t* dr, const uint16_t* mr, int64_t k) {
  const int64_t b = k / llmserve::kQBlock, j = k % llmserve::kQBlock;
  if constexpr (Q4) {
    const uint8_t byte = qr[b * 16 + (j & 15)];
    return std::fma(static_cast<float>(j < 16 ? byte & 15 : byte >> 4), f16(dr[b]), f16(mr[b]));
  } else {
    return static_cast<float>(reinterpret_cast<const int8_t*>(qr)[k]) * f16(dr[b]);
  }
}

// y[r * out] = x[r] . w_row + b for r < M; U blocks a step (so that M * kQV * U >= 4 FMA chains).
// TX, TY: fp32, or bf16 bits (x read as bf16, y rounded to bf16; the sums are fp32 either way)
template <bool Q4, int M, typename TX, typename TY>
inline void qgemv_row(const TX* x, int64_t in, const uint8_t* qr, const uint16_t* dr, const uint16_t* mr, float b,
                      TY* y, int64_t out, int64_t pf) {
  constexpr int U = M * kQV >= 4 ? 1 : 2, W = Vec::W;
  constexpr int64_t BB = kQBlockBytes<Q4>;
  Vec acc[M][U * kQV];
  LLMSERVE_UNROLL for (int r = 0; r < M; ++r) LLMSERVE_UNROLL for (int c = 0; c < U * kQV; ++c) acc[r][c] = vzero();
  const int64_t full = in / llmserve::kQBlock;
  auto step = [&](int64_t blk, int u) {
    if constexpr (!Q4 && M == 1) {  // one row: the block's dot product first, then its scale (one multiply, not kQV)
      const TX* xb = x + blk * llmserve::kQBlock;
      const int8_t* qb = reinterpret_cast<const int8_t*>(qr + blk * BB);
      Vec t = vmul(vload(xb), vload_i8(qb));
      LLMSERVE_UNROLL for (int c = 1; c < kQV; ++c) t = vfma(vload(xb + c * W), vload_i8(qb + c * W), t);
      acc[0][u * kQV] = vfma(t, vset(f16(dr[blk])), acc[0][u * kQV]);
      return;
    }
    Vec w[kQV];
    qblock<Q4>(qr + blk * BB, f16(dr[blk]), Q4 ? f16(mr[blk]) : 0.f, w);
    const TX* xb = x + blk * llmserve::kQBlock;
    LLMSERVE_UNROLL for (int r = 0; r < M; ++r)
      LLMSERVE_UNROLL for (int c = 0; c < kQV; ++c)
        acc[r][u * kQV + c] = vfma(vload(xb + r * in + c * W), w[c], acc[r][u * kQV + c]);
  };
  int64_t blk = 0;
  for (; blk + U <= full; blk += U) {
    if (pf > 0) __builtin_prefetch(qr + blk * BB + pf, 0, 3);
    LLMSERVE_UNROLL for (int u = 0; u < U; ++u) step(blk + u, u);
  }
  for (; blk < full; ++blk) step(blk, 0);
  for (int r = 0; r < M; ++r) {
    Vec a = acc[r][0];
    LLMSERVE_UNROLL for (int c = 1; c < U * kQV; ++c) a = vadd(a, acc[r][c]);
    float s = vsum(a) + b;
    for (int64_t k = full * llmserve::kQBlock; k < in; ++k) s += scalar(x[r * in + k]) * qscalar<Q4>(qr, dr, mr, k);
    put(y + r * out, s);
  }
}

// a row's `in` weights, dequantized, into dst (fp32, or bf16 bits rounded as torch rounds)
template <bool Q4, typename T>
inline void qdequant_row(const uint8_t* qr, const uint16_t* dr, const uint16_t* mr, int64_t in, T* dst) {
  const int64_t full = in / llmserve::kQBlock;
  for (int64_t blk = 0; blk < full; ++blk) {
    Vec w[kQV];
    qblock<Q4>(qr + blk * kQBlockBytes<Q4>, f16(dr[blk]), Q4 ? f16(mr[blk]) : 0.f, w);
    LLMSERVE_UNROLL for (int c = 0; c < kQV; ++c) vstore(dst + blk * llmserve::kQBlock + c * Vec::W, w[c]);
  }
  for (int64_t k = full * llmserve::kQBlock; k < in; ++k) put(dst + k, qscalar<Q4>(qr, dr, mr, k));
}

// output row o of a step of m <= 4 rows, in registers; false (nothing done) for more rows
template <bool Q4, typename TX, typename TY>
inline bool qgemv_few(const TX* x, int64_t m, const llmserve::QWeight& w, int64_t o, float b, TY* y, int64_t out,
                      int64_t pf) {
  const uint8_t* qr = w.q + o * w.row_bytes;
  const uint16_t* dr = w.d + o * w.kb;
  const uint16_t* mr = Q4 ? w.m + o * w.kb : nullptr;
  switch (m) {
    case 1: qgemv_row<Q4, 1>(x, w.in, qr, dr, mr, b, y + o, out, pf); return true;
    case 2: qgemv_row<Q4, 2>(x, w.in, qr, dr, mr, b, y + o, out, pf); return true;
    case 3: qgemv_row<Q4, 3>(x, w.in, qr, dr, mr, b, y + o, out, pf); return true;
    case 4: qgemv_row<Q4, 4>(x, w.in, qr, dr, mr, b, y + o, out, pf); return true;
    default: return false;
  }
}

template <bool Q4>
void qgemv(const float* x, int64_t m, const llmserve::QWeight& w, const float* bias, int64_t o0, int64_t o1, float* y,
           int64_t out, int64_t pf) {
  const int64_t in = w.in;
  thread_local std::vector<float> row;  // the dequantized weight row, for steps of more than 4 rows
  if (m > 4) row.resize(in);
  for (int64_t o = o0; o < o1; ++o) {
    const float b = bias ? bias[o] : 0.f;
    if (qgemv_few<Q4>(x, m, w, o, b, y, out, pf)) continue;
    const uint8_t* qr = w.q + o * w.row_bytes;
    const uint16_t* dr = w.d + o * w.kb;
    const uint16_t* mr = Q4 ? w.m + o * w.kb : nullptr;
    qdequant_row<Q4, float>(qr, dr, mr, in, row.data());
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) gemv_row<float, 4>(x + r * in, row.data(), b, in, y + r * out + o, out, 0);
    switch (m - r) {
      case 1: gemv_row<float, 1>(x + r * in, row.data(), b, in, y + r * out + o, out, 0); break;
      case 2: gemv_row<float, 2>(x + r * in, row.data(), b, in, y + r * out + o, out, 0); break;
      case 3: gemv_row<float, 3>(x + r * in, row.data(), b, in, y + r * out + o, out, 0); break;
      default: break;
    }
  }
}

// bf16 activations, M <= kQDotMaxRows rows, bf16 out (quant.h: QGemvBf16Fn). The rows are widened
// to fp32 once, into a buffer that stays in L1, rather than for every output row: fewer
// instructions a block, which is what limits this loop where the weights come from the cache.
template <bool Q4>
void qgemv_bf16(const uint16_t* x, int64_t m, const llmserve::QWeight& w, const float* bias, int64_t o0, int64_t o1,
                uint16_t* y, int64_t out, int64_t pf) {
  thread_local std::vector<float> xf;
  const int64_t n = m * w.in;
  xf.resize(n);
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) vstore(xf.data() + i, vload(x + i));
  for (; i < n; ++i) xf[i] = scalar(x[i]);
  for (int64_t o = o0; o < o1; ++o) qgemv_few<Q4>(xf.data(), m, w, o, bias ? bias[o] : 0.f, y, out, pf);
}

template <bool Q4>
void qdequant_rows(const llmserve::QWeight& w, int64_t o0, int64_t o1, void* dst, bool bf16) {
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = w.q + o * w.row_bytes;
    const uint16_t* dr = w.d + o * w.kb;
    const uint16_t* mr = Q4 ? w.m + o * w.kb : nullptr;
    if (bf16)
      qdequant_row<Q4, uint16_t>(qr, dr, mr, w.in, static_cast<uint16_t*>(dst) + (o - o0) * w.in);
    else
      qdequant_row<Q4, float>(qr, dr, mr, w.in, static_cast<float*>(dst) + (o - o0) * w.in);
  }
}

void qdequant(const llmserve::QWeight& w, int64_t o0, int64_t o1, void* dst, bool bf16) {
  return w.int4() ? qdequant_rows<true>(w, o0, o1, dst, bf16) : qdequant_rows<false>(w, o0, o1, dst, bf16);
}

inline llmserve::QGemvFn qgemv_variant(bool int4) { return int4 ? &qgemv<true> : &qgemv<false>; }
inline llmserve::QGemvBf16Fn qgemv_bf16_variant(bool int4) { return int4 ? &qgemv_bf16<true> : &qgemv_bf16<false>; }
