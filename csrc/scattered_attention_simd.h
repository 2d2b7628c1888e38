// The vector building blocks of the scattered attention (scattered_attention_cpu.cpp only):
// each ISA's vector width and register blocking, broadcasts, and a vector exp.
//
// GCC/Clang vector extensions: the same templates compile for AVX-512, AVX2 and the baseline
// inside functions with those target attributes, so no -march flag is needed.
#pragma once

#include <stdint.h>

#include <cstring>

#include "scattered_attention.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // wide vectors never cross a call: everything is inlined

namespace lmi_cache {
namespace simd {

#define LMI_INLINE inline __attribute__((always_inline))

// One vector ISA: its vector width and register blocking. An item's 64 rows are kVecs vectors;
// the score block is kKeyBlock keys x kScoreVecs row vectors, the output block kDimBlock dims x
// kOutVecs row vectors, each sized to keep its accumulators, row vectors and a broadcast in
// the kRegisters vector registers.
template <int kLanesT, int kRegistersT, int kKeyBlockT, int kScoreVecsT, int kDimBlockT, int kOutVecsT,
          bool kAsmBroadcastT>
struct Isa {
  typedef float vf __attribute__((vector_size(4 * kLanesT)));
  typedef int32_t vi __attribute__((vector_size(4 * kLanesT)));
  static constexpr int kLanes = kLanesT;
  static constexpr int kVecs = static_cast<int>(kRowsPerItem) / kLanes;
  static constexpr int kKeyBlock = kKeyBlockT;
  static constexpr int kScoreVecs = kScoreVecsT;
  static constexpr int kDimBlock = kDimBlockT;  // divides 8 (head_dim is a multiple of 8)
  static constexpr int kOutVecs = kOutVecsT;
  static constexpr bool kAsmBroadcast = kAsmBroadcastT;  // vbroadcastss from memory (AVX and up)
  static_assert(kVecs % kScoreVecs == 0 && kVecs % kOutVecs == 0 && 8 % kDimBlock == 0, "blocks tile the item");
  static_assert(kKeyBlock * kScoreVecs + kScoreVecs + 1 <= kRegistersT, "score block spills");
  static_assert(kDimBlock * kOutVecs + kOutVecs + 1 <= kRegistersT, "output block spills");
};
// AVX-512: 64 rows as 4 zmm (6-key and 4-dim register blocks) measured 10-25% faster than 32
// rows (8 x 2 blocks) or 48 on the benchmark's shape, and no slower with head_dim 128.
// AVX2: 6 keys x 2 row vectors (12 accumulators, 8 loads per 12 FMAs) and 4 dims x 2 row
// vectors. On an AMD EPYC (one thread, CPU time) 4x2 and 3x4 score blocks and a 2x4 output
// block were within run-to-run noise of these; 5x2 scores and 4x4 outputs (21 registers)
// were 10-20% slower.
// Generic (SSE2 on x86-64, NEON on Arm; 16 registers assumed): 4x2 blocks of 4 lanes.
using Avx512 = Isa<16, 32, 6, 4, 4, 4, true>;
using Avx2 = Isa<8, 16, 6, 2, 4, 2, true>;
using Generic = Isa<4, 16, 4, 2, 4, 2, false>;

// GCC 12 turns this into an add of +0.0 and a register broadcast (element lists and
// shuffles came out worse: per-lane masked broadcasts, twice as slow).
template <class V>
LMI_INLINE V splat(float x) { return V{} + x; }

// A float from memory in every lane. With AVX this is one vbroadcastss from memory, a
// load-port instruction: splat's add and register broadcast took two slots of the two FMA
// ports per broadcast (6 per 24 FMAs in the score block, 4 per 16 in the output block), and
// dropping them made the AVX-512 kernel 11-21% faster (one-off side-by-side build). The pointer
// goes in as a register, not an "m" operand: with one, GCC 12 stored all 24 accumulators to the
// stack on every iteration. The asm reads K/V, which nothing writes while the kernel runs.
template <class T>
LMI_INLINE typename T::vf broadcast(const float* p) {
  typedef typename T::vf vf;
  if constexpr (T::kAsmBroadcast) {
    vf out;
    asm("vbroadcastss (%1), %0" : "=v"(out) : "r"(p));
    return out;
  } else {
    return splat<vf>(*p);
  }
}
template <class V>
LMI_INLINE V vmax(V a, V b) { return a > b ? a : b; }

// exp(x) for x <= 0 (scores minus their running max), exactly 0 below -87
// (masked keys are -inf). Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a
// degree-5 polynomial for e^r, 2^n through the exponent bits.
template <class T>
LMI_INLINE typename T::vf exp_nonpositive(typename T::vf x) {
  typedef typename T::vf vf;
  typedef typename T::vi vi;
  const vi dead = x < splat<vf>(-87.0f);
  x = dead ? splat<vf>(-87.0f) : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat<vf>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return dead ? splat<vf>(0.0f) : p * two_n;
}

}  // namespace simd
}  // namespace lmi_cache
