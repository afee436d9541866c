// The expert-rank half of combine's backward (ep_comm/training.py), in one pass over the gradient rows.
// Torch-free: pointers, sizes and the stream arrive as raw values.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

// For each row r < num_rows of the dispatch layout (bf16 rows of `hidden` elements, contiguous, 16-byte aligned):
//  * in use (src_rank[r] >= 0): grad_expert_out[r, i] = bf16_rn(f32(row_weight[r] * g[r, i])), and
//    dots[r] = <g[r], expert_out[r]> in FP32, in this order: the columns fall into chunks of 256 (one 16-byte load
//    per lane of a warp), and lane l of 32 adds f(g * e) of its 8 columns 256 c + 8 l .. 256 c + 8 l + 7 of chunk c
//    = 0, 1, ... in turn (each product and sum rounded to FP32; the products of two bf16 values are exact unless they
//    leave FP32's normal range); then lane l += lane l + d for d = 16, 8, 4, 2, 1, and lane 0's sum is the dot
//    (ep_comm/training.py `combine_backward_rows_reference` is this order in torch, the tests' oracle);
//  * not in use (alignment padding, capacity rows past the rows in use): zeros in both, whatever g, expert_out or
//    row_weight hold there (capacity rows are never written by the dispatch).
// With weight_rows (may be null): also the routing-weight gradient rows that go back to the source ranks,
// bf16 [num_rows, weight_columns]: a row in use holds its dot split into three bf16 parts (hi = the dot truncated to
// bf16, mid = the rest truncated, lo = what is left rounded to nearest; hi + mid + lo == dot exactly for finite dots
// of magnitude 2^-110 or more; a NaN or Inf dot travels as hi = bf16_rn(dot), mid = lo = 0) in columns
// 3 topk_slot[r] .. 3 topk_slot[r] + 2, zeros elsewhere; a row not in use is zero. weight_columns % 32 == 0 and
// 3 * (topk_slot + 1) <= weight_columns for the rows in use (training.weights_hidden; split_fp32_in_bf16 in torch).
// hidden % 32 == 0. Returns cudaErrorInvalidValue for bad sizes, null or misaligned pointers (nothing launched).
cudaError_t launch_combine_backward_rows(const uint16_t* g, const uint16_t* expert_out, const float* row_weight,
                                         const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                         uint16_t* grad_expert_out, float* dots, const int32_t* topk_slot,
                                         int64_t weight_columns, uint16_t* weight_rows, cudaStream_t stream);

}  // namespace ep_comm
