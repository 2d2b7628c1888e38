// Paged KV-cache <-> chunk-buffer copies: the plan both implementations share.
//
// Plain C++ (no torch, no CUDA headers) so that the CUDA kernel file compiles
// with nvcc alone and the CPU extension can run the device code path on the
// host (see lmi_copy_piece and the "emulated" ops in bindings.cpp).
//
// One copy moves whole KV blocks of every layer. The table has one row per
// (chunk slot <-> paged block) pair: {chunk index, slot in chunk, block id}.
// A chunk buffer is contiguous [num_layers, blocks_per_chunk, block bytes].
// A paged block of one layer need not be contiguous (flash-attention keeps K
// and V apart; HND by stride permutation scatters a block further), so it is
// described as num_runs contiguous runs of run_bytes at run_offsets[r] from
// the block's start; in the chunk buffer the runs follow each other.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define LMI_HD __host__ __device__ __forceinline__
#else
#define LMI_HD inline
#endif

namespace lmi_cache {

struct PagedCopyArgs {
  const int64_t* table;        // [num_entries, 3]: chunk index, slot, block id
  int64_t num_entries;
  char* const* layer_ptrs;     // [num_layers]: byte address of block 0 of each layer
  char* const* chunk_ptrs;     // [num_chunks]: contiguous chunk buffers
  const int64_t* run_offsets;  // [num_runs]: byte offset of each run inside a paged block
  int64_t num_layers;
  int64_t blocks_per_chunk;
  int64_t block_stride_bytes;  // distance between consecutive paged blocks of one layer
  int64_t run_bytes;
  int64_t num_runs;
  int to_paged;                // 0: gather (paged -> chunks), 1: scatter (chunks -> paged)
  int runs_aligned16;          // run_bytes, block_stride_bytes and every run offset are multiples of 16
};

LMI_HD int64_t block_bytes(const PagedCopyArgs& a) { return a.run_bytes * a.num_runs; }

// The paged and chunk addresses of one (table row, layer) pair: one "item".
LMI_HD void item_addresses(const PagedCopyArgs& a, int64_t item, char** paged, char** chunk) {
  const int64_t entry = item / a.num_layers;
  const int64_t layer = item - entry * a.num_layers;
  const int64_t* row = a.table + 3 * entry;
  *paged = a.layer_ptrs[layer] + row[2] * a.block_stride_bytes;
  *chunk = a.chunk_ptrs[row[0]] + (layer * a.blocks_per_chunk + row[1]) * block_bytes(a);
}

// 16-byte unit of the wide copy path (no CUDA vector types, so host code can use it).
struct alignas(16) Wide16 {
  uint64_t lo, hi;
};

LMI_HD void copy_unit(bool wide, char* dst, const char* src) {
  if (wide) {
    *reinterpret_cast<Wide16*>(dst) = *reinterpret_cast<const Wide16*>(src);
  } else {
    *dst = *src;
  }
}

// The work of thread `tid` of `num_threads` on one item: the body of the CUDA
// kernel, also run sequentially on the host by the emulated ops. Unit indices
// are 32-bit (the binding refuses blocks of 2 GiB or more): a GPU divides
// 64-bit integers slowly.
LMI_HD void lmi_copy_piece(const PagedCopyArgs& a, int64_t item, int64_t tid, int64_t num_threads) {
  char* paged;
  char* chunk;
  item_addresses(a, item, &paged, &chunk);
  const bool wide = a.runs_aligned16 && (reinterpret_cast<uintptr_t>(paged) % 16) == 0 &&
                    (reinterpret_cast<uintptr_t>(chunk) % 16) == 0;
  const uint32_t unit = wide ? 16u : 1u;
  const uint32_t units_per_run = static_cast<uint32_t>(a.run_bytes / unit);
  const uint32_t threads = static_cast<uint32_t>(num_threads);
  if (units_per_run >= threads) {
    // Long runs (whole blocks, K/V halves): every thread strides through each run in turn.
    for (int64_t r = 0; r < a.num_runs; ++r) {
      char* p = paged + a.run_offsets[r];
      char* c = chunk + r * a.run_bytes;
      char* dst = a.to_paged ? p : c;
      const char* src = a.to_paged ? c : p;
      uint32_t k = static_cast<uint32_t>(tid);
      if (wide) {
        // Four loads in flight per thread before their stores (the pointers may alias, so the
        // compiler would not reorder them itself).
        const Wide16* s16 = reinterpret_cast<const Wide16*>(src);
        Wide16* d16 = reinterpret_cast<Wide16*>(dst);
        for (; k + 3 * threads < units_per_run; k += 4 * threads) {
          const Wide16 v0 = s16[k], v1 = s16[k + threads], v2 = s16[k + 2 * threads], v3 = s16[k + 3 * threads];
          d16[k] = v0;
          d16[k + threads] = v1;
          d16[k + 2 * threads] = v2;
          d16[k + 3 * threads] = v3;
        }
      }
      for (; k < units_per_run; k += threads) copy_unit(wide, dst + k * unit, src + k * unit);
    }
    return;
  }
  // Short runs (HND by strides: one head's row per run): threads spread over all runs at once.
  const uint32_t total = units_per_run * static_cast<uint32_t>(a.num_runs);
  for (uint32_t u = static_cast<uint32_t>(tid); u < total; u += threads) {
    const uint32_t r = u / units_per_run;
    const uint32_t off = (u - r * units_per_run) * unit;
    char* p = paged + a.run_offsets[r] + off;
    char* c = chunk + static_cast<int64_t>(r) * a.run_bytes + off;
    copy_unit(wide, a.to_paged ? p : c, a.to_paged ? c : p);
  }
}

// Implemented in paged_copy_cpu.cpp: the CPU copy (parallel, one memcpy per run).
void paged_copy_cpu(const PagedCopyArgs& a);

}  // namespace lmi_cache

namespace lmi_cache {
// Implemented in paged_copy_cuda.cu (built only with CUDA): enqueue on a
// cudaStream_t, return a cudaError_t value; and its message.
int paged_copy_cuda(const PagedCopyArgs& a, void* stream);
const char* paged_copy_cuda_error(int code);
}  // namespace lmi_cache
