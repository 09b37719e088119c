// The LoRA kernel (lora.h), written once over Vec (vec.h) and compiled once per ISA; included by
// isa_avx2.cpp and isa_avx512.cpp inside their pragma region and anonymous namespace, after
// gemv_kernel.h. The rows go to fp32 in the scratch, the shrink is the GEMV kernel over A's rows,
// and in the expand the M rows share each B vector loaded, so it feeds M FMA chains (U column
// vectors per step: M * U independent accumulators).

template <typename T, int M>
void lora_expand(const float* t, int64_t ts, const T* b, int64_t bs, int64_t rank, T* const* y, int64_t c0,
                 int64_t c1) {
  constexpr int W = Vec::W, U = 2;
  int64_t c = c0;
  for (; c + U * W <= c1; c += U * W) {
    Vec acc[M][U];
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) LLMSERVE_UNROLL for (int u = 0; u < U; ++u) acc[m][u] = vzero();
    for (int64_t r = 0; r < rank; ++r) {
      Vec bv[U];
      LLMSERVE_UNROLL for (int u = 0; u < U; ++u) bv[u] = vload(b + r * bs + c + u * W);
      LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
        const Vec tv = vset(t[m * ts + r]);
        LLMSERVE_UNROLL for (int u = 0; u < U; ++u) acc[m][u] = vfma(tv, bv[u], acc[m][u]);
      }
    }
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m)
      LLMSERVE_UNROLL for (int u = 0; u < U; ++u) vstore(y[m] + c + u * W, vadd(vload(y[m] + c + u * W), acc[m][u]));
  }
  for (; c + W <= c1; c += W) {
    Vec acc[M];
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[m] = vzero();
    for (int64_t r = 0; r < rank; ++r) {
      const Vec bv = vload(b + r * bs + c);
      LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[m] = vfma(vset(t[m * ts + r]), bv, acc[m]);
    }
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) vstore(y[m] + c, vadd(vload(y[m] + c), acc[m]));
  }
  for (; c < c1; ++c)
    for (int m = 0; m < M; ++m) {
      float s = scalar(y[m][c]);
      for (int64_t r = 0; r < rank; ++r) s += t[m * ts + r] * scalar(b[r * bs + c]);
      put(y[m] + c, s);
    }
}

template <typename T, int M>
void lora_block_m(const LoraBlock& blk, const LoraGeom& geo) {
  float* xs = blk.scratch;                    // [M, in]
  float* t = blk.scratch + M * geo.in;        // [M, width]
  for (int m = 0; m < M; ++m)
    for (int64_t i = 0; i < geo.in; ++i) xs[m * geo.in + i] = scalar(static_cast<const T*>(blk.x[m])[i]);
  gemv_m<T, M>(xs, blk.a, nullptr, geo.in, 0, geo.width, t, geo.width);
  T* const* y = reinterpret_cast<T* const*>(blk.y);
  const T* b = static_cast<const T*>(blk.b);
  for (int64_t j = 0, c0 = 0; j < geo.n; c0 += geo.slices[j++])
    lora_expand<T, M>(t + j * geo.rank, geo.width, b + j * geo.rank * geo.out, geo.out, geo.rank, y, c0,
                      c0 + geo.slices[j]);
}

template <typename T>
void lora_block(const LoraBlock& blk, const LoraGeom& geo) {
  switch (blk.m) {
    case 1: return lora_block_m<T, 1>(blk, geo);
    case 2: return lora_block_m<T, 2>(blk, geo);
    case 3: return lora_block_m<T, 3>(blk, geo);
    default: return lora_block_m<T, 4>(blk, geo);
  }
}

inline LoraBlockFn lora_variant(KvType weight) { return weight == KvType::kFloat ? &lora_block<float> : &lora_block<uint16_t>; }
