// Weight-only quantised matrix products: `cellbatch::int4_matmul` and `cellbatch::int8_matmul`,
// y[M, N] = x[M, K] w^T for float activations x and a weight w held in the panel layouts of
// cellbatch.model.quantized (PANEL = 16 output features each, the last panel zero-padded):
// - int4: codes int32 [P, K / 8, 16]: word (p, b, c) holds code q of feature 16p + c at inputs
//   8b .. 8b + 7, input 8b + i in bits 4i .. 4i + 3; scales [P, K / 32, 2, 16]: the scale s
//   and offset o of each group of 32 inputs, w = q s + o;
// - int8: codes int8 [P, K, 16]; scales [P, G, 16] for G groups of K / G inputs: w = q s;
// scales are float32, or float16 where they are float16 values (half the bytes, widened
// exactly).
//
// Owns: only the arithmetic. A panel's weights are dequantised input by input, 16 outputs
// at a time (int4: fma(q, s, o), one rounding; int8: q * s), and each row of x runs over
// them with the panel's 16 sums of the row in registers. Calls of up to kFusedRows rows use
// the weights straight from registers; larger ones dequantise kChunk inputs of a panel once
// into a buffer that stays in L1 and run every row over it, kRows rows at a time. Threads
// split the panels.
// Promises: each output y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), a
// chain of fused multiply-adds in input order over the same dequantised weights, whatever
// the other rows of x, the path their count takes and the thread count (batch invariance);
// the AVX2 path and the portable one compute the same chain. Non-float32 activations are
// widened to float32 and the result narrowed back.
// Never: allocates per row, or reads weights outside the panels it was given.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"
#include "quantized_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define CELLBATCH_QUANTIZED_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;      // output features per panel
constexpr int64_t kGroup = 32;      // inputs per int4 group
constexpr int64_t kChunk = 256;     // inputs dequantised into the buffer at a time: 16 KiB
constexpr int64_t kRows = 6;        // rows per block over the buffer: 12 sums + 2 weights + 1 x
constexpr int64_t kFusedRows = 3;   // rows over weights in registers: 6 sums + 10 for weights
constexpr int64_t kRowChunk = 64;   // rows per pass over a panel: their inputs stay in L2

// One input's dequantised weights for the panel's 16 outputs, and the running sums of one
// row over them: acc = fma(x, w, acc).
#ifdef CELLBATCH_QUANTIZED_AVX2
struct Lanes {
  __m256 lo, hi;
};
inline Lanes zero_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_lanes(float* p, const Lanes& v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void fma_lanes(const float* x, const Lanes& w, Lanes& acc) {
  const __m256 v = _mm256_broadcast_ss(x);
  acc.lo = _mm256_fmadd_ps(v, w.lo, acc.lo);
  acc.hi = _mm256_fmadd_ps(v, w.hi, acc.hi);
}
// Eight scales as floats.
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
struct Lanes {
  float v[kPanel];
};
inline Lanes zero_lanes() { return Lanes{}; }
inline Lanes load_lanes(const float* p) {
  Lanes out;
  std::copy_n(p, kPanel, out.v);
  return out;
}
inline void store_lanes(float* p, const Lanes& v) { std::copy_n(v.v, kPanel, p); }
inline void fma_lanes(const float* x, const Lanes& w, Lanes& acc) {
  for (int64_t c = 0; c < kPanel; ++c) acc.v[c] = std::fma(*x, w.v[c], acc.v[c]);
}
#endif

// -- dequantisers: fn(k, weights of input k) for k in [k0, k0 + len), in order ------------

// int4 (one panel's codes and scales): k0 and len multiples of 32.
template <typename S, typename Fn>
inline void visit_int4(const int32_t* codes, const S* scales, int64_t k0, int64_t len,
                       Fn&& fn) {
  for (int64_t g = k0 / kGroup; g < (k0 + len) / kGroup; ++g) {
    const S* s = scales + g * 2 * kPanel;
    const S* o = s + kPanel;
#ifdef CELLBATCH_QUANTIZED_AVX2
    const __m256 s0 = load_scales(s), s1 = load_scales(s + 8);
    const __m256 o0 = load_scales(o), o1 = load_scales(o + 8);
    const __m256i nibble = _mm256_set1_epi32(0xF);
    for (int64_t b = 0; b < kGroup / 8; ++b) {
      const int32_t* words = codes + (g * (kGroup / 8) + b) * kPanel;
      __m256i t0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
      __m256i t1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8));
      const int64_t k = g * kGroup + b * 8;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(t0, nibble));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(t1, nibble));
        fn(k + i, Lanes{_mm256_fmadd_ps(q0, s0, o0), _mm256_fmadd_ps(q1, s1, o1)});
        t0 = _mm256_srli_epi32(t0, 4);
        t1 = _mm256_srli_epi32(t1, 4);
      }
    }
#else
    for (int64_t b = 0; b < kGroup / 8; ++b) {
      const int32_t* words = codes + (g * (kGroup / 8) + b) * kPanel;
      for (int i = 0; i < 8; ++i) {
        Lanes w;
        for (int64_t c = 0; c < kPanel; ++c) {
          const uint32_t q = (static_cast<uint32_t>(words[c]) >> (4 * i)) & 0xF;
          w.v[c] = std::fma(static_cast<float>(q), static_cast<float>(s[c]),
                            static_cast<float>(o[c]));
        }
        fn(g * kGroup + b * 8 + i, w);
      }
    }
#endif
  }
}

// int8 (one panel's codes and scales): groups of `group` inputs share a scale.
template <typename S, typename Fn>
inline void visit_int8(const int8_t* codes, const S* scales, int64_t group, int64_t k0,
                       int64_t len, Fn&& fn) {
  for (int64_t k = k0; k < k0 + len;) {
    const int64_t g = k / group, end = std::min(k0 + len, (g + 1) * group);
    const S* s = scales + g * kPanel;
#ifdef CELLBATCH_QUANTIZED_AVX2
    const __m256 s0 = load_scales(s), s1 = load_scales(s + 8);
    for (; k < end; ++k) {
      const int8_t* q = codes + k * kPanel;
      const __m256 q0 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
      const __m256 q1 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
      fn(k, Lanes{_mm256_mul_ps(q0, s0), _mm256_mul_ps(q1, s1)});
    }
#else
    for (; k < end; ++k) {
      Lanes w;
      for (int64_t c = 0; c < kPanel; ++c)
        w.v[c] = static_cast<float>(codes[k * kPanel + c]) * static_cast<float>(s[c]);
      fn(k, w);
    }
#endif
  }
}

// -- rows over a panel -------------------------------------------------------------------

// R rows over weights dequantised on the fly: sums[r] = x[r] . w over all K inputs.
template <int R, typename Visit>
void rows_over_panel(Visit&& visit, const float* x, int64_t ldx, float* sums) {
  Lanes acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = zero_lanes();
  visit([&](int64_t k, const Lanes& w) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) fma_lanes(x + r * ldx + k, w, acc[r]);
  });
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store_lanes(sums + r * kPanel, acc[r]);
}

// R rows over a dequantised chunk w[len][16]: sums[r] continues over it (or starts).
template <int R>
void rows_over_chunk(const float* w, int64_t len, const float* x, int64_t ldx, float* sums,
                     bool first) {
  Lanes acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = first ? zero_lanes() : load_lanes(sums + r * kPanel);
  for (int64_t k = 0; k < len; ++k) {
    const Lanes weights = load_lanes(w + k * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) fma_lanes(x + r * ldx + k, weights, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store_lanes(sums + r * kPanel, acc[r]);
}

void rows_over_chunk(int64_t rows, const float* w, int64_t len, const float* x, int64_t ldx,
                     float* sums, bool first) {
  switch (rows) {
    case 1: return rows_over_chunk<1>(w, len, x, ldx, sums, first);
    case 2: return rows_over_chunk<2>(w, len, x, ldx, sums, first);
    case 3: return rows_over_chunk<3>(w, len, x, ldx, sums, first);
    case 4: return rows_over_chunk<4>(w, len, x, ldx, sums, first);
    case 5: return rows_over_chunk<5>(w, len, x, ldx, sums, first);
    default: return rows_over_chunk<kRows>(w, len, x, ldx, sums, first);
  }
}

// -- the product, for any visit(panel, k0, len, fn) ---------------------------------------

// x as float32 [M, K] rows with a contiguous last dimension.
at::Tensor float_rows(const at::Tensor& x, int64_t in_features, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, op, ": x must be [..., ", in_features,
              "], got ", x.sizes());
  at::Tensor rows = x.reshape({-1, in_features});
  if (rows.scalar_type() != at::kFloat) rows = rows.to(at::kFloat);
  if (rows.stride(1) != 1 || (rows.size(0) > 1 && rows.stride(0) < in_features))
    rows = rows.contiguous();
  return rows;
}

// One panel's sums for `rows` rows (at most kRowChunk) of x: sums[rows][16].
template <typename Visit>
void panel_sums(Visit&& visit, int64_t in_features, int64_t rows, const float* x, int64_t ldx,
                float* sums, float* buffer) {
  if (rows <= kFusedRows) {
    auto all = [&](auto&& fn) { visit(0, in_features, fn); };
    switch (rows) {
      case 1: return rows_over_panel<1>(all, x, ldx, sums);
      case 2: return rows_over_panel<2>(all, x, ldx, sums);
      default: return rows_over_panel<kFusedRows>(all, x, ldx, sums);
    }
  }
  for (int64_t k0 = 0; k0 < in_features; k0 += kChunk) {
    const int64_t len = std::min(kChunk, in_features - k0);
    visit(k0, len, [&](int64_t k, const Lanes& w) { store_lanes(buffer + (k - k0) * kPanel, w); });
    for (int64_t r = 0; r < rows; r += kRows)
      rows_over_chunk(std::min(kRows, rows - r), buffer, len, x + r * ldx + k0, ldx,
                      sums + r * kPanel, k0 == 0);
  }
}

template <typename PanelVisit>
at::Tensor product(const at::Tensor& x, int64_t in_features, int64_t out_features,
                   int64_t panels, const char* op, PanelVisit&& panel_visit) {
  TORCH_CHECK(out_features > 0 && panels == (out_features + kPanel - 1) / kPanel, op,
              ": ", panels, " panels of ", kPanel, " cannot hold ", out_features, " outputs");
  const at::Tensor rows = float_rows(x, in_features, op);
  const int64_t count = rows.size(0), ldx = rows.stride(0);
  at::Tensor out = at::empty({count, out_features}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  if (count > 0) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float buffer[kChunk * kPanel];
      std::vector<float> sums(std::min(count, kRowChunk) * kPanel);
      for (int64_t m0 = 0; m0 < count; m0 += kRowChunk) {
        const int64_t chunk_rows = std::min(kRowChunk, count - m0);
        for (int64_t p = begin; p < end; ++p) {
          panel_sums([&](int64_t k0, int64_t len, auto&& fn) { panel_visit(p, k0, len, fn); },
                     in_features, chunk_rows, src + m0 * ldx, ldx, sums.data(), buffer);
          const int64_t n0 = p * kPanel, width = std::min(kPanel, out_features - n0);
          for (int64_t r = 0; r < chunk_rows; ++r)
            std::copy_n(sums.data() + r * kPanel, width, dst + (m0 + r) * out_features + n0);
        }
      }
    });
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  out = out.view(shape);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       int64_t out_features) {
  const int64_t in_features = cellbatch::int4_in_features(codes, scales, "int4_matmul");
  const int64_t panels = codes.size(0);
  // A row of the wrong width goes on to the fp32 path, whose check names the problem.
  if (x.scalar_type() == at::kBFloat16 && cellbatch::bf16_products_available() &&
      x.size(-1) == in_features)
    return cellbatch::int4_matmul_bf16(x, codes, scales, out_features);
  const int32_t* c = codes.data_ptr<int32_t>();
  const int64_t words = in_features / 8 * kPanel, pairs = in_features / kGroup * 2 * kPanel;
  return cellbatch::for_scale_type(scales, "int4_matmul", [&](auto tag) {
    using S = decltype(tag);
    const S* s = scales.data_ptr<S>();
    return product(x, in_features, out_features, panels, "int4_matmul",
                   [&](int64_t p, int64_t k0, int64_t len, auto&& fn) {
                     visit_int4(c + p * words, s + p * pairs, k0, len, fn);
                   });
  });
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       int64_t out_features) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.is_contiguous() &&
                  codes.scalar_type() == at::kChar,
              "int8_matmul: codes must be contiguous int8 [panels, K, ", kPanel, "]");
  const int64_t panels = codes.size(0), in_features = codes.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels && scales.size(1) > 0 &&
                  in_features % scales.size(1) == 0 && scales.size(2) == kPanel &&
                  scales.is_contiguous(),
              "int8_matmul: scales must be contiguous [panels, groups, ", kPanel,
              "] with K a multiple of groups");
  if (x.scalar_type() == at::kBFloat16 && cellbatch::bf16_products_available() &&
      x.size(-1) == in_features && scales.size(1) * kGroup == in_features)
    return cellbatch::int8_matmul_bf16(x, codes, scales, out_features);
  const int8_t* c = codes.data_ptr<int8_t>();
  const int64_t groups = scales.size(1), group = in_features / groups;
  return cellbatch::for_scale_type(scales, "int8_matmul", [&](auto tag) {
    using S = decltype(tag);
    const S* s = scales.data_ptr<S>();
    return product(x, in_features, out_features, panels, "int8_matmul",
                   [&](int64_t p, int64_t k0, int64_t len, auto&& fn) {
                     visit_int8(c + p * in_features * kPanel, s + p * groups * kPanel, group,
                                k0, len, fn);
                   });
  });
}

}  // namespace

// The schemas are defined in Python (cellbatch/model/ops.py), with the torch implementations.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
}
