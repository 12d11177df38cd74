// Per-token logprobs as one MLX primitive: each row's log-softmax at its sampled token and the
// row's likeliest tokens, without the log-softmax row itself (a 49k-entry vocabulary took ~2 ms a
// position in mlx's CPU ops: a scalar exp per entry, a partition over the whole row).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// For float32 logits (N, V) and int32 tokens (N,), each in [0, V): [chosen (N,) float32: logits[n,
// token] - lse(n), top_ids (N, K) int32, top_logprobs (N, K) float32], the K >= 1 likeliest of each
// row, most likely first, ties by lower id. lse(n) = max + log(sum of e^(x - max)), the sum over 16
// lanes (lane i % 16, in i order) and a fixed tree: a row's bits depend on that row alone.
std::vector<mx::array> token_logprobs(const mx::array& logits, const mx::array& tokens, int num_top);

class TokenLogprobs : public mx::Primitive {
 public:
  TokenLogprobs(mx::Stream stream, int num_top) : mx::Primitive(stream), num_top_(num_top) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxTokenLogprobs"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int num_top_;
};

}  // namespace gmlx_kernels
