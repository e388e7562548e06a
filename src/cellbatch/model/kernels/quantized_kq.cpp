// `cellbatch::kquant_matmul_a8`: x [M, K] (float32 or bf16) times a weight kept in its GGUF
// block kinds (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; layout: quantized_kq.h), the
// inputs quantised to int8 per group of 32 as the int8 weights' `_a8` products quantise
// them (quantized_a8.cpp: d, sx, the codes xq and their sum qs of each group), with one
// scale d per block of 256 inputs where any segment is a K-quant kind, as llama.cpp's
// Q8_K inputs have it, so that a block's integer sums need one float step.
//
// Owns: the products' arithmetic on AVX512-VNNI CPUs and in portable code, and the op (the
// header's checks, one product per segment into its columns; AVX2 CPUs run
// quantized_kq_avx2.cpp). Per row (inputs xq, scale d), output n with codes q:
//   Q4_0 .. Q5_1, w = s q + o per group of 32 (`Panels::terms`), over the groups in order:
//     t = fma(float(dot), s * d, t); t = fma(o, sx, t),   dot = sum(q xq) over the group
//   Q4_K, Q5_K, w = D sc q - M mn (sc, mn per group; D, M per block of 256), per block:
//     t = fma(float(isum), D * d, t); t = fma(float(imin), (-M) * d, t),
//     isum = sum(sc dot), imin = sum(mn qs) over its 8 groups (|isum| < 2^26)
//   Q6_K, w = D sc (q - 32) (sc per sub-group h of 16, D per block), per block:
//     t = fma(float(isum), D * d, t),  isum = sum(sc_h (dot_h - 32 qs_h)) over its 16
//     sub-groups (|dot_h - 32 qs_h| <= 16 x 32 x 127, |isum| < 2^28)
// over the blocks in input order, every sum exact in int32 (qs: the sum of xq). VPDPBUSD
// takes the codes as they are (unsigned) and four inputs per lane: operand s of a group is inputs
// 4s .. 4s + 3 of the 16 outputs, one mask or shift of the nibbles and, for 5- and 6-bit
// kinds, one shift and mask of the high bits. Calls of up to 3 rows make the operands in
// registers; larger ones make a chunk of 256 inputs' operands and terms of three panels
// once, into a buffer that stays in L1, and run the rows over it, 4 at a time.
// Promises: y[m, n] is the same chain over the same values whatever the other rows of x,
// the path their count takes and the thread count; the VNNI path, the AVX2 one and the
// portable loop (CELLBATCH_A8_PORTABLE=1 runs it anywhere) give the same bits. Results are
// in x's dtype, bf16 rounded to nearest even.
// Never: changes the weights' numbers (only the activations are rounded), reads outside
// the segments the header names (the op checks every offset and size against the
// tensors), or allocates per row.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"
#include "quantized_a8.h"
#include "quantized_amx.h"
#include "quantized_kq.h"
#include "quantized_kq_vnni.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cellbatch::kq {
namespace {

// Rows from which `auto` takes the tiles: the group kinds' from 32; the K-quants' (whose
// tiles leave one float step per block) Q4_K and Q5_K's from 5, Q6_K's from 8 (its planes
// take longer to make). benchmarks/quantized.py --products --shapes 1b measures them.
constexpr int64_t kAmxMinRows = 32;
constexpr int64_t kBlockAmxMinRows = 5;
constexpr int64_t kSixAmxMinRows = 8;

// The portable loop over rows [0, count) and panels [p0, p1) of one segment.
template <typename T>
void product_portable(const Inputs& in, const Panels& panels, int64_t p0, int64_t p1,
                      int64_t out_features, T* y) {
  const a8::Quantised& xs = in.xs;
  const int64_t groups = panels.groups, in_features = xs.in_features, count = in.count();
  const Chain chain = chain_of(panels.kind);
  auto dot_of = [&](int64_t m, int64_t p, int c, int64_t g, int from, int to) {
    int32_t dot = 0;
    for (int k = from; k < to; ++k)
      dot += panels.code(p, g, c, k) * xs.q[m * in_features + g * kGroup + k];
    return dot;
  };
  for (int64_t m = 0; m < count; ++m)
    for (int64_t p = p0; p < p1; ++p)
      for (int c = 0; c < kPanel && p * kPanel + c < panels.rows; ++c) {
        float total = 0.0f;
        for (int64_t g0 = 0; chain == Chain::kBlock && g0 < groups; g0 += 8) {
          int32_t isum = 0, imin = 0;
          for (int64_t g = g0; g < g0 + 8; ++g) {
            isum += panels.scale_code(p, g, c) * dot_of(m, p, c, g, 0, kGroup);
            imin += panels.min_code(p, g, c) * xs.qsum[m * groups + g];
          }
          float d, negative_dmin;
          panels.block_halves(p, g0, c, &d, &negative_dmin);
          const float dx = xs.d[m * groups + g0];
          total = std::fma(static_cast<float>(isum), d * dx, total);
          total = std::fma(static_cast<float>(imin), negative_dmin * dx, total);
        }
        for (int64_t g0 = 0; chain == Chain::kSix && g0 < groups; g0 += 8) {
          int32_t isum = 0;
          for (int64_t g = g0; g < g0 + 8; ++g)
            for (int sub = 0; sub < 2; ++sub) {
              const int32_t qs = in.qs16[m * (in_features / 16) + 2 * g + sub];
              const int32_t exact = dot_of(m, p, c, g, 16 * sub, 16 * sub + 16) - 32 * qs;
              isum += panels.sub_scale(p, g, sub, c) * exact;
            }
          const float dx = xs.d[m * groups + g0];
          total = std::fma(static_cast<float>(isum), panels.block_d(p, g0, c) * dx, total);
        }
        for (int64_t g = 0; chain == Chain::kGroup && g < groups; ++g) {
          float scale, offset;
          panels.terms(p, g, c, &scale, &offset);
          total = std::fma(static_cast<float>(dot_of(m, p, c, g, 0, kGroup)),
                           scale * xs.d[m * groups + g], total);
          total = std::fma(offset, xs.sx[m * groups + g], total);
        }
        y[m * out_features + panels.column + p * kPanel + c] = static_cast<T>(total);
      }
}

#ifdef CELLBATCH_KQ_VNNI

bool vnni_available() { return a8::products_path() == a8::Path::kVnni; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

constexpr int64_t kBlock = 3;      // panels per block
constexpr int64_t kChunk = 256;    // inputs per buffer fill
constexpr int64_t kChunkGroups = kChunk / kGroup;
constexpr int64_t kRows = 4;       // rows per run over a buffer
constexpr int64_t kFusedRows = 3;  // calls of up to this many rows make operands in registers
constexpr int64_t kRowChunk = 64;  // rows per pass over a block
constexpr int64_t kAhead = 8;      // few-row path: codes asked for this many groups ahead
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
// kAhead groups on. The sources' reads are always inlined: left to the compiler, some were
// calls in every group's steps.
template <int kBits>
struct Direct {
  const Panels& panels;
  int64_t p0;
  template <int kS>
  [[gnu::always_inline]] __m512i get(int p, int64_t g) const {
    const uint8_t* at = panels.group_codes(p0 + p, g);
    if constexpr (kS == 0) {
      const char* ahead = reinterpret_cast<const char*>(panels.group_codes(p0 + p, g + kAhead));
      for (int line = 0; line < 4 + (kBits - 4); ++line)  // the group's 256, 320 or 384 bytes
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
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

template <int kBits, Chain kChain>
void fill(const Panels& panels, int64_t p0, int count, int64_t g0, int64_t g1, Buffer* buffer) {
  const Direct<kBits> direct{panels, p0};
  for (int p = 0; p < count; ++p) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* at = panels.group_codes(p0 + p, g);
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
// continue from group g0.
template <int R, int P, typename Source>
inline void groups_of_rows(const Source& source, const a8::Quantised& xs, int64_t m, int64_t g0,
                           int64_t g1, float* sums) {
  const int64_t groups = xs.in_features / kGroup;
  __m512 total[R][P];
  load_totals<R, P, kBlockWidth>(total, sums, g0 != 0);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i dot[R][P];
    clear(dot);
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
          t = fold_block(xs.qsum.data() + i, xs.d[i], isum[r][p], pairs, d, negative_dmin, t);
        }
        _mm512_storeu_ps(at, t);
      }
    }
  }
}

// R rows from m over P panels, groups [g0, g1): sums[r][16 P] continue from group g0.
template <int R, int P, int kBits, Chain kChain, typename Source>
void rows_over_groups(const Source& source, const Inputs& in, int64_t m, int64_t g0, int64_t g1,
                      float* sums) {
  if constexpr (kChain == Chain::kGroup)
    groups_of_rows<R, P>(source, in.xs, m, g0, g1, sums);
  else
    blocks_of_rows<R, P, kBits>(source, in, m, g0, g1, sums);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, int kBits, Chain kChain>
void block(const Panels& panels, const Inputs& in, int64_t m, int64_t count, int64_t p0,
           Buffer* buffer, float* sums) {
  const int64_t groups = panels.groups;
  if (count <= kFusedRows) {
    with_count<kFusedRows>(count, [&](auto rows) {
      rows_over_groups<decltype(rows)::value, P, kBits, kChain>(Direct<kBits>{panels, p0}, in, m,
                                                                0, groups, sums);
    });
    return;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kChunkGroups);
    fill<kBits, kChain>(panels, p0, P, g0, g1, buffer);
    const Buffered source{*buffer, g0};
    for (int64_t r = 0; r < count; r += kRows)
      with_count<kRows>(std::min(kRows, count - r), [&](auto rows) {
        rows_over_groups<decltype(rows)::value, P, kBits, kChain>(source, in, m + r, g0, g1,
                                                                  sums + r * kBlockWidth);
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
        store_block<kBlock>(panels, sums, m0, n, p0, out_features, y);
      });
}

#pragma GCC pop_options

template <typename T>
void product_vnni(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  const bool blocks = chain_of(panels.kind) == Chain::kBlock;
  switch (bits(panels.kind)) {
    case 4:
      return blocks ? product_vnni<4, Chain::kBlock>(in, panels, out_features, y)
                    : product_vnni<4, Chain::kGroup>(in, panels, out_features, y);
    case 5:
      return blocks ? product_vnni<5, Chain::kBlock>(in, panels, out_features, y)
                    : product_vnni<5, Chain::kGroup>(in, panels, out_features, y);
    default: return product_vnni<6, Chain::kSix>(in, panels, out_features, y);
  }
}

#else

bool vnni_available() { return false; }
template <typename T>
void product_vnni(const Inputs&, const Panels&, int64_t, T*) {}

#endif

// The weight's segments, each checked against the tensors' sizes.
std::vector<Panels> segments(const at::Tensor& codes, const at::Tensor& scales,
                             int64_t in_features, int64_t out_features) {
  constexpr const char* op = "kquant_matmul_a8";
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  scales.dim() == 1 && scales.scalar_type() == at::kByte && scales.is_contiguous(),
              op, ": codes and scales must be contiguous uint8 vectors (kquants.pack)");
  const auto* header = codes.data_ptr<uint8_t>();
  auto word = [&](int64_t i) {
    TORCH_CHECK((i + 1) * 4 <= codes.numel(), op, ": codes end inside the header");
    int32_t value;
    std::memcpy(&value, header + 4 * i, 4);
    return static_cast<int64_t>(value);
  };
  TORCH_CHECK(word(0) == kMagic, op, ": codes do not start with a kquant header");
  const int64_t count = word(1);
  TORCH_CHECK(word(2) == in_features, op, ": the weight has ", word(2), " inputs, x has ",
              in_features);
  TORCH_CHECK(count > 0 && in_features % kGroup == 0, op, ": no segments, or K not a multiple of 32");
  std::vector<Panels> out;
  int64_t column = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t kind = word(4 + 4 * i), rows = word(5 + 4 * i);
    const int64_t at = word(6 + 4 * i), scales_at = word(7 + 4 * i);
    TORCH_CHECK(kind >= 0 && kind < kKinds && rows > 0, op, ": segment ", i, " has kind ", kind,
                " and ", rows, " rows");
    const auto k = static_cast<Kind>(kind);
    TORCH_CHECK(!in_blocks(k) || in_features % kBlockInputs == 0, op, ": K-quant blocks need K a multiple of 256");
    const int64_t panel_count = (rows + kPanel - 1) / kPanel, groups = in_features / kGroup;
    TORCH_CHECK(at >= 0 && at + panel_count * groups * code_bytes(k) <= codes.numel() &&
                    scales_at >= 0 &&
                    scales_at + panel_count * scale_bytes(k, in_features) <= scales.numel(),
                op, ": segment ", i, " lies outside the codes or scales");
    out.push_back(Panels{k, rows, column, panel_count, groups, header + at,
                         scales.data_ptr<uint8_t>() + scales_at});
    column += rows;
  }
  TORCH_CHECK(column == out_features, op, ": the segments hold ", column, " outputs, not ",
              out_features);
  return out;
}

at::Tensor kquant_matmul_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1, "kquant_matmul_a8: x must have a last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kquant_matmul_a8: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t in_features = x.size(-1);
  const std::vector<Panels> parts = segments(codes, scales, in_features, out_features);
  const at::Tensor rows = x.reshape({-1, in_features}).contiguous();
  const int64_t count = rows.size(0);
  at::Tensor out = at::empty({count, out_features}, rows.options());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  if (count == 0) return out.view(shape);
  const a8::Path path = a8::products_path();
  const bool blocks = std::any_of(parts.begin(), parts.end(),
                                  [](const Panels& p) { return in_blocks(p.kind); });
  const a8::Quantised xs = a8::quantise_rows(rows, path, blocks ? kBlockInputs : kGroup);
  Inputs in{xs, {}};
  if (std::any_of(parts.begin(), parts.end(), [](const Panels& p) { return p.kind == kQ6_K; })) {
    in.qs16.resize(count * in_features / 16);
    for (size_t h = 0; h < in.qs16.size(); ++h) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 16; ++k) sum += xs.q[h * 16 + k];
      in.qs16[h] = sum;
    }
  }
  const bool vnni = path == a8::Path::kVnni && vnni_available();
  const bool amx = a8::amx_takes(count) && vnni;  // a bad CELLBATCH_AMX fails everywhere
  // CELLBATCH_AMX=always (amx_takes of one row) gives the tiles every segment.
  const bool always = amx && a8::amx_takes(1);
  auto tiles = [&](const Panels& panels) {
    if (!amx || always) return amx;
    switch (chain_of(panels.kind)) {
      case Chain::kGroup: return count >= kAmxMinRows;
      case Chain::kBlock: return count >= kBlockAmxMinRows;
      default: return count >= kSixAmxMinRows;
    }
  };
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* y = out.data_ptr<T>();
    for (const Panels& panels : parts) {
      if (tiles(panels)) {
        products_amx(in, panels, out_features, y);
      } else if (vnni) {
        product_vnni(in, panels, out_features, y);
      } else if (path == a8::Path::kAvx2) {
        products_avx2(in, panels, out_features, y);
      } else {
        at::parallel_for(0, panels.panel_count, 1, [&](int64_t begin, int64_t end) {
          product_portable(in, panels, begin, end, out_features, y);
        });
      }
    }
  };
  if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(float{});
  return out.view(shape);
}

}  // namespace
}  // namespace cellbatch::kq

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("kquant_matmul_a8", &cellbatch::kq::kquant_matmul_a8);
}
