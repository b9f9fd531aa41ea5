// Decode-shaped attention on a CPU (one token, a draft tree, a few rows), row-invariant by
// construction.
//
// Owns: softmax(q k^T * scale) v for every (batch row, query head, new token), reading the KV
// cache in place (bf16, [B, n_kv, S, hd] views whose last dimension is contiguous) and a boolean
// mask of visible slots.
//
// Why a kernel: the same attention as a dozen torch ops costs ~10 us of dispatch each, for about
// a microsecond of arithmetic per layer at one query; and a tree node must get the same bits as
// the same token decoded alone (eaglespec/attention.py explains why that matters).
//
// Why it is exact: each (row, head, token) is computed on its own, over its visible keys only,
// taken in slot order (the committed context, then the node's ancestors, then itself: the same
// logical sequence the one-token call reads), with a fixed sequence of float operations that
// depends on nothing but that sequence. Masked slots are skipped, not weighted by zero, so other
// nodes between a node's keys cannot change its sums; work is split between threads by whole
// (batch row, kv head) items. The tokens of an item share the loading of the context's keys and
// values (see attend_item), which changes no operation on any score or sum.
//
// Arithmetic: scores are fp32 dot products of the bf16 inputs (16 lanes, lanes summed in a fixed
// tree), the softmax runs in fp32 with the running maximum taken first, the weighted sum of values
// accumulates in fp32 along the keys (fused multiply-adds on AVX-512: vec.h's fmadd), and the
// output is rounded to bf16 once. -ffp-contract=off keeps the compiler from fusing multiply-adds
// differently in different places.
//
// On CPUs with AMX-BF16, attention_amx.cpp computes the same attention on tiles (its own
// arithmetic, row-invariant by the same construction); the caller picks one per call (`amx`).

#include "attention.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace eaglespec;

// A query-key dot product before its lane sum: q and k as `chunks` vectors of 16, multiplied lane
// by lane and added chunk after chunk (the one order every score uses).
// (Fused or not, the same bits: a product of two bf16 values is exact in fp32.)
inline f32x16 lane_products(const f32x16* q, const f32x16* k, int64_t chunks) {
  f32x16 d = q[0] * k[0];
  for (int64_t ch = 1; ch < chunks; ++ch) d = fmadd(q[ch], k[ch], d);
  return d;
}

// Per thread: one item's rows (its T tokens x g query heads, row r = t * g + j) and their state.
struct Scratch {
  std::vector<int64_t> slots, counts;  // slots[t * S + i]: token t's i-th visible slot; counts[t]
  std::vector<float> scores, totals;   // scores[r * Sp + i]
  std::vector<f32x16> qv, acc, block;  // block: LANES keys or values in fp32, [LANES * chunks]
  Scratch(const Call& c)
      : slots(c.T * c.S), counts(c.T), scores(c.T * c.g * padded(c.S)), totals(c.T * c.g),
        qv(c.T * c.g * c.chunks), acc(c.T * c.g * c.chunks), block(LANES * c.chunks) {}
  static int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }
};

// LANES keys or values widened to fp32 into out[l * chunks + ch]: those at list positions
// i0..i0+15, in slots slots[i] (null: slot = position, the shared context).
inline void widen_block(const c10::BFloat16* base, int64_t stride, const int64_t* slots, int64_t i0, int64_t chunks,
                        f32x16* out) {
  for (int64_t l = 0; l < LANES; ++l) {
    const int64_t s = slots ? slots[i0 + l] : i0 + l;
    for (int64_t ch = 0; ch < chunks; ++ch) out[l * chunks + ch] = load_bf16(base + s * stride + ch * LANES);
  }
}

// Scores of `rows` query rows (qv of row r at q0 + r * chunks, scores at s0 + r * Sp) for the LANES
// keys widened in `kb`, at list positions i0..i0+15: 16-lane products, lanes summed in a fixed tree.
template <int C>
inline void score_block(const f32x16* kb, const f32x16* q0, int64_t rows, int64_t chunks, float scale, float* s0,
                        int64_t Sp, int64_t i0) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // The same operations on 8-lane halves in registers: each key's lane products (multiply, then
  // multiply-and-add chunk after chunk, unfused), halves added (the tree's first step), the rest
  // of the tree for 8 keys at once (vec.h's tree_sums8), times the scale.
  constexpr int CH = C ? C : MAX_CHUNKS;
  const float* k = reinterpret_cast<const float*>(kb);
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* q = reinterpret_cast<const float*>(q0 + r * chunks);
    __m256 qh[2 * CH], a[LANES];
    for (int64_t x = 0; x < 2 * chunks; ++x) qh[x] = _mm256_loadu_ps(q + 8 * x);
    for (int64_t l = 0; l < LANES; ++l) {
      const float* kl = k + l * chunks * LANES;
      __m256 lo = _mm256_mul_ps(qh[0], _mm256_loadu_ps(kl)), hi = _mm256_mul_ps(qh[1], _mm256_loadu_ps(kl + 8));
      for (int64_t ch = 1; ch < chunks; ++ch) {
        lo = _mm256_add_ps(_mm256_mul_ps(qh[2 * ch], _mm256_loadu_ps(kl + 16 * ch)), lo);
        hi = _mm256_add_ps(_mm256_mul_ps(qh[2 * ch + 1], _mm256_loadu_ps(kl + 16 * ch + 8)), hi);
      }
      a[l] = _mm256_add_ps(lo, hi);
    }
    _mm256_storeu_ps(s0 + r * Sp + i0, _mm256_mul_ps(tree_sums8(a), sc));
    _mm256_storeu_ps(s0 + r * Sp + i0 + 8, _mm256_mul_ps(tree_sums8(a + 8), sc));
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    const f32x16* qr = q0 + r * chunks;
    f32x16 d[LANES];
    for (int64_t l = 0; l < LANES; ++l) d[l] = lane_products(qr, kb + l * chunks, C ? C : chunks);
    const f32x16 sc = lane_sums16(d) * scale;
    std::memcpy(s0 + r * Sp + i0, &sc, sizeof(sc));
  }
#endif
}

// Rows r0..r0+N-1 add the LANES values widened in vb (list positions i0..i0+15), weighted, to their
// sums, key after key. Each row's additions are the same sequence for any N; N rows side by side
// only give the CPU independent additions to overlap (one row's chain waits on each add).
#if defined(__AVX512F__)
constexpr int kValueRows = 3;
#else
constexpr int kValueRows = 1;  // 256-bit registers: one row's 4 x 2 accumulators already take half of them
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 builds: the same operations on 8-lane halves held in registers (GCC keeps a generic 16-lane
// array in memory there): acc += (0 + e) * v, multiply then add, as vec.h's fmadd without FMA.
template <int C, int N>
inline void accumulate_values(Scratch& w, const f32x16* vb, int64_t r0, int64_t chunks, int64_t Sp, int64_t i0) {
  static_assert(N == 1, "one row at a time on 256-bit registers");
  constexpr int CH = C ? C : MAX_CHUNKS;
  __m256 a[2 * CH];
  float* acc = reinterpret_cast<float*>(&w.acc[r0 * chunks]);
  const float* v = reinterpret_cast<const float*>(vb);
  const float* e = &w.scores[r0 * Sp + i0];
  for (int64_t x = 0; x < 2 * chunks; ++x) a[x] = _mm256_loadu_ps(acc + 8 * x);
  for (int64_t l = 0; l < LANES; ++l) {
    const __m256 el = _mm256_add_ps(_mm256_setzero_ps(), _mm256_set1_ps(e[l]));
    for (int64_t x = 0; x < 2 * chunks; ++x)
      a[x] = _mm256_add_ps(_mm256_mul_ps(el, _mm256_loadu_ps(v + l * chunks * LANES + 8 * x)), a[x]);
  }
  for (int64_t x = 0; x < 2 * chunks; ++x) _mm256_storeu_ps(acc + 8 * x, a[x]);
}
#else
template <int C, int N>
inline void accumulate_values(Scratch& w, const f32x16* vb, int64_t r0, int64_t chunks, int64_t Sp, int64_t i0) {
  constexpr int CH = C ? C : MAX_CHUNKS;
  f32x16 a[N][CH];
  for (int n = 0; n < N; ++n)
    for (int64_t ch = 0; ch < chunks; ++ch) a[n][ch] = w.acc[(r0 + n) * chunks + ch];
  for (int64_t l = 0; l < LANES; ++l)
    for (int n = 0; n < N; ++n) {
      const float e = w.scores[(r0 + n) * Sp + i0 + l];
      for (int64_t ch = 0; ch < chunks; ++ch) a[n][ch] = fmadd(splat(e), vb[l * chunks + ch], a[n][ch]);
    }
  for (int n = 0; n < N; ++n)
    for (int64_t ch = 0; ch < chunks; ++ch) w.acc[(r0 + n) * chunks + ch] = a[n][ch];
}
#endif

// One item: (row b, kv head h), all T tokens and their g query heads each, which share the keys.
// Token t reads its visible slots in slot order: every token sees slots 0..P-1 (the committed
// context, P the shortest such run), then its own (its ancestors, itself). Blocks of LANES keys
// within 0..P-1 are widened once for every row; the rest per token. A key's score, its weight and
// the order in which a row adds its weighted values depend only on that row's own sequence of
// visible keys, never on the other rows or on where the blocks fall, so a token's output is the
// same bits alone (one-token decoding) or in a tree.
template <int C>
void attend_item(const Call& c, int64_t item, Scratch& w) {
  const int64_t chunks = C ? C : c.chunks, g = c.g, Sp = Scratch::padded(c.S), T = c.T, R = T * g;
  const int64_t h = item % c.nkv, b = item / c.nkv;
  const int64_t P = visible_slots(c, b, w.slots.data(), w.counts.data());
  const int64_t shared = P / LANES * LANES;  // list positions 0..shared-1 are slots 0..shared-1 for every token
  const int64_t hd = chunks * LANES;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < g; ++j)
      for (int64_t ch = 0; ch < chunks; ++ch)
        w.qv[(t * g + j) * chunks + ch] = load_bf16(c.q + ((b * c.nh + h * g + j) * T + t) * hd + ch * LANES);
  const c10::BFloat16* kh = c.k + b * c.ksb + h * c.ksh;
  const c10::BFloat16* vh = c.v + b * c.vsb + h * c.vsh;
  f32x16* kb = w.block.data();
  // Scores. Whole blocks of 16 keys are widened to fp32 once and their 16 lane sums done together
  // (lane_sums16); a token's last keys one by one. Both give every key the same operations.
  for (int64_t i0 = 0; i0 < shared; i0 += LANES) {
    widen_block(kh, c.kss, nullptr, i0, chunks, kb);
    score_block<C>(kb, w.qv.data(), R, chunks, c.scale, w.scores.data(), Sp, i0);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* sl = w.slots.data() + t * c.S;
    const int64_t n = w.counts[t];
    const f32x16* qt = w.qv.data() + t * g * chunks;
    float* st = w.scores.data() + t * g * Sp;
    int64_t i0 = shared;
    for (; i0 + LANES <= n; i0 += LANES) {
      widen_block(kh, c.kss, sl, i0, chunks, kb);
      score_block<C>(kb, qt, g, chunks, c.scale, st, Sp, i0);
    }
    for (int64_t i = i0; i < n; ++i) {
      f32x16 kc[C ? C : MAX_CHUNKS];
      for (int64_t ch = 0; ch < chunks; ++ch) kc[ch] = load_bf16(kh + sl[i] * c.kss + ch * LANES);
      for (int64_t j = 0; j < g; ++j) st[j * Sp + i] = lane_sum(lane_products(qt + j * chunks, kc, chunks)) * c.scale;
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // unnormalised weights exp(score - max), and their sum
    w.totals[r] = softmax_row(w.scores.data() + r * Sp, w.counts[r / g]);
    for (int64_t ch = 0; ch < chunks; ++ch) w.acc[r * chunks + ch] = f32x16{};
  }
  // The weighted sum of values, along each row's keys in order: shared blocks widened once.
  f32x16* vb = w.block.data();
  for (int64_t i0 = 0; i0 < shared; i0 += LANES) {
    widen_block(vh, c.vss, nullptr, i0, chunks, vb);
    int64_t r = 0;
    for (; r + kValueRows <= R; r += kValueRows) accumulate_values<C, kValueRows>(w, vb, r, chunks, Sp, i0);
    for (; r < R; ++r) accumulate_values<C, 1>(w, vb, r, chunks, Sp, i0);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* sl = w.slots.data() + t * c.S;
    for (int64_t i = shared; i < w.counts[t]; ++i) {
      f32x16 vc[C ? C : MAX_CHUNKS];
      for (int64_t ch = 0; ch < chunks; ++ch) vc[ch] = load_bf16(vh + sl[i] * c.vss + ch * LANES);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = t * g + j;
        const float e = w.scores[r * Sp + i];
        f32x16* ar = &w.acc[r * chunks];
        for (int64_t ch = 0; ch < chunks; ++ch) ar[ch] = fmadd(splat(e), vc[ch], ar[ch]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / g, j = r % g;
    const float total = w.totals[r];
    c10::BFloat16* o = c.out + ((b * c.nh + h * g + j) * T + t) * hd;
    for (int64_t ch = 0; ch < chunks; ++ch)
      store_bf16(o + ch * LANES, total > 0.f ? w.acc[r * chunks + ch] / total : f32x16{});
  }
}

template <int C>
void attend_all(const Call& c, int64_t items) {
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch w(c);
    for (int64_t item = begin; item < end; ++item) attend_item<C>(c, item, w);
  });
}

}  // namespace

// q: [B, nh, T, hd] bf16; k, v: [B, nkv, S, hd] bf16 with contiguous last dim;
// mask: [B, T, S] bool (any strides) or undefined (every slot visible). Returns [B, nh, T, hd].
// amx: the tile implementation (refused where attention_amx_ready() is false; head_dim a multiple of 32).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               c10::optional<torch::Tensor> mask, double scale, bool amx) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "decode_attention: bf16 q, k, v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: 4-d q, k, v");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k, v need a contiguous last dim");
  q = q.contiguous();
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t nkv = k.size(1), S = k.size(2);
  TORCH_CHECK(hd % LANES == 0 && hd / LANES <= MAX_CHUNKS, "decode_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(nh % nkv == 0 && k.size(0) == B && v.size(0) == B && v.size(2) == S && k.size(3) == hd,
              "decode_attention: shapes do not match");
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && m.size(0) == B && m.size(1) == T && m.size(2) == S,
                "decode_attention: mask must be bool [B, T, S]");
  }
  auto out = torch::empty({B, nh, T, hd}, q.options());
  const bool masked = m.defined();
  const Call c{q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(),
               out.data_ptr<c10::BFloat16>(), masked ? m.data_ptr<bool>() : nullptr,
               nh, nkv, T, S, nh / nkv, hd / LANES,
               k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
               masked ? m.stride(0) : 0, masked ? m.stride(1) : 0, masked ? m.stride(2) : 0,
               static_cast<float>(scale)};
  const int64_t items = B * nkv;
  if (amx) {
    TORCH_CHECK(attention_amx_ready(), "decode_attention: AMX tiles are not available here");
    TORCH_CHECK(hd % 32 == 0, "decode_attention: the AMX path needs head_dim a multiple of 32");
    attend_all_amx(c, items);
    return out;
  }
  switch (c.chunks) {  // common head sizes unrolled; the arithmetic is identical
    case 4: attend_all<4>(c, items); break;
    case 8: attend_all<8>(c, items); break;
    case 16: attend_all<16>(c, items); break;
    default: attend_all<0>(c, items);
  }
  return out;
}
