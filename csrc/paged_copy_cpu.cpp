// CPU paged gather/scatter: every (table row, layer, run) is one memcpy,
// spread over ATen's intra-op thread pool in pieces of about kGrainBytes.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "paged_copy.h"

namespace lmi_cache {

namespace {
// Below this many bytes per task, thread hand-off costs more than it saves.
constexpr int64_t kGrainBytes = 64 * 1024;
}  // namespace

void paged_copy_cpu(const PagedCopyArgs& a) {
  const int64_t num_items = a.num_entries * a.num_layers;
  const int64_t total_runs = num_items * a.num_runs;
  if (total_runs == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, a.run_bytes));
  at::parallel_for(0, total_runs, grain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    while (i < end) {
      const int64_t item = i / a.num_runs;
      // Layer-major order: consecutive rows of one layer fill a chunk's layer slab front to back.
      const int64_t layer = item / a.num_entries;
      const int64_t* row = a.table + 3 * (item - layer * a.num_entries);
      char* paged = a.layer_ptrs[layer] + row[2] * a.block_stride_bytes;
      char* chunk = a.chunk_ptrs[row[0]] + (layer * a.blocks_per_chunk + row[1]) * block_bytes(a);
      // Runs of one item are consecutive in i: walk them without re-deriving the addresses.
      const int64_t item_end = std::min(end, (item + 1) * a.num_runs);
      for (int64_t r = i - item * a.num_runs; i < item_end; ++i, ++r) {
        char* p = paged + a.run_offsets[r];
        char* c = chunk + r * a.run_bytes;
        if (a.to_paged) {
          std::memcpy(p, c, static_cast<size_t>(a.run_bytes));
        } else {
          std::memcpy(c, p, static_cast<size_t>(a.run_bytes));
        }
      }
    }
  });
}

}  // namespace lmi_cache
