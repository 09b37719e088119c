// The AVX-512 variants of the decode-attention kernel (decode_kernel.h over 16-lane vectors, with
// bf16 x bf16 scores from the AVX512-BF16 dot product where the CPU has it) and of the GEMV
// (gemv_kernel.h). Only this file is
// built for AVX-512; the glue calls it only on a CPU with AVX-512 F, BW, VL and DQ, and the
// dot-product variant only where the CPU has AVX512-BF16 too.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "decode.h"
#include "gemv.h"
#include "layer.h"
#include "lora.h"
#include "quant.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

namespace {
#define LLMSERVE_AVX512
using llmserve::DecodeFn;
using llmserve::GemvFn;
using llmserve::LoraBlock;
using llmserve::LoraBlockFn;
using llmserve::LoraGeom;
using llmserve::DecodeGeom;
using llmserve::DecodeItem;
using llmserve::KvType;
#include "vec.h"
#include "decode_kernel.h"
#include "gemv_kernel.h"
#include "lora_kernel.h"
#include "quant_kernel.h"
#include "layer_kernel.h"
#include "quant_dpbf16.h"

// bf16 queries against bf16 rows: bf16 x bf16 products are exact in fp32, so only the summation
// order differs from the fp32 path; the scale is applied to the sums. q [g, hd] raw bf16.
template <int NV>
struct Bf16Dot {
  const uint16_t* q;
  struct Head {
    __m512bh qh[NV / 2];
    inline Vec operator()(const uint16_t* row) const {
      __m512 part = _mm512_setzero_ps();
      LLMSERVE_UNROLL for (int c = 0; c < NV / 2; ++c)
        part = _mm512_dpbf16_ps(part, qh[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
      return {part};
    }
  };
  inline Head head(int64_t j) const {
    Head h;
    LLMSERVE_UNROLL for (int c = 0; c < NV / 2; ++c) h.qh[c] = (__m512bh)_mm512_loadu_si512(q + (j * NV / 2 + c) * 32);
    return h;
  }
};

template <int NV>
void run_dpbf16(const DecodeItem& it, const DecodeGeom& geo) {
  const int64_t n = geo.g * NV * 16;
  attend<uint16_t, NV>(it, geo, Bf16Dot<NV>{static_cast<const uint16_t*>(it.q)}, geo.scale, it.scratch);
}

}  // namespace

namespace llmserve {

GemvFn pick_gemv_avx512(KvType weight) { return gemv_variant(weight); }
LoraBlockFn pick_lora_avx512(KvType weight) { return lora_variant(weight); }
QGemvFn pick_qgemv_avx512(bool int4) { return qgemv_variant(int4); }
QDequantFn pick_qdequant_avx512() { return &qdequant; }
LayerFns layer_fns_avx512(bool bf16) { return layer_variant(bf16); }
QGemvBf16Fn pick_qgemv_bf16_avx512(bool int4, bool dpbf16) {
  return int4 && dpbf16 ? &qgemv_dpbf16 : qgemv_bf16_variant(int4);
}

DecodeFn pick_avx512(KvType kv, bool q_bf16, bool dpbf16, int64_t hd) {
  const bool dp = kv == KvType::kBFloat16 && q_bf16 && dpbf16;
  switch (hd) {
    case 16: return fma_variant<1>(kv);  // one vector: no bf16 pairs to spare
    case 32: return dp ? &run_dpbf16<2> : fma_variant<2>(kv);
    case 64: return dp ? &run_dpbf16<4> : fma_variant<4>(kv);
    case 128: return dp ? &run_dpbf16<8> : fma_variant<8>(kv);
    default: return nullptr;
  }
}

}  // namespace llmserve

#pragma GCC pop_options
