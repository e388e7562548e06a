// LoRA adapters' low-rank products added to a product's output: the op `cellbatch::lora_add`.
//
// Owns: the op: checking its arguments, cutting a call into tasks (a block of up to
// kRowsTogether rows of one group times one module, or part of a module's columns) and
// running them on the threads. The layout is cellbatch/model/lora.py's: per group a
// [R, K] (PEFT's lora_A of the modules the adapter targets in this product, concatenated
// along the rank), b each module's [rank, columns] block (its lora_B transposed, scaled)
// one after the other, segments int64 [S, 4] (rank_start, rank_count, column_start,
// column_count), and scales: empty where a and b are in x's dtype, float32 [R] where
// they are int8 (rank r's A row scale times its B row scale). The arithmetic of a task
// is lora_rows.h's.
// Promises: a row's result is the same bits whatever the other rows, the groups and the
// threads (lora_rows.h's chains). Every group is checked before any row is written; one
// parallel region covers the call, each output value computed by one thread (a few rows'
// modules split by columns so that every thread loads weights), and work too small to
// pay for the region stays on the calling thread. Rows not named in `rows` are not
// touched, so a row without an adapter costs nothing.
// Never: allocates per row or per group, or reads rows of x other than those named.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include "common.h"
#include "lora_rows.h"

#include <algorithm>

namespace {

using cellbatch::for_each_scalar_type;
using namespace cellbatch::lora_rows;

// A call's bookkeeping, on the stack for the few rows and modules of a decode step.
template <typename T>
using Small = c10::SmallVector<T, 16>;

// Weight values a call must load to pay for a parallel region: its start and end (a few
// us), the A loads a column split repeats on every thread, and the threads' uneven
// shares. A lone row's call with rank-16 adapters on every module (up to about 68k
// values) runs faster on the calling thread alone (docs/benchmarks.md#lora-adapters).
constexpr int64_t kParallelValues = 1 << 17;

// A piece of work: rows [first, first + rows) of `rows` (one group) times one segment,
// for the segment's output columns [column_begin, column_end) (relative to the segment).
struct Task {
  int64_t group, first, rows, segment, column_begin, column_end;
  int64_t values;  // weight values it loads
};

// The tasks of a call in `bins` runs of consecutive tasks (a run per thread, its tasks in
// order) of about equal weight values: each task's run, and the most values a run loads.
// Consecutive tasks share a group's weights, so a weight is loaded by one thread where
// it can be.
int64_t assign(const Small<Task>& tasks, int64_t bins, Small<int64_t>& bin_of) {
  int64_t total = 0;
  for (const Task& task : tasks) total += task.values;
  Small<int64_t> load(bins, 0);
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
  Small<Task> tasks;
  Small<int64_t> bin_of;
  int64_t bins = 1;
};

// The call's tasks, one per (block of rows of one group, segment), in the groups' order.
// A call too small to pay for a parallel region runs on one thread. Where it has fewer
// blocks than twice the threads, a task's columns are split while that lowers the most
// one thread loads (each piece loads its segment's A again), so a few rows' large
// adapter loads on every thread.
Plan plan(const Small<Task>& blocks, const Small<Segment>& segs,
          const Small<int64_t>& first_segment, int64_t in, int64_t threads) {
  Plan result;
  Small<Task>& tasks = result.tasks;
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
  Small<int64_t>& bin_of = result.bin_of;
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
    Small<Task> split(tasks.begin(), largest);
    split.push_back(segment_task(whole, seg, in, whole.column_begin, middle));
    split.push_back(segment_task(whole, seg, in, middle, whole.column_end));
    split.insert(split.end(), largest + 1, tasks.end());
    Small<int64_t> split_bins;
    const int64_t next = assign(split, threads, split_bins);
    if (next >= most) break;
    tasks = std::move(split);
    bin_of = std::move(split_bins);
    result.bins = threads;
    most = next;
  }
  return result;
}

// A task's rows through add_segment<T, W, rows>: the row count as a template argument.
template <typename T, typename W>
void add_rows(int64_t rows, T* const* targets, const T* const* xs, const W* ap, int64_t in,
              const W* bp, const Segment& seg, int64_t begin, int64_t end,
              const float* scales, float* low) {
  switch (rows) {
    case 4: add_segment<T, W, 4>(targets, xs, ap, in, bp, seg, begin, end, scales, low); break;
    case 3: add_segment<T, W, 3>(targets, xs, ap, in, bp, seg, begin, end, scales, low); break;
    case 2: add_segment<T, W, 2>(targets, xs, ap, in, bp, seg, begin, end, scales, low); break;
    default: add_segment<T, W, 1>(targets, xs, ap, in, bp, seg, begin, end, scales, low);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// add_rows for bf16 rows, A and B: add_segment_pairs.
void add_rows_pairs(int64_t rows, BF16* const* targets, const BF16* const* xs, const BF16* ap,
                    int64_t in, const BF16* bp, const Segment& seg, int64_t begin, int64_t end,
                    float* low) {
  switch (rows) {
    case 4: add_segment_pairs<4>(targets, xs, ap, in, bp, seg, begin, end, low); break;
    case 3: add_segment_pairs<3>(targets, xs, ap, in, bp, seg, begin, end, low); break;
    case 2: add_segment_pairs<2>(targets, xs, ap, in, bp, seg, begin, end, low); break;
    default: add_segment_pairs<1>(targets, xs, ap, in, bp, seg, begin, end, low);
  }
}
#endif

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
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * groups, "lora_add: ", groups,
              " groups need ", 4 * groups, " weight tensors, got ", weights.size());
  const int64_t* bounds = offsets.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[groups] == rows.size(0),
              "lora_add: offsets must run from 0 to the number of rows");
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "lora_add: row ", row_ids[i],
                " is outside the ", x.size(0), " rows");
  }
  const int64_t in = x.size(1);
  Small<Segment> segs;  // every group's, one after the other
  Small<int64_t> first_segment(groups + 1, 0);
  Small<Task> blocks;
  int64_t max_ranks = 1;
  for (int64_t g = 0; g < groups; ++g) {
    first_segment[g] = static_cast<int64_t>(segs.size());
    const at::Tensor& a = weights[4 * g];
    const at::Tensor& b = weights[4 * g + 1];
    const at::Tensor& segments = weights[4 * g + 2];
    const at::Tensor& scales = weights[4 * g + 3];
    const int64_t count = bounds[g + 1] - bounds[g];
    TORCH_CHECK(count >= 0, "lora_add: offsets must not decrease");
    if (count == 0 || a.dim() != 2 || a.size(0) == 0) continue;
    const bool quantised = scales.numel() > 0;
    const at::ScalarType held = quantised ? at::kChar : x.scalar_type();
    TORCH_CHECK(a.size(1) == in && a.is_contiguous() && b.is_contiguous() &&
                    a.scalar_type() == held && b.scalar_type() == held,
                "lora_add: group ", g, "'s A must be contiguous [R, ", in,
                "] and A, B in x's dtype (int8 where the group has scales)");
    TORCH_CHECK(!quantised || (scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                               scales.numel() == a.size(0)),
                "lora_add: group ", g, "'s scales must be contiguous float32 [", a.size(0), "]");
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
  const Small<Task>& tasks = work.tasks;
  const Small<int64_t>& bin_of = work.bin_of;
  const int64_t bins = work.bins;
  c10::SmallVector<float, 256> low(tasks.size() * kRowsTogether * max_ranks);
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
        const Segment& seg = segs[task.segment];
        float* task_low = low.data() + i * kRowsTogether * max_ranks;
        const int64_t b = task.column_begin, e = task.column_end;
        const at::Tensor& a = weights[4 * task.group];
        const at::Tensor& bw = weights[4 * task.group + 1];
        const at::Tensor& scales = weights[4 * task.group + 3];
        if (scales.numel() > 0) {
          add_rows<T, int8_t>(task.rows, targets, xs, a.data_ptr<int8_t>(), in,
                              bw.data_ptr<int8_t>(), seg, b, e, scales.data_ptr<float>(),
                              task_low);
          continue;
        }
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (std::is_same_v<T, BF16>) {
          add_rows_pairs(task.rows, targets, xs, a.data_ptr<T>(), in, bw.data_ptr<T>(), seg, b,
                         e, task_low);
          continue;
        }
#endif
        add_rows<T, T>(task.rows, targets, xs, a.data_ptr<T>(), in, bw.data_ptr<T>(), seg, b, e,
                       nullptr, task_low);
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
