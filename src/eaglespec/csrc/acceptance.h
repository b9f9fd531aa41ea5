// The verification kernels' result (spec.tree.BatchAcceptance as tensors): path [B, width] (the
// accepted nodes, root first, padded with the last one), count [B], emitted [B, width] (the
// accepted drafted tokens, then the bonus token at count - 1) and bonus [B], all int64.
// Shared by verify_greedy_rows (pointwise.cpp) and verify_sampling_rows (sampling.cpp).
#pragma once
#include <torch/extension.h>

namespace eaglespec {

struct RowAcceptance {
  torch::Tensor path, count, emitted, bonus;
  int64_t width;

  RowAcceptance(int64_t B, int64_t width, const torch::TensorOptions& opts)
      : path(torch::empty({B, width}, opts)), count(torch::empty({B}, opts)),
        emitted(torch::empty({B, width}, opts)), bonus(torch::empty({B}, opts)), width(width) {}

  int64_t* path_row(int64_t b) { return path.data_ptr<int64_t>() + b * width; }

  // Row b walked down to `node` at `depth` (path_row(b)[0..depth] filled) with this bonus token;
  // tokens: the row's node tokens.
  void finish(int64_t b, int64_t depth, int64_t node, int64_t drawn, const int64_t* tokens) {
    int64_t* p = path_row(b);
    for (int64_t j = depth + 1; j < width; ++j) p[j] = node;
    count.data_ptr<int64_t>()[b] = depth + 1;
    bonus.data_ptr<int64_t>()[b] = drawn;
    int64_t* em = emitted.data_ptr<int64_t>() + b * width;
    for (int64_t j = 0; j < width; ++j) em[j] = j == depth ? drawn : tokens[p[j + 1 < width ? j + 1 : width - 1]];
  }

  std::vector<torch::Tensor> tensors() const { return {path, count, emitted, bonus}; }
};

}  // namespace eaglespec
