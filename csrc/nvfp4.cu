// NVFP4 quantize (4/6 or plain) and dequantize kernels. Arithmetic: quant_math.cuh (docs/NUMERICS.md).
//
// Quantize layout: a CTA holds `rows_per_cta` rows, `threads_per_row` threads each (a multiple of 32).
// Thread t of a row owns the 16-element blocks t, t + T, t + 2T, ... (T = threads_per_row), so a warp
// reads 32 consecutive blocks (1 KiB of bf16) per load instruction pair and writes 256 consecutive bytes
// of codes. When the row fits in 128 bytes per thread (K <= 32768 bf16 / 16384 fp32) it is read from HBM
// once and kept in registers while the row amax is reduced; longer rows take a second pass (L2).
#include <algorithm>

#include "formats.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

// 16-element blocks a thread keeps in registers per round: 128 bytes of raw input (4 bf16 / 2 fp32 blocks).
template <typename T>
constexpr int blocks_per_thread() {
  return 128 / (16 * static_cast<int>(sizeof(T)));
}
constexpr int kMaxThreadsPerRow = 512;
constexpr int kTargetCtaThreads = 256;
constexpr int kMaxWarpsPerCta = kMaxThreadsPerRow / 32;

// Raw 16-byte vectors of one 16-element block (2 for bf16/fp16, 4 for fp32).
template <typename T>
struct RawBlock16 {
  static constexpr int kVecs = 16 / vec::Elem<T>::kPerVec;
  uint4 raw[kVecs];

  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) raw[v] = vec::load16(src + v * vec::Elem<T>::kPerVec);
  }
  __device__ __forceinline__ void unpack(float x[16]) const {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) vec::Elem<T>::unpack(raw[v], x + v * vec::Elem<T>::kPerVec);
  }
};

// Max over the threads of one row (threads_per_row consecutive threads of threadIdx.x). All threads of
// the CTA must call it (it synchronizes when a row spans several warps).
__device__ __forceinline__ float row_max(float v, float* warp_max) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) v = qm::qm_max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  const int warps_per_row = blockDim.x / 32;
  if (warps_per_row == 1) return v;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_max[threadIdx.y * warps_per_row + threadIdx.x / 32] = v;
  __syncthreads();
  float row = 0.0f;
  for (int w = 0; w < warps_per_row; ++w) row = qm::qm_max(row, warp_max[threadIdx.y * warps_per_row + w]);
  return row;
}

template <typename T, bool kFourOverSix>
__global__ void __launch_bounds__(kMaxThreadsPerRow) nvfp4_quantize_kernel(Nvfp4QuantizeArgs args) {
  __shared__ float warp_max[kMaxWarpsPerCta];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_valid = row < args.num_rows && (args.num_rows_limit == nullptr || row < __ldg(args.num_rows_limit));
  const int num_blocks = static_cast<int>(args.hidden / 16);
  const int threads_per_row = blockDim.x;
  constexpr int kBlocksPerThread = blocks_per_thread<T>();
  const int per_round = threads_per_row * kBlocksPerThread;
  const bool single_round = num_blocks <= per_round;
  const T* x_row = static_cast<const T*>(args.x) + (row_valid ? row : 0) * args.x_row_stride;

  RawBlock16<T> blocks[kBlocksPerThread];
  auto load_round = [&](int first) {
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = first + threadIdx.x + i * threads_per_row;
      if (row_valid && b < num_blocks) blocks[i].load(x_row + static_cast<int64_t>(b) * 16);
    }
  };
  auto round_amax = [&](int first) {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = first + threadIdx.x + i * threads_per_row;
      if (row_valid && b < num_blocks) {
        float x[16];
        blocks[i].unpack(x);
        a = qm::qm_max(a, qm::block_amax16(x));
      }
    }
    return a;
  };

  if (single_round) load_round(0);
  float amax;
  if (args.amax_in == nullptr) {
    float local = 0.0f;
    if (single_round) {
      local = round_amax(0);
    } else {
      for (int first = 0; first < num_blocks; first += per_round) {
        load_round(first);
        local = qm::qm_max(local, round_amax(first));
      }
    }
    amax = row_max(local, warp_max);  // NaN-free: fmaxf ignores NaN elements
  } else {
    amax = row_valid ? args.amax_in[row] : 0.0f;
  }
  if (!row_valid) return;  // no barrier follows
  const int64_t dst = args.dst_rows != nullptr ? args.dst_rows[row] : row;
  if (dst < 0) return;

  const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax, args.e4m3_max);
  uint8_t* data_row = args.data + dst * args.data_row_stride;
  uint8_t* scale_row = args.scales + dst * args.scales_row_stride;
  if (args.amax_out != nullptr && threadIdx.x == 0) args.amax_out[dst] = amax;

  for (int first = 0; first < num_blocks; first += per_round) {
    if (!single_round) load_round(first);
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = first + threadIdx.x + i * threads_per_row;
      if (b >= num_blocks) continue;
      float x[16];
      blocks[i].unpack(x);
      uint32_t words[2];
      uint8_t scale;
      qm::nvfp4_quantize_block16_words(x, outer, amax, args.e4m3_max, kFourOverSix, words, &scale);
      *reinterpret_cast<uint2*>(data_row + static_cast<int64_t>(b) * 8) = make_uint2(words[0], words[1]);
      scale_row[b] = scale;
    }
  }
}

// One thread per 16-element block: 8 code bytes + 1 scale byte -> 16 outputs.
template <typename Out>
__global__ void __launch_bounds__(256) nvfp4_dequantize_kernel(const uint8_t* __restrict__ data,
                                                               const uint8_t* __restrict__ scales,
                                                               const float* __restrict__ amax, int64_t num_rows,
                                                               int64_t blocks_per_row, float e4m3_max,
                                                               Out* __restrict__ out,
                                                               const int32_t* __restrict__ num_rows_limit) {
  const int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (block >= num_rows * blocks_per_row) return;
  const int64_t row = block / blocks_per_row;
  if (num_rows_limit != nullptr && row >= __ldg(num_rows_limit)) return;
  const uint2 word = __ldg(reinterpret_cast<const uint2*>(data) + block);
  // amax == nullptr: block values only (e2m1 * e4m3, exact in fp16) -- the grouped GEMM's activation operand,
  // whose per-row outer scale is applied in the GEMM epilogue instead.
  const float final_scale = amax == nullptr ? qm::e4m3_decode(__ldg(scales + block))
                                            : qm::nvfp4_dequant_scale(__ldg(scales + block), __ldg(amax + row), e4m3_max);
  float y[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? word.x : word.y) >> (8 * (i % 4))) & 0xFFu;
    y[2 * i] = qm::qm_mul(qm::e2m1_decode(static_cast<uint8_t>(byte & 0xF)), final_scale);
    y[2 * i + 1] = qm::qm_mul(qm::e2m1_decode(static_cast<uint8_t>(byte >> 4)), final_scale);
  }
  vec::store_row_segment<Out, 16>(out + block * 16, y);
}

}  // namespace

cudaError_t launch_nvfp4_quantize(const Nvfp4QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 16 != 0 || args.num_rows < 0 || args.hidden / 16 > INT32_MAX / 2) {
    return cudaErrorInvalidValue;
  }
  if (args.num_rows == 0) return cudaSuccess;
  const int64_t num_blocks = args.hidden / 16;
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    // Enough threads per row to hold it in registers (one round), a multiple of 32, at most 512.
    const int64_t wanted = ceil_div(ceil_div(num_blocks, blocks_per_thread<T>()), 32) * 32;
    const int threads_per_row = static_cast<int>(std::min<int64_t>(kMaxThreadsPerRow, std::max<int64_t>(32, wanted)));
    const int rows_per_cta = std::max(1, kTargetCtaThreads / threads_per_row);
    const dim3 block(threads_per_row, rows_per_cta);
    const int64_t grid = ceil_div(args.num_rows, rows_per_cta);
    if (grid > INT32_MAX) return cudaErrorInvalidValue;
    if (args.four_over_six) {
      nvfp4_quantize_kernel<T, true><<<static_cast<unsigned>(grid), block, 0, stream>>>(args);
    } else {
      nvfp4_quantize_kernel<T, false><<<static_cast<unsigned>(grid), block, 0, stream>>>(args);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_nvfp4_dequantize(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                                    int64_t hidden, float e4m3_max, void* out, int out_type, cudaStream_t stream,
                                    const int32_t* num_rows_limit) {
  if (hidden <= 0 || hidden % 16 != 0 || num_rows < 0) return cudaErrorInvalidValue;
  const int64_t total_blocks = num_rows * (hidden / 16);
  if (total_blocks == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t grid = ceil_div(total_blocks, kThreads);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(out_type, [&](auto tag) {
    using Out = decltype(tag);
    nvfp4_dequantize_kernel<Out><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        data, scales, amax, num_rows, hidden / 16, e4m3_max, static_cast<Out*>(out), num_rows_limit);
    return cudaGetLastError();
  });
}

}  // namespace ep_comm
