#include "gguf_q6_k.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "encode.h"
#include "int8_dot_kernels.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int64_t kBlockBytes = 210;  // 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, float16 d
constexpr int64_t kBlockValues = 256;
constexpr int64_t kGroup = 32;

// float32 to float16, rounded to nearest even (numpy's astype(float16)).
uint16_t float_to_half(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0));
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 65520 and up: infinity
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24
    if (magnitude <= 0x33000000u) return static_cast<uint16_t>(sign);  // up to 2^-25 (a tie): zero
    const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u, shift = 126 - (magnitude >> 23);
    uint32_t units = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (units & 1u))) ++units;
    return static_cast<uint16_t>(sign | units);
  }
  uint32_t bits = (magnitude - 0x38000000u) >> 13;  // exponent rebiased from 127 to 15
  const uint32_t rest = magnitude & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (bits & 1u))) ++bits;
  return static_cast<uint16_t>(sign | bits);
}

// numpy's nextafter on a float16, toward -infinity (is_up false) or +infinity.
uint16_t next_half(uint16_t h, bool is_up) {
  if ((h & 0x7FFFu) > 0x7C00u) return h;  // NaN
  if ((h & 0x7FFFu) == 0) return is_up ? 0x0001u : 0x8001u;  // either zero: the smallest subnormal
  const bool is_negative = (h & 0x8000u) != 0;
  if (h == (is_up ? 0x7C00u : 0xFC00u)) return h;  // already that infinity
  return static_cast<uint16_t>(is_negative == is_up ? h - 1 : h + 1);
}

// A block's 256 values as the gguf package's dequantize gives them: (d * sc) * (q - 32) in
// float32. Value v of half h: low 4 bits in byte 64h + v % 64 (low nibble for v < 64), high 2
// bits at bit 2 (v / 32) of byte 32h + v % 32; sub-block scale (128h + v) / 16.
void q6_k_values(const uint8_t* block, float* values) {
  const auto* sub_scales = reinterpret_cast<const int8_t*>(block + 192);
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 208, sizeof(d_bits));
  const float d = half_to_float(d_bits);
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t* low = block + 64 * half;
    const uint8_t* high = block + 128 + 32 * half;
    for (int64_t quarter = 0; quarter < 4; ++quarter) {  // 32 values: one shift of the high bits
      const float scale_a = d * static_cast<float>(sub_scales[8 * half + 2 * quarter]);
      const float scale_b = d * static_cast<float>(sub_scales[8 * half + 2 * quarter + 1]);
      float* out = values + 128 * half + 32 * quarter;
      const uint8_t* low_bytes = low + 32 * (quarter % 2);
      const int low_shift = quarter < 2 ? 0 : 4, high_shift = 2 * static_cast<int>(quarter);
      for (int64_t l = 0; l < 32; ++l) {
        const int q = ((low_bytes[l] >> low_shift) & 0x0F) | (((high[l] >> high_shift) & 3) << 4);
        out[l] = (l < 16 ? scale_a : scale_b) * static_cast<float>(q - 32);
      }
    }
  }
}

// One group's 8-bit levels, scale and bias: gguf_blocks.requantized's steps in the same order.
void requantize_group(const float* values, uint8_t* levels, uint16_t* scale_out, uint16_t* bias_out) {
  float low = values[0], high = values[0];
  for (int64_t i = 1; i < kGroup; ++i) low = std::min(low, values[i]), high = std::max(high, values[i]);
  uint16_t bias = float_to_half(low);
  if (half_to_float(bias) > low) bias = next_half(bias, false);
  const float bias_f = half_to_float(bias);
  uint16_t scale = float_to_half((high - bias_f) / 255.0f);
  const float reach = half_to_float(scale) * 255.0f;
  if (reach + bias_f < high) scale = next_half(scale, true);
  const float step = (scale & 0x7FFFu) == 0 ? 1.0f : half_to_float(scale);
  constexpr float kRound = 8388608.0f;  // 2^23: adding and taking it off rounds [0, 2^23) half to even, as np.round
  for (int64_t i = 0; i < kGroup; ++i) {
    const float x = (values[i] - bias_f) / step;
    const float level = x < 255.0f ? (x + kRound) - kRound : 255.0f;
    levels[i] = x > 0.0f ? static_cast<uint8_t>(level) : 0;  // clipped to [0, 255]; NaN: 0
  }
  *scale_out = scale;
  *bias_out = bias;
}

struct RequantizeJob {
  const uint8_t* blocks;
  uint8_t* levels;
  uint16_t* scales;
  uint16_t* biases;
  int64_t blocks_per_row;
};

void requantize_row(void* context, int64_t row) {
  const auto& job = *static_cast<const RequantizeJob*>(context);
  float values[kBlockValues];
  for (int64_t b = 0; b < job.blocks_per_row; ++b) {
    const int64_t block = row * job.blocks_per_row + b;
    q6_k_values(job.blocks + block * kBlockBytes, values);
    for (int64_t g = 0; g < kBlockValues / kGroup; ++g) {
      const int64_t group = block * (kBlockValues / kGroup) + g;
      requantize_group(values + g * kGroup, job.levels + group * kGroup, job.scales + group, job.biases + group);
    }
  }
}

}  // namespace

std::vector<mx::array> requantize_q6_k(const mx::array& blocks) {
  if (blocks.dtype() != mx::uint8 || blocks.ndim() != 2 || blocks.shape(1) == 0 || blocks.shape(1) % kBlockBytes != 0) {
    throw std::invalid_argument("requantize_q6_k: blocks must be (rows, 210 x blocks) uint8");
  }
  const int rows = blocks.shape(0), num_blocks = blocks.shape(1) / kBlockBytes;
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{rows, num_blocks * 64}, {rows, num_blocks * 8}, {rows, num_blocks * 8}},
                                {mx::uint32, mx::float16, mx::float16}, std::make_shared<RequantizeQ6K>(s),
                                {mx::contiguous(blocks, false, s)});
}

void RequantizeQ6K::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);  // buffers typed float*, whatever they hold
  const auto& blocks = arrays.inputs[0];
  RequantizeJob job{blocks.data<uint8_t>(), reinterpret_cast<uint8_t*>(arrays.outputs[0]),
                    reinterpret_cast<uint16_t*>(arrays.outputs[1]), reinterpret_cast<uint16_t*>(arrays.outputs[2]),
                    blocks.shape(1) / kBlockBytes};
  encoder.dispatch([job, in = std::move(arrays.inputs)]() mutable {
    run_on_pool(requantize_row, &job, in[0].shape(0));
  });
}

void RequantizeQ6K::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxRequantizeQ6K runs on the CPU only");
}

}  // namespace gmlx_kernels
