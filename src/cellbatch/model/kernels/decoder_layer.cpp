// A whole decoder layer of a model whose products are all this library's quantised ones:
// the op `cellbatch::decoder_layer`.
//
// Owns: the order of a Llama layer's steps, run as one call instead of ~15 from Python:
//   a = rms_norm(hidden); q, k, v = split(product_qkv(a)); rope_store(q, k, v -> cache);
//   h = hidden + product_o(cell_attention(q)); out = h + product_down(silu_mul(
//   product_gate_up(rms_norm(h)))), each product followed by `lora_add` for the rows
//   with an adapter when `lora` is not empty.
// Each step is the registered op of the same name (through the dispatcher), so the layer
// gives the bits of `DecoderLayer.forward`'s Python path on the same weights (a test holds
// it to them), whatever the step. At one row the Python and dispatch between a layer's
// ops were ~0.7 ms of a 7.6 ms forward (the default model, 2 threads).
// Promises: rows past `num_tokens` (padding) are never stored in the cache nor attended
// to; their attention output is zeros, as CellAttention.attend makes it. A product's kind
// is its index in PRODUCT_OPS, the order of ops.PRODUCT_OPS in Python. `lora` holds the
// rows with adapters, their groups' offsets, then each product's groups' weights in the
// order above (cellbatch.model.adapters.LayerLora).
// Never: owns weights or the plan (the caller passes them each call), or runs a layer with
// biases, q/k norms or products of another kind (the Python path does those).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "op_handles.h"

#include <array>

namespace {

using cellbatch::find_op;

constexpr std::array<const char*, 5> PRODUCT_OPS = {
    "cellbatch::int4_matmul", "cellbatch::int4_matmul_a8", "cellbatch::int8_matmul",
    "cellbatch::int8_matmul_a8", "cellbatch::kquant_matmul_a8"};

struct Steps {
  using Product = c10::TypedOperatorHandle<cellbatch::QuantizedMatmulOp>;
  std::array<Product, PRODUCT_OPS.size()> products;
  c10::TypedOperatorHandle<cellbatch::RmsNormOp> rms_norm;
  c10::TypedOperatorHandle<cellbatch::RopeStoreOp> rope_store;
  c10::TypedOperatorHandle<cellbatch::CellAttentionOp> cell_attention;
  c10::TypedOperatorHandle<cellbatch::SiluMulOp> silu_mul;
  c10::TypedOperatorHandle<cellbatch::LoraAddOp> lora_add;

  const Product& product(int64_t kind) const {
    TORCH_CHECK(kind >= 0 && kind < static_cast<int64_t>(products.size()),
                "decoder_layer: product kind ", kind, " is not one of 0..",
                products.size() - 1);
    return products[kind];
  }
};

// Looked up at the first call: the schemas are defined from Python (cellbatch.model.ops)
// after this library loads.
const Steps& steps() {
  static const Steps found = [] {
    using cellbatch::QuantizedMatmulOp;
    return Steps{{find_op<QuantizedMatmulOp>(PRODUCT_OPS[0]),
                  find_op<QuantizedMatmulOp>(PRODUCT_OPS[1]),
                  find_op<QuantizedMatmulOp>(PRODUCT_OPS[2]),
                  find_op<QuantizedMatmulOp>(PRODUCT_OPS[3]),
                  find_op<QuantizedMatmulOp>(PRODUCT_OPS[4])},
                 find_op<cellbatch::RmsNormOp>("cellbatch::rms_norm"),
                 find_op<cellbatch::RopeStoreOp>("cellbatch::rope_store"),
                 find_op<cellbatch::CellAttentionOp>("cellbatch::cell_attention"),
                 find_op<cellbatch::SiluMulOp>("cellbatch::silu_mul"),
                 find_op<cellbatch::LoraAddOp>("cellbatch::lora_add")};
  }();
  return found;
}

at::Tensor decoder_layer(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& cells, const at::Tensor& plan_cells,
    const at::Tensor& plan_rows, const at::Tensor& plan_positions,
    const at::Tensor& plan_cell_offsets, const at::Tensor& plan_block_starts,
    int64_t num_tokens, int64_t window, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_codes,
    const at::Tensor& qkv_scales, int64_t qkv_kind, const at::Tensor& o_codes,
    const at::Tensor& o_scales, int64_t o_kind, const at::Tensor& gate_up_codes,
    const at::Tensor& gate_up_scales, int64_t gate_up_kind, int64_t intermediate,
    const at::Tensor& down_codes, const at::Tensor& down_scales, int64_t down_kind,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    at::TensorList lora) {
  TORCH_CHECK(hidden.dim() == 2, "decoder_layer: hidden must be [tokens, hidden]");
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= hidden.size(0),
              "decoder_layer: num_tokens must lie in [0, ", hidden.size(0), "], got ",
              num_tokens);
  TORCH_CHECK(lora.empty() || (lora.size() >= 2 && (lora.size() - 2) % 4 == 0),
              "decoder_layer: lora must be empty or rows, offsets and four products' weights");
  const Steps& s = steps();
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // product `index` of the layer (0 qkv, 1 o, 2 gate_up, 3 down) with its adapters' rows.
  auto product = [&](int64_t index, int64_t kind, const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scales, int64_t out_features) {
    at::Tensor out = s.product(kind).call(x, codes, scales, out_features);
    if (!lora.empty()) {
      const int64_t per = static_cast<int64_t>(lora.size() - 2) / 4;
      s.lora_add.call(out, x, lora[0], lora[1], lora.slice(2 + index * per, per));
    }
    return out;
  };
  const at::Tensor qkv = product(0, qkv_kind, s.rms_norm.call(hidden, input_norm, eps),
                                 qkv_codes, qkv_scales, q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  s.rope_store.call(q, k, v, cos, sin, cells, k_cache, v_cache);
  at::Tensor attended = at::empty({tokens, q_size}, hidden.options());
  if (num_tokens < tokens) attended.narrow(0, num_tokens, tokens - num_tokens).zero_();
  s.cell_attention.call(q, k_cache, v_cache, plan_cells, plan_rows, plan_positions,
                        plan_cell_offsets, plan_block_starts, window, scale, attended);
  const at::Tensor mid = hidden + product(1, o_kind, attended, o_codes, o_scales, width);
  const at::Tensor gate_up = product(2, gate_up_kind, s.rms_norm.call(mid, post_norm, eps),
                                     gate_up_codes, gate_up_scales, 2 * intermediate);
  return mid + product(3, down_kind, s.silu_mul.call(gate_up), down_codes, down_scales, width);
}

}  // namespace

// The schema is defined in Python (cellbatch/model/ops.py), with the torch implementation.
TORCH_LIBRARY_IMPL(cellbatch, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
