// Row kernels of the trainable experts (ep_comm/training_experts.py): the passes between its grouped GEMMs, fused so
// that each reads its tensors once. Torch-free: pointers, sizes and the stream arrive as raw values.
//
// Every kernel takes src_rank int32 [R] of the dispatch layout: a row is in use iff src_rank[r] >= 0 (nullptr: every
// row); rows not in use (alignment padding, the nvlink capacity rows past the rows in use) give zeros whatever the
// inputs hold there. Each is bit for bit the torch form named in its comment (the oracle of tests/test_training_
// experts.py); each returns cudaErrorInvalidValue for bad sizes, null or misaligned pointers (nothing launched).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

// From x bf16 [R, K] (rows contiguous; K % 32 == 0), zero on rows not in use, in one read:
//  * rows_out bf16 [R, K] (nullable): MXFP8 along K with stochastic rounding, dequantized --
//    mxfp8_dequantize(mxfp8_quantize(x, "stochastic", seed_rows)) (element index r * K + c);
//  * tokens_out bf16 [K, padded_rows] (nullable; padded_rows >= R, a multiple of 32, 16-byte aligned rows): x
//    transposed and zero-padded to padded_rows, MXFP8 along the tokens with stochastic rounding, dequantized --
//    the same of x^T (element index k * padded_rows + r).
// A non-null seed_*_on_device replaces seed_*: the seed is read there when the kernel runs (CUDA-graph replays).
cudaError_t launch_mxfp8_round_trips(const uint16_t* x, const int32_t* src_rank, int64_t num_rows, int64_t hidden,
                                     int64_t padded_rows, uint64_t seed_rows, uint64_t seed_tokens,
                                     const uint64_t* seed_rows_on_device, const uint64_t* seed_tokens_on_device,
                                     uint16_t* rows_out, uint16_t* tokens_out, cudaStream_t stream);

// The seeds of the trainable experts' stochastic roundings, derived on the device (so that a CUDA-graph replay
// derives them from the values there at replay time): out[j] = mix64(*in ^ xor_values[j]) for j < count (at most
// kMaxMixedSeeds; mix64 is one splitmix64 step, ep_comm.training_experts._mix64). If increment_in, *in is first
// incremented by one in place (a call counter). One thread; out must not overlap in.
constexpr int kMaxMixedSeeds = 8;
struct SeedMixArgs {
  uint64_t* in = nullptr;
  bool increment_in = false;
  uint64_t xor_values[kMaxMixedSeeds] = {};
  int count = 0;
  uint64_t* out = nullptr;
};
cudaError_t launch_mix_seeds(const SeedMixArgs& args, cudaStream_t stream);

// SwiGLU of w1's output: out fp32 [padded_rows, I] with, for rows in use, out[r, i] = silu(g) * u, g = f32(gate_up[r,
// i]) * factor[r], u = f32(gate_up[r, I + i]) * factor[r] (gate_up bf16 [R, 2I], factor fp32 [R]; silu(g) =
// g / (1 + expf(-g)), torch's CUDA form), and zeros on the other rows up to padded_rows. I % 8 == 0.
cudaError_t launch_swiglu_rows(const uint16_t* gate_up, const float* factor, const int32_t* src_rank,
                               int64_t num_rows, int64_t intermediate, int64_t padded_rows, float* out,
                               cudaStream_t stream);

// SwiGLU's backward: d_gate_up bf16 [R, 2I] from d_hidden bf16 [R, I] times d_factor fp32 [R] and the forward's
// gate_up bf16 [R, 2I] times factor fp32 [R] (as launch_swiglu_rows): sig = 1 / (1 + expf(-g)),
// d_up = bf16(dh * (g * sig)), d_gate = bf16((dh * u) * (sig * (1 + g * (1 - sig)))), each product and sum rounded
// to fp32 in that order (no FMA contraction). I % 8 == 0.
cudaError_t launch_swiglu_backward_rows(const uint16_t* d_hidden, const float* d_factor, const uint16_t* gate_up,
                                        const float* factor, const int32_t* src_rank, int64_t num_rows,
                                        int64_t intermediate, uint16_t* d_gate_up, cudaStream_t stream);

// In place: x[r, :] = bf16(f32(x[r, :]) * factor[r]) for rows in use, 0 for the others (x bf16 [R, K], K % 8 == 0).
cudaError_t launch_scale_rows(uint16_t* x, const float* factor, const int32_t* src_rank, int64_t num_rows,
                              int64_t hidden, cudaStream_t stream);

// out[i] = f32(x[i]) for i < n (bf16 -> fp32, exact; n % 8 == 0, both 16-byte aligned): the weight gradients,
// torch._grouped_mm's bf16, into the dtype of FP32 master weights (torch's cast kernel ran at ~2 TB/s there).
cudaError_t launch_widen_bf16(const uint16_t* x, float* out, int64_t n, cudaStream_t stream);

}  // namespace ep_comm
