// Row kernels of the trainable experts (training_experts.h): between the grouped GEMMs of ep_comm/training_experts.py,
// where torch needed a mask, a mixed-dtype multiply, a transposed copy and separate quantize / dequantize passes per
// tensor (measured on one H200 at 33760 x 7168 rows: ~10 ms of a 34 ms forward + backward, bench/RESULTS.md).
#include <cuda_bf16.h>

#include "quant_math.cuh"
#include "training_experts.h"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

using Bf16 = vec::Elem<__nv_bfloat16>;

__device__ __forceinline__ bool row_in_use(const int32_t* src_rank, int64_t row) {
  return src_rank == nullptr || __ldg(src_rank + row) >= 0;
}

// The MXFP8 round trip of one block of 32 values: encode (stochastic, element j drawing the random bits of
// index0 + j), then decode as the dequantize kernel does (the pair decode times 2^(scale - 127), in fp32).
__device__ __forceinline__ void mxfp8_round_trip32(float v[32], uint32_t key, int64_t index0) {
  uint32_t words[8];
  const uint8_t scale = qm::mxfp8_encode32_stochastic(v, key, index0, words);
  const float multiplier = qm::ue8m0_to_float(scale);
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    qm::e4m3x2_decode(static_cast<uint16_t>(words[w] & 0xFFFFu), v[4 * w], v[4 * w + 1]);
    qm::e4m3x2_decode(static_cast<uint16_t>(words[w] >> 16), v[4 * w + 2], v[4 * w + 3]);
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = qm::qm_mul(v[j], multiplier);
}

// A CTA takes 32 rows x 256 columns: loads them once into shared memory (zeros for rows not in use or past R), then
// thread t encodes the row block (row t / 8, columns 32 (t % 8) ..) and the token block (column t, the 32 rows).
constexpr int kTileRows = 32;
constexpr int kTileCols = 256;
constexpr int kTilePad = 8;  // (a row of the tile is 528 bytes: the row-block reads of a warp spread over the banks)
constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) mxfp8_round_trips_kernel(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ src_rank, int64_t num_rows, int64_t hidden,
    int64_t padded_rows, uint32_t key_rows, uint32_t key_tokens, const uint64_t* __restrict__ seed_rows_on_device,
    const uint64_t* __restrict__ seed_tokens_on_device, uint16_t* __restrict__ rows_out,
    uint16_t* __restrict__ tokens_out) {
  __shared__ __align__(16) uint16_t tile[kTileRows][kTileCols + kTilePad];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const int cols = static_cast<int>(hidden - c0 < kTileCols ? hidden - c0 : kTileCols);  // a multiple of 32
  constexpr int kVecsPerRow = kTileCols / 8;
  for (int v = threadIdx.x; v < kTileRows * kVecsPerRow; v += kThreads) {
    const int row = v / kVecsPerRow, column = (v % kVecsPerRow) * 8;
    const int64_t r = r0 + row;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (column < cols && r < num_rows && row_in_use(src_rank, r)) value = vec::load16(x + r * hidden + c0 + column);
    *reinterpret_cast<uint4*>(&tile[row][column]) = value;
  }
  __syncthreads();
  if (rows_out != nullptr) {
    const int row = threadIdx.x / (kTileCols / 32), column = (threadIdx.x % (kTileCols / 32)) * 32;
    const int64_t r = r0 + row;
    if (r < num_rows && column < cols) {
      float v[32];
#pragma unroll
      for (int q = 0; q < 4; ++q) Bf16::unpack(*reinterpret_cast<const uint4*>(&tile[row][column + 8 * q]), v + 8 * q);
      mxfp8_round_trip32(v, qm::sr_key_of(key_rows, seed_rows_on_device), r * hidden + c0 + column);
      uint16_t* dst = rows_out + r * hidden + c0 + column;
#pragma unroll
      for (int q = 0; q < 4; ++q) vec::store16(dst + 8 * q, Bf16::pack(v + 8 * q));
    }
  }
  if (tokens_out != nullptr && threadIdx.x < cols) {
    float v[32];
#pragma unroll
    for (int i = 0; i < kTileRows; ++i) v[i] = __uint_as_float(static_cast<uint32_t>(tile[i][threadIdx.x]) << 16);
    const int64_t k = c0 + threadIdx.x;
    mxfp8_round_trip32(v, qm::sr_key_of(key_tokens, seed_tokens_on_device), k * padded_rows + r0);
    uint16_t* dst = tokens_out + k * padded_rows + r0;
#pragma unroll
    for (int q = 0; q < 4; ++q) vec::store16(dst + 8 * q, Bf16::pack(v + 8 * q));
  }
}

// The elementwise row kernels: one thread per 8 columns of a row, grid-strided.
constexpr int kRowThreads = 256;

__device__ __forceinline__ float silu_f32(float g) {  // torch's CUDA silu: x / (1 + exp(-x)), exp the full expf
  return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
}

__global__ void __launch_bounds__(kRowThreads) swiglu_rows_kernel(const uint16_t* __restrict__ gate_up,
                                                                  const float* __restrict__ factor,
                                                                  const int32_t* __restrict__ src_rank,
                                                                  int64_t num_rows, int64_t intermediate,
                                                                  int64_t padded_rows, float* __restrict__ out) {
  const int64_t chunks_per_row = intermediate / 8;
  const int64_t total = padded_rows * chunks_per_row;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * kRowThreads) {
    const int64_t row = c / chunks_per_row, i = (c - row * chunks_per_row) * 8;
    float y[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (row < num_rows && row_in_use(src_rank, row)) {
      float g[8], u[8];
      Bf16::unpack(vec::load16(gate_up + row * 2 * intermediate + i), g);
      Bf16::unpack(vec::load16(gate_up + row * 2 * intermediate + intermediate + i), u);
      const float f = __ldg(factor + row);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(silu_f32(__fmul_rn(g[j], f)), __fmul_rn(u[j], f));
    }
    float* dst = out + row * intermediate + i;
    vec::store16(dst, vec::Elem<float>::pack(y));
    vec::store16(dst + 4, vec::Elem<float>::pack(y + 4));
  }
}

__global__ void __launch_bounds__(kRowThreads) swiglu_backward_rows_kernel(
    const uint16_t* __restrict__ d_hidden, const float* __restrict__ d_factor, const uint16_t* __restrict__ gate_up,
    const float* __restrict__ factor, const int32_t* __restrict__ src_rank, int64_t num_rows, int64_t intermediate,
    uint16_t* __restrict__ d_gate_up) {
  const int64_t chunks_per_row = intermediate / 8;
  const int64_t total = num_rows * chunks_per_row;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * kRowThreads) {
    const int64_t row = c / chunks_per_row, i = (c - row * chunks_per_row) * 8;
    float d_gate[8] = {0, 0, 0, 0, 0, 0, 0, 0}, d_up[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (row_in_use(src_rank, row)) {
      float dh[8], g[8], u[8];
      Bf16::unpack(vec::load16(d_hidden + row * intermediate + i), dh);
      Bf16::unpack(vec::load16(gate_up + row * 2 * intermediate + i), g);
      Bf16::unpack(vec::load16(gate_up + row * 2 * intermediate + intermediate + i), u);
      const float df = __ldg(d_factor + row), f = __ldg(factor + row);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float h = __fmul_rn(dh[j], df), gate = __fmul_rn(g[j], f), up = __fmul_rn(u[j], f);
        const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate)));  // torch's CUDA sigmoid
        const float slope = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gate, __fsub_rn(1.0f, sig))));
        d_gate[j] = __fmul_rn(__fmul_rn(h, up), slope);
        d_up[j] = __fmul_rn(h, __fmul_rn(gate, sig));
      }
    }
    vec::store16(d_gate_up + row * 2 * intermediate + i, Bf16::pack(d_gate));
    vec::store16(d_gate_up + row * 2 * intermediate + intermediate + i, Bf16::pack(d_up));
  }
}

__global__ void __launch_bounds__(kRowThreads) scale_rows_kernel(uint16_t* __restrict__ x,
                                                                 const float* __restrict__ factor,
                                                                 const int32_t* __restrict__ src_rank,
                                                                 int64_t num_rows, int64_t hidden) {
  const int64_t chunks_per_row = hidden / 8;
  const int64_t total = num_rows * chunks_per_row;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * kRowThreads) {
    const int64_t row = c / chunks_per_row, i = (c - row * chunks_per_row) * 8;
    float y[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint16_t* p = x + row * hidden + i;
    if (row_in_use(src_rank, row)) {
      Bf16::unpack(*reinterpret_cast<const uint4*>(p), y);
      const float f = __ldg(factor + row);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(y[j], f);
    }
    vec::store16(p, Bf16::pack(y));
  }
}

// Two 16-byte vectors of bf16 per thread per step (loads issued before the stores).
__global__ void __launch_bounds__(kRowThreads) widen_bf16_kernel(const uint16_t* __restrict__ x,
                                                                 float* __restrict__ out, int64_t num_vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; v < num_vectors; v += 2 * stride) {
    const bool second = v + stride < num_vectors;
    const uint4 a = vec::load16(x + 8 * v);
    const uint4 b = second ? vec::load16(x + 8 * (v + stride)) : make_uint4(0, 0, 0, 0);
    float y[8];
    Bf16::unpack(a, y);
    vec::store16(out + 8 * v, vec::Elem<float>::pack(y));
    vec::store16(out + 8 * v + 4, vec::Elem<float>::pack(y + 4));
    if (second) {
      Bf16::unpack(b, y);
      vec::store16(out + 8 * (v + stride), vec::Elem<float>::pack(y));
      vec::store16(out + 8 * (v + stride) + 4, vec::Elem<float>::pack(y + 4));
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int64_t row_grid(int64_t chunks) {  // grid-strided: enough CTAs to fill the GPU several times, no more
  const int64_t grid = ceil_div(chunks, kRowThreads);
  return grid < 65536 ? grid : 65536;
}

__global__ void mix_seeds_kernel(SeedMixArgs args) {
  uint64_t in = *args.in;
  if (args.increment_in) *args.in = ++in;
  for (int j = 0; j < args.count; ++j) args.out[j] = qm::mix64(in ^ args.xor_values[j]);
}

}  // namespace

cudaError_t launch_mix_seeds(const SeedMixArgs& args, cudaStream_t stream) {
  if (args.count < 0 || args.count > kMaxMixedSeeds) return cudaErrorInvalidValue;
  if (args.in == nullptr || (args.count > 0 && args.out == nullptr)) return cudaErrorInvalidValue;
  if (args.count > 0 && args.out < args.in + 1 && args.in < args.out + args.count) return cudaErrorInvalidValue;
  mix_seeds_kernel<<<1, 1, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_mxfp8_round_trips(const uint16_t* x, const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                     int64_t padded_rows, uint64_t seed_rows, uint64_t seed_tokens,
                                     const uint64_t* seed_rows_on_device, const uint64_t* seed_tokens_on_device,
                                     uint16_t* rows_out, uint16_t* tokens_out, cudaStream_t stream) {
  if (num_rows < 0 || hidden <= 0 || hidden % 32 != 0 || padded_rows < num_rows || padded_rows % 32 != 0) {
    return cudaErrorInvalidValue;
  }
  if (padded_rows == 0 || (rows_out == nullptr && tokens_out == nullptr)) return cudaSuccess;
  if ((num_rows > 0 && (x == nullptr || !aligned16(x))) || (rows_out != nullptr && !aligned16(rows_out)) ||
      (tokens_out != nullptr && !aligned16(tokens_out))) {
    return cudaErrorInvalidValue;
  }
  // (Both limits on the 64-bit counts, before the narrowing to the grid's unsigned: a wrapped count would pass.)
  const int64_t row_tiles = padded_rows / kTileRows, column_tiles = ceil_div(hidden, kTileCols);
  if (row_tiles > INT32_MAX || column_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(column_tiles));
  mxfp8_round_trips_kernel<<<grid, kThreads, 0, stream>>>(x, src_rank, num_rows, hidden, padded_rows,
                                                          qm::sr_key(seed_rows), qm::sr_key(seed_tokens),
                                                          seed_rows_on_device, seed_tokens_on_device, rows_out,
                                                          tokens_out);
  return cudaGetLastError();
}

cudaError_t launch_swiglu_rows(const uint16_t* gate_up, const float* factor, const int32_t* src_rank,
                               int64_t num_rows, int64_t intermediate, int64_t padded_rows, float* out,
                               cudaStream_t stream) {
  if (num_rows < 0 || intermediate <= 0 || intermediate % 8 != 0 || padded_rows < num_rows) {
    return cudaErrorInvalidValue;
  }
  if (padded_rows == 0) return cudaSuccess;
  if (out == nullptr || !aligned16(out) || (num_rows > 0 && (gate_up == nullptr || factor == nullptr ||
                                                             !aligned16(gate_up)))) {
    return cudaErrorInvalidValue;
  }
  swiglu_rows_kernel<<<static_cast<unsigned>(row_grid(padded_rows * (intermediate / 8))), kRowThreads, 0, stream>>>(
      gate_up, factor, src_rank, num_rows, intermediate, padded_rows, out);
  return cudaGetLastError();
}

cudaError_t launch_swiglu_backward_rows(const uint16_t* d_hidden, const float* d_factor, const uint16_t* gate_up,
                                        const float* factor, const int32_t* src_rank, int64_t num_rows,
                                        int64_t intermediate, uint16_t* d_gate_up, cudaStream_t stream) {
  if (num_rows < 0 || intermediate <= 0 || intermediate % 8 != 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  if (d_hidden == nullptr || d_factor == nullptr || gate_up == nullptr || factor == nullptr ||
      d_gate_up == nullptr || !aligned16(d_hidden) || !aligned16(gate_up) || !aligned16(d_gate_up)) {
    return cudaErrorInvalidValue;
  }
  swiglu_backward_rows_kernel<<<static_cast<unsigned>(row_grid(num_rows * (intermediate / 8))), kRowThreads, 0,
                                stream>>>(d_hidden, d_factor, gate_up, factor, src_rank, num_rows, intermediate,
                                          d_gate_up);
  return cudaGetLastError();
}

cudaError_t launch_scale_rows(uint16_t* x, const float* factor, const int32_t* src_rank, int64_t num_rows,
                              int64_t hidden, cudaStream_t stream) {
  if (num_rows < 0 || hidden <= 0 || hidden % 8 != 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  if (x == nullptr || factor == nullptr || !aligned16(x)) return cudaErrorInvalidValue;
  scale_rows_kernel<<<static_cast<unsigned>(row_grid(num_rows * (hidden / 8))), kRowThreads, 0, stream>>>(
      x, factor, src_rank, num_rows, hidden);
  return cudaGetLastError();
}

cudaError_t launch_widen_bf16(const uint16_t* x, float* out, int64_t n, cudaStream_t stream) {
  if (n < 0 || n % 8 != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || out == nullptr || !aligned16(x) || !aligned16(out)) return cudaErrorInvalidValue;
  const int64_t vectors = n / 8;
  int64_t grid = ceil_div(vectors, 2 * kRowThreads);
  if (grid > 65536) grid = 65536;
  widen_bf16_kernel<<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(x, out, vectors);
  return cudaGetLastError();
}

}  // namespace ep_comm
