// Decode attention straight from the paged KV cache: one query token per sequence, no gather.
//
// Shapes (T = the cache dtype, float or bfloat16; q and out share it):
//   q            [D, H, hd]            one query token per sequence
//   k_cache      [num_blocks, block_size, kvh, hd]   (v_cache likewise)
//   block_tables [D, max_blocks] int64  the sequence's blocks in order (padding is never read)
//   seq_lens     [D] int64              tokens to attend to, the new one included
//   out          [D, H, hd]
// Query heads h*g .. h*g+g-1 share KV head h (g = H / kvh). Scores, softmax and the weighted sum
// of V are computed in fp32. Work items are (sequence, KV head) pairs, split across threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// The same computation with AVX-512 registers: a head's query and running output stay in
// registers, each K/V row is converted to fp32 once and shared by the g query heads.
// Needs hd % 16 == 0 and hd <= kMaxHd, g <= kMaxGroup (checked by the caller).
constexpr int64_t kMaxHd = 256, kMaxGroup = 8;

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

constexpr int64_t kAhead = 2;  // blocks prefetched ahead of the one being computed

template <typename T>
inline void prefetch_block(const T* rows, int64_t block_size, int64_t kv_stride, int64_t hd) {
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t off = 0; off < hd * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * kv_stride) + off, _MM_HINT_T0);
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

template <typename T>
void attend_one_avx512(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
                       int64_t g, int64_t hd, int64_t block_size, int64_t kv_stride, int64_t block_stride,
                       float scale, T* out, std::vector<float>& scratch) {
  const int64_t nv = hd / 16, nblocks = (len + block_size - 1) / block_size;
  scratch.resize(g * len + g * hd + 16 * hd);
  float* scores = scratch.data();  // [g, len]
  float* acc_out = scores + g * len;  // [g, hd]
  __m512 qv[kMaxGroup][kMaxHd / 16];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < nv; ++c) qv[j][c] = _mm512_mul_ps(load16(q + j * hd + c * 16), sc);

  // Scores, 16 tokens at a time: each token's products with a query head are summed into one
  // register of partial sums, and reduce16 turns the 16 registers into 16 scores at once.
  float* kf = acc_out + g * hd;  // [16, hd]: up to 16 K rows of one block in fp32
  __m512 mv[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) mv[j] = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < std::min(kAhead, nblocks); ++b)
    prefetch_block(k_cache + table[b] * block_stride, block_size, kv_stride, hd);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* k = k_cache + table[b] * block_stride;
    if (b + kAhead < nblocks) prefetch_block(k_cache + table[b + kAhead] * block_stride, block_size, kv_stride, hd);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, n - t0);
      for (int64_t t = 0; t < cnt; ++t)
        for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(kf + t * hd + c * 16, load16(k + (t0 + t) * kv_stride + c * 16));
      const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
      for (int64_t j = 0; j < g; ++j) {
        __m512 part[16];
        for (int64_t t = 0; t < 16; ++t) {
          part[t] = _mm512_setzero_ps();
          if (t < cnt)
            for (int64_t c = 0; c < nv; ++c) part[t] = _mm512_fmadd_ps(qv[j][c], _mm512_loadu_ps(kf + t * hd + c * 16), part[t]);
        }
        const __m512 sv = reduce16(part);
        _mm512_mask_storeu_ps(scores + j * len + b * block_size + t0, live, sv);
        mv[j] = _mm512_mask_max_ps(mv[j], live, mv[j], sv);
      }
    }
  }
  float m[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) m[j] = _mm512_reduce_max_ps(mv[j]);
  for (int64_t b = 0; b < std::min(kAhead, nblocks); ++b)  // V's first blocks arrive during the softmax
    prefetch_block(v_cache + table[b] * block_stride, block_size, kv_stride, hd);
  for (int64_t j = 0; j < g; ++j) softmax_avx512(scores + j * len, len, m[j]);

  __m512 acc[kMaxGroup][kMaxHd / 16];
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < nv; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* v = v_cache + table[b] * block_stride;
    if (b + kAhead < nblocks) prefetch_block(v_cache + table[b + kAhead] * block_stride, block_size, kv_stride, hd);
    for (int64_t t = 0; t < n; ++t, v += kv_stride) {
      __m512 vr[kMaxHd / 16];
      for (int64_t c = 0; c < nv; ++c) vr[c] = load16(v + c * 16);
      for (int64_t j = 0; j < g; ++j) {
        const __m512 p = _mm512_set1_ps(scores[j * len + b * block_size + t]);
        for (int64_t c = 0; c < nv; ++c) acc[j][c] = _mm512_fmadd_ps(p, vr[c], acc[j][c]);
      }
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(acc_out + j * hd + c * 16, acc[j][c]);
  for (int64_t i = 0; i < g * hd; ++i) out[i] = static_cast<T>(acc_out[i]);
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
  at::parallel_for(0, d * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / kvh, h = w % kvh;
      const int64_t off = (s * heads + h * g) * hd;
#if defined(__AVX512F__)
      if (hd % 16 == 0 && hd <= kMaxHd && g <= kMaxGroup) {
        attend_one_avx512<T>(qp + off, kp + h * hd, vp + h * hd, tp + s * width, lp[s], g, hd, block_size,
                             kv_stride, block_stride, static_cast<float>(scale), op + off, scratch);
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

}  // namespace

TORCH_LIBRARY(llmserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
