// Sampling on a CPU for temperature-only rows (no top-k / top-p filter): the distribution
// softmax(logits / T), the inverse-CDF draw, and multi-round speculative sampling over a draft
// tree, each row in one call. spec/verify.py's torch ops stay the reference and the path
// elsewhere (CUDA, top-k / top-p rows); at 49,152 logits they cost ~1.5 ms per node on a 2-core
// EPYC (about 15 vocabulary-wide ops each), most of a sampled step's verification.
//
// Owns the numerics of temperature-only sampling on a CPU: `softmax_rows` is what
// spec.sampling.row_probabilities and sampling.probabilities return there, so plain sampling,
// the host oracle and speculative verification all draw from the same bits. The draw is
// spec.rng.draw's (the first token whose cumulative sum passes u * total, clamped to the last
// token with mass) up to the rounding of its sums. Sums here add float lanes per block of 64 and
// the blocks in fp64 (torch: its own fp32 order), so a rejected node's renormalised distribution
// may differ from the torch path's in the last bit.

#include "acceptance.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <type_traits>

using namespace eaglespec;

namespace {

template <typename T>
inline fvec load_row(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    fvec v;
    std::memcpy(&v, x, sizeof(v));
    return v;
  } else {
    return load_bf16<fvec>(x);
  }
}

// p[0..V) = softmax(x / t) in fp32: y = x / t, its maximum, e = exp(y - max) by the package's exp
// (0 below -87, as an underflowing exp gives, so -inf logits get exactly 0), then e / sum(e), the
// sum over NL float lanes (a fixed order) added up in fp64.
template <typename T>
void softmax_row(const T* x, int64_t V, float t, float* p) {
  const int64_t full = V / NL * NL;
  const float inf = std::numeric_limits<float>::infinity();
  const fvec vt = fvec{} + t;
  fvec vmax = fvec{} - inf;
  for (int64_t i = 0; i < full; i += NL) {
    const fvec y = load_row(x + i) / vt;
    std::memcpy(p + i, &y, sizeof(y));
    vmax = y > vmax ? y : vmax;
  }
  float mx = -inf;
  for (int j = 0; j < NL; ++j) mx = vmax[j] > mx ? vmax[j] : mx;
  for (int64_t i = full; i < V; ++i) {
    p[i] = static_cast<float>(x[i]) / t;
    mx = p[i] > mx ? p[i] : mx;
  }
  const fvec vm = fvec{} + mx, lo = fvec{} - 87.f, zero = fvec{};
  fvec acc = zero;
  for (int64_t i = 0; i < full; i += NL) {
    fvec d;
    std::memcpy(&d, p + i, sizeof(d));
    d = d - vm;
    const fvec e = exp_nonpositive(d);
    const fvec r = d < lo ? zero : e;
    acc += r;
    std::memcpy(p + i, &r, sizeof(r));
  }
  double s = 0.0;
  for (int j = 0; j < NL; ++j) s += acc[j];
  for (int64_t i = full; i < V; ++i) {
    const fvec d = fvec{} + (p[i] - mx);
    const fvec e = exp_nonpositive(d);
    p[i] = d[0] < -87.f ? 0.f : e[0];
    s += p[i];
  }
  const fvec vs = fvec{} + static_cast<float>(s);
  for (int64_t i = 0; i < full; i += NL) {
    fvec e;
    std::memcpy(&e, p + i, sizeof(e));
    e = e / vs;
    std::memcpy(p + i, &e, sizeof(e));
  }
  for (int64_t i = full; i < V; ++i) p[i] = p[i] / static_cast<float>(s);
}

constexpr int64_t kBlock = 64;  // the draw's blocks: their sums locate u * total without a full scan

float block_sum(const float* p, int64_t n) {  // n <= kBlock, NL float lanes then fp64
  fvec acc = fvec{};
  int64_t i = 0;
  for (; i + NL <= n; i += NL) {
    fvec v;
    std::memcpy(&v, p + i, sizeof(v));
    acc += v;
  }
  double s = 0.0;
  for (int j = 0; j < NL; ++j) s += acc[j];
  for (; i < n; ++i) s += p[i];
  return static_cast<float>(s);
}

// Inverse-CDF draw for one row: probs [V] fp32, u in [0, 1): the first token whose cumulative
// sum (fp64) passes u * total, clamped to the last token with mass (a zero-mass token is never
// drawn, rounding included), as spec.rng.draw. Block sums find where to start adding one by one.
int64_t draw_row(const float* p, int64_t V, double u) {
  int64_t last = V - 1;
  while (last > 0 && !(p[last] > 0.f)) --last;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  double total = 0.0;
  for (int64_t k = 0; k < blocks; ++k) {
    sums[k] = block_sum(p + k * kBlock, std::min(kBlock, V - k * kBlock));
    total += sums[k];
  }
  const double target = u * total;
  double c = 0.0;
  int64_t k = 0;
  while (k + 1 < blocks && c + sums[k] <= target) c += sums[k++];
  int64_t idx = V;
  for (int64_t i = k * kBlock; i < V; ++i) {  // the first cumulative sum above target (searchsorted, right)
    c += static_cast<double>(p[i]);
    if (c > target) {
      idx = i;
      break;
    }
  }
  idx = idx < last ? idx : last;
  return p[idx] > 0.f ? idx : last;
}

float sum_of(const float* x, int64_t V) {  // NL float lanes per block of kBlock, blocks added in fp64
  double s = 0.0;
  for (int64_t i = 0; i < V; i += kBlock) s += block_sum(x + i, std::min(kBlock, V - i));
  return static_cast<float>(s);
}

void normalise(float* x, int64_t V) {  // x / sum(x), rows without mass left as they are
  const float s = sum_of(x, V);
  if (s > 0.f)
    for (int64_t i = 0; i < V; ++i) x[i] = x[i] / s;
}

void check_rows(const torch::Tensor& x, const torch::Tensor& temperature, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, what, ": bf16 or fp32 logits");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) > 0 && x.size(0) == temperature.size(0), what,
              ": logits [B, ..., V] and temperature [B]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.dim() == 1, what, ": fp32 temperature [B]");
}

void softmax_into(const torch::Tensor& x, int64_t row, int64_t V, float t, float* out) {
  if (x.scalar_type() == at::kBFloat16)
    softmax_row(x.data_ptr<c10::BFloat16>() + row * V, V, t, out);
  else
    softmax_row(x.data_ptr<float>() + row * V, V, t, out);
}

}  // namespace

// logits [B, ..., V] bf16 or fp32, temperature [B] fp32 (> 0) -> fp32 [B, ..., V].
torch::Tensor softmax_rows(torch::Tensor x, torch::Tensor temperature) {
  check_rows(x, temperature, "softmax_rows");
  x = x.contiguous();
  temperature = temperature.contiguous();
  const int64_t B = x.size(0), V = x.size(-1), rows = x.numel() / V, per = B ? rows / B : 0;
  auto out = torch::empty(x.sizes(), x.options().dtype(at::kFloat));
  const float* tp = temperature.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) softmax_into(x, r, V, tp[r / per], op + r * V);
  });
  return out;
}

// probs [B, V] fp32, u [B] fp64 -> [B] int64: spec.rng.draw.
torch::Tensor draw_rows(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.size(1) > 0, "draw_rows: fp32 [B, V]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.dim() == 1 && u.size(0) == probs.size(0), "draw_rows: fp64 u [B]");
  probs = probs.contiguous();
  u = u.contiguous();
  const int64_t B = probs.size(0), V = probs.size(1);
  auto out = torch::empty({B}, u.options().dtype(at::kLong));
  for (int64_t b = 0; b < B; ++b)
    out.data_ptr<int64_t>()[b] = draw_row(probs.data_ptr<float>() + b * V, V, u.data_ptr<double>()[b]);
  return out;
}

// spec.verify.verify_sampling for temperature-only rows: logits [B, N, V], tokens / parents
// [B, N] int64, valid [B, N] bool, temperature [B] fp32 (> 0), draft_probs [B, N, V] fp32 or
// None (top-k drafts: q(x) = 1), u_accept / u_bonus [B, N] fp64 (the uniforms of each node's
// accept test and of a bonus drawn at it), width = max_depth + 1, k_max: siblings tried per node
// -> (path [B, width], count [B], emitted [B, width], bonus [B]).
std::vector<torch::Tensor> verify_sampling_rows(torch::Tensor logits, torch::Tensor tokens, torch::Tensor parents,
                                                torch::Tensor valid, torch::Tensor temperature,
                                                c10::optional<torch::Tensor> draft_probs, torch::Tensor u_accept,
                                                torch::Tensor u_bonus, int64_t width, int64_t k_max) {
  check_rows(logits, temperature, "verify_sampling_rows");
  TORCH_CHECK(logits.dim() == 3, "verify_sampling_rows: logits [B, N, V]");
  const int64_t B = logits.size(0), N = logits.size(1), V = logits.size(2);
  for (const torch::Tensor* t : {&tokens, &parents, &valid, &u_accept, &u_bonus})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == N, "verify_sampling_rows: per-node tensors [B, N]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && parents.scalar_type() == at::kLong &&
                  valid.scalar_type() == at::kBool && u_accept.scalar_type() == at::kDouble &&
                  u_bonus.scalar_type() == at::kDouble && width >= 1,
              "verify_sampling_rows: int64 tokens / parents, bool valid, fp64 uniforms, width >= 1");
  torch::Tensor q;
  if (draft_probs.has_value()) {
    q = draft_probs->contiguous();
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.size(0) == B && q.size(1) == N && q.size(2) == V,
                "verify_sampling_rows: fp32 draft_probs [B, N, V]");
  }
  logits = logits.contiguous();
  tokens = tokens.contiguous();
  parents = parents.contiguous();
  valid = valid.contiguous();
  u_accept = u_accept.contiguous();
  u_bonus = u_bonus.contiguous();
  temperature = temperature.contiguous();
  RowAcceptance out(B, width, tokens.options());
  const int64_t *tp = tokens.data_ptr<int64_t>(), *pp = parents.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  const double *ua = u_accept.data_ptr<double>(), *ub = u_bonus.data_ptr<double>();
  const float* temp = temperature.data_ptr<float>();
  const float* qp = q.defined() ? q.data_ptr<float>() : nullptr;
  // Scratch rows, allocated once per call: the node's fresh distribution, what is left of it
  // after rejections (a copy made at the first rejection), and the draft's renormalised q.
  std::unique_ptr<float[]> fresh(new float[V]), left(new float[V]), qn(qp ? new float[V] : nullptr);
  std::vector<int64_t> kids;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t *tok = tp + b * N, *par = pp + b * N;
    const bool* ok = vp + b * N;
    int64_t* row_path = out.path_row(b);
    int64_t node = 0, depth = 0, drawn = 0;
    row_path[0] = 0;
    while (true) {
      softmax_into(logits, b * N + node, V, temp[b], fresh.get());
      float* p = fresh.get();  // becomes `left` at the first rejection
      if (qp) std::memcpy(qn.get(), qp + (b * N + node) * V, V * sizeof(float));
      kids.clear();
      if (depth + 1 < width)
        for (int64_t c = node + 1; c < N && (int64_t)kids.size() < k_max; ++c)
          if (par[c] == node && ok[c]) kids.push_back(c);
      int64_t next = -1;
      for (int64_t c : kids) {
        const int64_t x = tok[c];
        const double u = ua[b * N + c];
        const float px = p[x];
        bool accept;
        if (!qp) {
          accept = u < static_cast<double>(px);
        } else {
          const float qx = qn[x];
          double ratio = qx > 0.f ? static_cast<double>(px / qx) : 0.0;
          ratio = ratio < 1.0 ? ratio : 1.0;
          accept = qx > 0.f && u < ratio;
        }
        if (accept) {
          next = c;
          break;
        }
        if (p == fresh.get()) {
          std::memcpy(left.get(), p, V * sizeof(float));
          p = left.get();
        }
        if (!qp) {
          p[x] = 0.f;  // q(x) = 1: all of p(x) was offered
        } else {
          for (int64_t i = 0; i < V; ++i) {  // max(0, p - q), with q before x is removed
            const float d = p[i] - qn[i];
            p[i] = d > 0.f ? d : 0.f;
          }
          qn[x] = 0.f;
          normalise(qn.get(), V);
        }
        normalise(p, V);
      }
      if (next < 0) {
        const float* rest = p != fresh.get() && sum_of(p, V) <= 0.f ? fresh.get() : p;
        drawn = draw_row(rest, V, ub[b * N + node]);
        break;
      }
      node = next;
      row_path[++depth] = node;
    }
    out.finish(b, depth, node, drawn, tok);
  }
  return out.tensors();
}

// spec.rng.uniforms: U[0, 1) per (seed, step, node, purpose) by SplitMix64's finaliser, on
// unsigned 64-bit words (the wrap-around int64 arithmetic of the torch version, the same bits).
// seed, step [B] int64; node [B] or [B, K] int64 -> fp64 of node's shape. torch's ~20 int64 ops
// took ~0.15 ms for a handful of nodes.
static inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

torch::Tensor uniforms_rows(torch::Tensor seed, torch::Tensor step, torch::Tensor node, int64_t purpose) {
  TORCH_CHECK(seed.scalar_type() == at::kLong && step.scalar_type() == at::kLong && node.scalar_type() == at::kLong,
              "uniforms_rows: int64 seed, step and node");
  TORCH_CHECK(seed.dim() == 1 && step.sizes() == seed.sizes() && (node.dim() == 1 || node.dim() == 2) &&
                  node.size(0) == seed.size(0),
              "uniforms_rows: seed, step [B]; node [B] or [B, K]");
  seed = seed.contiguous();
  step = step.contiguous();
  node = node.contiguous();
  const int64_t B = node.size(0), K = node.dim() == 2 ? node.size(1) : 1;
  auto out = torch::empty(node.sizes(), node.options().dtype(at::kDouble));
  const int64_t *sp = seed.data_ptr<int64_t>(), *tp = step.data_ptr<int64_t>(), *np = node.data_ptr<int64_t>();
  double* op = out.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t base = splitmix(splitmix(static_cast<uint64_t>(sp[b])) ^ static_cast<uint64_t>(tp[b]));
    for (int64_t k = 0; k < K; ++k) {
      const uint64_t x = splitmix(base ^ (static_cast<uint64_t>(np[b * K + k]) * 4u + static_cast<uint64_t>(purpose)));
      op[b * K + k] = static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
    }
  }
  return out;
}
