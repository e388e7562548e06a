// The cellbatch ops as C++ code calls them through the dispatcher: each op's C++
// signature (as its schema in cellbatch/model/ops.py declares it) and `find_op`.
//
// Owns: nothing but those declarations, for the callers of registered ops: the C entry
// points of exported programs (aoti_shims.cpp) and the one-op layer (decoder_layer.cpp).
// Promises: a caller that goes through find_op runs the kernel registered for the op's CPU
// key, the one the eager model runs.
// Never: defines or registers an op.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace cellbatch {

using RmsNormOp = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using SiluMulOp = at::Tensor(const at::Tensor&);
// int4_matmul, int4_matmul_a8, int8_matmul, int8_matmul_a8 and kquant_matmul_a8 take the
// same arguments.
using QuantizedMatmulOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t);
using KquantRowsOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                int64_t, int64_t);
using RopeStoreOp = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);
using LoraAddOp = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       at::TensorList);
using CellAttentionOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, int64_t, double, at::Tensor&);

// The op `name` ("cellbatch::...") with C++ signature Signature; callers keep it in a
// static, since the schemas are defined from Python after this library loads.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace cellbatch
