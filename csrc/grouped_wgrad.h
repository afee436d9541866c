// Weight-gradient grouped GEMM of the trainable experts (ep_comm/training_experts.py) on Hopper (sm_90a): groups
// along the contraction axis, FP32 out. Torch-free launcher interface.
//
//   out[e, m, n] = sum over k in [start_e, end_e) of a[m, k] * b[n, k]        (FP32 accumulation)
//
// a: bf16 [m_rows, k_total], b: bf16 [n_rows, k_total] (row strides lda / ldb elements: both K-major, the tokens
// along K -- what the MXFP8 round trips' transposed outputs are); the groups are the experts' token segments:
// start_e = e ? group_ends[e - 1] : 0, end_e = group_ends[e] (int32 [E] on the device, non-decreasing; clamped on the
// device to [0, k_total], so inconsistent ends cannot make the kernel read outside a and b); an empty segment gives a
// zero matrix. out: fp32 [E, m_rows, n_rows], contiguous, every element written (or added to: `accumulate`).
//
// Why: torch._grouped_mm writes BF16 only, so FP32 master weights took its BF16 weight gradients widened by a separate
// pass (read 2 + write 4 bytes per weight, ~3 ms of a ~23 ms forward + backward at DeepSeek-V3 expert shapes) and
// rounded to BF16 on the way. Here the FP32 accumulators are the gradient.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

struct GroupedWgradArgs {
  const uint16_t* a = nullptr;  // bf16 bits [m_rows, lda]
  const uint16_t* b = nullptr;  // bf16 bits [n_rows, ldb]
  int64_t lda = 0;              // elements; multiples of 8 (16-byte rows), a and b 16-byte aligned
  int64_t ldb = 0;
  const int32_t* group_ends = nullptr;  // [num_experts], device
  int num_experts = 0;
  int64_t m_rows = 0;   // multiple of 8
  int64_t n_rows = 0;   // multiple of 8
  int64_t k_total = 0;  // <= lda and <= ldb: the columns the segments may cover
  float* out = nullptr;  // [num_experts, m_rows, n_rows], 16-byte aligned
  // false: out = the result (every element written). true: out += the result, one FP32 addition per element (the
  // TMA's reduce-add in L2: the bits of `out + result` computed apart), for gradients accumulated over micro-batches
  // in an FP32 buffer (Megatron's main_grad) without a separate pass over it.
  bool accumulate = false;
};

// cudaErrorInvalidValue for bad sizes, null or misaligned pointers (or sizes past the TMA's int32 coordinates);
// cudaErrorNotSupported when the current device is not sm_90 (wgmma is sm_90a code) or the driver has no tensor-map
// encoder. Launches clusters of two CTAs. Never synchronizes.
cudaError_t launch_grouped_wgrad_bf16(const GroupedWgradArgs& args, cudaStream_t stream);

}  // namespace ep_comm
