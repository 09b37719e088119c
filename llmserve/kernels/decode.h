// The contract between the decode-attention glue (paged_attention.cpp) and its ISA variants
// (isa_avx2.cpp, isa_avx512.cpp, and the portable loop in paged_attention.cpp).
//
// One work item is the g query heads that share one KV head of one sequence, over a range of that
// sequence's blocks (a split: long contexts at small batch are split over blocks so that every
// core has work). It writes an unnormalised partial result that the glue merges across splits:
//   partial [g, hd + 2]  rows 0..g-1: sum_t exp(s_t - m) * v_t, then m = max_t s_t, then
//                        l = sum_t exp(s_t - m) (an empty range has l = 0)
// where s_t = scale * q . k_t over the item's tokens.

#pragma once

#include <cstdint>

namespace llmserve {

enum class KvType : int { kFloat = 0, kBFloat16 = 1 };

struct DecodeGeom {
  int64_t g;             // query heads per KV head
  int64_t hd;            // head_dim
  int64_t block_size;    // tokens per block
  int64_t kv_stride;     // elements between tokens of one block (kvh * hd)
  int64_t block_stride;  // elements between blocks (block_size * kvh * hd)
  float scale;
};

struct DecodeItem {
  const void* q;          // [g, hd] unscaled: fp32, or bf16 bits where q_bf16
  bool q_bf16;
  const void* k;          // this KV head's slice of block 0 of k_cache (float or bf16 bits)
  const void* v;          // likewise for v_cache
  const int64_t* table;   // the sequence's block ids
  int64_t first_block;    // the item covers blocks first_block .. end_block - 1 ...
  int64_t end_block;
  int64_t len;            // ... of a sequence of len tokens (the last block may be partial)
  float* partial;         // [g, hd + 2], see above
  float* scratch;         // at least scratch_floats(g, hd, tokens covered) floats
};

inline int64_t scratch_floats(int64_t g, int64_t hd, int64_t tokens) { return 2 * g * hd + g * (tokens + 64) + 64; }

using DecodeFn = void (*)(const DecodeItem&, const DecodeGeom&);

// The variant compiled for (cache dtype, head_dim), or nullptr where that ISA has none.
// q_bf16: the queries are bf16 (so a bf16 dot product on them is exact);
// dpbf16: the CPU has AVX512-BF16 (only the AVX-512 variant uses it).
DecodeFn pick_avx2(KvType kv, int64_t hd);
DecodeFn pick_avx512(KvType kv, bool q_bf16, bool dpbf16, int64_t hd);

}  // namespace llmserve
