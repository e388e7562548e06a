// `cellbatch::kquant_matmul_a8`: x [M, K] (float32 or bf16) times a weight kept in its GGUF
// block kinds (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; layout: quantized_kq.h), the
// inputs quantised to int8 per group of 32 as the int8 weights' `_a8` products quantise
// them (quantized_a8.cpp: d, sx, the codes xq and their sum qs of each group), with one
// scale d per block of 256 inputs where any segment is a K-quant kind, as llama.cpp's
// Q8_K inputs have it, so that a block's integer sums need one float step.
//
// `cellbatch::kquant_rows`: outputs of such a weight dequantised as gguf does (a kept
// embedding's token rows).
//
// Owns: the products' chains and their portable loop, the rows' dequantisation, and the ops
// (the header's checks, the inputs' quantisation, one product per segment into its columns
// by the path its kind and row count take: quantized_kq_vnni.cpp on AVX512-VNNI CPUs,
// quantized_kq_amx.cpp's tiles from a few rows where there is AMX, quantized_kq_avx2.cpp on
// AVX2 CPUs). Per row (inputs xq, scale d), output n with codes q:
//   Q4_0 .. Q5_1, w = s (q - z) + o per group of 32 (`Panels::terms`; Q4_0 and Q5_0 have
//     no o and a zero z of 8 and 16, as llama.cpp's Q4_0 x Q8_0 products, the others z = 0),
//     over the groups in order:
//     t = fma(float(dot - z qs), s * d, t); and where there is o, t = fma(o, sx, t),
//     dot = sum(q xq) over the group
//   Q4_K, Q5_K, w = D sc q - M mn (sc, mn per group; D, M per block of 256), per block:
//     t = fma(float(isum), D * d, t); t = fma(float(imin), (-M) * d, t),
//     isum = sum(sc dot), imin = sum(mn qs) over its 8 groups (|isum| < 2^26)
//   Q6_K, w = D sc (q - 32) (sc per sub-group h of 16, D per block), per block:
//     t = fma(float(isum), D * d, t),  isum = sum(sc_h (dot_h - 32 qs_h)) over its 16
//     sub-groups (|dot_h - 32 qs_h| <= 16 x 32 x 127, |isum| < 2^28)
// over the blocks in input order, every sum exact in int32 (qs: the sum of xq).
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cellbatch::kq {
namespace {

// Rows from which `auto` takes the tiles: the group kinds' from 32; the K-quants' (whose
// tiles leave one float step per block) from 4. benchmarks/quantized.py --products
// --shapes 1b measures them.
constexpr int64_t kAmxMinRows = 32;
constexpr int64_t kBlockAmxMinRows = 4;

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
          const int32_t dot = dot_of(m, p, c, g, 0, kGroup) - zero(panels.kind) * xs.qsum[m * groups + g];
          total = std::fma(static_cast<float>(dot), scale * xs.d[m * groups + g], total);
          if (has_m(panels.kind)) total = std::fma(offset, xs.sx[m * groups + g], total);
        }
        y[m * out_features + panels.column + p * kPanel + c] = static_cast<T>(total);
      }
}

// The weight's segments, each checked against the tensors' sizes.
std::vector<Panels> segments(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                             int64_t in_features, int64_t out_features) {
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
  TORCH_CHECK(word(0) == kMagic, op,
              ": codes do not start with this version's kquant header (\"KQ02\"); weights "
              "packed by another version (an older exported program) must be converted again");
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
  const std::vector<Panels> parts =
      segments("kquant_matmul_a8", codes, scales, in_features, out_features);
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
  Inputs in{xs, {}, {}};
  if (std::any_of(parts.begin(), parts.end(),
                  [](const Panels& p) { return chain_of(p.kind) == Chain::kBlock; })) {
    in.qsum_pairs.resize(xs.qsum.size() / 2);
    for (size_t i = 0; i < in.qsum_pairs.size(); ++i)
      in.qsum_pairs[i] = (xs.qsum[2 * i] & 0xFFFF) | static_cast<int32_t>(
                             static_cast<uint32_t>(xs.qsum[2 * i + 1]) << 16);
  }
  if (std::any_of(parts.begin(), parts.end(), [](const Panels& p) { return p.kind == kQ6_K; })) {
    in.qs16.resize(count * in_features / 16);
    for (size_t h = 0; h < in.qs16.size(); ++h) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 16; ++k) sum += xs.q[h * 16 + k];
      in.qs16[h] = sum;
    }
  }
  const bool vnni = path == a8::Path::kVnni && vnni_products_available();
  const bool amx = a8::amx_takes(count) && vnni;  // a bad CELLBATCH_AMX fails everywhere
  // CELLBATCH_AMX=always (amx_takes of one row) gives the tiles every segment.
  const bool always = amx && a8::amx_takes(1);
  auto tiles = [&](const Panels& panels) {
    if (!amx || always) return amx;
    return count >= (chain_of(panels.kind) == Chain::kGroup ? kAmxMinRows : kBlockAmxMinRows);
  };
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* y = out.data_ptr<T>();
    for (const Panels& panels : parts) {
      if (tiles(panels)) {
        products_amx(in, panels, out_features, y);
      } else if (vnni) {
        products_vnni(in, panels, out_features, y);
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

// Output c of panel p as floats, as gguf dequantises it: w = (q - z) s + o per group of 32
// (the group kinds' terms; Q4_K, Q5_K: z = 0, s = D sc, o = -(M mn)), w = (q - 32) D sc
// (Q6_K), each product and sum rounded once.
void dequantise(const Panels& panels, int64_t p, int c, float* w) {
  const Chain chain = chain_of(panels.kind);
  for (int64_t g = 0; g < panels.groups; ++g) {
    float scale[2], offset = 0.0f;
    if (chain == Chain::kGroup) {
      panels.terms(p, g, c, &scale[0], &offset);
      scale[1] = scale[0];
    } else if (chain == Chain::kSix) {
      const float d = panels.block_d(p, g, c);
      scale[0] = d * static_cast<float>(panels.sub_scale(p, g, 0, c));
      scale[1] = d * static_cast<float>(panels.sub_scale(p, g, 1, c));
    } else {
      float d, negative_dmin;
      panels.block_halves(p, g, c, &d, &negative_dmin);
      scale[0] = scale[1] = d * static_cast<float>(panels.scale_code(p, g, c));
      offset = negative_dmin * static_cast<float>(panels.min_code(p, g, c));
    }
    for (int k = 0; k < kGroup; ++k) {
      const int q = panels.code(p, g, c, k);
      w[g * kGroup + k] = chain == Chain::kSix
                              ? static_cast<float>(q - 32) * scale[k / 16]
                              : static_cast<float>(q - zero(panels.kind)) * scale[0] + offset;
    }
  }
}

// `cellbatch::kquant_rows`: outputs `rows` (int64 [n], each below out_features) of the
// weight, dequantised (float32 [n, in_features]): a kept embedding's token rows.
at::Tensor kquant_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& rows,
                       int64_t in_features, int64_t out_features) {
  const std::vector<Panels> parts =
      segments("kquant_rows", codes, scales, in_features, out_features);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "kquant_rows: rows must be an int64 vector, got ", rows.scalar_type(), " of ",
              rows.dim(), " dimensions");
  const at::Tensor wanted = rows.contiguous();
  const int64_t* row = wanted.data_ptr<int64_t>();
  const int64_t count = wanted.numel();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < out_features, "kquant_rows: row ", row[i],
                " is outside the weight's ", out_features, " outputs");
  at::Tensor out = at::empty({count, in_features}, codes.options().dtype(at::kFloat));
  float* w = out.data_ptr<float>();
  // A few rows of a few thousand values: threads only for a prompt's many.
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto part = std::find_if(parts.begin(), parts.end(), [&](const Panels& panels) {
        return row[i] < panels.column + panels.rows;
      });
      const int64_t at = row[i] - part->column;
      dequantise(*part, at / kPanel, static_cast<int>(at % kPanel), w + i * in_features);
    }
  });
  return out;
}

}  // namespace
}  // namespace cellbatch::kq

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("kquant_matmul_a8", &cellbatch::kq::kquant_matmul_a8);
  m.impl("kquant_rows", &cellbatch::kq::kquant_rows);
}
