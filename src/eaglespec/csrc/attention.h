// Shared by the two decode-attention implementations (attention.cpp: AVX-512 vectors;
// attention_amx.cpp: AMX tiles): the call's arguments, each token's list of visible slots, and the
// fp32 softmax of one row. Every piece works on one (row, token) at a time, so neither
// implementation's results depend on how many tokens or rows a call holds.
#pragma once
#include "vec.h"

#include <torch/extension.h>

#include <cmath>
#include <cstring>

namespace eaglespec {

constexpr int MAX_CHUNKS = 32;  // head_dim up to 512

struct Call {
  const c10::BFloat16 *q, *k, *v;
  c10::BFloat16* out;
  const bool* mask;  // null: every slot visible
  int64_t nh, nkv, T, S, g, chunks;
  int64_t ksb, ksh, kss, vsb, vsh, vss, msb, mst, mss;
  float scale;
};

// Token t's visible slots of (batch row) b, in slot order, into slots[t * S ...] and counts[t];
// returns P, the length of the run of slots 0..P-1 that every token sees (the shared context).
inline int64_t visible_slots(const Call& c, int64_t b, int64_t* slots, int64_t* counts) {
  int64_t P = c.S;
  for (int64_t t = 0; t < c.T; ++t) {
    int64_t* sl = slots + t * c.S;
    int64_t n = 0;
    if (c.mask) {
      const bool* row = c.mask + b * c.msb + t * c.mst;
      int64_t run = 0;
      for (int64_t s = 0; s < c.S; ++s)
        if (row[s * c.mss]) {
          if (run == s) ++run;
          sl[n++] = s;
        }
      P = run < P ? run : P;
    } else {
      for (int64_t s = 0; s < c.S; ++s) sl[n++] = s;
    }
    counts[t] = n;
  }
  return P;
}

// One row's softmax numerators in place: sj[0..n) holds its scores (room up to the next multiple
// of 16); they become exp(score * scale - max), the unused lanes of the last block exact zeros.
// Returns their sum (16 lanes along the blocks, then the lanes in a fixed tree). With `bf16` not
// null, the numerators are also written there rounded to bf16 (same length).
inline float softmax_row(float* sj, int64_t n, float scale = 1.f, uint16_t* bf16 = nullptr) {
  const int64_t blocks = (n + LANES - 1) / LANES;
  for (int64_t i = n; i < blocks * LANES; ++i) sj[i] = -INFINITY;
  fvec top = fvec{} - INFINITY;
  for (int64_t i = 0; i < blocks * LANES; i += NL) {
    fvec x;
    std::memcpy(&x, sj + i, sizeof(x));
    if (scale != 1.f) {
      x = x * scale;
      std::memcpy(sj + i, &x, sizeof(x));
    }
    top = x > top ? x : top;
  }
  float mx = top[0];  // a maximum is exact in any order
  for (int j = 1; j < NL; ++j) mx = top[j] > mx ? top[j] : mx;
  fvec total[LANES / NL] = {};  // one 16-lane sum along the blocks, NL lanes at a time
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int p = 0; p < LANES / NL; ++p) {
      float* at = sj + blk * LANES + p * NL;
      fvec x;
      std::memcpy(&x, at, sizeof(x));
      fvec e = exp_nonpositive(x - mx);
      e = x == -INFINITY ? fvec{} : e;  // unused lanes weigh exactly nothing
      std::memcpy(at, &e, sizeof(e));
      if (bf16) {
#if defined(__AVX512BF16__)  // one instruction, the same rounding (to nearest even) for these finite values
        const __m256bh h = _mm512_cvtneps_pbh((__m512)e);
#else
        const halves_of<fvec> h = __builtin_convertvector(bf16_bits(e) >> 16, halves_of<fvec>);
#endif
        std::memcpy(bf16 + blk * LANES + p * NL, &h, sizeof(h));
      }
      total[p] = total[p] + e;
    }
  }
  return lane_sum(joined(total));
}

// Built with AMX-BF16 and granted the tile state by Linux (attention_amx.cpp).
bool attention_amx_ready();
// Every item (batch row, kv head) of the call on AMX tiles.
void attend_all_amx(const Call& c, int64_t items);

}  // namespace eaglespec
