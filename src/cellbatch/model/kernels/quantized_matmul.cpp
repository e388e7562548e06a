// Weight-only quantised matrix products: `cellbatch::int4_matmul` and `cellbatch::int8_matmul`,
// y[M, N] = x[M, K] w^T for float activations x and a weight w held in the panel layouts of
// cellbatch.model.quantized (PANEL = 16 output features each, the last panel zero-padded):
// - int4: codes int32 [P, K / 8, 16]: word (p, b, c) holds code q of feature 16p + c at inputs
//   8b .. 8b + 7, input 8b + i in bits 4i .. 4i + 3; scales float32 [P, K / 32, 2, 16]: the
//   scale s and zero z of each group of 32 inputs, w = (q - 8) s + z;
// - int8: codes int8 [P, K, 16]; scales float32 [P, G, 16] for G groups of K / G inputs: w = q s.
//
// Owns: only the arithmetic. For one panel and a chunk of inputs the weights are dequantised
// once into a float buffer that stays in L1 (exactly as Int4Weight/Int8Weight.dequantize
// round them: (q - 8) s, then + z), and every row of x runs over that buffer, ROWS rows at a
// time with the panel's 16 outputs of each row in registers. Threads split the panels.
// Promises: each output y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), a
// chain of fused multiply-adds in input order that depends neither on the other rows of x
// nor on the thread count (batch invariance): the AVX2 path and the portable one compute the
// same chain. Non-float32 activations are widened to float32 and the result narrowed back.
// Never: allocates per row, or reads weights outside the panels it was given.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define CELLBATCH_QUANTIZED_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;   // output features per panel: two 8-float registers
constexpr int64_t kGroup = 32;   // inputs per int4 group
constexpr int64_t kChunk = 256;  // inputs dequantised at a time: 16 KiB of floats, in L1
constexpr int64_t kRows = 6;     // rows per register block: 12 sums + 2 weights + 1 input
constexpr int64_t kRowChunk = 64;  // rows per pass over a panel: their inputs stay in L2

// -- dequantisation of one panel's chunk of inputs [k0, k0 + len) into w[len][16] --------

// int4: k0 and len multiples of 32.
void dequantize_int4(const int32_t* codes, const float* scales, int64_t k0, int64_t len,
                     float* w) {
  for (int64_t g = k0 / kGroup; g < (k0 + len) / kGroup; ++g) {
    const float* s = scales + g * 2 * kPanel;
    const float* z = s + kPanel;
#ifdef CELLBATCH_QUANTIZED_AVX2
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 z0 = _mm256_loadu_ps(z), z1 = _mm256_loadu_ps(z + 8);
    const __m256i nibble = _mm256_set1_epi32(0xF);
    // 2^23 + q as a float's bits, minus 2^23 + 8: q - 8 exactly, with no conversion.
    const __m256i magic = _mm256_set1_epi32(0x4B000000);
    const __m256 offset = _mm256_set1_ps(8388616.f);
    for (int64_t b = 0; b < kGroup / 8; ++b) {
      const int32_t* words = codes + (g * (kGroup / 8) + b) * kPanel;
      __m256i t0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
      __m256i t1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8));
      float* out = w + (g * kGroup + b * 8 - k0) * kPanel;
      for (int i = 0; i < 8; ++i) {
        const __m256 q0 = _mm256_sub_ps(
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(t0, nibble), magic)), offset);
        const __m256 q1 = _mm256_sub_ps(
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(t1, nibble), magic)), offset);
        _mm256_store_ps(out + i * kPanel, _mm256_add_ps(_mm256_mul_ps(q0, s0), z0));
        _mm256_store_ps(out + i * kPanel + 8, _mm256_add_ps(_mm256_mul_ps(q1, s1), z1));
        t0 = _mm256_srli_epi32(t0, 4);
        t1 = _mm256_srli_epi32(t1, 4);
      }
    }
#else
    for (int64_t b = 0; b < kGroup / 8; ++b) {
      const int32_t* words = codes + (g * (kGroup / 8) + b) * kPanel;
      float* out = w + (g * kGroup + b * 8 - k0) * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        const uint32_t word = static_cast<uint32_t>(words[c]);
        for (int i = 0; i < 8; ++i) {
          const float q = static_cast<float>(static_cast<int>((word >> (4 * i)) & 0xF) - 8);
          out[i * kPanel + c] = q * s[c] + z[c];
        }
      }
    }
#endif
  }
}

// int8: groups of `group` inputs share a scale.
void dequantize_int8(const int8_t* codes, const float* scales, int64_t group, int64_t k0,
                     int64_t len, float* w) {
  for (int64_t k = k0; k < k0 + len;) {
    const int64_t g = k / group, end = std::min(k0 + len, (g + 1) * group);
    const float* s = scales + g * kPanel;
#ifdef CELLBATCH_QUANTIZED_AVX2
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    for (; k < end; ++k) {
      const int8_t* q = codes + k * kPanel;
      const __m256 q0 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
      const __m256 q1 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
      _mm256_store_ps(w + (k - k0) * kPanel, _mm256_mul_ps(q0, s0));
      _mm256_store_ps(w + (k - k0) * kPanel + 8, _mm256_mul_ps(q1, s1));
    }
#else
    for (; k < end; ++k) {
      for (int64_t c = 0; c < kPanel; ++c)
        w[(k - k0) * kPanel + c] = static_cast<float>(codes[k * kPanel + c]) * s[c];
    }
#endif
  }
}

// -- R rows of x over a dequantised chunk: sums[r][0..16) += x[r][0..len) . w ---------------

template <int R>
void rows_over_chunk(const float* w, int64_t len, const float* x, int64_t ldx, float* sums,
                     bool first) {
#ifdef CELLBATCH_QUANTIZED_AVX2
  __m256 acc[R][2];  // registers: every loop over r is unrolled
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kPanel);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kPanel + 8);
  }
  for (int64_t k = 0; k < len; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kPanel), w1 = _mm256_load_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(v, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(v, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(sums + r * kPanel + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) acc[c] = first ? 0.f : sums[r * kPanel + c];
    for (int64_t k = 0; k < len; ++k) {
      const float v = x[r * ldx + k];
      for (int64_t c = 0; c < kPanel; ++c) acc[c] = std::fma(v, w[k * kPanel + c], acc[c]);
    }
    for (int64_t c = 0; c < kPanel; ++c) sums[r * kPanel + c] = acc[c];
  }
#endif
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

// -- the product, for any dequantiser(panel, k0, len, w) ---------------------------------

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

template <typename Dequantize>
at::Tensor product(const at::Tensor& x, int64_t in_features, int64_t out_features,
                   int64_t panels, const char* op, Dequantize&& dequantize) {
  TORCH_CHECK(out_features > 0 && panels == (out_features + kPanel - 1) / kPanel, op,
              ": ", panels, " panels of ", kPanel, " cannot hold ", out_features, " outputs");
  const at::Tensor rows = float_rows(x, in_features, op);
  const int64_t count = rows.size(0), ldx = rows.stride(0);
  at::Tensor out = at::empty({count, out_features}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  if (count > 0) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float w[kChunk * kPanel];
      std::vector<float> sums(std::min(count, kRowChunk) * kPanel);
      for (int64_t m0 = 0; m0 < count; m0 += kRowChunk) {
        const int64_t chunk_rows = std::min(kRowChunk, count - m0);
        for (int64_t p = begin; p < end; ++p) {
          for (int64_t k0 = 0; k0 < in_features; k0 += kChunk) {
            const int64_t len = std::min(kChunk, in_features - k0);
            dequantize(p, k0, len, w);
            for (int64_t r = 0; r < chunk_rows; r += kRows) {
              rows_over_chunk(std::min(kRows, chunk_rows - r), w, len,
                              src + (m0 + r) * ldx + k0, ldx, sums.data() + r * kPanel,
                              k0 == 0);
            }
          }
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
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.is_contiguous() &&
                  codes.scalar_type() == at::kInt,
              "int4_matmul: codes must be contiguous int32 [panels, K / 8, ", kPanel, "]");
  const int64_t panels = codes.size(0), in_features = codes.size(1) * 8;
  TORCH_CHECK(in_features % kGroup == 0, "int4_matmul: K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == panels &&
                  scales.size(1) == in_features / kGroup && scales.size(2) == 2 &&
                  scales.size(3) == kPanel && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "int4_matmul: scales must be contiguous float32 [panels, K / ", kGroup, ", 2, ",
              kPanel, "]");
  const int32_t* c = codes.data_ptr<int32_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t words = in_features / 8 * kPanel, pairs = in_features / kGroup * 2 * kPanel;
  return product(x, in_features, out_features, panels, "int4_matmul",
                 [&](int64_t p, int64_t k0, int64_t len, float* w) {
                   dequantize_int4(c + p * words, s + p * pairs, k0, len, w);
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
                  scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "int8_matmul: scales must be contiguous float32 [panels, groups, ", kPanel,
              "] with K a multiple of groups");
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t groups = scales.size(1), group = in_features / groups;
  return product(x, in_features, out_features, panels, "int8_matmul",
                 [&](int64_t p, int64_t k0, int64_t len, float* w) {
                   dequantize_int8(c + p * in_features * kPanel, s + p * groups * kPanel, group,
                                   k0, len, w);
                 });
}

}  // namespace

// The schemas are defined in Python (cellbatch/model/ops.py), with the torch implementations.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
}
