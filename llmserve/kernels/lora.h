// The contract between the LoRA glue (lora.cpp) and its ISA variants (isa_avx2.cpp,
// isa_avx512.cpp, and the portable loop in lora.cpp): one block of up to kLoraMaxRows rows that
// use the same adapter, updated in place:
//   t = A x_m                                      [n * R] per row m (the shrink)
//   y_m[slice j] += B[jR:(j+1)R, slice j]^T t[jR:(j+1)R]   for each slice j (the expand)
// x, y, A, B all in the layer's dtype (float, or bf16 bits).

#pragma once

#include <cstdint>

#include "decode.h"

namespace llmserve {

constexpr int64_t kLoraMaxRows = 4;

struct LoraGeom {
  int64_t in, out;        // x's and y's widths
  int64_t width, rank;    // A's rows (n * R) and R
  const int64_t* slices;  // n column counts of y, in order, adding up to out
  int64_t n;
};

struct LoraBlock {
  const void* x[kLoraMaxRows];  // the rows of x ...
  void* y[kLoraMaxRows];        // ... and of y, m of each
  int64_t m;
  const void* a;   // this slot's A [n * R, in]
  const void* b;   // this slot's B [n * R, out]; slice j's R rows are read only over its own columns
  float* scratch;  // kLoraMaxRows * (in + width) floats, this thread's own
};

using LoraBlockFn = void (*)(const LoraBlock&, const LoraGeom&);

LoraBlockFn pick_lora_avx2(KvType weight);
LoraBlockFn pick_lora_avx512(KvType weight);

}  // namespace llmserve
