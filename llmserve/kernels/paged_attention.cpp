// Decode attention straight from the paged KV cache: one query token per sequence, no gather.
// Below it, paged_attention: a whole flat batch (decode rows, then prefill chunks) in one op, for
// compiled steps.
//
// Shapes (T = the cache dtype, float or bfloat16; q and out share it):
//   q            [D, H, hd]            one query token per sequence
//   k_cache      [num_blocks, block_size, kvh, hd]   (v_cache likewise)
//   block_tables [D, max_blocks] int64  the sequence's blocks in order (padding is never read)
//   seq_lens     [D] int64              tokens to attend to, the new one included
//   out          [D, H, hd]
// Query heads h*g .. h*g+g-1 share KV head h (g = H / kvh). Scores, softmax and the weighted sum
// of V are computed in fp32 (bf16 scores: exact bf16 products summed in fp32). Work items are
// (sequence, KV head) pairs, split across threads. With AVX-512, g <= 8 and head_dim in
// {16, 32, 64, 128} run a variant compiled for that shape; anything else the portable loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

// exp(x) for x <= 0 as 2^n * 2^f, a degree-6 polynomial for 2^f (rel. error <= 1e-5, ~2e-7 near
// 0; inputs below -87 give ~1e-38). Plain arithmetic, so loops over it vectorise (std::exp does
// not). n comes from a clamped copy, so it is always a small integer; a NaN input stays NaN via f.
constexpr float kLog2e = 1.44269504088896341f;
// 2^f for f in [0, 1): a degree-6 polynomial, highest power first.
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

inline float fast_exp(float x) {
  float xc = x > -87.f ? x : -87.f;  // NaN -> -87 here
  xc = xc < 0.f ? xc : 0.f;
  const float n = std::floor(xc * kLog2e);
  const float f = ((x > -87.f || x != x) ? x : -87.f) * kLog2e - n;  // in [0, 1); NaN stays NaN
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// s[0:len] <- softmax(s), given m = max(s).
inline void softmax_inplace(float* s, int64_t len, float m) {
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) s[t] = fast_exp(s[t] - m);
  for (int64_t t = 0; t < len; ++t) sum += s[t];
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
                int64_t g, int64_t hd, int64_t block_size, int64_t kv_stride, int64_t block_stride,
                float scale, T* out, std::vector<float>& scratch) {
  // q/out point at this KV head's g query heads: [g, hd]. k_cache/v_cache point at head h of block 0.
  const int64_t nblocks = (len + block_size - 1) / block_size;
  scratch.assign(g * hd + block_size * hd + g * len + g * hd, 0.f);
  float* qf = scratch.data();                 // [g, hd], pre-scaled
  float* rows = qf + g * hd;                  // [block_size, hd]: one block's K or V rows in fp32
  float* scores = rows + block_size * hd;     // [g, len]
  float* acc = scores + g * len;              // [g, hd]
  load_row(q, qf, g * hd);
  for (int64_t i = 0; i < g * hd; ++i) qf[i] *= scale;

  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* k = k_cache + table[b] * block_stride;
    for (int64_t t = 0; t < n; ++t) load_row(k + t * kv_stride, rows + t * hd, hd);
    for (int64_t j = 0; j < g; ++j)
      for (int64_t t = 0; t < n; ++t) scores[j * len + b * block_size + t] = dot(qf + j * hd, rows + t * hd, hd);
  }
  for (int64_t j = 0; j < g; ++j) {
    const float* s = scores + j * len;
    softmax_inplace(scores + j * len, len, *std::max_element(s, s + len));
  }
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* v = v_cache + table[b] * block_stride;
    for (int64_t t = 0; t < n; ++t) load_row(v + t * kv_stride, rows + t * hd, hd);
    for (int64_t j = 0; j < g; ++j) {
      float* a = acc + j * hd;
      const float* p = scores + j * len + b * block_size;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < hd; ++i) a[i] += p[t] * rows[t * hd + i];
    }
  }
  for (int64_t i = 0; i < g * hd; ++i) out[i] = static_cast<T>(acc[i]);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Ask for the next block's rows of this head while the current one is computed: the rows are
// strided (one head's slice of each token) and the block is elsewhere in memory, which the
// hardware prefetcher does not foresee.
// fast_exp's polynomial on 16 lanes; scalef applies 2^n exactly (underflow to 0, NaN kept).
inline __m512 exp16(__m512 x) {
  x = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

inline void softmax_avx512(float* s, int64_t len, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), mv));
    _mm512_mask_storeu_ps(s + t, live, e);
    sum = _mm512_mask_add_ps(sum, live, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
    _mm512_mask_storeu_ps(s + t, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + t), inv));
  }
}

constexpr int64_t kAhead = 6;  // blocks prefetched ahead of the one being computed (into L2: L1's miss buffers are few)

template <typename T>
inline void prefetch_block(const T* rows, int64_t block_size, int64_t kv_stride, int64_t hd) {
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t off = 0; off < hd * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * kv_stride) + off, _MM_HINT_T1);
}

// out[t] = the sum of v[t]'s 16 lanes, t = 0..15, as one register: pairs of registers are
// interleaved and added (unpack), then quads (shuffle_ps), then the four 128-bit lanes (shuffle_f32x4).
inline __m512 reduce16(const __m512* v) {
  __m512 s[8], r[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One (sequence, KV head) work item with the group size G and head_dim / 16 = NV known at compile
// time, so a head's queries and running outputs stay in registers (with runtime bounds the
// compiler kept them on the stack and the kernel was compute-bound at about a third of the
// memory bandwidth). bf16 scores use the AVX512-BF16 dot product straight on the cached rows:
// bf16 x bf16 products are exact in fp32, so only the summation order differs.
template <typename T, int G, int NV>
struct Queries {
  static constexpr bool kDpbf16 =
#if defined(__AVX512BF16__)
      std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
#else
      false;
#endif
  __m512 f[kDpbf16 ? 1 : G][kDpbf16 ? 1 : NV];  // fp32, pre-scaled
#if defined(__AVX512BF16__)
  __m512bh h[kDpbf16 ? G : 1][kDpbf16 ? NV / 2 : 1];  // raw bf16 pairs; scaled after the dot
#endif
  float post_scale;

  Queries(const T* q, float scale) {
    if constexpr (kDpbf16) {
#if defined(__AVX512BF16__)
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < NV / 2; ++c) h[j][c] = (__m512bh)_mm512_loadu_si512(q + j * NV * 16 + c * 32);
#endif
      post_scale = scale;
    } else {
      const __m512 sc = _mm512_set1_ps(scale);
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < NV; ++c) f[j][c] = _mm512_mul_ps(load16(q + j * NV * 16 + c * 16), sc);
      post_scale = 1.f;
    }
  }

  // 16 partial sums of query head j against one K row; their total is the (scaled) score.
  inline __m512 dot(int j, const T* row) const {
    __m512 part = _mm512_setzero_ps();
    if constexpr (kDpbf16) {
#if defined(__AVX512BF16__)
      for (int c = 0; c < NV / 2; ++c) part = _mm512_dpbf16_ps(part, h[j][c], (__m512bh)_mm512_loadu_si512(row + c * 32));
#endif
    } else {
      for (int c = 0; c < NV; ++c) part = _mm512_fmadd_ps(f[j][c], load16(row + c * 16), part);
    }
    return part;
  }
};

template <typename T, int G, int NV>
void attend_fixed(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
                  int64_t block_size, int64_t kv_stride, int64_t block_stride, float scale, T* out,
                  std::vector<float>& scratch) {
  constexpr int64_t hd = NV * 16;
  const int64_t nblocks = (len + block_size - 1) / block_size;
  scratch.resize(G * len);
  float* scores = scratch.data();  // [G, len]
  const Queries<T, G, NV> qs(q, scale);
  const __m512 post = _mm512_set1_ps(qs.post_scale);

  // Scores, 16 tokens at a time: each token's products with a query head are summed into one
  // register of partial sums, and reduce16 turns the 16 registers into 16 scores at once.
  __m512 mv[G];
  for (int j = 0; j < G; ++j) mv[j] = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < std::min(kAhead, nblocks); ++b)
    prefetch_block(k_cache + table[b] * block_stride, block_size, kv_stride, hd);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* k = k_cache + table[b] * block_stride;
    if (b + kAhead < nblocks) prefetch_block(k_cache + table[b + kAhead] * block_stride, block_size, kv_stride, hd);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, n - t0);
      const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
      for (int j = 0; j < G; ++j) {
        __m512 part[16];
        for (int t = 0; t < 16; ++t) part[t] = t < cnt ? qs.dot(j, k + (t0 + t) * kv_stride) : _mm512_setzero_ps();
        const __m512 sv = _mm512_mul_ps(reduce16(part), post);
        _mm512_mask_storeu_ps(scores + j * len + b * block_size + t0, live, sv);
        mv[j] = _mm512_mask_max_ps(mv[j], live, mv[j], sv);
      }
    }
  }
  for (int64_t b = 0; b < std::min(kAhead, nblocks); ++b)  // V's first blocks arrive during the softmax
    prefetch_block(v_cache + table[b] * block_stride, block_size, kv_stride, hd);
  for (int j = 0; j < G; ++j) softmax_avx512(scores + j * len, len, _mm512_reduce_max_ps(mv[j]));

  __m512 acc[G][NV];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* v = v_cache + table[b] * block_stride;
    const float* p = scores + b * block_size;
    if (b + kAhead < nblocks) prefetch_block(v_cache + table[b + kAhead] * block_stride, block_size, kv_stride, hd);
    for (int64_t t = 0; t < n; ++t, v += kv_stride) {
      __m512 vr[NV];
      for (int c = 0; c < NV; ++c) vr[c] = load16(v + c * 16);
      for (int j = 0; j < G; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j * len + t]);
        for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_fmadd_ps(pj, vr[c], acc[j][c]);
      }
    }
  }
  alignas(64) float res[G * hd];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NV; ++c) _mm512_store_ps(res + j * hd + c * 16, acc[j][c]);
  for (int64_t i = 0; i < G * hd; ++i) out[i] = static_cast<T>(res[i]);
}

using AttendFn = void (*)(const void*, const void*, const void*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          float, void*, std::vector<float>&);

template <typename T, int G, int NV>
void attend_erased(const void* q, const void* k, const void* v, const int64_t* table, int64_t len, int64_t block_size,
                   int64_t kv_stride, int64_t block_stride, float scale, void* out, std::vector<float>& scratch) {
  attend_fixed<T, G, NV>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), table, len,
                         block_size, kv_stride, block_stride, scale, static_cast<T*>(out), scratch);
}

// The compiled variants: G = 1..8 query heads per KV head, head_dim 16, 32, 64 or 128 (Llama-style
// models use 64 or 128). Each head size adds to the one-time build (eight took 58 s, these four
// 20 s); other sizes take the portable loop.
template <typename T, int G>
AttendFn pick_nv(int64_t nv) {
  switch (nv) {
    case 1: return &attend_erased<T, G, 1>;
    case 2: return &attend_erased<T, G, 2>;
    case 4: return &attend_erased<T, G, 4>;
    case 8: return &attend_erased<T, G, 8>;
    default: return nullptr;
  }
}

template <typename T>
AttendFn pick_variant(int64_t g, int64_t hd) {
  if (hd % 16) return nullptr;
  switch (g) {
    case 1: return pick_nv<T, 1>(hd / 16);
    case 2: return pick_nv<T, 2>(hd / 16);
    case 3: return pick_nv<T, 3>(hd / 16);
    case 4: return pick_nv<T, 4>(hd / 16);
    case 5: return pick_nv<T, 5>(hd / 16);
    case 6: return pick_nv<T, 6>(hd / 16);
    case 7: return pick_nv<T, 7>(hd / 16);
    case 8: return pick_nv<T, 8>(hd / 16);
    default: return nullptr;
  }
}
#endif

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t d = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t block_size = k_cache.size(1), kvh = k_cache.size(2), g = heads / kvh;
  const int64_t kv_stride = kvh * hd, block_stride = block_size * kv_stride, width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
#if defined(__AVX512F__)
  const AttendFn fixed = pick_variant<T>(g, hd);
#endif
  at::parallel_for(0, d * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / kvh, h = w % kvh;
      const int64_t off = (s * heads + h * g) * hd;
#if defined(__AVX512F__)
      if (fixed) {
        fixed(qp + off, kp + h * hd, vp + h * hd, tp + s * width, lp[s], block_size, kv_stride, block_stride,
              static_cast<float>(scale), op + off, scratch);
        continue;
      }
#endif
      attend_one<T>(qp + off, kp + h * hd, vp + h * hd, tp + s * width, lp[s], g, hd, block_size, kv_stride,
                    block_stride, static_cast<float>(scale), op + off, scratch);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1, "block_tables [D, max_blocks], seq_lens [D]");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one table per query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1), block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < lens.size(0); ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * block_size, "seq_lens[", i, "] = ", lp[i], " is outside [1, ",
                width * block_size, "]");
    for (int64_t b = 0; b < (lp[i] + block_size - 1) / block_size; ++b)  // every block that will be read
      TORCH_CHECK(tp[i * width + b] >= 0 && tp[i * width + b] < num_blocks, "block_tables[", i, ", ", b, "] = ",
                  tp[i * width + b], " is not a block of this cache (", num_blocks, " blocks)");
  }
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat)
    run<float>(qc, k_cache, v_cache, tables, lens, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(qc, k_cache, v_cache, tables, lens, scale, out);
  else
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, not ", q.scalar_type());
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
    keys = k_cache.index_select(0, blocks).view({-1, kvh, hd}).narrow(0, 0, ctx);
    vals = v_cache.index_select(0, blocks).view({-1, kvh, hd}).narrow(0, 0, ctx);
    const at::Tensor q_pos = at::arange(ctx - n, ctx, table.options());
    mask = at::arange(ctx, table.options()).unsqueeze(0) <= q_pos.unsqueeze(1);  // [n, ctx] bool
  }
  const at::Tensor out = at::scaled_dot_product_attention(
      q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0), mask,
      0.0, /*is_causal=*/ctx == n, scale, /*enable_gqa=*/kvh != q.size(1));
  return out.squeeze(0).transpose(0, 1);
}

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
  at::Tensor out = at::empty_like(q);
  if (d) out.narrow(0, 0, d).copy_(paged_decode_attention(q.narrow(0, 0, d), k_cache, v_cache, block_tables, seq_lens, scale));
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

}  // namespace

TORCH_LIBRARY(llmserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start, Tensor query_len, Tensor context_len, Tensor prefill_tables, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention", &paged_attention);
}
