// The kept GGUF block kinds' vector pieces that the AVX512 paths share (quantized_kq.cpp's
// VNNI products and quantized_kq_amx.cpp's tiles): a group's operands from its codes, a
// panel's scales and offsets as floats, and the store of a block's sums into a segment's
// columns.
//
// Promises: operand<kBits, s>(codes) is the 64 bytes of inputs 4s .. 4s + 3 of the group's
// 16 outputs (one 32-bit lane each, the codes unsigned), and terms() the products
// Panels::terms makes, so that every path folds the same values.
// Never: runs before the caller asked the CPU for AVX512 (these are compiled for it).

#pragma once

#include "quantized_kq.h"

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_KQ_VNNI 1
#include <immintrin.h>

namespace cellbatch::kq {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

// Operand s of a group (inputs 4s .. 4s + 3 of its 16 outputs) from its codes `at`.
template <int kBits, int kS>
inline __m512i operand(const uint8_t* at) {
  const __m512i word = _mm512_loadu_si512(at + (kS / 2) * 64);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i q = kS % 2 == 0 ? _mm512_and_si512(word, low)
                          : _mm512_and_si512(_mm512_srli_epi32(word, 4), low);
  if constexpr (kBits == 5) {
    const __m512i high = _mm512_loadu_si512(at + 256);
    const __m512i moved = kS <= 4 ? _mm512_slli_epi32(high, 4 - kS) : _mm512_srli_epi32(high, kS - 4);
    q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x10)));
  } else if constexpr (kBits == 6) {
    const __m512i high = _mm512_loadu_si512(at + 256 + (kS / 4) * 64);
    constexpr int kShift = 2 * (kS % 4);
    const __m512i moved =
        kShift <= 4 ? _mm512_slli_epi32(high, 4 - kShift) : _mm512_srli_epi32(high, kShift - 4);
    q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  }
  return q;
}

// A panel's float16 terms as floats: group kinds' d and m (each group), K-quants' d and
// -dmin (Q6_K: d) of the block of 256 they are from, kept while the groups run through it.
struct Halves {
  __m512 d, second;
  int64_t block = -1;
};

// Sub-group `sub` of group g's 16 scales and offsets (the vector form of Panels::terms:
// the same products, so the same values). Always inlined: the compiler left it a call
// through the PLT in every group's fold, a fifth of a 1B model's decode.
[[gnu::always_inline]] inline void terms(const Panels& panels, int64_t p, int64_t g, int sub,
                                         Halves& halves, __m512* scale, __m512* offset) {
  const bool blocks = in_blocks(panels.kind);
  if (!blocks || halves.block != g / 8) {
    const uint8_t* h = panels.halves(p, g);
    halves.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    if (panels.kind != kQ6_K) {
      const __m512 second =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
      // K-quants: -dmin, so that o = (-dmin) mn, which is -(dmin mn) exactly.
      halves.second = blocks ? _mm512_sub_ps(_mm512_setzero_ps(), second) : second;
    }
    halves.block = blocks ? g / 8 : -1;
  }
  const __m512 d = halves.d;
  if (panels.kind == kQ6_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panels.small(p, g, sub)));
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  } else if (blocks) {
    const uint8_t* sm = panels.small(p, g, 0);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm));
    const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kPanel));
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    *offset = _mm512_mul_ps(halves.second, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
  } else {
    *scale = d;
    *offset = _mm512_sub_ps(halves.second, _mm512_mul_ps(_mm512_set1_ps(zero(panels.kind)), d));
  }
}

// The sums [n][16 kBlock] of rows m0 .. m0 + n - 1 and panels p0 .. (a block) into the
// segment's columns of y [M, out_features], rounded to T.
template <int64_t kBlock, typename T>
void store_block(const Panels& panels, const float* sums, int64_t m0, int64_t n, int64_t p0,
                 int64_t out_features, T* y) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t p = 0; p < kBlock && (p0 + p) * kPanel < panels.rows; ++p) {
      const int64_t start = (p0 + p) * kPanel;
      const int64_t width = std::min(kPanel, panels.rows - start);
      T* row = y + (m0 + r) * out_features + panels.column + start;
      const float* from = sums + (r * kBlock + p) * kPanel;
      for (int64_t c = 0; c < width; ++c) row[c] = static_cast<T>(from[c]);
    }
}

#pragma GCC pop_options

}  // namespace cellbatch::kq

#endif
