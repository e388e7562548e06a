// Attention over cells on the CPU: the op `cellbatch::cell_attention`.
//
// Owns: one fused pass per query block (gather K/V rows by cell, scores, softmax, weighted
// values) for every query of a packed step, in place of the gather-then-GEMM path.
// Promises: a query's output depends only on its own query vector and the K/V of its own
// visible cells, computed in a fixed order (so it is bit-identical whatever else shares the
// step or its block); keys outside [pos - window + 1, pos] are never read; numerics follow
// transformers' eager attention in the compute dtype T: score = T(T(q.k) * scale), softmax in
// float32, probabilities rounded to T, values summed in float32 and rounded to T. K/V stored
// in another dtype are first rounded to T, as `.to(T)` would.
// Never: allocates per key, reads the scratch cell, or touches rows that no query names.
//
// Layout: q [tokens, heads, head_dim] (rows may be strided); k_cache/v_cache [cells, kv_heads, head_dim];
// out [tokens, heads * head_dim]. Query i (in block order) is token rows[i] at position
// pos[i]; its sequence's cells, in position order, start at cells[cell_offsets[i]].
// block_starts splits the queries into blocks of one sequence each.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using cellbatch::kLanes;
using cellbatch::round_to;
using cellbatch::Vec;
using cellbatch::widen;
constexpr int64_t kKeyTile = 32;  // K/V rows widened to float at a time: 24 KiB at 3x64, in L1
constexpr int64_t kPrefetchRows = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline void round_all(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<T>(x[i]);
  }
}

// A cache row as compute dtype T would hold it, widened to float.
template <typename T, typename C>
inline void load_row(const C* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
  if constexpr (!std::is_same_v<T, C> && !std::is_same_v<T, float>) round_all<T>(dst, n);
}

// Asks for the cache lines of a row that will be read soon: a sequence's cells need not be
// adjacent, so the hardware prefetcher cannot be relied on.
template <typename C>
inline void prefetch_row(const C* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < n * static_cast<int64_t>(sizeof(C)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// Rows [t0, t0 + n) of a sequence's cells, each as compute dtype T would hold it, widened to
// float, into tile; the rows after them are prefetched.
template <typename T, typename C>
inline void load_tile(const C* cache, const int64_t* seq_cells, int64_t t0, int64_t n,
                      int64_t ahead_end, int64_t width, float* tile) {
  for (int64_t j = 0; j < n; ++j) {
    if (t0 + j + kPrefetchRows < ahead_end)
      prefetch_row(cache + seq_cells[t0 + j + kPrefetchRows] * width, width);
    load_row<T>(cache + seq_cells[t0 + j] * width, tile + j * width, width);
  }
}

inline float sum_lanes(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, x);
}

inline float max_lanes(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x);
}

// out[j] = q . keys[j * stride ...] for j < n, each dot in one fixed order (lane-wide fused
// multiply-adds over NV vectors, then a lane tree), wherever the key sits in the loop.
template <int NV>
inline void dots(const float* q, const float* keys, int64_t stride, int64_t n, float* out) {
  Vec qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = Vec::loadu(q + v * kLanes);
  auto one = [&](const float* k) {
    Vec acc(0.f);
    for (int v = 0; v < NV; ++v) acc = at::vec::fmadd(qv[v], Vec::loadu(k + v * kLanes), acc);
    return sum_lanes(acc);
  };
  int64_t j = 0;
  // Four independent dots per iteration hide the lane tree's latency.
  for (; j + 4 <= n; j += 4) {
    const float s0 = one(keys + j * stride), s1 = one(keys + (j + 1) * stride);
    const float s2 = one(keys + (j + 2) * stride), s3 = one(keys + (j + 3) * stride);
    out[j] = s0, out[j + 1] = s1, out[j + 2] = s2, out[j + 3] = s3;
  }
  for (; j < n; ++j) out[j] = one(keys + j * stride);
}

// acc += sum over j < n of w[j] * rows[j * stride ...], keys in ascending order.
template <int NV>
inline void weighted_sum(const float* w, const float* rows, int64_t stride, int64_t n, float* acc) {
  Vec a[NV];
  for (int v = 0; v < NV; ++v) a[v] = Vec::loadu(acc + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const Vec wj(w[j]);
    const float* r = rows + j * stride;
    for (int v = 0; v < NV; ++v) a[v] = at::vec::fmadd(wj, Vec::loadu(r + v * kLanes), a[v]);
  }
  for (int v = 0; v < NV; ++v) a[v].store(acc + v * kLanes);
}

// Register-blocked kernels for head sizes of 2..16 vectors, plain loops otherwise.
inline void dots_any(const float* q, const float* keys, int64_t stride, int64_t n, float* out,
                     int64_t dim) {
  switch (dim % kLanes == 0 ? dim / kLanes : 0) {
    case 2: return dots<2>(q, keys, stride, n, out);
    case 4: return dots<4>(q, keys, stride, n, out);
    case 8: return dots<8>(q, keys, stride, n, out);
    case 16: return dots<16>(q, keys, stride, n, out);
    default:
      for (int64_t j = 0; j < n; ++j) {
        float s = 0.f;
        for (int64_t d = 0; d < dim; ++d) s += q[d] * keys[j * stride + d];
        out[j] = s;
      }
  }
}

inline void weighted_sum_any(const float* w, const float* rows, int64_t stride, int64_t n,
                             float* acc, int64_t dim) {
  switch (dim % kLanes == 0 ? dim / kLanes : 0) {
    case 2: return weighted_sum<2>(w, rows, stride, n, acc);
    case 4: return weighted_sum<4>(w, rows, stride, n, acc);
    case 8: return weighted_sum<8>(w, rows, stride, n, acc);
    case 16: return weighted_sum<16>(w, rows, stride, n, acc);
    default:
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; ++d) acc[d] += w[j] * rows[j * stride + d];
  }
}

// Softmax of one query head's scores s[lo, hi) in place (entries between a lane-aligned
// start and lo hold -inf). Lanes are aligned on absolute key positions, so the sums' order
// does not depend on which block the query sits in.
template <typename T>
inline void softmax_row(float* s, int64_t lo, int64_t hi, float scale) {
  const int64_t start = lo / kLanes * kLanes, end = (hi + kLanes - 1) / kLanes * kLanes;
  round_all<T>(s + lo, hi - lo);
#pragma omp simd
  for (int64_t j = lo; j < hi; ++j) s[j] *= scale;
  round_all<T>(s + lo, hi - lo);
  Vec top(kNegInf);
  for (int64_t j = start; j < end; j += kLanes) top = at::vec::maximum(top, Vec::loadu(s + j));
  const Vec shift(max_lanes(top));
  Vec total(0.f);
  for (int64_t j = start; j < end; j += kLanes) {
    const Vec e = (Vec::loadu(s + j) - shift).exp();
    e.store(s + j);
    total = total + e;
  }
  const Vec inverse(1.f / sum_lanes(total));
  for (int64_t j = start; j < end; j += kLanes) (Vec::loadu(s + j) * inverse).store(s + j);
  round_all<T>(s + lo, hi - lo);
}

struct Query {
  int64_t lo, hi;  // visible keys [lo, hi)
};

template <typename T, typename C>
void attend(const T* q, const C* k_cache, const C* v_cache, const int64_t* cells,
            const int64_t* rows, const int64_t* pos, const int64_t* cell_offsets,
            const int64_t* block_starts, int64_t num_blocks, int64_t heads, int64_t kv_heads,
            int64_t head_dim, int64_t q_row_stride, int64_t window, float scale, T* out) {
  const int64_t share = heads / kv_heads, width = heads * head_dim;
  const int64_t kv_width = kv_heads * head_dim;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries, acc, tile(kKeyTile * kv_width);
    std::vector<Query> visible;
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block_starts[block], count = block_starts[block + 1] - first;
      const int64_t* seq_cells = cells + cell_offsets[first];
      visible.resize(count);
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t p = pos[first + i];
        visible[i] = {window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, p + 1};
        lo = std::min(lo, visible[i].lo);
        hi = std::max(hi, visible[i].hi);
      }
      // Score rows cover key positions [base, base + span), lane-aligned.
      const int64_t base = lo / kLanes * kLanes;
      const int64_t span = (hi - base + kLanes - 1) / kLanes * kLanes;
      scores.assign(count * heads * span, kNegInf);
      queries.resize(count * width);
      acc.assign(count * width, 0.f);
      for (int64_t i = 0; i < count; ++i) {
        const T* src = q + rows[first + i] * q_row_stride;
        for (int64_t x = 0; x < width; ++x) queries[i * width + x] = widen(src[x]);
      }
      auto row_of = [&](int64_t i, int64_t h) { return scores.data() + (i * heads + h) * span - base; };
      // body(i, h, j0, j1, keys): query i, head h sees keys [j0, j1) of this tile, whose
      // rows (of head h's KV head) start at `keys`, kv_width floats apart.
      auto for_each_tile = [&](const C* cache, auto&& body) {
        for (int64_t t0 = lo; t0 < hi; t0 += kKeyTile) {
          const int64_t tn = std::min(kKeyTile, hi - t0);
          load_tile<T>(cache, seq_cells, t0, tn, hi, kv_width, tile.data());
          for (int64_t i = 0; i < count; ++i) {
            const int64_t j0 = std::max(t0, visible[i].lo), j1 = std::min(t0 + tn, visible[i].hi);
            if (j1 <= j0) continue;
            for (int64_t h = 0; h < heads; ++h)
              body(i, h, j0, j1, tile.data() + (j0 - t0) * kv_width + (h / share) * head_dim);
          }
        }
      };
      for_each_tile(k_cache, [&](int64_t i, int64_t h, int64_t j0, int64_t j1, const float* keys) {
        dots_any(queries.data() + i * width + h * head_dim, keys, kv_width, j1 - j0,
                 row_of(i, h) + j0, head_dim);
      });
      for (int64_t i = 0; i < count; ++i)
        for (int64_t h = 0; h < heads; ++h)
          softmax_row<T>(row_of(i, h), visible[i].lo, visible[i].hi, scale);
      for_each_tile(v_cache, [&](int64_t i, int64_t h, int64_t j0, int64_t j1, const float* values) {
        weighted_sum_any(row_of(i, h) + j0, values, kv_width, j1 - j0,
                         acc.data() + i * width + h * head_dim, head_dim);
      });
      for (int64_t i = 0; i < count; ++i) {
        T* o = out + rows[first + i] * width;
        for (int64_t x = 0; x < width; ++x) o[x] = static_cast<T>(acc[i * width + x]);
      }
    }
  });
}

template <typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cells, const at::Tensor& rows, const at::Tensor& pos,
                    const at::Tensor& cell_offsets, const at::Tensor& block_starts, int64_t window,
                    double scale, at::Tensor& out) {
  cellbatch::for_each_scalar_type(k_cache, "cell_attention KV", [&](auto cache_tag) {
    using C = decltype(cache_tag);
    attend<T, C>(q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                 cells.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                 cell_offsets.data_ptr<int64_t>(), block_starts.data_ptr<int64_t>(),
                 block_starts.size(0) - 1, q.size(1), k_cache.size(1), q.size(2), q.stride(0), window,
                 static_cast<float>(scale), out.data_ptr<T>());
  });
}

void cell_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cells, const at::Tensor& rows, const at::Tensor& pos,
                    const at::Tensor& cell_offsets, const at::Tensor& block_starts,
                    int64_t window, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "cell_attention: q must be [tokens, heads, dim], K/V [cells, kv_heads, dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0,
              "cell_attention: head sizes of q and K/V disagree");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 2 &&
                  out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2),
              "cell_attention: out must be [tokens, heads * dim] in q's dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "cell_attention: q's heads must be contiguous (rows may be strided)");
  const at::Tensor* all[] = {&k_cache, &v_cache, &cells, &rows, &pos, &cell_offsets,
                             &block_starts, &out};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "cell_attention: CPU, contiguous");
  TORCH_CHECK(q.device().is_cpu(), "cell_attention: CPU tensors only");
  for (const at::Tensor* t : {&cells, &rows, &pos, &cell_offsets, &block_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong, "cell_attention: index tensors must be int64");
  cellbatch::for_each_scalar_type(q, "cell_attention", [&](auto tag) {
    dispatch_cache<decltype(tag)>(q, k_cache, v_cache, cells, rows, pos, cell_offsets,
                                  block_starts, window, scale, out);
  });
}

}  // namespace

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) { m.impl("cell_attention", &cell_attention); }
