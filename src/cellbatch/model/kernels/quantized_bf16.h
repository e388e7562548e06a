// The bf16 path of the quantised products (quantized_bf16.cpp), which quantized_matmul.cpp
// takes for bfloat16 activations on CPUs with the AVX512-BF16 dot-product instructions.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace cellbatch {

// True when this library holds the bf16 products and this CPU runs them (AVX512-F, -BW
// and -BF16, detected when first asked, never assumed) with torch at the AVX512 width.
bool bf16_products_available();

// y[M, N] (bfloat16) = x w^T for bfloat16 x [M, K] and the int4 panels of
// quantized_matmul.cpp, with scales float32 or float16.
at::Tensor int4_matmul_bf16(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, int64_t out_features);

// The same for int8 panels whose groups are 32 inputs (scales [P, K / 32, 16]).
at::Tensor int8_matmul_bf16(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, int64_t out_features);

}  // namespace cellbatch
