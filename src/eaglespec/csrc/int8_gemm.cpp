// Row-invariant W8A8 GEMM for CPUs with AVX512-VNNI or AVX2: y[M, N] (bf16) = x[M, K] (bf16) W^T, with W as
// int8 per output row (w = q * wscale, q in -127..127): the LM head and the `int8` mode's linears.
//
// Owns: the integer product and its layout (activations are quantised by common.h). The layout is
// built in Python (eaglespec/kernels.py, pack_int8):
//   codes u8 [N/16, K/32, 512]: per tile of 16 outputs and group of 32 inputs, 8 chunks of 64 bytes;
//         byte 4*j + b of chunk s holds q + 128 of output j, input 4s + b (vpdpbusd multiplies an
//         unsigned operand by a signed one: the offset makes the weights unsigned).
//   wscale f32 [N].
// Per row m and group g (d, a, A from common.h): S_n = sum (q + 128) a - 128 A = sum q a (exact);
//   acc_n += float(S_n) * d  (fp32, no FMA, groups in order); y_n = acc_n * wscale_n.
// Threads take whole output tiles, and nothing depends on M: row-invariant by construction
// (tests/test_int4_kernel.py compares with a torch reference of the same operations, bit for bit).
// The AVX2 build forms S_n = sum q a directly: vpmaddubsw of |a| by q carrying a's sign (|q|, |a|
// <= 127, so a pair fits 16 bits), widened to 32 bits pair by pair; then the same float steps,
// 8 outputs at a time: the same bits as the AVX512 build.
#include "common.h"

namespace {

using namespace eaglespec;

#if defined(__AVX512VNNI__)
template <int R>
void tile_rows(const uint8_t* codes, const float* wscale, int64_t G, const int8_t* a, const float* d,
               const int32_t* sums, int64_t K, int64_t m0, uint16_t* y, int64_t N, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i w[8];  // w[s]: inputs 4s..4s+3 of the group, 16 outputs
    for (int st = 0; st < 8; ++st) w[st] = _mm512_loadu_si512((const void*)(codes + g * 512 + 64 * st));
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
      const int64_t i = (m0 + r) * G + g;
      // integer: exact in any order; undoes the +128 of the codes
      const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * sums[i]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d[i])));
    }
  }
  const __m512 ws = _mm512_loadu_ps(wscale + n0);
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256((__m256i*)(y + (m0 + r) * N + n0), to_bf16(_mm512_mul_ps(acc[r], ws)));
}

#else  // AVX2

template <int R>
void tile_rows(const uint8_t* codes, const float* wscale, int64_t G, const int8_t* a, const float* d,
               const int32_t* sums, int64_t K, int64_t m0, uint16_t* y, int64_t N, int64_t n0) {
  (void)sums;  // S_n needs no correction here
  const __m256i offset = _mm256_set1_epi8((char)0x80);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {  // outputs 8h..8h+7
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i w[8];  // w[s]: q (signed) of inputs 4s..4s+3 of the group
      for (int st = 0; st < 8; ++st)
        w[st] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(codes + g * 512 + 64 * st + 32 * h)), offset);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* ag = a + (m0 + r) * K + g * kGroup;
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int st = 0; st < 8; ++st) {
          int32_t f;
          __builtin_memcpy(&f, ag + 4 * (st & 3) + 16 * (st >> 2), 4);
          const __m256i av = _mm256_set1_epi32(f);
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(av), _mm256_sign_epi8(w[st], av));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));  // integer: exact in any order
        }
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d[(m0 + r) * G + g])));
      }
    }
    const __m256 ws = _mm256_loadu_ps(wscale + n0 + 8 * h);
    for (int r = 0; r < R; ++r)
      _mm_storeu_si128((__m128i*)(y + (m0 + r) * N + n0 + 8 * h), to_bf16(_mm256_mul_ps(acc[r], ws)));
  }
}

#endif

constexpr int kRows = 8;  // rows sharing one weight load (registers: 8 codes + kRows accumulators)

// x: bf16 [M, K]; codes: u8 [N/16, K/32, 512]; wscale: f32 [N] -> bf16 [M, N]
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor wscale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 512,
              "codes: contiguous u8 [N/16, K/32, 512]");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = codes.size(1), N = T * kTile;
  TORCH_CHECK(wscale.dim() == 1 && wscale.scalar_type() == at::kFloat && wscale.is_contiguous() &&
              wscale.size(0) == N, "wscale: contiguous f32 [N]");
  TORCH_CHECK(K == G * kGroup, "shapes do not match");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto a = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto dc = torch::empty({2, M, G}, x.options().dtype(at::kFloat));
  auto sums = torch::empty({M, G}, x.options().dtype(at::kInt));
  float* dp = dc.data_ptr<float>();
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, a.data_ptr<int8_t>(), dp,
                dp + M * G, sums.data_ptr<int32_t>());
  const int8_t* ap = a.data_ptr<int8_t>();
  const int32_t* sp = sums.data_ptr<int32_t>();
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const float* scp = wscale.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Threads split the output tiles only: every (row, output) is computed whole by one thread.
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = wp + t * G * 512;
      for_row_blocks<kRows>(M, [&](auto rows, int64_t m) {
        tile_rows<decltype(rows)::value>(wt, scp, G, ap, dp, sp, K, m, yp, N, t * kTile);
      });
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "row-invariant W8A8 GEMM: bf16 [M, K] x packed int8 [N, K] -> bf16 [M, N]");
  // For csrc/layer_stack.cpp, which calls this product from another extension module (the same
  // compiler and torch headers build both): the function's address, as an integer.
  m.def("int8_gemm_address", [] { return reinterpret_cast<uintptr_t>(&int8_gemm); },
        "address of int8_gemm: torch::Tensor (*)(torch::Tensor x, torch::Tensor, torch::Tensor)");
}
