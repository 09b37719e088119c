// The AVX2 + FMA variants of the decode-attention kernel (decode_kernel.h) and the GEMV
// (gemv_kernel.h), over 8-lane vectors. Only this file is built for AVX2; the glue calls it only
// on a CPU that has AVX2 and FMA.

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
#pragma GCC target("avx2,fma,f16c")

namespace {
#define LLMSERVE_AVX2
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
}  // namespace

namespace llmserve {

GemvFn pick_gemv_avx2(KvType weight) { return gemv_variant(weight); }
LoraBlockFn pick_lora_avx2(KvType weight) { return lora_variant(weight); }
QGemvFn pick_qgemv_avx2(bool int4) { return qgemv_variant(int4); }
QDequantFn pick_qdequant_avx2() { return &qdequant; }
LayerFns layer_fns_avx2(bool bf16) { return layer_variant(bf16); }
QGemvBf16Fn pick_qgemv_bf16_avx2(bool int4) { return qgemv_bf16_variant(int4); }

// head_dim 16, 32, 64 or 128 (Llama-style models use 64 or 128); others take the portable loop
DecodeFn pick_avx2(KvType kv, int64_t hd) {
  switch (hd) {
    case 16: return fma_variant<2>(kv);
    case 32: return fma_variant<4>(kv);
    case 64: return fma_variant<8>(kv);
    case 128: return fma_variant<16>(kv);
    default: return nullptr;
  }
}

}  // namespace llmserve

#pragma GCC pop_options
