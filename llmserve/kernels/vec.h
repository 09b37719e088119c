// A width-generic fp32 vector for the ISA variant that includes this header: 8 lanes (AVX2 + FMA)
// when LLMSERVE_AVX2 is defined, 16 lanes (AVX-512 F/BW/VL/DQ) when LLMSERVE_AVX512 is. Kernels
// are written once over Vec and compiled once per ISA (isa_avx2.cpp, isa_avx512.cpp), each
// translation unit under its own `#pragma GCC target`, so one library runs on any x86-64 CPU and
// picks its variant at run time.
//
// Include it inside the ISA's pragma region and an anonymous namespace, after the standard
// headers: everything here has internal linkage, so no inline function built for one ISA can be
// merged with (and run in place of) another's.

// Loops of a compile-time count are unrolled, so that arrays of vectors stay in registers.
#define LLMSERVE_UNROLL _Pragma("GCC unroll 16")

inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) {  // bf16 bits -> fp32
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
// float16 bits -> fp32 (F16C, which both ISA variants have)
inline float f16(uint16_t h) { return _cvtsh_ss(h); }
// fp32 -> float or bf16 bits, rounded to nearest even as torch rounds (a NaN stays a quiet NaN)
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  *p = x != x ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#if defined(LLMSERVE_AVX512)
struct Vec {
  static constexpr int W = 16;
  __m512 v;
};
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {  // 16 bf16 -> fp32: widen and shift into the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, Vec a) {  // 16 fp32 -> bf16, as put() rounds
  const __m512i b = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxof(Vec a) { return _mm512_reduce_max_ps(a.v); }
// lanes >= n replaced by `fill`
inline Vec vfirst(Vec a, int n, float fill) {
  const __mmask16 live = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  return {_mm512_mask_blend_ps(live, _mm512_set1_ps(fill), a.v)};
}
inline Vec vexp2_parts(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n
inline Vec vfloor(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec vabs(Vec a) { return {_mm512_abs_ps(a.v)}; }
// lanes where c < 0 take a, the others b
inline Vec vwhere_neg(Vec c, Vec a, Vec b) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(c.v, _mm512_setzero_ps(), _CMP_LT_OQ), b.v, a.v)}; }

// W int8 -> fp32
inline Vec vload_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// W bytes -> their low nibbles and their high nibbles, as fp32
inline void vload_nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}

// out lane t = the sum of v[t]'s 16 lanes: pairs interleaved and added, then quads, then the
// four 128-bit lanes.
inline Vec vreduce_rows(const Vec* v) {
  __m512 s[8], r[4];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)))};
}
#elif defined(LLMSERVE_AVX2)
struct Vec {
  static constexpr int W = 8;
  __m256 v;
};
inline Vec vzero() { return {_mm256_setzero_ps()}; }
inline Vec vset(float x) { return {_mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {  // 8 bf16 -> fp32: widen and shift into the high half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, Vec a) {  // 8 fp32 -> bf16, as put() rounds
  const __m256i b = _mm256_castps_si256(a.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmaxof(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Vec vfirst(Vec a, int n, float fill) {
  const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, live)};
}
// p * 2^n for integral n in [-126, 0]: n goes straight into the exponent bits
inline Vec vexp2_parts(Vec p, Vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(bits))};
}
inline Vec vfloor(Vec a) { return {_mm256_floor_ps(a.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec vabs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
// lanes where c < 0 take a, the others b (by the sign bit: -0 counts as negative)
inline Vec vwhere_neg(Vec c, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, c.v)}; }

// W int8 -> fp32
inline Vec vload_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
// W bytes -> their low nibbles and their high nibbles, as fp32
inline void vload_nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}

// out lane t = the sum of v[t]'s 8 lanes: horizontal adds within 128-bit halves, then the halves.
inline Vec vreduce_rows(const Vec* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0].v, v[1].v), h23 = _mm256_hadd_ps(v[2].v, v[3].v);
  const __m256 h45 = _mm256_hadd_ps(v[4].v, v[5].v), h67 = _mm256_hadd_ps(v[6].v, v[7].v);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);  // [0..3 | 0..3], [4..7 | 4..7]
  return {_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31))};
}
#endif

// exp(x) for x <= 0 as 2^n * 2^f, with a degree-6 polynomial for 2^f, f in [0, 1) (relative error
// <= 1e-5, ~2e-7 near 0). x is clamped below at -87 (~1e-38 out); NaN stays NaN (max keeps its
// second operand when either is NaN).
inline Vec vexp(Vec x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kPoly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                              5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
  const Vec t = vmul(vmax(vset(-87.f), x), vset(kLog2e));
  const Vec n = vfloor(t);
  const Vec f = vsub(t, n);
  Vec p = vset(kPoly[0]);
  _Pragma("GCC unroll 8") for (int i = 1; i < 7; ++i) p = vfma(p, f, vset(kPoly[i]));
  return vexp2_parts(p, n);
}
