#include "decoder_layer.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "float_matmul.h"
#include "int8_dot_kernels.h"
#include "quantized_matmul.h"
#include "rms_norm.h"
#include "rope.h"
#include "swiglu.h"

namespace gmlx_kernels {

namespace {

// Per-thread scratch for the stages' intermediates: a decode step makes ~90 fused calls,
// each would otherwise allocate and free three or four buffers. Only grows.
struct Scratch {
  std::vector<float> buffers[4];
  float* get(int i, int64_t num_floats) {
    if (static_cast<int64_t>(buffers[i].size()) < num_floats) buffers[i].resize(num_floats);
    return buffers[i].data();
  }
};

// Rows (b, t) of a (B * T, H * Dh) buffer as (B, H, T, Dh), rotated into y.
void rotate_heads(const float* x, int64_t num_b, int64_t num_heads, int64_t num_t, int64_t head_dim,
                  const mx::array& offset, const RopeSpec& rope, float* y) {
  RopeArgs args;
  args.x = x;
  args.num_b = num_b;
  args.num_m = num_heads;
  args.num_t = num_t;
  args.num_d = head_dim;
  args.stride_b = num_t * num_heads * head_dim;
  args.stride_m = head_dim;
  args.stride_t = num_heads * head_dim;
  args.stride_d = 1;
  args.offsets = offset.data<int32_t>();
  args.offset_stride = offset.ndim() == 1 && offset.size() > 1 ? offset.strides(0) : 0;
  args.y = y;
  args.dims = rope.dims;
  args.traditional = rope.traditional;
  args.base = rope.base;
  args.scale = rope.scale;
  rotate(args);
}

// A layer's products over its weights' layout: float32 panels (bits kFloatBits) or quads.
struct Product {
  const mx::array* weights;
  int64_t num_outputs;
  float* y;
};

void weight_products(const float* x, int64_t num_rows, int64_t num_inputs, int bits,
                     const std::vector<Product>& products) {
  if (bits == kFloatBits) {
    std::vector<PanelsPart> parts;
    for (const auto& p : products) parts.push_back({p.weights->data<float>(), p.num_outputs, p.y});
    panels_products(x, num_rows, num_inputs, parts);
  } else {
    std::vector<QuadsPart> parts;
    for (const auto& p : products) parts.push_back({p.weights->data<uint8_t>(), p.num_outputs, p.y});
    quads_products(x, num_rows, num_inputs, bits, parts);
  }
}

void check_weights(const mx::array& weights, int64_t num_outputs, int64_t num_inputs, int bits,
                   const std::string& what) {
  if (bits == kFloatBits) {
    check_panel_layout(weights, num_outputs, num_inputs, what);
  } else {
    check_quad_layout(weights, num_outputs, num_inputs, bits, what);
  }
}

}  // namespace

std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight, float eps,
                                        const mx::array& offset, const std::vector<mx::array>& quads,
                                        int num_q_heads, int num_kv_heads, int head_dim, int bits,
                                        int rope_dims, bool rope_traditional, float rope_base, float rope_scale) {
  if (x.ndim() != 3 || norm_weight.ndim() != 1 || norm_weight.shape(0) != x.shape(2) || x.shape(2) % 32 != 0) {
    throw std::invalid_argument("attention_inputs: x must be (B, T, D), D a multiple of 32, norm_weight (D,)");
  }
  if (quads.size() != 3) throw std::invalid_argument("attention_inputs: quads of q, k and v");
  if (rope_dims <= 0 || rope_dims % 2 != 0 || rope_dims > head_dim) {
    throw std::invalid_argument("attention_inputs: rope dims must be even and at most head_dim");
  }
  if (!(offset.ndim() == 0 || (offset.ndim() == 1 && (offset.size() == 1 || offset.shape(0) == x.shape(0))))) {
    throw std::invalid_argument("attention_inputs: offset must be a scalar or one per row");
  }
  const int dims = x.shape(2);
  check_weights(quads[0], static_cast<int64_t>(num_q_heads) * head_dim, dims, bits, "attention_inputs q");
  check_weights(quads[1], static_cast<int64_t>(num_kv_heads) * head_dim, dims, bits, "attention_inputs k");
  check_weights(quads[2], static_cast<int64_t>(num_kv_heads) * head_dim, dims, bits, "attention_inputs v");
  auto s = mx::default_stream(mx::Device::cpu);
  const int num_b = x.shape(0), num_t = x.shape(1);
  const mx::Shape q_shape = {num_b, num_q_heads, num_t, head_dim};
  const mx::Shape kv_shape = {num_b, num_kv_heads, num_t, head_dim};
  return mx::array::make_arrays(
      {q_shape, kv_shape, kv_shape}, {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kAttentionInputs, bits, eps, num_q_heads, num_kv_heads,
                                       head_dim, 0, RopeSpec{rope_dims, rope_traditional, rope_base, rope_scale}),
      {as_dtype(x, mx::float32, s), as_dtype(norm_weight, mx::float32, s), as_dtype(offset, mx::int32, s), quads[0],
       quads[1], quads[2]});
}

mx::array project_add(const mx::array& a, const mx::array& quads, const mx::array& residual, int bits) {
  if (a.ndim() < 1 || residual.ndim() != a.ndim() || a.shape(-1) % 32 != 0) {
    throw std::invalid_argument("project_add: a (..., K), K a multiple of 32, and residual (..., N)");
  }
  for (int i = 0; i + 1 < a.ndim(); ++i) {
    if (a.shape(i) != residual.shape(i)) throw std::invalid_argument("project_add: a and residual rows differ");
  }
  check_weights(quads, residual.shape(-1), a.shape(-1), bits, "project_add");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(residual.shape(), mx::float32,
                   std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kProjectAdd, bits, 0.0f, 0, 0, 0, 0,
                                                    RopeSpec{}),
                   {as_dtype(a, mx::float32, s), quads, as_dtype(residual, mx::float32, s)});
}

mx::array mlp_block(const mx::array& h, const mx::array& norm_weight, float eps, const mx::array& gate_quads,
                    const mx::array& up_quads, const mx::array& down_quads, int hidden_dims, int bits) {
  if (h.ndim() < 1 || norm_weight.ndim() != 1 || norm_weight.shape(0) != h.shape(-1) || h.shape(-1) % 32 != 0 ||
      hidden_dims % 32 != 0) {
    throw std::invalid_argument("mlp_block: h (..., D), norm_weight (D,), D and hidden_dims multiples of 32");
  }
  check_weights(gate_quads, hidden_dims, h.shape(-1), bits, "mlp_block gate");
  check_weights(up_quads, hidden_dims, h.shape(-1), bits, "mlp_block up");
  check_weights(down_quads, h.shape(-1), hidden_dims, bits, "mlp_block down");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(h.shape(), mx::float32,
                   std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kMlpBlock, bits, eps, 0, 0, 0,
                                                    hidden_dims, RopeSpec{}),
                   {as_dtype(h, mx::float32, s), as_dtype(norm_weight, mx::float32, s), gate_quads, up_quads,
                    down_quads});
}

void DecoderLayerOp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y = std::move(arrays.outputs), kind = kind_, bits = bits_,
                    eps = eps_, num_q_heads = num_q_heads_, num_kv_heads = num_kv_heads_, head_dim = head_dim_,
                    hidden_dims = hidden_dims_, rope = rope_]() {
    thread_local Scratch scratch;  // the lambdas of one stream run on one thread, one at a time
    std::vector<float> x_copy;
    const float* x = row_major_data<float>(in[0], x_copy);
    const int64_t num_inputs = in[0].shape(-1);
    const int64_t num_rows = in[0].size() / num_inputs;
    if (kind == Kind::kAttentionInputs) {
      const int64_t q_width = static_cast<int64_t>(num_q_heads) * head_dim;
      const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
      float* normed = scratch.get(0, num_rows * num_inputs);
      float* q = scratch.get(1, num_rows * q_width);
      float* k = scratch.get(2, num_rows * kv_width);
      float* v = scratch.get(3, num_rows * kv_width);
      normalize(x, in[1].data<float>(), in[1].strides(0), normed, num_rows, num_inputs, eps);
      weight_products(normed, num_rows, num_inputs, bits, {{&in[3], q_width, q}, {&in[4], kv_width, k},
                                                          {&in[5], kv_width, v}});
      const int64_t num_b = in[0].shape(0), num_t = in[0].shape(1);
      rotate_heads(q, num_b, num_q_heads, num_t, head_dim, in[2], rope, y[0]);
      rotate_heads(k, num_b, num_kv_heads, num_t, head_dim, in[2], rope, y[1]);
      for (int64_t b = 0; b < num_b; ++b) {  // v as (B, Hkv, T, Dh): the same floats, moved
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          for (int64_t t = 0; t < num_t; ++t) {
            const float* src = v + (b * num_t + t) * kv_width + h * head_dim;
            std::copy(src, src + head_dim, y[2] + ((b * num_kv_heads + h) * num_t + t) * head_dim);
          }
        }
      }
    } else if (kind == Kind::kProjectAdd) {
      std::vector<float> residual_copy;
      const float* residual = row_major_data<float>(in[2], residual_copy);
      const int64_t num_outputs = in[2].shape(-1);
      weight_products(x, num_rows, num_inputs, bits, {{&in[1], num_outputs, y[0]}});
      // residual + product, in the residual add's order (a float add either way).
      for (int64_t i = 0; i < num_rows * num_outputs; ++i) y[0][i] = residual[i] + y[0][i];
    } else {
      float* normed = scratch.get(0, num_rows * num_inputs);
      float* gate = scratch.get(1, num_rows * hidden_dims);
      float* up = scratch.get(2, num_rows * hidden_dims);
      normalize(x, in[1].data<float>(), in[1].strides(0), normed, num_rows, num_inputs, eps);
      weight_products(normed, num_rows, num_inputs, bits, {{&in[2], hidden_dims, gate}, {&in[3], hidden_dims, up}});
      apply_swiglu(gate, up, gate, num_rows * hidden_dims);
      weight_products(gate, num_rows, hidden_dims, bits, {{&in[4], num_inputs, y[0]}});
      for (int64_t i = 0; i < num_rows * num_inputs; ++i) y[0][i] = x[i] + y[0][i];
    }
  });
}

void DecoderLayerOp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxDecoderLayerOp runs on the CPU only");
}

bool DecoderLayerOp::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecoderLayerOp&>(other);
  return kind_ == o.kind_ && bits_ == o.bits_ && eps_ == o.eps_ && num_q_heads_ == o.num_q_heads_ &&
         num_kv_heads_ == o.num_kv_heads_ && head_dim_ == o.head_dim_ && hidden_dims_ == o.hidden_dims_ &&
         rope_.dims == o.rope_.dims && rope_.traditional == o.rope_.traditional && rope_.base == o.rope_.base &&
         rope_.scale == o.rope_.scale;
}

}  // namespace gmlx_kernels
