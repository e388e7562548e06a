// What both AMX paths share: quantized_amx.cpp's (int4 and int8 panels) and
// quantized_kq_amx.cpp's (GGUF blocks).
//
// Owns: a row tile's inputs (a part-filled last tile copied out), and one row tile's
// exact int32 dot products of a chunk of groups of 32 inputs with up to three panels'
// operand tiles (a8::TileShape::kGroups: tile 0 the rows' inputs, 1-3 the operands, 4-6
// the dots).
// Promises: dot(i, p) holds group i's 16 rows x 16 outputs of panel p, TDPBSSD's (signed
// operands) or TDPBSUD's (unsigned), the values VPDPBUSD sums on the VNNI path.
// Never: configures tiles (the caller's a8::Tiles has).

#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace cellbatch::a8 {

constexpr int64_t kRowTileRows = 16;  // the rows of an input tile and of a dot-product tile

// The inputs of a row tile: `rows` rows (at most 16) from `first`, `stride` bytes apart,
// `bytes` of each. A full tile's are read in place; a part-filled one's are copied into
// `tail` (rows tail_stride bytes apart), so that the tile load reads no further than the
// last row.
struct RowTile {
  const int8_t* inputs;
  int64_t stride;
};
inline RowTile row_tile(const int8_t* first, int64_t stride, int64_t rows, int64_t bytes,
                        int8_t* tail, int64_t tail_stride) {
  if (rows == kRowTileRows) return {first, stride};
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(tail + r * tail_stride, first + r * stride, bytes);
  return {tail, tail_stride};
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")

// Group i of the chunk (of `chunk` groups) has its inputs at `inputs` + 32 i, rows
// `stride` bytes apart; operand(i, p) gives panel p's tile of 8 rows of 64 bytes, and
// dot(i, p) the place of its 16 x 16 int32 dots.
template <int P, bool kSigned, typename Operand, typename Dot>
[[gnu::always_inline]] inline void group_tile_dots(const int8_t* inputs, int64_t stride,
                                                   int64_t chunk, Operand&& operand, Dot&& dot) {
  // Tile numbers are immediates: one statement per panel. The panels' products are issued
  // together, and only then stored, so that a store does not wait on the product just
  // before it.
  for (int64_t i = 0; i < chunk; ++i) {
    _tile_loadd(0, inputs + i * 32, stride);
    _tile_zero(4);
    if constexpr (P > 1) _tile_zero(5);
    if constexpr (P > 2) _tile_zero(6);
    _tile_loadd(1, operand(i, 0), 64);
    if constexpr (P > 1) _tile_loadd(2, operand(i, 1), 64);
    if constexpr (P > 2) _tile_loadd(3, operand(i, 2), 64);
    if constexpr (kSigned) {
      _tile_dpbssd(4, 0, 1);
      if constexpr (P > 1) _tile_dpbssd(5, 0, 2);
      if constexpr (P > 2) _tile_dpbssd(6, 0, 3);
    } else {
      _tile_dpbsud(4, 0, 1);
      if constexpr (P > 1) _tile_dpbsud(5, 0, 2);
      if constexpr (P > 2) _tile_dpbsud(6, 0, 3);
    }
    _tile_stored(4, dot(i, 0), 64);
    if constexpr (P > 1) _tile_stored(5, dot(i, 1), 64);
    if constexpr (P > 2) _tile_stored(6, dot(i, 2), 64);
  }
}

#pragma GCC pop_options

}  // namespace cellbatch::a8

#endif
