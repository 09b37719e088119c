// The contract between the fused decoder layer (decoder_layer.cpp) and its ISA variants
// (isa_avx2.cpp, isa_avx512.cpp over layer_kernel.h, and the portable loops in
// decoder_layer.cpp): the elementwise parts of one Llama decoder layer, on one row of the
// activation dtype (fp32, or bf16 bits). Each computes in fp32 and rounds a result to that dtype
// once, as a compiled graph's fused kernels do; the RMS norm also rounds where the model does
// (the normalised row, before the weight).
//   rms_norm  y[i] = w[i] * round(x[i] / sqrt(mean(x^2) + eps))        x, w, y: [n]
//   rope      y[h, i] = x[h, i] * cos[i] + rotate_half(x[h])[i] * sin[i]  x, y: [heads, hd] (rows
//             of x may be strided: x_stride between heads), cos, sin: [hd]; rotate_half(r) =
//             [-r[hd/2:], r[:hd/2]], the layout of Hugging Face checkpoints
//   silu_mul  y[i] = silu(gate[i]) * up[i]                              gate, up, y: [n]
//   add       y[i] = a[i] + b[i]                                        a, b, y: [n]

#pragma once

#include <cstdint>

namespace llmserve {

struct LayerFns {
  void (*rms_norm)(const void* x, const void* w, int64_t n, float eps, void* y);
  void (*rope)(const void* x, int64_t x_stride, const void* cos, const void* sin, int64_t heads, int64_t hd, void* y);
  void (*silu_mul)(const void* gate, const void* up, int64_t n, void* y);
  void (*add)(const void* a, const void* b, int64_t n, void* y);
};

LayerFns layer_fns_avx2(bool bf16);
LayerFns layer_fns_avx512(bool bf16);

}  // namespace llmserve
