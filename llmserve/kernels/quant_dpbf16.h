// The int4 (Q4_1) GEMV against bf16 activations by the AVX512-BF16 dot product (quant.h:
// QGemvBf16Fn); included by isa_avx512.cpp after quant_kernel.h, inside its pragma region and
// anonymous namespace. The fp32 kernel (quant_kernel.h) converts each weight to fp32 and scales it
// before its FMA; here one vdpbf16ps takes 32 weights, and the scales apply once a block:
//
//   sum_k w[k] x[k] = sum_b d[b] * sum_{k in b} u[k] x[k]  +  m[b] * X[b]     (X[b] = sum_{k in b} x[k])
//
// A nibble u becomes the bf16 word 0x4300 | u, which is 128 + u exactly (exponent 2^7, u in the
// mantissa), so no conversion instruction: the dot product over a block gives D = u.x + 128 X[b],
// and the result is sum_b d[b] D[b] + (m[b] - 128 d[b]) X[b]. Products are exact in fp32; the
// sums are fp32 (D carries 128 X[b] for the few bits it costs: ~2e-6 relative, far under bf16's
// own 4e-3).
//
// Blocks go in pairs: 32 bytes (blocks b, b + 1) zero-extend to 32 words W; W & 15 holds weights
// 0-15 of both blocks, W >> 4 weights 16-31. So x is laid out per pair to match, once a call per
// thread (M x in words: nothing beside the weights it is used against):
//   xp[pair] = [x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32]]   (64 bf16)
// and the dot product's lanes 0-7 hold block b's partial sums, lanes 8-15 block b + 1's. The
// last block of an odd count and a part block take the scalar loop.

constexpr int kQPairWords = 64;

// x [M, in] bf16 -> xp [M, pairs * 64] bf16 (the layout above), X [M, kb] fp32 block sums
inline void qpair_layout(const uint16_t* x, int64_t m, int64_t in, int64_t pairs, int64_t kb, uint16_t* xp, float* xs) {
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* xr = x + r * in;
    uint16_t* pr = xp + r * pairs * kQPairWords;
    for (int64_t p = 0; p < pairs; ++p)
      for (int h = 0; h < 2; ++h)
        for (int b = 0; b < 2; ++b)
          __builtin_memcpy(pr + p * kQPairWords + h * 32 + b * 16, xr + (2 * p + b) * 32 + h * 16, 32);
    for (int64_t b = 0; b < kb; ++b) {
      float s = 0.f;
      for (int64_t k = b * 32; k < std::min(in, b * 32 + 32); ++k) s += scalar(xr[k]);
      xs[r * kb + b] = s;
    }
  }
}

// y[r * out] = x[r] . w_row + bias for r < M, rounded to bf16
template <int M>
inline void qdot_row(const uint16_t* x, const uint16_t* xp, const float* xs, int64_t in, int64_t pairs, const uint8_t* qr,
                     const uint16_t* dr, const uint16_t* mr, int64_t kb, float bias, uint16_t* y, int64_t out, int64_t pf) {
  const __m512i low = _mm512_set1_epi16(15), magic = _mm512_set1_epi16(0x4300);
  __m512 acc[M], corr[M];
  LLMSERVE_UNROLL for (int r = 0; r < M; ++r) acc[r] = corr[r] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += 8) {  // 16 blocks' scales at a time
    const int np = static_cast<int>(std::min<int64_t>(8, pairs - p0));
    const __mmask16 lanes = static_cast<__mmask16>((1u << (2 * np)) - 1);
    const int64_t b0 = 2 * p0;
    if (pf > 0) {  // the scales, pf / 8 bytes ahead (they are an eighth of the packed bytes)
      __builtin_prefetch(reinterpret_cast<const char*>(dr + b0) + pf / 8, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(mr + b0) + pf / 8, 0, 3);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, dr + b0));
    const __m512 c = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.f), _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, mr + b0)));
    LLMSERVE_UNROLL for (int r = 0; r < M; ++r) corr[r] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(lanes, xs + r * kb + b0), corr[r]);
    for (int j = 0; j < np; ++j) {
      const int64_t p = p0 + j;
      if (pf > 0 && (j & 1) == 0) __builtin_prefetch(qr + p * 32 + pf, 0, 3);  // a line every two pairs
      const __m512i wd = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + p * 32)));
      const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(wd, low, magic, 0xEA);  // (wd & low) | magic
      const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(wd, 4), magic);
      // lanes 0-7: block b0 + 2j's scale, lanes 8-15: the next block's
      const __m512 dj = _mm512_permutexvar_ps(
          _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(2 * j)), d);
      LLMSERVE_UNROLL for (int r = 0; r < M; ++r) {
        const uint16_t* xq = xp + (r * pairs + p) * kQPairWords;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xq));
        t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(xq + 32));
        acc[r] = _mm512_fmadd_ps(t, dj, acc[r]);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], corr[r])) + bias;
    for (int64_t k = 2 * pairs * llmserve::kQBlock; k < in; ++k) s += scalar(x[r * in + k]) * qscalar<true>(qr, dr, mr, k);
    put(y + r * out, s);
  }
}

void qgemv_dpbf16(const uint16_t* x, int64_t m, const llmserve::QWeight& w, const float* bias, int64_t o0, int64_t o1,
                  uint16_t* y, int64_t out, int64_t pf) {
  const int64_t pairs = w.in / llmserve::kQBlock / 2;
  thread_local std::vector<uint16_t> xp;
  thread_local std::vector<float> xs;
  xp.resize(m * pairs * kQPairWords);
  xs.resize(m * w.kb);
  qpair_layout(x, m, w.in, pairs, w.kb, xp.data(), xs.data());
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = w.q + o * w.row_bytes;
    const uint16_t* dr = w.d + o * w.kb;
    const uint16_t* mr = w.m + o * w.kb;
    const float b = bias ? bias[o] : 0.f;
    switch (m) {
      case 1: qdot_row<1>(x, xp.data(), xs.data(), w.in, pairs, qr, dr, mr, w.kb, b, y + o, out, pf); break;
      case 2: qdot_row<2>(x, xp.data(), xs.data(), w.in, pairs, qr, dr, mr, w.kb, b, y + o, out, pf); break;
      case 3: qdot_row<3>(x, xp.data(), xs.data(), w.in, pairs, qr, dr, mr, w.kb, b, y + o, out, pf); break;
      default: qdot_row<4>(x, xp.data(), xs.data(), w.in, pairs, qr, dr, mr, w.kb, b, y + o, out, pf); break;
    }
  }
}
