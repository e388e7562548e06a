// `kquant_matmul_a8` on AVX2 CPUs (without AVX512-VNNI): the same quantised inputs, terms
// and chain per output as quantized_kq.cpp's VNNI path and portable loop, with VPMADDUBSW
// in place of VPDPBUSD.
//
// Owns: the AVX2 arithmetic. VPMADDUBSW multiplies the unsigned codes by the signed inputs
// and adds adjacent pairs into int16 (at most 2 x 63 x 127 = 16,002: never saturates);
// VPMADDWD by ones adds those pairs into int32, so each lane holds the dot product of four
// codes of one output with four inputs, as a VPDPBUSD lane does. A panel's 16 outputs are
// two 8-lane halves; rows run two at a time over each panel, so a panel's codes stay in L1
// while every row of the call runs over them, and the first run asks for the next panel's
// into L2. Threads split the panels.
// Promises: y[m, n] is the portable loop's chain over the same values, so the same bits
// whatever the rows, their count and the threads.
// Never: runs on a CPU without AVX2, FMA and F16C, or where torch runs below the AVX2 width
// (a8::products_path() says kAvx2 only then), or allocates.

#include "quantized_kq.h"

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_KQ_AVX2 1
#include <immintrin.h>
#endif

namespace cellbatch::kq {

#ifdef CELLBATCH_KQ_AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

constexpr int kRows = 2;

// Operand kS of half j (outputs 8j .. 8j + 7) of a group, from its codes `at`.
template <int kBits, int kS>
inline __m256i operand(const uint8_t* at, int j) {
  const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + (kS / 2) * 64 + 32 * j));
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i q = kS % 2 == 0 ? _mm256_and_si256(word, low)
                          : _mm256_and_si256(_mm256_srli_epi32(word, 4), low);
  if constexpr (kBits == 5) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 256 + 32 * j));
    const __m256i moved = kS <= 4 ? _mm256_slli_epi32(high, 4 - kS) : _mm256_srli_epi32(high, kS - 4);
    q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
  } else if constexpr (kBits == 6) {
    const __m256i high = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(at + 256 + (kS / 4) * 64 + 32 * j));
    constexpr int kShift = 2 * (kS % 4);
    const __m256i moved =
        kShift <= 4 ? _mm256_slli_epi32(high, 4 - kShift) : _mm256_srli_epi32(high, kShift - 4);
    q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  }
  return q;
}

inline __m256 halves8(const uint8_t* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// Half j of group g's scales and offsets for the group kinds (Panels::terms, 8 lanes).
template <typename Source>
inline void terms(const Source& panels, int64_t p, int64_t g, int j, __m256* scale,
                  __m256* offset) {
  const uint8_t* h = panels.halves(p, g);
  const __m256 d = halves8(h + 16 * j);
  *scale = d;
  *offset = has_m(panels.kind) ? halves8(h + 32 + 16 * j) : _mm256_setzero_ps();
}

// Half j of a Q4_K/Q5_K group's integer scales or mins (`at`: its 16 bytes).
inline __m256i codes8(const uint8_t* at, int j) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8 * j)));
}

template <int R, int kBits, int kS>
inline void step(const uint8_t* at, const a8::Quantised& xs, int64_t m, int64_t g,
                 __m256i (&dot)[R][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i codes[2] = {operand<kBits, kS>(at, 0), operand<kBits, kS>(at, 1)};
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, xs.q.data() + (m + r) * xs.in_features + g * kGroup + 4 * kS, sizeof four);
    const __m256i x = _mm256_set1_epi32(four);
    for (int j = 0; j < 2; ++j)
      dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(codes[j], x), ones));
  }
}

template <int R, int kBits, int kFirst>
inline void steps4(const uint8_t* at, const a8::Quantised& xs, int64_t m, int64_t g,
                   __m256i (&dot)[R][2]) {
  step<R, kBits, kFirst>(at, xs, m, g, dot);
  step<R, kBits, kFirst + 1>(at, xs, m, g, dot);
  step<R, kBits, kFirst + 2>(at, xs, m, g, dot);
  step<R, kBits, kFirst + 3>(at, xs, m, g, dot);
}

// The group kinds' fold of group g's dots (started from -zero qs, quantized_kq.cpp's
// chain) into the totals: the offsets' step only where the kind keeps m.
template <int R, typename Source>
inline void fold(const Source& panels, const Inputs& in, int64_t p, int64_t m, int64_t g,
                 __m256i (&dot)[R][2], __m256 (&total)[R][2]) {
  const a8::Quantised& xs = in.xs;
  const int64_t groups = panels.groups;
  const bool offsets = has_m(panels.kind);
  for (int j = 0; j < 2; ++j) {
    __m256 scale, offset;
    terms(panels, p, g, j, &scale, &offset);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * groups + g;
      const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(xs.d[i]));
      total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][j]), row_scale, total[r][j]);
      if (offsets) total[r][j] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xs.sx[i]), total[r][j]);
    }
  }
}

// The K-quants' chains (quantized_kq.cpp) of R rows from m over panel p (asking for panel
// p + 1 as it goes where ask_next).
template <int R, int kBits, Chain kChain>
inline void blocks_over_panel(const Layout<kBits, kChain>& panels, const Inputs& in, int64_t m,
                              int64_t p, bool ask_next, __m256 (&total)[R][2]) {
  constexpr bool kSix = kBits == 6;
  const a8::Quantised& xs = in.xs;
  const int64_t groups = panels.groups;
  for (int64_t b = 0; b < groups; b += 8) {
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int64_t g = b; g < b + 8; ++g) {
      const uint8_t* at = panels.group_codes(p, g);
      if (ask_next) panels.ask_for(p + 1, g);
      // Q6_K: each sub-group of 16 (its dots less 32 qs) by its scale; else the group's.
      for (int sub = 0; sub < (kSix ? 2 : 1); ++sub) {
        __m256i dot[R][2];
        for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        if (!kSix || sub == 0) steps4<R, kBits, 0>(at, xs, m, g, dot);
        if (!kSix || sub == 1) steps4<R, kBits, 4>(at, xs, m, g, dot);
        for (int j = 0; j < 2; ++j) {
          const uint8_t* small = panels.small(p, g, sub) + 8 * j;
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(small));
          const __m256i sc = kSix ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
          for (int r = 0; r < R; ++r) {
            __m256i exact = dot[r][j];
            if constexpr (kSix) {
              const int32_t qs = in.qs16[((m + r) * groups + g) * 2 + sub];
              exact = _mm256_sub_epi32(exact, _mm256_set1_epi32(32 * qs));
            }
            isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_mullo_epi32(exact, sc));
          }
        }
      }
    }
    const uint8_t* h = panels.halves(p, b);
    for (int j = 0; j < 2; ++j) {
      const __m256 d = halves8(h + 16 * j);
      __m256 negative_dmin = _mm256_setzero_ps();
      __m256i pairs[4];  // Q4_K/Q5_K: groups 2i and 2i + 1's mins as int16 pairs, for VPMADDWD
      if constexpr (!kSix) {
        negative_dmin = _mm256_sub_ps(negative_dmin, halves8(h + 32 + 16 * j));
        for (int i = 0; i < 4; ++i) {
          const __m256i low = codes8(panels.small(p, b + 2 * i, 0) + kPanel, j);
          const __m256i high = codes8(panels.small(p, b + 2 * i + 1, 0) + kPanel, j);
          pairs[i] = _mm256_or_si256(low, _mm256_slli_epi32(high, 16));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xs.d[(m + r) * groups + b]);
        total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][j]), _mm256_mul_ps(d, dx), total[r][j]);
        if constexpr (kSix) continue;
        const int32_t* qs = xs.qsum.data() + (m + r) * groups + b;
        __m256i imin = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          const int32_t both = (qs[2 * i] & 0xFFFF) | (qs[2 * i + 1] << 16);
          imin = _mm256_add_epi32(imin, _mm256_madd_epi16(pairs[i], _mm256_set1_epi32(both)));
        }
        total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(negative_dmin, dx),
                                      total[r][j]);
      }
    }
  }
}

// R rows from m over panel p into y; where ask_next, asking for panel p + 1's codes and
// scales into L2 as it goes, for the rows' first run over that panel: the later runs find
// their panel in L1 or L2, the first one waited on memory for it.
template <int R, int kBits, Chain kChain, typename T>
void rows_over_panel(const Panels& panels, const Inputs& in, int64_t m, int64_t p, bool ask_next,
                     int64_t out_features, T* y) {
  const Layout<kBits, kChain> layout(panels);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  if constexpr (kChain != Chain::kGroup) blocks_over_panel<R>(layout, in, m, p, ask_next, total);
  for (int64_t g = 0; kChain == Chain::kGroup && g < panels.groups; ++g) {
    const uint8_t* at = layout.group_codes(p, g);
    if (ask_next) layout.ask_for(p + 1, g);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r)
      dot[r][0] = dot[r][1] = _mm256_set1_epi32(-zero(panels.kind) * in.xs.qsum[(m + r) * panels.groups + g]);
    steps4<R, kBits, 0>(at, in.xs, m, g, dot);
    steps4<R, kBits, 4>(at, in.xs, m, g, dot);
    fold<R>(layout, in, p, m, g, dot, total);
  }
  const int64_t width = std::min(kPanel, panels.rows - p * kPanel);
  for (int r = 0; r < R; ++r) {
    alignas(32) float sums[kPanel];
    _mm256_store_ps(sums, total[r][0]);
    _mm256_store_ps(sums + 8, total[r][1]);
    T* row = y + (m + r) * out_features + panels.column + p * kPanel;
    for (int64_t c = 0; c < width; ++c) row[c] = static_cast<T>(sums[c]);
  }
}

template <int kBits, Chain kChain, typename T>
void products(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  const int64_t count = in.count();
  at::parallel_for(0, panels.panel_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m = 0; m < count; m += kRows)
        with_count<kRows>(std::min<int64_t>(kRows, count - m), [&](auto rows) {
          rows_over_panel<decltype(rows)::value, kBits, kChain>(
              panels, in, m, p, m == 0 && p + 1 < end, out_features, y);
        });
  });
}

}  // namespace

template <typename T>
void products_avx2(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  with_kind(panels.kind, [&](auto kind_bits, auto chain) {
    products<decltype(kind_bits)::value, decltype(chain)::value>(in, panels, out_features, y);
  });
}

#pragma GCC pop_options

#else  // not x86-64 with GCC or Clang: a8::products_path() never says kAvx2

template <typename T>
void products_avx2(const Inputs&, const Panels&, int64_t, T*) {}

#endif

template void products_avx2(const Inputs&, const Panels&, int64_t, float*);
template void products_avx2(const Inputs&, const Panels&, int64_t, c10::BFloat16*);

}  // namespace cellbatch::kq
