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

// Loops whose lanes never meet (elementwise steps, maxima) run at the CPU's own register width,
// NL floats: 8 where a 16-lane vector is two 256-bit registers (AVX2 without AVX-512), 16
// otherwise. There GCC keeps a 16-lane vector in memory and moves its comparisons, selects and
// conversions through the stack one lane at a time (measured: silu_mul 6 ns an output, argmax of
// 16 x 49,152 logits 2.3 ms). Every lane sees the same IEEE operations at either width, and sums
// keep the 16-lane order (their partial sums are 16 / NL native vectors side by side), so the
// results are the same bits.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int NL = 8;
#else
constexpr int NL = 16;
#endif
template <int N> struct Lanes;  // float, int32, uint32 and uint16 vectors of N lanes
template <> struct Lanes<8> {
  typedef f32x8 F;
  typedef int32_t I __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
};
template <> struct Lanes<16> {
  typedef f32x16 F;
  typedef i32x16 I;
  typedef u32x16 U;
  typedef u16x16 H;
};
typedef Lanes<NL>::F fvec;
typedef Lanes<NL>::I ivec;
template <class F> using ints_of = typename Lanes<sizeof(F) / 4>::I;
template <class F> using uints_of = typename Lanes<sizeof(F) / 4>::U;
template <class F> using halves_of = typename Lanes<sizeof(F) / 4>::H;

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

template <class F = f32x16>
inline F load_bf16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (sizeof(F) == sizeof(f32x16)) {  // two halves, explicitly (above)
    const __m128i* in = reinterpret_cast<const __m128i*>(p);
    return join(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(in)), 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(in + 1)), 16)));
  } else
#endif
  {
    halves_of<F> h;
    std::memcpy(&h, p, sizeof(h));
    const uints_of<F> w = __builtin_convertvector(h, uints_of<F>) << 16;
    F f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
}

// v rounded to bf16 (nearest even; NaN -> the quiet NaN 0x7fc0), as the fp32 bits of the result:
// c10::BFloat16(float)'s rounding, lane by lane, in vector integer operations (a scalar
// conversion per lane cost about as much as the arithmetic around it).
template <class F>
inline uints_of<F> bf16_bits(F v) {
  typedef uints_of<F> U;
  U b;
  std::memcpy(&b, &v, sizeof(b));
  const U rounded = (b + (0x7fffu + ((b >> 16) & 1u))) & 0xffff0000u;
  const U nan = (U)(v != v);  // all ones where NaN
  return (rounded & ~nan) | (0x7fc00000u & nan);
}

template <class F>
inline F round_bf16(F v) {
  const uints_of<F> b = bf16_bits(v);
  F f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

template <class F>
inline void store_bf16(c10::BFloat16* p, F v) {
  const halves_of<F> h = __builtin_convertvector(bf16_bits(v) >> 16, halves_of<F>);
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
inline f32x8 fmadd(f32x8 a, f32x8 b, f32x8 c) { return a * b + c; }  // 8 lanes: AVX2 builds, never fused

// exp of values <= 0 (scores minus their maximum), a vector of any width, ours rather than libm's
// so that the result is the same function everywhere: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series
// to r^7 (relative error below 2e-7), times 2^n built from the exponent bits. Below -87 the
// result is clamped to exp(-87) (~1.6e-38), negligible against the maximum's weight of 1.
template <class F>
inline F exp_nonpositive(F x) {
  typedef ints_of<F> I;
  const F lo = F{} - 87.f;
  x = x < lo ? lo : x;
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);  // rounds toward 0: ceil
  const F nf = __builtin_convertvector(n, F);
  // r = x - n ln2, ln2 in two parts
  const F r = fmadd(nf, F{} - 1.428606765330187e-06f, fmadd(nf, F{} - 0.693145751953125f, x));
  F p = fmadd(r, F{} + 1.f / 5040, F{} + 1.f / 720);  // Horner steps as fused multiply-adds
  p = fmadd(p, r, F{} + 1.f / 120);
  p = fmadd(p, r, F{} + 1.f / 24);
  p = fmadd(p, r, F{} + 1.f / 6);
  p = fmadd(p, r, F{} + 0.5f);
  p = fmadd(p, r, F{} + 1.f);
  p = fmadd(p, r, F{} + 1.f);
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Whether any lane of v is greater than t (an ordered comparison: NaN lanes are not).
inline bool any_greater(fvec v, float t) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0;
#else
  bool any = false;
  for (int j = 0; j < NL; ++j) any |= v[j] > t;
  return any;
#endif
}

// The 16-lane vector whose lanes are those of parts[0], parts[1], ... (16 / NL of them).
inline f32x16 joined(const fvec* parts) {
  f32x16 v;
  std::memcpy(&v, parts, sizeof(v));
  return v;
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
