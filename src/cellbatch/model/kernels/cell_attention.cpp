// Attention over cells on the CPU: the op `cellbatch::cell_attention`.
//
// Owns: causal attention of every query of a packed step over its own sequence's cells, in
// one flash-attention-style pass per (block of queries, KV head): the block's keys are read
// once, a tile of kKeyTile positions at a time, and each tile serves every query of the
// block and every query head that shares the KV head, with an online softmax (running
// maximum and sum) instead of a materialised row of scores. A cache in another dtype than
// float32 is widened a tile at a time, each cell's K and V rows whole (every KV head: one
// contiguous read per cell), before the KV heads run over them: read a head at a time, the
// rows were strided reads that left a decode step's attention waiting on memory. While a
// cell is widened, the cell kAhead positions on is asked for, adjacent in the pool or not:
// the hardware prefetcher alone left a cache beyond the L3 waiting. With fewer sequences'
// blocks than threads (a single stream's decode), each KV head of a block is a work item
// of its own, so the threads share it (the figures: docs/benchmarks.md#where-the-time-goes).
// The tiles' arithmetic and the rows' widening are cell_attention_tiles.h's.
// Promises: a query's output depends only on its own query vector and the K/V of its own
// visible cells, computed in a fixed order: tiles are aligned on absolute key positions,
// each score is one chain of fused multiply-adds over the head dimension, and every sum
// runs over ascending positions, where keys another query of the block needs but this one
// does not add exact zeros. So a query's result is bit-identical whatever else shares the
// step, its block or its KV head's work, and whether it was a decode or a prompt chunk.
// Keys outside [pos - window + 1, pos] of every query of a block are never read.
// Numerics in compute dtype T: score = T(T(q.k) * scale), as transformers' eager attention;
// then, in float32, an online softmax (exp to within 20 ulp, as ATen's flash attention),
// values summed with unnormalised weights and divided by the softmax sum once, rounded to
// T. K/V stored in another dtype are first rounded to T, as `.to(T)` would; an int8 cache's
// (cellbatch/kv_format.py) are code * scale in float32, then rounded to T, and are widened
// a tile at a time as bf16 ones are.
// Never: allocates per key or per query, reads the scratch cell, or touches rows that no
// query names.
//
// Layout: q [tokens, heads, head_dim] (rows may be strided); k_cache/v_cache [cells,
// kv_heads, head_dim] (int8: head_dim + 4, each head's codes and then its scale); out
// [tokens, heads * head_dim]. Query i (in block order) is token
// rows[i] at position pos[i]; its sequence's cells, in position order, start at
// cells[cell_offsets[i]]. block_starts splits the queries into blocks of one sequence each.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cell_attention_tiles.h"
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using namespace cellbatch::attention;
using cellbatch::kLanes;
using cellbatch::round_to;
using cellbatch::Vec;
using cellbatch::widen;

// How many cells ahead of the one being widened a bf16 or fp16 cache row is prefetched
// (4, 8 and 16 measured alike; 8 a little ahead).
constexpr int64_t kAhead = 8;
// Keys transposed at a time (at::vec's 8 x 8 float transpose).
constexpr int64_t kTransposeRows = 8;
// Score rows computed together in registers: kRowGroup rows x (up to) 4 vectors of keys.
constexpr int kRowGroup = 3;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kKeyTile % kTransposeRows == 0);

// What one worker reuses from item to item.
struct Scratch {
  // tile_keys / tile_values: a tile's K and V rows widened, every KV head of a cell
  // together (kKeyTile x kv_heads x dim), when the cache is not float32 already.
  std::vector<float> queries, acc, scores, keys_t, staged, tile_keys, tile_values, row_max,
      row_sum;
  std::vector<int64_t> lo, hi;
  std::vector<const float*> value_rows = std::vector<const float*>(kKeyTile);
};

template <typename T, typename C>
struct CellAttention {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  const int64_t* cells;
  const int64_t* rows;
  const int64_t* pos;
  const int64_t* cell_offsets;
  const int64_t* block_starts;
  int64_t num_blocks, heads, kv_heads, dim, q_row_stride, window;
  float scale;
  T* out;

  static constexpr bool kDirect = std::is_same_v<T, float> && std::is_same_v<C, float>;
  static constexpr bool kInt8 = std::is_same_v<C, int8_t>;

  int64_t share() const { return heads / kv_heads; }
  // Floats per cell of a staged tile: every KV head's values.
  int64_t kv_width() const { return kv_heads * dim; }
  // Elements of C per head and per cell in the cache (int8: the scale too).
  int64_t head_width() const { return cellbatch::cache_head_width<C>(dim); }
  int64_t cell_width() const { return kv_heads * head_width(); }
  const C* cache_row(const C* cache, const int64_t* seq_cells, int64_t key, int64_t g) const {
    return cache + seq_cells[key] * cell_width() + g * head_width();
  }

  // Widens the tile's K and V rows j in [a, b) (tile-relative), the KV heads [g0, g1) of a
  // cell at once: a cell's K (or V) is one contiguous row of kv_heads x dim, read once and
  // in order, where reading it a head at a time strode through it three times. The rows of
  // the block's keys up to `end` (absolute) are prefetched kAhead cells ahead. Staged rows
  // keep the cache's layout (kv_width apart, head g at g * dim).
  void stage_tile(const int64_t* seq_cells, int64_t t0, int64_t a, int64_t b, int64_t end,
                  int64_t g0, int64_t g1, Scratch& s) const {
    const int64_t width = kv_width(), begin = g0 * dim, count = (g1 - g0) * dim;
    const int64_t stored = cell_width(), stored_begin = g0 * head_width();
    const int64_t stored_count = (g1 - g0) * head_width();
    for (int64_t j = a; j < b; ++j) {
      const int64_t cell = seq_cells[t0 + j], ahead = t0 + j + kAhead;
      if (ahead < end) {
        prefetch_row(k_cache + seq_cells[ahead] * stored + stored_begin, stored_count);
        prefetch_row(v_cache + seq_cells[ahead] * stored + stored_begin, stored_count);
      }
      float* keys = s.tile_keys.data() + j * width;
      float* values = s.tile_values.data() + j * width;
      if constexpr (kInt8) {
        for (int64_t g = g0; g < g1; ++g) {
          load_int8_head<T>(k_cache + cell * stored + g * head_width(), keys + g * dim, dim);
          load_int8_head<T>(v_cache + cell * stored + g * head_width(), values + g * dim, dim);
        }
      } else {
        load_row<T>(k_cache + cell * stored + begin, keys + begin, count);
        load_row<T>(v_cache + cell * stored + begin, values + begin, count);
      }
    }
  }

  // keys_t[d][j] for the tile's keys j in [a, b) (tile-relative) of KV head g; zeros for
  // the other keys of each transposed group that holds one of them.
  void load_keys(const int64_t* seq_cells, int64_t t0, int64_t a, int64_t b, int64_t g,
                 Scratch& s) const {
    float* keys_t = s.keys_t.data();
    for (int64_t j0 = a / kTransposeRows * kTransposeRows; j0 < b; j0 += kTransposeRows) {
      const float* src = nullptr;
      int64_t stride = dim;
      bool whole = j0 >= a && j0 + kTransposeRows <= b;
      if constexpr (!kDirect) {
        if (whole) {  // the staged rows of KV head g, kv_width apart
          src = s.tile_keys.data() + j0 * kv_width() + g * dim;
          stride = kv_width();
        }
      }
      if constexpr (kDirect) {
        // Adjacent cells (the usual case for a prompt) transpose straight from the cache.
        const int64_t first = seq_cells[t0 + j0];
        for (int64_t r = 1; whole && r < kTransposeRows; ++r)
          whole = seq_cells[t0 + j0 + r] == first + r;
        if (whole) {
          src = cache_row(k_cache, seq_cells, t0 + j0, g);
          stride = kv_width();
        }
      }
      if (src == nullptr) {
        float* staged = s.staged.data();
        for (int64_t r = 0; r < kTransposeRows; ++r) {
          const int64_t j = j0 + r;
          if (j >= a && j < b && kDirect)
            load_row<T>(cache_row(k_cache, seq_cells, t0 + j, g), staged + r * dim, dim);
          else if (j >= a && j < b)
            std::copy_n(s.tile_keys.data() + j * kv_width() + g * dim, dim, staged + r * dim);
          else
            std::fill(staged + r * dim, staged + (r + 1) * dim, 0.f);
        }
        src = staged;
      }
      int64_t d = 0;
      for (; d + kTransposeRows <= dim; d += kTransposeRows)
        at::vec::transpose_mxn<float, kTransposeRows, kTransposeRows>(
            src + d, stride, keys_t + d * kKeyTile + j0, kKeyTile);
      for (; d < dim; ++d)
        for (int64_t r = 0; r < kTransposeRows; ++r)
          keys_t[d * kKeyTile + j0 + r] = src[r * stride + d];
    }
  }

  // Points s.value_rows[j] at the tile's value rows j in [a, b) of KV head g.
  void load_values(const int64_t* seq_cells, int64_t t0, int64_t a, int64_t b, int64_t g,
                   Scratch& s) const {
    for (int64_t j = a; j < b; ++j) {
      if constexpr (kDirect) {
        s.value_rows[j] = cache_row(v_cache, seq_cells, t0 + j, g);
      } else {
        s.value_rows[j] = s.tile_values.data() + j * kv_width() + g * dim;
      }
    }
  }

  // Turns row r's scores over the tile into unnormalised weights for its visible keys
  // [j0, j1) (tile-relative; zeros elsewhere), updates its running maximum and sum, and
  // returns the factor its accumulated values must be scaled by.
  float softmax_step(float* row, int64_t j0, int64_t j1, float& running_max,
                     float& running_sum) const {
    if (j1 <= j0) {
      std::fill(row, row + kKeyTile, 0.f);
      return 1.f;
    }
    // Whole vectors covering [j0, j1); lanes are aligned on absolute positions.
    const int64_t v0 = j0 / kLanes * kLanes, v1 = (j1 + kLanes - 1) / kLanes * kLanes;
    // In float32 the scaling joins the exp's pass: rounding is monotonic, so the top of the
    // scaled scores is the scaled top, and each weight sees the same scaled score.
    constexpr bool kScaleLate = std::is_same_v<T, float>;
    if constexpr (!kScaleLate) {
      round_all<T>(row + j0, j1 - j0);
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) row[j] *= scale;
      round_all<T>(row + j0, j1 - j0);
    }
    std::fill(row + v0, row + j0, kNegInf);
    std::fill(row + j1, row + v1, kNegInf);
    Vec top(kNegInf);
    for (int64_t j = v0; j < v1; j += kLanes) top = at::vec::maximum(top, Vec::loadu(row + j));
    const float tile_max = kScaleLate ? max_lanes(top) * scale : max_lanes(top);
    const float new_max = std::max(running_max, tile_max);
    const float factor = std::exp(running_max - new_max);
    const Vec shift(new_max), factor_in(kScaleLate ? scale : 1.f);
    Vec total(0.f);
    for (int64_t j = v0; j < v1; j += kLanes) {
      Vec x = Vec::loadu(row + j);
      if constexpr (kScaleLate) x = x * factor_in;
      const Vec e = (x - shift).exp_u20();
      e.store(row + j);
      total = total + e;
    }
    std::fill(row, row + v0, 0.f);
    std::fill(row + v1, row + kKeyTile, 0.f);
    running_max = new_max;
    running_sum = running_sum * factor + sum_lanes(total);
    return factor;
  }

  // The queries of `block` under the query heads of KV heads [g0, g1): every visible key,
  // tile by tile. Each KV head's work reads only its own K/V and queries, so how a block's
  // KV heads are split between items never changes a result.
  void run_block(int64_t block, int64_t g0, int64_t g1, Scratch& s) const {
    const int64_t first = block_starts[block], count = block_starts[block + 1] - first;
    const int64_t* seq_cells = cells + cell_offsets[first];
    const int64_t group = share(), num_rows = count * heads, width = heads * dim;
    const int64_t group_rows = count * group;  // rows of one KV head
    s.lo.resize(count);
    s.hi.resize(count);
    int64_t block_lo = std::numeric_limits<int64_t>::max(), block_hi = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t p = pos[first + i];
      s.lo[i] = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      s.hi[i] = p + 1;
      block_lo = std::min(block_lo, s.lo[i]);
      block_hi = std::max(block_hi, s.hi[i]);
    }
    // Row (g * count + i) * group + h' is query i under head g * group + h': the rows of
    // one KV head are adjacent.
    auto row_of = [&](int64_t g, int64_t i, int64_t h) { return (g * count + i) * group + h; };
    s.queries.resize(num_rows * dim);
    for (int64_t i = 0; i < count; ++i) {
      const T* src = q + rows[first + i] * q_row_stride;
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t x = 0; x < group * dim; ++x)
          s.queries[row_of(g, i, 0) * dim + x] = widen(src[g * group * dim + x]);
    }
    s.acc.assign(num_rows * dim, 0.f);
    s.row_max.assign(num_rows, kNegInf);
    s.row_sum.assign(num_rows, 0.f);
    s.scores.resize(group_rows * kKeyTile);
    const int64_t last_tile = (block_hi - 1) / kKeyTile * kKeyTile;
    for (int64_t t0 = block_lo / kKeyTile * kKeyTile; t0 <= last_tile; t0 += kKeyTile) {
      const int64_t a = std::max(t0, block_lo) - t0, b = std::min(t0 + kKeyTile, block_hi) - t0;
      if (kDirect && t0 < last_tile) {  // (stage_tile prefetches for the other caches)
        for (int64_t j = t0 + kKeyTile; j < std::min(t0 + 2 * kKeyTile, block_hi); ++j) {
          if (seq_cells[j] == seq_cells[j - 1] + 1) continue;
          prefetch_row(k_cache + seq_cells[j] * cell_width(), cell_width());
          prefetch_row(v_cache + seq_cells[j] * cell_width(), cell_width());
        }
      }
      if constexpr (!kDirect) stage_tile(seq_cells, t0, a, b, block_hi, g0, g1, s);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t base = g * group_rows;
        load_keys(seq_cells, t0, a, b, g, s);
        int64_t r = 0;
        for (; r + kRowGroup <= group_rows; r += kRowGroup)
          tile_scores<kRowGroup>(&s.queries[(base + r) * dim], dim, s.keys_t.data(), a, b,
                                 &s.scores[r * kKeyTile]);
        for (; r < group_rows; ++r)
          tile_scores<1>(&s.queries[(base + r) * dim], dim, s.keys_t.data(), a, b,
                         &s.scores[r * kKeyTile]);
        load_values(seq_cells, t0, a, b, g, s);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t j0 = std::max(s.lo[i] - t0, a), j1 = std::min(s.hi[i] - t0, b);
          for (int64_t h = 0; h < group; ++h) {
            const int64_t row = row_of(g, i, h);
            const float factor = softmax_step(&s.scores[(row - base) * kKeyTile], j0, j1,
                                              s.row_max[row], s.row_sum[row]);
            if (factor != 1.f) {
              float* acc = &s.acc[row * dim];
              for (int64_t x = 0; x < dim; ++x) acc[x] *= factor;
            }
          }
        }
        // Weights outside a row's visible keys are zero, so each group of rows may run
        // over every loaded key: the extra terms add exact zeros.
        r = 0;
        for (; r + kRowGroup <= group_rows; r += kRowGroup)
          tile_values_all<kRowGroup>(&s.scores[r * kKeyTile], s.value_rows.data(), a, b,
                                     &s.acc[(base + r) * dim], dim);
        for (; r < group_rows; ++r)
          tile_values_all<1>(&s.scores[r * kKeyTile], s.value_rows.data(), a, b,
                             &s.acc[(base + r) * dim], dim);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      T* o = out + rows[first + i] * width;
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t row = row_of(g, i, h);
          const float* acc = &s.acc[row * dim];
          const float total = s.row_sum[row];
          T* dst = o + (g * group + h) * dim;
          for (int64_t x = 0; x < dim; ++x) dst[x] = static_cast<T>(acc[x] / total);
        }
    }
  }

  void run() const {
    // An item is a block's work under a range of its KV heads. With at least as many
    // blocks as threads an item is a whole block (each cell's K/V row staged once); with
    // fewer (a single stream's decode), each KV head of a block is an item of its own, so
    // every thread has work. Items are handed out longest first to whichever worker is
    // free: which worker runs an item, and how a block is split, never changes a result.
    const int64_t threads = at::get_num_threads();
    const int64_t parts = num_blocks < threads ? kv_heads : 1;
    const int64_t num_items = num_blocks * parts;
    std::vector<int64_t> cost(num_items);
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int64_t first = block_starts[block], last = block_starts[block + 1] - 1;
      const int64_t span = pos[last] - (window > 0 ? pos[first] - window : -1);
      for (int64_t part = 0; part < parts; ++part)
        cost[block * parts + part] = (last - first + 1) * std::max<int64_t>(span, 1);
    }
    std::vector<int64_t> order(num_items);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(threads, num_items);
    const int64_t heads_per_item = kv_heads / parts;
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch s;
      s.keys_t.resize(dim * kKeyTile);
      s.staged.resize(kTransposeRows * dim);
      if constexpr (!kDirect) {
        s.tile_keys.resize(kKeyTile * kv_width());
        s.tile_values.resize(kKeyTile * kv_width());
      }
      for (int64_t k = next++; k < num_items; k = next++) {
        const int64_t part = order[k] % parts;
        run_block(order[k] / parts, part * heads_per_item, (part + 1) * heads_per_item, s);
      }
    });
  }
};

template <typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cells, const at::Tensor& rows, const at::Tensor& pos,
                    const at::Tensor& cell_offsets, const at::Tensor& block_starts, int64_t window,
                    double scale, at::Tensor& out) {
  cellbatch::for_each_cache_type(k_cache, "cell_attention KV", [&](auto cache_tag) {
    using C = decltype(cache_tag);
    CellAttention<T, C>{q.data_ptr<T>(),
                        k_cache.data_ptr<C>(),
                        v_cache.data_ptr<C>(),
                        cells.data_ptr<int64_t>(),
                        rows.data_ptr<int64_t>(),
                        pos.data_ptr<int64_t>(),
                        cell_offsets.data_ptr<int64_t>(),
                        block_starts.data_ptr<int64_t>(),
                        block_starts.size(0) - 1,
                        q.size(1),
                        k_cache.size(1),
                        q.size(2),
                        q.stride(0),
                        window,
                        static_cast<float>(scale),
                        out.data_ptr<T>()}
        .run();
  });
}

void cell_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cells, const at::Tensor& rows, const at::Tensor& pos,
                    const at::Tensor& cell_offsets, const at::Tensor& block_starts,
                    int64_t window, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "cell_attention: q must be [tokens, heads, dim], K/V [cells, kv_heads, dim]");
  const int64_t head_width = k_cache.scalar_type() == at::kChar
                                 ? q.size(2) + cellbatch::kCacheScaleBytes
                                 : q.size(2);
  TORCH_CHECK(head_width == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0,
              "cell_attention: head sizes of q and K/V disagree (an int8 cache's heads hold ",
              "head_dim + 4)");
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
