// Decode-shaped attention on AMX-BF16 tiles: the same call as attention.cpp's vector path
// (softmax(q k^T * scale) v per batch row, query head and new token, over each token's visible
// slots in slot order), with the products on the tile unit.
//
// Why: a verified tree's tokens each read the whole context. On vectors that costs about as much
// per token as the first one; on tiles one product serves 16 query rows, so a tree's cost grows
// much more slowly (scripts/attention_bench.py, 256 context tokens: 9 tokens 3.3x one token,
// against 4.5x on vectors).
//
// Arithmetic, per (row r, token t), on its visible list of keys (positions i = 0..n-1):
//   score_i = (dot of q_r and k_i as tile bf16 products accumulated in fp32 by `tdpbf16ps`, over
//              head_dim in steps of 32 from zero) * scale
//   e_i     = exp(score_i - max) in fp32 (attention.h's softmax_row), total = their fp32 sum
//   out_r   = bf16((sum over blocks of 32 positions, in order, of tdpbf16ps(bf16(e), v)) / total)
// Each output element is a function of its own row's query, weights and list of keys only:
// a tile's element (m, n) depends on row m of A and column n of B and nothing else in the tile.
// Blocks are taken at the same list positions whether they are shared by all tokens (the committed
// context, read straight from the cache) or one token's own (gathered through its slot list), and
// positions past a token's count hold zero weights and zero values, so a tree node gets the same
// bits as the same token decoded alone. The vector path computes different (equally valid) bits:
// a process uses one of the two for every call (attention.kernel_attention).
//
// Layouts (tiles of 16 rows x 64 bytes):
//   K (A, scores): 16 slots' rows, 32 dims each, straight from the cache (a partial last block
//                  copied and zero-padded); scores come out transposed (S^T = K Q^T);
//   Q (B, scores): qb[r][d] bf16 (rows padded to a multiple of 16, plus 16 rows so that a window
//                  of 16 rows may start at any token's first row), transposed as dwords (pairs
//                  of dims) per group of 16 rows: qt[p][r] = row r's dims 2p, 2p + 1 (the VNNI
//                  layout tdpbf16ps takes for B);
//   P (A, values): pb[r][i] bf16 weights (zero past the row's count up to its last block of 32);
//   V (B, values): for key pairs (2j, 2j + 1) and 16 dims c..c+15: the dword (v[2j][d], v[2j+1][d]).
#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace eaglespec {
namespace {

constexpr int kKeys = 16;   // keys per score tile (its columns)
constexpr int kBlock = 32;  // positions per value tile (its A columns: 32 bf16)
constexpr int kDims = 16;   // output dims per value tile
constexpr int kPass = 4;    // value tiles accumulated at once (tmm4..7)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes. tmm0, 1: A; tmm2, 3: B; tmm4..7: sums (scores, then weighted values).
void configure() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Per thread and call: one item's rows (T tokens x g query heads, r = t * g + j) and their state.
// Buffers every part of which is written before it is read are left uninitialised; rows past R of
// qb, pb and acc feed only tile rows that are never read, and are zeroed so that no garbage (NaN,
// denormal patterns) reaches the tile unit.
template <typename V>
std::unique_ptr<V[]> uninit(int64_t n) { return std::unique_ptr<V[]>(new V[n]); }

struct Scratch {
  int64_t R, Rx, Sp, hd;
  std::vector<int64_t> slots, counts;      // visible_slots of batch row slots_of (-1: none yet)
  int64_t slots_of = -1, shared = 0;
  std::unique_ptr<float[]> scores, totals, acc;  // scores [Rx][Sp], acc [Rx][hd]
  std::unique_ptr<uint16_t[]> qb, pb;            // [Rx][hd], [Rx][Sp]
  std::unique_ptr<uint32_t[]> qt;                // [Rx / 16][hd / 32][16][16]: queries transposed (score tiles B)
  std::unique_ptr<uint16_t[]> kpad;              // [16][hd]: a last, partial block of keys
  std::unique_ptr<uint32_t[]> vt;                // [blocks][hd / 16][16][16]: shared blocks' value tiles, + 1
  std::vector<const uint16_t*> rows;             // kBlock row pointers (null: a zero row)
  std::vector<uint16_t> zero;                    // [hd]
  alignas(64) float cbuf[kPass][16 * 16];
  explicit Scratch(const Call& c)
      : R(c.T * c.g), Rx(round_up(R, 16) + 16), Sp(round_up(c.S > 0 ? c.S : 1, kBlock)), hd(c.chunks * LANES),
        slots(c.T * c.S), counts(c.T), scores(uninit<float>(Rx * Sp)), totals(uninit<float>(Rx)),
        acc(uninit<float>(Rx * hd)), qb(uninit<uint16_t>(Rx * hd)), pb(uninit<uint16_t>(Rx * Sp)),
        qt(uninit<uint32_t>(Rx / 16 * (hd / 32) * 256)), kpad(uninit<uint16_t>(16 * hd)),
        vt(uninit<uint32_t>((Sp / kBlock + 1) * (hd / kDims) * 256)), rows(kBlock), zero(hd, 0) {
    std::fill(qb.get() + R * hd, qb.get() + Rx * hd, 0);
    std::fill(pb.get() + R * Sp, pb.get() + Rx * Sp, 0);
    std::fill(acc.get() + R * hd, acc.get() + Rx * hd, 0.f);
  }
};

// 16 dwords from each of 16 rows (the dword at column 16 * col of each) -> out rows 16 * col..+15
// (out[(16 col + p) * 16 + n] = dword 16 col + p of row n).
inline void transpose16(const uint32_t* const* src, int64_t col, uint32_t* out) {
  __m512i r[16], t[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(src[n] + 16 * col);
  for (int i = 0; i < 8; ++i) {  // 2x2 blocks of dwords
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 4x4 blocks within each 128-bit lane
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + k] now holds, in 128-bit lane l, dwords 4l + k of rows 4i..4i+3. Gather lanes across the
  // four groups: out row 4l + k = lane l of r[k], r[4 + k], r[8 + k], r[12 + k].
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);       // lanes 0,1 of each
    const __m512i b = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i c = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xee);       // lanes 2,3 of each
    const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xee);
    _mm512_storeu_si512(out + (16 * col + 0 + k) * 16, _mm512_shuffle_i32x4(a, b, 0x88));   // lane 0
    _mm512_storeu_si512(out + (16 * col + 4 + k) * 16, _mm512_shuffle_i32x4(a, b, 0xdd));   // lane 1
    _mm512_storeu_si512(out + (16 * col + 8 + k) * 16, _mm512_shuffle_i32x4(c, d, 0x88));   // lane 2
    _mm512_storeu_si512(out + (16 * col + 12 + k) * 16, _mm512_shuffle_i32x4(c, d, 0xdd));  // lane 3
  }
}

// Value tiles for kBlock positions (w.rows[0..31]) into out[c][j][d] (c over head_dim / 16): for
// each pair of rows, 32 dims of both at a time interleaved by one two-source word permute.
inline void value_tiles(const Scratch& w, uint32_t* out) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);  // dims 0..15
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));                              // dims 16..31
  for (int j = 0; j < 16; ++j) {
    const uint16_t* a = w.rows[2 * j] ? w.rows[2 * j] : w.zero.data();
    const uint16_t* b = w.rows[2 * j + 1] ? w.rows[2 * j + 1] : w.zero.data();
    for (int64_t h = 0; h < w.hd / 32; ++h) {
      const __m512i va = _mm512_loadu_si512(a + 32 * h), vb = _mm512_loadu_si512(b + 32 * h);
      _mm512_storeu_si512(out + ((2 * h) * 16 + j) * 16, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(out + ((2 * h + 1) * 16 + j) * 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// GCC's tile intrinsics take the register number as a literal (they paste it into the assembly),
// so the value sums' registers tmm4..7 are chosen by a switch.
#define EAGLESPEC_ACC_TILE(i, op) \
  switch (i) {                    \
    case 0: op(4); break;         \
    case 1: op(5); break;         \
    case 2: op(6); break;         \
    default: op(7);               \
  }

// tmm4 + i += (A in tmm<a>) x (the B tile at tiles + i * step dwords), for i < n (n <= kPass):
// up to four independent sums in flight, B loaded alternately into tmm2 and tmm3 so that a load
// need not wait for the product before it to finish reading its B (tiles are not renamed).
#define EAGLESPEC_DP_PASS(name, A)                                                                    \
  inline void name(const uint32_t* tiles, int64_t step, int64_t n) {                                 \
    switch (n) { /* falls through: the highest i first */                                            \
      case 4: _tile_loadd(3, tiles + 3 * step, 64); _tile_dpbf16ps(7, A, 3); [[fallthrough]];         \
      case 3: _tile_loadd(2, tiles + 2 * step, 64); _tile_dpbf16ps(6, A, 2); [[fallthrough]];         \
      case 2: _tile_loadd(3, tiles + 1 * step, 64); _tile_dpbf16ps(5, A, 3); [[fallthrough]];         \
      default: _tile_loadd(2, tiles, 64); _tile_dpbf16ps(4, A, 2);                                    \
    }                                                                                                 \
  }
EAGLESPEC_DP_PASS(dp_pass0, 0)  // A in tmm0
EAGLESPEC_DP_PASS(dp_pass1, 1)  // A in tmm1

// tmm4 + u += (key tile u: A, 16 slots' dims d0..d0+31, alternately in tmm0 and tmm1) x (the
// queries' B in tmm<B>), for u < n (n <= kPass).
#define EAGLESPEC_KEYS_PASS(name, B)                                                               \
  inline void name(const uint16_t* const* ka, const int64_t* stride, int64_t d0, int64_t n) {     \
    switch (n) { /* falls through: the highest u first */                                        \
      case 4: _tile_loadd(1, ka[3] + d0, stride[3]); _tile_dpbf16ps(7, 1, B); [[fallthrough]];    \
      case 3: _tile_loadd(0, ka[2] + d0, stride[2]); _tile_dpbf16ps(6, 0, B); [[fallthrough]];    \
      case 2: _tile_loadd(1, ka[1] + d0, stride[1]); _tile_dpbf16ps(5, 1, B); [[fallthrough]];    \
      default: _tile_loadd(0, ka[0] + d0, stride[0]); _tile_dpbf16ps(4, 0, B);                    \
    }                                                                                              \
  }
EAGLESPEC_KEYS_PASS(keys_pass2, 2)  // queries in tmm2
EAGLESPEC_KEYS_PASS(keys_pass3, 3)  // queries in tmm3

inline void acc_zero(int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    EAGLESPEC_ACC_TILE(i, _tile_zero)
  }
}

// Tiles tmm4 + i (i < n) <-> 16 rows of floats at base + i * step, rows `stride` bytes apart.
inline void acc_load(const float* base, int64_t stride, int64_t step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float* p = base + i * step;
#define LOAD(t) _tile_loadd(t, p, stride)
    EAGLESPEC_ACC_TILE(i, LOAD)
#undef LOAD
  }
}

inline void acc_store(float* base, int64_t stride, int64_t step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float* p = base + i * step;
#define STORE(t) _tile_stored(t, p, stride)
    EAGLESPEC_ACC_TILE(i, STORE)
#undef STORE
  }
}

void attend_item(const Call& c, int64_t item, Scratch& w) {
  const int64_t g = c.g, T = c.T, R = w.R, Sp = w.Sp, hd = w.hd, S = c.S;
  const int64_t h = item % c.nkv, b = item / c.nkv;
  if (b != w.slots_of) {  // the same for every kv head of a batch row
    w.shared = visible_slots(c, b, w.slots.data(), w.counts.data());
    w.slots_of = b;
  }
  const int64_t P = w.shared;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(c.q);
  const uint16_t* kh = reinterpret_cast<const uint16_t*>(c.k + b * c.ksb + h * c.ksh);
  const uint16_t* vh = reinterpret_cast<const uint16_t*>(c.v + b * c.vsb + h * c.vsh);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < g; ++j)
      std::memcpy(w.qb.get() + (t * g + j) * hd, q + ((b * c.nh + h * g + j) * T + t) * hd, hd * 2);
  const int64_t groups = round_up(R, 16);

  // Scores of every row against every slot 0..S-1, computed transposed (S^T = K Q^T): 16 slots
  // are a tile A read straight from the cache, the queries (transposed once per item, in row
  // groups of 16) are B, kPass key tiles in flight. A score is a function of its query and key
  // alone, so scoring slots a row does not see changes nothing; each row's list of visible
  // slots is then gathered in place (list position i < P is slot i; past it, slot sl[i] >= i,
  // not yet overwritten).
  const int64_t blocks16 = (S + kKeys - 1) / kKeys, chunks32 = hd / 32;
  for (int64_t r0 = 0; r0 < groups; r0 += 16) {
    const uint32_t* src[16];
    for (int n = 0; n < 16; ++n) src[n] = reinterpret_cast<const uint32_t*>(w.qb.get() + (r0 + n) * hd);
    for (int64_t kc = 0; kc < chunks32; ++kc) transpose16(src, kc, w.qt.get() + r0 / 16 * chunks32 * 256);
  }
  for (int64_t u0 = 0; u0 < blocks16; u0 += kPass) {
    const int64_t nu = std::min<int64_t>(kPass, blocks16 - u0);
    const uint16_t* ka[kPass];
    int64_t kstride[kPass];
    for (int64_t u = 0; u < nu; ++u) {
      const int64_t i0 = (u0 + u) * kKeys;
      if (i0 + kKeys <= S) {
        ka[u] = kh + i0 * c.kss;
        kstride[u] = c.kss * 2;
      } else {  // the last, partial block: copied, zero-padded (the cache may end at slot S)
        uint16_t* pad = w.kpad.get();
        for (int64_t m = 0; m < kKeys; ++m)
          std::memcpy(pad + m * hd, i0 + m < S ? kh + (i0 + m) * c.kss : w.zero.data(), hd * 2);
        ka[u] = pad;
        kstride[u] = hd * 2;
      }
    }
    for (int64_t r0 = 0; r0 < groups; r0 += 16) {
      acc_zero(nu);
      for (int64_t kc = 0; kc < chunks32; ++kc) {
        const uint32_t* qt = w.qt.get() + (r0 / 16 * chunks32 + kc) * 256;
        if (kc % 2 == 0) {
          _tile_loadd(2, qt, 64);
          keys_pass2(ka, kstride, kc * 32, nu);
        } else {
          _tile_loadd(3, qt, 64);
          keys_pass3(ka, kstride, kc * 32, nu);
        }
      }
      acc_store(w.cbuf[0], 64, 256, nu);
      const int64_t rows = std::min<int64_t>(16, R - r0);
      for (int64_t u = 0; u < nu; ++u) {  // cbuf[u][key][row] -> scores[row][slot]
        float* dst = w.scores.get() + r0 * Sp + (u0 + u) * kKeys;
        const float* cb = w.cbuf[u];
        if (rows > 4) {
          const uint32_t* cs[16];
          for (int n = 0; n < 16; ++n) cs[n] = reinterpret_cast<const uint32_t*>(cb + n * 16);
          alignas(64) uint32_t tr[256];
          transpose16(cs, 0, tr);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * Sp, tr + r * 16, 64);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int n = 0; n < 16; ++n) dst[r * Sp + n] = cb[n * 16 + r];
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / g, n = w.counts[t];
    const int64_t* sl = w.slots.data() + t * S;
    float* sj = w.scores.get() + r * Sp;
    for (int64_t i = P; i < n; ++i) sj[i] = sj[sl[i]];
  }

  // Weights: scaled scores, softmax numerators in fp32 (their sum in totals), then bf16 copies
  // with zeros past the row's count up to the end of its last block of 32.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = w.counts[r / g];
    uint16_t* pr = w.pb.get() + r * Sp;
    w.totals[r] = softmax_row(w.scores.get() + r * Sp, n, c.scale, pr);
    for (int64_t i = (n + LANES - 1) / LANES * LANES; i < round_up(n, kBlock); ++i) pr[i] = 0;
  }

  // Weighted values. Shared blocks of 32: value tiles built once, every row group accumulating in
  // tmm4..7 (head_dim in passes of 4 tiles of 16 dims). Then each token's own blocks: its 16-row
  // window's sums loaded from acc, accumulated, and only its g rows written back.
  const int64_t shared32 = P / kBlock * kBlock, nb = shared32 / kBlock, dtiles = hd / kDims;
  for (int64_t blk = 0; blk < nb; ++blk) {
    for (int m = 0; m < kBlock; ++m) w.rows[m] = vh + (blk * kBlock + m) * c.vss;
    value_tiles(w, w.vt.get() + blk * dtiles * 256);
  }
  for (int64_t r0 = 0; r0 < groups; r0 += 16)
    for (int64_t c0 = 0; c0 < dtiles; c0 += kPass) {
      const int64_t np = std::min<int64_t>(kPass, dtiles - c0);
      acc_zero(np);
      for (int64_t blk = 0; blk < nb; ++blk) {
        if (blk % 2 == 0) {
          _tile_loadd(0, w.pb.get() + r0 * Sp + blk * kBlock, Sp * 2);
          dp_pass0(w.vt.get() + (blk * dtiles + c0) * 256, 256, np);
        } else {
          _tile_loadd(1, w.pb.get() + r0 * Sp + blk * kBlock, Sp * 2);
          dp_pass1(w.vt.get() + (blk * dtiles + c0) * 256, 256, np);
        }
      }
      acc_store(w.acc.get() + r0 * hd + c0 * kDims, hd * 4, kDims, np);
    }
  uint32_t* own = w.vt.get() + nb * dtiles * 256;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* sl = w.slots.data() + t * S;
    const int64_t n = w.counts[t], r0 = t * g;
    for (int64_t i0 = shared32; i0 < n; i0 += kBlock) {
      for (int m = 0; m < kBlock; ++m) w.rows[m] = i0 + m < n ? vh + sl[i0 + m] * c.vss : nullptr;
      value_tiles(w, own);
      for (int64_t c0 = 0; c0 < dtiles; c0 += kPass) {
        const int64_t np = std::min<int64_t>(kPass, dtiles - c0);
        acc_load(w.acc.get() + r0 * hd + c0 * kDims, hd * 4, kDims, np);
        _tile_loadd(0, w.pb.get() + r0 * Sp + i0, Sp * 2);
        dp_pass0(own + c0 * 256, 256, np);
        acc_store(w.cbuf[0], 64, 256, np);
        for (int64_t p = 0; p < np; ++p)
          for (int64_t j = 0; j < g; ++j)
            std::memcpy(w.acc.get() + (r0 + j) * hd + (c0 + p) * kDims, w.cbuf[p] + j * 16, 64);
      }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / g, j = r % g;
    const float total = w.totals[r];
    c10::BFloat16* o = c.out + ((b * c.nh + h * g + j) * T + t) * hd;
    for (int64_t ch = 0; ch < c.chunks; ++ch) {
      f32x16 a;
      std::memcpy(&a, w.acc.get() + r * hd + ch * LANES, sizeof(a));
      store_bf16(o + ch * LANES, total > 0.f ? a / total : f32x16{});
    }
  }
}

}  // namespace

bool attention_amx_ready() {
  // Linux lends the tile registers' state only on request (once per process).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

void attend_all_amx(const Call& c, int64_t items) {
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch w(c);
    configure();
    for (int64_t item = begin; item < end; ++item) attend_item(c, item, w);
    _tile_release();
  });
}

}  // namespace eaglespec

#else  // built without AMX-BF16: the vector path serves every call

namespace eaglespec {
bool attention_amx_ready() { return false; }
void attend_all_amx(const Call&, int64_t) { TORCH_CHECK(false, "decode_attention: built without AMX-BF16"); }
}  // namespace eaglespec

#endif
