// The kept GGUF block kinds' vector pieces that the AVX512 paths share (quantized_kq.cpp's
// VNNI products and quantized_kq_amx.cpp's tiles): a group's operands from its codes and
// a panel's scales and offsets as floats. (A block's sums go into a segment's columns by
// common.h's store_sums.)
//
// Promises: operand<kBits, s>(codes) is the 64 bytes of inputs 4s .. 4s + 3 of the group's
// 16 outputs (one 32-bit lane each, the codes unsigned); terms(), sub_scales(), block_d(),
// block_codes() and block_halves() the values Panels gives (read through Panels or through
// a Layout, the same addresses), and fold_block() the Q4_K/Q5_K chain's float step, so that
// every path folds the same values the same way.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

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

// Group g's 16 scales d and offsets m for the group kinds (the vector form of
// Panels::terms: the same values).
template <typename Source>
[[gnu::always_inline]] inline void terms(const Source& panels, int64_t p, int64_t g,
                                         __m512* scale, __m512* offset) {
  const uint8_t* h = panels.halves(p, g);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  const __m512 m = has_m(panels.kind)
                       ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)))
                       : _mm512_setzero_ps();
  *scale = d;
  *offset = m;
}

// v's lanes as floats, each |v| < 2^22: 1.5 2^23 + v is exact in float32, so one integer
// add and one float subtraction give them, on either vector port (VCVTDQ2PS takes port 0,
// beside the VPDPBUSDs).
[[gnu::always_inline]] inline __m512 small_to_float(__m512i v) {
  const __m512 biased = _mm512_castsi512_ps(_mm512_add_epi32(v, _mm512_set1_epi32(0x4B400000)));
  return _mm512_sub_ps(biased, _mm512_set1_ps(12582912.0f));
}

// Q6_K: sub-group `sub` of group g's 16 integer scales as floats (Panels::sub_scale), and
// the d of g's block (Panels::block_d).
template <typename Source>
[[gnu::always_inline]] inline __m512 sub_scales(const Source& panels, int64_t p, int64_t g,
                                                int sub) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panels.small(p, g, sub)));
  return small_to_float(_mm512_cvtepi8_epi32(sc));
}
template <typename Source>
[[gnu::always_inline]] inline __m512 block_d(const Source& panels, int64_t p, int64_t g) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panels.halves(p, g))));
}

// Q4_K and Q5_K: group g's 16 integer scales and mins as int32 lanes (Panels::scale_code,
// min_code) ...
template <typename Source>
[[gnu::always_inline]] inline void block_codes(const Source& panels, int64_t p, int64_t g,
                                               __m512i* sc, __m512i* mn) {
  const uint8_t* sm = panels.small(p, g, 0);
  *sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
  *mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kPanel)));
}
// ... the d and -dmin of g's block (Panels::block_halves) ...
template <typename Source>
[[gnu::always_inline]] inline void block_halves(const Source& panels, int64_t p, int64_t g,
                                                __m512* d, __m512* negative_dmin) {
  const uint8_t* h = panels.halves(p, g);
  *d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
  *negative_dmin = _mm512_sub_ps(_mm512_setzero_ps(), dmin);
}

// ... and the mins of the block from group g0 as int16 pairs: pairs[i] holds groups
// 2i and 2i + 1's in each output's 32-bit lane, for VPDPWSSD.
template <typename Source>
[[gnu::always_inline]] inline void block_min_pairs(const Source& panels, int64_t p, int64_t g0,
                                                   __m512i (&pairs)[4]) {
  for (int i = 0; i < 4; ++i) {
    const uint8_t* first = panels.small(p, g0 + 2 * i, 0) + kPanel;
    const uint8_t* second = panels.small(p, g0 + 2 * i + 1, 0) + kPanel;
    const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first)));
    const __m512i high = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(second)));
    pairs[i] = _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
  }
}

// The Q4_K/Q5_K chain's float step of one block for a row (its inputs' group sums in
// pairs `qs_pairs`, Inputs::qsum_pairs, and its scale dx) and 16 outputs: imin from the
// mins' pairs, then the two fmas onto t.
[[gnu::always_inline]] inline __m512 fold_block(const int32_t* qs_pairs, float dx, __m512i isum,
                                                const __m512i (&pairs)[4], __m512 d,
                                                __m512 negative_dmin, __m512 t) {
  __m512i imin = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i)
    imin = _mm512_dpwssd_epi32(imin, pairs[i], _mm512_set1_epi32(qs_pairs[i]));
  const __m512 row = _mm512_set1_ps(dx);
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, row), t);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(negative_dmin, row), t);
}

#pragma GCC pop_options

}  // namespace cellbatch::kq

#endif
