// The tiles of cell_attention.cpp's flash-attention pass: how K/V cache rows are widened to
// float as the compute dtype would hold them, and the register-blocked arithmetic of one
// tile of kKeyTile keys (scores of a few query rows against the tile's transposed keys,
// and the weighted sum of its value rows).
//
// Promises: every score is one chain of fused multiply-adds over the head dimension in
// ascending order, and every value sum runs over ascending key positions, whatever the
// rows and vectors grouped together; load_row and load_int8_head give what `.to(T)` of
// the stored row would, widened exactly.
// Never: allocates, or reads past the n values (or the tile) it is given.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cellbatch::attention {

// Keys per tile: the unit of the online softmax, aligned on absolute positions (so it is
// part of the numerics: changing it changes results by rounding, never their invariance).
// 64 rather than 32 halves the per-tile bookkeeping of each score row.
constexpr int64_t kKeyTile = 64;
constexpr int64_t kTileVectors = kKeyTile / kLanes;
// Value columns accumulated together: R rows x kValueVectors accumulators.
constexpr int kValueVectors = 4;
static_assert(kKeyTile % kLanes == 0);

template <typename T>
inline void round_all(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<T>(x[i]);
  }
}

// A cache row as compute dtype T would hold it, widened to float. A bf16 or fp16 row is
// widened a vector at a time (exact, as the scalar widening): in a decode step each K/V row
// serves only the few query heads of its KV head, so widening it is most of attention's
// work, and the scalar loop did not vectorise.
template <typename T, typename C>
inline void load_row(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half>) {
    using Narrow = at::vec::Vectorized<C>;
    for (; i + Narrow::size() <= n; i += Narrow::size()) {
      const auto [low, high] = at::vec::convert_to_float<C>(Narrow::loadu(src + i));
      low.store(dst + i);
      high.store(dst + i + kLanes);
    }
  }
  for (; i < n; ++i) dst[i] = widen(src[i]);
  if constexpr (!std::is_same_v<T, C> && !std::is_same_v<T, float>) round_all<T>(dst, n);
}

// An int8 cache's head (dim codes, then a float32 scale) as compute dtype T would hold
// code * scale, widened to float.
template <typename T>
inline void load_int8_head(const int8_t* src, float* dst, int64_t n) {
  float scale;
  std::memcpy(&scale, src + n, sizeof scale);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  round_all<T>(dst, n);
}

// Asks for the cache lines of a row that will be read soon.
template <typename C>
inline void prefetch_row(const C* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < n * static_cast<int64_t>(sizeof(C)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

inline float sum_lanes(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, x);
}

inline float max_lanes(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x);
}

// scores[r][c0 * kLanes, (c0 + NC) * kLanes) = q[r] . keys, for R rows of q (dim floats
// apart) against the tile's keys transposed (keys_t[d][j], kKeyTile floats apart): one
// fused multiply-add per d, in ascending d, for every score.
template <int R, int NC>
inline void tile_scores_part(const float* q, int64_t dim, const float* keys_t, int64_t c0,
                             float* scores) {
  Vec acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec(0.f);
  for (int64_t d = 0; d < dim; ++d) {
    Vec qd[R];
    for (int r = 0; r < R; ++r) qd[r] = Vec(q[r * dim + d]);
    const float* k = keys_t + d * kKeyTile + c0 * kLanes;
    for (int c = 0; c < NC; ++c) {
      const Vec kc = Vec::loadu(k + c * kLanes);
      for (int r = 0; r < R; ++r) acc[r][c] = at::vec::fmadd(qd[r], kc, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c].store(scores + r * kKeyTile + (c0 + c) * kLanes);
}

// The scores of keys [a, b) of the tile (and of the other keys of their vectors), up to
// four vectors at a time: a sequence's last tile is seldom full.
template <int R>
inline void tile_scores(const float* q, int64_t dim, const float* keys_t, int64_t a, int64_t b,
                        float* scores) {
  constexpr int kPart = kTileVectors < 4 ? kTileVectors : 4;
  const int64_t end = (b + kLanes - 1) / kLanes;
  for (int64_t c0 = a / kLanes; c0 < end; c0 += kPart)
    cellbatch::with_count<kPart>(std::min<int64_t>(kPart, end - c0), [&](auto n) {
      tile_scores_part<R, decltype(n)::value>(q, dim, keys_t, c0, scores);
    });
}

// acc[r][d0, d0 + NV * kLanes) += sum over keys j in [j0, j1), ascending, of
// weights[r][j] * values[j][d0 ...], for R rows (acc rows dim floats apart).
template <int R, int NV>
inline void tile_values(const float* weights, const float* const* values, int64_t j0,
                        int64_t j1, float* acc, int64_t dim, int64_t d0) {
  Vec a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * dim + d0 + v * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = Vec(weights[r * kKeyTile + j]);
    const float* row = values[j] + d0;
    for (int v = 0; v < NV; ++v) {
      const Vec x = Vec::loadu(row + v * kLanes);
      for (int r = 0; r < R; ++r) a[r][v] = at::vec::fmadd(w[r], x, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v].store(acc + r * dim + d0 + v * kLanes);
}

template <int R>
inline void tile_values_all(const float* weights, const float* const* values, int64_t j0,
                            int64_t j1, float* acc, int64_t dim) {
  int64_t d0 = 0;
  for (; d0 + kValueVectors * kLanes <= dim; d0 += kValueVectors * kLanes)
    tile_values<R, kValueVectors>(weights, values, j0, j1, acc, dim, d0);
  for (; d0 + kLanes <= dim; d0 += kLanes) tile_values<R, 1>(weights, values, j0, j1, acc, dim, d0);
  for (; d0 < dim; ++d0)
    for (int r = 0; r < R; ++r)
      for (int64_t j = j0; j < j1; ++j)
        acc[r * dim + d0] += weights[r * kKeyTile + j] * values[j][d0];
}

}  // namespace cellbatch::attention
