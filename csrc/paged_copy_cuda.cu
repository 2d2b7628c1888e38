// CUDA paged gather/scatter: one thread block per (table row, layer) item,
// its threads striding over the block's bytes in 16-byte units when aligned.
//
// Written against raw pointers and the CUDA runtime only (no torch headers),
// so `nvcc -c paged_copy_cuda.cu` checks it on any machine with a toolkit;
// bindings.cpp is the thin torch layer that launches it. All pointers in
// PagedCopyArgs (table, layer/chunk pointer arrays, run offsets) must be
// device-accessible; the body of each thread is lmi_copy_piece (paged_copy.h).
#include <cuda_runtime.h>

#include "paged_copy.h"

namespace lmi_cache {

namespace {
constexpr int kThreadsPerItem = 256;
// Grid-stride beyond this many thread blocks (far more than any GPU runs at once).
constexpr int64_t kMaxGrid = 1 << 20;

__global__ void __launch_bounds__(kThreadsPerItem) paged_copy_kernel(PagedCopyArgs a, int64_t num_items) {
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    lmi_copy_piece(a, item, threadIdx.x, blockDim.x);
  }
}
}  // namespace

// Enqueues the copy on `stream` (a cudaStream_t); returns a cudaError_t value.
int paged_copy_cuda(const PagedCopyArgs& a, void* stream) {
  const int64_t num_items = a.num_entries * a.num_layers;
  if (num_items == 0) return static_cast<int>(cudaSuccess);
  const int64_t grid = num_items < kMaxGrid ? num_items : kMaxGrid;
  paged_copy_kernel<<<static_cast<unsigned>(grid), kThreadsPerItem, 0, static_cast<cudaStream_t>(stream)>>>(
      a, num_items);
  return static_cast<int>(cudaGetLastError());
}

const char* paged_copy_cuda_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace lmi_cache
