// Row-invariant W8A16 GEMM: y[M, N] (bf16) = x[M, K] (bf16) W^T, with W as int8 per output row
// (w = q * wscale, the layout of int8_gemm.cpp: codes u8 [N/16, K/32, 512] holding q + 128) and
// each activation row rounded to 16-bit integers with one scale per row, then split into two
// int8 halves. Two implementations of the same numbers: AMX tiles (tdpbsud) where the CPU has
// AMX-INT8, AVX512-VNNI (vpdpbusd) elsewhere.
//
// Why: with one scale per row, a row's whole K-long dot product is one exact integer sum, so the
// AMX tile unit can accumulate it without leaving the tile (int8_gemm.cpp's per-group scales
// need a float step every 32 inputs, which is what made tiles slower than VNNI there). With 16
// bits per activation, rounding is finer than int8 per group of 32.
//
// Numbers, per row m (quantize_rows_a16):
//   s = max|x| / 32639; v = round_half_even(x / s) in -32639..32639; h = (v + 128) >> 8 (floor),
//   l = v - 256 h, so v = 256 h + l with h in -127..127, l in -128..127.
// Per output n: Sh = sum h q, Sl = sum l q (exact int32: |Sh| <= K * 127 * 127);
//   y = bf16(((float(Sh) * 256 + float(Sl)) * s) * wscale_n)
// Nothing depends on M or on which rows share a tile, and both paths give the same integers:
// row-invariant and identical across CPUs (tests/test_int8_a16_kernel.py checks both against a
// torch reference, bit for bit).
#include "common.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace {

using namespace eaglespec;

constexpr int kMaxV = 32639;  // 127 * 256 + 127: h stays in -127..127

// x: bf16 [M, K] -> hl: int8 [2, M, K] (h, then l), s: f32 [M], sums: int32 [2, M] (sum h, sum l)
void quantize_rows_a16(const uint16_t* x, int64_t M, int64_t K, int8_t* hl, float* s, int32_t* sums) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + k))), 16));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float sm = _mm512_reduce_max_ps(amax) / (float)kMaxV;
    const float inv = sm != 0.0f ? 1.0f / sm : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lim = _mm512_set1_epi32(kMaxV);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    int8_t* hr = hl + m * K;
    int8_t* lr = hl + (M + m) * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + k))), 16));
      __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      q = _mm512_max_epi32(_mm512_min_epi32(q, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
      __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
      _mm_storeu_si128((__m128i*)(hr + k), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128((__m128i*)(lr + k), _mm512_cvtepi32_epi8(l));
      sh = _mm512_add_epi32(sh, h);
      sl = _mm512_add_epi32(sl, l);
    }
    s[m] = sm;
    sums[m] = _mm512_reduce_add_epi32(sh);
    sums[M + m] = _mm512_reduce_add_epi32(sl);
  }
}

// The integer sums (with the +128 of the codes still in: Sh' = sum h (q + 128)) -> bf16 outputs.
inline void finish(__m512i sh, __m512i sl, int32_t sum_h, int32_t sum_l, float s, const float* ws, uint16_t* y) {
  sh = _mm512_sub_epi32(sh, _mm512_set1_epi32(128 * sum_h));  // exact: undoes the offset
  sl = _mm512_sub_epi32(sl, _mm512_set1_epi32(128 * sum_l));
  __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sh), _mm512_set1_ps(256.0f)), _mm512_cvtepi32_ps(sl));
  t = _mm512_mul_ps(_mm512_mul_ps(t, _mm512_set1_ps(s)), _mm512_loadu_ps(ws));
  _mm256_storeu_si256((__m256i*)y, to_bf16(t));
}

struct Args {
  const int8_t* hl;
  const float* s;
  const int32_t* sums;
  const uint8_t* codes;
  const float* ws;
  uint16_t* y;
  int64_t M, K, N, G;
};

// ---- AVX512-VNNI ----
template <int R>
void vnni_rows(const Args& a, int64_t t, int64_t m0) {
  __m512i ch[R], cl[R];
  for (int r = 0; r < R; ++r) ch[r] = cl[r] = _mm512_setzero_si512();
  const uint8_t* wt = a.codes + t * a.G * 512;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i w[8];
    for (int st = 0; st < 8; ++st) w[st] = _mm512_loadu_si512((const void*)(wt + g * 512 + 64 * st));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* hp = a.hl + (m0 + r) * a.K + g * kGroup;
      const int8_t* lp = hp + a.M * a.K;
#pragma GCC unroll 8
      for (int st = 0; st < 8; ++st) {
        int32_t fh, fl;
        __builtin_memcpy(&fh, hp + 4 * st, 4);
        __builtin_memcpy(&fl, lp + 4 * st, 4);
        ch[r] = _mm512_dpbusd_epi32(ch[r], w[st], _mm512_set1_epi32(fh));
        cl[r] = _mm512_dpbusd_epi32(cl[r], w[st], _mm512_set1_epi32(fl));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    finish(ch[r], cl[r], a.sums[m], a.sums[a.M + m], a.s[m], a.ws + t * kTile, a.y + m * a.N + t * kTile);
  }
}

constexpr int kRows = 6;  // rows sharing one weight load: 8 codes + 2 kRows accumulators in registers

void vnni_gemm(const Args& a) {
  at::parallel_for(0, a.N / kTile, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for_row_blocks<kRows>(a.M, [&](auto rows, int64_t m) { vnni_rows<decltype(rows)::value>(a, t, m); });
  });
}

// ---- AMX-INT8 ----
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: sums (h, l) x (tile t, tile t + 1), mb rows of 16 int32; tmm4, 5: h and l, mb rows of
// 64 inputs; tmm6, 7: the two tiles' codes, 16 rows of (16 outputs x 4 inputs).
void configure(int mb) {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = i < 6 ? mb : 16;
  }
  _tile_loadconfig(&c);
}

// Output tiles t and t + 1 (pair) or t alone, rows m0..m0 + mb.
template <bool kPair>
void amx_tiles(const Args& a, int64_t t, int64_t m0, int mb) {
  _tile_zero(0);
  _tile_zero(1);
  if (kPair) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int8_t* hp = a.hl + m0 * a.K;
  const int8_t* lp = hp + a.M * a.K;
  const uint8_t* w0 = a.codes + t * a.G * 512;
  const uint8_t* w1 = w0 + a.G * 512;
  for (int64_t kb = 0; kb < a.K / 64; ++kb) {  // 64 inputs: two groups of the layout, 16 tile rows
    _tile_loadd(4, hp + kb * 64, a.K);
    _tile_loadd(5, lp + kb * 64, a.K);
    _tile_loadd(6, w0 + kb * 1024, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 5, 6);
    if (kPair) {
      _tile_loadd(7, w1 + kb * 1024, 64);
      _tile_dpbsud(2, 4, 7);
      _tile_dpbsud(3, 5, 7);
    }
  }
  alignas(64) int32_t c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (kPair) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  for (int p = 0; p < (kPair ? 2 : 1); ++p)
    for (int r = 0; r < mb; ++r) {
      const int64_t m = m0 + r;
      finish(_mm512_load_si512(c[2 * p] + 16 * r), _mm512_load_si512(c[2 * p + 1] + 16 * r), a.sums[m],
             a.sums[a.M + m], a.s[m], a.ws + (t + p) * kTile, a.y + m * a.N + (t + p) * kTile);
    }
}

void amx_gemm(const Args& a) {
  const int64_t T = a.N / kTile, pairs = (T + 1) / 2;
  at::parallel_for(0, pairs, 2, [&](int64_t p0, int64_t p1) {
    int configured = -1;
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int mb = (int)std::min<int64_t>(16, a.M - m0);
      if (mb != configured) configure(configured = mb);
      for (int64_t p = p0; p < p1; ++p) {
        if (2 * p + 1 < T) amx_tiles<true>(a, 2 * p, m0, mb);
        else amx_tiles<false>(a, 2 * p, m0, mb);
      }
    }
    _tile_release();
  });
}

bool amx_ready() {
  // Linux lends the tile registers' state only on request (once per process).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
#else
void amx_gemm(const Args&) { TORCH_CHECK(false, "built without AMX"); }
bool amx_ready() { return false; }
#endif

// x: bf16 [M, K]; codes: u8 [N/16, K/32, 512]; wscale: f32 [N]; amx: use the tile unit -> bf16 [M, N]
torch::Tensor int8_a16_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor wscale, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 512,
              "codes: contiguous u8 [N/16, K/32, 512]");
  const int64_t M = x.size(0), K = x.size(1), G = codes.size(1), N = codes.size(0) * kTile;
  TORCH_CHECK(K == G * kGroup && K % 64 == 0, "K must be a multiple of 64 and match the codes");
  TORCH_CHECK(wscale.dim() == 1 && wscale.scalar_type() == at::kFloat && wscale.is_contiguous() &&
              wscale.size(0) == N, "wscale: contiguous f32 [N]");
  TORCH_CHECK(!amx || amx_ready(), "AMX tiles are not available here");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto hl = torch::empty({2, M, K}, x.options().dtype(at::kChar));
  auto s = torch::empty({M}, x.options().dtype(at::kFloat));
  auto sums = torch::empty({2, M}, x.options().dtype(at::kInt));
  quantize_rows_a16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, hl.data_ptr<int8_t>(),
                    s.data_ptr<float>(), sums.data_ptr<int32_t>());
  Args a{hl.data_ptr<int8_t>(), s.data_ptr<float>(), sums.data_ptr<int32_t>(), codes.data_ptr<uint8_t>(),
         wscale.data_ptr<float>(), reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N, G};
  if (amx) amx_gemm(a);
  else vnni_gemm(a);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_a16_gemm", &int8_a16_gemm, "row-invariant W8A16 GEMM: bf16 [M, K] x packed int8 [N, K] -> bf16 [M, N]");
  m.def("amx_ready", &amx_ready, "whether this build and process can use AMX tiles");
}
