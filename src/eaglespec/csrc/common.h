// Shared by the package's row-invariant integer kernels (int4_gemm.cpp, int8_gemm.cpp): rounding bf16
// activations to int8 per row per group of 32 (like llama.cpp's Q8_0) and fp32 -> bf16 output.
// Both are per row, so nothing here depends on how many rows are computed together.
//
// Two builds of the same operations: AVX512 (with VNNI for the products) and AVX2 (CPUs without
// AVX-512). Every step is exact integer work or the same IEEE operation lane by lane, so both
// builds give the same bits (tests/test_int4_kernel.py checks each against one torch reference).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

namespace eaglespec {

constexpr int kGroup = 32;
constexpr int kTile = 16;

// Calls f(std::integral_constant<int, R>{}, m) for every block of R rows starting at m: blocks of
// R, then the last rows as one smaller block. The kernels' per-row operations do not depend on
// the block size, so neither does a row's result.
template <int R, typename F>
inline void last_rows(int64_t left, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (left == R) f(std::integral_constant<int, R>{}, m);
    else last_rows<R - 1>(left, m, f);
  }
}

template <int R, typename F>
inline void for_row_blocks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + R <= M; m += R) f(std::integral_constant<int, R>{}, m);
  last_rows<R - 1>(M - m, m, f);
}

#if defined(__AVX512F__)
// x: bf16 [M, K] -> a: int8 [M, K], d: f32 [M, G] (activation scale), c: f32 [M, G] (d * sum a),
// sums: int32 [M, G] (sum a). Per row and group of 32: d = max|x| / 127, a = round(x * (1 / d)),
// half to even like torch.round (d = 0: a = 0).
inline void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* a, float* d, float* c, int32_t* sums) {
  const int64_t G = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* xs = x + m * K + g * kGroup;
      // bf16 -> f32 is a 16-bit shift (exact)
      __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)xs)), 16));
      __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xs + 16))), 16));
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      float dg = amax / 127.0f;
      float inv = dg != 0.0f ? 1.0f / dg : 0.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      // round half to even, as torch.round
      __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, vinv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, vinv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      int8_t* as = a + m * K + g * kGroup;
      _mm_storeu_si128((__m128i*)as, _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128((__m128i*)(as + 16), _mm512_cvtepi32_epi8(qhi));
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      d[m * G + g] = dg;
      c[m * G + g] = dg * (float)sum;
      sums[m * G + g] = sum;
    }
  }
}

// f32 -> bf16, round to nearest even (torch's .to(bfloat16) for finite values; NaN kept NaN)
inline __m256i to_bf16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

#else  // AVX2

// x: bf16 [M, K] -> a: int8 [M, K], d: f32 [M, G] (activation scale), c: f32 [M, G] (d * sum a),
// sums: int32 [M, G] (sum a), as the AVX512 build: 8 lanes at a time.
inline __m256 bf16x8(const uint16_t* p) {  // bf16 -> f32 is a 16-bit shift (exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* a, float* d, float* c, int32_t* sums) {
  const int64_t G = K / kGroup;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // packs_epi32 / packs_epi16 interleave 128-bit lanes; this puts the 8 groups of 4 back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* xs = x + m * K + g * kGroup;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = bf16x8(xs + 8 * i);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      float amax = _mm_cvtss_f32(m4);  // a maximum is exact in any order
      float dg = amax / 127.0f;
      float inv = dg != 0.0f ? 1.0f / dg : 0.0f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i q[4];
      for (int i = 0; i < 4; ++i)  // round half to even, as torch.round
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256((__m256i*)(a + m * K + g * kGroup), _mm256_permutevar8x32_epi32(p8, order));
      __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      int sum = _mm_cvtsi128_si32(s4);
      d[m * G + g] = dg;
      c[m * G + g] = dg * (float)sum;
      sums[m * G + g] = sum;
    }
  }
}

// f32 -> bf16 for 8 lanes, round to nearest even, NaN kept NaN (as the AVX512 build)
inline __m128i to_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // packus keeps 4 of each 128-bit lane twice over; elements 0 and 2 are the 8 in order
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

#endif

}  // namespace eaglespec
