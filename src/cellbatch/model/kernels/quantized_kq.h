// The kept GGUF block formats (cellbatch/model/kquants.py writes them) as the products of
// quantized_kq.cpp (VNNI, portable), quantized_kq_avx2.cpp (AVX2) and quantized_kq_amx.cpp
// (AMX tiles) read them: the kinds, the header of a weight's segments, each segment's
// panels, and the scalar reading of one code and one sub-group's scale and offset (the portable loop's, which the vector paths
// must equal).
//
// Per panel of 16 outputs and group g of 32 inputs the codes take 256 bytes of nibbles
// (word (b, c): byte j's low nibble is input 8b + j, its high one input 8b + 4 + j), then
// for 5-bit kinds 64 bytes (word c: bit 8j + s is bit 4 of input 4s + j) and for Q6_K 128
// (words (w, c): bits 8j + 2t .. + 1 are bits 4-5 of input 16w + 4t + j). So operand s
// (inputs 4s .. 4s + 3 of the 16 outputs, one 32-bit lane each, the inputs in order) is
// one mask or shift of a nibble word, plus one shift and mask of a high-bit word.
// Scales per panel: group kinds per group d[16] float16, then m[16] for Q4_1 and Q5_1 (Q4_0
// and Q5_0 have none: their codes count from a zero); Q4_K/Q5_K per block of 256
// d[16], dmin[16] float16 then per group sc[16], mn[16] uint8; Q6_K per block of 256 d[16]
// float16 then per group of 16 sc[16] int8.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "quantized_a8.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cellbatch::kq {

constexpr int64_t kPanel = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kBlockInputs = 256;  // inputs per K-quant block
constexpr int32_t kMagic = 0x3230514B;  // "KQ02"

enum Kind : int32_t { kQ4_0 = 0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kKinds };

constexpr int bits(Kind kind) {
  return kind == kQ6_K ? 6 : (kind == kQ5_0 || kind == kQ5_1 || kind == kQ5_K) ? 5 : 4;
}
constexpr bool in_blocks(Kind kind) { return kind >= kQ4_K; }
constexpr int64_t code_bytes(Kind kind) { return bits(kind) == 4 ? 256 : bits(kind) == 5 ? 320 : 384; }
// How a kind's dot products become outputs (quantized_kq.cpp's chains): per group of 32
// (Q4_0 .. Q5_1), or per block of 256 with integer scales and mins (Q4_K, Q5_K) or integer
// scales per sub-group of 16 and codes counted from 32 (Q6_K).
enum class Chain { kGroup, kBlock, kSix };
constexpr Chain chain_of(Kind kind) {
  return kind == kQ6_K ? Chain::kSix : kind >= kQ4_K ? Chain::kBlock : Chain::kGroup;
}
// fn(bits, chain) for a segment's kind, both std::integral_constants: the vector paths
// compile their loops per code width and chain.
template <typename Fn>
void with_kind(Kind kind, Fn&& fn) {
  using Bits4 = std::integral_constant<int, 4>;
  using Bits5 = std::integral_constant<int, 5>;
  using Group = std::integral_constant<Chain, Chain::kGroup>;
  using Block = std::integral_constant<Chain, Chain::kBlock>;
  switch (chain_of(kind)) {
    case Chain::kGroup: return bits(kind) == 4 ? fn(Bits4{}, Group{}) : fn(Bits5{}, Group{});
    case Chain::kBlock: return bits(kind) == 4 ? fn(Bits4{}, Block{}) : fn(Bits5{}, Block{});
    default: return fn(std::integral_constant<int, 6>{}, std::integral_constant<Chain, Chain::kSix>{});
  }
}
// Sub-groups of a group of 32 inputs, each with its own scale: Q6_K's 16-input ones.
constexpr int subs(Kind kind) { return kind == kQ6_K ? 2 : 1; }
// w = d (q - zero) for Q4_0 and Q5_0, which keep no m; the other kinds' zero is 0.
constexpr int32_t zero(Kind kind) { return kind == kQ4_0 ? 8 : kind == kQ5_0 ? 16 : 0; }
constexpr bool has_m(Kind kind) { return kind == kQ4_1 || kind == kQ5_1; }
// A group kind's scale bytes per panel and group: d[16] (and m[16]).
constexpr int64_t group_scale_bytes(Kind kind) { return has_m(kind) ? 64 : 32; }
[[gnu::always_inline]] inline int64_t scale_bytes(Kind kind, int64_t in_features) {
  if (kind == kQ6_K) return in_features / kBlockInputs * (32 + 256);
  if (in_blocks(kind)) return in_features / kBlockInputs * (64 + 256);
  return in_features / kGroup * group_scale_bytes(kind);
}

// One segment of a weight's rows: `rows` outputs of one kind from output `column`. Its
// address helpers run per group in the products' inner loops: always inlined (left to
// the compiler, some were calls through the PLT).
struct Panels {
  Kind kind;
  int64_t rows, column, panel_count, groups;
  const uint8_t* codes;
  const uint8_t* scales;

  [[gnu::always_inline]] const uint8_t* group_codes(int64_t p, int64_t g) const {
    return codes + (p * groups + g) * code_bytes(kind);
  }
  [[gnu::always_inline]] const uint8_t* panel_scales(int64_t p) const {
    return scales + p * scale_bytes(kind, groups * kGroup);
  }
  // The bytes of group g's scales: its d (group kinds: and m), or its block's d (and dmin).
  [[gnu::always_inline]] const uint8_t* halves(int64_t p, int64_t g) const {
    if (!in_blocks(kind)) return panel_scales(p) + g * group_scale_bytes(kind);
    return panel_scales(p) + g / 8 * (kind == kQ6_K ? 288 : 320);
  }
  // Group g's integer scales (and mins): sc[16] (then mn[16]); Q6_K: sub-group `sub`'s sc.
  [[gnu::always_inline]] const uint8_t* small(int64_t p, int64_t g, int sub) const {
    if (kind == kQ6_K) return halves(p, g) + 32 + ((g % 8) * 2 + sub) * kPanel;
    return halves(p, g) + 64 + (g % 8) * 2 * kPanel;
  }

  // Output c's code of input k (0..31) of group g.
  int code(int64_t p, int64_t g, int c, int k) const {
    const uint8_t* at = group_codes(p, g);
    const int s = k / 4, j = k % 4;
    const uint8_t byte = at[(s / 2) * 64 + c * 4 + j];
    int q = s % 2 == 0 ? byte & 15 : byte >> 4;
    if (bits(kind) == 5) q |= ((at[256 + c * 4 + j] >> s) & 1) << 4;
    if (bits(kind) == 6) q |= ((at[256 + (s / 4) * 64 + c * 4 + j] >> (2 * (s % 4))) & 3) << 4;
    return q;
  }

  // Output c's scale and offset of group g for the group kinds, w = d (q - zero) + m: d,
  // and m (0 where the kind has none).
  void terms(int64_t p, int64_t g, int c, float* scale, float* offset) const {
    const uint8_t* h = halves(p, g);
    *scale = static_cast<float>(half_at(h, c));
    *offset = has_m(kind) ? static_cast<float>(half_at(h + 32, c)) : 0.0f;
  }

  // Q6_K: output c's integer scale of sub-group `sub` of group g, and its block's d.
  int sub_scale(int64_t p, int64_t g, int sub, int c) const {
    return static_cast<int8_t>(small(p, g, sub)[c]);
  }
  float block_d(int64_t p, int64_t g, int c) const {
    return static_cast<float>(half_at(halves(p, g), c));
  }

  // Q4_K and Q5_K: output c's integer scale and min of group g (w = d sc q - dmin mn).
  int scale_code(int64_t p, int64_t g, int c) const { return small(p, g, 0)[c]; }
  int min_code(int64_t p, int64_t g, int c) const { return small(p, g, 0)[kPanel + c]; }
  // ... and of g's block, d and -dmin.
  void block_halves(int64_t p, int64_t g, int c, float* d, float* negative_dmin) const {
    const uint8_t* h = halves(p, g);
    *d = static_cast<float>(half_at(h, c));
    *negative_dmin = -static_cast<float>(half_at(h + 32, c));
  }

  static c10::Half half_at(const uint8_t* at, int c) {
    c10::Half value;
    std::memcpy(&value, at + 2 * c, 2);
    return value;
  }
};

// A segment's panels (Panels) seen with the strides its kind's bits and chain fix: the
// same addresses as Panels' accessors, computed without their run-time choice of kind,
// which in the few-row loops cost a compare and a multiply at every operand.
template <int kBits, Chain kChain>
struct Layout {
  static constexpr int64_t kCodeBytes = kBits == 4 ? 256 : kBits == 5 ? 320 : 384;
  static constexpr int64_t kBlockBytes = kChain == Chain::kSix ? 288 : 320;  // scales a block

  Kind kind;
  int64_t groups;
  int64_t group_scales;  // the group kinds' bytes per group (group_scale_bytes)
  const uint8_t* codes;
  const uint8_t* scales;

  explicit Layout(const Panels& panels)
      : kind(panels.kind),
        groups(panels.groups),
        group_scales(group_scale_bytes(panels.kind)),
        codes(panels.codes),
        scales(panels.scales) {}
  [[gnu::always_inline]] const uint8_t* group_codes(int64_t p, int64_t g) const {
    return codes + (p * groups + g) * kCodeBytes;
  }
  [[gnu::always_inline]] const uint8_t* halves(int64_t p, int64_t g) const {
    if constexpr (kChain == Chain::kGroup) return scales + (p * groups + g) * group_scales;
    return scales + (p * groups / 8 + g / 8) * kBlockBytes;
  }
  [[gnu::always_inline]] const uint8_t* small(int64_t p, int64_t g, int sub) const {
    if constexpr (kChain == Chain::kSix) return halves(p, g) + 32 + ((g % 8) * 2 + sub) * kPanel;
    return halves(p, g) + 64 + (g % 8) * 2 * kPanel;
  }
  // Asks for group g's codes of panel p into L2: locality 2 is PREFETCHT1 on x86.
  [[gnu::always_inline]] void ask_for_codes(int64_t p, int64_t g) const {
    const uint8_t* at = group_codes(p, g);
    for (int64_t line = 0; line < kCodeBytes; line += 64) __builtin_prefetch(at + line, 0, 2);
  }
  // ... and its scales too (a block's, which start anywhere in a line, with its first
  // group's).
  [[gnu::always_inline]] void ask_for(int64_t p, int64_t g) const {
    ask_for_codes(p, g);
    const uint8_t* h = halves(p, g);
    if constexpr (kChain == Chain::kGroup) {
      __builtin_prefetch(h, 0, 2);
    } else if (g % 8 == 0) {
      for (int64_t line = 0; line < kBlockBytes; line += 64) __builtin_prefetch(h + line, 0, 2);
      __builtin_prefetch(h + kBlockBytes - 1, 0, 2);
    }
  }
};

// Each row's quantised inputs beside the sums the blocks' chains need: Q6_K, per row and
// 16 inputs, the sum of their codes (qs16 [M, K / 16]); Q4_K/Q5_K's mins, the groups' sums
// xs.qsum two by two as int16 halves of an int32 (qsum_pairs [M, K / 64]: VPDPWSSD's
// operand, made once per call rather than per panel).
struct Inputs {
  const a8::Quantised& xs;
  std::vector<int32_t> qs16;
  std::vector<int32_t> qsum_pairs;
  int64_t count() const { return static_cast<int64_t>(xs.d.size()) / (xs.in_features / kGroup); }
};

// True when this library holds the VNNI products and a8::products_path() takes them.
bool vnni_products_available();
// y [count, out_features] (T float or c10::BFloat16): the segment's columns, each output
// the portable loop's chain (quantized_kq.cpp), bit for bit (quantized_kq_vnni.cpp).
template <typename T>
void products_vnni(const Inputs& in, const Panels& panels, int64_t out_features, T* y);

// True when this library holds the AVX2 products and this CPU runs them (a8's question).
// y [count, out_features] (T float or c10::BFloat16): the segment's columns, each output
// the portable loop's chain (quantized_kq.cpp), bit for bit.
template <typename T>
void products_avx2(const Inputs& in, const Panels& panels, int64_t out_features, T* y);

// The same products by AMX tiles (quantized_kq_amx.cpp), the same bits: only after
// a8::amx_takes said yes for the call.
template <typename T>
void products_amx(const Inputs& in, const Panels& panels, int64_t out_features, T* y);

}  // namespace cellbatch::kq
