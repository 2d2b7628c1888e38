// One-pass rotation of (i, i + D/2) pairs by per-token angles (see rotate_pairs_cpu.cpp).
#pragma once

#include <stdint.h>

namespace lmi_cache {

// x and out: [num_outer, num_tokens, num_heads, head_dim] float32 whose (heads, head_dim)
// rows are contiguous; the outer and token strides are free (views). cos/sin: contiguous
// [num_tokens, head_dim / 2]. out may not overlap x unless it is x itself.
struct RotatePairsArgs {
  const float* x;
  float* out;
  const float* cos;
  const float* sin;
  int64_t num_outer, num_tokens, num_heads, head_dim;
  int64_t x_outer_stride, x_token_stride, out_outer_stride, out_token_stride;
};

void rotate_pairs_cpu(const RotatePairsArgs& args);

}  // namespace lmi_cache
