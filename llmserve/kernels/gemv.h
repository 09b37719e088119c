// The contract between the GEMV glue (gemv.cpp) and its ISA variants (isa_avx2.cpp,
// isa_avx512.cpp): a linear layer for steps of few rows (batch-1 decode and small batches), which
// is bound by reading the weights once, over a plain [out, in] weight. It takes up to
// kGemvMaxRows rows; packed layers send it steps of at most gemv_row_limit() rows (the plan
// measures where it stops beating oneDNN on this machine).
//   y[m, o] = sum_i x[m, i] * w[o, i] + bias[o]   for rows o in [o0, o1), m < M
// x: [M, in] fp32; w: [out, in] float or bf16 bits; bias: [out] fp32 or nullptr; y: [M, out] fp32;
// pf: software prefetch distance in bytes (0: none; see gemv_kernel.h).

#pragma once

#include <cstdint>

#include "decode.h"

namespace llmserve {

constexpr int64_t kGemvMaxRows = 16;
int64_t gemv_row_limit();  // set_gemv_max_rows (gemv.cpp)
int64_t gemv_prefetch_bytes();  // set_gemv_prefetch (gemv.cpp); the quantized GEMV prefetches as far
// Of a step's m rows, those the GEMVs compute: all, or the first set_live_rows(n) (gemv.cpp). A
// compiled step pads a batch-1 decode with a row (model/compile.py); the GEMVs then write zeros
// into the padding row instead of reading every weight for it.
int64_t live_rows(int64_t m);

using GemvFn = void (*)(const float* x, int64_t m, const void* w, const float* bias, int64_t in, int64_t o0,
                        int64_t o1, float* y, int64_t out, int64_t pf);

GemvFn pick_gemv_avx2(KvType weight);
GemvFn pick_gemv_avx512(KvType weight);

// The ISA variant this process runs (llmserve.plan picks it; isa.cpp keeps it).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
int current_isa();

}  // namespace llmserve
