// The int8-activation products on AVX2 CPUs (without AVX512-VNNI): the same quantised
// inputs and the same chain per output as quantized_a8.cpp's VNNI path and portable loop,
// with VPMADDUBSW in place of VPDPBUSD.
//
// Owns: the AVX2 arithmetic of `int4_matmul_a8` and `int8_matmul_a8`. VPMADDUBSW
// multiplies unsigned bytes by signed ones and adds adjacent pairs into int16; VPMADDWD
// by ones adds those pairs into int32, so each 32-bit lane holds the dot product of four
// codes of one output with four inputs, as one VPDPBUSD lane does. A pair never
// saturates int16: int4 codes are 0..15 (2 x 15 x 127 = 3,810), and an int8 code goes in
// as |code| with the input's sign moved onto it (VPSIGNB; 2 x 128 x 127 = 32,512), which
// gives the same exact dot product as the VNNI path's code + 128 and its correction.
// For int4 a group's eight pair sums per lane stay in int16 until the group ends (at most
// 8 x 3,810 = 30,480), so the widening add runs once a group, not once a step.
// A panel's 16 outputs are two 8-lane halves; rows run two at a time over each panel, so
// a panel's codes stay in L1 while every row of the call runs over them. Threads split
// the panels.
// Promises: y[m, n] is the portable loop's chain over the same values (exact int32 dots
// per group, then fma(dot, s d, t) and, for int4, fma(o, sx, t), groups in input order),
// so the same bits whatever the rows, their count and the threads; results rounded to T
// as the portable loop rounds them.
// Never: runs on a CPU without AVX2, FMA and F16C, or where torch runs below the AVX2
// width (`avx2_products_available` asks both, and the instructions live only in functions
// compiled for that target), or allocates.

#include "quantized_a8.h"

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_A8_AVX2 1
#include <immintrin.h>
#endif

namespace cellbatch::a8 {

#ifdef CELLBATCH_A8_AVX2

bool avx2_products_available() {
  static const bool available = __builtin_cpu_supports("avx2") &&
                                __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c") && torch_runs_avx2();
  return available;
}

// Everything below runs only after avx2_products_available() said yes.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

constexpr int kRows = 2;  // rows per pass over a panel: 4 int32 + 4 float accumulators

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A format's panels (its layout, quantized_a8.h) as the products read them:
// operands(p, b, h, codes, signs) gives, for each half j of panel p, the unsigned bytes of
// its 8 outputs' codes for inputs 8b + 4h .. 8b + 4h + 3 (in the order the quantised
// inputs are stored) and what signs the inputs take (inputs(x, signs[j])).
template <typename S>
struct Int4Panels : Int4Layout<S> {
  void operands(int64_t p, int64_t b, int h, __m256i* out, __m256i*) const {
    const int32_t* words = this->words(p, b);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 2; ++j) {
      const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8 * j));
      out[j] = _mm256_and_si256(h == 0 ? word : _mm256_srli_epi32(word, 4), nibble);
    }
  }
  static __m256i inputs(__m256i x, __m256i) { return x; }
};

template <typename S>
struct Int8Panels : Int8Layout<S> {
  void operands(int64_t p, int64_t b, int h, __m256i* out, __m256i* signs) const {
    const int8_t* quad = this->quad(p, 2 * b + h);
    for (int j = 0; j < 2; ++j) {
      signs[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32 * j));
      out[j] = _mm256_sign_epi8(signs[j], signs[j]);  // |code|
    }
  }
  static __m256i inputs(__m256i x, __m256i signs) { return _mm256_sign_epi8(x, signs); }
};

// R rows from m over panel p, into y.
template <int R, typename Panels, typename T>
void rows_over_panel(const Panels& panels, const Quantised& xs, int64_t m, int64_t p,
                     int64_t out_features, T* y) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t b = 4 * g; b < 4 * g + 4; ++b)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i codes[2], signs[2];
        panels.operands(p, b, h, codes, signs);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xs.q.data() + (m + r) * in_features + 8 * b + 4 * h, sizeof four);
          const __m256i x = _mm256_set1_epi32(four);
          for (int j = 0; j < 2; ++j) {
            const __m256i pairs = _mm256_maddubs_epi16(codes[j], Panels::inputs(x, signs[j]));
            if constexpr (Panels::kInt4) dot[r][j] = _mm256_add_epi16(dot[r][j], pairs);
            else dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    if constexpr (Panels::kInt4)  // the group's int16 pair sums, added into int32 once
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 2; ++j) dot[r][j] = _mm256_madd_epi16(dot[r][j], ones);
    const auto* group = panels.group(p, g);
    for (int j = 0; j < 2; ++j) {
      const __m256 scale = load8(group + 8 * j);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * groups + g;
        const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(xs.d[i]));
        total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][j]), row_scale, total[r][j]);
        if constexpr (Panels::kInt4)
          total[r][j] = _mm256_fmadd_ps(load8(group + kPanel + 8 * j), _mm256_set1_ps(xs.sx[i]),
                                        total[r][j]);
      }
    }
  }
  const int64_t width = std::min(kPanel, out_features - p * kPanel);
  for (int r = 0; r < R; ++r) {
    alignas(32) float sums[kPanel];
    _mm256_store_ps(sums, total[r][0]);
    _mm256_store_ps(sums + 8, total[r][1]);
    T* row = y + (m + r) * out_features + p * kPanel;
    for (int64_t c = 0; c < width; ++c) row[c] = static_cast<T>(sums[c]);
  }
}

template <typename Panels, typename T>
void products(const Panels& panels, const Quantised& xs, int64_t panel_count,
              int64_t out_features, T* y) {
  const int64_t count = static_cast<int64_t>(xs.d.size()) / (xs.in_features / kGroup);
  at::parallel_for(0, panel_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m = 0; m < count; m += kRows)
        with_count<kRows>(std::min<int64_t>(kRows, count - m), [&](auto rows) {
          rows_over_panel<decltype(rows)::value>(panels, xs, m, p, out_features, y);
        });
  });
}

}  // namespace

template <typename S, typename T>
void int4_products_avx2(const Quantised& xs, const int32_t* codes, const S* scales,
                        int64_t panel_count, int64_t out_features, T* y) {
  products(Int4Panels<S>{{codes, scales, xs.in_features}}, xs, panel_count, out_features, y);
}

template <typename S, typename T>
void int8_products_avx2(const Quantised& xs, const int8_t* codes, const S* scales,
                        int64_t panel_count, int64_t out_features, T* y) {
  products(Int8Panels<S>{{codes, scales, xs.in_features}}, xs, panel_count, out_features, y);
}

#pragma GCC pop_options

#else  // not x86-64 with GCC or Clang: the portable loop only

bool avx2_products_available() { return false; }

template <typename S, typename T>
void int4_products_avx2(const Quantised&, const int32_t*, const S*, int64_t, int64_t, T*) {}
template <typename S, typename T>
void int8_products_avx2(const Quantised&, const int8_t*, const S*, int64_t, int64_t, T*) {}

#endif

// The instances quantized_a8.cpp calls: activations float32 or bf16, scales float32 or
// float16.
template void int4_products_avx2(const Quantised&, const int32_t*, const float*, int64_t,
                                 int64_t, float*);
template void int4_products_avx2(const Quantised&, const int32_t*, const float*, int64_t,
                                 int64_t, c10::BFloat16*);
template void int4_products_avx2(const Quantised&, const int32_t*, const c10::Half*, int64_t,
                                 int64_t, float*);
template void int4_products_avx2(const Quantised&, const int32_t*, const c10::Half*, int64_t,
                                 int64_t, c10::BFloat16*);
template void int8_products_avx2(const Quantised&, const int8_t*, const float*, int64_t,
                                 int64_t, float*);
template void int8_products_avx2(const Quantised&, const int8_t*, const float*, int64_t,
                                 int64_t, c10::BFloat16*);
template void int8_products_avx2(const Quantised&, const int8_t*, const c10::Half*, int64_t,
                                 int64_t, float*);
template void int8_products_avx2(const Quantised&, const int8_t*, const c10::Half*, int64_t,
                                 int64_t, c10::BFloat16*);

}  // namespace cellbatch::a8
