#include "quantized_matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "huge_pages.h"
#include "int8_dot_kernels.h"
#include "qmm_kernels.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

std::atomic<Isa> g_isa{best_isa()};
// Calls with at least this many rows run the panel kernels (same bits, blocked for many
// rows). Measured on Zen 4, weights from DRAM: the panel path wins from 7 rows (1.2-1.5x),
// from 8 rows by 1.4-2.3x; at 2-5 rows the few-row kernels win.
constexpr int64_t kDefaultPanelMinRows = 8;
std::atomic<int64_t> g_panel_min_rows{kDefaultPanelMinRows};

// Outputs per chunk a thread takes: a few KB of weights each, many chunks per thread.
constexpr int64_t kOutputsPerChunk = kMaxOutputsPerCall;

struct QmmJob {
  QmmArgs args;
  const float* x_blocked;
  int64_t block;
  Isa isa;
  int64_t num_padded_rows;  // panel path: rows of x_blocked (in lane order, zero past num_rows)
  int64_t outputs_per_chunk;  // panel path
  QuantizedRows* quantized_rows;  // int8 path: x quantized (run_quantize_chunk)
};

void run_qmm_chunk(void* context, int64_t chunk) {
  auto* job = static_cast<QmmJob*>(context);
  int64_t begin = chunk * kOutputsPerChunk;
  int64_t end = std::min(begin + kOutputsPerChunk, job->args.num_outputs);
  qmm_outputs(job->args, job->x_blocked, job->block, begin, end, job->isa);
}

void run_panel_chunk(void* context, int64_t chunk) {
  auto* job = static_cast<QmmJob*>(context);
  int64_t begin = chunk * job->outputs_per_chunk;
  int64_t end = std::min(begin + job->outputs_per_chunk, job->args.num_outputs);
  qmm_panel_outputs(job->args, job->x_blocked, job->num_padded_rows, begin, end, job->isa);
}

// Products under this many multiply-adds run on the caller: a k or v projection of one row
// (110K) is ~5 us, about what a hand-off to a worker costs. Since workers poll with
// yields (thread_pool.cpp) every SmolLM2 product from an o_proj (330K) up pays on two
// threads: 1.15x the step against one thread, where a pure spin lost 0.88x to it.
constexpr int64_t kDefaultMinPoolMacs = int64_t{1} << 18;
std::atomic<int64_t> g_min_pool_macs{kDefaultMinPoolMacs};

void run_chunks(ThreadPool::ChunkFn fn, QmmJob& job, int64_t num_chunks) {
  run_sized(fn, &job, num_chunks, job.args.num_rows * job.args.num_outputs * job.args.num_inputs);
}

// Chunks per pool thread the int8 path splits a product's outputs into.
constexpr int64_t kInt8ChunksPerThread = 4;

// Rows of x each chunk of the int8-activation path quantizes.
constexpr int64_t kRowsPerQuantizeChunk = 8;

void run_quantize_chunk(void* context, int64_t chunk) {
  auto* job = static_cast<QmmJob*>(context);
  const int64_t begin = chunk * kRowsPerQuantizeChunk;
  const int64_t end = std::min(begin + kRowsPerQuantizeChunk, job->args.num_rows);
  quantize_rows(job->args.x, job->args.num_inputs, begin, end, job->args.bits, *job->quantized_rows);
}

// A few chunks per thread, whole multiples of 16 outputs: a claim costs a cache line passed
// between cores (~0.3 us), a 16-output chunk of a 576-input row ~0.5 us of work. Output bits
// do not depend on the chunking.
int64_t int8_outputs_per_chunk(int64_t num_outputs) {
  const int64_t num_parts = kInt8ChunksPerThread * pool_num_threads();
  const int64_t per_part = (num_outputs + num_parts - 1) / num_parts;
  return std::max<int64_t>(1, (per_part + kOutputsPerChunk - 1) / kOutputsPerChunk) * kOutputsPerChunk;
}

// The int8 path for one or more products of one x (q/k/v, gate/up), each over its own
// weights (plain rows or the quad layout): x quantized once, then every part's outputs in
// chunks of one pool job. Each part's bits are those of a call of its own.
struct Int8Job {
  std::vector<QmmArgs> parts;  // one x, rows, inputs and bits
  std::vector<int64_t> first_chunk;  // per part, then the total
  int64_t outputs_per_chunk = kOutputsPerChunk;
  QuantizedRows* quantized_rows = nullptr;
  Isa isa = Isa::kPortable;
};

void run_int8_chunk(void* context, int64_t chunk) {
  auto* job = static_cast<Int8Job*>(context);
  size_t p = 0;
  while (chunk >= job->first_chunk[p + 1]) ++p;
  const QmmArgs& args = job->parts[p];
  const int64_t begin = (chunk - job->first_chunk[p]) * job->outputs_per_chunk;
  int8_dot_outputs(args, *job->quantized_rows, begin, std::min(begin + job->outputs_per_chunk, args.num_outputs),
                   job->isa);
}

void run_int8_parts(Int8Job& job) {
  QmmJob quantize;  // the first part's x, rows and bits: every part's
  quantize.args = job.parts[0];
  // The tile layout pairs a vector with four consecutive inputs: x in its own order (8 bits').
  if (quantize.args.quads != nullptr && tile_layout()) quantize.args.bits = 8;
  // Reused across calls (a decode step makes ~200): this thread runs one product at a time,
  // and the pool is done with the buffers before run_on_pool returns.
  thread_local QuantizedRows rows;
  resize_quantized_rows(rows, quantize.args.num_rows, quantize.args.num_inputs);
  quantize.quantized_rows = job.quantized_rows = &rows;
  const int64_t num_quantize_chunks = (quantize.args.num_rows + kRowsPerQuantizeChunk - 1) / kRowsPerQuantizeChunk;
  if (num_quantize_chunks == 1) {
    run_quantize_chunk(&quantize, 0);  // decode's few rows: not worth waking the pool
  } else {
    run_on_pool(run_quantize_chunk, &quantize, num_quantize_chunks);
  }
  int64_t num_outputs = 0;
  for (const auto& part : job.parts) num_outputs += part.num_outputs;
  job.outputs_per_chunk = int8_outputs_per_chunk(num_outputs);
  job.first_chunk = {0};
  for (const auto& part : job.parts) {
    const int64_t num_chunks = (part.num_outputs + job.outputs_per_chunk - 1) / job.outputs_per_chunk;
    job.first_chunk.push_back(job.first_chunk.back() + num_chunks);
  }
  run_sized(run_int8_chunk, &job, job.first_chunk.back(),
            quantize.args.num_rows * num_outputs * quantize.args.num_inputs);
}

// Activations quantized once per call, then integer dots: the same path at every row count.
void run_int8(QmmJob& job) {
  Int8Job int8_job;
  int8_job.parts = {job.args};
  int8_job.isa = job.isa;
  run_int8_parts(int8_job);
}

// Many rows: x in lane order as one block, padded with zero rows to whole tiles.
void run_panel(QmmJob& job) {
  const QmmArgs& a = job.args;
  const int64_t multiple = panel_row_multiple(job.isa);
  job.num_padded_rows = (a.num_rows + multiple - 1) / multiple * multiple;
  std::vector<float> x_lanes;
  if (a.bits == 8 && job.num_padded_rows == a.num_rows) {
    job.x_blocked = a.x;  // already in lane order, whole tiles
  } else {
    x_lanes.resize(job.num_padded_rows * a.num_inputs);
    block_rows(a, a.num_inputs, x_lanes.data());
    std::fill(x_lanes.begin() + a.num_rows * a.num_inputs, x_lanes.end(), 0.0f);
    job.x_blocked = x_lanes.data();
  }
  job.outputs_per_chunk = panel_outputs_per_chunk(a.num_inputs, job.isa);
  run_on_pool(run_panel_chunk, &job, (a.num_outputs + job.outputs_per_chunk - 1) / job.outputs_per_chunk);
}

Isa parse_isa(const std::string& name) {
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "portable") return Isa::kPortable;
  throw std::invalid_argument("isa " + name + ": expected avx512, avx2 or portable");
}

}  // namespace

void run_sized(ThreadPool::ChunkFn fn, void* context, int64_t num_chunks, int64_t num_macs) {
  if (num_macs < g_min_pool_macs.load(std::memory_order_relaxed)) {
    for (int64_t i = 0; i < num_chunks; ++i) fn(context, i);
  } else {
    run_on_pool(fn, context, num_chunks);
  }
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool int8_activations) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits " + std::to_string(bits) + ": expected 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("group_size " + std::to_string(group_size) + ": expected 32, 64 or 128");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) {
    throw std::invalid_argument("quantized_matmul: x needs >= 1 dims, w, scales and biases 2");
  }
  const int num_inputs = x.shape(-1);
  const int num_outputs = w.shape(0);
  if (num_inputs == 0) throw std::invalid_argument("quantized_matmul: x has no inputs (last dim 0)");
  if (w.dtype() != mx::uint32 || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(num_inputs) * bits) {
    throw std::invalid_argument("quantized_matmul: w must be uint32 (out, K * bits / 32) for x (..., K)");
  }
  const mx::Shape group_shape = {num_outputs, num_inputs / group_size};
  if (num_inputs % group_size != 0 || scales.shape() != group_shape || biases.shape() != group_shape) {
    throw std::invalid_argument("quantized_matmul: scales and biases must be (out, K / group_size)");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  // The int8 path reads float16 scales and biases as they are (a GGUF's Q4_1 d and m: fewer
  // bytes per weight, the same values); the float path takes float32.
  const bool is_half_groups = int8_activations && scales.dtype() == mx::float16 && biases.dtype() == mx::float16;
  mx::Shape out_shape = x.shape();
  out_shape.back() = num_outputs;
  return mx::array(out_shape, mx::float32, std::make_shared<QuantizedMatmul>(s, group_size, bits, int8_activations, false),
                   {as_dtype(x, mx::float32, s), w, is_half_groups ? scales : as_dtype(scales, mx::float32, s),
                    is_half_groups ? biases : as_dtype(biases, mx::float32, s)});
}

void check_quad_layout(const mx::array& quads, int64_t num_outputs, int64_t num_inputs, int bits,
                       const std::string& what) {
  if (quads.dtype() != mx::uint8 || quads.ndim() != 1 || !is_layout_bits(bits) ||
      (is_k_layout(bits) && num_inputs % kSuperBlockInputs != 0) ||
      static_cast<int64_t>(quads.size()) != quad_layout_bytes(num_outputs, num_inputs, bits)) {
    throw std::invalid_argument(what + ": quads must be the uint8 layout of " + std::to_string(num_outputs) +
                                " outputs x " + std::to_string(num_inputs) + " inputs (pack_quads)");
  }
}

std::vector<mx::array> quantized_matmul_quads_group(const mx::array& x, const std::vector<mx::array>& quads,
                                                   const std::vector<int>& num_outputs, int bits) {
  check_layout_bits(bits);
  if (x.ndim() < 1 || x.shape(-1) == 0 || x.shape(-1) % kInt8BlockInputs != 0) {
    throw std::invalid_argument("quantized_matmul_quads: x needs a last dim that is a positive multiple of 32");
  }
  if (quads.empty() || quads.size() != num_outputs.size()) {
    throw std::invalid_argument("quantized_matmul_quads: one output count per quads array, at least one");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {as_dtype(x, mx::float32, s)};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < quads.size(); ++i) {
    check_quad_layout(quads[i], num_outputs[i], x.shape(-1), bits, "quantized_matmul_quads");
    inputs.push_back(quads[i]);
    shapes.push_back(x.shape());
    shapes.back().back() = num_outputs[i];
  }
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(quads.size(), mx::float32),
                                std::make_shared<QuantizedMatmul>(s, kInt8BlockInputs, bits, true, true), inputs);
}

mx::array quantized_matmul_quads(const mx::array& x, const mx::array& quads, int num_outputs, int bits) {
  return quantized_matmul_quads_group(x, {quads}, {num_outputs}, bits)[0];
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (is_quads_) return eval_quads(inputs, outputs);
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  const auto& scales = inputs[2];
  const auto& biases = inputs[3];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(y);
  // Graph-detached copies, as mlx's own CPU ops capture: an owning copy could drop a
  // graph node's last reference on the scheduler thread while the main thread edits it.
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                    scales = mx::array::unsafe_weak_copy(scales), biases = mx::array::unsafe_weak_copy(biases),
                    y_data = y.data<float>(), group_size = group_size_, bits = bits_,
                    int8_activations = int8_activations_]() {
    std::vector<float> x_copy, scales_copy, biases_copy;
    std::vector<uint32_t> w_copy;
    std::vector<mx::float16_t> scales_f16_copy, biases_f16_copy;
    QmmJob job;
    job.args.x = row_major_data<float>(x, x_copy);
    job.args.w = row_major_data<uint32_t>(w, w_copy);
    if (scales.dtype() == mx::float16) {  // the int8 path only (quantized_matmul above)
      job.args.scales_f16 = reinterpret_cast<const uint16_t*>(row_major_data<mx::float16_t>(scales, scales_f16_copy));
      job.args.biases_f16 = reinterpret_cast<const uint16_t*>(row_major_data<mx::float16_t>(biases, biases_f16_copy));
    } else {
      job.args.scales = row_major_data<float>(scales, scales_copy);
      job.args.biases = row_major_data<float>(biases, biases_copy);
    }
    job.args.y = y_data;
    job.args.num_inputs = x.shape(-1);
    job.args.num_rows = x.size() / x.shape(-1);
    job.args.num_outputs = w.shape(0);
    job.args.group_size = group_size;
    job.args.bits = bits;
    job.isa = g_isa.load();
    if (int8_activations) return run_int8(job);
    if (job.isa != Isa::kPortable && job.args.num_rows >= g_panel_min_rows.load()) return run_panel(job);
    job.block = inputs_per_block(job.args.num_rows, job.args.num_inputs, group_size);
    std::vector<float> x_blocked;
    if (job.block == job.args.num_inputs && bits == 8) {
      job.x_blocked = job.args.x;  // one block, in order: already as the kernels read it
    } else {
      x_blocked.resize(job.args.num_rows * job.args.num_inputs);
      block_rows(job.args, job.block, x_blocked.data());
      job.x_blocked = x_blocked.data();
    }
    int64_t num_chunks = (job.args.num_outputs + kOutputsPerChunk - 1) / kOutputsPerChunk;
    run_chunks(run_qmm_chunk, job, num_chunks);
  });
}

void quads_products(const float* x, int64_t num_rows, int64_t num_inputs, int bits, const std::vector<QuadsPart>& parts) {
  Int8Job job;
  job.isa = g_isa.load();
  for (const auto& part : parts) {
    QmmArgs args;
    args.x = x;
    args.w = nullptr;
    args.scales = args.biases = nullptr;
    args.quads = part.quads;
    args.y = part.y;
    args.num_inputs = num_inputs;
    args.num_rows = num_rows;
    args.num_outputs = part.num_outputs;
    args.group_size = kInt8BlockInputs;  // values repeated per block in the layout
    args.bits = bits;
    job.parts.push_back(args);
  }
  run_int8_parts(job);
}

void QuantizedMatmul::eval_quads(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  std::vector<int64_t> num_outputs;
  for (const auto& y : outputs) num_outputs.push_back(y.shape(-1));
  encoder.dispatch([inputs = std::move(arrays.inputs), y_data = std::move(arrays.outputs),
                    num_outputs = std::move(num_outputs), bits = bits_]() {
    const auto& x = inputs[0];
    std::vector<float> x_copy;
    std::vector<QuadsPart> parts;
    for (size_t i = 0; i + 1 < inputs.size(); ++i) {
      parts.push_back({inputs[i + 1].data<uint8_t>(), num_outputs[i], y_data[i]});  // 1-D, so row-major
    }
    quads_products(row_major_data<float>(x, x_copy), x.size() / x.shape(-1), x.shape(-1), bits, parts);
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxQuantizedMatmul runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && int8_activations_ == o.int8_activations_ &&
         is_quads_ == o.is_quads_;
}

void set_isa(const std::string& name) {
  Isa isa = parse_isa(name);
  if (!is_isa_supported(isa)) throw std::invalid_argument("isa " + name + ": this CPU does not support it");
  g_isa.store(isa);
}

Isa kernels_isa() { return g_isa.load(); }

void set_panel_min_rows(int64_t num_rows) {
  g_panel_min_rows.store(num_rows < 1 ? kDefaultPanelMinRows : num_rows);
}
int64_t panel_min_rows() { return g_panel_min_rows.load(); }

void set_min_pool_macs(int64_t num_macs) { g_min_pool_macs.store(num_macs < 0 ? kDefaultMinPoolMacs : num_macs); }
int64_t min_pool_macs() { return g_min_pool_macs.load(); }

std::string current_isa() { return isa_name(g_isa.load()); }
std::string best_isa_name() { return isa_name(best_isa()); }

namespace {
struct SumJob {
  const float* data;
  int64_t floats_per_chunk;
  Isa isa;
  std::vector<float> sums;  // one per chunk, so the compiler cannot drop the loads
};
void run_sum_chunk(void* context, int64_t chunk) {
  auto* job = static_cast<SumJob*>(context);
  job->sums[chunk] = sum_floats(job->data + chunk * job->floats_per_chunk, job->floats_per_chunk, job->isa);
}
}  // namespace

// A buffer on 2 MB pages where Linux grants them, as gmlx's weights are (gmlx/platform/memory.py):
// on 4 KB pages the sum pays a TLB miss every 4 KB and understates what memory can deliver.
class HugePageFloats {
 public:
  explicit HugePageFloats(int64_t num_floats) : num_bytes_(num_floats * sizeof(float) + kHugePageBytes) {
#if defined(__linux__)
    void* mapped = mmap(nullptr, num_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) throw std::runtime_error("read_bandwidth: mmap failed");
    mapped_ = mapped;
    auto address = reinterpret_cast<uintptr_t>(mapped);
    data_ = reinterpret_cast<float*>((address + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes);
    advise_huge_pages(data_, num_floats * sizeof(float));
#else
    fallback_.resize(num_floats);
    data_ = fallback_.data();
#endif
    std::fill(data_, data_ + num_floats, 1.0f);  // touched: pages mapped
  }
  ~HugePageFloats() {
#if defined(__linux__)
    munmap(mapped_, num_bytes_);
#endif
  }
  HugePageFloats(const HugePageFloats&) = delete;
  HugePageFloats& operator=(const HugePageFloats&) = delete;
  float* data() { return data_; }

 private:
  int64_t num_bytes_;
  void* mapped_ = nullptr;
  float* data_ = nullptr;
  std::vector<float> fallback_;
};

double read_bandwidth(int64_t num_bytes, int num_passes) {
  constexpr int64_t kChunkBytes = 1 << 20;
  int64_t num_chunks = std::max<int64_t>(1, num_bytes / kChunkBytes);
  HugePageFloats buffer(num_chunks * kChunkBytes / sizeof(float));
  SumJob job{buffer.data(), kChunkBytes / static_cast<int64_t>(sizeof(float)), g_isa.load(),
             std::vector<float>(num_chunks)};
  double best_s = 1e30;
  for (int pass = 0; pass < std::max(1, num_passes); ++pass) {
    auto start = std::chrono::steady_clock::now();
    run_on_pool(run_sum_chunk, &job, num_chunks);
    std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    best_s = std::min(best_s, elapsed.count());
  }
  volatile float sink = job.sums[0];
  (void)sink;
  return static_cast<double>(num_chunks * kChunkBytes) / best_s / 1e9;
}

}  // namespace gmlx_kernels
