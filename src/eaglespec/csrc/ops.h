// The operations of the `eaglespec_ops` extension (bound to Python in ops.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               c10::optional<torch::Tensor> mask, double scale, bool amx);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor qkv_rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor slots, int64_t nh, int64_t nkv);
torch::Tensor silu_mul(torch::Tensor x);  // pointwise.cpp
torch::Tensor argmax_rows(torch::Tensor x);
std::vector<torch::Tensor> topk_logprobs(torch::Tensor x, int64_t k);
namespace eaglespec {
bool attention_amx_ready();  // attention_amx.cpp
}
