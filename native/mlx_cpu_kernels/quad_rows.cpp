#include "quad_rows.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "int8_dot_kernels.h"
#include "quantized_matmul.h"

namespace gmlx_kernels {

namespace {

// Row `id` of the layout into y (num_inputs floats). Per 128-input chunk (a half chunk: 64)
// the layout holds the four outputs' packed weights (output i's at i * W, mlx's own packing:
// low nibble first), then 16 float16 scales and 16 biases, output i's block k at 4i + k.
void quad_row(const uint8_t* quads, int64_t id, int64_t num_inputs, int bits, float* y) {
  const QuadLayout layout = quad_layout(num_inputs, bits);
  const int64_t lane = id % 4;
  const uint8_t* quad = quads + id / 4 * layout.quad_bytes;
  for (int64_t j0 = 0; j0 < num_inputs; j0 += kInt8BlockInputs) {
    const int64_t c = j0 / kInt8ChunkInputs;
    const uint8_t* chunk = quad + c * layout.chunk_bytes;  // a half chunk follows the whole ones
    const int64_t weight_bytes = kInt8ChunkInputs * bits / 8 / (c == layout.num_whole_chunks ? 2 : 1);
    const int64_t block = j0 % kInt8ChunkInputs / kInt8BlockInputs;
    const uint8_t* w = chunk + lane * weight_bytes + block * kInt8BlockInputs * bits / 8;
    const auto* halves = reinterpret_cast<const uint16_t*>(chunk + 4 * weight_bytes);
    const float scale = half_to_float(halves[4 * lane + block]);
    const float bias = half_to_float(halves[16 + 4 * lane + block]);
    for (int64_t t = 0; t < kInt8BlockInputs; ++t) {
      const int q = bits == 4 ? (w[t / 2] >> (4 * (t % 2))) & 0xF : w[t];
      y[j0 + t] = scale * static_cast<float>(q) + bias;
    }
  }
}

template <typename T>
void rows_of(const mx::array& ids, const uint8_t* quads, int64_t num_outputs, int64_t num_inputs, int bits, float* y) {
  std::vector<T> copy;
  const T* id_data = row_major_data<T>(ids, copy);
  for (size_t n = 0; n < ids.size(); ++n) {
    const auto id = static_cast<int64_t>(id_data[n]);
    float* row = y + static_cast<int64_t>(n) * num_inputs;
    if (id < 0 || id >= num_outputs) {
      std::fill(row, row + num_inputs, 0.0f);
    } else {
      (tile_layout() ? tile_row : quad_row)(quads, id, num_inputs, bits, row);
    }
  }
}

}  // namespace

mx::array quad_rows(const mx::array& quads, const mx::array& ids, int num_outputs, int num_inputs, int bits) {
  check_layout_bits(bits);
  if (num_inputs <= 0 || num_inputs % kInt8BlockInputs != 0) {
    throw std::invalid_argument("quad_rows: num_inputs " + std::to_string(num_inputs) +
                                " is not a positive multiple of 32");
  }
  check_quad_layout(quads, num_outputs, num_inputs, bits, "quad_rows");
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32 && ids.dtype() != mx::int64) {
    throw std::invalid_argument("quad_rows: ids must be int32, uint32 or int64");
  }
  auto shape = ids.shape();
  shape.push_back(num_inputs);
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(std::move(shape), mx::float32, std::make_shared<QuadRows>(s, num_outputs, bits), {quads, ids});
}

void QuadRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y = arrays.outputs[0], num_outputs = num_outputs_, bits = bits_,
                    num_inputs = outputs[0].shape(-1)]() {
    const auto* quads = in[0].data<uint8_t>();
    const auto& ids = in[1];
    if (ids.dtype() == mx::int32) {
      rows_of<int32_t>(ids, quads, num_outputs, num_inputs, bits, y);
    } else if (ids.dtype() == mx::uint32) {
      rows_of<uint32_t>(ids, quads, num_outputs, num_inputs, bits, y);
    } else {
      rows_of<int64_t>(ids, quads, num_outputs, num_inputs, bits, y);
    }
  });
}

void QuadRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxQuadRows runs on the CPU only");
}

bool QuadRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuadRows&>(other);
  return num_outputs_ == o.num_outputs_ && bits_ == o.bits_;
}

}  // namespace gmlx_kernels
