// Small per-token operations of the target's forward and of greedy verification, one call each
// instead of torch's: at decode and tree sizes their cost was dispatch and scalar loops, not
// arithmetic (measured on a 16-node tree: silu 17 us and the multiply 7 us per layer; the argmax
// over 16 x 49,152 logits 0.7 ms). Each row is computed on its own, so results are row-invariant.

#include "acceptance.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>

using namespace eaglespec;

// x: [..., 2I] bf16 (gate then up, rows contiguous) -> [..., I] bf16: silu(gate) * up with the
// reference's two roundings (silu rounded to bf16, then the product). silu(g) = g * sigmoid(g),
// the sigmoid from exp(-|g|) so that the exponential never overflows; below -87 (where exp(-|g|)
// is clamped) the sigmoid is 0, as torch's overflowing exp makes it.
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "silu_mul: bf16");
  const int64_t I = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * I && I % LANES == 0, "silu_mul: width must be 2 * a multiple of 16");
  x = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, x.options());
  const int64_t rows = x.numel() / (2 * I);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const fvec one = fvec{} + 1.f, zero = fvec{};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = xp + r * 2 * I;
      const c10::BFloat16* u = g + I;
      for (int64_t c = 0; c < I; c += NL) {
        const fvec v = load_bf16<fvec>(g + c);
        const fvec e = exp_nonpositive(v < zero ? v : zero - v);  // exp(-|v|) in (0, 1]
        fvec sig = (v < zero ? e : one) / (one + e);
        sig = v < fvec{} - 87.f ? zero : sig;  // where torch's exp(-v) overflows: silu = -0
        store_bf16(yp + r * I + c, round_bf16(v * sig) * load_bf16<fvec>(u + c));
      }
    }
  });
  return y;
}

// Index of each row's largest value: x [..., V] bf16 or fp32 -> [...] int64. The first maximum on
// ties, as torch's argmax; NaNs are never chosen (a row of NaNs gives 0). Lane j keeps the best of
// columns j, j + NL, ... (strictly greater replaces, so the earliest stays); the lanes are then
// compared by value, ties to the lower column: the first maximum at any width.
template <typename T>
static int64_t argmax_row(const T* x, int64_t V) {
  fvec best = fvec{} - std::numeric_limits<float>::infinity();
  ivec at = ivec{} - 1, col;
  for (int j = 0; j < NL; ++j) col[j] = j;
  int64_t c = 0;
  for (; c + NL <= V; c += NL, col += NL) {
    fvec v;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&v, x + c, sizeof(v));
    } else {
      v = load_bf16<fvec>(x + c);
    }
    const ivec gt = (ivec)(v > best);
    best = v > best ? v : best;
    at = (at & ~gt) | (col & gt);
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t idx = -1;
  for (int j = 0; j < NL; ++j) {
    if (at[j] >= 0 && (best[j] > top || (best[j] == top && at[j] < idx))) top = best[j], idx = at[j];
  }
  for (; c < V; ++c) {  // the tail: columns past every lane's, so only a strictly larger value wins
    const float v = static_cast<float>(x[c]);
    if (v > top || (idx < 0 && v == top)) top = v, idx = c;
  }
  return idx < 0 ? 0 : idx;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "argmax_rows: bf16 or fp32");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax_rows: a non-empty last dimension");
  x = x.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(at::kLong));
  auto* op = out.data_ptr<int64_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = bf16 ? argmax_row(static_cast<const c10::BFloat16*>(xp) + r * V, V)
                   : argmax_row(static_cast<const float*>(xp) + r * V, V);
    }
  });
  return out;
}

// Greedy verification of B draft trees (spec/verify.py's verify_greedy, which stays the reference
// and the path off the CPU): logits [B, N, V] bf16 or fp32 at every node, tokens / parents [B, N]
// int64 (root -1, parents before children), valid [B, N] bool, width = max_depth + 1 ->
// (path [B, width], count [B], emitted [B, width], bonus [B]), all int64, as verify_greedy gives.
// Each row walks down from the root: the accepted child of a node is its first valid child (in
// node order) whose token is the node's argmax, so only the argmax of accepted nodes is taken.
// The ~25 torch ops of verify_greedy took 0.6 ms per step on a 2-core EPYC for any tree size.
std::vector<torch::Tensor> verify_greedy_rows(torch::Tensor logits, torch::Tensor tokens, torch::Tensor parents,
                                              torch::Tensor valid, int64_t width) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "verify_greedy_rows: bf16 or fp32 logits");
  TORCH_CHECK(logits.dim() == 3 && logits.size(2) > 0, "verify_greedy_rows: logits [B, N, V]");
  const int64_t B = logits.size(0), N = logits.size(1), V = logits.size(2);
  TORCH_CHECK(tokens.sizes() == parents.sizes() && tokens.sizes() == valid.sizes() && tokens.dim() == 2 &&
                  tokens.size(0) == B && tokens.size(1) == N,
              "verify_greedy_rows: tokens, parents, valid [B, N]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && parents.scalar_type() == at::kLong &&
                  valid.scalar_type() == at::kBool && width >= 1,
              "verify_greedy_rows: int64 tokens and parents, bool valid, width >= 1");
  logits = logits.contiguous();
  tokens = tokens.contiguous();
  parents = parents.contiguous();
  valid = valid.contiguous();
  RowAcceptance out(B, width, tokens.options());
  const int64_t *tp = tokens.data_ptr<int64_t>(), *pp = parents.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* lp = logits.data_ptr();
  auto pred = [&](int64_t row) {  // row = b * N + node
    return bf16 ? argmax_row(static_cast<const c10::BFloat16*>(lp) + row * V, V)
                : argmax_row(static_cast<const float*>(lp) + row * V, V);
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t *tok = tp + b * N, *par = pp + b * N;
    const bool* ok = vp + b * N;
    int64_t* p = out.path_row(b);
    int64_t node = 0, depth = 0, top = pred(b * N);
    p[0] = 0;
    while (depth + 1 < width) {
      int64_t next = -1;
      for (int64_t c = node + 1; c < N; ++c) {
        if (par[c] == node && ok[c] && tok[c] == top) {
          next = c;
          break;
        }
      }
      if (next < 0) break;
      node = next;
      p[++depth] = node;
      top = pred(b * N + node);
    }
    out.finish(b, depth, node, top, tok);
  }
  return out.tensors();
}

// Keep the accepted path in a row KV cache (kv_cache.RowKVCache.keep): k, v [L, B, H, S, D]
// (bf16 or fp32, S and D contiguous), per row b copy slots start[b] + src[b, j] to start[b] + j
// for every j < src.size(1), all reads before any write (as torch's indexed copy does). A row whose
// path is already in place (vanilla's one-node path) copies nothing. torch's advanced-indexing
// copy cost 0.2-0.3 ms per step.
void keep_rows(torch::Tensor k, torch::Tensor v, torch::Tensor start, torch::Tensor src) {
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  k.scalar_type() == v.scalar_type() && k.stride(4) == 1 && k.stride(3) == k.size(4),
              "keep_rows: k, v [L, B, H, S, D] alike, with S and D contiguous");
  TORCH_CHECK(src.dim() == 2 && src.size(0) == k.size(1) && start.dim() == 1 && start.size(0) == k.size(1) &&
                  src.scalar_type() == at::kLong && start.scalar_type() == at::kLong,
              "keep_rows: int64 start [B] and src [B, W]");
  src = src.contiguous();
  start = start.contiguous();
  const int64_t L = k.size(0), B = k.size(1), H = k.size(2), S = k.size(3), W = src.size(1);
  const int64_t bytes = k.size(4) * k.element_size();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* st = start.data_ptr<int64_t>();
  std::vector<char> held(W * bytes);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* from = sp + b * W;
    bool moves = false;
    for (int64_t j = 0; j < W; ++j) {
      TORCH_CHECK(st[b] >= 0 && st[b] + from[j] >= 0 && st[b] + from[j] < S && st[b] + j < S,
                  "keep_rows: a slot past the cache");
      moves |= from[j] != j;
    }
    if (!moves) continue;
    for (torch::Tensor* t : {&k, &v}) {
      char* base = static_cast<char*>(t->data_ptr());
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t h = 0; h < H; ++h) {
          char* row = base + (l * t->stride(0) + b * t->stride(1) + h * t->stride(2)) * t->element_size() +
                      st[b] * bytes;
          for (int64_t j = 0; j < W; ++j) std::memcpy(held.data() + j * bytes, row + from[j] * bytes, bytes);
          for (int64_t j = 0; j < W; ++j)
            if (from[j] != j) std::memcpy(row + j * bytes, held.data() + j * bytes, bytes);
        }
      }
    }
  }
}

// The k largest log-probabilities of each row of logits: x [..., V] bf16 or fp32 ->
// (values [..., k] fp32, descending, x - logsumexp(x); indices [..., k] int64). One pass for the
// maximum, one for the sum of exp(x - max) (the package's exp, 16 lanes summed in a fixed tree)
// and the top k (a block of 16 is looked at only when one of its values beats the k-th best so
// far). Equal values rank by index, the lower first; NaNs are never picked. Drafting's log_softmax,
// then topk, in one call: 110 us -> about 15 for 4 x 8,192 logits.
template <typename T>
static void topk_logprobs_row(const T* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
  auto load = [&](int64_t c) {
    fvec v;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&v, x + c, sizeof(v));
    } else {
      v = load_bf16<fvec>(x + c);
    }
    return v;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t full = V / LANES * LANES;
  fvec mx = fvec{} - inf;
  for (int64_t c = 0; c < full; c += NL) {
    const fvec v = load(c);
    mx = v > mx ? v : mx;
  }
  float m = -inf;
  for (int j = 0; j < NL; ++j) m = mx[j] > m ? mx[j] : m;
  for (int64_t c = full; c < V; ++c) m = static_cast<float>(x[c]) > m ? static_cast<float>(x[c]) : m;
  for (int64_t j = 0; j < k; ++j) vals[j] = -inf, idx[j] = -1;
  auto offer = [&](float v, int64_t c) {  // insert (v, c) into the sorted top k; ties stay behind
    if (!(v > vals[k - 1]) && !(idx[k - 1] < 0 && v == vals[k - 1])) return;
    int64_t j = k - 1;
    while (j > 0 && (v > vals[j - 1] || (idx[j - 1] < 0 && v == vals[j - 1]))) {
      vals[j] = vals[j - 1], idx[j] = idx[j - 1];
      --j;
    }
    vals[j] = v, idx[j] = c;
  };
  fvec sum[LANES / NL] = {};  // lanes 0..15 of one 16-lane sum, NL at a time
  const fvec mv = fvec{} + m;
  for (int64_t c = 0; c < full; c += LANES) {
    for (int p = 0; p < LANES / NL; ++p) {
      const fvec v = load(c + p * NL);
      sum[p] = sum[p] + exp_nonpositive(v - mv);
      if (idx[k - 1] < 0 || any_greater(v, vals[k - 1])) {
        for (int j = 0; j < NL; ++j) offer(v[j], c + p * NL + j);
      }
    }
  }
  float s = lane_sum(joined(sum));
  for (int64_t c = full; c < V; ++c) {
    const float v = static_cast<float>(x[c]);
    const f32x16 e = exp_nonpositive(f32x16{} + (v - m));
    s += e[0];
    offer(v, c);
  }
  const float lse = m + std::log(s);
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = idx[j] < 0 ? -inf : vals[j] - lse;
    idx[j] = idx[j] < 0 ? 0 : idx[j];
  }
}

std::vector<torch::Tensor> topk_logprobs(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "topk_logprobs: bf16 or fp32");
  TORCH_CHECK(x.dim() >= 1 && k >= 1 && k <= x.size(-1), "topk_logprobs: need 1 <= k <= the last dimension");
  x = x.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.back() = k;
  auto vals = torch::empty(sizes, x.options().dtype(at::kFloat));
  auto idx = torch::empty(sizes, x.options().dtype(at::kLong));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bf16) {
        topk_logprobs_row(static_cast<const c10::BFloat16*>(xp) + r * V, V, k, vp + r * k, ip + r * k);
      } else {
        topk_logprobs_row(static_cast<const float*>(xp) + r * V, V, k, vp + r * k, ip + r * k);
      }
    }
  });
  return {vals, idx};
}
