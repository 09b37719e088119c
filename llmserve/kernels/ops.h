// The ops one source file calls in another (each is also a torch op, torch.ops.llmserve.*): a
// direct call skips the dispatcher, which a fused op (decoder_layer.cpp) would otherwise pay
// several times a layer.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace llmserve {

at::Tensor onednn_linear(const at::Tensor& x, int64_t handle);  // packed_linear.cpp
at::Tensor qlinear(const at::Tensor& x, int64_t handle);        // quant_linear.cpp
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping);  // cache_write.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& context_len,
                           const at::Tensor& prefill_tables, double scale);  // paged_attention.cpp

}  // namespace llmserve
