// The int8-activation products on CPUs with AMX (quantized_amx.cpp): when a call takes
// them, and their entry points, beside the VNNI path (quantized_a8.cpp) that calls them.

#pragma once

#include "quantized_a8.h"

#include <cstdint>

namespace cellbatch::a8 {

// True when this library holds the AMX products and this process may run them: the CPU
// has AMX-TILE and AMX-INT8 besides the VNNI path's AVX512 features and AVX512-VBMI, which
// every AMX CPU has (CPUID; the K-quant planes use its byte multishift), torch runs at
// the AVX512 width, and Linux granted the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM; refused, or another OS: false). Asked once, when first needed.
bool amx_products_available();

// Whether a call of `rows` rows runs on AMX: amx_products_available() and the switch
// CELLBATCH_AMX (read at each call, as the tests set it): unset or "auto", calls of at
// least amx_min_rows() rows; "0", none; "always", every call (for the tests). Any other
// value is an error that names these.
bool amx_takes(int64_t rows);
int64_t amx_min_rows();

// The tile products' configurations (palette 1). kGroups: tile 0, 16 rows of 32 input
// bytes; tiles 1-3, 8 rows of 64 code bytes (four inputs of 16 outputs to a 32-bit lane);
// tiles 4-6, 16 x 16 int32 dot products. kBlocks (quantized_kq_amx.cpp's K-quant blocks):
// tiles 0-6 all 16 rows of 64 bytes (64 inputs of 16 rows; 64 inputs of 16 outputs; dots).
enum class TileShape { kGroups, kBlocks };

// The configuration of `shape` loaded on this thread; then the tiles released. Only after
// amx_products_available().
void load_tile_config(TileShape shape);
void release_tiles();

// A thread's tiles over one call: configured at its first tile product, released when the
// thread is done with the call, so that torch's oneDNN (which uses AMX too) and these
// products never see each other's tile state.
class Tiles {
 public:
  Tiles() = default;
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() {
    if (configured_) release_tiles();
  }
  void configure(TileShape shape = TileShape::kGroups) {
    if (configured_ && shape == shape_) return;
    load_tile_config(shape);
    configured_ = true;
    shape_ = shape;
  }

 private:
  bool configured_ = false;
  TileShape shape_ = TileShape::kGroups;
};

// y [count, out_features] (T: float or c10::BFloat16) from the quantised rows and int4
// panels (Int4Layout) or int8 ones (Int8Layout, whose [P, K / 4, 16, 4] codes are the
// tiles' own layout: any format whose int8 codes and per-group scales can be laid out so
// can call int8_products_amx), S float or c10::Half: each group's exact int32 dot products
// by one tile product per 32 inputs, then the portable loop's chain per output, so the
// same bits as the VNNI, AVX2 and portable paths. Only after amx_products_available().
template <typename S, typename T>
void int4_products_amx(const Quantised& xs, const int32_t* codes, const S* scales,
                       int64_t panel_count, int64_t out_features, T* y);
template <typename S, typename T>
void int8_products_amx(const Quantised& xs, const int8_t* codes, const S* scales,
                       int64_t panel_count, int64_t out_features, T* y);

}  // namespace cellbatch::a8
