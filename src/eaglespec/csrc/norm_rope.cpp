// RMSNorm and rotary embedding of bf16 rows on a CPU: one call each instead of the 7-8 torch ops
// that cost ~10 us of dispatch apiece at decode sizes. Each row is computed on its own with a
// fixed sequence of float operations, so the results are row-invariant.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>

using namespace eaglespec;

// x: [..., H] bf16 (rows contiguous), weight: [H] bf16. y = w * bf16(x / rms(x)), the mean of
// squares summed in fp32 (16 lanes, lanes summed in a tree); the two roundings to bf16 are those
// of the reference implementation (normalised value, then times the weight).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm: bf16");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H % LANES == 0 && weight.numel() == H, "rms_norm: width must be a multiple of 16");
  x = x.contiguous();
  weight = weight.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / H;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = xp + r * H;
      fvec ss[LANES / NL] = {};  // one 16-lane sum of squares, NL lanes at a time
      for (int64_t c = 0; c < H; c += LANES) {
        for (int p = 0; p < LANES / NL; ++p) {
          const fvec v = load_bf16<fvec>(xr + c + p * NL);
          ss[p] = ss[p] + v * v;
        }
      }
      const float inv = 1.f / std::sqrt(lane_sum(joined(ss)) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t c = 0; c < H; c += NL) {
        store_bf16(yp + r * H + c, load_bf16<fvec>(wp + c) * round_bf16(load_bf16<fvec>(xr + c) * inv));
      }
    }
  });
  return y;
}

// One head of hd = 2 * half values: y = x * cos + concat(-x2, x1) * sin in fp32, rounded once.
static inline void rotate_head(const c10::BFloat16* xr, const c10::BFloat16* cr, const c10::BFloat16* sr,
                               c10::BFloat16* yr, int64_t half) {
  for (int64_t c = 0; c < half; c += NL) {
    const fvec x1 = load_bf16<fvec>(xr + c), x2 = load_bf16<fvec>(xr + half + c);
    store_bf16(yr + c, x1 * load_bf16<fvec>(cr + c) - x2 * load_bf16<fvec>(sr + c));
    store_bf16(yr + half + c, x2 * load_bf16<fvec>(cr + half + c) + x1 * load_bf16<fvec>(sr + half + c));
  }
}

// x: [B, n, T, hd] bf16 (any strides, last dim contiguous), cos/sin: [B, 1, T, hd] bf16.
// Rotate-half layout: out = x * cos + concat(-x2, x1) * sin, in fp32, rounded once. Returns a
// contiguous [B, n, T, hd].
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16, "rope: bf16");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x [B, n, T, hd] with a contiguous last dim");
  const int64_t B = x.size(0), n = x.size(1), T = x.size(2), hd = x.size(3), half = hd / 2;
  TORCH_CHECK(half % LANES == 0, "rope: head_dim must be a multiple of 32");
  cos = cos.expand({B, 1, T, hd}).contiguous();
  sin = sin.expand({B, 1, T, hd}).contiguous();
  auto y = torch::empty({B, n, T, hd}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t sb = x.stride(0), sn = x.stride(1), st = x.stride(2);
  at::parallel_for(0, B * n * T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i % T, h = (i / T) % n, b = i / (T * n);
      const c10::BFloat16* xr = xp + b * sb + h * sn + t * st;
      const c10::BFloat16* cr = cp + (b * T + t) * hd;
      const c10::BFloat16* sr = sp + (b * T + t) * hd;
      c10::BFloat16* yr = yp + i * hd;
      rotate_head(xr, cr, sr, yr, half);
    }
  });
  return y;
}

// One attention layer's step after its qkv product: split qkv [B, T, (nh + 2 nkv) hd] into heads,
// rotate q and k as `rope` does (the same bits), write k and v into the layer's KV cache rows at
// their slots (k_cache, v_cache: [B, nkv, S, hd], any strides but a contiguous last dim; slots
// [B, T]), and return q as a contiguous [B, nh, T, hd]. Replaces about 15 torch operations a
// layer (split, views, transposes, two rope calls, two cache scatters).
torch::Tensor qkv_rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor slots, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "qkv_rope_write: bf16");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "qkv_rope_write: qkv [B, T, W] with a contiguous last dim");
  const int64_t B = qkv.size(0), T = qkv.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.size(1) == nkv && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "qkv_rope_write: caches [B, nkv, S, hd] with a contiguous last dim");
  const int64_t S = k_cache.size(2), hd = k_cache.size(3), half = hd / 2;
  TORCH_CHECK(qkv.size(2) == (nh + 2 * nkv) * hd, "qkv_rope_write: qkv width must be (nh + 2 nkv) * head_dim");
  TORCH_CHECK(half % LANES == 0, "qkv_rope_write: head_dim must be a multiple of 32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == B && slots.size(1) == T,
              "qkv_rope_write: slots [B, T] int64");
  slots = slots.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "qkv_rope_write: slot out of range");
  cos = cos.expand({B, 1, T, hd}).contiguous();
  sin = sin.expand({B, 1, T, hd}).contiguous();
  auto q = torch::empty({B, nh, T, hd}, qkv.options());
  const auto* xp = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  auto* qp = q.data_ptr<c10::BFloat16>();
  auto* kp = k_cache.data_ptr<c10::BFloat16>();
  auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int64_t xb = qkv.stride(0), xt = qkv.stride(1);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), ks = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vs = v_cache.stride(2);
  const int64_t heads = nh + 2 * nkv;
  at::parallel_for(0, B * T * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % heads, t = (i / heads) % T, b = i / (heads * T);
      const c10::BFloat16* xr = xp + b * xb + t * xt + h * hd;
      const int64_t slot = sl[b * T + t];
      if (h >= nh + nkv) {  // a value head: copied as it is
        std::memcpy(vp + b * vb + (h - nh - nkv) * vh + slot * vs, xr, hd * sizeof(c10::BFloat16));
        continue;
      }
      c10::BFloat16* yr = h < nh ? qp + ((b * nh + h) * T + t) * hd : kp + b * kb + (h - nh) * kh + slot * ks;
      const c10::BFloat16* cr = cp + (b * T + t) * hd;
      const c10::BFloat16* sr = sp + (b * T + t) * hd;
      rotate_head(xr, cr, sr, yr, half);  // rope's arithmetic: the same bits
    }
  });
  return q;
}
