// The expert-rank half of combine's backward (ep_comm/training.py), in one pass over the gradient rows.
// Torch-free: pointers, sizes and the stream arrive as raw values.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

// For each row r < num_rows of the dispatch layout (bf16 rows of `hidden` elements, contiguous):
//  * in use (src_rank[r] >= 0): grad_expert_out[r, i] = bf16_rn(f32(row_weight[r] * g[r, i])), and
//    dots[r] = <g[r], expert_out[r]> in FP32, in this order: lane l of 32 adds f(g * e) of columns l, l + 32,
//    l + 64, ... in turn (each product and sum rounded to FP32; the products of two bf16 values are exact unless they
//    leave FP32's normal range), then lane l += lane l + d for d = 16, 8, 4, 2, 1, and lane 0's sum is the dot
//    (ep_comm/training.py `combine_backward_rows_reference` is this order in torch, the tests' oracle);
//  * not in use (alignment padding, capacity rows past the rows in use): zeros in both, whatever g, expert_out or
//    row_weight hold there (capacity rows are never written by the dispatch).
// hidden % 32 == 0. Returns cudaErrorInvalidValue for bad sizes or null pointers (nothing launched).
cudaError_t launch_combine_backward_rows(const uint16_t* g, const uint16_t* expert_out, const float* row_weight,
                                         const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                         uint16_t* grad_expert_out, float* dots, cudaStream_t stream);

}  // namespace ep_comm
