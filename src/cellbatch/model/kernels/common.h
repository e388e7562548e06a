// Shared by the kernels' sources: float widening and narrowing for each compute dtype,
// and dispatch over those dtypes and over the quantised products' scale dtypes.
//
// Promises: round_to<T>(x) is x as a tensor of dtype T would hold it (round to nearest
// even); the bf16 cases are bit operations, so that loops of them vectorise (c10's
// conversions do not inline into such loops).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cellbatch {

using Vec = at::vec::Vectorized<float>;
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

// fn(S{}) for the quantised products' scales dtype S: float32 or float16 (op names the
// op in the error for any other).
template <typename Fn>
auto for_scale_type(const at::Tensor& scales, const char* op, Fn&& fn) {
  const at::ScalarType type = scales.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf, op,
              ": scales must be float32 or float16, got ", type);
  return type == at::kHalf ? fn(c10::Half{}) : fn(float{});
}

}  // namespace cellbatch
