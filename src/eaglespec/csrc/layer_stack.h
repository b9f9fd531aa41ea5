// LayerStack: a run of decoder layers as one call (csrc/layer_stack.cpp binds it; the draft runner
// of csrc/draft_runner.cpp runs a draft head's layer through it).
#pragma once

#include "ops.h"

#include <torch/extension.h>

namespace layer_stack {

using Gemm = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor);

struct Product {
  Gemm fn;
  torch::Tensor a, b;  // the packed weight's two tensors (codes, then params / scales)
  torch::Tensor operator()(const torch::Tensor& x) const { return fn(x, a, b); }
};

struct Layer {
  c10::optional<torch::Tensor> attn_norm;  // [H]; None: the EAGLE-1/2 draft layer has no input norm
  torch::Tensor mlp_norm;                  // [H]
  double eps;
  Product qkv, out, gate_up, down;
  int64_t nh, nkv;
};

inline Product product(uintptr_t fn, torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(fn != 0, "LayerStack: a product needs its kernel's address");
  return Product{reinterpret_cast<Gemm>(fn), std::move(a), std::move(b)};
}

}  // namespace layer_stack

class LayerStack {
  using Layer = layer_stack::Layer;

 public:
  void add(c10::optional<torch::Tensor> attn_norm, torch::Tensor mlp_norm, double eps, uintptr_t qkv_fn,
           torch::Tensor qkv_a, torch::Tensor qkv_b, uintptr_t out_fn, torch::Tensor out_a, torch::Tensor out_b,
           uintptr_t gate_up_fn, torch::Tensor gate_up_a, torch::Tensor gate_up_b, uintptr_t down_fn,
           torch::Tensor down_a, torch::Tensor down_b, int64_t nh, int64_t nkv) {
    using layer_stack::product;
    layers_.push_back(Layer{std::move(attn_norm), std::move(mlp_norm), eps, product(qkv_fn, qkv_a, qkv_b),
                            product(out_fn, out_a, out_b), product(gate_up_fn, gate_up_a, gate_up_b),
                            product(down_fn, down_a, down_b), nh, nkv});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // Layers [first, last) over x [B*T, H] bf16 (the residual stream as rows): cos, sin [B, 1, T, hd];
  // k, v [L, B, nkv, capacity, hd], the whole cache (layer i reads and writes k[i], v[i]); slots
  // [B, T] where the new entries go; attention over slots [0, view) with mask [B, T, view] bool or
  // None; scale and amx as attention.kernel_attention passes them. Returns the stream after `last`.
  torch::Tensor run(torch::Tensor x, int64_t b, int64_t t, torch::Tensor cos, torch::Tensor sin, torch::Tensor k,
                    torch::Tensor v, torch::Tensor slots, int64_t view, c10::optional<torch::Tensor> mask,
                    double scale, bool amx, int64_t first, int64_t last) const {
    TORCH_CHECK(0 <= first && first <= last && last <= size(), "LayerStack.run: layers out of range");
    TORCH_CHECK(x.dim() == 2 && x.size(0) == b * t, "LayerStack.run: x [B*T, H]");
    TORCH_CHECK(k.dim() == 5 && k.size(0) >= last && view <= k.size(3), "LayerStack.run: k, v [L, B, nkv, S, hd]");
    const int64_t rows = b * t;
    for (int64_t i = first; i < last; ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor normed = l.attn_norm.has_value() ? rms_norm(x, *l.attn_norm, l.eps) : x;
      const torch::Tensor qkv = l.qkv(normed);  // [B*T, (nh + 2 nkv) hd]
      torch::Tensor k_layer = k.select(0, i), v_layer = v.select(0, i);  // [B, nkv, S, hd]
      const torch::Tensor q = qkv_rope_write(qkv.view({b, t, -1}), cos, sin, k_layer, v_layer, slots, l.nh, l.nkv);
      const torch::Tensor y = decode_attention(q, k_layer.slice(2, 0, view), v_layer.slice(2, 0, view), mask, scale,
                                               amx);  // [B, nh, T, hd]
      x = x + l.out(y.transpose(1, 2).reshape({rows, -1}));
      x = x + l.down(silu_mul(l.gate_up(rms_norm(x, l.mlp_norm, l.eps))));
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
};
