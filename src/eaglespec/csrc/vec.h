// 16-lane float vectors (GCC vector extensions: AVX-512 where built with it, narrower vectors
// otherwise, the same IEEE operations lane by lane either way) and bf16 loads/stores.
#pragma once
#include <c10/util/BFloat16.h>

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

inline void store_bf16(c10::BFloat16* p, f32x16 v) {
  for (int l = 0; l < LANES; ++l) p[l] = c10::BFloat16(v[l]);  // rounds to nearest even
}

inline float lane_sum(f32x16 v) {
  // A fixed pairwise tree over the 16 lanes: lane i + lane i + 8, then + 4, + 2, + 1.
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

}  // namespace eaglespec
