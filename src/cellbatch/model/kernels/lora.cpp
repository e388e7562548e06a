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
// written; one parallel region covers the call, each output value computed by one
// thread (a few rows' modules split by columns so that every thread loads weights), and
// work too small to pay for the region stays on the calling thread. Up to kRowsTogether
// rows of a group share each weight load. Rows not named in `rows` are not touched, so a
// row without an adapter costs nothing.
// Never: allocates per row or per group, or reads rows of x other than those named.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#include <immintrin.h>

#include <algorithm>
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

// Weight values a call must load to pay for a parallel region's start (a few us): the
// adapters' weights come from far caches or memory, so the loads set the time.
constexpr int64_t kParallelValues = 1 << 13;
// Output columns one pass of the second product writes: four vectors, whole cache lines.
constexpr int64_t kBlock = 4 * kLanes;
// Ranks the first product computes together (one row's).
constexpr int64_t kRanks = 4;
// Rows of one group computed together: each weight vector loaded (and widened) once for
// all of them. Together or alone, a row's chains are the same.
constexpr int64_t kRowsTogether = 4;
// Column blocks ahead of the one computed that the second product asks the caches for.
constexpr int64_t kAhead = 4;

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// One module's part of one group's adapter: its ranks of A and its block of B.
struct Segment {
  int64_t rank_start, ranks, column, columns;
  int64_t b_offset;  // where its [ranks, columns] block starts in b
};

// A piece of work: rows [first, first + rows) of `rows` (one group) times one segment,
// for the segment's output columns [column_begin, column_end) (relative to the segment).
struct Task {
  int64_t group, first, rows, segment, column_begin, column_end;
  int64_t values;  // weight values it loads
};

// The low-rank product of N rows of one group for one segment added to their out rows,
// for the segment's columns [c_begin, c_end): t = x[row] · A^T over the segment's ranks
// into `low` (kRanks ranks at a time, their chains interleaved: each chain's order is as
// alone, the interleaving only hides the multiply-adds' latency; a step short of ranks
// repeats its last one and stores it once), then per block of kBlock output columns
// t · B, the block's vectors' chains interleaved over the segment's ranks in order.
// low holds N rows of `seg.ranks` floats.
template <typename T, int N>
void add_segment(T* const* targets, const T* const* xs, const T* ap, int64_t in, const T* bp,
                 const Segment& seg, int64_t c_begin, int64_t c_end, float* low) {
  const int64_t last = seg.rank_start + seg.ranks - 1;
  for (int64_t j0 = seg.rank_start; j0 <= last; j0 += kRanks) {
    const T* weights[kRanks];
    for (int64_t q = 0; q < kRanks; ++q) weights[q] = ap + std::min(j0 + q, last) * in;
    Vec sum[N][kRanks];
    for (int r = 0; r < N; ++r) {
      for (int64_t q = 0; q < kRanks; ++q) sum[r][q] = Vec(0.f);
    }
    // Whole vectors in a loop of fixed shape (the accumulators stay in registers), then
    // the inputs' tail, zero-padded: the same lanes' chains as one padded loop.
    const int64_t whole = in - in % kLanes;
    for (int64_t k = 0; k < whole; k += kLanes) {
      Vec w[kRanks];
      for (int64_t q = 0; q < kRanks; ++q) {
        prefetch(weights[q] + k + kRanks * in);  // the next kRanks ranks
        w[q] = load_full(weights[q] + k);
      }
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
      for (int64_t q = 0; q < kRanks && j0 + q <= last; ++q) {
        low[r * seg.ranks + j0 - seg.rank_start + q] =
            at::vec::vec_reduce_all<float>([](Vec p, Vec s) { return p + s; }, sum[r][q]);
      }
    }
  }
  constexpr int64_t kVectors = kBlock / kLanes;
  const int64_t ranks = seg.ranks, columns = seg.columns;
  const T* block = bp + seg.b_offset;
  alignas(64) float lanes_out[kBlock];
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kBlock) {
    const int64_t lanes = std::min(kBlock, c_end - c0);
    const int64_t vectors = (lanes + kLanes - 1) / kLanes;
    Vec sum[N][kVectors];
    for (int r = 0; r < N; ++r) {
      for (int64_t v = 0; v < kVectors; ++v) sum[r][v] = Vec(0.f);
    }
    if (vectors == kVectors) {
      for (int64_t j = 0; j < ranks; ++j) {
        const T* from = block + j * columns + c0;
        prefetch(from + kAhead * kBlock);
        prefetch(from + kAhead * kBlock + kBlock / 2);
        Vec w[kVectors];
        for (int64_t v = 0; v < kVectors; ++v) w[v] = load_full(from + v * kLanes);
        for (int r = 0; r < N; ++r) {
          const Vec scale(low[r * ranks + j]);
          for (int64_t v = 0; v < kVectors; ++v) sum[r][v] = at::vec::fmadd(scale, w[v], sum[r][v]);
        }
      }
    } else {
      for (int64_t j = 0; j < ranks; ++j) {
        const T* from = block + j * columns + c0;
        for (int64_t v = 0; v < vectors; ++v) {
          const Vec w = load_lanes(from + v * kLanes, std::min(kLanes, lanes - v * kLanes));
          for (int r = 0; r < N; ++r) {
            sum[r][v] = at::vec::fmadd(Vec(low[r * ranks + j]), w, sum[r][v]);
          }
        }
      }
    }
    for (int r = 0; r < N; ++r) {
      for (int64_t v = 0; v < vectors; ++v) sum[r][v].store(lanes_out + v * kLanes);
      T* target = targets[r] + seg.column + c0;
      for (int64_t l = 0; l < lanes; ++l) {
        target[l] = narrow<T>(widen(target[l]) + lanes_out[l]);
      }
    }
  }
}

// The tasks of a call in `bins` runs of consecutive tasks (a run per thread, its tasks in
// order) of about equal weight values: each task's run, and the most values a run loads.
// Consecutive tasks share a group's weights, so a weight is loaded by one thread where
// it can be.
int64_t assign(const std::vector<Task>& tasks, int64_t bins, std::vector<int64_t>& bin_of) {
  int64_t total = 0;
  for (const Task& task : tasks) total += task.values;
  std::vector<int64_t> load(bins, 0);
  bin_of.assign(tasks.size(), 0);
  int64_t before = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int64_t middle = before + tasks[i].values / 2;
    const int64_t bin = total == 0 ? 0 : std::min(bins - 1, middle * bins / total);
    bin_of[i] = bin;
    load[bin] += tasks[i].values;
    before += tasks[i].values;
  }
  return *std::max_element(load.begin(), load.end());
}

// The segment's task for columns [begin, end), with the values it loads.
inline Task segment_task(const Task& base, const Segment& seg, int64_t in, int64_t begin,
                         int64_t end) {
  Task task = base;
  task.column_begin = begin;
  task.column_end = end;
  task.values = seg.ranks * (in + end - begin);
  return task;
}

// A call's work: its tasks and the thread (bin) each runs on, `bins` threads in all.
struct Plan {
  std::vector<Task> tasks;
  std::vector<int64_t> bin_of;
  int64_t bins = 1;
};

// The call's tasks, one per (block of rows of one group, segment), in the groups' order.
// A call too small to pay for a parallel region runs on one thread. Where it has fewer
// blocks than twice the threads, a task's columns are split while that lowers the most
// one thread loads (each piece loads its segment's A again), so a lone row's adapter
// loads on every thread.
Plan plan(const std::vector<Task>& blocks, const std::vector<Segment>& segs,
          const std::vector<int64_t>& first_segment, int64_t in, int64_t threads) {
  Plan result;
  std::vector<Task>& tasks = result.tasks;
  int64_t total = 0;
  for (const Task& b : blocks) {
    for (int64_t s = first_segment[b.group]; s < first_segment[b.group + 1]; ++s) {
      const Segment& seg = segs[s];
      if (seg.ranks == 0 || seg.columns == 0) continue;
      Task base = b;
      base.segment = s;
      tasks.push_back(segment_task(base, seg, in, 0, seg.columns));
      total += tasks.back().values;
    }
  }
  if (threads < 2 || total < kParallelValues) {
    result.bin_of.assign(tasks.size(), 0);
    return result;
  }
  result.bins = std::min<int64_t>(threads, static_cast<int64_t>(tasks.size()));
  std::vector<int64_t>& bin_of = result.bin_of;
  int64_t most = assign(tasks, result.bins, bin_of);
  if (static_cast<int64_t>(blocks.size()) >= 2 * threads) return result;
  for (int64_t tries = 0; tries < 2 * threads; ++tries) {
    // Split the largest piece's columns in two at a block boundary, the pieces side by side.
    const auto largest = std::max_element(
        tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.values < y.values; });
    const Task whole = *largest;
    const int64_t width = whole.column_end - whole.column_begin;
    if (width < 2 * kBlock) break;
    const Segment& seg = segs[whole.segment];
    const int64_t middle = whole.column_begin + (width / kBlock + 1) / 2 * kBlock;
    std::vector<Task> split(tasks.begin(), largest);
    split.push_back(segment_task(whole, seg, in, whole.column_begin, middle));
    split.push_back(segment_task(whole, seg, in, middle, whole.column_end));
    split.insert(split.end(), largest + 1, tasks.end());
    std::vector<int64_t> split_bins;
    const int64_t next = assign(split, threads, split_bins);
    if (next >= most) break;
    tasks = std::move(split);
    bin_of = std::move(split_bins);
    result.bins = threads;
    most = next;
  }
  return result;
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
  const int64_t in = x.size(1);
  std::vector<Segment> segs;  // every group's, one after the other
  std::vector<int64_t> first_segment(groups + 1, 0);
  std::vector<Task> blocks;
  int64_t max_ranks = 1;
  for (int64_t g = 0; g < groups; ++g) {
    first_segment[g] = static_cast<int64_t>(segs.size());
    const at::Tensor& a = weights[3 * g];
    const at::Tensor& b = weights[3 * g + 1];
    const at::Tensor& segments = weights[3 * g + 2];
    const int64_t count = bounds[g + 1] - bounds[g];
    TORCH_CHECK(count >= 0, "lora_add: offsets must not decrease");
    if (count == 0 || a.dim() != 2 || a.size(0) == 0) continue;
    TORCH_CHECK(a.size(1) == in && a.is_contiguous() && b.is_contiguous() &&
                    a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
                "lora_add: group ", g, "'s A must be contiguous [R, ", in,
                "] and A, B in x's dtype");
    TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() &&
                    segments.dim() == 2 && segments.size(1) == 4,
                "lora_add: segments must be contiguous int64 [S, 4]");
    const int64_t* seg = segments.data_ptr<int64_t>();
    int64_t b_values = 0;
    for (int64_t s = 0; s < segments.size(0); ++s) {
      const int64_t rank_start = seg[4 * s], ranks = seg[4 * s + 1];
      const int64_t column = seg[4 * s + 2], columns = seg[4 * s + 3];
      segs.push_back({rank_start, ranks, column, columns, b_values});
      b_values += ranks * columns;
      TORCH_CHECK(rank_start >= 0 && ranks >= 0 && rank_start + ranks <= a.size(0) &&
                      column >= 0 && columns >= 0 && column + columns <= out.size(1) &&
                      b_values <= b.numel(),
                  "lora_add: group ", g, "'s segment ", s, " (", rank_start, ", ", ranks, ", ",
                  column, ", ", columns, ") lies outside A's ", a.size(0), " ranks, the ",
                  out.size(1), " outputs or B's ", b.numel(), " values");
      max_ranks = std::max(max_ranks, ranks);
    }
    for (int64_t p = bounds[g]; p < bounds[g + 1]; p += kRowsTogether) {
      blocks.push_back({g, p, std::min(kRowsTogether, bounds[g + 1] - p), -1, 0, 0, 0});
    }
  }
  first_segment[groups] = static_cast<int64_t>(segs.size());
  // Every group checked before any row is written; then the tasks in one parallel region,
  // each task's rows and columns written by the one thread that runs it.
  const int64_t threads = at::get_num_threads();
  const Plan work = plan(blocks, segs, first_segment, in, threads);
  const std::vector<Task>& tasks = work.tasks;
  const std::vector<int64_t>& bin_of = work.bin_of;
  const int64_t bins = work.bins;
  std::vector<float> low(tasks.size() * kRowsTogether * max_ranks);
  for_each_scalar_type(x, "lora_add", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
    auto run = [&](int64_t bin) {
      for (size_t i = 0; i < tasks.size(); ++i) {
        if (bin_of[i] != bin) continue;
        const Task& task = tasks[i];
        T* targets[kRowsTogether];
        const T* xs[kRowsTogether];
        for (int64_t r = 0; r < task.rows; ++r) {
          targets[r] = op + row_ids[task.first + r] * out_stride;
          xs[r] = xp + row_ids[task.first + r] * x_stride;
        }
        const T* ap = weights[3 * task.group].data_ptr<T>();
        const T* bp = weights[3 * task.group + 1].data_ptr<T>();
        const Segment& seg = segs[task.segment];
        float* task_low = low.data() + i * kRowsTogether * max_ranks;
        const int64_t b = task.column_begin, e = task.column_end;
        switch (task.rows) {
          case 4: add_segment<T, 4>(targets, xs, ap, in, bp, seg, b, e, task_low); break;
          case 3: add_segment<T, 3>(targets, xs, ap, in, bp, seg, b, e, task_low); break;
          case 2: add_segment<T, 2>(targets, xs, ap, in, bp, seg, b, e, task_low); break;
          default: add_segment<T, 1>(targets, xs, ap, in, bp, seg, b, e, task_low); break;
        }
      }
    };
    if (bins == 1) {
      run(0);
    } else {
      at::parallel_for(0, bins, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bin = begin; bin < end; ++bin) run(bin);
      });
    }
  });
}

}  // namespace

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) { m.impl("lora_add", &lora_add); }
