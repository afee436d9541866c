// Combine's backward on the expert rank (training_rows.h): the rows' gradients f(w * g), the routing-weight dots
// <g, expert_out> and (optionally) the dots as the bf16 rows that carry them back, in one pass, instead of torch's
// separate mask, mixed-dtype multiply, batched dot (measured on one H200 at 32768 x 7168 rows: ~2.4 ms for those
// passes) and the ~20 small ops of the split and scatter (host-bound at small token counts).
//
// One warp per row, rows grid-strided. A lane takes 8 contiguous columns per 256-column chunk: one 16-byte load of g
// and one of expert_out per chunk (a warp moves 512 contiguous bytes per instruction), kUnroll chunks loaded before
// any math so that enough bytes are in flight even when the rows are few (128 tokens: ~8 warps per SM). The sum order
// is fixed (training_rows.h), so the dots are deterministic and the torch oracle reproduces them bit for bit.
#include <cuda_bf16.h>

#include "formats.h"
#include "training_rows.h"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kColumnsPerLane = 8;                  // bf16 values in one 16-byte vector
constexpr int kChunk = 32 * kColumnsPerLane;        // columns one warp-wide load covers
constexpr int kUnroll = 4;                          // chunks in flight per lane
using Bf16 = vec::Elem<__nv_bfloat16>;

__device__ __forceinline__ uint16_t truncated_bf16_bits(float value) {
  return static_cast<uint16_t>(__float_as_uint(value) >> 16);  // bf16 is fp32's top half: exact, never overflows
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// The dot as three bf16 parts whose sum (hi + mid) + lo is the dot exactly (training_rows.h; the torch form is
// ep_comm.training.split_fp32_in_bf16).
__device__ __forceinline__ void split_in_three(float dot, uint16_t parts[3]) {
  if (!isfinite(dot)) {
    parts[0] = __bfloat16_as_ushort(__float2bfloat16_rn(dot));
    parts[1] = parts[2] = 0;
    return;
  }
  parts[0] = truncated_bf16_bits(dot);
  const float rest = __fsub_rn(dot, bf16_bits_to_float(parts[0]));  // exact: at most 16 significant bits left
  parts[1] = truncated_bf16_bits(rest);
  parts[2] = __bfloat16_as_ushort(__float2bfloat16_rn(__fsub_rn(rest, bf16_bits_to_float(parts[1]))));
}

__global__ void __launch_bounds__(kThreads) combine_backward_rows_kernel(
    const uint16_t* __restrict__ g, const uint16_t* __restrict__ expert_out, const float* __restrict__ row_weight,
    const int32_t* __restrict__ src_rank, int64_t num_rows, int64_t hidden, uint16_t* __restrict__ grad_expert_out,
    float* __restrict__ dots, const int32_t* __restrict__ topk_slot, int64_t weight_columns,
    uint16_t* __restrict__ weight_rows) {
  const int lane = threadIdx.x % 32;
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t num_chunks = (hidden + kChunk - 1) / kChunk;  // (the last may be partial: hidden % 256 != 0)
  for (int64_t row = first_warp; row < num_rows; row += num_warps) {
    const bool in_use = src_rank[row] >= 0;  // (the same for the whole warp)
    uint4* out_row = reinterpret_cast<uint4*>(grad_expert_out + row * hidden);
    float sum = 0.0f;
    if (!in_use) {
      for (int64_t column = kColumnsPerLane * lane; column < hidden; column += kChunk) {
        out_row[column / kColumnsPerLane] = make_uint4(0, 0, 0, 0);
      }
    } else {
      const float weight = row_weight[row];
      const uint4* g_row = reinterpret_cast<const uint4*>(g + row * hidden);
      const uint4* e_row = reinterpret_cast<const uint4*>(expert_out + row * hidden);
      for (int64_t chunk = 0; chunk < num_chunks; chunk += kUnroll) {
        uint4 g_vec[kUnroll], e_vec[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t column = (chunk + u) * kChunk + kColumnsPerLane * lane;
          if (column < hidden) {  // (false only in a partial last chunk, or past the last)
            g_vec[u] = __ldg(g_row + column / kColumnsPerLane);
            e_vec[u] = __ldg(e_row + column / kColumnsPerLane);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t column = (chunk + u) * kChunk + kColumnsPerLane * lane;
          if (column < hidden) {
            float g_vals[kColumnsPerLane], e_vals[kColumnsPerLane], grad[kColumnsPerLane];
            Bf16::unpack(g_vec[u], g_vals);
            Bf16::unpack(e_vec[u], e_vals);
#pragma unroll
            for (int j = 0; j < kColumnsPerLane; ++j) {
              sum = __fadd_rn(sum, __fmul_rn(g_vals[j], e_vals[j]));  // (the oracle's two roundings, in its order)
              grad[j] = __fmul_rn(weight, g_vals[j]);
            }
            out_row[column / kColumnsPerLane] = Bf16::pack(grad);
          }
        }
      }
#pragma unroll
      for (int d = 16; d >= 1; d /= 2) sum = __fadd_rn(sum, __shfl_down_sync(0xFFFFFFFFu, sum, d));
    }
    const float dot = __shfl_sync(0xFFFFFFFFu, sum, 0);  // (0 for a row not in use)
    if (lane == 0) dots[row] = dot;
    if (weight_rows != nullptr) {
      uint16_t parts[3];
      split_in_three(dot, parts);
      const int64_t first = in_use ? 3LL * topk_slot[row] : -3;  // (-3: no column of a row not in use holds a part)
      uint16_t* carried = weight_rows + row * weight_columns;
      for (int64_t column = lane; column < weight_columns; column += 32) {
        const int64_t part = column - first;
        carried[column] = part == 0 ? parts[0] : part == 1 ? parts[1] : part == 2 ? parts[2] : uint16_t{0};
      }
    }
  }
}

}  // namespace

cudaError_t launch_combine_backward_rows(const uint16_t* g, const uint16_t* expert_out, const float* row_weight,
                                         const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                         uint16_t* grad_expert_out, float* dots, const int32_t* topk_slot,
                                         int64_t weight_columns, uint16_t* weight_rows, cudaStream_t stream) {
  if (num_rows < 0 || hidden <= 0 || hidden % 32 != 0) return cudaErrorInvalidValue;
  if (weight_rows != nullptr && (topk_slot == nullptr || weight_columns <= 0 || weight_columns % 32 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (g == nullptr || expert_out == nullptr || row_weight == nullptr || src_rank == nullptr ||
      grad_expert_out == nullptr || dots == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!rows_aligned(g, 0, 16) || !rows_aligned(expert_out, 0, 16) || !rows_aligned(grad_expert_out, 0, 16)) {
    return cudaErrorInvalidValue;  // 16-byte loads and stores (rows of 2 * hidden bytes, hidden % 32 == 0)
  }
  int device = 0, num_sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  // Enough warps to cover the rows once where they are few, else 8 blocks per SM striding over them.
  const int64_t blocks_for_rows = (num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t blocks = blocks_for_rows < 8LL * num_sms ? blocks_for_rows : 8LL * num_sms;
  combine_backward_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      g, expert_out, row_weight, src_rank, num_rows, hidden, grad_expert_out, dots, topk_slot, weight_columns,
      weight_rows);
  return cudaGetLastError();
}

}  // namespace ep_comm
