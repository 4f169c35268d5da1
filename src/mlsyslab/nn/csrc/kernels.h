// The kernels one file calls from another: decode_layers.cpp runs a whole decode step through the
// per-step kernels of layer_ops.cpp, paged_decode.cpp and streamed_linear.cpp. Each is also a
// `torch.ops.mlsyslab` op.
#pragma once

#include <ATen/ATen.h>

namespace mlsyslab {

void check_float_or_bf16(const at::Tensor& t, const char* name);  // layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths, double scale);
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                           const std::optional<at::Tensor>& residual);

}  // namespace mlsyslab
