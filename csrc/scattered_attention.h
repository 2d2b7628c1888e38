// Causal attention of scattered query tokens over a prompt's keys (CPU).
//
// Blending recomputes a few tokens spread through a long prompt. Each one
// attends to every key at a position <= its own. Run one query at a time, a
// kernel streams the whole prompt's K/V once per query for a handful of
// heads (memory-bound); here queries are taken in groups of consecutive
// (sorted) positions so one pass over a key tile serves every query row of a
// group, as in a dense flash-attention kernel: GEMM-shaped work from L1.
//
// No torch headers here: bindings.cpp validates the tensors and calls in.
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

namespace lmi_cache {

// Keys laid end to end from position 0: segment s holds positions
// [first_position, first_position + count). Rows are tokens; within a row,
// kv head h's head_dim floats start at h * head_dim.
struct KeySegment {
  const float* k;
  const float* v;
  int64_t k_row_stride;  // floats from one token's row to the next
  int64_t v_row_stride;
  int64_t first_position;
  int64_t count;
};

// A query's position is only its causal limit (RoPE is already in q): it attends to the keys at
// positions <= it. Equal positions are allowed, so a group of queries can share one limit, e.g.
// the last token before their own segment (attention to what precedes the segment).
struct ScatteredAttentionArgs {
  const float* q;          // [num_queries, num_heads, head_dim], contiguous
  const int64_t* positions;  // [num_queries], ascending (ties allowed), each < the keys' end
  float* out;              // [num_queries, num_heads, head_dim], contiguous
  float* lse;              // [num_queries, num_heads] log-sum-exp of the scaled scores, or nullptr
  int64_t num_queries;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;        // a multiple of 8, at most kMaxHeadDim
  float scale;
  const KeySegment* segments;
  int64_t num_segments;
};

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kRowsPerItem = 64;  // query rows (queries x heads of one kv head) per work item

// Why the kernel cannot take this shape (one line), or nullptr: heads a multiple of kv heads, at
// most kRowsPerItem per kv head; head_dim a multiple of 8, at most kMaxHeadDim.
const char* scattered_attention_shape_problem(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);

// Runs on ATen's intra-op threads with the code compiled for `isa` (one of
// scattered_attention_isas(); empty: the widest). False if this CPU lacks it.
bool scattered_attention_cpu(const ScatteredAttentionArgs& args, const std::string& isa);

// The vector ISAs this CPU runs, widest first: "avx512", "avx2", "generic".
std::vector<std::string> scattered_attention_isas();

}  // namespace lmi_cache
