// The decoder layer's small elementwise steps as single ops: `cellbatch::rms_norm`,
// `cellbatch::rope_store` and `cellbatch::silu_mul`.
//
// Owns: nothing but the arithmetic; each op replaces a chain of torch ops (and the
// temporaries between them) on a step's hidden rows.
// Promises: the roundings of the torch chains they replace, which follow transformers:
// RMSNorm normalises in float32 and scales in the compute dtype T; RoPE multiplies and
// adds in T with cos/sin rounded to T; SiLU runs in float32, is rounded to T, then
// multiplied by `up` in T. Each row is computed on its own, so a row's result does not
// depend on the other rows (batch invariance).
// Never: allocates per row, or reads or writes cache rows other than `cells`.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>
#include <cstring>
#include <vector>
#include <type_traits>

namespace {

using cellbatch::for_each_scalar_type;
using cellbatch::kLanes;
using cellbatch::narrow;
using cellbatch::round_to;
using cellbatch::Vec;
using cellbatch::widen;

// Rows of x ([..., size], last dim contiguous, rows evenly strided) normalised by their
// root mean square, times weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t size = x.size(-1), rows = x.numel() / std::max<int64_t>(size, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [", size, "] in x's dtype");
  const at::Tensor rows_view = x.reshape({rows, size});
  TORCH_CHECK(rows_view.stride(1) == 1, "rms_norm: x's last dimension must be contiguous");
  at::Tensor out = at::empty({rows, size}, x.options());
  for_each_scalar_type(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* src = rows_view.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const int64_t stride = rows_view.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = src + r * stride;
        Vec lanes(0.f);
        int64_t d = 0;
        float tail = 0.f;
        if (size % kLanes == 0) {
          alignas(64) float buffer[kLanes];
          for (; d < size; d += kLanes) {
            for (int64_t l = 0; l < kLanes; ++l) buffer[l] = widen(row[d + l]);
            const Vec v = Vec::loadu(buffer);
            lanes = at::vec::fmadd(v, v, lanes);
          }
        } else {
          for (; d < size; ++d) tail += widen(row[d]) * widen(row[d]);
        }
        const float sum =
            at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, lanes) + tail;
        const float scale = 1.f / std::sqrt(sum / static_cast<float>(size) + static_cast<float>(eps));
        T* o = dst + r * size;
        for (int64_t i = 0; i < size; ++i) o[i] = static_cast<T>(widen(w[i]) * round_to<T>(widen(row[i]) * scale));
      }
    });
  });
  return out.view(x.sizes());
}

// Rotates q in place and writes the rotated k and v into k_cache/v_cache rows `cells` (the
// first cells.size(0) tokens; later rows are padding and are not stored); an int8 cache
// takes each head quantised (cellbatch::quantize_head). q [T, H, D] and
// k, v [T, KVH, D] may be strided views (last two dims contiguous); cos, sin [T, D/2] float32.
void rope_store(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& cells, at::Tensor& k_cache,
                at::Tensor& v_cache) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), half = dim / 2;
  const int64_t kv_heads = k.size(1), stored = cells.size(0);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim && k.stride(2) == 1 && k.stride(1) == dim &&
                  v.stride(2) == 1 && v.stride(1) == dim,
              "rope_store: q, k, v must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  cos.size(0) >= tokens && cos.size(1) == half,
              "rope_store: cos/sin must be float32 [tokens, dim / 2]");
  TORCH_CHECK(dim % 2 == 0 && dim <= 512, "rope_store: head_dim must be even and <= 512");
  TORCH_CHECK(cells.scalar_type() == at::kLong && cells.is_contiguous() && stored <= tokens,
              "rope_store: cells must be int64, one per stored token");
  const int64_t width = k_cache.scalar_type() == at::kChar ? dim + cellbatch::kCacheScaleBytes : dim;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.size(1) == kv_heads &&
                  k_cache.size(2) == width && v_cache.sizes() == k_cache.sizes(),
              "rope_store: caches must be contiguous [cells, kv_heads, dim] (int8: dim + 4)");
  for_each_scalar_type(q, "rope_store", [&](auto tag) {
    using T = decltype(tag);
    cellbatch::for_each_cache_type(k_cache, "rope_store cache", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      constexpr bool kInt8 = std::is_same_v<C, int8_t>;
      T* qp = q.data_ptr<T>();
      const T* kp = k.data_ptr<T>();
      const T* vp = v.data_ptr<T>();
      const float* cp = cos.data_ptr<float>();
      const float* sp = sin.data_ptr<float>();
      const int64_t* cell = cells.data_ptr<int64_t>();
      C* kc = k_cache.data_ptr<C>();
      C* vc = v_cache.data_ptr<C>();
      const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
      at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* c = cp + t * half;
          const float* s = sp + t * half;
          auto rotate = [&](const T* x, auto&& write) {
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = widen(x[i]), x2 = widen(x[i + half]);
              const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
              write(i, round_to<T>(round_to<T>(x1 * ci) - round_to<T>(x2 * si)));
              write(i + half, round_to<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si)));
            }
          };
          for (int64_t h = 0; h < heads; ++h) {
            T* x = qp + t * qs + h * dim;
            alignas(64) float rotated[512];
            rotate(x, [&](int64_t i, float value) { rotated[i] = value; });
            for (int64_t i = 0; i < dim; ++i) x[i] = static_cast<T>(rotated[i]);
          }
          if (t >= stored) continue;
          C* kd = kc + cell[t] * kv_heads * width;
          C* vd = vc + cell[t] * kv_heads * width;
          for (int64_t h = 0; h < kv_heads; ++h) {
            const T* vh = vp + t * vs + h * dim;
            if constexpr (kInt8) {
              alignas(64) float rotated[512];
              rotate(kp + t * ks + h * dim, [&](int64_t i, float value) { rotated[i] = value; });
              cellbatch::quantize_head(rotated, dim, kd + h * width);
              for (int64_t i = 0; i < dim; ++i) rotated[i] = widen(vh[i]);
              cellbatch::quantize_head(rotated, dim, vd + h * width);
            } else {
              rotate(kp + t * ks + h * dim,
                     [&](int64_t i, float value) { kd[h * dim + i] = static_cast<C>(value); });
              for (int64_t i = 0; i < dim; ++i) vd[h * dim + i] = static_cast<C>(widen(vh[i]));
            }
          }
        }
      });
    });
  });
}

// [rows, 2I] (gate | up) -> [rows, I]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  for_each_scalar_type(gate_up, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(width);
      for (int64_t r = begin; r < end; ++r) {
        const T* g = src + r * 2 * width;
        const T* u = g + width;
        T* o = dst + r * width;
        for (int64_t i = 0; i < width; ++i) gate[i] = widen(g[i]);
        int64_t i = 0;
        for (; i + kLanes <= width; i += kLanes) {
          const Vec x = Vec::loadu(gate.data() + i);
          (x / (Vec(1.f) + x.neg().exp())).store(gate.data() + i);
        }
        for (; i < width; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
        for (int64_t j = 0; j < width; ++j)
          o[j] = narrow<T>(widen(narrow<T>(gate[j])) * widen(u[j]));
      }
    });
  });
  return out;
}

}  // namespace

// The schemas are defined in Python (cellbatch/model/ops.py), with the torch implementations.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
}
