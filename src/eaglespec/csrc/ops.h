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
std::vector<torch::Tensor> verify_greedy_rows(torch::Tensor logits, torch::Tensor tokens, torch::Tensor parents,
                                              torch::Tensor valid, int64_t width);
void keep_rows(torch::Tensor k, torch::Tensor v, torch::Tensor start, torch::Tensor src);
torch::Tensor softmax_rows(torch::Tensor x, torch::Tensor temperature);  // sampling.cpp
torch::Tensor draw_rows(torch::Tensor probs, torch::Tensor u);
torch::Tensor uniforms_rows(torch::Tensor seed, torch::Tensor step, torch::Tensor node, int64_t purpose);
std::vector<torch::Tensor> verify_sampling_rows(torch::Tensor logits, torch::Tensor tokens, torch::Tensor parents,
                                                torch::Tensor valid, torch::Tensor temperature,
                                                c10::optional<torch::Tensor> draft_probs, torch::Tensor u_accept,
                                                torch::Tensor u_bonus, int64_t width, int64_t k_max);
void bind_layer_stack(py::module_& m);  // layer_stack.cpp
void bind_draft_runner(py::module_& m);  // draft_runner.cpp
namespace eaglespec {
bool attention_amx_ready();  // attention_amx.cpp
}
