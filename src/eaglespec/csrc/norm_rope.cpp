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
      f32x16 ss = f32x16{};
      for (int64_t c = 0; c < H; c += LANES) {
        const f32x16 v = load_bf16(xr + c);
        ss = ss + v * v;
      }
      const float inv = 1.f / std::sqrt(lane_sum(ss) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t c = 0; c < H; c += LANES) {
        store_bf16(yp + r * H + c, load_bf16(wp + c) * round_bf16(load_bf16(xr + c) * inv));
      }
    }
  });
  return y;
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
      for (int64_t c = 0; c < half; c += LANES) {
        const f32x16 x1 = load_bf16(xr + c), x2 = load_bf16(xr + half + c);
        store_bf16(yr + c, x1 * load_bf16(cr + c) - x2 * load_bf16(sr + c));
        store_bf16(yr + half + c, x2 * load_bf16(cr + half + c) + x1 * load_bf16(sr + half + c));
      }
    }
  });
  return y;
}
