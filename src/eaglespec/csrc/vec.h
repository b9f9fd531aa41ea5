// 16-lane float vectors (GCC vector extensions: AVX-512 where built with it, narrower vectors
// otherwise, the same IEEE operations lane by lane either way) and bf16 loads/stores.
#pragma once
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || defined(__AVX2__)
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

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 builds: a 16-lane vector is two 256-bit registers. GCC lowers shuffles and widening
// conversions of vectors wider than the hardware's lane by lane through the stack (measured: the
// decode attention ran at a tenth of its speed), so the few operations that move data between
// lanes take these halves explicitly. Only data movement differs: every add is the same one.
inline __m256 half_lo(const f32x16& v) { __m256 h; std::memcpy(&h, &v, 32); return h; }
inline __m256 half_hi(const f32x16& v) { __m256 h; std::memcpy(&h, reinterpret_cast<const char*>(&v) + 32, 32); return h; }
inline f32x16 join(__m256 lo, __m256 hi) {
  f32x16 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
#endif

// f32x16{} + x in every lane (0 + x: the same value, -0 becoming +0, as the generic expression).
inline f32x16 splat(float x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 h = _mm256_add_ps(_mm256_setzero_ps(), _mm256_set1_ps(x));
  return join(h, h);
#else
  return f32x16{} + x;
#endif
}

inline f32x16 load_bf16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m128i* in = reinterpret_cast<const __m128i*>(p);
  return join(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(in)), 16)),
              _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(in + 1)), 16)));
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
#endif
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
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 a = _mm256_add_ps(half_lo(v), half_hi(v));                                // [i] + [i + 8]
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // + 4
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                  // + 2
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));                              // + 1
#else
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The rest of lane_sum's tree for 8 vectors at once, from their first sums a[i] = lanes j + j + 8:
// [j] + [j + 4] for two vectors at once (a 128-bit half each), [j] + [j + 2] and [j] + [j + 1]
// for four; the pairs are chosen so that vector i's sum lands in lane i.
inline __m256 tree_sums8(const __m256* a) {
  __m256 s[4], t[2];
  for (int i = 0; i < 4; ++i)  // s[i] = [b of vector i | b of vector i + 4]
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)  // t[i] = [c of 2i, c of 2i + 1 | c of 2i + 4, c of 2i + 5]
    t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// lane_sum of 16 vectors at once: out[i] == lane_sum(v[i]) bit for bit (the same pairwise tree,
// each stage adding the low and high halves of two vectors in one operation), so a caller may
// reduce keys 16 at a time or one by one and get the same scores.
inline f32x16 lane_sums16(const f32x16* v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // The same tree per vector: a = [i] + [i + 8] (8 lanes each); then [i] + [i + 4] for two vectors
  // at once (a 128-bit half each), [i] + [i + 2] and [i] + [i + 1] for four; the pairs are chosen
  // so that the results land in order.
  __m256 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm256_add_ps(half_lo(v[i]), half_hi(v[i]));
  return join(tree_sums8(a), tree_sums8(a + 8));
#else
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
#endif
}

}  // namespace eaglespec
