// Writes a step's new K/V rows into the paged KV cache: vLLM's reshape_and_cache, for our layout.
//
// Shapes (T = the cache dtype; k and v are converted to it first if they differ):
//   k, v          [N, kvh, hd]                      the new tokens' keys and values
//   kv_cache      [2, num_blocks, block_size, kvh, hd]  written in place: [0] keys, [1] values
//   slot_mapping  [N] int64                          row n goes to slot slot_mapping[n]
//                                                    (block * block_size + offset); a negative
//                                                    slot (a padded row) writes nothing
// A row is kvh * hd contiguous elements on both sides (rows may be strided in k and v), so each
// is one memcpy. The same slot twice in one call keeps the later row, as index_copy_ does.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

// x [N, kvh, hd] in the cache's dtype, with each row's kvh * hd elements contiguous (a view of a
// fused qkv row qualifies as it is; anything else is copied).
at::Tensor rows_of(const at::Tensor& x, at::ScalarType dtype) {
  const at::Tensor y = x.to(dtype);
  return y.stride(2) == 1 && y.stride(1) == y.size(2) ? y : y.contiguous();
}

void reshape_and_cache_meta(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&) {}

}  // namespace

namespace llmserve {

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kvh, hd] tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4),
              "k and v must be [N, kvh, hd] matching the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be [N] int64");
  const at::Tensor kc = rows_of(k, kv_cache.scalar_type()), vc = rows_of(v, kv_cache.scalar_type());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t n = k.size(0), num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4) * kv_cache.element_size();  // bytes
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] < num_slots, "slot_mapping[", i, "] = ", sp[i], " is outside the cache (", num_slots, " slots)");
  char* keys = static_cast<char*>(kv_cache.data_ptr());
  char* vals = keys + num_slots * row;
  // The slots are scattered and cold: ask for every destination line first, so the misses
  // overlap instead of each copy waiting for its own.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t off = 0; off < row && sp[i] >= 0; off += 64) {
      __builtin_prefetch(keys + sp[i] * row + off, 1);
      __builtin_prefetch(vals + sp[i] * row + off, 1);
    }
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  const int64_t kstride = kc.stride(0) * kc.element_size(), vstride = vc.stride(0) * vc.element_size();
  for (int64_t i = 0; i < n; ++i) {
    if (sp[i] < 0) continue;
    std::memcpy(keys + sp[i] * row, ks + i * kstride, row);
    std::memcpy(vals + sp[i] * row, vs + i * vstride, row);
  }
}

}  // namespace llmserve

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("reshape_and_cache", &llmserve::reshape_and_cache); }
TORCH_LIBRARY_IMPL(llmserve, Meta, m) { m.impl("reshape_and_cache", &reshape_and_cache_meta); }
