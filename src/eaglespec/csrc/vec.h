// 16-lane float vectors (GCC vector extensions: AVX-512 where built with it, narrower vectors
// otherwise, the same IEEE operations lane by lane either way) and bf16 loads/stores.
#pragma once
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace eaglespec {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

constexpr int LANES = 16;

inline f32x16 load_bf16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// v rounded to bf16 (nearest even; NaN -> the quiet NaN 0x7fc0), as the fp32 bits of the result:
// c10::BFloat16(float)'s rounding, lane by lane, in vector integer operations (a scalar
// conversion per lane cost about as much as the arithmetic around it).
inline u32x16 bf16_bits(f32x16 v) {
  u32x16 b;
  std::memcpy(&b, &v, sizeof(b));
  const u32x16 rounded = (b + (0x7fffu + ((b >> 16) & 1u))) & 0xffff0000u;
  const u32x16 nan = (u32x16)(v != v);  // all ones where NaN
  return (rounded & ~nan) | (0x7fc00000u & nan);
}

inline f32x16 round_bf16(f32x16 v) {
  const u32x16 b = bf16_bits(v);
  f32x16 f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline void store_bf16(c10::BFloat16* p, f32x16 v) {
  const u16x16 h = __builtin_convertvector(bf16_bits(v) >> 16, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

// a * b + c. Fused (one rounding) where built for AVX-512, else a multiply then an add: either
// way one fixed function per build, so every code path that uses it gets the same bits. The
// build-wide -ffp-contract=off leaves the compiler no say; callers choose fusing explicitly.
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

// exp of 16 values <= 0 (scores minus their maximum), ours rather than libm's so that the result
// is the same function everywhere: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series
// to r^7 (relative error below 2e-7), times 2^n built from the exponent bits. Below -87 the
// result is clamped to exp(-87) (~1.6e-38), negligible against the maximum's weight of 1.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lo = f32x16{} - 87.f;
  x = x < lo ? lo : x;
  const i32x16 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i32x16);  // rounds toward 0: ceil
  const f32x16 nf = __builtin_convertvector(n, f32x16);
  // r = x - n ln2, ln2 in two parts
  const f32x16 r = fmadd(nf, f32x16{} - 1.428606765330187e-06f, fmadd(nf, f32x16{} - 0.693145751953125f, x));
  f32x16 p = fmadd(r, f32x16{} + 1.f / 5040, f32x16{} + 1.f / 720);  // Horner steps as fused multiply-adds
  p = fmadd(p, r, f32x16{} + 1.f / 120);
  p = fmadd(p, r, f32x16{} + 1.f / 24);
  p = fmadd(p, r, f32x16{} + 1.f / 6);
  p = fmadd(p, r, f32x16{} + 0.5f);
  p = fmadd(p, r, f32x16{} + 1.f);
  p = fmadd(p, r, f32x16{} + 1.f);
  const i32x16 bits = (n + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float lane_sum(f32x16 v) {
  // A fixed pairwise tree over the 16 lanes: lane i + lane i + 8, then + 4, + 2, + 1.
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

// lane_sum of 16 vectors at once: out[i] == lane_sum(v[i]) bit for bit (the same pairwise tree,
// each stage adding the low and high halves of two vectors in one operation), so a caller may
// reduce keys 16 at a time or one by one and get the same scores.
inline f32x16 lane_sums16(const f32x16* v) {
  f32x16 w[8], x[4], y[2];
  for (int p = 0; p < 8; ++p)  // lane j of pair (A, B): A[j] + A[j + 8], then B's in lanes 8..15
    w[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 4; ++p)  // each group of 8: [j] + [j + 4]
    x[p] = __builtin_shufflevector(w[2 * p], w[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * p], w[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)  // each group of 4: [j] + [j + 2]
    y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * p], x[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

}  // namespace eaglespec
