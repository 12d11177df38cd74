// The bookkeeping every kernel op with float32 outputs does before it dispatches its work.
#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace gmlx_kernels {

struct EncodedArrays {
  std::vector<mlx::core::array> inputs;  // graph-detached copies, safe to capture in the dispatch
  std::vector<float*> outputs;  // each float32 output's fresh buffer
};

// Registers inputs and outputs with the encoder and allocates the (float32) outputs. Detached
// copies, as mlx's own CPU ops capture: an owning copy could drop a graph node's last
// reference on the scheduler thread while the main thread edits it.
inline EncodedArrays encode_arrays(mlx::core::cpu::CommandEncoder& encoder, const std::vector<mlx::core::array>& inputs,
                                   std::vector<mlx::core::array>& outputs) {
  EncodedArrays encoded;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    encoded.inputs.push_back(mlx::core::array::unsafe_weak_copy(a));
  }
  for (auto& y : outputs) {
    y.set_data(mlx::core::allocator::malloc(y.nbytes()));
    encoder.set_output_array(y);
    encoded.outputs.push_back(y.data<float>());
  }
  return encoded;
}

}  // namespace gmlx_kernels
