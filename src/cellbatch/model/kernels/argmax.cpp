// The greedy draw of each row of a step's logits: the op `cellbatch::argmax_rows`.
//
// Owns: finding, per row, the index that torch's `max(dim=-1).indices` gives: the first
// maximal value, or the first NaN of a row that holds one. torch's CPU max with indices is
// a generic index reduction, several times slower than what it does here: one pass for the
// maximum, one that stops at its first occurrence.
// Promises: torch's indices exactly, for float32, bf16 and fp16 rows (widening to float is
// exact and keeps the order, the infinities and the NaNs), whatever the threads; each row
// is read on its own.
// Never: writes its input, or allocates per row.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace {

using cellbatch::for_each_scalar_type;
using cellbatch::kLanes;
using cellbatch::Vec;
using cellbatch::widen;

// Calls f(i, v) for every vector of `row` as floats (v holds values i .. i + kLanes - 1),
// and returns where the whole vectors end; f returns false to stop.
template <typename T, typename F>
int64_t each_vector(const T* row, int64_t n, F&& f) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kLanes <= n; i += kLanes)
      if (!f(i, Vec::loadu(row + i))) return -1;
  } else {
    using Narrow = at::vec::Vectorized<T>;
    static_assert(Narrow::size() == 2 * kLanes);
    for (; i + Narrow::size() <= n; i += Narrow::size()) {
      const auto [low, high] = at::vec::convert_to_float<T>(Narrow::loadu(row + i));
      if (!f(i, low) || !f(i + kLanes, high)) return -1;
    }
  }
  return i;
}

// The larger of two floats, NaN when either is.
inline float larger(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<float>::quiet_NaN()
                                        : std::max(a, b);
}

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  // The maximum, NaN when the row holds one (at::vec::maximum propagates NaN).
  Vec top(-std::numeric_limits<float>::infinity());
  const int64_t tail = each_vector(row, n, [&](int64_t, Vec v) {
    top = at::vec::maximum(top, v);
    return true;
  });
  alignas(64) float lanes[kLanes];
  top.store(lanes);
  float best = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) best = larger(best, lane);
  for (int64_t i = tail; i < n; ++i) best = larger(best, widen(row[i]));
  // Its first occurrence: the first lane equal to it, or unequal to itself for NaN
  // (zero_mask sets the bits of the lanes where a compare is false).
  const bool nan = std::isnan(best);
  const Vec wanted(best);
  constexpr int kAllLanes = (1 << kLanes) - 1;
  int64_t found = -1;
  const int64_t scanned = each_vector(row, n, [&](int64_t i, Vec v) {
    const int hits = nan ? (v == v).zero_mask() : ~(v == wanted).zero_mask() & kAllLanes;
    if (hits == 0) return true;
    found = i + __builtin_ctz(static_cast<unsigned>(hits));
    return false;
  });
  if (scanned < 0) return found;
  for (int64_t i = scanned; i < n; ++i) {
    const float value = widen(row[i]);
    if (nan ? std::isnan(value) : value == best) return i;
  }
  return n - 1;  // not reached: the maximum is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0,
              "argmax_rows: logits must be [rows, vocab] with vocab > 0, got ", logits.sizes());
  TORCH_CHECK(logits.device().is_cpu(), "argmax_rows: logits must be a CPU tensor");
  const at::Tensor rows_view = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = rows_view.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* indices = out.data_ptr<int64_t>();
  for_each_scalar_type(logits, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* base = rows_view.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) indices[r] = row_argmax(base + r * stride, vocab);
    });
  });
  return out;
}

}  // namespace

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
