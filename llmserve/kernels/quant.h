// The contract between the quantized-linear glue (quant_linear.cpp) and its ISA variants
// (isa_avx2.cpp, isa_avx512.cpp): linear layers over block-quantized weights, read as stored.
//
// Two formats, both in blocks of kQBlock = 32 weights along K (GGUF's Q8_0 and Q4_1 layouts,
// with the scales split out of the blocks):
//   int8 (Q8_0): w[o, k] = d[o, k/32] * q[o, k]                 q: int8 [out, kb * 32]
//   int4 (Q4_1): w[o, k] = d[o, k/32] * q[o, k] + m[o, k/32]    q: 4 bits, two a byte [out, kb * 16]:
//       in block b of a row, weight j < 16 is the low nibble of byte b * 16 + j and weight
//       j + 16 its high nibble.
// d, m: float16 bits [out, kb]; kb = ceil(in / 32). A row's last block may be partial (in % 32
// weights): what lies past `in` (padding) is never read into a result.
// Dequantized as one FMA in fp32 (d * q is exact), so every path computes the same weights.

#pragma once

#include <cstdint>

namespace llmserve {

constexpr int64_t kQBlock = 32;

struct QWeight {
  const uint8_t* q;   // row o starts at q + o * row_bytes
  const uint16_t* d;  // [out, kb] float16 bits
  const uint16_t* m;  // [out, kb] float16 bits (int4), nullptr (int8)
  int64_t in, kb, row_bytes;
  bool int4() const { return m != nullptr; }
};

//   y[r, o] = sum_k x[r, k] * w[o, k] + bias[o]   for o in [o0, o1), r < M (M <= kGemvMaxRows)
// x: [M, in] fp32; bias: [out] fp32 or nullptr; y: [M, out] fp32; pf: prefetch distance in bytes.
using QGemvFn = void (*)(const float* x, int64_t m, const QWeight& w, const float* bias, int64_t o0, int64_t o1,
                         float* y, int64_t out, int64_t pf);
// rows [o0, o1) of the dequantized weight into dst [o1 - o0, in]: fp32, or bf16 bits where bf16
using QDequantFn = void (*)(const QWeight& w, int64_t o0, int64_t o1, void* dst, bool bf16);

// Rows of bf16 activations: as QGemvFn, but x [M, in] and y [M, out] bf16 bits, M <= 4 (the fp32
// kernel over the rows widened to fp32 once a call; for int4 under AVX512-BF16, the bf16 dot product of quant_dpbf16.h, whose
// sums differ from the fp32 kernel's in summation order only).
using QGemvBf16Fn = void (*)(const uint16_t* x, int64_t m, const QWeight& w, const float* bias, int64_t o0, int64_t o1,
                             uint16_t* y, int64_t out, int64_t pf);
constexpr int64_t kQDotMaxRows = 4;

QGemvFn pick_qgemv_avx2(bool int4);
QGemvFn pick_qgemv_avx512(bool int4);
QGemvBf16Fn pick_qgemv_bf16_avx2(bool int4);
QGemvBf16Fn pick_qgemv_bf16_avx512(bool int4, bool dpbf16);  // dpbf16: the CPU has AVX512-BF16
QDequantFn pick_qdequant_avx2();
QDequantFn pick_qdequant_avx512();

// IEEE half bits -> float, exactly (subnormals, infinities and NaNs included)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace llmserve
