// What the int8-activation products (quantized_a8.cpp) share with their AVX2 path
// (quantized_a8_avx2.cpp) and the inputs' quantisation (quantized_a8_inputs.cpp): the panel
// and group sizes, the panels' layouts, each row's quantised inputs, and the AVX2
// products' entry points.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace cellbatch::a8 {

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int64_t kGroup = 32;  // inputs per group: one weight scale, one input scale

// Storage from a 64-byte line: where K is a multiple of 64 every row's inputs start a cache
// line, so that a tile or vector load of 64 inputs reads one line, not two.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}  // NOLINT: rebinding, as std::allocator does
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* at, std::size_t) { ::operator delete(at, std::align_val_t{64}); }
  bool operator==(const LineAllocator&) const { return true; }
};

// Each row's quantised inputs: q [M, K] (in the byte order of the weights' format), and per
// group [M, K / 32] d, qsum (the sum of the group's q) and sx = d qsum (quantized_a8_inputs.cpp).
struct Quantised {
  std::vector<int8_t, LineAllocator<int8_t>> q;
  std::vector<float> d, sx;
  std::vector<int32_t> qsum;
  int64_t in_features = 0;
};

// The int4 panels as both vector paths address them: words(p, b), panel p's code words
// for inputs 8b .. 8b + 7 (one 32-bit word of 8 nibbles per output; codes [P, K / 8, 16]);
// group(p, g), the group's 16 scales, then its 16 offsets (scales [P, K / 32, 2, 16]).
template <typename S>
struct Int4Layout {
  static constexpr bool kInt4 = true;
  const int32_t* codes;
  const S* scales;
  int64_t in_features;
  const int32_t* words(int64_t p, int64_t b) const {
    return codes + (p * in_features / 8 + b) * kPanel;
  }
  const S* group(int64_t p, int64_t g) const {
    return scales + ((p * in_features / kGroup + g) * 2) * kPanel;
  }
};

// The int8 panels laid out for these products: quad(p, j), panel p's codes of inputs
// 4j .. 4j + 3, four to each output's 32-bit lane (codes [P, K / 4, 16, 4]); group(p, g),
// the group's 16 scales (scales [P, K / 32, 16]).
template <typename S>
struct Int8Layout {
  static constexpr bool kInt4 = false;
  const int8_t* codes;
  const S* scales;
  int64_t in_features;
  const int8_t* quad(int64_t p, int64_t j) const {
    return codes + (p * in_features / 4 + j) * 4 * kPanel;
  }
  const S* group(int64_t p, int64_t g) const {
    return scales + (p * in_features / kGroup + g) * kPanel;
  }
};

// Which arithmetic the int8-input products take here: VPDPBUSD (AVX512-VNNI at torch's
// AVX512 width), VPMADDUBSW (AVX2), or the portable loop (neither, or
// CELLBATCH_A8_PORTABLE=1, read at each call).
enum class Path { kVnni, kAvx2, kPortable };
Path products_path();

// The order of each 8 quantised inputs of a group: their own (int8 and K-quant weights),
// or the int4 panels' nibble order, 0, 2, 4, 6, 1, 3, 5, 7 (quantised_slot).
enum class InputOrder { kOwn, kInt4 };
template <InputOrder kOrder>
constexpr int64_t quantised_slot(int64_t i) {
  return kOrder == InputOrder::kInt4 ? (i % 2) * 4 + i / 2 : i;
}

// rows [M, K] (contiguous float32 or bf16, K a multiple of `span`) quantised per group of
// 32 (quantized_a8_inputs.cpp), each group's scale d from the largest |x| of its span of
// inputs (32: its own; kquant's 256: its block's, so that a block's dot products add up in
// int32 before one float step), by the vector code where `path` is kVnni, else the
// portable loop: the same values either way.
Quantised quantise_rows(const at::Tensor& rows, Path path, int64_t span,
                        InputOrder order = InputOrder::kOwn);

// True when this library holds the AVX2 products and this CPU runs them (AVX2, FMA, F16C,
// detected when first asked) with torch at the AVX2 width or wider.
bool avx2_products_available();

// y [count, out_features] (T: float or c10::BFloat16) from the quantised rows and int4
// panels (codes [P, K / 8, 16], scales S [P, K / 32, 2, 16]) or int8 ones (codes
// [P, K / 4, 16, 4], scales [P, K / 32, 16]), S float or c10::Half: the same chain per
// output as the portable loop and the VNNI path, so the same bits.
template <typename S, typename T>
void int4_products_avx2(const Quantised& xs, const int32_t* codes, const S* scales,
                        int64_t panel_count, int64_t out_features, T* y);
template <typename S, typename T>
void int8_products_avx2(const Quantised& xs, const int8_t* codes, const S* scales,
                        int64_t panel_count, int64_t out_features, T* y);

}  // namespace cellbatch::a8
