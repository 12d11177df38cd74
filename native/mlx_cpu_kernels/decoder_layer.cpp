#include "decoder_layer.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "attention_job.h"
#include "encode.h"
#include "float_matmul.h"
#include "int8_dot_kernels.h"
#include "quantized_matmul.h"
#include "rms_norm.h"
#include "rope.h"
#include "swiglu.h"

namespace gmlx_kernels {

namespace {

// Per-thread scratch for the stages' intermediates: a decode step makes 30-90 fused calls,
// each would otherwise allocate and free several buffers. Only grows. The stages use 0-3;
// the whole layer keeps its own intermediates in 4-8, a stack its layers' hidden states in 9-10.
struct Scratch {
  std::vector<float> buffers[11];
  std::vector<RopeAngles> angles;  // each segment's rows' RoPE angles: one layer's, or all of a stack's
  float* get(int i, int64_t num_floats) {
    if (static_cast<int64_t>(buffers[i].size()) < num_floats) buffers[i].resize(num_floats);
    return buffers[i].data();
  }
  // Room for num_segments segments' angles; the pointer holds until the next call.
  RopeAngles* segment_angles(size_t num_segments) {
    if (angles.size() < num_segments) angles.resize(num_segments);
    return angles.data();
  }
};

// Rows of one cache in a layer's call, B x T of them from first_row of the call's (rows, D)
// hidden state. A stack runs several (a round's decode rows and the prompt chunks it carries):
// the products of all of them share one pass over the weights, and each segment's RoPE, KV
// write and attention read its own offsets and cache.
struct SegmentRows {
  int64_t first_row, num_b, num_t;
  const int32_t* offsets;
  int64_t offset_stride;  // 0: one offset for every row b
  const RopeAngles* angles;  // fill_layer_angles
  int64_t num_rows() const { return num_b * num_t; }
};

SegmentRows segment_rows(int64_t first_row, const mx::array& x, const mx::array& offset, const RopeAngles* angles) {
  return {first_row, x.shape(0), x.shape(1), offset.data<int32_t>(), per_row_stride(offset), angles};
}

int64_t total_rows(const std::vector<SegmentRows>& segments) {
  return segments.back().first_row + segments.back().num_rows();
}

// RoPE of a segment's rows (b, t) of a (B * T, H * Dh) buffer as (B, H, T, Dh), into y.
RopeArgs head_rope_args(const float* x, const SegmentRows& rows, int64_t num_heads, int64_t head_dim,
                        const RopeSpec& rope, float* y) {
  RopeArgs args;
  args.x = x;
  args.num_b = rows.num_b;
  args.num_m = num_heads;
  args.num_t = rows.num_t;
  args.num_d = head_dim;
  args.stride_b = rows.num_t * num_heads * head_dim;
  args.stride_m = head_dim;
  args.stride_t = num_heads * head_dim;
  args.stride_d = 1;
  args.offsets = rows.offsets;
  args.offset_stride = rows.offset_stride;
  args.y = y;
  args.dims = rope.dims;
  args.traditional = rope.traditional;
  args.base = rope.base;
  args.scale = rope.scale;
  args.freqs = rope.freqs.empty() ? nullptr : rope.freqs.data();
  args.mscale = rope.mscale;
  return args;
}

// The angles each row (b, t) of a segment's q and k turn by: the same for every layer of a step.
void fill_layer_angles(const SegmentRows& rows, int64_t head_dim, const RopeSpec& rope, RopeAngles& angles) {
  fill_rope_angles(head_rope_args(nullptr, rows, 1, head_dim, rope, nullptr), angles);
}

// A layer's product over its weights' layout: float32 panels (bits kFloatBits) or quads of 4 or 8
// bits (a K-quant GGUF mixes them within a layer).
struct Product {
  const void* weights;
  int bits;
  int64_t num_outputs;
  float* y;
};

// Products of one x: those of one layout share a pass (x quantized once, one pool job); each
// product's bits are those of a call of its own either way.
void weight_products(const float* x, int64_t num_rows, int64_t num_inputs, const std::vector<Product>& products) {
  std::vector<int> layouts;
  for (const auto& p : products) {
    if (std::find(layouts.begin(), layouts.end(), p.bits) == layouts.end()) layouts.push_back(p.bits);
  }
  for (int bits : layouts) {
    if (bits == kFloatBits) {
      std::vector<PanelsPart> parts;
      for (const auto& p : products) {
        if (p.bits == bits) parts.push_back({static_cast<const float*>(p.weights), p.num_outputs, p.y});
      }
      panels_products(x, num_rows, num_inputs, parts);
    } else {
      std::vector<QuadsPart> parts;
      for (const auto& p : products) {
        if (p.bits == bits) parts.push_back({static_cast<const uint8_t*>(p.weights), p.num_outputs, p.y});
      }
      quads_products(x, num_rows, num_inputs, bits, parts);
    }
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

// One layout per product: bits holds as many as there are products.
void check_bits_count(const std::vector<int>& bits, size_t num_products, const std::string& who) {
  if (bits.size() != num_products) {
    throw std::invalid_argument(who + ": bits must hold one value per product (" + std::to_string(num_products) +
                                "), got " + std::to_string(bits.size()));
  }
}

// A layer's seven products' weights (q, k, v, o, gate, up, down), each in the layout its bits name.
void check_layer_weights(const mx::array* weights, int64_t q_width, int64_t kv_width, int64_t dims,
                         int64_t hidden_dims, const std::vector<int>& bits, const std::string& who) {
  check_bits_count(bits, 7, who);
  const char* names[] = {" q", " k", " v", " o", " gate", " up", " down"};
  const int64_t outputs[] = {q_width, kv_width, kv_width, dims, hidden_dims, hidden_dims, dims};
  const int64_t inputs[] = {dims, dims, dims, q_width, dims, dims, hidden_dims};
  for (int i = 0; i < 7; ++i) check_weights(weights[i], outputs[i], inputs[i], bits[i], who + names[i]);
}

// A layer's weights after the seven products: none, or qwen3's q and k norms over each head (Dh,).
void check_head_norms(const std::vector<mx::array>& weights, size_t num_products, int head_dim,
                      const std::string& who) {
  if (weights.size() != num_products && weights.size() != num_products + 2) {
    throw std::invalid_argument(who + ": the products' weights, then optionally the q and k head norms");
  }
  for (size_t i = num_products; i < weights.size(); ++i) {
    if (weights[i].ndim() != 1 || weights[i].shape(0) != head_dim) {
      throw std::invalid_argument(who + ": head norm weights must be (head_dim,)");
    }
  }
}

// Grouped heads: the q heads a whole multiple of the kv heads.
void check_heads(int num_q_heads, int num_kv_heads, const std::string& who) {
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) {
    throw std::invalid_argument(who + ": the q heads must be a multiple of the kv heads");
  }
}

// RoPE over the first rope_dims of each head: even, at most head_dim.
// An offset is a scalar or one per row of x (B, ...).
void check_offset(const mx::array& offset, const mx::array& x, const std::string& who) {
  if (!(offset.ndim() == 0 || (offset.ndim() == 1 && (offset.size() == 1 || offset.shape(0) == x.shape(0))))) {
    throw std::invalid_argument(who + ": offset must be a scalar or one per row");
  }
}

// qwen2's q, k and v biases: none, or three float32-castable vectors of the products' widths.
void check_qkv_biases(const std::vector<mx::array>& biases, int64_t q_width, int64_t kv_width,
                      const std::string& who) {
  if (biases.empty()) return;
  const int64_t widths[] = {q_width, kv_width, kv_width};
  if (biases.size() != 3) throw std::invalid_argument(who + ": qkv_biases must be none or q's, k's and v's");
  for (int i = 0; i < 3; ++i) {
    if (biases[i].ndim() != 1 || biases[i].shape(0) != widths[i]) {
      throw std::invalid_argument(who + ": qkv_biases must be (q width,), (kv width,), (kv width,)");
    }
  }
}

// A node's inputs, then arrays[first:] as float32: a layer's head norms (past its products'
// weights), qwen2's q, k and v biases.
std::vector<mx::array> with_float32(std::vector<mx::array> inputs, const std::vector<mx::array>& arrays,
                                    size_t first, mx::Stream s) {
  for (size_t i = first; i < arrays.size(); ++i) inputs.push_back(as_dtype(arrays[i], mx::float32, s));
  return inputs;
}

NormWeight norm_weight(const mx::array& weight) { return {weight.data<float>(), weight.strides(0)}; }

// q, k and v's biases as a task reads them (three node inputs from `first`), or none.
QkvBiases qkv_biases_at(const std::vector<mx::array>& in, size_t first, bool has_biases) {
  if (!has_biases) return {};
  return {true, {norm_weight(in[first]), norm_weight(in[first + 1]), norm_weight(in[first + 2])}};
}

// A layer's weights: the norms, the seven products and their bits, head_norms (q's, k's) or null,
// and the q/k/v biases.
LayerWeights layer_weights(const mx::array& input_norm, const mx::array& post_norm, const mx::array* products,
                           const std::vector<int>& bits, const mx::array* head_norms, const QkvBiases& biases) {
  LayerWeights w{norm_weight(input_norm), norm_weight(post_norm), {}, {}, head_norms != nullptr, {}, biases};
  for (int i = 0; i < 7; ++i) w.products[i] = products[i].data<void>(), w.bits[i] = bits[i];
  if (head_norms != nullptr) w.head_norms[0] = norm_weight(head_norms[0]), w.head_norms[1] = norm_weight(head_norms[1]);
  return w;
}

// Norm, the q/k/v products (plus qwen2's biases, as mlx adds them after a product) and qwen3's
// per-head q and k norms (head_norms not null: q's, then
// k's) over every segment's rows, then each segment's RoPE by its angles: q into q_out (B, Hq,
// T, Dh), k and v into k_out and v_out (B, Hkv, T, Dh), a segment's block from its first row on.
// weights and bits: q's, k's, v's.
void inputs_stage(Scratch& scratch, const float* x, const std::vector<SegmentRows>& segments, int64_t num_inputs,
                  const NormWeight& norm, float eps, const void* const* weights, const int* bits, int num_q_heads,
                  int num_kv_heads, int head_dim, const RopeSpec& rope, const NormWeight* head_norms,
                  const QkvBiases& biases, float* q_out,
                  float* k_out, float* v_out) {
  const int64_t num_rows = total_rows(segments);
  const int64_t q_width = static_cast<int64_t>(num_q_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  float* normed = scratch.get(0, num_rows * num_inputs);
  float* q = scratch.get(1, num_rows * q_width);
  float* k = scratch.get(2, num_rows * kv_width);
  float* v = scratch.get(3, num_rows * kv_width);
  normalize(x, norm.data, norm.stride, normed, num_rows, num_inputs, eps);
  weight_products(normed, num_rows, num_inputs, {{weights[0], bits[0], q_width, q}, {weights[1], bits[1], kv_width, k},
                                                {weights[2], bits[2], kv_width, v}});
  if (biases.is_present) {
    float* outs[] = {q, k, v};
    const int64_t widths[] = {q_width, kv_width, kv_width};
    for (int i = 0; i < 3; ++i) {
      const NormWeight& bias = biases.vectors[i];
      for (int64_t r = 0; r < num_rows; ++r) {
        float* row = outs[i] + r * widths[i];
        for (int64_t j = 0; j < widths[i]; ++j) row[j] = row[j] + bias.data[j * bias.stride];
      }
    }
  }
  if (head_norms != nullptr) {  // rows of Dh, normalized in place (a row is read before it is written)
    normalize(q, head_norms[0].data, head_norms[0].stride, q, num_rows * num_q_heads, head_dim, eps);
    normalize(k, head_norms[1].data, head_norms[1].stride, k, num_rows * num_kv_heads, head_dim, eps);
  }
  for (const auto& rows : segments) {
    const int64_t q_start = rows.first_row * q_width, kv_start = rows.first_row * kv_width;
    rotate_with(head_rope_args(q + q_start, rows, num_q_heads, head_dim, rope, q_out + q_start), *rows.angles);
    rotate_with(head_rope_args(k + kv_start, rows, num_kv_heads, head_dim, rope, k_out + kv_start), *rows.angles);
    const float* v_rows = v + kv_start;
    float* v_rows_out = v_out + kv_start;
    for (int64_t b = 0; b < rows.num_b; ++b) {  // v as (B, Hkv, T, Dh): the same floats, moved
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t t = 0; t < rows.num_t; ++t) {
          const float* src = v_rows + (b * rows.num_t + t) * kv_width + h * head_dim;
          std::copy(src, src + head_dim, v_rows_out + ((b * num_kv_heads + h) * rows.num_t + t) * head_dim);
        }
      }
    }
  }
}

// y = residual + a @ W.T, in the residual add's order (a float add either way).
void project_add_stage(const float* a, int64_t num_rows, int64_t num_inputs, const void* weights,
                       int64_t num_outputs, const float* residual, int bits, float* y) {
  weight_products(a, num_rows, num_inputs, {{weights, bits, num_outputs, y}});
  for (int64_t i = 0; i < num_rows * num_outputs; ++i) y[i] = residual[i] + y[i];
}

// y = h + down(swiglu(gate(n), up(n))), n = rms_norm(h). weights and bits: gate's, up's, down's.
void mlp_stage(Scratch& scratch, const float* h, int64_t num_rows, int64_t num_inputs, const NormWeight& norm,
               float eps, const void* const* weights, int64_t hidden_dims, const int* bits, float* y) {
  float* normed = scratch.get(0, num_rows * num_inputs);
  float* gate = scratch.get(1, num_rows * hidden_dims);
  float* up = scratch.get(2, num_rows * hidden_dims);
  normalize(h, norm.data, norm.stride, normed, num_rows, num_inputs, eps);
  weight_products(normed, num_rows, num_inputs,
                  {{weights[0], bits[0], hidden_dims, gate}, {weights[1], bits[1], hidden_dims, up}});
  apply_swiglu(gate, up, gate, num_rows * hidden_dims);
  weight_products(gate, num_rows, hidden_dims, {{weights[2], bits[2], num_inputs, y}});
  for (int64_t i = 0; i < num_rows * num_inputs; ++i) y[i] = h[i] + y[i];
}

// Row b's T new keys or values (B, H, T, Dh) into a (B, H, S, Dh) buffer at positions offset[b] + t;
// a position outside [0, S) is not written (the caller reserves room; this keeps memory safe).
// A Half buffer takes each float rounded to nearest even, as mlx's astype rounds.
template <typename KV>
void write_new_positions(const float* fresh, const SegmentRows& rows, int64_t num_heads, int64_t head_dim,
                         int64_t capacity, KV* buffer) {
  for (int64_t b = 0; b < rows.num_b; ++b) {
    const int64_t start = rows.offsets[b * rows.offset_stride];
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t t = 0; t < rows.num_t; ++t) {
        if (start + t < 0 || start + t >= capacity) continue;
        const float* src = fresh + ((b * num_heads + h) * rows.num_t + t) * head_dim;
        std::copy(src, src + head_dim, buffer + ((b * num_heads + h) * capacity + start + t) * head_dim);
      }
    }
  }
}

// A segment's cache in one layer: its (B, Hkv, capacity, Dh) key and value buffers, float or Half.
struct SegmentCache {
  void* keys;
  void* values;
  int64_t capacity;
  bool is_half;
};

// One layer over each segment's rows of x (rows, D) into h_out, segment s's new keys and values
// written at its offsets into caches[s]: the code of the one-node layer (one segment) and of each
// layer of a stack. Every row's bits are those of a call of its segment alone: the products are
// row-independent, and the rest runs per row or per segment.
void run_layer(const LayerShape& shape, Scratch& scratch, const float* x, const std::vector<SegmentRows>& segments,
               const SegmentCache* caches, int64_t dims, const LayerWeights& weights, float* h_out) {
  const int64_t num_q_heads = shape.num_q_heads, num_kv_heads = shape.num_kv_heads, head_dim = shape.head_dim;
  const int64_t num_rows = total_rows(segments);
  const int64_t q_width = num_q_heads * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
  float* q = scratch.get(4, num_rows * q_width);
  float* k = scratch.get(5, num_rows * kv_width);
  float* v = scratch.get(6, num_rows * kv_width);
  float* attended = scratch.get(7, num_rows * q_width);
  float* h = scratch.get(8, num_rows * dims);
  inputs_stage(scratch, x, segments, dims, weights.input_norm, shape.eps, weights.products, weights.bits,
               shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.rope,
               weights.has_head_norms ? weights.head_norms : nullptr, weights.qkv_biases, q, k, v);
  for (size_t s = 0; s < segments.size(); ++s) {
    const SegmentRows& rows = segments[s];
    const SegmentCache& cache = caches[s];
    const int64_t kv_start = rows.first_row * kv_width;
    const auto write = [&](auto* keys, auto* values) {
      write_new_positions(k + kv_start, rows, num_kv_heads, head_dim, cache.capacity, keys);
      write_new_positions(v + kv_start, rows, num_kv_heads, head_dim, cache.capacity, values);
    };
    if (cache.is_half) {
      write(static_cast<Half*>(cache.keys), static_cast<Half*>(cache.values));
    } else {
      write(static_cast<float*>(cache.keys), static_cast<float*>(cache.values));
    }
    AttentionJob job;
    job.q = {q + rows.first_row * q_width, num_q_heads * rows.num_t * head_dim, rows.num_t * head_dim, head_dim};
    job.keys = {cache.keys, num_kv_heads * cache.capacity * head_dim, cache.capacity * head_dim, head_dim};
    job.values = {cache.values, num_kv_heads * cache.capacity * head_dim, cache.capacity * head_dim, head_dim};
    job.is_half_kv = cache.is_half;
    job.offsets = rows.offsets;
    job.offset_stride = rows.offset_stride;
    job.out = attended + rows.first_row * q_width;
    job.num_b = rows.num_b;
    job.num_q_heads = num_q_heads;
    job.num_t = rows.num_t;
    job.num_d = head_dim;
    job.num_keys = cache.capacity;
    job.group = num_q_heads / num_kv_heads;
    job.scale = shape.attention_scale;
    job.isa = kernels_isa();
    run_attention_job(job);
  }
  project_add_stage(attended, num_rows, q_width, weights.products[3], dims, x, weights.bits[3], h);
  mlp_stage(scratch, h, num_rows, dims, weights.post_norm, shape.eps, &weights.products[4], shape.hidden_dims,
            &weights.bits[4], h_out);
}

// The KV buffers a layer writes in place: the caller hands over buffers no other array shares
// (RaggedKVCache.writable_buffers) and takes the outputs, which alias them, so later readers
// depend on this write. (mlx's donation cannot be used: the previous step's node, still queued,
// keeps its sibling outputs' buffers referenced until it runs.) A strided buffer is copied:
// true when `output` got a fresh buffer the task must fill from `buffer`.
bool share_or_allocate(const mx::array& buffer, mx::array& output) {
  if (buffer.flags().row_contiguous) {
    output.copy_shared_buffer(buffer);
    return false;
  }
  output.set_data(mx::allocator::malloc(output.nbytes()));
  return true;
}

// A node that writes KV buffers in place: inputs [num_segments x's, their offsets, the KV
// buffers, ...], outputs [each segment's h, the same buffers]. Registers both with the encoder
// (each h fresh, each buffer shared or, if strided, fresh); returns the inputs' graph-detached
// copies and which buffers are fresh.
struct InPlaceEncoded {
  std::vector<mx::array> inputs;
  std::vector<bool> is_copied;  // per buffer: the task fills it from its input (fill_copied)
};

InPlaceEncoded encode_in_place(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs, int num_segments, int num_buffers) {
  InPlaceEncoded encoded;
  for (int i = 0; i < num_buffers; ++i) {
    encoded.is_copied.push_back(share_or_allocate(inputs[2 * num_segments + i], outputs[num_segments + i]));
  }
  for (int i = 0; i < num_segments; ++i) outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    encoded.inputs.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& y : outputs) encoder.set_output_array(y);
  return encoded;
}

// The KV buffers' type in a node: float16 (a float16 cache, written and read as halves) when
// every buffer is, else float32 (the others are cast, which makes fresh buffers).
mx::Dtype kv_buffer_dtype(const std::vector<mx::array>& buffers) {
  const bool is_half = std::all_of(buffers.begin(), buffers.end(), [](const mx::array& a) {
    return a.dtype() == mx::float16;
  });
  return is_half ? mx::float16 : mx::float32;
}

// A strided KV input into the fresh buffer share_or_allocate gave its output.
template <typename KV>
void fill_copied_as(const mx::array& buffer, void* y) {
  std::vector<KV> copy;
  const KV* src = row_major_data<KV>(buffer, copy);
  std::copy(src, src + buffer.size(), static_cast<KV*>(y));
}

void fill_copied(const mx::array& buffer, void* y) {
  if (buffer.dtype() == mx::float16) return fill_copied_as<Half>(buffer, y);
  fill_copied_as<float>(buffer, y);
}

}  // namespace

std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight, float eps,
                                        const mx::array& offset, const std::vector<mx::array>& quads,
                                        int num_q_heads, int num_kv_heads, int head_dim, const std::vector<int>& bits,
                                        int rope_dims, bool rope_traditional, float rope_base, float rope_scale,
                                        const std::vector<float>& rope_freqs, float rope_mscale,
                                        const std::vector<mx::array>& qkv_biases) {
  if (x.ndim() != 3 || norm_weight.ndim() != 1 || norm_weight.shape(0) != x.shape(2) || x.shape(2) % 32 != 0) {
    throw std::invalid_argument("attention_inputs: x must be (B, T, D), D a multiple of 32, norm_weight (D,)");
  }
  check_head_norms(quads, 3, head_dim, "attention_inputs");
  check_rope(rope_dims, rope_freqs, head_dim, "attention_inputs");
  check_offset(offset, x, "attention_inputs");
  check_bits_count(bits, 3, "attention_inputs");
  check_qkv_biases(qkv_biases, static_cast<int64_t>(num_q_heads) * head_dim,
                   static_cast<int64_t>(num_kv_heads) * head_dim, "attention_inputs");
  const int dims = x.shape(2);
  check_weights(quads[0], static_cast<int64_t>(num_q_heads) * head_dim, dims, bits[0], "attention_inputs q");
  check_weights(quads[1], static_cast<int64_t>(num_kv_heads) * head_dim, dims, bits[1], "attention_inputs k");
  check_weights(quads[2], static_cast<int64_t>(num_kv_heads) * head_dim, dims, bits[2], "attention_inputs v");
  auto s = mx::default_stream(mx::Device::cpu);
  const int num_b = x.shape(0), num_t = x.shape(1);
  const mx::Shape q_shape = {num_b, num_q_heads, num_t, head_dim};
  const mx::Shape kv_shape = {num_b, num_kv_heads, num_t, head_dim};
  return mx::array::make_arrays(
      {q_shape, kv_shape, kv_shape}, {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kAttentionInputs, bits, eps, num_q_heads, num_kv_heads,
                                       head_dim, 0, RopeSpec{rope_dims, rope_traditional, rope_base, rope_scale,
                                                             rope_freqs, rope_mscale},
                                       0.0f, !qkv_biases.empty()),
      with_float32(with_float32({as_dtype(x, mx::float32, s), as_dtype(norm_weight, mx::float32, s),
                                 as_dtype(offset, mx::int32, s), quads[0], quads[1], quads[2]},
                                quads, 3, s),
                   qkv_biases, 0, s));
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
                   std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kProjectAdd, std::vector<int>{bits}, 0.0f,
                                                    0, 0, 0, 0,
                                                    RopeSpec{}),
                   {as_dtype(a, mx::float32, s), quads, as_dtype(residual, mx::float32, s)});
}

mx::array mlp_block(const mx::array& h, const mx::array& norm_weight, float eps, const mx::array& gate_quads,
                    const mx::array& up_quads, const mx::array& down_quads, int hidden_dims,
                    const std::vector<int>& bits) {
  if (h.ndim() < 1 || norm_weight.ndim() != 1 || norm_weight.shape(0) != h.shape(-1) || h.shape(-1) % 32 != 0 ||
      hidden_dims % 32 != 0) {
    throw std::invalid_argument("mlp_block: h (..., D), norm_weight (D,), D and hidden_dims multiples of 32");
  }
  check_bits_count(bits, 3, "mlp_block");
  check_weights(gate_quads, hidden_dims, h.shape(-1), bits[0], "mlp_block gate");
  check_weights(up_quads, hidden_dims, h.shape(-1), bits[1], "mlp_block up");
  check_weights(down_quads, h.shape(-1), hidden_dims, bits[2], "mlp_block down");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(h.shape(), mx::float32,
                   std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kMlpBlock, bits, eps, 0, 0, 0,
                                                    hidden_dims, RopeSpec{}),
                   {as_dtype(h, mx::float32, s), as_dtype(norm_weight, mx::float32, s), gate_quads, up_quads,
                    down_quads});
}

std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& offset, const mx::array& keys,
                                     const mx::array& values, const mx::array& input_norm_weight,
                                     const mx::array& post_norm_weight, float eps,
                                     const std::vector<mx::array>& weights, int num_q_heads, int num_kv_heads,
                                     int head_dim, int hidden_dims, const std::vector<int>& bits,
                                     float attention_scale, int rope_dims, bool rope_traditional, float rope_base,
                                     float rope_scale, const std::vector<float>& rope_freqs, float rope_mscale,
                                     const std::vector<mx::array>& qkv_biases) {
  if (x.ndim() != 3 || x.shape(2) % 32 != 0 || hidden_dims % 32 != 0) {
    throw std::invalid_argument("decoder_layer: x must be (B, T, D), D and hidden_dims multiples of 32");
  }
  const int dims = x.shape(2);
  for (const auto* norm : {&input_norm_weight, &post_norm_weight}) {
    if (norm->ndim() != 1 || norm->shape(0) != dims) throw std::invalid_argument("decoder_layer: norm weights (D,)");
  }
  check_head_norms(weights, 7, head_dim, "decoder_layer");
  check_heads(num_q_heads, num_kv_heads, "decoder_layer");
  check_rope(rope_dims, rope_freqs, head_dim, "decoder_layer");
  const mx::Shape kv_shape = {x.shape(0), num_kv_heads, keys.ndim() == 4 ? keys.shape(2) : 0, head_dim};
  if (keys.shape() != kv_shape || values.shape() != kv_shape || keys.shape(2) < x.shape(1)) {
    throw std::invalid_argument("decoder_layer: keys and values must be (B, Hkv, S, Dh) with S >= T");
  }
  check_offset(offset, x, "decoder_layer");
  const int64_t q_width = static_cast<int64_t>(num_q_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  check_layer_weights(weights.data(), q_width, kv_width, dims, hidden_dims, bits, "decoder_layer");
  check_qkv_biases(qkv_biases, q_width, kv_width, "decoder_layer");
  auto s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype kv_dtype = kv_buffer_dtype({keys, values});
  std::vector<mx::array> inputs = {as_dtype(x, mx::float32, s), as_dtype(offset, mx::int32, s),
                                   as_dtype(keys, kv_dtype, s), as_dtype(values, kv_dtype, s),
                                   as_dtype(input_norm_weight, mx::float32, s),
                                   as_dtype(post_norm_weight, mx::float32, s)};
  inputs.insert(inputs.end(), weights.begin(), weights.begin() + 7);
  return mx::array::make_arrays(
      {x.shape(), kv_shape, kv_shape}, {mx::float32, kv_dtype, kv_dtype},
      std::make_shared<DecoderLayerOp>(s, DecoderLayerOp::Kind::kLayer, bits, eps, num_q_heads, num_kv_heads, head_dim,
                                       hidden_dims,
                                       RopeSpec{rope_dims, rope_traditional, rope_base, rope_scale, rope_freqs,
                                                rope_mscale},
                                       attention_scale, !qkv_biases.empty()),
      with_float32(with_float32(std::move(inputs), weights, 7, s), qkv_biases, 0, s));
}

void DecoderLayerOp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  if (kind_ == Kind::kLayer) return eval_layer(encoder, inputs, outputs);
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y = std::move(arrays.outputs), kind = kind_, bits = bits_,
                    eps = eps_, num_q_heads = num_q_heads_, num_kv_heads = num_kv_heads_, head_dim = head_dim_,
                    hidden_dims = hidden_dims_, rope = rope_, has_biases = has_qkv_biases_]() {
    thread_local Scratch scratch;  // the lambdas of one stream run on one thread, one at a time
    std::vector<float> x_copy;
    const float* x = row_major_data<float>(in[0], x_copy);
    const int64_t num_inputs = in[0].shape(-1);
    const int64_t num_rows = in[0].size() / num_inputs;
    if (kind == Kind::kAttentionInputs) {
      const void* products[3] = {in[3].data<void>(), in[4].data<void>(), in[5].data<void>()};
      // Inputs: x, norm, offset, q, k, v, then the head norms and the biases where the layer has them.
      const size_t num_biases = has_biases ? 3 : 0;
      const bool has_head_norms = in.size() - num_biases == 8;
      NormWeight head_norms[2];
      if (has_head_norms) head_norms[0] = norm_weight(in[6]), head_norms[1] = norm_weight(in[7]);
      RopeAngles* angles = scratch.segment_angles(1);
      const std::vector<SegmentRows> rows = {segment_rows(0, in[0], in[2], angles)};
      fill_layer_angles(rows[0], head_dim, rope, *angles);
      inputs_stage(scratch, x, rows, num_inputs, norm_weight(in[1]), eps, products, bits.data(), num_q_heads,
                   num_kv_heads,
                   head_dim, rope, has_head_norms ? head_norms : nullptr,
                   qkv_biases_at(in, in.size() - num_biases, has_biases), y[0], y[1], y[2]);
    } else if (kind == Kind::kProjectAdd) {
      std::vector<float> residual_copy;
      const float* residual = row_major_data<float>(in[2], residual_copy);
      project_add_stage(x, num_rows, num_inputs, in[1].data<void>(), in[2].shape(-1), residual, bits[0], y[0]);
    } else {
      const void* products[3] = {in[2].data<void>(), in[3].data<void>(), in[4].data<void>()};
      mlp_stage(scratch, x, num_rows, num_inputs, norm_weight(in[1]), eps, products, hidden_dims, bits.data(), y[0]);
    }
  });
}

// Inputs: x, offset, keys, values, the two norms' weights, then q, k, v, o, gate, up, down, and
// qwen3's q and k head norms where the layer has them.
void DecoderLayerOp::eval_layer(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  InPlaceEncoded encoded = encode_in_place(encoder, inputs, outputs, 1, 2);
  encoder.dispatch([in = std::move(encoded.inputs), h_out = outputs[0].data<float>(), keys = outputs[1].data<void>(),
                    values = outputs[2].data<void>(), is_keys_copied = encoded.is_copied[0],
                    is_values_copied = encoded.is_copied[1], bits = bits_, has_biases = has_qkv_biases_,
                    shape = LayerShape{eps_, num_q_heads_, num_kv_heads_, head_dim_, hidden_dims_, rope_,
                                       attention_scale_}]() {
    thread_local Scratch scratch;
    const size_t num_biases = has_biases ? 3 : 0;
    std::vector<float> x_copy;
    if (is_keys_copied) fill_copied(in[2], keys);
    if (is_values_copied) fill_copied(in[3], values);
    const float* x = row_major_data<float>(in[0], x_copy);
    RopeAngles* angles = scratch.segment_angles(1);
    const std::vector<SegmentRows> rows = {segment_rows(0, in[0], in[1], angles)};
    fill_layer_angles(rows[0], shape.head_dim, shape.rope, *angles);
    const SegmentCache cache = {keys, values, in[2].shape(2), in[2].dtype() == mx::float16};
    run_layer(shape, scratch, x, rows, &cache, in[0].shape(2),
              layer_weights(in[4], in[5], &in[6], bits, in.size() - num_biases == 15 ? &in[13] : nullptr,
                            qkv_biases_at(in, in.size() - num_biases, has_biases)),
              h_out);
  });
}

LayerStack::LayerStack(const std::vector<mx::array>& input_norms, const std::vector<mx::array>& post_norms,
                       const std::vector<std::vector<mx::array>>& weights, const std::vector<std::vector<int>>& bits,
                       float eps, int num_q_heads, int num_kv_heads, int head_dim, int hidden_dims,
                       float attention_scale,
                       int rope_dims, bool rope_traditional, float rope_base, float rope_scale,
                       const std::vector<float>& rope_freqs, float rope_mscale,
                       const std::vector<std::vector<mx::array>>& qkv_biases)
    : input_norms_(input_norms),
      post_norms_(post_norms),
      weights_(weights),
      qkv_biases_(qkv_biases),
      shape_{eps, num_q_heads, num_kv_heads, head_dim, hidden_dims,
             RopeSpec{rope_dims, rope_traditional, rope_base, rope_scale, rope_freqs, rope_mscale}, attention_scale} {
  if (input_norms.empty() || post_norms.size() != input_norms.size() || weights.size() != input_norms.size() ||
      bits.size() != input_norms.size()) {
    throw std::invalid_argument(
        "LayerStack: one input norm, post norm, weight list and bits list per layer, at least one");
  }
  check_heads(num_q_heads, num_kv_heads, "LayerStack");
  check_rope(rope_dims, rope_freqs, head_dim, "LayerStack");
  if (hidden_dims % 32 != 0) throw std::invalid_argument("LayerStack: hidden_dims must be a multiple of 32");
  const int dims = input_norms[0].ndim() == 1 ? input_norms[0].shape(0) : 0;
  if (dims % 32 != 0 || dims == 0) throw std::invalid_argument("LayerStack: norm weights (D,), D a multiple of 32");
  const int64_t q_width = static_cast<int64_t>(num_q_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  for (size_t l = 0; l < weights.size(); ++l) {
    for (const auto* norm : {&input_norms[l], &post_norms[l]}) {
      // Read by the node's task without a graph edge: it must hold its floats already.
      if (norm->ndim() != 1 || norm->shape(0) != dims || norm->dtype() != mx::float32 || !norm->is_available()) {
        throw std::invalid_argument("LayerStack: norm weights must be evaluated float32 (D,) arrays");
      }
    }
    const auto& w = weights[l];
    check_head_norms(w, 7, head_dim, "LayerStack");
    if (w.size() != weights[0].size()) throw std::invalid_argument("LayerStack: every layer with head norms or none");
    for (size_t i = 0; i < w.size(); ++i) {
      if (!w[i].is_available()) throw std::invalid_argument("LayerStack: weights must be evaluated");
      if (i >= 7 && w[i].dtype() != mx::float32) throw std::invalid_argument("LayerStack: head norms must be float32");
    }
    check_layer_weights(w.data(), q_width, kv_width, dims, hidden_dims, bits[l], "LayerStack");
    if (!qkv_biases.empty()) {
      check_qkv_biases(qkv_biases[l], q_width, kv_width, "LayerStack");
      for (const auto& bias : qkv_biases[l]) {
        if (bias.dtype() != mx::float32 || !bias.is_available()) {
          throw std::invalid_argument("LayerStack: qkv_biases must be evaluated float32 arrays");
        }
      }
    }
  }
  const auto is_empty = [](const std::vector<mx::array>& biases) { return biases.empty(); };
  if (!qkv_biases.empty() &&
      (qkv_biases.size() != weights.size() || std::any_of(qkv_biases.begin(), qkv_biases.end(), is_empty))) {
    throw std::invalid_argument("LayerStack: q, k and v biases for every layer or none");
  }
  for (size_t l = 0; l < weights.size(); ++l) {  // after every check: the arrays are evaluated
    const auto& w = weights_[l];
    const QkvBiases biases = qkv_biases_.empty() ? QkvBiases{} : qkv_biases_at(qkv_biases_[l], 0, true);
    const mx::array* head_norms = w.size() > 7 ? w.data() + 7 : nullptr;
    layers_.push_back(layer_weights(input_norms_[l], post_norms_[l], w.data(), bits[l], head_norms, biases));
  }
}

std::vector<mx::array> decoder_stack(std::shared_ptr<const LayerStack> stack, const std::vector<mx::array>& xs,
                                     const std::vector<mx::array>& offsets, const std::vector<mx::array>& keys,
                                     const std::vector<mx::array>& values, const std::vector<mx::array>& after) {
  if (!stack) throw std::invalid_argument("decoder_stack: no layer stack");
  const LayerShape& shape = stack->shape();
  const int num_layers = stack->num_layers();
  const int num_segments = static_cast<int>(xs.size());
  if (xs.empty() || offsets.size() != xs.size()) {
    throw std::invalid_argument("decoder_stack: one offset per segment, at least one segment");
  }
  if (keys.size() != xs.size() * num_layers || values.size() != xs.size() * num_layers) {
    throw std::invalid_argument("decoder_stack: one keys and one values buffer per segment and layer");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  // The buffers are written where they lie: a cast would write a copy.
  const mx::Dtype kv_dtype = keys[0].dtype();
  if (kv_dtype != mx::float16 && kv_dtype != mx::float32) {
    throw std::invalid_argument("decoder_stack: keys and values must be float16 or float32");
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs;
  for (int i = 0; i < num_segments; ++i) {
    const mx::array& x = xs[i];
    if (x.ndim() != 3 || x.shape(2) != stack->dims()) throw std::invalid_argument("decoder_stack: x must be (B, T, D)");
    check_offset(offsets[i], x, "decoder_stack");
    shapes.push_back(x.shape());
    inputs.push_back(as_dtype(x, mx::float32, s));
  }
  for (const auto& offset : offsets) inputs.push_back(as_dtype(offset, mx::int32, s));
  for (const auto* buffers : {&keys, &values}) {
    for (size_t i = 0; i < buffers->size(); ++i) {
      const mx::array& buffer = (*buffers)[i];
      const mx::array& x = xs[i / num_layers];
      const mx::Shape kv_shape = {x.shape(0), shape.num_kv_heads, buffer.ndim() == 4 ? buffer.shape(2) : 0,
                                  shape.head_dim};
      if (buffer.shape() != kv_shape || buffer.shape(2) < x.shape(1)) {
        throw std::invalid_argument("decoder_stack: keys and values must be (B, Hkv, S, Dh) with S >= T");
      }
      if (buffer.dtype() != kv_dtype) throw std::invalid_argument("decoder_stack: keys and values of one dtype");
      inputs.push_back(buffer);
    }
  }
  inputs.insert(inputs.end(), after.begin(), after.end());  // edges only: the task never reads them
  // Only the hidden states are outputs: 2 x layers KV outputs made a step's graph O(layers^2) to
  // build and free (mlx links every output of a node to all its siblings), ~0.4 ms at 30 layers.
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(num_segments, mx::float32),
                                std::make_shared<DecoderStackOp>(s, std::move(stack), num_segments), inputs);
}

// Inputs: each segment's x, each segment's offset, then keys and values, each segment's layers in
// turn, written where they lie (the caller's: RaggedKVCache.writable_buffers); outputs: each
// segment's h, on which whoever reads the buffers next must depend.
void DecoderStackOp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int num_buffers = 2 * num_segments_ * stack_->num_layers();
  const int first_buffer = 2 * num_segments_;
  std::vector<void*> kv;
  for (int i = 0; i < num_buffers; ++i) {
    const mx::array& buffer = inputs[first_buffer + i];
    if (!buffer.flags().row_contiguous) {
      throw std::invalid_argument("decoder_stack: a KV buffer is strided (RaggedKVCache keeps them row-contiguous)");
    }
    kv.push_back(const_cast<void*>(static_cast<const void*>(buffer.data<char>())));
  }
  std::vector<float*> h_out;
  for (int i = 0; i < num_segments_; ++i) {
    outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    h_out.push_back(outputs[i].data<float>());
  }
  std::vector<mx::array> in;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& y : outputs) encoder.set_output_array(y);
  encoder.dispatch([in = std::move(in), kv = std::move(kv), h_out = std::move(h_out), stack = stack_,
                    num_segments = num_segments_]() {
    thread_local Scratch scratch;
    const int num_layers = stack->num_layers();
    const int64_t dims = stack->dims();
    const int64_t first_buffer = 2 * num_segments;
    RopeAngles* angles = scratch.segment_angles(num_segments);
    std::vector<SegmentRows> segments;
    for (int i = 0; i < num_segments; ++i) {
      const int64_t first_row = i == 0 ? 0 : total_rows(segments);
      segments.push_back(segment_rows(first_row, in[i], in[num_segments + i], &angles[i]));
      fill_layer_angles(segments[i], stack->shape().head_dim, stack->shape().rope, angles[i]);
    }
    // One segment's x is read where it lies and its last layer writes its h; several lie end to end.
    const int64_t size = total_rows(segments) * dims;
    std::vector<float> x_copy;
    const float* x = nullptr;
    if (num_segments == 1) {
      x = row_major_data<float>(in[0], x_copy);
    } else {
      float* gathered = scratch.get(9, size);
      for (int i = 0; i < num_segments; ++i) {
        const float* src = row_major_data<float>(in[i], x_copy);
        std::copy(src, src + in[i].size(), gathered + segments[i].first_row * dims);
      }
      x = gathered;
    }
    std::vector<SegmentCache> caches(num_segments);
    // The hidden state between layers alternates between two scratch buffers (x in 9 goes first to 10).
    for (int l = 0; l < num_layers; ++l) {
      for (int i = 0; i < num_segments; ++i) {
        const int64_t b = static_cast<int64_t>(i) * num_layers + l;
        caches[i] = {kv[b], kv[num_segments * num_layers + b], in[first_buffer + b].shape(2),
                     in[first_buffer + b].dtype() == mx::float16};
      }
      float* y = l + 1 == num_layers && num_segments == 1 ? h_out[0] : scratch.get(9 + (l + 1) % 2, size);
      run_layer(stack->shape(), scratch, x, segments, caches.data(), dims, stack->layer(l), y);
      x = y;
    }
    if (num_segments > 1) {
      for (int i = 0; i < num_segments; ++i) {
        const float* src = x + segments[i].first_row * dims;
        std::copy(src, src + segments[i].num_rows() * dims, h_out[i]);
      }
    }
  });
}

void DecoderStackOp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxDecoderStackOp runs on the CPU only");
}

void DecoderLayerOp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxDecoderLayerOp runs on the CPU only");
}

bool DecoderLayerOp::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecoderLayerOp&>(other);
  return kind_ == o.kind_ && bits_ == o.bits_ && eps_ == o.eps_ && has_qkv_biases_ == o.has_qkv_biases_ &&
         num_q_heads_ == o.num_q_heads_ &&
         num_kv_heads_ == o.num_kv_heads_ && head_dim_ == o.head_dim_ && hidden_dims_ == o.hidden_dims_ &&
         rope_.dims == o.rope_.dims && rope_.traditional == o.rope_.traditional && rope_.base == o.rope_.base &&
         rope_.scale == o.rope_.scale && rope_.freqs == o.rope_.freqs &&
         rope_.mscale == o.rope_.mscale && attention_scale_ == o.attention_scale_;
}

}  // namespace gmlx_kernels
