// LoRA adapters' low-rank products added to a product's output: the op `cellbatch::lora_add`.
//
// Owns: the arithmetic of out[r] += x[r] · A^T · B for the rows of each group (one adapter
// each), in the layout of cellbatch/model/lora.py: a [R, K] (PEFT's lora_A of the modules
// the adapter targets in this product, concatenated along the rank), b each module's
// [rank, columns] block (its lora_B transposed, scaled) one after the other, segments
// int64 [S, 4] (rank_start, rank_count, column_start, column_count).
// Promises: a row's result is one chain whatever the other rows, the groups and the
// threads: t = x · A sums over the inputs in order, then each output sums over the
// module's rank in order, in float32 lanes (bf16 and fp16 widened exactly), and is added
// to out[r] and rounded to out's dtype once. Every group is checked before any row is
// written; one parallel region covers the call, a row computed whole by one thread, and
// work too small to pay for the region stays on the calling thread. Up to kRowsTogether
// rows of a group share each weight load. Rows not named in
// `rows` are not touched, so a row without an adapter costs nothing.
// Never: allocates per row or per group, or reads rows of x other than those named.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#include <vector>

namespace {

using cellbatch::for_each_scalar_type;
using cellbatch::kLanes;
using cellbatch::narrow;
using cellbatch::Vec;
using cellbatch::widen;

// kLanes values from p widened to float lanes.
template <typename T>
inline Vec load_full(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// `count` (<= kLanes) values from p widened to float lanes, zeros after them.
template <typename T>
inline Vec load_lanes(const T* p, int64_t count) {
  if (count == kLanes) return load_full(p);
  alignas(64) float buffer[kLanes] = {};
  for (int64_t i = 0; i < count; ++i) buffer[i] = widen(p[i]);
  return Vec::loadu(buffer);
}

// Vector multiply-adds a parallel region must hold to pay for its start (a few us).
constexpr int64_t kParallelWork = 1 << 12;
// Output columns one task of the second product writes: four vectors, whole cache lines.
constexpr int64_t kBlock = 4 * kLanes;
// Ranks one task of the first product computes together (one row's).
constexpr int64_t kRanks = 4;

// The grain that keeps `tasks` tasks of `work` vector multiply-adds each on the calling
// thread unless together they hold kParallelWork.
inline int64_t grain(int64_t tasks, int64_t work) {
  return tasks * work < kParallelWork ? tasks + 1 : std::max<int64_t>(1, kParallelWork / work);
}

// Rows of one group computed together: each weight vector loaded (and widened) once for
// all of them. Together or alone, a row's chains are the same.
constexpr int64_t kRowsTogether = 4;

// The low-rank products of N rows of one group added to their out rows: t = x[row] · A^T
// into `low` (kRanks ranks at a time, their chains interleaved: each chain's order is as
// alone, the interleaving only hides the multiply-adds' latency; a step short of ranks
// repeats its last one and stores it once), then per module and per block of kBlock
// output columns t · B_module, the block's vectors' chains interleaved over the module's
// ranks in order. low holds N rows of `stride` floats.
template <typename T, int N>
void add_rows(T* const* targets, const T* const* xs, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& segments, float* low, int64_t stride) {
  const int64_t rank = a.size(0), in = a.size(1);
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  for (int64_t j0 = 0; j0 < rank; j0 += kRanks) {
    const T* weights[kRanks];
    for (int64_t q = 0; q < kRanks; ++q) weights[q] = ap + std::min(j0 + q, rank - 1) * in;
    Vec sum[N][kRanks];
    for (int r = 0; r < N; ++r) {
      for (int64_t q = 0; q < kRanks; ++q) sum[r][q] = Vec(0.f);
    }
    // Whole vectors in a loop of fixed shape (the accumulators stay in registers), then
    // the inputs' tail, zero-padded: the same lanes' chains as one padded loop.
    const int64_t whole = in - in % kLanes;
    for (int64_t k = 0; k < whole; k += kLanes) {
      Vec w[kRanks];
      for (int64_t q = 0; q < kRanks; ++q) w[q] = load_full(weights[q] + k);
      for (int r = 0; r < N; ++r) {
        const Vec x = load_full(xs[r] + k);
        for (int64_t q = 0; q < kRanks; ++q) sum[r][q] = at::vec::fmadd(x, w[q], sum[r][q]);
      }
    }
    if (whole < in) {
      alignas(64) T w_tail[kRanks][kLanes] = {};
      alignas(64) T x_tail[N][kLanes] = {};
      for (int64_t i = 0; i < in - whole; ++i) {
        for (int64_t q = 0; q < kRanks; ++q) w_tail[q][i] = weights[q][whole + i];
        for (int r = 0; r < N; ++r) x_tail[r][i] = xs[r][whole + i];
      }
      Vec w[kRanks];
      for (int64_t q = 0; q < kRanks; ++q) w[q] = load_full(w_tail[q]);
      for (int r = 0; r < N; ++r) {
        const Vec x = load_full(x_tail[r]);
        for (int64_t q = 0; q < kRanks; ++q) sum[r][q] = at::vec::fmadd(x, w[q], sum[r][q]);
      }
    }
    for (int r = 0; r < N; ++r) {
      for (int64_t q = 0; q < kRanks && j0 + q < rank; ++q) {
        low[r * stride + j0 + q] =
            at::vec::vec_reduce_all<float>([](Vec p, Vec s) { return p + s; }, sum[r][q]);
      }
    }
  }
  constexpr int64_t kVectors = kBlock / kLanes;
  const int64_t* seg = segments.data_ptr<int64_t>();
  int64_t b_offset = 0;
  alignas(64) float lanes_out[kBlock];
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t rank_start = seg[4 * s], ranks = seg[4 * s + 1];
    const int64_t column = seg[4 * s + 2], columns = seg[4 * s + 3];
    const T* block = bp + b_offset;
    b_offset += ranks * columns;
    for (int64_t c0 = 0; c0 < columns; c0 += kBlock) {
      const int64_t lanes = std::min(kBlock, columns - c0);
      const int64_t vectors = (lanes + kLanes - 1) / kLanes;
      Vec sum[N][kVectors];
      for (int r = 0; r < N; ++r) {
        for (int64_t v = 0; v < kVectors; ++v) sum[r][v] = Vec(0.f);
      }
      if (vectors == kVectors) {
        for (int64_t j = 0; j < ranks; ++j) {
          const T* from = block + j * columns + c0;
          Vec w[kVectors];
          for (int64_t v = 0; v < kVectors; ++v) w[v] = load_full(from + v * kLanes);
          for (int r = 0; r < N; ++r) {
            const Vec scale(low[r * stride + rank_start + j]);
            for (int64_t v = 0; v < kVectors; ++v) sum[r][v] = at::vec::fmadd(scale, w[v], sum[r][v]);
          }
        }
      } else {
        for (int64_t j = 0; j < ranks; ++j) {
          const T* from = block + j * columns + c0;
          for (int64_t v = 0; v < vectors; ++v) {
            const Vec w = load_lanes(from + v * kLanes, std::min(kLanes, lanes - v * kLanes));
            for (int r = 0; r < N; ++r) {
              sum[r][v] = at::vec::fmadd(Vec(low[r * stride + rank_start + j]), w, sum[r][v]);
            }
          }
        }
      }
      for (int r = 0; r < N; ++r) {
        for (int64_t v = 0; v < vectors; ++v) sum[r][v].store(lanes_out + v * kLanes);
        T* target = targets[r] + column + c0;
        for (int64_t l = 0; l < lanes; ++l) {
          target[l] = narrow<T>(widen(target[l]) + lanes_out[l]);
        }
      }
    }
  }
}

// Vector multiply-adds of one row's product with adapter (a, segments).
inline int64_t row_work(const at::Tensor& a, const at::Tensor& segments) {
  int64_t work = a.size(0) * ((a.size(1) + kLanes - 1) / kLanes);
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.size(0); ++s) {
    work += seg[4 * s + 1] * ((seg[4 * s + 3] + kLanes - 1) / kLanes);
  }
  return work;
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& offsets, at::TensorList weights) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  x.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "lora_add: out [T, N] and x [T, K] must have contiguous rows and one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1 &&
                  offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.dim() == 1 && offsets.size(0) >= 1,
              "lora_add: rows and offsets must be contiguous int64 vectors");
  const int64_t groups = offsets.size(0) - 1;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 3 * groups, "lora_add: ", groups,
              " groups need ", 3 * groups, " weight tensors, got ", weights.size());
  const int64_t* bounds = offsets.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[groups] == rows.size(0),
              "lora_add: offsets must run from 0 to the number of rows");
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "lora_add: row ", row_ids[i],
                " is outside the ", x.size(0), " rows");
  }
  std::vector<char> active(groups, false);
  int64_t max_rank = 0, max_work = 1;
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& a = weights[3 * g];
    const at::Tensor& b = weights[3 * g + 1];
    const at::Tensor& segments = weights[3 * g + 2];
    const int64_t count = bounds[g + 1] - bounds[g];
    TORCH_CHECK(count >= 0, "lora_add: offsets must not decrease");
    if (count == 0 || a.dim() != 2 || a.size(0) == 0) continue;
    TORCH_CHECK(a.size(1) == x.size(1) && a.is_contiguous() && b.is_contiguous() &&
                    a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
                "lora_add: group ", g, "'s A must be contiguous [R, ", x.size(1),
                "] and A, B in x's dtype");
    TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() &&
                    segments.dim() == 2 && segments.size(1) == 4,
                "lora_add: segments must be contiguous int64 [S, 4]");
    const int64_t* seg = segments.data_ptr<int64_t>();
    int64_t b_values = 0;
    for (int64_t s = 0; s < segments.size(0); ++s) {
      const int64_t rank_start = seg[4 * s], ranks = seg[4 * s + 1];
      const int64_t column = seg[4 * s + 2], columns = seg[4 * s + 3];
      b_values += ranks * columns;
      TORCH_CHECK(rank_start >= 0 && ranks >= 0 && rank_start + ranks <= a.size(0) &&
                      column >= 0 && columns >= 0 && column + columns <= out.size(1) &&
                      b_values <= b.numel(),
                  "lora_add: group ", g, "'s segment ", s, " (", rank_start, ", ", ranks, ", ",
                  column, ", ", columns, ") lies outside A's ", a.size(0), " ranks, the ",
                  out.size(1), " outputs or B's ", b.numel(), " values");
    }
    active[g] = true;
    max_rank = std::max<int64_t>(max_rank, a.size(0));
    max_work = std::max<int64_t>(max_work, row_work(a, segments));
  }
  // Every group checked before any row is written; then one parallel region over blocks of
  // at most kRowsTogether rows of one group, each row computed whole by one thread.
  std::vector<int64_t> block_starts;
  for (int64_t g = 0; g < groups; ++g) {
    if (!active[g]) continue;
    for (int64_t p = bounds[g]; p < bounds[g + 1]; p += kRowsTogether) block_starts.push_back(p);
  }
  const int64_t blocks = static_cast<int64_t>(block_starts.size());
  std::vector<int64_t> group_of(blocks), block_rows(blocks);
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    if (!active[g]) continue;
    for (int64_t p = bounds[g]; p < bounds[g + 1]; p += kRowsTogether, ++i) {
      group_of[i] = g;
      block_rows[i] = std::min(kRowsTogether, bounds[g + 1] - p);
    }
  }
  std::vector<float> low(rows.size(0) * max_rank);
  for_each_scalar_type(x, "lora_add", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
    at::parallel_for(0, blocks, grain(blocks, kRowsTogether * max_work),
                     [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = group_of[i], first = block_starts[i];
        T* targets[kRowsTogether];
        const T* xs[kRowsTogether];
        for (int64_t r = 0; r < block_rows[i]; ++r) {
          targets[r] = op + row_ids[first + r] * out_stride;
          xs[r] = xp + row_ids[first + r] * x_stride;
        }
        const at::Tensor &a = weights[3 * g], &b = weights[3 * g + 1], &seg = weights[3 * g + 2];
        float* rows_low = low.data() + first * max_rank;
        switch (block_rows[i]) {
          case 4: add_rows<T, 4>(targets, xs, a, b, seg, rows_low, max_rank); break;
          case 3: add_rows<T, 3>(targets, xs, a, b, seg, rows_low, max_rank); break;
          case 2: add_rows<T, 2>(targets, xs, a, b, seg, rows_low, max_rank); break;
          default: add_rows<T, 1>(targets, xs, a, b, seg, rows_low, max_rank); break;
        }
      }
    });
  });
}

}  // namespace

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) { m.impl("lora_add", &lora_add); }
