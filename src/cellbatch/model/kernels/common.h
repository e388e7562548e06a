// Shared by the kernels' sources: float widening and narrowing for each compute dtype,
// dispatch over those dtypes and over the quantised products' scale dtypes, and the
// question the AVX512 paths ask of torch beside the CPU.
//
// Promises: round_to<T>(x) is x as a tensor of dtype T would hold it (round to nearest
// even); the bf16 cases are bit operations, so that loops of them vectorise (c10's
// conversions do not inline into such loops).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace cellbatch {

using Vec = at::vec::Vectorized<float>;

// True when torch runs its kernels at the AVX512 width in this process: the CPU has it and
// ATEN_CPU_CAPABILITY does not cap torch lower. The AVX512 paths need it beside their CPU
// features, so a process capped at AVX2 runs what an AVX2 CPU would (cellbatch.model.cpu
// asks the same for the `auto` choices).
inline bool torch_runs_avx512() { return at::get_cpu_capability() == "AVX512"; }
// The same for the AVX2 paths: torch runs at the AVX2 width or wider.
inline bool torch_runs_avx2() {
  const std::string capability = at::get_cpu_capability();
  return capability == "AVX2" || capability == "AVX512";
}
constexpr int64_t kLanes = Vec::size();

template <typename T>
inline float widen(T x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(x);
  }
}

template <typename T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    T out;
    out.x = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return out;
  } else {
    return static_cast<T>(x);
  }
}

template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return widen(narrow<T>(x));
  }
}

// fn(T{}) for the tensor's dtype: float32, bfloat16 or float16.
template <typename Fn>
void for_each_scalar_type(const at::Tensor& t, const char* what, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    case at::kHalf: return fn(c10::Half{});
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type());
  }
}

// fn(C{}) for a KV cache's dtype C: one of for_each_scalar_type's, or int8_t, the int8
// cache (cellbatch/kv_format.py: per head, head_dim codes, then a float32 scale).
template <typename Fn>
void for_each_cache_type(const at::Tensor& t, const char* what, Fn&& fn) {
  if (t.scalar_type() == at::kChar) return fn(int8_t{});
  for_each_scalar_type(t, what, fn);
}

// The int8 cache's float32 scale, which follows a head's `dim` codes.
constexpr int64_t kCacheScaleBytes = 4;
// Elements of C per head of a cell in a cache of dtype C.
template <typename C>
constexpr int64_t cache_head_width(int64_t dim) {
  return std::is_same_v<C, int8_t> ? dim + kCacheScaleBytes : dim;
}

// Quantises n values (as the compute dtype holds them) into the int8 cache's layout at
// dst: codes round-half-even(x / scale) with scale = max|x| / 127 (codes 0 when it is 0),
// then the scale's bytes; the bits of cellbatch.kv_format.quantize_heads.
inline void quantize_head(const float* x, int64_t n, int8_t* dst) {
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
  const float scale = top / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    const float code = scale > 0.f ? std::nearbyint(x[i] / scale) : 0.f;
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  std::memcpy(dst + n, &scale, sizeof scale);
}

// fn(S{}) for the quantised products' scales dtype S: float32 or float16 (op names the
// op in the error for any other).
template <typename Fn>
auto for_scale_type(const at::Tensor& scales, const char* op, Fn&& fn) {
  const at::ScalarType type = scales.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf, op,
              ": scales must be float32 or float16, got ", type);
  return type == at::kHalf ? fn(c10::Half{}) : fn(float{});
}

// fn(std::integral_constant<int, N>{}) for N = n in [1, kMax]: a count of rows or panels
// known at run time as a constant that the products' register blocks are compiled for.
template <int kMax, typename Fn>
void with_count(int64_t n, Fn&& fn) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_count<kMax - 1>(n, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

// How the bf16 and int8-activation products split their work: blocks of kBlock panels (16
// outputs each) between threads, and per block the rows in chunks of kRowChunk. The threads
// claim runs of consecutive blocks as they go, each what is left over twice the thread
// count (one block at least), so that a thread slowed by others on its core, or by its
// blocks' kind, does not leave the rest waiting at the end of the product; a thread's run
// stays consecutive, which the prefetches across a block's end count on. Each thread holds
// one Buffer (only when count > kFusedRows: the few-row paths use none) and one chunk's
// sums [kRowChunk][16 kBlock]; run(width, m0, n, p0, buffer, sums) computes the sums of
// panels p0 .. p0 + width - 1 for rows m0 .. m0 + n - 1 (width a std::integral_constant,
// so that the block's register arrays are sized at compile time), and store(m0, n, p0,
// sums) writes them out. Which thread computes a block never changes its values.
template <typename Buffer, int64_t kBlock, int64_t kRowChunk, int64_t kFusedRows, typename Run,
          typename Store>
void for_each_block(int64_t count, int64_t panel_count, Run&& run, Store&& store) {
  const int64_t blocks = (panel_count + kBlock - 1) / kBlock;
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  // One task per thread; nested in another parallel region, one task claims every block.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<Buffer> buffer(count > kFusedRows ? 1 : 0);  // tens of KiB: off the stack
    Buffer* held = buffer.empty() ? nullptr : buffer.data();
    std::vector<float> sums(std::min(count, kRowChunk) * kBlock * 16);
    int64_t begin = next.load(std::memory_order_relaxed);
    for (;;) {
      int64_t size;
      do {
        if (begin >= blocks) return;
        size = std::max<int64_t>(1, (blocks - begin) / (2 * threads));
      } while (!next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed));
      for (int64_t m0 = 0; m0 < count; m0 += kRowChunk) {
        const int64_t n = std::min(kRowChunk, count - m0);
        for (int64_t b = begin; b < begin + size; ++b) {
          const int64_t p0 = b * kBlock;
          with_count<kBlock>(std::min(kBlock, panel_count - p0),
                             [&](auto width) { run(width, m0, n, p0, held, sums.data()); });
          store(m0, n, p0, sums.data());
        }
      }
      begin = next.load(std::memory_order_relaxed);
    }
  });
}

// The int4 panels' layout (quantized_matmul.cpp), checked for `op`: codes contiguous int32
// [P, K / 8, 16], scales contiguous [P, K / 32, 2, 16], K a multiple of 32. Returns K.
inline int64_t int4_in_features(const at::Tensor& codes, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.is_contiguous() &&
                  codes.scalar_type() == at::kInt,
              op, ": codes must be contiguous int32 [panels, K / 8, 16]");
  const int64_t panels = codes.size(0), in_features = codes.size(1) * 8;
  TORCH_CHECK(in_features % 32 == 0, op, ": K must be a multiple of 32");
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == panels && scales.size(1) == in_features / 32 &&
                  scales.size(2) == 2 && scales.size(3) == 16 && scales.is_contiguous(),
              op, ": scales must be contiguous [panels, K / 32, 2, 16]");
  return in_features;
}

#if defined(__x86_64__) && defined(__GNUC__)
// 16 values as floats (float16 and bf16 widened exactly): the quantised products' scales
// and inputs. For the AVX512 paths only: their callers are compiled for AVX512-F, and the
// CPU was asked before any of them runs.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// The first `width` (<= 16) of 16 float sums stored as T: float32 as they are, bf16 rounded
// to nearest even (c10::BFloat16's rounding), NaN kept quiet, without needing
// AVX512-BF16. For the AVX512 paths only, as load16.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store16(const float* sums,
                                                                          int64_t width,
                                                                          float* y) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << width) - 1), _mm512_loadu_ps(sums));
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store16(const float* sums,
                                                                          int64_t width,
                                                                          c10::BFloat16* y) {
  const __m512 v = _mm512_loadu_ps(sums);
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << width) - 1),
                           _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// The int8-input products' register sums of R rows and P panels: from `sums` (rows
// kWidth floats apart) when a chain continues, else zero; and back into `sums`.
template <int R, int P, int64_t kWidth>
__attribute__((target("avx512f"), always_inline)) inline void load_totals(
    __m512 (&total)[R][P], const float* sums, bool continues) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      total[r][p] = continues ? _mm512_loadu_ps(sums + r * kWidth + p * 16) : _mm512_setzero_ps();
}
template <int R, int P, int64_t kWidth>
__attribute__((target("avx512f"), always_inline)) inline void store_totals(
    const __m512 (&total)[R][P], float* sums) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(sums + r * kWidth + p * 16, total[r][p]);
}
// The sums [n][16 kBlock] of rows m0 .. m0 + n - 1 and panels p0 .. into the first
// `columns` columns from y of rows `out_features` apart (y [M, out_features] itself, or a
// segment of it): the `store` of for_each_block for the AVX512 int8-input products.
template <int64_t kBlock, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_sums(
    const float* sums, int64_t m0, int64_t n, int64_t p0, int64_t columns, int64_t out_features,
    T* y) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t p = 0; p < kBlock && (p0 + p) * 16 < columns; ++p) {
      const int64_t start = (p0 + p) * 16;
      store16(sums + (r * kBlock + p) * 16, std::min<int64_t>(16, columns - start),
              y + (m0 + r) * out_features + start);
    }
}
#endif

}  // namespace cellbatch
