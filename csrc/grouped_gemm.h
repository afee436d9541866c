// NVFP4 grouped GEMM for the MoE experts on Hopper (sm_90a): torch-free launcher interface.
//
// y[row, n] = (sum_k x[row, k] * w_e[n, k]) * row_factor[row] * w_factor[e] for every valid row of expert e
// (rows expert_offsets[e] .. expert_offsets[e] + num_tokens_per_expert[e] - 1; other rows are not written).
//   x: fp16 block values of NVFP4 activations (e2m1 * e4m3 block scale, exact in fp16), row_factor the
//      per-row outer decode scale amax / (6 M).
//   w: NVFP4 weights packed offline in the wgmma A-fragment order (ep_comm/grouped_gemm.py documents the
//      layout bit by bit): per (expert, 64-row tile, 64-column k-block) 128 threads x 16 bytes of codes and
//      64 rows x 4 k-steps of scale codes (256 bytes); w_factor[e] the per-expert outer decode scale. The packed
//      rows are in the order the epilogues assume (pack_gemm_weights' row_perm): without swiglu, column pairs
//      (packed row 16 q + g is row 16 q + 2 g for g < 8, 16 q + 2 (g - 8) + 1 otherwise), so w_e[n, k] above is
//      the weight of output column n; with swiglu, the gate/up interleave below.
// The counts and offsets stay on the device: the grid is sized from num_rows_total and CTAs without work exit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "waves.h"

namespace ep_comm {

struct GroupedGemmArgs {
  const uint16_t* x = nullptr;       // fp16 [num_rows_total, k], row stride x_row_stride elements
  int64_t x_row_stride = 0;
  const float* row_factor = nullptr;  // [num_rows_total]
  const uint32_t* w_values = nullptr;  // [E, n/64, k/64, 128, 4]
  const uint8_t* w_scales = nullptr;   // [E, n/64, k/64, 64, 4]
  const float* w_factor = nullptr;     // [E]
  const int32_t* expert_offsets = nullptr;         // [E + 1] first row of each expert (device), non-decreasing:
                                                   // overlapping segments can need more tiles than the grid has
  const int32_t* num_tokens_per_expert = nullptr;  // [E] valid rows of each expert (device); clamped on the
                                                   // device to the segment and to num_rows_total
  int num_experts = 0;
  int n = 0;  // weight rows (output features; 2I for w1 with swiglu)
  int k = 0;  // reduction length (hidden)
  int64_t num_rows_total = 0;  // rows of x and out (bounds the grid: sum_e ceil(count_e / tile) <= rows / tile + E)
  void* out = nullptr;         // [num_rows_total, n] (or n / 2 with swiglu) of out_type (unused for out_type 2)
  int out_type = 1;            // 0 = fp32, 1 = bf16, 2 = RHT + S2F6 combine rows (CombineRows below)
  int64_t out_row_stride = 0;
  bool swiglu = false;  // packed rows interleave gate/up per 8: out[:, i] = silu(gate_i) * up_i
  // Optional, with swiglu and out_type 0 / 1: [num_rows_total] FP32, zero-filled by the caller. Each valid row's max
  // |out| over all its columns (NaN ignored, as the NVFP4 quantizer's row amax) is max-ed in with atomics, so that
  // the w2 input's per-token NVFP4 scale needs no amax pass of its own.
  float* row_amax = nullptr;
  int token_tile = 0;   // 16 / 32 / 64 / 128 tokens per CTA tile; 0 = from the average rows per expert
  // Small remainders: an expert whose count % token_tile is 1 .. tail_tile has those rows computed by a second
  // launch with token tile tail_tile (16 / 32 / 64, < token_tile) instead of a mostly empty full tile.
  // -1 = the launcher's choice (32 for token tile 128, else off), 0 = off. With token_tile = 0 a tail_tile at or
  // above the automatic tile turns the split off for that call (with an explicit token_tile it is an error).
  int tail_tile = -1;
  // out_type 2: every valid row goes, as one RHT-32 + S2F6 combine row, straight into the combine area of the rank
  // that sent the token (the local_reduce=False rows of DESIGN.md §3; NVLink peer addresses for other ranks).
  // Row r is stored at bases[src_rank[r]] + offset + (src_token[r] * topk + topk_slot[r]) * row_bytes (bases
  // 16-byte aligned): n code bytes, then the UE8M0 scale of 32-chunk c at byte scale_offset + c. A row counted in
  // whose destination is not one (src_rank outside [0, num_ranks), src_token outside [0, max_tokens), topk_slot
  // outside [0, topk): the dispatch's -1 padding rows, when a caller counts a segment's padding in) is not stored.
  // Each value is rounded to bf16 first (what out_type 1 stores), so the bytes are those that combine(bf16 out,
  // local_reduce=False) sends.
  // Needs swiglu off; the caller orders these stores against the reader (the nvlink backend's begin/finish).
  struct CombineRows {
    const uint64_t* bases = nullptr;  // [world] base address of each rank's region as this GPU addresses it
    int64_t offset = 0;               // of the combine area within a region
    const int32_t* src_rank = nullptr;   // [num_rows_total]
    const int32_t* src_token = nullptr;  // [num_rows_total]
    const int32_t* topk_slot = nullptr;  // [num_rows_total]
    int topk = 0;
    int num_ranks = 0;         // entries of bases
    int64_t max_tokens = 0;    // tokens per rank's area (its rows: max_tokens * topk)
    int64_t row_bytes = 0;     // multiple of 16
    int64_t scale_offset = 0;  // >= n
    uint32_t sign_mask = 0;    // the RHT sign vector
    // The Buffer's abort flag (nullptr: none). Once it is set (an earlier wait timed out -- begin_combine_rows' or
    // one of an earlier call --, a fault, or a peer's notice), the epilogue stores nothing into the sources:
    // fail-stop, so that a slow peer times out instead of reading these rows as those of the combine it waits for.
    const unsigned int* abort = nullptr;
  } combine;
  // Waves (waves.h; wave.area == nullptr: off): x, row_factor, expert_offsets and num_tokens_per_expert are being
  // written by the NVLink dispatch receive that this launch runs behind. The launch is its programmatic dependent
  // (PDL); every CTA waits until the layout is published, takes work items from the area's counter (persistent,
  // dynamic) and starts a token tile only once every row of its expert is in. A split launch's remainder part runs
  // after the main part has completed (which implies the receive has), without waves.
  WaveSync wave;
  // Inexact FP8 mode (ep_comm/grouped_gemm.py, precision "fp8_inexact"): x holds e4m3 bytes [num_rows_total, k]
  // (x_row_stride still in 2-byte units: row bytes / 2), permuted inside each 16-column group as
  // expand_nvfp4_rows(precision="fp8_inexact") writes them; the weights are rounded to e4m3 in registers and the MMA
  // is wgmma's E4M3 form (twice the fp16 rate). k % 128 == 0; every out_type (combine rows too) and waves.
  bool fp8 = false;
};

// cudaErrorInvalidValue for bad sizes or x / w_values / w_scales not 16-byte aligned; cudaErrorNotSupported when
// the current device is not sm_90 (the kernel uses wgmma, which only sm_90a has; Blackwell needs the tcgen05 design
// in docs/GEMM.md).
cudaError_t launch_grouped_gemm_nvfp4(const GroupedGemmArgs& args, cudaStream_t stream);

// Whether the current device is sm_90 (the wgmma kernels' only architecture); false when it cannot be asked.
bool device_is_sm90();

// The token tile the launcher picks for token_tile = 0 (exposed so benchmarks can report it).
int grouped_gemm_auto_token_tile(int64_t num_rows_total, int num_experts);

}  // namespace ep_comm
