// Row-invariant W4A8 GEMM for CPUs with AVX512-VNNI or AVX2: y[M, N] (bf16) = x[M, K] (bf16) W^T, with W as
// 4-bit codes in groups of 32 inputs (w = q * scale + zero8 per group, q in 0..15).
//
// Owns: the integer product and its layout (activations are quantised by common.h). The weight layout is built in Python (eaglespec/kernels.py, pack_int4):
//   codes  u8 [N/16, K/32, 256]: per tile of 16 outputs and group of 32 inputs, 4 chunks of 64
//          bytes; byte 4*j + b of chunk c holds output j's code for input 4c + b in its low nibble
//          and for input 16 + 4c + b in its high one, so one vpdpbusd takes 4 inputs x 16 outputs.
//   params f16 [N/16, K/32, 2, 16]: the tile's scales, then zero8 = zero - 8 * scale. fp16 as in
//          the GGUF's own blocks (Q4_1's d and m are these two, exactly): a sixth less to read per
//          token than fp32 params, and decoding one token is bound by reading the weights.
// Per row m and group g: d = max|x| / 127, a = round(x / d) (as x * (1/d)), A = sum a, S_n = sum q a;
//   acc_n += (float(S_n) * (scale_n * d) + zero8_n * (d * A))   -- each op rounded in fp32, no FMA,
// groups in order. Nothing depends on M or on the thread split (threads take whole output tiles),
// so a row's output is the same bits alone or among others; tests/test_int4_kernel.py checks
// this against a torch reference of the same operations, bit for bit.
// The AVX2 build forms the same integer sums S_n with vpmaddubsw (code q <= 15 times |a| <= 127:
// a pair is at most 3,810, so the 8 pairs of a lane sum to at most 30,480 in 16 bits, exactly)
// and runs the same float steps 8 outputs at a time: the same bits as the AVX512 build.
#include "common.h"

namespace {

using namespace eaglespec;

#if defined(__AVX512VNNI__)
// R rows (consecutive, from row m0) x one tile of 16 outputs. R only sets how many rows share a
// weight load; each row's operations are the same for any R.
template <int R>
void tile_rows(const uint8_t* codes, const uint16_t* params, int64_t G, const int8_t* a, const float* d,
               const float* c, int64_t K, int64_t m0, uint16_t* y, int64_t N, int64_t n0) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = codes + g * 256;
    __m512i w[8];  // w[s]: inputs 4s..4s+3 of the group, 16 outputs
    for (int ch = 0; ch < 4; ++ch) {
      __m512i v = _mm512_loadu_si512((const void*)(wg + 64 * ch));
      w[ch] = _mm512_and_si512(v, nib);
      w[ch + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(params + g * 32)));  // exact
    const __m512 zero8 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(params + g * 32 + 16)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* ag = a + (m0 + r) * K + g * kGroup;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: shorter latency
#pragma GCC unroll 4
      for (int st = 0; st < 4; ++st) {
        int32_t f0, f1;
        __builtin_memcpy(&f0, ag + 4 * st, 4);
        __builtin_memcpy(&f1, ag + 16 + 4 * st, 4);
        s0 = _mm512_dpbusd_epi32(s0, w[st], _mm512_set1_epi32(f0));
        s1 = _mm512_dpbusd_epi32(s1, w[st + 4], _mm512_set1_epi32(f1));
      }
      const __m512i s = _mm512_add_epi32(s0, s1);  // integer: exact in any order
      const float dg = d[(m0 + r) * (K / kGroup) + g];
      const float cg = c[(m0 + r) * (K / kGroup) + g];
      __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(dg)));
      __m512 p2 = _mm512_mul_ps(zero8, _mm512_set1_ps(cg));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(p1, p2));
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256((__m256i*)(y + (m0 + r) * N + n0), to_bf16(acc[r]));
}

#else  // AVX2

// R rows (consecutive, from row m0) x one tile of 16 outputs, as two halves of 8 (a 256-bit
// register holds 8 outputs x 4 inputs of a chunk). R only sets how many rows share a weight load.
template <int R>
void tile_rows(const uint8_t* codes, const uint16_t* params, int64_t G, const int8_t* a, const float* d,
               const float* c, int64_t K, int64_t m0, uint16_t* y, int64_t N, int64_t n0) {
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = codes + g * 256 + 32 * h;
      __m256i w[8];  // w[s]: inputs 4s..4s+3 of the group, outputs 8h..8h+7
      for (int ch = 0; ch < 4; ++ch) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(wg + 64 * ch));
        w[ch] = _mm256_and_si256(v, nib);
        w[ch + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      }
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(params + g * 32 + 8 * h)));  // exact
      const __m256 zero8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(params + g * 32 + 16 + 8 * h)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* ag = a + (m0 + r) * K + g * kGroup;
        __m256i t = _mm256_setzero_si256();  // 16-bit pair sums, exact (header)
#pragma GCC unroll 4
        for (int st = 0; st < 4; ++st) {
          int32_t f0, f1;
          __builtin_memcpy(&f0, ag + 4 * st, 4);
          __builtin_memcpy(&f1, ag + 16 + 4 * st, 4);
          t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[st], _mm256_set1_epi32(f0)));
          t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[st + 4], _mm256_set1_epi32(f1)));
        }
        const __m256i s = _mm256_madd_epi16(t, ones);  // S_n for 8 outputs
        const float dg = d[(m0 + r) * (K / kGroup) + g];
        const float cg = c[(m0 + r) * (K / kGroup) + g];
        __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, _mm256_set1_ps(dg)));
        __m256 p2 = _mm256_mul_ps(zero8, _mm256_set1_ps(cg));
        acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(p1, p2));
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_si128((__m128i*)(y + (m0 + r) * N + n0 + 8 * h), to_bf16(acc[r]));
  }
}

#endif

constexpr int kRows = 8;  // rows sharing one weight load (registers: 8 codes + kRows accumulators)

// x: bf16 [M, K]; codes: u8 [N/16, K/32, 256]; params: f16 [N/16, K/32, 2, 16] -> bf16 [M, N]
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor params) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 256,
              "codes: contiguous u8 [N/16, K/32, 256]");
  TORCH_CHECK(params.dim() == 4 && params.scalar_type() == at::kHalf && params.is_contiguous(),
              "params: contiguous f16 [N/16, K/32, 2, 16]");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = codes.size(1), N = T * kTile;
  TORCH_CHECK(K == G * kGroup && params.size(0) == T && params.size(1) == G, "shapes do not match");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto a = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto dc = torch::empty({2, M, G}, x.options().dtype(at::kFloat));
  auto sums = torch::empty({M, G}, x.options().dtype(at::kInt));
  const int8_t* ap = a.data_ptr<int8_t>();
  float* dp = dc.data_ptr<float>();
  float* cp = dp + M * G;
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, a.data_ptr<int8_t>(), dp, cp,
                sums.data_ptr<int32_t>());
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Threads split the output tiles only: every (row, output) is computed whole by one thread.
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = wp + t * G * 256;
      const uint16_t* pt = pp + t * G * 32;
      for_row_blocks<kRows>(M, [&](auto rows, int64_t m) {
        tile_rows<decltype(rows)::value>(wt, pt, G, ap, dp, cp, K, m, yp, N, t * kTile);
      });
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_gemm", &int4_gemm, "row-invariant W4A8 GEMM: bf16 [M, K] x packed int4 [N, K] -> bf16 [M, N]");
  // For csrc/layer_stack.cpp, which calls this product from another extension module (the same
  // compiler and torch headers build both): the function's address, as an integer.
  m.def("int4_gemm_address", [] { return reinterpret_cast<uintptr_t>(&int4_gemm); },
        "address of int4_gemm: torch::Tensor (*)(torch::Tensor x, torch::Tensor, torch::Tensor)");
}
