// C entry points of the cellbatch ops for AOTInductor-compiled programs: one
// `aoti_torch_cpu_<op>` per op of cellbatch/model/ops.py's SCHEMAS but decoder_layer
// (a program traces a layer as its steps) and lora_add (a program runs no adapters),
// with the C signature
// AOTInductor's generated code calls when an op is listed in
// `aot_inductor.custom_ops_to_c_shims` (tensors as AtenTensorHandle, int as int64_t, float
// as double, a returned tensor through AtenTensorHandle* ret0, which an op returning
// nothing gets too, null). A program's methods call
// these directly; without them every call goes through the proxy executor, which boxes
// the arguments into a stack (~4 us a call on the development CPU, ~300 calls a decode
// step of the default model).
//
// Owns: the conversion between handles and tensors, and errors to error codes.
// Promises: each entry point calls its op through the dispatcher (the same CPU kernel the
// eager model runs, so a program computes what the eager model does) and returns
// AOTI_TORCH_SUCCESS, or AOTI_TORCH_FAILURE after logging the op's error.
// Never: computes anything itself.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include "op_handles.h"

namespace {

using cellbatch::find_op;

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

const at::Tensor& tensor(AtenTensorHandle handle) {
  return *tensor_handle_to_tensor_pointer(handle);
}

at::Tensor& mutable_tensor(AtenTensorHandle handle) {
  return *tensor_handle_to_tensor_pointer(handle);
}

// The quantised products share one signature; each instantiation (one per op name) keeps
// its own op in its static.
constexpr char kInt4Matmul[] = "cellbatch::int4_matmul";
constexpr char kInt8Matmul[] = "cellbatch::int8_matmul";
constexpr char kInt4MatmulA8[] = "cellbatch::int4_matmul_a8";
constexpr char kInt8MatmulA8[] = "cellbatch::int8_matmul_a8";
constexpr char kKquantMatmulA8[] = "cellbatch::kquant_matmul_a8";

template <const char* kName>
AOTITorchError quantized_matmul(AtenTensorHandle x, AtenTensorHandle codes,
                                AtenTensorHandle scales, int64_t out_features,
                                AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::QuantizedMatmulOp>(kName);
    *ret0 = new_tensor_handle(op.call(tensor(x), tensor(codes), tensor(scales), out_features));
  });
}

}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight,
                                       double eps, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::RmsNormOp>("cellbatch::rms_norm");
    *ret0 = new_tensor_handle(op.call(tensor(x), tensor(weight), eps));
  });
}

AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle gate_up, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::SiluMulOp>("cellbatch::silu_mul");
    *ret0 = new_tensor_handle(op.call(tensor(gate_up)));
  });
}

AOTITorchError aoti_torch_cpu_int4_matmul(AtenTensorHandle x, AtenTensorHandle codes,
                                          AtenTensorHandle scales, int64_t out_features,
                                          AtenTensorHandle* ret0) {
  return quantized_matmul<kInt4Matmul>(x, codes, scales, out_features, ret0);
}

AOTITorchError aoti_torch_cpu_int4_matmul_a8(AtenTensorHandle x, AtenTensorHandle codes,
                                             AtenTensorHandle scales, int64_t out_features,
                                             AtenTensorHandle* ret0) {
  return quantized_matmul<kInt4MatmulA8>(x, codes, scales, out_features, ret0);
}

AOTITorchError aoti_torch_cpu_int8_matmul(AtenTensorHandle x, AtenTensorHandle codes,
                                          AtenTensorHandle scales, int64_t out_features,
                                          AtenTensorHandle* ret0) {
  return quantized_matmul<kInt8Matmul>(x, codes, scales, out_features, ret0);
}

AOTITorchError aoti_torch_cpu_int8_matmul_a8(AtenTensorHandle x, AtenTensorHandle codes,
                                             AtenTensorHandle scales, int64_t out_features,
                                             AtenTensorHandle* ret0) {
  return quantized_matmul<kInt8MatmulA8>(x, codes, scales, out_features, ret0);
}

AOTITorchError aoti_torch_cpu_kquant_matmul_a8(AtenTensorHandle x, AtenTensorHandle codes,
                                               AtenTensorHandle scales, int64_t out_features,
                                               AtenTensorHandle* ret0) {
  return quantized_matmul<kKquantMatmulA8>(x, codes, scales, out_features, ret0);
}

AOTITorchError aoti_torch_cpu_kquant_rows(AtenTensorHandle codes, AtenTensorHandle scales,
                                          AtenTensorHandle rows, int64_t in_features,
                                          int64_t out_features, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::KquantRowsOp>("cellbatch::kquant_rows");
    *ret0 = new_tensor_handle(
        op.call(tensor(codes), tensor(scales), tensor(rows), in_features, out_features));
  });
}

AOTITorchError aoti_torch_cpu_rope_store(AtenTensorHandle q, AtenTensorHandle k,
                                         AtenTensorHandle v, AtenTensorHandle cos,
                                         AtenTensorHandle sin, AtenTensorHandle cells,
                                         AtenTensorHandle k_cache, AtenTensorHandle v_cache,
                                         AtenTensorHandle* /*no result*/) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::RopeStoreOp>("cellbatch::rope_store");
    op.call(mutable_tensor(q), tensor(k), tensor(v), tensor(cos), tensor(sin), tensor(cells),
              mutable_tensor(k_cache), mutable_tensor(v_cache));
  });
}

AOTITorchError aoti_torch_cpu_cell_attention(
    AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache,
    AtenTensorHandle cells, AtenTensorHandle rows, AtenTensorHandle pos,
    AtenTensorHandle cell_offsets, AtenTensorHandle block_starts, int64_t window, double scale,
    AtenTensorHandle out, AtenTensorHandle* /*no result*/) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op = find_op<cellbatch::CellAttentionOp>("cellbatch::cell_attention");
    op.call(tensor(q), tensor(k_cache), tensor(v_cache), tensor(cells), tensor(rows),
              tensor(pos), tensor(cell_offsets), tensor(block_starts), window, scale,
              mutable_tensor(out));
  });
}

}  // extern "C"
