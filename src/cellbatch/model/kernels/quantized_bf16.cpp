// The quantised products for bfloat16 activations on CPUs with AVX512-BF16: the bf16 path
// of `cellbatch::int4_matmul` and `int8_matmul` (quantized_matmul.cpp dispatches here).
//
// Owns: the arithmetic of that path. The codes are integers that bf16 holds exactly (int4:
// 0..15, int8: -127..127), so a panel's codes are turned into bf16 as they are, without
// their scales, and the rows run over them with the bf16 dot-product instruction: 32
// products per instruction, twice the fp32 FMAs'. The scales come in once per group of 32
// inputs, per row and output:
//   int4 (w = q s + o): y += s * sum(x q) + o * sum(x)
//   int8 (w = q s):     y += s * sum(x q)
// where sum(x q) is the group's dot product of the row's bf16 inputs with the codes (fp32
// accumulation) and sum(x) the group's sum of the row's inputs, computed once per call.
// Calls of up to 3 rows convert the codes in registers as they go; larger ones convert
// 256 inputs of a block of three panels at a time into a buffer that stays in L1 and run
// every row over it, 8 rows at a time, while the next chunk's codes are prefetched.
// Pairs: VDPBF16PS multiplies pairs of adjacent bf16 values, so each 32-bit lane of a
// weight register holds one output's codes for two inputs. For int8 the pair is (k, k+1);
// for int4 it is (8b + i, 8b + 4 + i), the nibbles that one shift of a code word's two
// 16-bit halves brings down together, and the activations are put in that order once per
// call. Threads split the blocks of panels.
// Promises: each output y[m, n] is the same chain of operations over the same values
// whatever the other rows of x, the path their count takes, the row blocks and the thread
// count (batch invariance): groups in input order, pairs in a fixed order within a group.
// The weights' bytes read are the int4/int8 codes and scales, as on the fp32 path. Results
// are bf16, rounded to nearest even from the fp32 sums.
// Never: runs on a CPU without AVX512-BF16, or where torch runs below the AVX512 width
// (`bf16_products_available` asks both, and the instructions live only in functions
// compiled for that target), or allocates per row.

#include "quantized_bf16.h"

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_BF16_PRODUCTS 1
#include <immintrin.h>
#endif

namespace cellbatch {

#ifdef CELLBATCH_BF16_PRODUCTS

bool bf16_products_available() {
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bf16") &&
                                torch_runs_avx512();
  return available;
}

// Everything below runs only after bf16_products_available() said yes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

namespace {

constexpr int64_t kPanel = 16;     // outputs per panel
constexpr int64_t kGroup = 32;     // inputs per group (one scale per group and output)
constexpr int64_t kPairs = kGroup / 2;
constexpr int64_t kBlock = 3;      // panels per block: three weight registers per pair
constexpr int64_t kChunk = 256;    // inputs per buffer fill: 24 KiB of bf16 for a block
constexpr int64_t kRows = 8;       // rows per call over a buffer: 8 x 3 accumulators
constexpr int64_t kFusedRows = 3;  // calls of up to this many rows convert in registers
constexpr int64_t kRowChunk = 256;  // rows per pass over a block: one buffer fill serves them
constexpr int64_t kPrefetchWords = 48;  // few-row path: codes asked for 3 KiB ahead per panel
constexpr int64_t kBlockWidth = kBlock * kPanel;

// A block's codes as bf16 pairs, kChunk inputs of each of its panels.
struct alignas(64) Buffer {
  uint16_t codes[kChunk / 2][kBlock][2 * kPanel];
};

// Asks for the cache lines of [p, p + bytes).
inline void prefetch(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(start + offset, _MM_HINT_T0);
}

// The tables below are constant data, never computed at load time: code that runs when
// the library loads must not hold AVX512 instructions, which this region may emit.

// Index vectors and lookup tables of 32 16-bit entries, built at compile time.
template <typename Entry>
constexpr std::array<uint16_t, 32> table32(Entry entry) {
  std::array<uint16_t, 32> out{};
  for (int i = 0; i < 32; ++i) out[i] = entry(i);
  return out;
}

// bf16(i & 15) in entry i: the top half of the float's bits, exact for small integers
// (v = 2^e + r, r < 2^e, is exponent 127 + e and mantissa r << (7 - e)). VPERMW reads
// the low 5 bits of an index, so a nibble with the next nibble's low bit above it still
// finds its value.
constexpr uint16_t bf16_of_small_integer(int i) {
  const int value = i & 15;
  if (value == 0) return 0;
  int exponent = 0;
  while ((2 << exponent) <= value) ++exponent;
  const int mantissa = (value - (1 << exponent)) << (7 - exponent);
  return static_cast<uint16_t>(((127 + exponent) << 7) | mantissa);
}
alignas(64) constexpr std::array<uint16_t, 32> kNibbleValues = table32(bf16_of_small_integer);
static_assert(kNibbleValues[1] == 0x3F80 && kNibbleValues[15] == 0x4170 && kNibbleValues[17] == 0x3F80);

// pair_order's permutation: within each 8 inputs, (0, 4, 1, 5, 2, 6, 3, 7).
alignas(64) constexpr std::array<uint16_t, 32> kPairOrder =
    table32([](int i) { return static_cast<uint16_t>(8 * (i / 8) + (i % 8) / 2 + 4 * (i % 2)); });

// int8_pair's interleaving of two inputs' 16 codes.
alignas(64) constexpr std::array<uint16_t, 32> kInterleave =
    table32([](int i) { return static_cast<uint16_t>(i % 2 == 0 ? i / 2 : 16 + i / 2); });

// int4 codes: a word holds inputs 8b .. 8b + 7 of one output, input 8b + i in bits 4i ..
// 4i + 3, so its low 16 bits hold inputs 8b .. 8b + 3 and its high ones 8b + 4 .. 8b + 7.
// Shifting both halves by 4i and looking the low nibbles up gives, in each 32-bit lane,
// the bf16 pair (q(8b + i), q(8b + 4 + i)): two instructions per pair of 16 outputs. The
// activations are put in the same order once per call (`pair_order`).
inline __m512i int4_pair(__m512i words, int i, __m512i values) {
  return _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * i), values);
}

// x's inputs reordered as int4_pair pairs them: within each 8, (0, 4, 1, 5, 2, 6, 3, 7).
void pair_order(const uint16_t* x, int64_t count, uint16_t* out) {
  const __m512i index = _mm512_load_si512(kPairOrder.data());
  for (int64_t i = 0; i < count; i += 32)
    _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(index, _mm512_loadu_si512(x + i)));
}

// int8 codes (input k's 16 codes together): a pair of inputs widened to fp32, narrowed to
// bf16 (exact) and interleaved.
inline __m512i int8_pair(const int8_t* codes, __m512i interleave) {
  const auto load = [](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(load(codes + kPanel), load(codes)));
  return _mm512_permutexvar_epi16(interleave, both);
}

// One format's panels: codes and scales, and how a pair of inputs becomes bf16.
template <typename S>
struct Int4Panels {
  static constexpr bool kOffset = true;
  const int32_t* codes;  // [P, K / 8, 16]
  const S* scales;       // [P, K / 32, 2, 16]
  int64_t in_features;
  const int32_t* words(int64_t p, int64_t b) const { return codes + (p * in_features / 8 + b) * kPanel; }
  __m512 scale(int64_t p, int64_t g) const { return load16(scales + ((p * in_features / kGroup + g) * 2) * kPanel); }
  __m512 offset(int64_t p, int64_t g) const { return load16(scales + ((p * in_features / kGroup + g) * 2 + 1) * kPanel); }
  // Asks for the codes and scales of the chunk [k0, k0 + len) of panel p.
  void prefetch_chunk(int64_t p, int64_t k0, int64_t len) const {
    prefetch(words(p, k0 / 8), len / 8 * kPanel * sizeof(int32_t));
    prefetch(scales + ((p * in_features + k0) / kGroup * 2) * kPanel, len / kGroup * 2 * kPanel * sizeof(S));
  }
  // The chunk [k0, k0 + len) of panel p into the buffer's slot.
  void fill(int64_t p, int64_t k0, int64_t len, int slot, Buffer& buffer) const {
    const __m512i values = _mm512_load_si512(kNibbleValues.data());
    for (int64_t b = k0 / 8; b < (k0 + len) / 8; ++b) {
      const __m512i w = _mm512_loadu_si512(words(p, b));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        _mm512_store_si512(buffer.codes[(8 * b - k0) / 2 + i][slot], int4_pair(w, i, values));
    }
  }
  // Group g's 16 pairs of panels p0 .. p0 + P - 1, converted in registers: fn(j, w[P]).
  template <int P, typename Fn>
  void visit_group(int64_t p0, int64_t g, Fn&& fn) const {
    const __m512i values = _mm512_load_si512(kNibbleValues.data());
    for (int64_t b = 4 * g; b < 4 * g + 4; ++b) {
      __m512i w[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        w[p] = _mm512_loadu_si512(words(p0 + p, b));
        _mm_prefetch(reinterpret_cast<const char*>(words(p0 + p, b + kPrefetchWords)), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m512bh pairs[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) pairs[p] = reinterpret_cast<__m512bh>(int4_pair(w[p], i, values));
        fn(4 * (b - 4 * g) + i, pairs);
      }
    }
  }
};

template <typename S>
struct Int8Panels {
  static constexpr bool kOffset = false;
  const int8_t* codes;  // [P, K, 16]
  const S* scales;      // [P, K / 32, 16]
  int64_t in_features;
  const int8_t* input(int64_t p, int64_t k) const { return codes + (p * in_features + k) * kPanel; }
  __m512 scale(int64_t p, int64_t g) const { return load16(scales + (p * in_features / kGroup + g) * kPanel); }
  __m512 offset(int64_t, int64_t) const { return _mm512_setzero_ps(); }
  void prefetch_chunk(int64_t p, int64_t k0, int64_t len) const {
    prefetch(input(p, k0), len * kPanel);
    prefetch(scales + (p * in_features + k0) / kGroup * kPanel, len / kGroup * kPanel * sizeof(S));
  }
  void fill(int64_t p, int64_t k0, int64_t len, int slot, Buffer& buffer) const {
    const __m512i interleave = _mm512_load_si512(kInterleave.data());
    for (int64_t k = k0; k < k0 + len; k += 2)
      _mm512_store_si512(buffer.codes[(k - k0) / 2][slot], int8_pair(input(p, k), interleave));
  }
  template <int P, typename Fn>
  void visit_group(int64_t p0, int64_t g, Fn&& fn) const {
    const __m512i interleave = _mm512_load_si512(kInterleave.data());
    for (int64_t j = 0; j < kPairs; ++j) {
      __m512bh pairs[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        pairs[p] = reinterpret_cast<__m512bh>(int8_pair(input(p0 + p, g * kGroup + 2 * j), interleave));
      fn(j, pairs);
    }
  }
};

// The rows' inputs as the products read them: x (bf16, in pair order for int4) and each
// row's sum of inputs per group (int4's offsets multiply it).
struct Rows {
  const uint16_t* x;
  const float* sums_x;  // [M, K / 32]
  int64_t in_features;
};

// R rows of `rows` (from row m) times panels p0 .. p0 + P - 1 over groups [g0, g1), pairs
// from next(g, fn): sums[r][0 .. 16P) continue (or start at group 0). Per group, the
// pairs' dot products in fp32 registers, then sums = fma(acc, scale, sums) and, for int4,
// sums = fma(sum of inputs, offset, sums).
template <int R, int P, typename Panels, typename Visit>
void rows_over_groups(const Panels& panels, const Rows& rows, int64_t m, int64_t p0, int64_t g0,
                      int64_t g1, Visit&& visit, float* sums) {
  const int64_t groups = rows.in_features / kGroup;
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    const uint16_t* x = rows.x + m * rows.in_features + g * kGroup;
    visit(g, [&](int64_t j, const __m512bh* w) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, x + r * rows.in_features + 2 * j, sizeof two);
        const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(two));
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xs, w[p]);
      }
    });
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 scale = panels.scale(p0 + p, g);
      const __m512 offset = panels.offset(p0 + p, g);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* out = sums + r * kBlockWidth + p * kPanel;
        __m512 total = _mm512_fmadd_ps(acc[r][p], scale, g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out));
        if constexpr (Panels::kOffset)
          total = _mm512_fmadd_ps(_mm512_set1_ps(rows.sums_x[(m + r) * groups + g]), offset, total);
        _mm512_storeu_ps(out, total);
      }
    }
  }
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, typename Panels>
void block(const Panels& panels, int64_t panel_count, const Rows& rows, int64_t m, int64_t count, int64_t p0,
           Buffer* buffer, float* sums) {
  const int64_t groups = rows.in_features / kGroup;
  if (count <= kFusedRows) {  // few rows: convert the codes in registers, once
    with_count<kFusedRows>(count, [&](auto r) {
      auto visit = [&](int64_t g, auto&& fn) { panels.template visit_group<P>(p0, g, fn); };
      rows_over_groups<decltype(r)::value, P>(panels, rows, m, p0, 0, groups, visit, sums);
    });
    return;
  }
  for (int64_t k0 = 0; k0 < rows.in_features; k0 += kChunk) {  // else through the buffer
    const int64_t len = std::min(kChunk, rows.in_features - k0);
    for (int slot = 0; slot < P; ++slot) panels.fill(p0 + slot, k0, len, slot, *buffer);
    // While the rows run over this chunk, the next one (of this block, else of the block
    // that follows it) comes from memory.
    const bool last = k0 + kChunk >= rows.in_features;
    const int64_t next_p0 = last ? p0 + P : p0, next_k0 = last ? 0 : k0 + kChunk;
    for (int64_t p = next_p0; p < std::min(next_p0 + P, panel_count); ++p)
      panels.prefetch_chunk(p, next_k0, std::min(kChunk, rows.in_features - next_k0));
    auto visit = [&](int64_t g, auto&& fn) {
      for (int64_t j = 0; j < kPairs; ++j) {
        __m512bh w[P];
        const int64_t pair = (g * kGroup - k0) / 2 + j;
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) w[p] = reinterpret_cast<__m512bh>(_mm512_load_si512(buffer->codes[pair][p]));
        fn(j, w);
      }
    };
    for (int64_t r = 0; r < count; r += kRows)
      with_count<kRows>(std::min(kRows, count - r), [&](auto n) {
        rows_over_groups<decltype(n)::value, P>(panels, rows, m + r, p0, k0 / kGroup,
                                                (k0 + len) / kGroup, visit, sums + r * kBlockWidth);
      });
  }
}

// Each row's sum of inputs per group, in a fixed order (two 16-lane halves added, then
// the lanes reduced), so that a row's sums never depend on the other rows.
void group_sums(const uint16_t* x, int64_t count, int64_t in_features, float* out) {
  const int64_t groups = in_features / kGroup;
  const auto* values = reinterpret_cast<const c10::BFloat16*>(x);
  for (int64_t i = 0; i < count * groups; ++i) {
    const c10::BFloat16* p = values + i * kGroup;
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(load16(p), load16(p + 16)));
  }
}

// A block's sums written to y as bf16 (rounded to nearest even), `count` rows.
void store_block(const float* sums, int64_t count, int64_t n0, int64_t out_features, uint16_t* y) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t p = 0; p < kBlock && n0 + p * kPanel < out_features; ++p) {
      const int64_t start = n0 + p * kPanel, width = std::min(kPanel, out_features - start);
      const __m256i narrowed = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(sums + r * kBlockWidth + p * kPanel)));
      _mm256_mask_storeu_epi16(y + r * out_features + start, static_cast<__mmask16>((1u << width) - 1), narrowed);
    }
}

// The product: blocks of kBlock panels split between threads; per block, rows in chunks
// of kRowChunk.
template <typename Panels>
at::Tensor product(const at::Tensor& x, const Panels& panels, int64_t panel_count, int64_t out_features) {
  const int64_t in_features = panels.in_features;
  const at::Tensor source = x.reshape({-1, in_features}).contiguous();
  const int64_t count = source.size(0), groups = in_features / kGroup;
  at::Tensor out = at::empty({count, out_features}, source.options());
  const auto* src = reinterpret_cast<const uint16_t*>(source.data_ptr<c10::BFloat16>());
  std::vector<uint16_t> ordered(Panels::kOffset ? count * in_features : 0);
  std::vector<float> sums_x(Panels::kOffset ? count * groups : 0);
  if (Panels::kOffset && count > 0) {
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      pair_order(src + begin * in_features, (end - begin) * in_features, ordered.data() + begin * in_features);
      group_sums(src + begin * in_features, end - begin, in_features, sums_x.data() + begin * groups);
    });
  }
  const Rows rows{Panels::kOffset ? ordered.data() : src, sums_x.data(), in_features};
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for_each_block<Buffer, kBlock, kRowChunk, kFusedRows>(
      count, panel_count,
      [&](auto width, int64_t m0, int64_t n, int64_t p0, Buffer* buffer, float* sums) {
        block<decltype(width)::value>(panels, panel_count, rows, m0, n, p0, buffer, sums);
      },
      [&](int64_t m0, int64_t n, int64_t p0, const float* sums) {
        store_block(sums, n, p0 * kPanel, out_features, dst + m0 * out_features);
      });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return out.view(shape);
}

}  // namespace

at::Tensor int4_matmul_bf16(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, int64_t out_features) {
  return for_scale_type(scales, "int4_matmul", [&](auto tag) {
    using S = decltype(tag);
    const Int4Panels<S> panels{codes.data_ptr<int32_t>(), scales.data_ptr<S>(), codes.size(1) * 8};
    return product(x, panels, codes.size(0), out_features);
  });
}

at::Tensor int8_matmul_bf16(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, int64_t out_features) {
  return for_scale_type(scales, "int8_matmul", [&](auto tag) {
    using S = decltype(tag);
    const Int8Panels<S> panels{codes.data_ptr<int8_t>(), scales.data_ptr<S>(), codes.size(1)};
    return product(x, panels, codes.size(0), out_features);
  });
}

#pragma GCC pop_options

#else  // not x86-64 with GCC or Clang: no bf16 path

bool bf16_products_available() { return false; }

at::Tensor int4_matmul_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int4_matmul: this build has no bf16 products");
}

at::Tensor int8_matmul_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int8_matmul: this build has no bf16 products");
}

#endif

}  // namespace cellbatch
