// Combine's backward on the expert rank (training_rows.h): the rows' gradients f(w * g) and the routing-weight dots
// <g, expert_out> in one pass, instead of torch's separate mask, mixed-dtype multiply and batched dot (measured on
// one H200 at 32768 x 7168 rows: ~2.4 ms for those passes).
//
// One warp per row, rows grid-strided. A lane takes columns l, l + 32, ... (2-byte loads: a warp reads 64 contiguous
// bytes per instruction), kUnroll of them loaded before any math so that enough bytes are in flight. The sum order is
// fixed (training_rows.h), so the dots are deterministic and the torch oracle reproduces them bit for bit.
#include <cuda_bf16.h>

#include "training_rows.h"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = 8;

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);  // exact: bf16 is fp32's top half
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

__global__ void __launch_bounds__(kThreads) combine_backward_rows_kernel(
    const uint16_t* __restrict__ g, const uint16_t* __restrict__ expert_out, const float* __restrict__ row_weight,
    const int32_t* __restrict__ src_rank, int64_t num_rows, int64_t hidden, uint16_t* __restrict__ grad_expert_out,
    float* __restrict__ dots) {
  const int lane = threadIdx.x % 32;
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_warp; row < num_rows; row += num_warps) {
    const bool in_use = src_rank[row] >= 0;  // (the same for the whole warp)
    uint16_t* out_row = grad_expert_out + row * hidden;
    if (!in_use) {
      for (int64_t column = lane; column < hidden; column += 32) out_row[column] = 0;
      if (lane == 0) dots[row] = 0.0f;
      continue;
    }
    const float weight = row_weight[row];
    const uint16_t* g_row = g + row * hidden;
    const uint16_t* e_row = expert_out + row * hidden;
    float sum = 0.0f;
    int64_t column = lane;
    for (; column + 32 * (kUnroll - 1) < hidden; column += 32 * kUnroll) {
      uint16_t g_bits[kUnroll], e_bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        g_bits[u] = __ldg(g_row + column + 32 * u);
        e_bits[u] = __ldg(e_row + column + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float gv = bf16_bits_to_float(g_bits[u]);
        sum = __fadd_rn(sum, __fmul_rn(gv, bf16_bits_to_float(e_bits[u])));  // (the oracle's two roundings)
        out_row[column + 32 * u] = float_to_bf16_bits(__fmul_rn(weight, gv));
      }
    }
    for (; column < hidden; column += 32) {  // the rest, in the same column order
      const float gv = bf16_bits_to_float(g_row[column]);
      sum = __fadd_rn(sum, __fmul_rn(gv, bf16_bits_to_float(e_row[column])));
      out_row[column] = float_to_bf16_bits(__fmul_rn(weight, gv));
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) sum = __fadd_rn(sum, __shfl_down_sync(0xFFFFFFFFu, sum, d));
    if (lane == 0) dots[row] = sum;
  }
}

}  // namespace

cudaError_t launch_combine_backward_rows(const uint16_t* g, const uint16_t* expert_out, const float* row_weight,
                                         const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                         uint16_t* grad_expert_out, float* dots, cudaStream_t stream) {
  if (num_rows < 0 || hidden <= 0 || hidden % 32 != 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  if (g == nullptr || expert_out == nullptr || row_weight == nullptr || src_rank == nullptr ||
      grad_expert_out == nullptr || dots == nullptr) {
    return cudaErrorInvalidValue;
  }
  int device = 0, num_sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  // Enough warps to cover the rows once where they are few, else 8 blocks per SM striding over them.
  const int64_t blocks_for_rows = (num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t blocks = blocks_for_rows < 8LL * num_sms ? blocks_for_rows : 8LL * num_sms;
  combine_backward_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      g, expert_out, row_weight, src_rank, num_rows, hidden, grad_expert_out, dots);
  return cudaGetLastError();
}

}  // namespace ep_comm
