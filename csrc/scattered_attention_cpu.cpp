// Scattered-query causal attention on CPU: see scattered_attention.h.
//
// One work item is (kv head, group of queries consecutive in sorted order)
// with at most kRowsPerItem query rows (query x head of that kv head), held
// as the lanes of a few vectors (4 of 16 floats with AVX-512, 8 of 8 with
// AVX2). Every array the inner loops touch is laid out [something][row], so
// K and V elements are only ever broadcast and the online softmax (max, exp,
// sum, rescale) is element-wise over rows:
//   S^T[key][row] = sum_d K[key][d] * Q^T[d][row]
//   O^T[d][row]   = O^T[d][row] * alpha[row] + sum_key V[key][d] * P^T[key][row]
// Keys past a group's first query position are masked per row (position
// rule), so a group costs its last query's key count; with queries at 15%
// density a group of 32 wastes about 2% on masked keys. Each row's sums run
// in the same order whatever the grouping, so results do not depend on it.
//
// Each ISA has its own register blocking (``Isa`` in scattered_attention_simd.h):
// the accumulators of one block, the row vectors it reads and a broadcast K/V
// element must fit the register file, or every FMA spills to the stack. AVX2
// has 16 registers of 8 floats; running AVX-512's 64-row block there (96
// registers' worth of accumulators) made that variant 8x slower than vLLM's
// own CPU attention.
//
// The keys are first copied one kv head after another (``pack_keys``), and the
// items go kv head by kv head, so both threads stream the same head's keys.
//
// The vector code uses GCC/Clang vector extensions and is compiled three
// times by function target attributes (AVX-512, AVX2+FMA, the build's
// baseline); the dispatcher picks one with __builtin_cpu_supports, so the
// library runs on any x86-64 and needs no -march flag (the build cache is
// shared by machines of one architecture name).
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "scattered_attention.h"
#include "scattered_attention_simd.h"

namespace lmi_cache {
namespace {

using simd::Avx2;
using simd::Avx512;
using simd::broadcast;
using simd::exp_nonpositive;
using simd::Generic;
using simd::splat;
using simd::vmax;

constexpr int kTile = 64;  // keys per online-softmax step

LMI_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct Item {
  int64_t kv_head;
  int64_t first_query;
  int64_t end_query;
};

// Every ISA's arrays are the same bytes: [something][64 rows] of floats.
template <class T>
struct alignas(64) Scratch {
  typename T::vf qt[kMaxHeadDim][T::kVecs];  // Q^T, pre-scaled
  typename T::vf ot[kMaxHeadDim][T::kVecs];  // O^T, unnormalised
  typename T::vf st[kTile][T::kVecs];        // S^T, then P^T, of one key tile
};

// Keys the way attend_item reads them: kv head h's keys start h * head_stride floats in, each
// key one row of head_dim floats (``pack_keys``).
struct HeadMajorKeys {
  const float* k;
  const float* v;
  int64_t head_stride;
};

// S^T[key][row] for the tile's n keys at kbase, row vectors [0, vecs) (a multiple of
// kScoreVecs). Row blocks go outermost, so a block's Q^T columns stay in L1 over the tile.
template <class T>
LMI_INLINE void tile_scores(const float* kbase, int64_t n, int64_t dim, int vecs, Scratch<T>& s) {
  typedef typename T::vf vf;
  constexpr int kKeys = T::kKeyBlock, kRowVecs = T::kScoreVecs;
  for (int v0 = 0; v0 < vecs; v0 += kRowVecs) {
    for (int64_t jb = 0; jb < n; jb += kKeys) {
      const int64_t nb = min64(kKeys, n - jb);
      vf acc[kKeys][kRowVecs] = {};
      const float* krow[kKeys];
      for (int b = 0; b < kKeys; ++b) krow[b] = kbase + (jb + (b < nb ? b : 0)) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        vf qv[kRowVecs];
        for (int v = 0; v < kRowVecs; ++v) qv[v] = s.qt[d][v0 + v];
        for (int b = 0; b < kKeys; ++b) {
          const vf kb = broadcast<T>(krow[b] + d);
          for (int v = 0; v < kRowVecs; ++v) acc[b][v] += kb * qv[v];
        }
      }
      for (int64_t b = 0; b < nb; ++b)
        for (int v = 0; v < kRowVecs; ++v) s.st[jb + b][v0 + v] = acc[b][v];
    }
  }
}

// O^T[d][row] = O^T[d][row] * alpha[row] + sum over the tile's n keys of V[key][d] * P^T[key][row].
template <class T>
LMI_INLINE void tile_output(const float* vbase, int64_t n, int64_t dim, int vecs, const typename T::vf* alpha,
                            Scratch<T>& s) {
  typedef typename T::vf vf;
  constexpr int kDims = T::kDimBlock, kRowVecs = T::kOutVecs;
  for (int v0 = 0; v0 < vecs; v0 += kRowVecs) {
    for (int64_t d0 = 0; d0 < dim; d0 += kDims) {
      vf acc[kDims][kRowVecs];
      for (int b = 0; b < kDims; ++b)
        for (int v = 0; v < kRowVecs; ++v) acc[b][v] = s.ot[d0 + b][v0 + v] * alpha[v0 + v];
      for (int64_t j = 0; j < n; ++j) {
        vf pv[kRowVecs];
        for (int v = 0; v < kRowVecs; ++v) pv[v] = s.st[j][v0 + v];
        const float* vrow = vbase + j * dim + d0;
        for (int b = 0; b < kDims; ++b) {
          const vf vb = broadcast<T>(vrow + b);
          for (int v = 0; v < kRowVecs; ++v) acc[b][v] += vb * pv[v];
        }
      }
      for (int b = 0; b < kDims; ++b)
        for (int v = 0; v < kRowVecs; ++v) s.ot[d0 + b][v0 + v] = acc[b][v];
    }
  }
}

template <class T>
LMI_INLINE void attend_item(const ScatteredAttentionArgs& a, const HeadMajorKeys& keys, const Item& item,
                            Scratch<T>& s) {
  typedef typename T::vf vf;
  typedef typename T::vi vi;
  constexpr int kLanes = T::kLanes, kVecs = T::kVecs;
  constexpr int64_t kRows = kRowsPerItem;
  const int64_t dim = a.head_dim;
  const int64_t per_kv = a.num_heads / a.num_kv_heads;
  const int64_t rows = (item.end_query - item.first_query) * per_kv;
  // Row vectors holding real rows, rounded up to whole score and output blocks (a short last
  // group skips the vectors of padding only).
  constexpr int kBlock = T::kScoreVecs > T::kOutVecs ? T::kScoreVecs : T::kOutVecs;
  const int vecs = static_cast<int>(min64(kVecs, (rows + kBlock * kLanes - 1) / (kBlock * kLanes) * kBlock));
  const int64_t last_position = a.positions[item.end_query - 1];
  const int64_t first_position = a.positions[item.first_query];
  int32_t row_position[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    // Padding rows copy the group's last row: finite, and never written out.
    const int64_t query = item.first_query + (r < rows ? r / per_kv : (rows - 1) / per_kv);
    const int64_t head = item.kv_head * per_kv + (r < rows ? r % per_kv : (rows - 1) % per_kv);
    const float* qrow = a.q + (query * a.num_heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) s.qt[d][r / kLanes][r % kLanes] = qrow[d] * a.scale;
    row_position[r] = static_cast<int32_t>(a.positions[query]);
  }
  vi row_pos[kVecs];
  std::memcpy(row_pos, row_position, sizeof(row_pos));
  vf m[kVecs], l[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    m[v] = splat<vf>(-__builtin_inff());
    l[v] = splat<vf>(0.0f);
  }
  std::memset(s.ot, 0, sizeof(vf) * kVecs * dim);

  const int64_t num_keys = last_position + 1;
  const float* khead = keys.k + item.kv_head * keys.head_stride;
  const float* vhead = keys.v + item.kv_head * keys.head_stride;
  for (int64_t j0 = 0; j0 < num_keys; j0 += kTile) {
    const int64_t n = min64(kTile, num_keys - j0);
    tile_scores<T>(khead + j0 * dim, n, dim, vecs, s);
    if (j0 + n - 1 > first_position) {  // some rows may not see the tile's later keys
      for (int64_t j = 0; j < n; ++j) {
        const vi key_pos = vi{} + static_cast<int32_t>(j0 + j);
        for (int v = 0; v < vecs; ++v)
          s.st[j][v] = key_pos <= row_pos[v] ? s.st[j][v] : splat<vf>(-__builtin_inff());
      }
    }
    // Online softmax over the tile.
    vf alpha[kVecs];
    for (int v = 0; v < vecs; ++v) {
      vf tile_max = s.st[0][v];
      for (int64_t j = 1; j < n; ++j) tile_max = vmax(tile_max, s.st[j][v]);
      const vf m_new = vmax(m[v], tile_max);  // finite: key 0 is in the first tile and every row sees it
      alpha[v] = exp_nonpositive<T>(m[v] - m_new);
      vf sum = splat<vf>(0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const vf p = exp_nonpositive<T>(s.st[j][v] - m_new);
        s.st[j][v] = p;
        sum += p;
      }
      l[v] = l[v] * alpha[v] + sum;
      m[v] = m_new;
    }
    tile_output<T>(vhead + j0 * dim, n, dim, vecs, alpha, s);
  }
  float inv[kRows], row_max[kRows], row_sum[kRows];
  for (int v = 0; v < vecs; ++v) {
    const vf iv = splat<vf>(1.0f) / l[v];
    std::memcpy(inv + v * kLanes, &iv, sizeof(iv));
    std::memcpy(row_max + v * kLanes, &m[v], sizeof(vf));
    std::memcpy(row_sum + v * kLanes, &l[v], sizeof(vf));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t query = item.first_query + r / per_kv;
    const int64_t head = item.kv_head * per_kv + r % per_kv;
    float* orow = a.out + (query * a.num_heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] = s.ot[d][r / kLanes][r % kLanes] * inv[r];
    // The scores were scaled with q, so this is log sum_key exp(scale * q.k).
    if (a.lse != nullptr) a.lse[query * a.num_heads + head] = row_max[r] + std::log(row_sum[r]);
  }
}

// One worker's loop: take the next item until none is left.
template <class T>
LMI_INLINE void work(const ScatteredAttentionArgs& a, const HeadMajorKeys& keys, const Item* items,
                     int64_t num_items, std::atomic<int64_t>& next) {
  std::unique_ptr<Scratch<T>> scratch(new Scratch<T>);
  for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
    attend_item<T>(a, keys, items[i], *scratch);
}

using WorkFn = void (*)(const ScatteredAttentionArgs&, const HeadMajorKeys&, const Item*, int64_t,
                        std::atomic<int64_t>&);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,fma,avx2")))
void work_avx512(const ScatteredAttentionArgs& a, const HeadMajorKeys& keys, const Item* items, int64_t n,
                 std::atomic<int64_t>& next) {
  work<Avx512>(a, keys, items, n, next);
}
__attribute__((target("avx2,fma")))
void work_avx2(const ScatteredAttentionArgs& a, const HeadMajorKeys& keys, const Item* items, int64_t n,
               std::atomic<int64_t>& next) {
  work<Avx2>(a, keys, items, n, next);
}
#endif
void work_generic(const ScatteredAttentionArgs& a, const HeadMajorKeys& keys, const Item* items, int64_t n,
                  std::atomic<int64_t>& next) {
  work<Generic>(a, keys, items, n, next);
}

struct Variant {
  WorkFn fn;
  const char* isa;
};

// Widest first; every build has "generic".
std::vector<Variant> supported_variants() {
  std::vector<Variant> out;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    out.push_back({work_avx512, "avx512"});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({work_avx2, "avx2"});
#endif
  out.push_back({work_generic, "generic"});
  return out;
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> found = supported_variants();
  return found;
}

}  // namespace

static_assert(kRowsPerItem == 64 && kMaxHeadDim == 256, "scattered_attention_shape_problem's lines name these");

const char* scattered_attention_shape_problem(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kRowsPerItem)
    return "heads must be a multiple of kv heads, at most 64 per kv head";
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim)
    return "head_dim must be a multiple of 8 up to 256";
  return nullptr;
}

std::vector<std::string> scattered_attention_isas() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.emplace_back(v.isa);
  return names;
}

namespace {

// Each kv head's K and V, one after the other, of keys [0, num_keys): [kv head][key][head_dim].
// In vLLM's [token, kv head, head_dim] rows a work item (one kv head) reads head_dim floats
// every num_kv_heads * head_dim: with 8 heads of 128 that is one 4 KiB page per key, so a tile
// of 64 keys touches 128 pages (the first-level TLB holds about 64) and no hardware prefetcher
// follows it across pages. Copied once per call (a memory-speed pass) and taken head by
// head, a Llama-3-8B-like layer ran about 1.5x faster and the 32M test model's 4 x 64 layout
// about 10% (one-off side-by-side builds; bench_blend_attention.py gives today's figures).
struct PackedKeys {
  std::unique_ptr<float[]> data;  // empty when the input already was head-major
  HeadMajorKeys keys;
};

PackedKeys pack_keys(const ScatteredAttentionArgs& a, int64_t num_keys) {
  const int64_t dim = a.head_dim, heads = a.num_kv_heads;
  if (a.num_segments == 1 && heads == 1 && a.segments[0].k_row_stride == dim && a.segments[0].v_row_stride == dim)
    return {nullptr, {a.segments[0].k, a.segments[0].v, 0}};  // one head's rows back to back already
  const int64_t head_block = num_keys * dim;
  PackedKeys packed{std::unique_ptr<float[]>(new float[2 * heads * head_block]), {}};
  float* k_out = packed.data.get();
  float* v_out = k_out + heads * head_block;
  for (int64_t s = 0; s < a.num_segments; ++s) {
    const KeySegment& seg = a.segments[s];
    const int64_t end = min64(seg.first_position + seg.count, num_keys);
    if (end <= seg.first_position) continue;
    at::parallel_for(seg.first_position, end, 256, [&](int64_t begin, int64_t stop) {
      for (int64_t p = begin; p < stop; ++p) {
        const float* k_row = seg.k + (p - seg.first_position) * seg.k_row_stride;
        const float* v_row = seg.v + (p - seg.first_position) * seg.v_row_stride;
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(k_out + h * head_block + p * dim, k_row + h * dim, sizeof(float) * dim);
          std::memcpy(v_out + h * head_block + p * dim, v_row + h * dim, sizeof(float) * dim);
        }
      }
    });
  }
  packed.keys = {k_out, v_out, head_block};
  return packed;
}

}  // namespace

bool scattered_attention_cpu(const ScatteredAttentionArgs& a, const std::string& isa) {
  WorkFn fn = nullptr;
  for (const Variant& v : variants())
    if (isa.empty() || isa == v.isa) {
      fn = v.fn;
      break;
    }
  if (fn == nullptr) return false;
  if (a.num_queries == 0) return true;
  const PackedKeys packed = pack_keys(a, a.positions[a.num_queries - 1] + 1);  // ascending: the last is the largest
  const int64_t per_kv = a.num_heads / a.num_kv_heads;
  const int64_t group = kRowsPerItem / per_kv;  // queries per item
  std::vector<Item> items;
  const int64_t groups = (a.num_queries + group - 1) / group;
  items.reserve(static_cast<size_t>(groups * a.num_kv_heads));
  // Kv head by kv head (the threads share one head's keys in cache), and in each the latest
  // groups (most keys) first, so the dynamic hand-out ends with short items.
  for (int64_t h = 0; h < a.num_kv_heads; ++h)
    for (int64_t g = groups - 1; g >= 0; --g)
      items.push_back({h, g * group, min64((g + 1) * group, a.num_queries)});
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = min64(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) fn(a, packed.keys, items.data(), num_items, next);
  });
  return true;
}

}  // namespace lmi_cache
