// The decode-attention kernel, written once over Vec (vec.h) and compiled once per ISA. Included
// by isa_avx2.cpp and isa_avx512.cpp inside their pragma region and anonymous namespace.
//
// One work item (decode.h): the g query heads of one KV head over a range of blocks.
//   1. scores[j, t] = scale * q_j . k_t, W tokens at a time: each token's products with a query
//      head are summed into one register of partial sums, and vreduce_rows turns W of them into
//      W scores at once. A block's K rows (block_size x hd) stay in L1 while every query head reads
//      them, so no more than W + the query chunk need registers (AVX2 has 16).
//   2. m_j = max_t scores, p = exp(scores - m_j), l_j = sum_t p.
//   3. acc_j += p[j, t] * v_t, block by block: each V row is loaded once for as many query heads
//      as their accumulators fit in registers (all of SmolLM2's 3 on AVX-512; 2 at a time, in
//      chunks of 4 vectors, on AVX2), and the block stays in L1 for the next group.
// Blocks kAhead ahead are prefetched into L2: rows are strided (one head's slice of each token)
// and blocks are scattered, which the hardware prefetcher does not foresee.

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

constexpr int64_t kAhead = 6;
// Step 3's register budget: kAccumulators accumulators of up to kChunk vectors per head, beside
// the V chunk and the broadcast probability (AVX-512 has 32 registers, AVX2 16).
#if defined(LLMSERVE_AVX512)
constexpr int kChunk = 8, kAccumulators = 16;
#else
constexpr int kChunk = 4, kAccumulators = 8;
#endif

template <typename T>
inline void prefetch_block(const T* rows, int64_t block_size, int64_t kv_stride, int64_t hd) {
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t off = 0; off < hd * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * kv_stride) + off, _MM_HINT_T1);
}

// q_j . row as W partial sums; q pre-scaled fp32 [g, hd]. head(j) loads query head j once, into
// registers where they fit, for all the rows it meets.
template <typename T, int NV>
struct FmaDot {
  const float* q;
  struct Head {
    Vec qv[NV];
    inline Vec operator()(const T* row) const {
      Vec part = vzero();
      LLMSERVE_UNROLL for (int c = 0; c < NV; ++c) part = vfma(qv[c], vload(row + c * Vec::W), part);
      return part;
    }
  };
  inline Head head(int64_t j) const {
    Head h;
    LLMSERVE_UNROLL for (int c = 0; c < NV; ++c) h.qv[c] = vload(q + (j * NV + c) * Vec::W);
    return h;
  }
};

template <typename T, int NV, typename Dot>
void attend(const DecodeItem& it, const DecodeGeom& geo, const Dot& dot, float post, float* scores) {
  constexpr int W = Vec::W;
  constexpr int64_t hd = NV * W;
  constexpr int CH = NV < kChunk ? NV : kChunk;  // vectors of a V row held at once in step 3
  constexpr int HB = kAccumulators / CH < 1 ? 1 : kAccumulators / CH > 8 ? 8 : kAccumulators / CH;  // heads at once
  const int64_t g = geo.g, bs = geo.block_size, ks = geo.kv_stride, bstride = geo.block_stride;
  const T* kbase = static_cast<const T*>(it.k);
  const T* vbase = static_cast<const T*>(it.v);
  const int64_t t0 = it.first_block * bs, n_tok = imin(it.end_block * bs, it.len) - t0;
  const int64_t pitch = (n_tok + W - 1) / W * W + 32;  // a row of scores, with room for full-width stores
  float* acc = it.partial;  // [g, hd]
  float* m = acc + g * hd;
  float* l = m + g;
  for (int64_t i = 0; i < g * hd; i += W) vstore(acc + i, vzero());
  if (n_tok <= 0) {
    for (int64_t j = 0; j < g; ++j) m[j] = -INFINITY, l[j] = 0.f;
    return;
  }

  // 1. scores
  for (int64_t b = it.first_block; b < imin(it.first_block + kAhead, it.end_block); ++b)
    prefetch_block(kbase + it.table[b] * bstride, bs, ks, hd);
  for (int64_t b = it.first_block; b < it.end_block; ++b) {
    const int64_t base = b * bs - t0, n = imin(bs, it.len - b * bs);
    const T* k = kbase + it.table[b] * bstride;
    if (b + kAhead < it.end_block) prefetch_block(kbase + it.table[b + kAhead] * bstride, bs, ks, hd);
    for (int64_t j = 0; j < g; ++j) {
      const auto qj = dot.head(j);
      for (int64_t s0 = 0; s0 < n; s0 += W) {
        const int64_t cnt = imin(W, n - s0);
        Vec part[W];
        LLMSERVE_UNROLL for (int t = 0; t < W; ++t) part[t] = t < cnt ? qj(k + (s0 + t) * ks) : vzero();
        vstore(scores + j * pitch + base + s0, vmul(vreduce_rows(part), vset(post)));
      }
    }
  }
  for (int64_t b = it.first_block; b < imin(it.first_block + kAhead, it.end_block); ++b)
    prefetch_block(vbase + it.table[b] * bstride, bs, ks, hd);  // V's first blocks arrive during step 2

  // 2. softmax numerators
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * pitch;
    Vec mv = vset(-INFINITY);
    for (int64_t i = 0; i < n_tok; i += W) mv = vmax(mv, vfirst(vload(s + i), static_cast<int>(imin(W, n_tok - i)), -INFINITY));
    const Vec mj = vset(m[j] = vmaxof(mv));
    Vec sum = vzero();
    for (int64_t i = 0; i < n_tok; i += W) {
      const Vec e = vfirst(vexp(vsub(vload(s + i), mj)), static_cast<int>(imin(W, n_tok - i)), 0.f);
      vstore(s + i, e);
      sum = vadd(sum, e);
    }
    l[j] = vsum(sum);
  }

  // 3. weighted sum of V: a block's rows are loaded (and widened from bf16) once per chunk of CH
  // vectors and head group of HB heads, whose accumulators stay in registers through the block
  for (int64_t b = it.first_block; b < it.end_block; ++b) {
    const int64_t base = b * bs - t0, n = imin(bs, it.len - b * bs);
    const T* v = vbase + it.table[b] * bstride;
    if (b + kAhead < it.end_block) prefetch_block(vbase + it.table[b + kAhead] * bstride, bs, ks, hd);
    for (int c0 = 0; c0 < NV; c0 += CH)
      for (int64_t j0 = 0; j0 < g; j0 += HB) {
        const int64_t gc = imin(HB, g - j0);
        Vec r[HB][CH];
        LLMSERVE_UNROLL for (int jj = 0; jj < HB; ++jj)
          LLMSERVE_UNROLL for (int c = 0; c < CH; ++c) r[jj][c] = jj < gc ? vload(acc + (j0 + jj) * hd + (c0 + c) * W) : vzero();
        for (int64_t t = 0; t < n; ++t) {
          Vec vr[CH];
          const T* row = v + t * ks + c0 * W;
          LLMSERVE_UNROLL for (int c = 0; c < CH; ++c) vr[c] = vload(row + c * W);
          LLMSERVE_UNROLL for (int jj = 0; jj < HB; ++jj) {
            if (jj >= gc) break;
            const Vec pt = vset(scores[(j0 + jj) * pitch + base + t]);
            LLMSERVE_UNROLL for (int c = 0; c < CH; ++c) r[jj][c] = vfma(pt, vr[c], r[jj][c]);
          }
        }
        LLMSERVE_UNROLL for (int jj = 0; jj < HB; ++jj)
          if (jj < gc) LLMSERVE_UNROLL for (int c = 0; c < CH; ++c) vstore(acc + (j0 + jj) * hd + (c0 + c) * W, r[jj][c]);
      }
  }
}

// fp32 queries, pre-scaled into the scratch; T = float or uint16_t (bf16 bits)
template <typename T, int NV>
void run_fma(const DecodeItem& it, const DecodeGeom& geo) {
  const int64_t n = geo.g * NV * Vec::W;
  float* qs = it.scratch;
  if (it.q_bf16)
    for (int64_t i = 0; i < n; ++i) qs[i] = scalar(static_cast<const uint16_t*>(it.q)[i]) * geo.scale;
  else
    for (int64_t i = 0; i < n; ++i) qs[i] = static_cast<const float*>(it.q)[i] * geo.scale;
  attend<T, NV>(it, geo, FmaDot<T, NV>{qs}, 1.f, qs + n);
}

template <int NV>
DecodeFn fma_variant(KvType kv) {
  return kv == KvType::kFloat ? &run_fma<float, NV> : &run_fma<uint16_t, NV>;
}
