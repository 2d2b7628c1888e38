// RoPE-style rotation of (i, i + D/2) pairs in one pass (CPU, float32).
//
// Blending moves every layer's cached K of every reused segment to its new
// place: out = x * cos + rotate_half(x) * sin with per-token angles. In torch
// that is four full passes over [layers, tokens, heads, head_dim] (a sixth of
// a blend on the RAG benchmark); here each row is read once and written once.
#include <ATen/Parallel.h>

#include "rotate_pairs.h"

namespace lmi_cache {

void rotate_pairs_cpu(const RotatePairsArgs& a) {
  const int64_t rows = a.num_outer * a.num_tokens;
  const int64_t half = a.head_dim / 2;
  // A row is heads * head_dim floats: a few KiB, so hand out many per task.
  const int64_t grain = 64;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t outer = row / a.num_tokens, token = row % a.num_tokens;
      const float* x = a.x + outer * a.x_outer_stride + token * a.x_token_stride;
      float* out = a.out + outer * a.out_outer_stride + token * a.out_token_stride;
      const float* c = a.cos + token * half;
      const float* s = a.sin + token * half;
      for (int64_t h = 0; h < a.num_heads; ++h) {
        const float* xh = x + h * a.head_dim;
        float* oh = out + h * a.head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = xh[i], hi = xh[i + half];
          oh[i] = lo * c[i] - hi * s[i];
          oh[i + half] = hi * c[i] + lo * s[i];
        }
      }
    }
  });
}

}  // namespace lmi_cache
