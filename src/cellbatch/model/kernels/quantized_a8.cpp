// The quantised products with activations quantised to int8: `cellbatch::int4_matmul_a8`
// for the int4 panels of quantized_matmul.cpp and `cellbatch::int8_matmul_a8` for int8
// panels laid out for it, with float32 or bfloat16 activations x [M, K].
//
// Owns: the products over each row's inputs quantised per group g of 32 inputs (the
// weights' groups; quantized_a8_inputs.cpp: scale d, sum sx, codes xq): for each output n
// with the group's scale s (int4: and offset o, w = q s + o):
//   int4: y = chain over g in input order of: t = fma(float(dot), s * d, t); t = fma(o, sx, t)
//   int8: y = chain over g in input order of: t = fma(float(dot), s * d, t)
// where dot = sum(q xq) over the group, exact in int32. So a row costs 8 VPDPBUSD per
// group of 32 inputs and 16 outputs (64 products each, four times the fp32 FMA's and
// twice VDPBF16PS's) and a few instructions to bring the scales in. VPDPBUSD multiplies
// unsigned bytes by signed ones: int4 codes are unsigned already; an int8 code goes in as
// code + 128 and the group's dot product gives back 128 sum(xq), exactly.
// Operands: int4 code words are split into bytes, byte j of (word & 0x0F0F0F0F) being
// input 8b + 2j and of (word >> 4 & 0x0F0F0F0F) input 8b + 2j + 1, so for int4 the
// quantised inputs are stored in that order (within each 8: 0, 2, 4, 6, 1, 3, 5, 7); int8
// panels hold each output's codes four inputs to a 32-bit lane ([P, K / 4, 16, 4]), and
// the inputs keep their own order. Calls of up to 3 rows make the operands in registers;
// larger ones make those of 256 inputs of a block of three panels once, into a buffer
// that stays in L1, and run the rows over it, 4 at a time, while the next chunk's codes
// are prefetched.
// Promises: y[m, n] is the same chain over the same values whatever the other rows of x,
// the path their count takes and the thread count (batch invariance). CPUs without
// AVX512-VNNI, and processes where torch runs below the AVX512 width
// (ATEN_CPU_CAPABILITY=avx2), run the AVX2 products (quantized_a8_avx2.cpp), or where AVX2
// is missing too a portable loop, over the same quantised values and the same chain
// (bit-identical results; CELLBATCH_A8_PORTABLE=1 runs the portable loop anywhere, for
// the tests: a8::products_path). Results are in x's dtype, bf16 rounded to nearest even.
// Never: changes the weights' numbers (only the activations are rounded), or allocates
// per row.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"
#include "quantized_a8.h"
#include "quantized_amx.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_A8_PRODUCTS 1
#include <immintrin.h>
#endif

namespace cellbatch {
namespace {

using a8::InputOrder;
using a8::kGroup;
using a8::kPanel;
using a8::quantised_slot;
constexpr int64_t kBlock = 3;      // panels per block
constexpr int64_t kChunk = 256;    // inputs per buffer fill: 12 KiB for a block
constexpr int64_t kRows = 4;       // rows per run over a buffer: 12 int32 + 12 float sums
constexpr int64_t kFusedRows = 3;  // calls of up to this many rows split codes in registers
constexpr int64_t kRowChunk = 256;  // rows per pass over a block: one buffer fill serves them
constexpr int64_t kPrefetchWords = 48;  // few-row path: codes asked for 3 KiB ahead per panel
constexpr int64_t kBlockWidth = kBlock * kPanel;

using a8::Quantised;

// The portable products for rows [m0, m1) and panels [p0, p1): per output (row m, panel
// p, column c) the chain over groups g of total = add(m, p, c, g, total), the format's
// terms, as the vector products run it.
template <typename T, typename Add>
void for_each_output(int64_t groups, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                     int64_t out_features, T* y, Add&& add) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < out_features; ++c) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; ++g) total = add(m, p, c, g, total);
        y[m * out_features + p * kPanel + c] = static_cast<T>(total);
      }
}

template <typename S, typename T>
void product_portable(const Quantised& xs, const int32_t* codes, const S* scales, int64_t m0,
                      int64_t m1, int64_t p0, int64_t p1, int64_t out_features, T* y) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  const a8::Int4Layout<S> panels{codes, scales, in_features};
  for_each_output(groups, m0, m1, p0, p1, out_features, y,
                  [&](int64_t m, int64_t p, int64_t c, int64_t g, float total) {
                    int32_t dot = 0;
                    for (int64_t b = 4 * g; b < 4 * g + 4; ++b) {
                      const auto word = static_cast<uint32_t>(panels.words(p, b)[c]);
                      for (int64_t i = 0; i < 8; ++i)
                        dot += static_cast<int32_t>((word >> (4 * i)) & 15u) *
                               xs.q[m * in_features + 8 * b + quantised_slot<InputOrder::kInt4>(i)];
                    }
                    const S* group = panels.group(p, g);
                    const float scale = static_cast<float>(group[c]) * xs.d[m * groups + g];
                    total = std::fma(static_cast<float>(dot), scale, total);
                    return std::fma(static_cast<float>(group[kPanel + c]), xs.sx[m * groups + g], total);
                  });
}

template <typename S, typename T>
void product_portable(const Quantised& xs, const int8_t* codes, const S* scales, int64_t m0,
                      int64_t m1, int64_t p0, int64_t p1, int64_t out_features, T* y) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  const a8::Int8Layout<S> panels{codes, scales, in_features};
  for_each_output(groups, m0, m1, p0, p1, out_features, y,
                  [&](int64_t m, int64_t p, int64_t c, int64_t g, float total) {
                    int32_t dot = 0;
                    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
                      dot += static_cast<int32_t>(panels.quad(p, k / 4)[c * 4 + k % 4]) *
                             xs.q[m * in_features + k];
                    const float scale = static_cast<float>(panels.group(p, g)[c]) * xs.d[m * groups + g];
                    return std::fma(static_cast<float>(dot), scale, total);
                  });
}

#ifdef CELLBATCH_A8_PRODUCTS

// Everything in this region runs only after a8::products_path() said kVnni.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

inline void prefetch(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(start + at, _MM_HINT_T0);
}

// A format's panels (its layout, quantized_a8.h) as the VNNI products read them:
// operand(p, b, h), the VPDPBUSD operand (unsigned bytes, four inputs of each of the
// panel's 16 outputs per 32-bit lane) for inputs 8b + 4h .. 8b + 4h + 3 of panel p, in the
// order the quantised inputs are stored.
template <typename S>
struct Int4Panels : a8::Int4Layout<S> {
  using a8::Int4Layout<S>::words;
  using a8::Int4Layout<S>::group;
  // Byte j of the low nibbles is input 8b + 2j, of the high ones 8b + 2j + 1.
  __m512i operand(int64_t p, int64_t b, int h) const {
    const __m512i word = _mm512_loadu_si512(words(p, b)), nibble = _mm512_set1_epi8(0x0F);
    return h == 0 ? _mm512_and_si512(word, nibble) : _mm512_and_si512(_mm512_srli_epi32(word, 4), nibble);
  }
  void prefetch_ahead(int64_t p, int64_t b, int h) const {
    if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(words(p, b + kPrefetchWords)), _MM_HINT_T0);
  }
  void prefetch_chunk(int64_t p, int64_t k0, int64_t len) const {
    prefetch(words(p, k0 / 8), len / 8 * kPanel * 4);
    prefetch(group(p, k0 / kGroup), len / kGroup * 2 * kPanel * int64_t(sizeof(S)));
  }
};

// int8 codes are signed: the operand is code + 128 (the sign bit flipped), and the
// product takes 128 times the inputs' sum back off each group's dot product.
template <typename S>
struct Int8Panels : a8::Int8Layout<S> {
  using a8::Int8Layout<S>::quad;
  using a8::Int8Layout<S>::group;
  __m512i operand(int64_t p, int64_t b, int h) const {
    return _mm512_xor_si512(_mm512_loadu_si512(quad(p, 2 * b + h)), _mm512_set1_epi8(-128));
  }
  void prefetch_ahead(int64_t p, int64_t b, int h) const {
    _mm_prefetch(reinterpret_cast<const char*>(quad(p, 2 * (b + kPrefetchWords) + h)), _MM_HINT_T0);
  }
  void prefetch_chunk(int64_t p, int64_t k0, int64_t len) const {
    prefetch(quad(p, k0 / 4), len * kPanel);
    prefetch(group(p, k0 / kGroup), len / kGroup * kPanel * int64_t(sizeof(S)));
  }
};

// A chunk of a block's operands: for inputs 8b .. 8b + 7 of the chunk and each panel,
// operand(p, b, 0) and operand(p, b, 1).
struct alignas(64) Buffer {
  int32_t bytes[kChunk / 8][kBlock][2][kPanel];
};

// R rows from m times panels p0 .. p0 + P - 1 over groups [g0, g1), the operand of
// inputs 8b + 4h .. of panel p from split(b, p, h); sums[r][16 P] continue from group g0
// (start at 0).
template <int R, int P, typename Panels, typename Split>
inline void rows_over_groups(const Panels& panels, const Quantised& xs, int64_t m, int64_t p0,
                             int64_t g0, int64_t g1, Split&& split, float* sums) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  __m512 total[R][P];
  load_totals<R, P, kBlockWidth>(total, sums, g0 != 0);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i dot[R][P];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int p = 0; p < P; ++p) dot[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t b = 4 * g; b < 4 * g + 4; ++b)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i codes[P];
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) codes[p] = split(b, p, h);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xs.q.data() + (m + r) * in_features + 8 * b + 4 * h, sizeof four);
          const __m512i inputs = _mm512_set1_epi32(four);
#pragma GCC unroll 3
          for (int p = 0; p < P; ++p) dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], codes[p], inputs);
        }
      }
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) {
      const auto* group = panels.group(p0 + p, g);
      const __m512 scale = load16(group);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * groups + g;
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(xs.d[i]));
        if constexpr (Panels::kInt4) {
          total[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]), row_scale, total[r][p]);
          total[r][p] = _mm512_fmadd_ps(load16(group + kPanel), _mm512_set1_ps(xs.sx[i]), total[r][p]);
        } else {
          const __m512i exact = _mm512_sub_epi32(dot[r][p], _mm512_set1_epi32(128 * xs.qsum[i]));
          total[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), row_scale, total[r][p]);
        }
      }
    }
  }
  store_totals<R, P, kBlockWidth>(total, sums);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, typename Panels>
void block(const Panels& panels, int64_t panel_count, const Quantised& xs, int64_t m,
           int64_t count, int64_t p0, Buffer* buffer, float* sums) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  if (count <= kFusedRows) {  // few rows: the operands made in registers, once
    with_count<kFusedRows>(count, [&](auto rows) {
      auto split = [&](int64_t b, int p, int h) {
        panels.prefetch_ahead(p0 + p, b, h);
        return panels.operand(p0 + p, b, h);
      };
      rows_over_groups<decltype(rows)::value, P>(panels, xs, m, p0, 0, groups, split, sums);
    });
    return;
  }
  for (int64_t k0 = 0; k0 < in_features; k0 += kChunk) {  // else through the buffer
    const int64_t len = std::min(kChunk, in_features - k0);
    for (int p = 0; p < P; ++p)
      for (int64_t b = k0 / 8; b < (k0 + len) / 8; ++b)
        for (int h = 0; h < 2; ++h)
          _mm512_store_si512(buffer->bytes[b - k0 / 8][p][h], panels.operand(p0 + p, b, h));
    // While the rows run over this chunk, the next one (of this block, else of the block
    // that follows it) comes from memory.
    const bool last = k0 + kChunk >= in_features;
    const int64_t next_p0 = last ? p0 + P : p0, next_k0 = last ? 0 : k0 + kChunk;
    for (int64_t p = next_p0; p < std::min(next_p0 + P, panel_count); ++p)
      panels.prefetch_chunk(p, next_k0, std::min(kChunk, in_features - next_k0));
    auto split = [&](int64_t b, int p, int h) {
      return _mm512_load_si512(buffer->bytes[b - k0 / 8][p][h]);
    };
    for (int64_t r = 0; r < count; r += kRows)
      with_count<kRows>(std::min(kRows, count - r), [&](auto rows) {
        rows_over_groups<decltype(rows)::value, P>(panels, xs, m + r, p0, k0 / kGroup,
                                                   (k0 + len) / kGroup, split, sums + r * kBlockWidth);
      });
  }
}

template <typename Panels, typename T>
void product_vnni(const Quantised& xs, const Panels& panels, int64_t count, int64_t panel_count,
                  int64_t out_features, T* y) {
  for_each_block<Buffer, kBlock, kRowChunk, kFusedRows>(
      count, panel_count,
      [&](auto width, int64_t m0, int64_t n, int64_t p0, Buffer* buffer, float* sums) {
        block<decltype(width)::value>(panels, panel_count, xs, m0, n, p0, buffer, sums);
      },
      [&](int64_t m0, int64_t n, int64_t p0, const float* sums) {
        store_sums<kBlock>(sums, m0, n, p0, out_features, out_features, y);
      });
}

#pragma GCC pop_options

#endif

// The product of x [..., K] (float32 or bf16) with int4 or int8 panels whose layout `op`
// has checked.
template <bool kInt4>
at::Tensor a8_product(const char* op, const at::Tensor& x, const at::Tensor& codes,
                      const at::Tensor& scales, int64_t in_features, int64_t out_features) {
  using Code = std::conditional_t<kInt4, int32_t, int8_t>;
  const int64_t panel_count = codes.size(0);
  TORCH_CHECK(out_features > 0 && panel_count == (out_features + kPanel - 1) / kPanel, op, ": ",
              panel_count, " panels of ", kPanel, " cannot hold ", out_features, " outputs");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, op, ": x must be [..., ", in_features,
              "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  const at::Tensor rows = x.reshape({-1, in_features}).contiguous();
  const int64_t count = rows.size(0);
  at::Tensor out = at::empty({count, out_features}, rows.options());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  if (count == 0) return out.view(shape);
  const a8::Path path = a8::products_path();
  const bool vector = path == a8::Path::kVnni;
  const bool amx = a8::amx_takes(count) && vector;  // a bad CELLBATCH_AMX fails everywhere
  const Quantised xs =
      a8::quantise_rows(rows, path, kGroup, kInt4 ? InputOrder::kInt4 : InputOrder::kOwn);
  auto run = [&](auto input_tag, auto scale_tag) {
    using T = decltype(input_tag);
    using S = decltype(scale_tag);
    T* y = out.data_ptr<T>();
    const Code* c = codes.data_ptr<Code>();
    const S* s = scales.data_ptr<S>();
    if (amx) {
      if constexpr (kInt4) return a8::int4_products_amx(xs, c, s, panel_count, out_features, y);
      else return a8::int8_products_amx(xs, c, s, panel_count, out_features, y);
    }
#ifdef CELLBATCH_A8_PRODUCTS
    if (vector) {
      using Panels = std::conditional_t<kInt4, Int4Panels<S>, Int8Panels<S>>;
      return product_vnni(xs, Panels{{c, s, in_features}}, count, panel_count, out_features, y);
    }
#endif
    if (path == a8::Path::kAvx2) {
      if constexpr (kInt4) return a8::int4_products_avx2(xs, c, s, panel_count, out_features, y);
      else return a8::int8_products_avx2(xs, c, s, panel_count, out_features, y);
    }
    at::parallel_for(0, panel_count, 1, [&](int64_t begin, int64_t end) {
      product_portable(xs, c, s, 0, count, begin, end, out_features, y);
    });
  };
  for_scale_type(scales, op, [&](auto scale_tag) {
    if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{}, scale_tag);
    else run(float{}, scale_tag);
    return 0;
  });
  return out.view(shape);
}

at::Tensor int4_matmul_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t out_features) {
  const int64_t in_features = int4_in_features(codes, scales, "int4_matmul_a8");
  return a8_product<true>("int4_matmul_a8", x, codes, scales, in_features, out_features);
}

at::Tensor int8_matmul_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t out_features) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kPanel && codes.size(3) == 4 &&
                  codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "int8_matmul_a8: codes must be contiguous int8 [panels, K / 4, 16, 4]");
  const int64_t panels = codes.size(0), in_features = codes.size(1) * 4;
  TORCH_CHECK(in_features % kGroup == 0, "int8_matmul_a8: K must be a multiple of 32");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels &&
                  scales.size(1) == in_features / kGroup && scales.size(2) == kPanel &&
                  scales.is_contiguous(),
              "int8_matmul_a8: scales must be contiguous [panels, K / 32, 16]");
  return a8_product<false>("int8_matmul_a8", x, codes, scales, in_features, out_features);
}

}  // namespace

}  // namespace cellbatch

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("int4_matmul_a8", &cellbatch::int4_matmul_a8);
  m.impl("int8_matmul_a8", &cellbatch::int8_matmul_a8);
}
