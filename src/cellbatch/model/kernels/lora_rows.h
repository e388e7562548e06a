// The arithmetic of `lora_add` (lora.cpp) for a few rows of one group and one module:
// out[r] += (x[r] · A^T) · B over a segment's columns, widened to float and rounded once.
//
// Owns: the segments' layout (Segment), the per-task kernels add_segment (any dtype, A and
// B in it or in int8, any CPU kind) and add_segment_pairs (bf16 on AVX512), and their
// blocking constants.
// Promises: a row's outputs are the same bits whichever other rows share its task (up to
// kRowsTogether) and whichever columns the task covers: t = x · A runs one chain per rank
// over the inputs (in order; bf16 on AVX512: in the even/odd pairs a 32-value load takes),
// each output one chain over the ranks in order, in float32 lanes (bf16, fp16 and int8
// widened exactly), added to out and rounded to out's dtype once (to the nearest even).
// With int8 A and B, a rank's t is multiplied by its scale once, after its chain.
// Never: allocates, or reads values of x, A or B outside the task's rows and segment.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "common.h"

#include <immintrin.h>

#include <algorithm>

namespace cellbatch::lora_rows {

// kLanes values from p widened to float lanes (exactly: float, bf16, fp16 or int8).
template <typename T>
inline Vec load_full(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<T, int8_t>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
    alignas(64) float buffer[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) buffer[i] = static_cast<float>(p[i]);
    return Vec::loadu(buffer);
#endif
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

// target[0, kBlock) += sum, each value added in float and rounded to T once, a pair of
// vectors at a time (the same rounding as `narrow`, to the nearest even).
template <typename T>
inline void add_rounded(T* target, const Vec* sum) {
  for (int64_t v = 0; v < kBlock / kLanes; v += 2) {
    const Vec lo = load_full(target + v * kLanes) + sum[v];
    const Vec hi = load_full(target + (v + 1) * kLanes) + sum[v + 1];
    if constexpr (std::is_same_v<T, float>) {
      lo.store(target + v * kLanes);
      hi.store(target + (v + 1) * kLanes);
    } else {
      at::vec::convert_from_float<T>(lo, hi).store(target + v * kLanes);
    }
  }
}

// One module's part of one group's adapter: its ranks of A and its block of B.
struct Segment {
  int64_t rank_start, ranks, column, columns;
  int64_t b_offset;  // where its [ranks, columns] block starts in b
};

// The second product of add_segment (below): t · B for columns [c_begin, c_end) of the
// segment, t being N rows of `seg.ranks` floats in `low`.
template <typename T, typename W, int N>
void add_columns(T* const* targets, const W* bp, const Segment& seg, int64_t c_begin,
                 int64_t c_end, const float* low) {
  constexpr int64_t kVectors = kBlock / kLanes;
  const int64_t ranks = seg.ranks, columns = seg.columns;
  const W* block = bp + seg.b_offset;
  alignas(64) float lanes_out[kBlock];
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kBlock) {
    const int64_t lanes = std::min(kBlock, c_end - c0);
    const int64_t vectors = (lanes + kLanes - 1) / kLanes;
    Vec sum[N][kVectors];
    for (int r = 0; r < N; ++r) {
      for (int64_t v = 0; v < kVectors; ++v) sum[r][v] = Vec(0.f);
    }
    if (lanes == kBlock) {
      for (int64_t j = 0; j < ranks; ++j) {
        const W* from = block + j * columns + c0;
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
        const W* from = block + j * columns + c0;
        for (int64_t v = 0; v < vectors; ++v) {
          const Vec w = load_lanes(from + v * kLanes, std::min(kLanes, lanes - v * kLanes));
          for (int r = 0; r < N; ++r) {
            sum[r][v] = at::vec::fmadd(Vec(low[r * ranks + j]), w, sum[r][v]);
          }
        }
      }
    }
    for (int r = 0; r < N; ++r) {
      T* target = targets[r] + seg.column + c0;
      if (lanes == kBlock) {
        add_rounded(target, sum[r]);
        continue;
      }
      for (int64_t v = 0; v < vectors; ++v) sum[r][v].store(lanes_out + v * kLanes);
      for (int64_t l = 0; l < lanes; ++l) {
        target[l] = narrow<T>(widen(target[l]) + lanes_out[l]);
      }
    }
  }
}

// The low-rank product of N rows of one group for one segment added to their out rows,
// for the segment's columns [c_begin, c_end): t = x[row] · A^T over the segment's ranks
// (with int8 A and B, W = int8_t: each rank's t times rank_scales[rank], A's row scale
// times B's; other W, the activations' T, ignore rank_scales)
// into `low` (kRanks ranks at a time, their chains interleaved: each chain's order is as
// alone, the interleaving only hides the multiply-adds' latency; a step short of ranks
// repeats its last one and stores it once), then per block of kBlock output columns
// t · B, the block's vectors' chains interleaved over the segment's ranks in order.
// low holds N rows of `seg.ranks` floats.
template <typename T, typename W, int N>
void add_segment(T* const* targets, const T* const* xs, const W* ap, int64_t in, const W* bp,
                 const Segment& seg, int64_t c_begin, int64_t c_end, const float* rank_scales,
                 float* low) {
  const int64_t last = seg.rank_start + seg.ranks - 1;
  for (int64_t j0 = seg.rank_start; j0 <= last; j0 += kRanks) {
    const W* weights[kRanks];
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
      alignas(64) W w_tail[kRanks][kLanes] = {};
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
        float value =
            at::vec::vec_reduce_all<float>([](Vec p, Vec s) { return p + s; }, sum[r][q]);
        if constexpr (std::is_same_v<W, int8_t>) value *= rank_scales[j0 + q];
        low[r * seg.ranks + j0 - seg.rank_start + q] = value;
      }
    }
  }
  add_columns<T, W, N>(targets, bp, seg, c_begin, c_end, low);
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 rows on AVX512, where widening costs more than the multiply-adds: 32 values a
// load, split into the even-indexed ones (moved into the high half of their lanes) and
// the odd-indexed ones (their low neighbour cleared), each exact as float.
constexpr int64_t kPair = 32;
static_assert(kBlock == 2 * kPair, "a column block is two 32-value loads");
using BF16 = c10::BFloat16;

// Each 32-bit lane's high half: where a bf16 value sits as the float it widens to.
inline __m512i high_halves() { return _mm512_set1_epi32(static_cast<int>(0xffff0000u)); }

inline void widen_pairs(const BF16* p, __m512& even, __m512& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_halves()));
}

// v rounded to bf16 (to the nearest even, as `narrow`), left in the high half of each lane.
inline __m512i round_high(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd_bit = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd_bit, _mm512_set1_epi32(0x7fff)));
}

// `add_segment` for bf16: the first product's chains run over a row's inputs in the
// order even/odd pairs take them (every row's the same, alone or beside others, on any
// thread); the second product's are those of `add_segment`, column for column.
template <int N>
void add_segment_pairs(BF16* const* targets, const BF16* const* xs, const BF16* ap, int64_t in,
                       const BF16* bp, const Segment& seg, int64_t c_begin, int64_t c_end,
                       float* low) {
  const int64_t last = seg.rank_start + seg.ranks - 1;
  const int64_t whole = in - in % kPair;
  for (int64_t j0 = seg.rank_start; j0 <= last; j0 += kRanks) {
    const BF16* weights[kRanks];
    for (int64_t q = 0; q < kRanks; ++q) weights[q] = ap + std::min(j0 + q, last) * in;
    __m512 sum[N][kRanks];
    for (int r = 0; r < N; ++r) {
      for (int64_t q = 0; q < kRanks; ++q) sum[r][q] = _mm512_setzero_ps();
    }
    auto accumulate = [&](const BF16* const* w_at, const BF16* const* x_at) {
      __m512 even[kRanks], odd[kRanks];
      for (int64_t q = 0; q < kRanks; ++q) widen_pairs(w_at[q], even[q], odd[q]);
      for (int r = 0; r < N; ++r) {
        __m512 x_even, x_odd;
        widen_pairs(x_at[r], x_even, x_odd);
        for (int64_t q = 0; q < kRanks; ++q) {
          sum[r][q] = _mm512_fmadd_ps(x_even, even[q], sum[r][q]);
          sum[r][q] = _mm512_fmadd_ps(x_odd, odd[q], sum[r][q]);
        }
      }
    };
    for (int64_t k = 0; k < whole; k += kPair) {
      const BF16* w_at[kRanks];
      const BF16* x_at[N];
      for (int64_t q = 0; q < kRanks; ++q) {
        prefetch(weights[q] + k + kRanks * in);  // the next kRanks ranks
        w_at[q] = weights[q] + k;
      }
      for (int r = 0; r < N; ++r) x_at[r] = xs[r] + k;
      accumulate(w_at, x_at);
    }
    if (whole < in) {  // the inputs' tail, zero-padded
      alignas(64) BF16 w_tail[kRanks][kPair] = {};
      alignas(64) BF16 x_tail[N][kPair] = {};
      const BF16* w_at[kRanks];
      const BF16* x_at[N];
      for (int64_t i = 0; i < in - whole; ++i) {
        for (int64_t q = 0; q < kRanks; ++q) w_tail[q][i] = weights[q][whole + i];
        for (int r = 0; r < N; ++r) x_tail[r][i] = xs[r][whole + i];
      }
      for (int64_t q = 0; q < kRanks; ++q) w_at[q] = w_tail[q];
      for (int r = 0; r < N; ++r) x_at[r] = x_tail[r];
      accumulate(w_at, x_at);
    }
    for (int r = 0; r < N; ++r) {
      for (int64_t q = 0; q < kRanks && j0 + q <= last; ++q) {
        low[r * seg.ranks + j0 - seg.rank_start + q] = _mm512_reduce_add_ps(sum[r][q]);
      }
    }
  }
  const int64_t ranks = seg.ranks, columns = seg.columns;
  const BF16* block = bp + seg.b_offset;
  const int64_t whole_end = c_begin + (c_end - c_begin) / kBlock * kBlock;
  for (int64_t c0 = c_begin; c0 < whole_end; c0 += kBlock) {
    // sum[r][2h] and sum[r][2h + 1]: the even and odd columns of the block's half h.
    __m512 sum[N][4];
    for (int r = 0; r < N; ++r) {
      for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < ranks; ++j) {
      const BF16* from = block + j * columns + c0;
      prefetch(from + kAhead * kBlock);
      prefetch(from + kAhead * kBlock + kBlock / 2);
      __m512 w[4];
      widen_pairs(from, w[0], w[1]);
      widen_pairs(from + kPair, w[2], w[3]);
      for (int r = 0; r < N; ++r) {
        const __m512 scale = _mm512_set1_ps(low[r * ranks + j]);
        for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_fmadd_ps(scale, w[v], sum[r][v]);
      }
    }
    for (int r = 0; r < N; ++r) {
      BF16* target = targets[r] + seg.column + c0;
      for (int h = 0; h < 2; ++h) {
        __m512 even, odd;
        widen_pairs(target + h * kPair, even, odd);
        const __m512i low_half =
            _mm512_srli_epi32(round_high(_mm512_add_ps(even, sum[r][2 * h])), 16);
        const __m512i high_half =
            _mm512_and_si512(round_high(_mm512_add_ps(odd, sum[r][2 * h + 1])), high_halves());
        _mm512_storeu_si512(target + h * kPair, _mm512_or_si512(low_half, high_half));
      }
    }
  }
  if (whole_end < c_end) add_columns<BF16, BF16, N>(targets, bp, seg, whole_end, c_end, low);
}
#endif

}  // namespace cellbatch::lora_rows
