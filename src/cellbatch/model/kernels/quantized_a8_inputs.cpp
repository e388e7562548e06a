// Each row's inputs quantised to int8 for the int8-input products (quantized_a8.cpp,
// quantized_a8_avx2.cpp and the kept GGUF blocks' quantized_kq.cpp), and which arithmetic
// those products take on this CPU (a8::products_path).
//
// Owns: the quantisation, per row and group g of 32 inputs as llama.cpp's Q8_1 blocks
// hold them (amax over the group's span: the group, or a K-quant block of 256):
//   amax = max |x|,  d = amax / 127,  xq = round_half_even(x * (127 / amax))  (0 if amax 0)
//   qsum = the sum of xq,  sx = d qsum (the quantised inputs' sum, llama.cpp's Q8_1 s: an
//   offset times it adds o sum(d xq), so that an offset's error is the inputs' rounding
//   times the weight, not times the weight less its offset)
// by AVX512 code on the VNNI path and a portable loop elsewhere.
// Promises: both give the same values (xq by the same products and roundings, then integers);
// a row's quantisation reads only that row; the order of a group's bytes is the weights'
// (a8::InputOrder).
// Never: allocates per row.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "common.h"
#include "quantized_a8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define CELLBATCH_A8_VECTOR_INPUTS 1
#include <immintrin.h>
#endif

namespace cellbatch::a8 {
namespace {


// The largest |x| of `count` inputs (any order gives the same maximum).
template <typename T>
float amax_portable(const T* x, int64_t count) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(widen(x[i])));
  return amax;
}

// One group of 32 inputs quantised in portable code with the largest |x| of its span
// (`amax`): the reference for the vector path.
template <InputOrder kOrder, typename T>
void quantise_group_portable(const T* x, float amax, int8_t* q, float* d, float* sx,
                             int32_t* qsum) {
  float values[kGroup];
  for (int64_t i = 0; i < kGroup; ++i) values[i] = widen(x[i]);
  *d = amax / 127.0f;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  *qsum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float scaled = std::clamp(std::nearbyint(values[i] * inverse), -127.0f, 127.0f);
    q[8 * (i / 8) + quantised_slot<kOrder>(i % 8)] = static_cast<int8_t>(scaled);
    *qsum += static_cast<int32_t>(scaled);
  }
  *sx = *d * static_cast<float>(*qsum);
}

#ifdef CELLBATCH_A8_VECTOR_INPUTS

bool vnni_available() {
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512vnni") &&
                                torch_runs_avx512();
  return available;
}

// The vector quantisation runs only after vnni_available() said yes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

// The largest |x| of `count` inputs, a multiple of 32 (amax_portable's value).
template <typename T>
float amax_of(const T* x, int64_t count) {
  __m512 most = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += 16) most = _mm512_max_ps(most, _mm512_abs_ps(load16(x + i)));
  return _mm512_reduce_max_ps(most);
}

// One group of 32 inputs quantised with its span's largest |x| (the vector form of
// quantise_group_portable).
template <InputOrder kOrder, typename T>
void quantise_group(const T* x, float amax, int8_t* q, float* d, float* sx, int32_t* qsum) {
  const __m512 low = load16(x), high = load16(x + 16);
  *d = amax / 127.0f;
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  // |x| <= amax, so every product rounds into [-127, 127]: the narrowing never saturates.
  const __m512i i_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
  const __m512i i_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(i_low, i_high));
  *sx = *d * static_cast<float>(*qsum);
  const __m256i both = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm512_cvtsepi32_epi8(i_low)), _mm512_cvtsepi32_epi8(i_high), 1);
  if constexpr (kOrder == InputOrder::kInt4) {
    // Within each 8 bytes: 0, 2, 4, 6, 1, 3, 5, 7 (both 128-bit lanes alike).
    const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                           0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_shuffle_epi8(both, order));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), both);
  }
}

#pragma GCC pop_options

#else  // not x86-64 with GCC or Clang: the portable loop only

bool vnni_available() { return false; }

#endif

// CELLBATCH_A8_PORTABLE=1 runs the portable loop on a VNNI CPU too, so that the tests
// check on this machine the path that CPUs without VNNI take (read at each call: a test
// sets it for a few calls).
bool portable_asked() {
  const char* value = std::getenv("CELLBATCH_A8_PORTABLE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

template <InputOrder kOrder, typename T>
Quantised quantise(const T* x, int64_t count, int64_t in_features, int64_t span, bool vector) {
  const int64_t groups = in_features / kGroup, per_span = span / kGroup;
  Quantised xs{decltype(Quantised::q)(count * in_features), std::vector<float>(count * groups),
               std::vector<float>(count * groups), std::vector<int32_t>(count * groups),
               in_features};
  const int64_t spans = count * groups / per_span;
  at::parallel_for(0, spans, std::max<int64_t>(1, 64 / per_span), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const T* from = x + s * span;
#ifdef CELLBATCH_A8_VECTOR_INPUTS
      if (vector) {
        const float amax = amax_of(from, span);
        for (int64_t i = s * per_span; i < (s + 1) * per_span; ++i)
          quantise_group<kOrder>(x + i * kGroup, amax, xs.q.data() + i * kGroup, &xs.d[i],
                                &xs.sx[i], &xs.qsum[i]);
        continue;
      }
#endif
      const float amax = amax_portable(from, span);
      for (int64_t i = s * per_span; i < (s + 1) * per_span; ++i)
        quantise_group_portable<kOrder>(x + i * kGroup, amax, xs.q.data() + i * kGroup, &xs.d[i],
                                       &xs.sx[i], &xs.qsum[i]);
    }
  });
  return xs;
}

}  // namespace

Path products_path() {
  if (portable_asked()) return Path::kPortable;
  if (vnni_available()) return Path::kVnni;
  return avx2_products_available() ? Path::kAvx2 : Path::kPortable;
}

Quantised quantise_rows(const at::Tensor& rows, Path path, int64_t span, InputOrder order) {
  const int64_t count = rows.size(0), in_features = rows.size(1);
  TORCH_CHECK(span % kGroup == 0 && span > 0 && in_features % span == 0,
              "quantise_rows: a span of ", span, " inputs does not divide K = ", in_features,
              " into whole groups of 32");
  const bool vector = path == Path::kVnni;
  auto in_order = [&](auto order_tag) {
    constexpr InputOrder kOrder = decltype(order_tag)::value;
    if (rows.scalar_type() == at::kBFloat16)
      return quantise<kOrder>(rows.data_ptr<c10::BFloat16>(), count, in_features, span, vector);
    return quantise<kOrder>(rows.data_ptr<float>(), count, in_features, span, vector);
  };
  if (order == InputOrder::kInt4)
    return in_order(std::integral_constant<InputOrder, InputOrder::kInt4>{});
  return in_order(std::integral_constant<InputOrder, InputOrder::kOwn>{});
}

}  // namespace cellbatch::a8
