// The kept GGUF block kinds' products (`kquant_matmul_a8`) on CPUs with AMX: quantized_kq.cpp
// calls them for the calls a8::amx_takes gives the tiles (from a few rows up).
//
// Owns: the tile arithmetic of those products, two ways.
// Group kinds (Q4_0 .. Q5_1): a tile product (TDPBSUD: the signed int8 inputs by the
// unsigned codes) of 16 rows' 32 quantised inputs of a group (tile A, the rows' own bytes,
// K apart) and one panel's operands of that group (tile B, 8 x 64 bytes: row s is the VNNI
// path's operand s, inputs 4s .. 4s + 3 of the 16 outputs) into a zeroed tile C gives each
// row's exact int32 dot product per output over the group. Tile C goes to an L1 buffer, and
// the float chain over groups (quantized_kq.cpp's comment) runs there, 4 rows at a time:
// t = fma(float(dot - z qs), s * d, t), and t = fma(o, sx, t) where the kind keeps o.
// A block of three panels' operands and terms is made once per 4 groups for every row of
// the call. Tiles: 0 the rows' inputs, 1-3 the block's operands, 4-6 its dot products
// (a8::TileShape::kGroups).
// K-quants: a block of 256 inputs needs only integers before its float step (isum, and
// Q4_K/Q5_K's imin), so the tiles make them whole from planes of weights that fit a byte,
// made once per panel and block for every row of the call (four tiles each of 64 inputs,
// 16 rows of 64 bytes), accumulated over the block by the tile products:
//   Q4_K, Q5_K: each group's codes times its scale sc = 2^k hi + lo (k = 4 for 4-bit codes,
//     3 for 5-bit) make two planes, q lo and q hi (every byte at most 225): isum = C_lo +
//     2^k C_hi. imin, the mins times the inputs' group sums, is the VNNI path's (fold_block):
//     a third plane of mins would cost a third of the tile products for 1/32 of the work.
//   Q6_K: w = sc (q - 32) (|w| <= 4096) is split as 64 hi + lo, lo in [0, 64) (TDPBSUD)
//     and hi in [-64, 64] (TDPBSSD): isum = C_lo + 64 C_hi.
// Then per row the block's float step of quantized_kq.cpp's chain. Tiles: 0 the rows'
// inputs, 1-2 the planes, 4-5 the sums (a8::TileShape::kBlocks).
// Promises: the VNNI path's chain over the same exact values, so y's bits do not depend on
// which path a call takes, on the other rows or on the thread count. Each thread configures
// its tiles when it starts a call and releases them when it ends it (a8::Tiles).
// Never: allocates per row, or runs unless a8::amx_takes said yes.

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "common.h"
#include "quantized_amx.h"
#include "quantized_amx_tiles.h"
#include "quantized_kq.h"
#include "quantized_kq_vnni.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CELLBATCH_KQ_VNNI) && defined(__linux__)
#define CELLBATCH_KQ_AMX 1
#endif

namespace cellbatch::kq {

#ifdef CELLBATCH_KQ_AMX

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c,amx-tile,amx-int8")

namespace {

constexpr int64_t kTileRows = 16;    // rows of an input tile and of a dot-product tile
constexpr int64_t kBlock = 3;        // panels per block: one tile each for operands and dots
constexpr int64_t kChunkGroups = 4;  // groups per fill of a block's operand tiles
constexpr int64_t kRowChunk = 128;   // rows per pass over a block: their inputs stay in L2
constexpr int64_t kRunRows = 4;      // rows per run of the float chain: 12 float sums
constexpr int64_t kTileBytes = 8 * 64;
constexpr int64_t kBlockWidth = kBlock * kPanel;

// What a thread holds for a call: its tiles; for the chunk of groups at hand, the block's
// operand tiles and terms per group; a row tile's dot products; and a last row tile of
// fewer than 16 rows, copied out.
struct alignas(64) Buffer {
  int8_t operands[kChunkGroups][kBlock][kTileBytes];
  int32_t dots[kChunkGroups][kBlock][kTileRows * kPanel];
  __m512 scales[kChunkGroups][kBlock];
  __m512 offsets[kChunkGroups][kBlock];
  int8_t tail[kTileRows][kChunkGroups * kGroup] = {};
  a8::Tiles tiles;
};

// Groups [g0, g0 + chunk) of P panels from p0: their operand tiles and terms.
template <int P, int kBits>
void fill(const Panels& panels, int64_t p0, int64_t g0, int64_t chunk, Buffer* buffer) {
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < chunk; ++i) {
      const int64_t g = g0 + i;
      const uint8_t* at = panels.group_codes(p0 + p, g);
      __m512i* tile = reinterpret_cast<__m512i*>(buffer->operands[i][p]);
      tile[0] = operand<kBits, 0>(at), tile[1] = operand<kBits, 1>(at);
      tile[2] = operand<kBits, 2>(at), tile[3] = operand<kBits, 3>(at);
      tile[4] = operand<kBits, 4>(at), tile[5] = operand<kBits, 5>(at);
      tile[6] = operand<kBits, 6>(at), tile[7] = operand<kBits, 7>(at);
      terms(panels, p0 + p, g, &buffer->scales[i][p], &buffer->offsets[i][p]);
    }
}

// The chain of R rows (row `first` of a row tile, row m of the call) over the chunk's
// `chunk` groups from g0, P panels; sums[r][16 kBlock] continue from group g0. kOffsets:
// the kind keeps m (Q4_1, Q5_1); else its codes count from `zero`.
template <int R, int P, bool kOffsets>
void chain(const Inputs& in, int32_t zero, int64_t m, int64_t first, int64_t g0, int64_t chunk,
           const Buffer* buffer, float* sums) {
  const a8::Quantised& xs = in.xs;
  const int64_t groups = xs.in_features / kGroup;
  __m512 total[R][P];
  load_totals<R, P, kBlockWidth>(total, sums, g0 != 0);
  for (int64_t i = 0; i < chunk; ++i) {
    const int64_t g = g0 + i;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m + r) * groups + g;
      const __m512 row_d = _mm512_set1_ps(xs.d[at]);
      const __m512 row_sx = _mm512_set1_ps(xs.sx[at]);
      const __m512i row_zero = _mm512_set1_epi32(zero * xs.qsum[at]);
#pragma GCC unroll 3
      for (int p = 0; p < P; ++p) {
        const __m512 row_scale = _mm512_mul_ps(buffer->scales[i][p], row_d);
        __m512i dot = _mm512_load_si512(buffer->dots[i][p] + (first + r) * kPanel);
        if constexpr (!kOffsets) dot = _mm512_sub_epi32(dot, row_zero);
        total[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, total[r][p]);
        if constexpr (kOffsets)
          total[r][p] = _mm512_fmadd_ps(buffer->offsets[i][p], row_sx, total[r][p]);
      }
    }
  }
  store_totals<R, P, kBlockWidth>(total, sums);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, int kBits>
void block(const Panels& panels, const Inputs& in, int64_t m, int64_t count, int64_t p0,
           Buffer* buffer, float* sums) {
  const int64_t in_features = in.xs.in_features, groups = panels.groups;
  buffer->tiles.configure(a8::TileShape::kGroups);
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - g0);
    fill<P, kBits>(panels, p0, g0, chunk, buffer);
    for (int64_t row0 = 0; row0 < count; row0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, count - row0);
      const auto [inputs, stride] =
          a8::row_tile(in.xs.q.data() + (m + row0) * in_features + g0 * kGroup, in_features,
                       rows, chunk * kGroup, buffer->tail[0], kChunkGroups * kGroup);
      a8::group_tile_dots<P, false>(
          inputs, stride, chunk, [&](int64_t i, int p) { return buffer->operands[i][p]; },
          [&](int64_t i, int p) { return buffer->dots[i][p]; });
      for (int64_t r = 0; r < rows; r += kRunRows)
        with_count<kRunRows>(std::min(kRunRows, rows - r), [&](auto run) {
          constexpr int kRun = decltype(run)::value;
          float* at = sums + (row0 + r) * kBlockWidth;
          if (has_m(panels.kind))
            chain<kRun, P, true>(in, 0, m + row0 + r, r, g0, chunk, buffer, at);
          else
            chain<kRun, P, false>(in, zero(panels.kind), m + row0 + r, r, g0, chunk, buffer, at);
        });
    }
  }
}

// ---- K-quants: the blocks' integer sums by tiles ----

constexpr int64_t kPlaneBytes = kTileRows * 64;  // a tile: 64 inputs of 16 outputs
constexpr int64_t kChunksPerBlock = kBlockInputs / 64;

// A row tile's integer sums over a block: C_lo and C_hi, [16 rows][16 outputs] each.
using RowTileSums = int32_t[2][kTileRows * kPanel];

// What a thread holds for a call: one panel's planes of one block (two per 64 inputs), its
// d and -dmin and (Q4_K, Q5_K) its mins' pairs; two row tiles' sums; a last row tile of
// fewer than 16 rows, copied out.
struct alignas(64) BlockBuffer {
  int8_t planes[kChunksPerBlock][2][kPlaneBytes];
  __m512 d, negative_dmin;
  __m512i min_pairs[4];
  RowTileSums sums[2];  // two row tiles': one's float steps run beside the next's products
  int8_t tail[kTileRows][kBlockInputs] = {};
  a8::Tiles tiles;
};

// Operand kS of a Q4_K/Q5_K group's codes `at` times the scale words into the planes' rows.
template <int kBits, int kS>
inline void put_planes(const uint8_t* at, __m512i low, __m512i high, int8_t* lo, int8_t* hi) {
  const __m512i q = operand<kBits, kS>(at);
  // Each 16-bit word holds two codes (at most 31) and the scale part (at most 15 for 4-bit
  // codes, 7 for 5-bit) in its low byte: each byte's product stays below 256, no carry.
  _mm512_store_si512(lo + 64 * kS, _mm512_mullo_epi16(q, low));
  _mm512_store_si512(hi + 64 * kS, _mm512_mullo_epi16(q, high));
}

// A Q6_K sub-group's 16 scales sc (int8) in the forms put_six_planes takes: in each output's
// 32-bit lane, sc as the even bytes' and as the odd bytes' multiplier (VPMADDUBSW: the
// other byte of each 16-bit word zero), and 32 sc in both 16-bit halves.
struct SixScales {
  __m512i even, odd, offset;
};

inline SixScales six_scales(const uint8_t* scales) {
  const __m512i lanes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  const __m512i byte = _mm512_and_si512(lanes, _mm512_set1_epi32(0xFF));
  const __m512i even = _mm512_or_si512(byte, _mm512_slli_epi32(byte, 16));
  const __m512i words = _mm512_or_si512(_mm512_and_si512(lanes, _mm512_set1_epi32(0xFFFF)),
                                        _mm512_slli_epi32(lanes, 16));
  return {even, _mm512_slli_epi32(even, 8), _mm512_slli_epi16(words, 5)};
}

// Operand kS of a Q6_K group's codes `at` and its sub-group's scales into the planes' rows:
// w = sc (q - 32) of the even and of the odd bytes as int16 words (VPMADDUBSW of the codes,
// at most 63, by sc is exact), then split by 64: the low plane's bytes are w's bits 0-5, the
// high plane's its bits 6-13 (w >> 6, |w| <= 4096), each picked from its word by a
// multishift and interleaved back into the operand's byte order.
template <int kS>
inline void put_six_planes(const uint8_t* at, const SixScales& scales, int8_t* lo, int8_t* hi) {
  const __m512i q = operand<6, kS>(at);
  const __m512i even = _mm512_sub_epi16(_mm512_maddubs_epi16(q, scales.even), scales.offset);
  const __m512i odd = _mm512_sub_epi16(_mm512_maddubs_epi16(q, scales.odd), scales.offset);
  constexpr __mmask64 kOddBytes = 0xAAAAAAAAAAAAAAAAull;
  // Bytes 2i and 2i + 1 of a 64-bit lane take the 8 bits from bit 16 i (low) or 16 i + 6
  // (high) of the lane of `even` or of `odd`.
  const __m512i from_low = _mm512_set1_epi64(0x3030202010100000);
  const __m512i from_high = _mm512_set1_epi64(0x3636262616160606);
  const __m512i low = _mm512_and_si512(
      _mm512_mask_multishift_epi64_epi8(even, kOddBytes, from_low, odd), _mm512_set1_epi8(63));
  const __m512i high = _mm512_mask_multishift_epi64_epi8(
      _mm512_multishift_epi64_epi8(from_high, even), kOddBytes, from_high, odd);
  _mm512_store_si512(lo + 64 * kS, low);
  _mm512_store_si512(hi + 64 * kS, high);
}

template <int kBits>
void make_planes(const Panels& panels, int64_t p, int64_t b, BlockBuffer* buffer) {
  constexpr int kShift = kBits == 4 ? 4 : 3;
  // The next block's codes and scales (the next panel's after a panel's last: panels lie one
  // after another) are asked for a group at a time, so that they arrive while the tiles work
  // on this one: the hardware prefetcher, seeing codes read in bursts between tile products
  // and starting afresh at each page, left this loop waiting on memory. All at once, the
  // requests held up this block's own loads.
  const int64_t group_bytes = code_bytes(panels.kind);
  const char* next_codes =
      reinterpret_cast<const char*>(panels.group_codes(p, 8 * b)) + 8 * group_bytes;
  const char* next_scales =
      reinterpret_cast<const char*>(panels.halves(p, 8 * b)) + (kBits == 6 ? 288 : 320);
  for (int64_t half = 0; half < 8; ++half) {
    const int64_t g = 8 * b + half;
    const int64_t row = (half % 2) * 8 * 64;  // a group is half of a 64-input tile
    int8_t* lo = buffer->planes[half / 2][0] + row;
    int8_t* hi = buffer->planes[half / 2][1] + row;
    const uint8_t* at = panels.group_codes(p, g);
    for (int64_t offset = 0; offset < group_bytes; offset += 64)
      _mm_prefetch(next_codes + half * group_bytes + offset, _MM_HINT_T0);
    if (half < 5) _mm_prefetch(next_scales + 64 * half, _MM_HINT_T0);
    if constexpr (kBits == 6) {
      const SixScales first = six_scales(panels.small(p, g, 0));
      const SixScales second = six_scales(panels.small(p, g, 1));
      put_six_planes<0>(at, first, lo, hi), put_six_planes<1>(at, first, lo, hi);
      put_six_planes<2>(at, first, lo, hi), put_six_planes<3>(at, first, lo, hi);
      put_six_planes<4>(at, second, lo, hi), put_six_planes<5>(at, second, lo, hi);
      put_six_planes<6>(at, second, lo, hi), put_six_planes<7>(at, second, lo, hi);
    } else {
      __m512i sc, mn;
      block_codes(panels, p, g, &sc, &mn);
      const __m512i words = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
      const __m512i low = _mm512_and_si512(words, _mm512_set1_epi16((1 << kShift) - 1));
      const __m512i high = _mm512_srli_epi16(words, kShift);
      put_planes<kBits, 0>(at, low, high, lo, hi), put_planes<kBits, 1>(at, low, high, lo, hi);
      put_planes<kBits, 2>(at, low, high, lo, hi), put_planes<kBits, 3>(at, low, high, lo, hi);
      put_planes<kBits, 4>(at, low, high, lo, hi), put_planes<kBits, 5>(at, low, high, lo, hi);
      put_planes<kBits, 6>(at, low, high, lo, hi);
      put_planes<kBits, 7>(at, low, high, lo, hi);
    }
  }
  if constexpr (kBits == 6) buffer->d = block_d(panels, p, 8 * b);
  else {
    block_halves(panels, p, 8 * b, &buffer->d, &buffer->negative_dmin);
    block_min_pairs(panels, p, 8 * b, buffer->min_pairs);
  }
}

// The tile products of a row tile (its inputs of the block at `inputs`, rows `stride`
// bytes apart) over the block's planes, into sums (C_lo, C_hi).
template <int kBits>
void block_sums(const int8_t* inputs, int64_t stride, BlockBuffer* buffer, RowTileSums& sums) {
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t c = 0; c < kChunksPerBlock; ++c) {
    _tile_loadd(0, inputs + 64 * c, stride);
    _tile_loadd(1, buffer->planes[c][0], 64);
    _tile_loadd(2, buffer->planes[c][1], 64);
    _tile_dpbsud(4, 0, 1);
    if constexpr (kBits == 6) _tile_dpbssd(5, 0, 2);
    else _tile_dpbsud(5, 0, 2);
  }
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock].
template <int P, int kBits>
void blocks_block(const Panels& panels, const Inputs& in, int64_t m, int64_t count, int64_t p0,
                  BlockBuffer* buffer, float* sums) {
  constexpr int kShift = kBits == 4 ? 4 : kBits == 5 ? 3 : 6;
  const a8::Quantised& xs = in.xs;
  const int64_t in_features = xs.in_features, groups = panels.groups;
  buffer->tiles.configure(a8::TileShape::kBlocks);
  for (int p = 0; p < P; ++p)
    for (int64_t b = 0; b < groups / 8; ++b) {
      make_planes<kBits>(panels, p0 + p, b, buffer);
      // The block's float step for `rows` rows from row0 of the call, from their tile sums.
      auto fold_rows = [&](int64_t row0, int64_t rows) {
        const RowTileSums& tile = buffer->sums[(row0 / kTileRows) % 2];
        for (int64_t r = 0; r < rows; ++r) {
          const __m512i lo = _mm512_load_si512(tile[0] + r * kPanel);
          const __m512i hi = _mm512_load_si512(tile[1] + r * kPanel);
          const __m512i isum = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, kShift));
          const int64_t i = (m + row0 + r) * groups + 8 * b;
          float* at = sums + (row0 + r) * kBlockWidth + p * kPanel;
          __m512 t = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(at);
          if constexpr (kBits == 6) {
            const __m512 scale = _mm512_mul_ps(buffer->d, _mm512_set1_ps(xs.d[i]));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, t);
          } else {
            t = fold_block(in.qsum_pairs.data() + i / 2, xs.d[i], isum, buffer->min_pairs,
                           buffer->d, buffer->negative_dmin, t);
          }
          _mm512_storeu_ps(at, t);
        }
      };
      for (int64_t row0 = 0; row0 < count; row0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, count - row0);
        const auto [inputs, stride] =
            a8::row_tile(xs.q.data() + (m + row0) * in_features + b * kBlockInputs, in_features,
                         rows, kBlockInputs, buffer->tail[0], kBlockInputs);
        // The float steps of the row tile before go after this one's tile products are
        // issued, so that the vector units work on them while the tiles multiply.
        block_sums<kBits>(inputs, stride, buffer, buffer->sums[(row0 / kTileRows) % 2]);
        if (row0 > 0) fold_rows(row0 - kTileRows, kTileRows);
        if (row0 + kTileRows >= count) fold_rows(row0, rows);
      }
    }
}

// The segment's products: blocks of panels between threads (common.h's for_each_block),
// each run by `block` over what a thread holds (a Buffer or a BlockBuffer).
template <typename Held, typename Block, typename T>
void products(const Inputs& in, const Panels& panels, int64_t out_features, T* y, Block&& block) {
  for_each_block<Held, kBlock, kRowChunk, 0>(
      in.count(), panels.panel_count,
      [&](auto width, int64_t m0, int64_t n, int64_t p0, Held* buffer, float* sums) {
        block(width, m0, n, p0, buffer, sums);
      },
      [&](int64_t m0, int64_t n, int64_t p0, const float* sums) {
        store_sums<kBlock>(sums, m0, n, p0, panels.rows, out_features, y + panels.column);
      });
}

template <int kBits, typename T>
void product_amx(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  if (chain_of(panels.kind) != Chain::kGroup) {
    products<BlockBuffer>(in, panels, out_features, y, [&](auto width, auto... rest) {
      blocks_block<decltype(width)::value, kBits>(panels, in, rest...);
    });
  } else {
    products<Buffer>(in, panels, out_features, y, [&](auto width, auto... rest) {
      block<decltype(width)::value, kBits>(panels, in, rest...);
    });
  }
}

}  // namespace

#pragma GCC pop_options

template <typename T>
void products_amx(const Inputs& in, const Panels& panels, int64_t out_features, T* y) {
  switch (bits(panels.kind)) {
    case 4: return product_amx<4>(in, panels, out_features, y);
    case 5: return product_amx<5>(in, panels, out_features, y);
    default: return product_amx<6>(in, panels, out_features, y);
  }
}

#else  // not x86-64 Linux with GCC or Clang: no tiles

template <typename T>
void products_amx(const Inputs&, const Panels&, int64_t, T*) {
  TORCH_CHECK(false, "kquant products_amx: no AMX path in this build");
}

#endif

template void products_amx<float>(const Inputs&, const Panels&, int64_t, float*);
template void products_amx<c10::BFloat16>(const Inputs&, const Panels&, int64_t, c10::BFloat16*);

}  // namespace cellbatch::kq
