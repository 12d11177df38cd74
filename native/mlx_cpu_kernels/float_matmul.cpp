#include "float_matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "isa_target.h"
#include "qmm_kernels.h"
#include "quantized_matmul.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

// Inputs per k block: 16 KB of a panel, kept in L1 while every row of the call sweeps it.
// The accumulators go to memory between blocks (exact), so the chains are unchanged.
constexpr int64_t kBlockInputs = 64;

// Every output of acc (rows x 64, row stride 64) gets the fma chain of inputs k0..k1-1.
void block_portable(const float* x, int64_t num_rows, int64_t num_inputs, const float* panel, int64_t k0,
                    int64_t k1, float* acc) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* out = acc + r * kPanelOutputs;
    for (int64_t k = k0; k < k1; ++k) {
      const float xv = x[r * num_inputs + k];
      const float* w = panel + k * kPanelOutputs;
      for (int64_t j = 0; j < kPanelOutputs; ++j) out[j] = std::fma(xv, w[j], out[j]);
    }
  }
}

#if defined(GMLX_X86)
// One row's 64 outputs (8 chains in flight) over inputs k0..k1-1. Every row sweeps the whole
// panel width: the first row streams the block from DRAM, the others re-read it from L1.
// (Tiles of several rows by part of the width read each 256-byte panel row in 2-4 strided
// passes: 4 rows of 49152x576 cost 3.5x one row from DRAM, against 1.4x this way.)
// The first row prefetches the stream prefetch_bytes ahead (0: none), a panel row's 4 lines a step.
template <bool kIsPrefetching>
GMLX_AVX2 void row_avx2(const float* x, const float* panel, int64_t k0, int64_t k1, float* acc,
                        int64_t prefetch_bytes) {
  __m256 sums[8];
  for (int v = 0; v < 8; ++v) sums[v] = _mm256_loadu_ps(acc + 8 * v);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = panel + k * kPanelOutputs;
    if constexpr (kIsPrefetching) {
      const char* ahead = reinterpret_cast<const char*>(w) + prefetch_bytes;
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int v = 0; v < 8; ++v) sums[v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * v), sums[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(acc + 8 * v, sums[v]);
}

GMLX_AVX2 void block_avx2(const float* x, int64_t num_rows, int64_t num_inputs, const float* panel, int64_t k0,
                          int64_t k1, float* acc, int64_t prefetch_bytes) {
  for (int64_t r = 0; r < num_rows; ++r) {
    if (r == 0 && prefetch_bytes > 0) {
      row_avx2<true>(x, panel, k0, k1, acc, prefetch_bytes);
    } else {
      row_avx2<false>(x + r * num_inputs, panel, k0, k1, acc + r * kPanelOutputs, 0);
    }
  }
}
#endif

// One panel's outputs for every row: y (num_rows, y_stride), its first num_valid columns written.
void panel_rows(const float* x, int64_t num_rows, int64_t num_inputs, const float* panel, int64_t num_valid, float* y,
                int64_t y_stride, Isa isa) {
  thread_local std::vector<float> acc;  // one panel call at a time per thread
  acc.assign(num_rows * kPanelOutputs, 0.0f);
  const int64_t prefetch_bytes = panel_prefetch_bytes();
  for (int64_t k0 = 0; k0 < num_inputs; k0 += kBlockInputs) {
    const int64_t k1 = std::min(k0 + kBlockInputs, num_inputs);
#if defined(GMLX_X86)
    if (isa != Isa::kPortable) {
      block_avx2(x, num_rows, num_inputs, panel, k0, k1, acc.data(), prefetch_bytes);
      continue;
    }
#endif
    block_portable(x, num_rows, num_inputs, panel, k0, k1, acc.data());
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    std::copy(acc.data() + r * kPanelOutputs, acc.data() + r * kPanelOutputs + num_valid, y + r * y_stride);
  }
}

std::atomic<int64_t> g_panel_prefetch_bytes{-1};  // -1: the default
// 12 panel rows ahead: float32 decode 1.03-1.06x (SmolLM2) and 1.14x (a 120M model) on an Intel core
// (scripts/bench_kernel_settings.py); unmeasured elsewhere, so other CPUs leave the stream to the
// hardware prefetcher.
constexpr int64_t kIntelPanelPrefetchBytes = 3072;

int64_t num_panels(int64_t num_outputs) { return (num_outputs + kPanelOutputs - 1) / kPanelOutputs; }

struct PanelsJob {
  const float* x;
  int64_t num_rows, num_inputs;
  std::vector<PanelsPart> parts;
  std::vector<int64_t> first_chunk;  // per part, then the total
  int64_t panels_per_chunk;
  Isa isa;
};

void run_panels_chunk(void* context, int64_t chunk) {
  const auto* job = static_cast<const PanelsJob*>(context);
  size_t p = 0;
  while (chunk >= job->first_chunk[p + 1]) ++p;
  const PanelsPart& part = job->parts[p];
  const int64_t begin = (chunk - job->first_chunk[p]) * job->panels_per_chunk;
  const int64_t end = std::min(begin + job->panels_per_chunk, num_panels(part.num_outputs));
  for (int64_t i = begin; i < end; ++i) {
    panel_rows(job->x, job->num_rows, job->num_inputs, part.panels + i * job->num_inputs * kPanelOutputs,
               std::min(kPanelOutputs, part.num_outputs - i * kPanelOutputs), part.y + i * kPanelOutputs,
               part.num_outputs, job->isa);
  }
}

// AVX-512 CPUs run the AVX2 kernel: a decode row reads weights faster than DRAM delivers them
// either way, and the chains (hence the bits) are the same.
Isa float_isa() { return kernels_isa() == Isa::kPortable ? Isa::kPortable : Isa::kAvx2; }

}  // namespace

void panels_products(const float* x, int64_t num_rows, int64_t num_inputs, const std::vector<PanelsPart>& parts) {
  PanelsJob job{x, num_rows, num_inputs, parts, {0}, 1, float_isa()};
  int64_t total_panels = 0, num_outputs = 0;
  for (const auto& part : parts) total_panels += num_panels(part.num_outputs), num_outputs += part.num_outputs;
  // About eight chunks a thread: a claim is a cache line passed between cores, a panel of a
  // 576-input row ~150 KB of weights.
  job.panels_per_chunk = std::max<int64_t>(1, total_panels / (8 * pool_num_threads()));
  for (const auto& part : parts) {
    const int64_t num_chunks = (num_panels(part.num_outputs) + job.panels_per_chunk - 1) / job.panels_per_chunk;
    job.first_chunk.push_back(job.first_chunk.back() + num_chunks);
  }
  run_sized(run_panels_chunk, &job, job.first_chunk.back(), num_rows * num_outputs * num_inputs);
}

void set_panel_prefetch_bytes(int64_t num_bytes) { g_panel_prefetch_bytes.store(num_bytes < 0 ? -1 : num_bytes); }

int64_t panel_prefetch_bytes() {
  const int64_t setting = g_panel_prefetch_bytes.load(std::memory_order_relaxed);
  return setting >= 0 ? setting : is_intel_cpu() ? kIntelPanelPrefetchBytes : 0;
}

void check_panel_layout(const mx::array& panels, int64_t num_outputs, int64_t num_inputs, const std::string& what) {
  if (panels.dtype() != mx::float32 || panels.ndim() != 3 || panels.shape(0) != num_panels(num_outputs) ||
      panels.shape(1) != num_inputs || panels.shape(2) != kPanelOutputs) {
    throw std::invalid_argument(what + ": panels must be float32 (" + std::to_string(num_panels(num_outputs)) + ", " +
                                std::to_string(num_inputs) + ", 64), the panel layout of " +
                                std::to_string(num_outputs) + " outputs");
  }
}

mx::array float_matmul(const mx::array& x, const mx::array& panels, int num_outputs) {
  if (x.ndim() < 1 || x.shape(-1) == 0) throw std::invalid_argument("float_matmul: x needs a non-empty last dim");
  if (num_outputs < 1) throw std::invalid_argument("float_matmul: num_outputs must be positive");
  check_panel_layout(panels, num_outputs, x.shape(-1), "float_matmul");
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape out_shape = x.shape();
  out_shape.back() = num_outputs;
  return mx::array(out_shape, mx::float32, std::make_shared<FloatMatmul>(s), {as_dtype(x, mx::float32, s), panels});
}

void FloatMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y = arrays.outputs[0], num_outputs = outputs[0].shape(-1)]() {
    std::vector<float> x_copy, panels_copy;
    const float* x = row_major_data<float>(in[0], x_copy);
    const float* panels = row_major_data<float>(in[1], panels_copy);
    const int64_t num_inputs = in[0].shape(-1);
    panels_products(x, in[0].size() / num_inputs, num_inputs, {{panels, num_outputs, y}});
  });
}

void FloatMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxFloatMatmul runs on the CPU only");
}

}  // namespace gmlx_kernels
