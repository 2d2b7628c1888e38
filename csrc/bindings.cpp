// Torch binding of the paged gather/scatter ops (module lmi_cache_kernels).
//
// Validates tensors and the block table (shapes, dtypes, devices, bounds,
// duplicate destinations) so a bad call raises instead of corrupting memory,
// derives the run plan of one paged block from its strides, and dispatches
// to the CPU implementation or, when built with LMI_CACHE_WITH_CUDA, to the
// CUDA kernel on the current stream. The *_emulated ops run the CUDA kernel's
// per-thread body on the host so CPU-only CI checks its index arithmetic.
//
// Only the headers this file uses, not <torch/extension.h> (all of libtorch's C++ API): that halves the
// first-use compile (about 34 s -> 15 s of one core at -O3 for this file).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor type casters

#include <cstring>
#include <vector>

#ifdef LMI_CACHE_WITH_CUDA
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "paged_copy.h"
#include "rotate_pairs.h"
#include "scattered_attention.h"

namespace lmi_cache {
namespace {

struct Plan {
  PagedCopyArgs args{};
  at::Tensor table;
  std::vector<char*> layer_ptrs;
  std::vector<char*> chunk_ptrs;
  std::vector<int64_t> run_offsets;
};

// Contiguous runs of one block of `layer` (block dim 0 removed), in logical order.
void plan_runs(const at::Tensor& layer, Plan& plan) {
  const int64_t elem = layer.element_size();
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 1; d < layer.dim(); ++d) {
    if (layer.size(d) == 1) continue;  // its stride is meaningless
    TORCH_CHECK(layer.stride(d) != 0, "paged copy: KV layer has a broadcast (stride 0) dimension ", d);
    sizes.push_back(layer.size(d));
    strides.push_back(layer.stride(d));
  }
  int64_t run_elems = 1;
  int64_t outer = static_cast<int64_t>(sizes.size());
  while (outer > 0 && strides[outer - 1] == run_elems) {
    run_elems *= sizes[outer - 1];
    --outer;
  }
  plan.run_offsets.assign(1, 0);
  for (int64_t d = 0; d < outer; ++d) {  // row-major expansion of the outer dims
    std::vector<int64_t> next;
    next.reserve(plan.run_offsets.size() * sizes[d]);
    for (int64_t base : plan.run_offsets)
      for (int64_t i = 0; i < sizes[d]; ++i) next.push_back(base + i * strides[d] * elem);
    plan.run_offsets.swap(next);
  }
  plan.args.run_bytes = run_elems * elem;
  plan.args.num_runs = static_cast<int64_t>(plan.run_offsets.size());
  TORCH_CHECK(plan.args.run_bytes * plan.args.num_runs < (int64_t{1} << 31),
              "paged copy: one block of one layer must be smaller than 2 GiB");
  bool aligned = plan.args.run_bytes % 16 == 0 && plan.args.block_stride_bytes % 16 == 0;
  for (int64_t off : plan.run_offsets) aligned = aligned && off % 16 == 0;
  plan.args.runs_aligned16 = aligned ? 1 : 0;
}

Plan make_plan(const std::vector<at::Tensor>& layers, const at::Tensor& table, const std::vector<at::Tensor>& chunks,
               bool to_paged) {
  TORCH_CHECK(!layers.empty(), "paged copy: no KV layers given");
  TORCH_CHECK(!chunks.empty(), "paged copy: no chunk buffers given");
  const at::Tensor& first = layers[0];
  TORCH_CHECK(first.dim() >= 2, "paged copy: a KV layer view needs a block dimension and a block shape");
  TORCH_CHECK(first.numel() > 0, "paged copy: empty KV layer");
  for (const auto& layer : layers) {
    TORCH_CHECK(layer.scalar_type() == first.scalar_type() && layer.device() == first.device() &&
                    layer.sizes() == first.sizes() && layer.strides() == first.strides(),
                "paged copy: all KV layers must share dtype, device, shape and strides");
  }
  std::vector<int64_t> chunk_shape{static_cast<int64_t>(layers.size()), chunks[0].dim() >= 2 ? chunks[0].size(1) : 0};
  for (int64_t d = 1; d < first.dim(); ++d) chunk_shape.push_back(first.size(d));
  for (const auto& chunk : chunks) {
    TORCH_CHECK(chunk.scalar_type() == first.scalar_type() && chunk.device() == first.device(),
                "paged copy: chunk buffers must have the KV layers' dtype and device");
    TORCH_CHECK(chunk.is_contiguous(), "paged copy: chunk buffers must be contiguous");
    TORCH_CHECK(chunk.sizes() == at::IntArrayRef(chunk_shape), "paged copy: chunk buffer shape ", chunk.sizes(),
                " is not ", at::IntArrayRef(chunk_shape));
  }
  TORCH_CHECK(table.scalar_type() == at::kLong && table.device().is_cpu() && table.dim() == 2 && table.size(1) == 3,
              "paged copy: the table must be a CPU int64 tensor of shape [n, 3]");
  Plan plan;
  plan.table = table.contiguous();
  const int64_t num_blocks = first.size(0);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int64_t blocks_per_chunk = chunk_shape[1];
  const int64_t* rows = plan.table.data_ptr<int64_t>();
  const int64_t num_entries = plan.table.size(0);
  // A destination written twice would race between threads: refuse it (callers keep the last).
  std::vector<char> written(to_paged ? num_blocks : num_chunks * blocks_per_chunk, 0);
  for (int64_t e = 0; e < num_entries; ++e) {
    const int64_t c = rows[3 * e], s = rows[3 * e + 1], b = rows[3 * e + 2];
    TORCH_CHECK(c >= 0 && c < num_chunks, "paged copy: table row ", e, ": chunk index ", c, " out of range");
    TORCH_CHECK(s >= 0 && s < blocks_per_chunk, "paged copy: table row ", e, ": slot ", s, " out of range");
    TORCH_CHECK(b >= 0 && b < num_blocks, "paged copy: table row ", e, ": block id ", b, " out of range");
    char& mark = written[to_paged ? b : c * blocks_per_chunk + s];
    TORCH_CHECK(!mark, "paged copy: table row ", e, " writes a destination an earlier row writes");
    mark = 1;
  }
  for (const auto& layer : layers) plan.layer_ptrs.push_back(static_cast<char*>(layer.data_ptr()));
  for (const auto& chunk : chunks) plan.chunk_ptrs.push_back(static_cast<char*>(chunk.data_ptr()));
  plan.args.num_entries = num_entries;
  plan.args.num_layers = static_cast<int64_t>(layers.size());
  plan.args.blocks_per_chunk = blocks_per_chunk;
  plan.args.block_stride_bytes = first.stride(0) * first.element_size();
  plan.args.to_paged = to_paged ? 1 : 0;
  plan_runs(first, plan);
  plan.args.table = rows;
  plan.args.layer_ptrs = plan.layer_ptrs.data();
  plan.args.chunk_ptrs = plan.chunk_ptrs.data();
  plan.args.run_offsets = plan.run_offsets.data();
  return plan;
}

#ifdef LMI_CACHE_WITH_CUDA
void run_cuda(Plan& plan, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n_table = 3 * plan.args.num_entries, n_layers = plan.args.num_layers;
  const int64_t n_chunks = static_cast<int64_t>(plan.chunk_ptrs.size()), n_runs = plan.args.num_runs;
  // One pinned host block -> one asynchronous copy; the caching host allocator keeps it alive until done.
  at::Tensor host = at::empty({n_table + n_layers + n_chunks + n_runs}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  std::memcpy(h, plan.table.data_ptr<int64_t>(), n_table * sizeof(int64_t));
  for (int64_t i = 0; i < n_layers; ++i) h[n_table + i] = reinterpret_cast<int64_t>(plan.layer_ptrs[i]);
  for (int64_t i = 0; i < n_chunks; ++i) h[n_table + n_layers + i] = reinterpret_cast<int64_t>(plan.chunk_ptrs[i]);
  std::memcpy(h + n_table + n_layers + n_chunks, plan.run_offsets.data(), n_runs * sizeof(int64_t));
  at::Tensor dev = host.to(device, /*non_blocking=*/true);
  int64_t* d = dev.data_ptr<int64_t>();
  PagedCopyArgs args = plan.args;
  args.table = d;
  args.layer_ptrs = reinterpret_cast<char* const*>(d + n_table);
  args.chunk_ptrs = reinterpret_cast<char* const*>(d + n_table + n_layers);
  args.run_offsets = d + n_table + n_layers + n_chunks;
  const int err = paged_copy_cuda(args, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == 0, "paged copy: CUDA kernel launch failed: ", paged_copy_cuda_error(err));
}
#endif

void run(const std::vector<at::Tensor>& layers, const at::Tensor& table, const std::vector<at::Tensor>& chunks,
         bool to_paged) {
  Plan plan = make_plan(layers, table, chunks, to_paged);
  if (plan.args.num_entries == 0) return;
  const at::Device device = layers[0].device();
  if (device.is_cpu()) {
    paged_copy_cpu(plan.args);
    return;
  }
#ifdef LMI_CACHE_WITH_CUDA
  if (device.is_cuda()) {
    run_cuda(plan, device);
    return;
  }
#endif
  TORCH_CHECK(false, "paged copy: no native kernel for device ", device, " in this build");
}

// The CUDA kernel's thread body, run sequentially on the host (CPU tensors only).
void run_emulated(const std::vector<at::Tensor>& layers, const at::Tensor& table,
                  const std::vector<at::Tensor>& chunks, bool to_paged, int64_t num_threads) {
  TORCH_CHECK(layers.empty() || layers[0].device().is_cpu(), "emulated paged copy runs on CPU tensors only");
  TORCH_CHECK(num_threads >= 1, "emulated paged copy: num_threads must be >= 1");
  Plan plan = make_plan(layers, table, chunks, to_paged);
  const int64_t num_items = plan.args.num_entries * plan.args.num_layers;
  for (int64_t item = 0; item < num_items; ++item)
    for (int64_t tid = 0; tid < num_threads; ++tid) lmi_copy_piece(plan.args, item, tid, num_threads);
}

// out = x * cos + rotate_half(x) * sin over [outer, tokens, heads, head_dim], angles per token.
void rotate_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  for (const at::Tensor* t : {&x, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4,
                "rotate pairs: x and out must be CPU float32 tensors [outer, tokens, heads, head_dim]");
    TORCH_CHECK(t->stride(3) == 1 && (t->size(2) == 1 || t->stride(2) == t->size(3)),
                "rotate pairs: each token's heads must be contiguous rows");
  }
  TORCH_CHECK(x.sizes() == out.sizes(), "rotate pairs: out must have x's shape");
  const int64_t dim = x.size(3), tokens = x.size(1);
  TORCH_CHECK(dim % 2 == 0, "rotate pairs: head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == tokens && t->size(1) == dim / 2,
                "rotate pairs: cos and sin must be contiguous CPU float32 [tokens, head_dim / 2]");
  if (x.numel() > 0 && x.data_ptr() != out.data_ptr()) {  // in place is fine; a partial overlap is not
    auto span = [](const at::Tensor& t) {
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
      const float* first = t.data_ptr<float>();
      return std::make_pair(first, first + last + 1);
    };
    const auto xs = span(x), os = span(out);
    TORCH_CHECK(xs.second <= os.first || os.second <= xs.first, "rotate pairs: out overlaps x");
  }
  RotatePairsArgs args{x.data_ptr<float>(), out.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       x.size(0), tokens, x.size(2), dim, x.stride(0), x.stride(1), out.stride(0), out.stride(1)};
  rotate_pairs_cpu(args);
}

// out[i] = causal attention of q[i] at positions[i] over the keys laid end to end from position 0;
// lse (optional, [queries, heads]) receives each row's log-sum-exp of the scaled scores.
at::Tensor scattered_attention(const at::Tensor& q, const at::Tensor& positions, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, double scale,
                               const std::string& isa, const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "scattered attention: q must be a contiguous CPU float32 tensor [queries, heads, head_dim]");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == q.size(0),
              "scattered attention: positions must be a contiguous CPU int64 tensor [queries]");
  TORCH_CHECK(keys.size() == values.size(), "scattered attention: one value tensor per key tensor");
  const int64_t num_heads = q.size(1), dim = q.size(2);
  std::vector<KeySegment> segments;
  int64_t num_kv_heads = -1, total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    for (const at::Tensor* t : {&k, &v}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3,
                  "scattered attention: keys and values must be CPU float32 tensors [tokens, kv_heads, head_dim]");
      TORCH_CHECK(t->size(2) == dim && t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == dim),
                  "scattered attention: each token's kv heads must be contiguous rows of head_dim floats");
    }
    TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1), "scattered attention: keys and values differ in shape");
    TORCH_CHECK(num_kv_heads < 0 || k.size(1) == num_kv_heads, "scattered attention: segments differ in kv heads");
    num_kv_heads = k.size(1);
    if (k.size(0) == 0) continue;
    segments.push_back({k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), v.stride(0), total, k.size(0)});
    total += k.size(0);
  }
  const char* problem = scattered_attention_shape_problem(num_heads, num_kv_heads, dim);
  TORCH_CHECK(problem == nullptr, "scattered attention: ", problem, " (", num_heads, " heads, ", num_kv_heads,
              " kv heads, head_dim ", dim, ")");
  TORCH_CHECK(total < (int64_t{1} << 31), "scattered attention: at most 2^31 keys");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.size(0); ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < total, "scattered attention: position ", pos[i], " outside the ", total, " keys");
    TORCH_CHECK(i == 0 || pos[i] >= pos[i - 1], "scattered attention: positions must be ascending");
  }
  float* lse_out = nullptr;
  if (lse.has_value()) {
    const at::Tensor& t = *lse;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
                    t.size(0) == q.size(0) && t.size(1) == num_heads,
                "scattered attention: lse must be a contiguous CPU float32 tensor [queries, heads]");
    lse_out = t.data_ptr<float>();
  }
  at::Tensor out = at::empty_like(q);
  ScatteredAttentionArgs args{q.data_ptr<float>(), pos, out.data_ptr<float>(), lse_out, q.size(0), num_heads,
                              num_kv_heads, dim, static_cast<float>(scale), segments.data(),
                              static_cast<int64_t>(segments.size())};
  TORCH_CHECK(scattered_attention_cpu(args, isa), "scattered attention: this CPU cannot run the '", isa, "' code");
  return out;
}

}  // namespace
}  // namespace lmi_cache

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using lmi_cache::run;
  using lmi_cache::run_emulated;
  m.doc() = "lmi-cache paged KV gather/scatter kernels";
  m.def("gather", [](const std::vector<at::Tensor>& layers, const at::Tensor& table,
                     const std::vector<at::Tensor>& chunks) { run(layers, table, chunks, false); },
        "chunks[c][layer, slot] = layers[layer][block] for each table row (c, slot, block)");
  m.def("scatter", [](const std::vector<at::Tensor>& layers, const at::Tensor& table,
                      const std::vector<at::Tensor>& chunks) { run(layers, table, chunks, true); },
        "layers[layer][block] = chunks[c][layer, slot] for each table row (c, slot, block)");
  m.def("gather_emulated", [](const std::vector<at::Tensor>& layers, const at::Tensor& table,
                              const std::vector<at::Tensor>& chunks, int64_t num_threads) {
    run_emulated(layers, table, chunks, false, num_threads);
  });
  m.def("scatter_emulated", [](const std::vector<at::Tensor>& layers, const at::Tensor& table,
                               const std::vector<at::Tensor>& chunks, int64_t num_threads) {
    run_emulated(layers, table, chunks, true, num_threads);
  });
  m.def("scattered_attention", &lmi_cache::scattered_attention,
        "causal attention of q [Tq, H, D] at ascending positions over keys/values [n_i, H_kv, D] laid end to end",
        py::arg("q"), py::arg("positions"), py::arg("keys"), py::arg("values"), py::arg("scale"), py::arg("isa") = "",
        py::arg("lse") = py::none());
  m.def("rotate_pairs", &lmi_cache::rotate_pairs,
        "out = x * cos + rotate_half(x) * sin for x [outer, tokens, heads, head_dim], cos/sin [tokens, head_dim / 2]");
  m.def("scattered_attention_supports", [](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    return lmi_cache::scattered_attention_shape_problem(num_heads, num_kv_heads, head_dim) == nullptr;
  }, "whether scattered_attention takes this head geometry");
  m.def("scattered_attention_isas", &lmi_cache::scattered_attention_isas,
        "vector ISAs of the scattered attention this CPU runs, widest first");
#ifdef LMI_CACHE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
