// The kept GGUF block kinds' products (`kquant_matmul_a8`) on AVX512-VNNI CPUs: quantized_kq.cpp
// calls them for every call the tiles do not take.
//
// Owns: the VNNI arithmetic of quantized_kq.cpp's chains. VPDPBUSD takes the codes as they
// are (unsigned) and four inputs per lane: operand s of a group is inputs 4s .. 4s + 3 of
// the 16 outputs (quantized_kq_vnni.h). Calls of up to 3 rows make the operands in
// registers, one panel after another; larger ones make one K-quant block's (256 inputs')
// operands and terms of three panels once, into a buffer that stays in L1, and run the
// rows over it, 4 at a time, while the blocks two fills on come into L2.
// Promises: the portable loop's chain over the same exact values, so the same bits whatever
// the rows, their count and the threads.
// Never: runs unless vnni_products_available() said yes, or allocates per row.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "common.h"
#include "quantized_kq.h"
#include "quantized_kq_vnni.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace cellbatch::kq {

#ifdef CELLBATCH_KQ_VNNI

bool vnni_products_available() { return a8::products_path() == a8::Path::kVnni; }

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

constexpr int64_t kBlock = 3;      // panels per block
constexpr int64_t kChunk = 256;    // inputs per buffer fill
constexpr int64_t kChunkGroups = kChunk / kGroup;
constexpr int64_t kRows = 4;       // rows per run over a buffer
constexpr int64_t kFusedRows = 3;  // calls of up to this many rows make operands in registers
constexpr int64_t kRowChunk = 256;  // rows per pass over a block: one buffer fill serves them
constexpr int64_t kAhead = 32;     // few-row path: codes asked for this many groups ahead
constexpr int64_t kFillAhead = 2 * kChunkGroups;  // buffered path: the same, two fills ahead
constexpr int64_t kBlockWidth = kBlock * kPanel;

// A chunk of a block's operands and terms, for the rows to run over: one K-quant block.
struct alignas(64) Buffer {
  __m512i operands[kChunkGroups][8][kBlock];
  __m512 scales[kChunkGroups][2][kBlock];  // the group kinds' [g][0]; Q4_K's sc; Q6_K's [g][sub]
  __m512 offsets[kChunkGroups][kBlock];    // the group kinds'
  __m512i min_pairs[kBlock][4];            // Q4_K, Q5_K
  __m512 d[kBlock], negative_dmin[kBlock];  // the K-quants' block
};
static_assert(kChunkGroups * kGroup == kBlockInputs);

// Operands and terms straight from the panels (the few-row path), asking for the codes
// kAhead groups on (8 KiB of Q4_K, 12 of Q6_K: past a panel's end, the next panel's), into
// L2: asked into L1, the requests held the miss buffers that the loads themselves need
// (docs/benchmarks.md#scale-models). The sources' reads are always inlined: left to the
// compiler, some were calls in every group's steps.
template <int kBits, Chain kChain>
struct Direct {
  Layout<kBits, kChain> panels;
  int64_t p0;
  template <int kS>
  [[gnu::always_inline]] __m512i get(int p, int64_t g) const {
    const uint8_t* at = panels.group_codes(p0 + p, g);
    if constexpr (kS == 0) panels.ask_for_codes(p0 + p, g + kAhead);
    return operand<kBits, kS>(at);
  }
  [[gnu::always_inline]] void terms_of(int p, int64_t g, __m512* scale, __m512* offset) const {
    terms(panels, p0 + p, g, scale, offset);
  }
  [[gnu::always_inline]] __m512 scales_of(int p, int64_t g, int sub) const {
    if constexpr (kBits == 6) return sub_scales(panels, p0 + p, g, sub);
    __m512i sc, mn;
    block_codes(panels, p0 + p, g, &sc, &mn);
    return small_to_float(sc);
  }
  [[gnu::always_inline]] void block_of(int p, int64_t g0, __m512* d, __m512* negative_dmin,
                                       __m512i (&pairs)[4]) const {
    block_halves(panels, p0 + p, g0, d, negative_dmin);
    block_min_pairs(panels, p0 + p, g0, pairs);
  }
  [[gnu::always_inline]] __m512 d_of(int p, int64_t g0) const { return block_d(panels, p0 + p, g0); }
};

// Operands and terms from a filled Buffer (groups from g0).
struct Buffered {
  const Buffer& buffer;
  int64_t g0;
  template <int kS>
  [[gnu::always_inline]] __m512i get(int p, int64_t g) const {
    return _mm512_load_si512(&buffer.operands[g - g0][kS][p]);
  }
  [[gnu::always_inline]] void terms_of(int p, int64_t g, __m512* scale, __m512* offset) const {
    *scale = buffer.scales[g - g0][0][p];
    *offset = buffer.offsets[g - g0][p];
  }
  [[gnu::always_inline]] __m512 scales_of(int p, int64_t g, int sub) const {
    return buffer.scales[g - g0][sub][p];
  }
  [[gnu::always_inline]] void block_of(int p, int64_t, __m512* d, __m512* negative_dmin,
                                       __m512i (&pairs)[4]) const {
    *d = buffer.d[p];
    *negative_dmin = buffer.negative_dmin[p];
    for (int i = 0; i < 4; ++i) pairs[i] = buffer.min_pairs[p][i];
  }
  [[gnu::always_inline]] __m512 d_of(int p, int64_t) const { return buffer.d[p]; }
};

// Groups [g0, g1) of `count` panels from p0 into the buffer, asking for the groups
// kFillAhead on (two fills later; past a panel's end, those of the same panel of the next
// block, which a thread's run of blocks takes next), into L2: the rows' runs in between
// hide the latency the fill otherwise waits on, from memory or L3 alike. Asked into L1,
// they gained nothing measurable (docs/benchmarks.md#fill-ahead).
template <int kBits, Chain kChain>
void fill(const Panels& panels, int64_t p0, int count, int64_t g0, int64_t g1, Buffer* buffer) {
  const Layout<kBits, kChain> layout(panels);
  const Direct<kBits, kChain> direct{layout, p0};
  for (int p = 0; p < count; ++p) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t ahead_p = p0 + p, ahead_g = g + kFillAhead;
      if (ahead_g >= panels.groups) ahead_p += count, ahead_g -= panels.groups;
      if (ahead_p < panels.panel_count && ahead_g < panels.groups) layout.ask_for(ahead_p, ahead_g);
      const uint8_t* at = layout.group_codes(p0 + p, g);
      auto& ops = buffer->operands[g - g0];
      ops[0][p] = operand<kBits, 0>(at);
      ops[1][p] = operand<kBits, 1>(at);
      ops[2][p] = operand<kBits, 2>(at);
      ops[3][p] = operand<kBits, 3>(at);
      ops[4][p] = operand<kBits, 4>(at);
      ops[5][p] = operand<kBits, 5>(at);
      ops[6][p] = operand<kBits, 6>(at);
      ops[7][p] = operand<kBits, 7>(at);
      if constexpr (kChain == Chain::kGroup) {
        direct.terms_of(p, g, &buffer->scales[g - g0][0][p], &buffer->offsets[g - g0][p]);
      } else {
        for (int sub = 0; sub < subs(panels.kind); ++sub)
          buffer->scales[g - g0][sub][p] = direct.scales_of(p, g, sub);
      }
    }
    if constexpr (kChain == Chain::kBlock)
      direct.block_of(p, g0, &buffer->d[p], &buffer->negative_dmin[p], buffer->min_pairs[p]);
    if constexpr (kChain == Chain::kSix) buffer->d[p] = direct.d_of(p, g0);
  }
}

// dot[r][p] += operand kS of each panel times rows m + r's inputs 4 kS .. of group g.
template <int R, int P, int kS, typename Source>
inline void step(const Source& source, const a8::Quantised& xs, int64_t m, int64_t g,
                 __m512i (&dot)[R][P]) {
  __m512i codes[P];
#pragma GCC unroll 3
  for (int p = 0; p < P; ++p) codes[p] = source.template get<kS>(p, g);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, xs.q.data() + (m + r) * xs.in_features + g * kGroup + 4 * kS, sizeof four);
    const __m512i inputs = _mm512_set1_epi32(four);
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], codes[p], inputs);
  }
}

template <int R, int P>
inline void clear(__m512i (&dot)[R][P]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) dot[r][p] = _mm512_setzero_si512();
}

template <int R, int P, int kFirst, typename Source>
inline void steps4(const Source& source, const a8::Quantised& xs, int64_t m, int64_t g,
                   __m512i (&dot)[R][P]) {
  step<R, P, kFirst>(source, xs, m, g, dot);
  step<R, P, kFirst + 1>(source, xs, m, g, dot);
  step<R, P, kFirst + 2>(source, xs, m, g, dot);
  step<R, P, kFirst + 3>(source, xs, m, g, dot);
}

// The group kinds' chain of R rows from m over P panels, groups [g0, g1): sums[r][16 P]
// continue from group g0. kOffsets: the kind keeps m (Q4_1, Q5_1); else its codes count
// from `zero`.
template <int R, int P, bool kOffsets, typename Source>
inline void groups_of_rows(const Source& source, const a8::Quantised& xs, int32_t zero, int64_t m,
                           int64_t g0, int64_t g1, float* sums) {
  const int64_t groups = xs.in_features / kGroup;
  __m512 total[R][P];
  load_totals<R, P, kBlockWidth>(total, sums, g0 != 0);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i dot[R][P];
    if constexpr (kOffsets) {
      clear(dot);
    } else {  // the codes' zero taken off in the integers: no float step for it per panel
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i minus = _mm512_set1_epi32(-zero * xs.qsum[(m + r) * groups + g]);
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) dot[r][p] = minus;
      }
    }
    steps4<R, P, 0>(source, xs, m, g, dot);
    steps4<R, P, 4>(source, xs, m, g, dot);
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) {
      __m512 scale, offset;
      source.terms_of(p, g, &scale, &offset);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * groups + g;
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(xs.d[i]));
        total[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]), row_scale, total[r][p]);
        if constexpr (kOffsets)
          total[r][p] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs.sx[i]), total[r][p]);
      }
    }
  }
  store_totals<R, P, kBlockWidth>(total, sums);
}

// The K-quants' chains of R rows from m over P panels, whole blocks of groups [g0, g1):
// sums[r][16 P] continue from group g0. isum is summed in float32 over runs whose sum
// stays an integer below 2^24, so exactly, then in int32: a conversion and an FMA per
// group (Q6_K: sub-group) and panel, where VPMULLD would take two uops of port 0, the port
// the VPDPBUSDs wait on. Runs: Q4_K 4 groups (4 x 63 x 32 x 15 x 127 < 2^24), Q5_K 2,
// Q6_K one group's 2 sub-groups (2 x 128 x 16 x 32 x 127).
template <int R, int P, int kBits, typename Source>
inline void blocks_of_rows(const Source& source, const Inputs& in, int64_t m, int64_t g0,
                           int64_t g1, float* sums) {
  constexpr bool kSix = kBits == 6;
  constexpr int64_t kRun = kBits == 4 ? 4 : kBits == 5 ? 2 : 1;
  const a8::Quantised& xs = in.xs;
  const int64_t groups = xs.in_features / kGroup;
  for (int64_t b = g0; b < g1; b += 8) {
    __m512i isum[R][P];
    for (int64_t run = b; run < b + 8; run += kRun) {
      __m512 exact[R][P];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) exact[r][p] = _mm512_setzero_ps();
      // The dots of inputs [16 half, 16 half + 16) of group g (Q6_K's sub-group `half`),
      // minus Q6_K's 32 qs, times their scale, onto exact.
      auto add = [&](int64_t g, int half, const __m512i (&dot)[R][P]) {
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) {
          const __m512 sc = source.scales_of(p, g, half);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            __m512i value = dot[r][p];
            if constexpr (kSix) {
              const int32_t qs = in.qs16[((m + r) * groups + g) * 2 + half];
              value = _mm512_sub_epi32(value, _mm512_set1_epi32(32 * qs));
            }
            exact[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(value), sc, exact[r][p]);
          }
        }
      };
      for (int64_t g = run; g < run + kRun; ++g) {
        __m512i dot[R][P];
        clear(dot);
        steps4<R, P, 0>(source, xs, m, g, dot);
        if constexpr (kSix) {  // the first 16 inputs are a sub-group of their own
          add(g, 0, dot);
          clear(dot);
        }
        steps4<R, P, 4>(source, xs, m, g, dot);
        add(g, kSix ? 1 : 0, dot);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) {
          const __m512i whole = _mm512_cvtps_epi32(exact[r][p]);
          isum[r][p] = run == b ? whole : _mm512_add_epi32(isum[r][p], whole);
        }
    }
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) {
      __m512 d, negative_dmin;
      __m512i pairs[4];
      if constexpr (kSix) d = source.d_of(p, b);
      else source.block_of(p, b, &d, &negative_dmin, pairs);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* at = sums + r * kBlockWidth + p * kPanel;
        __m512 t = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(at);
        const int64_t i = (m + r) * groups + b;
        if constexpr (kSix) {
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xs.d[i]));
          t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][p]), scale, t);
        } else {
          t = fold_block(in.qsum_pairs.data() + i / 2, xs.d[i], isum[r][p], pairs, d, negative_dmin, t);
        }
        _mm512_storeu_ps(at, t);
      }
    }
  }
}

// R rows from m over P panels of `kind`, groups [g0, g1): sums[r][16 P] continue from
// group g0.
template <int R, int P, int kBits, Chain kChain, typename Source>
void rows_over_groups(const Source& source, const Inputs& in, Kind kind, int64_t m, int64_t g0,
                      int64_t g1, float* sums) {
  if constexpr (kChain != Chain::kGroup)
    blocks_of_rows<R, P, kBits>(source, in, m, g0, g1, sums);
  else if (has_m(kind))
    groups_of_rows<R, P, true>(source, in.xs, 0, m, g0, g1, sums);
  else
    groups_of_rows<R, P, false>(source, in.xs, zero(kind), m, g0, g1, sums);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, int kBits, Chain kChain>
void block(const Panels& panels, const Inputs& in, int64_t m, int64_t count, int64_t p0,
           Buffer* buffer, float* sums) {
  const int64_t groups = panels.groups;
  if (count <= kFusedRows) {
    // Panel by panel: the codes a thread reads are then one stream through memory (a
    // panel's groups are contiguous, and so are the panels), which the prefetches run
    // ahead of, where the block's three panels at once were three streams.
    const Layout<kBits, kChain> layout(panels);
    with_count<kFusedRows>(count, [&](auto rows) {
      for (int p = 0; p < P; ++p)
        rows_over_groups<decltype(rows)::value, 1, kBits, kChain>(
            Direct<kBits, kChain>{layout, p0 + p}, in, panels.kind, m, 0, groups, sums + p * kPanel);
    });
    return;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kChunkGroups);
    fill<kBits, kChain>(panels, p0, P, g0, g1, buffer);
    const Buffered source{*buffer, g0};
    for (int64_t r = 0; r < count; r += kRows)
      with_count<kRows>(std::min(kRows, count - r), [&](auto rows) {
        rows_over_groups<decltype(rows)::value, P, kBits, kChain>(source, in, panels.kind, m + r,
                                                                  g0, g1, sums + r * kBlockWidth);
      });
  }
}

template <int kBits, Chain kChain, typename T>
void product_vnni(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  for_each_block<Buffer, kBlock, kRowChunk, kFusedRows>(
      in.count(), panels.panel_count,
      [&](auto width, int64_t m0, int64_t n, int64_t p0, Buffer* buffer, float* sums) {
        block<decltype(width)::value, kBits, kChain>(panels, in, m0, n, p0, buffer, sums);
      },
      [&](int64_t m0, int64_t n, int64_t p0, const float* sums) {
        store_sums<kBlock>(sums, m0, n, p0, panels.rows, out_features, y + panels.column);
      });
}

#pragma GCC pop_options

}  // namespace

template <typename T>
void products_vnni(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  with_kind(panels.kind, [&](auto kind_bits, auto chain) {
    product_vnni<decltype(kind_bits)::value, decltype(chain)::value>(in, panels, out_features, y);
  });
}

#else  // not x86-64 with GCC or Clang: no VNNI products

bool vnni_products_available() { return false; }
template <typename T>
void products_vnni(const Inputs&, const Panels&, int64_t, T*) {}

#endif

template void products_vnni(const Inputs&, const Panels&, int64_t, float*);
template void products_vnni(const Inputs&, const Panels&, int64_t, c10::BFloat16*);

}  // namespace cellbatch::kq
