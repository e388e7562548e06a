// The int8-activation products on CPUs with AMX: the tile path of `int4_matmul_a8` and
// `int8_matmul_a8` (quantized_a8.cpp quantises the rows and calls it for wide calls).
//
// Owns: the AMX arithmetic of those ops, whether this process may run it, and the switch
// CELLBATCH_AMX. A tile product (TDPBSUD: signed inputs by unsigned int4 codes; TDPBSSD:
// signed by signed int8 codes) of 16 rows' 32 quantised inputs (tile A, 16 x 32 bytes,
// the rows' own bytes with stride K) and one panel's codes of those inputs (tile B, 8 x
// 64 bytes: four inputs of each of the 16 outputs to a 32-bit lane, the layout the VNNI
// path's operands have) into a zeroed tile C gives each group's exact int32 dot products,
// the values VPDPBUSD sums in the VNNI path: one TDPBxxD per group of 32 inputs, 16 rows
// and 16 outputs (8,192 products), so groups never mix. Tile C goes to an L1 buffer, and
// the float chain over groups runs there as in the other paths:
//   int4: t = fma(float(dot), s * d, t); t = fma(o, sx, t)      int8: t = fma(float(dot), s * d, t)
// int4 code words become tile rows as the VNNI path splits them (bytes of word & 0x0F0F0F0F,
// then of word >> 4 & 0x0F0F0F0F), once per 256 inputs of a block of three panels, and
// every row of the call runs over them; int8 tiles are read from the panels as they lie.
// Tiles: 0 the rows' inputs, 1-3 the block's codes, 4-6 its dot products.
// Promises: the same chain over the same exact values as the portable loop, the VNNI
// path and the AVX2 path, so y's bits do not depend on which path a call takes, on the
// other rows or on the thread count; quantized_a8.cpp may choose by the row count.
// Runs only where amx_products_available() said yes: CPUID, torch at the AVX512 width,
// and Linux's permission for the tile data (asked once per process; refused, the VNNI
// path runs). Each thread loads its tile configuration when it starts a call and
// releases the tiles when it ends one, so torch's oneDNN (which uses AMX too) and this
// path never see each other's tile state.
// Never: allocates per row, or runs when CELLBATCH_AMX=0.

#include "quantized_amx.h"
#include "quantized_amx_tiles.h"

#include "common.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define CELLBATCH_AMX_PRODUCTS 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cellbatch::a8 {

// Calls of up to 3 rows run faster on the VNNI path, which makes their operands in
// registers; from 4 rows, where it goes through a buffer as the tiles do, the tiles win
// (the "a8 vnni" and "a8 amx" columns of benchmarks/quantized.py --products --rows 2,3,4,6).
constexpr int64_t kAmxMinRows = 4;

int64_t amx_min_rows() { return kAmxMinRows; }

bool amx_takes(int64_t rows) {
  const char* value = std::getenv("CELLBATCH_AMX");
  const bool unset = value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0;
  const bool off = !unset && std::strcmp(value, "0") == 0;
  const bool always = !unset && std::strcmp(value, "always") == 0;
  TORCH_CHECK(unset || off || always, "CELLBATCH_AMX=", value,
              " is not a choice: use auto (the tile path for calls of at least ", kAmxMinRows,
              " rows, the default), 0 (never) or always (every call, for tests)");
  if (off || !amx_products_available()) return false;
  return always || rows >= kAmxMinRows;
}

#ifdef CELLBATCH_AMX_PRODUCTS

namespace {

constexpr int64_t kTileRows = 16;    // rows of an input tile and of a dot-product tile
constexpr int64_t kBlock = 3;        // panels per block: one tile each for codes and dots
constexpr int64_t kChunkGroups = 4;  // groups per fill of a block's code tiles: 6 KiB
constexpr int64_t kRowChunk = 128;   // rows per pass over a block: their inputs stay in L2
constexpr int64_t kRunRows = 4;      // rows per run of the float chain: 12 float sums
constexpr int64_t kTileBytes = 8 * 64;
constexpr int64_t kBlockWidth = kBlock * kPanel;

// CPUID leaf 7's AMX-TILE and AMX-INT8 bits, then Linux's permission to use the tile
// data (XFEATURE_XTILEDATA, 18), which a process must ask for before its first tile
// instruction; a kernel without AMX support refuses it.
bool tiles_permitted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1u, int8 = (edx >> 25) & 1u;
  if (!tile || !int8) return false;
  constexpr int kGetPermission = 0x1022, kRequestPermission = 0x1023, kTileData = 18;
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetPermission, &granted) != 0) return false;
  return (granted >> kTileData) & 1u;
}

}  // namespace

bool amx_products_available() {
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512vbmi") && torch_runs_avx512() &&
                                tiles_permitted();
  return available;
}

// Everything below runs only after amx_products_available() said yes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-int8")

namespace {

// A tile configuration (palette 1): a8::TileShape's tiles 0-6.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(TileShape shape) {
    const bool blocks = shape == TileShape::kBlocks;
    rows[0] = kTileRows, bytes_per_row[0] = blocks ? 64 : kGroup;  // the rows' inputs
    for (int t = 1; t <= kBlock; ++t) rows[t] = blocks ? 16 : 8, bytes_per_row[t] = 64;  // codes
    for (int t = 1 + kBlock; t <= 2 * kBlock; ++t) rows[t] = kTileRows, bytes_per_row[t] = 64;
  }
};

// Objects that hold the configurations in memory: built on the stack beside the load,
// their rows and widths were stores the compiler dropped (it sees LDTILECFG read no further).
const TileConfig kGroupTiles(TileShape::kGroups);
const TileConfig kBlockTiles(TileShape::kBlocks);

}  // namespace

void load_tile_config(TileShape shape) {
  _tile_loadconfig(shape == TileShape::kBlocks ? &kBlockTiles : &kGroupTiles);
}

void release_tiles() { _tile_release(); }

namespace {

// A format's panels as the tile products read them: tile(p, g, scratch), the 512 bytes of
// tile B for panel p's group g (8 rows of 16 outputs' four codes), made in scratch when
// the panels do not hold them so; kSigned, whether the codes are signed bytes.
template <typename S>
struct Int4Tiles : Int4Layout<S> {
  static constexpr bool kSigned = false;
  // Row 2j + h: bytes of (word >> 4h) & 0x0F0F0F0F of the group's word j, inputs 8j + 2i + h
  // of the group in byte i, the order the quantised inputs of int4 weights are stored in.
  const int8_t* tile(int64_t p, int64_t g, int8_t* scratch) const {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t j = 0; j < 4; ++j) {
      const __m512i word = _mm512_loadu_si512(this->words(p, 4 * g + j));
      _mm512_store_si512(scratch + 128 * j, _mm512_and_si512(word, nibble));
      _mm512_store_si512(scratch + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi32(word, 4), nibble));
    }
    return scratch;
  }
};

template <typename S>
struct Int8Tiles : Int8Layout<S> {
  static constexpr bool kSigned = true;
  const int8_t* tile(int64_t p, int64_t g, int8_t*) const { return this->quad(p, 8 * g); }
};

using Dots = int32_t[kChunkGroups][kBlock][kTileRows * kPanel];

// What a thread holds for a call: its tiles; for the chunk of groups at hand, the block's
// code tiles (int4's made once for every row of the call) and its scales and offsets as
// float32; a row tile's dot products; and a last row tile of fewer than 16 rows, copied
// out with zero rows after it.
struct alignas(64) Buffer {
  int8_t codes[kChunkGroups][kBlock][kTileBytes];
  Dots dots;
  float scales[kChunkGroups][kBlock][kPanel];
  float offsets[kChunkGroups][kBlock][kPanel];
  int8_t tail[kTileRows][kChunkGroups * kGroup] = {};
  const int8_t* tiles[kChunkGroups][kBlock];
  Tiles state;
};

// The float chain of R rows (row `first` of a row tile, quantised row m) over the chunk's
// `count` groups from g0, P panels, from that tile's dot products; sums[r][16 kBlock]
// continue from group g0 (start at 0).
template <int R, int P, bool kInt4>
void chain(const Quantised& xs, int64_t m, int64_t first, int64_t g0, int64_t count,
           const Buffer* buffer, const Dots& dots, float* sums) {
  const int64_t groups = xs.in_features / kGroup;
  const float* d = xs.d.data() + m * groups + g0;
  const float* sx = xs.sx.data() + m * groups + g0;
  __m512 total[R][P];
  load_totals<R, P, kBlockWidth>(total, sums, g0 != 0);
  for (int64_t i = 0; i < count; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 row_d = _mm512_set1_ps(d[r * groups + i]);
      const __m512 row_sx = kInt4 ? _mm512_set1_ps(sx[r * groups + i]) : row_d;
#pragma GCC unroll 3
      for (int p = 0; p < P; ++p) {
        const __m512 row_scale = _mm512_mul_ps(_mm512_load_ps(buffer->scales[i][p]), row_d);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[i][p] + (first + r) * kPanel));
        total[r][p] = _mm512_fmadd_ps(dot, row_scale, total[r][p]);
        if constexpr (kInt4)
          total[r][p] = _mm512_fmadd_ps(_mm512_load_ps(buffer->offsets[i][p]), row_sx, total[r][p]);
      }
    }
  }
  store_totals<R, P, kBlockWidth>(total, sums);
}

// One block (P panels from p0) for `count` rows from m, into sums [count][16 kBlock]: per
// chunk of groups, the block's code tiles once, then per row tile its dot products and the
// chain of its rows over them. (The tile loads and stores do not overlap the vector
// units' work on the CPUs measured, so nothing is gained by interleaving the two.)
template <int P, typename Panels>
void block(const Panels& panels, const Quantised& xs, int64_t m, int64_t count, int64_t p0,
           Buffer* buffer, float* sums) {
  const int64_t in_features = xs.in_features, groups = in_features / kGroup;
  buffer->state.configure();
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - g0);
    for (int64_t i = 0; i < chunk; ++i)
      for (int p = 0; p < P; ++p) {
        buffer->tiles[i][p] = panels.tile(p0 + p, g0 + i, buffer->codes[i][p]);
        const auto* group = panels.group(p0 + p, g0 + i);
        _mm512_store_ps(buffer->scales[i][p], load16(group));
        if constexpr (Panels::kInt4) _mm512_store_ps(buffer->offsets[i][p], load16(group + kPanel));
      }
    for (int64_t row0 = 0; row0 < count; row0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, count - row0);
      const auto [inputs, stride] =
          row_tile(xs.q.data() + (m + row0) * in_features + g0 * kGroup, in_features, rows,
                   chunk * kGroup, buffer->tail[0], kChunkGroups * kGroup);
      group_tile_dots<P, Panels::kSigned>(
          inputs, stride, chunk, [&](int64_t i, int p) { return buffer->tiles[i][p]; },
          [&](int64_t i, int p) { return buffer->dots[i][p]; });
      for (int64_t r = 0; r < rows; r += kRunRows)
        with_count<kRunRows>(std::min(kRunRows, rows - r), [&](auto run) {
          chain<decltype(run)::value, P, Panels::kInt4>(xs, m + row0 + r, r, g0, chunk, buffer,
                                                        buffer->dots, sums + (row0 + r) * kBlockWidth);
        });
    }
  }
}

template <typename Panels, typename T>
void product_amx(const Quantised& xs, const Panels& panels, int64_t panel_count,
                 int64_t out_features, T* y) {
  const int64_t count = static_cast<int64_t>(xs.d.size()) / (xs.in_features / kGroup);
  for_each_block<Buffer, kBlock, kRowChunk, 0>(
      count, panel_count,
      [&](auto width, int64_t m0, int64_t n, int64_t p0, Buffer* buffer, float* sums) {
        block<decltype(width)::value>(panels, xs, m0, n, p0, buffer, sums);
      },
      [&](int64_t m0, int64_t n, int64_t p0, const float* sums) {
        store_sums<kBlock>(sums, m0, n, p0, out_features, out_features, y);
      });
}

}  // namespace

template <typename S, typename T>
void int4_products_amx(const Quantised& xs, const int32_t* codes, const S* scales,
                       int64_t panel_count, int64_t out_features, T* y) {
  product_amx(xs, Int4Tiles<S>{{codes, scales, xs.in_features}}, panel_count, out_features, y);
}

template <typename S, typename T>
void int8_products_amx(const Quantised& xs, const int8_t* codes, const S* scales,
                       int64_t panel_count, int64_t out_features, T* y) {
  product_amx(xs, Int8Tiles<S>{{codes, scales, xs.in_features}}, panel_count, out_features, y);
}

#pragma GCC pop_options

#else  // not x86-64 Linux with GCC or Clang: no tiles

bool amx_products_available() { return false; }
void load_tile_config(TileShape) {
  TORCH_CHECK(false, "load_tile_config: no AMX path in this build");
}
void release_tiles() {}

template <typename S, typename T>
void int4_products_amx(const Quantised&, const int32_t*, const S*, int64_t, int64_t, T*) {
  TORCH_CHECK(false, "int4_products_amx: no AMX path in this build");
}
template <typename S, typename T>
void int8_products_amx(const Quantised&, const int8_t*, const S*, int64_t, int64_t, T*) {
  TORCH_CHECK(false, "int8_products_amx: no AMX path in this build");
}

#endif

#define CELLBATCH_AMX_INSTANCES(S, T)                                                          \
  template void int4_products_amx<S, T>(const Quantised&, const int32_t*, const S*, int64_t,  \
                                        int64_t, T*);                                          \
  template void int8_products_amx<S, T>(const Quantised&, const int8_t*, const S*, int64_t,   \
                                        int64_t, T*);
CELLBATCH_AMX_INSTANCES(float, float)
CELLBATCH_AMX_INSTANCES(float, c10::BFloat16)
CELLBATCH_AMX_INSTANCES(c10::Half, float)
CELLBATCH_AMX_INSTANCES(c10::Half, c10::BFloat16)
#undef CELLBATCH_AMX_INSTANCES

}  // namespace cellbatch::a8
