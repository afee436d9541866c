// NVFP4 x NVFP4 grouped GEMM for the MoE experts on Hopper: wgmma with the weights as the register operand.
//
// Problem transposed ("swap AB"): the weights are wgmma's A (M = weight rows), the tokens its B (N = tokens of
// one expert). Hopper has no FP4 MMA, so each thread turns its own NVFP4 weight codes into fp16 in registers:
// E2M1 * E4M3 has at most 6 significant bits, so with the weights scaled by 2^-7 every product is an exact fp16
// (normal or subnormal, see below) and the MMA accumulates exact products in FP32 -- the only difference from
// an FP32 reference is the summation order. Activations arrive as fp16 block values (e2m1 * block scale, exact)
// in the dispatch layout; both outer FP32 scales are applied in the epilogue. Epilogues: fp32 / bf16 rows (SwiGLU
// fused for w1), or RHT-32 + S2F6 combine rows stored straight into the source ranks' combine areas
// (store_combine_rows, out_type 2: the w2 GEMM of MoELayer on the nvlink backend).
//
// This file: the classic form (below: every warpgroup loads and computes) and the launcher (select_kernel,
// launch_grouped_gemm_nvfp4). The exact mode's token tiles 128 and 144 run by default in the warp-specialized form
// (grouped_gemm_ws.cu: a producer warp feeds two consumer warpgroups), bitwise the same; the pieces both share are
// in grouped_gemm_tiles.cuh.
//
// Classic form: CTA = kWarpGroups (2 or 4) warpgroups; warpgroup g owns weight tile mt = cta * kWarpGroups + g (64 rows) and all
// of the CTA's token tile (kTile tokens of one expert). Every thread streams its own packed weight bytes
// (16 B of codes per 64-wide k-block) with cp.async into a private smem slot; 16 lanes of each warpgroup copy
// the tile's 256 scale bytes; the token tile is shared and published with a barrier. kStages-deep ring of
// stages of kBlocksPerStage k-blocks; stage st + kStages - 1 is loaded into the slot of st - 1 once every wgmma
// that read it has retired.
//
// Weight decode (layout in ep_comm/grouped_gemm.py): for pair j of a k-step word w,
//   ((w & F_j) * M_j) & 0x8E008E00 (32-bit; decode_pair0..3 in grouped_gemm_tiles.cuh) is the fp16x2 of the two E2M1 values * 2^-14
// (magnitude bits at the fp16 exponent/mantissa boundary, sign at bit 15; E2M1's subnormal 0.5 lands on fp16's
// subnormal 2^-15, so zero and 0.5 need no special case). Pair 0 is stored in place (1 op), pair 1 three bits
// lower (shift + mask), pairs 2 and 3 keep sign and magnitude at other distances: the multiply by 2^a + 2^b
// moves the magnitude by a and the sign by b in one IMAD, and the stray copies and carries stay outside the
// mask (checked for every code by tests/test_grouped_gemm.py). 9 integer ops per 8 weights instead of 13 with
// one shift distance per pair. The scale code c of E4M3 scale s gives the fp16 s * 2^7 as c << 7; one mask of
// a row's 4-byte scale word gives the codes of two k-steps, and HMUL2 broadcasts the half it needs. Product:
// v * s * 2^-7, at least 2^-17 in magnitude (a multiple of 2^-17, exact even as an fp16 subnormal) and at most
// 6 * 448 * 2^-7 = 21. fp16 HMUL2 keeps subnormals (no flush for f16 on sm_90).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "cp_async.cuh"
#include "env_choice.h"
#include "grouped_gemm.h"
#include "grouped_gemm_tiles.cuh"
#include "pdl_launch.cuh"
#include "tensor_map.h"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

using namespace grouped_gemm_detail;

// k-blocks per pipeline stage for the default CTA shapes (EP_COMM_GEMM_KBLOCKS_PER_STAGE=1 for tuning): two halve
// the barriers and ring bookkeeping; measured on H200 1.01-1.05x (128 rows per expert) and 1.04-1.07x (16 rows)
// over one (two calls, bench/RESULTS.md).
constexpr int kDefaultBlocksPerStage = 2;

template <int kTile, int kWarpGroups, int kCtasPerSm, int kBlocksPerStage, bool kFp8 = false>
struct Geometry {
  static constexpr int kThreads = kWarpGroups * 128;
  // B (token) tile of one k-block, K-major in wgmma's 128-byte swizzle: token rows of 128 B (64 k) with 16-byte
  // chunk c stored at chunk c ^ (token % 8); 8-row groups 1024 B apart; the tile starts 1024-byte aligned. (An
  // interleaved, unswizzled layout was 1.31x slower at 128 rows per expert: wgmma's shared-memory reads were the
  // bottleneck; removed, bench/RESULTS.md second session.)
  // FP8 mode (kFp8): e4m3 tokens, one byte per k, so one 128-byte token row holds both k-blocks of a stage; the stage
  // is [weights + scales of k-block 0][... of k-block 1][token tile], and k-block b's tokens start 64 b bytes into
  // each row.
  static constexpr int kTokensBytes = kTile * 128;
  static constexpr int kValuesOffset = 0;
  static constexpr int kScalesOffset = kThreads * kValueBytes;
  static constexpr int kWeightBlockBytes = kScalesOffset + kWarpGroups * kTileScaleBytes;  // a multiple of 16
  static constexpr int kTokensOffset = ((kFp8 ? kBlocksPerStage * kWeightBlockBytes : kWeightBlockBytes) + 1023) /
                                       1024 * 1024;
  // One k-block (fp16); the weights and scales of one k-block (FP8).
  static constexpr int kBlockBytes = kFp8 ? kWeightBlockBytes : (kTokensOffset + kTokensBytes + 1023) / 1024 * 1024;
  // A stage (ring slot) holds kBlocksPerStage consecutive k-blocks: the CTA barrier that publishes a stage and
  // frees the previous one, the cp.async issue and the ring bookkeeping are paid once per stage.
  static constexpr int kStageBytes = kFp8 ? kTokensOffset + kTokensBytes : kBlocksPerStage * kBlockBytes;
  static_assert(!kFp8 || kBlocksPerStage == 2, "an FP8 stage's 128-byte token rows hold two 64-wide k-blocks");
  // Byte offset, within a stage, of the first token byte of k-block `sub` (where its wgmma descriptors start).
  static constexpr __host__ __device__ int mma_tokens_offset(int sub) {
    return kFp8 ? kTokensOffset + 64 * sub : sub * kBlockBytes + kTokensOffset;
  }
  // As many stages as the CTA's share of the SM's shared memory holds (228 KiB less 1 KiB per CTA and the
  // alignment slack): loads are issued kStages - 1 stages ahead, which must cover HBM latency under load
  // (~1-2 us) even when a k-block's MMAs take only ~0.5 us.
  static constexpr int kSmemBudget = (224 * 1024) / kCtasPerSm - 3 * 1024;
  static constexpr int kStages = (kSmemBudget / kStageBytes) < 16 ? (kSmemBudget / kStageBytes) : 16;
  static_assert(kStages >= 3, "the ring needs three stages (one in use, one landing, one loading)");
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + room to align the ring to 1024 B
};

// Which expert and token tile tile slot `slot` is (scan_tiles, run by warp 0), for the whole CTA. Returns false when
// the slot is past the last tile. All threads of the CTA call it (it ends in a barrier); `slot` only matters in lane 0
// of warp 0 (with waves only thread 0 holds the item it took).
// Waves (args.wave.area set): lane 0 also waits, before the barrier, until every row of the tile's expert has been
// received (acquire): the barrier then orders the whole CTA's loads of the tile after it, with no barrier of its own.
template <int kTile>
__device__ bool find_tile(const GroupedGemmArgs& args, const RowSplit split, int slot, TileCursor& cursor,
                          FoundTile* tile, const unsigned long long wave_epoch) {
  __shared__ FoundTile found;
  if (threadIdx.x < 32) {
    const FoundTile result = scan_tiles<kTile>(args, split, __shfl_sync(0xFFFFFFFFu, slot, 0), cursor);
    if (threadIdx.x == 0) {
      found = result;
      if (args.wave.area != nullptr && result.expert >= 0) {
        wave::wait_rows(args.wave, result.expert, wave_epoch, clamped_count(args, result.expert));
      }
    }
  }
  __syncthreads();
  *tile = found;
  return tile->expert >= 0;
}

template <int kTile, int kWarpGroups>
__device__ __forceinline__ void store_combine_rows(const GroupedGemmArgs& args, const float (&acc)[kTile / 2],
                                                   const float* factors, const uint64_t* destinations,
                                                   __nv_bfloat16* tile,
                                                   const WorkItem item) {
  // Accumulator i of this lane: column 64 * warp_group + 16 * warp + 2 * (lane / 4) + (i / 2) % 2 (the column-pair
  // row order of pack_gemm_weights), token 8 * (i / 4) + 2 * (lane % 4) + i % 2; rounded to bf16 here, as the bf16
  // epilogue stores it. Columns c and c + 1 (c even) are adjacent in the tile: one 4-byte store of the bf16 pair.
  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  stage_combine_tile<kTile, kWarpGroups>(acc, factors, tile, 64 * warp_group + 16 * warp + 2 * (lane / 4));
  __syncthreads();
  send_combine_rows<kTile, kWarpGroups, kWarpGroups * 4>(args, destinations, tile, item, threadIdx.x / 32);
}

#if EP_COMM_HAS_WGMMA
template <int kTile, int kWarpGroups>
__device__ __forceinline__ void store_rows(const GroupedGemmArgs& args, const float (&acc)[kTile / 2],
                                           const float* factors, const WorkItem item) {
  const int weight_tile = item.weight_cta * kWarpGroups + threadIdx.x / 128;
  if (weight_tile >= args.n / kTileRows) return;  // a spare warpgroup of the last weight CTA
  store_tile_rows<kTile>(args, acc, factors, item, weight_tile);
}

// Every work item of this CTA: item blockIdx.x, then (persistent) blockIdx.x + gridDim.x, ... until find_tile finds
// no tile; with waves, the items taken one by one from the wave work counter instead. Each item is one token tile of one expert (find_tile) against weight CTA `weight_cta` (kWarpGroups
// weight tiles of 64 rows): its k-blocks stream through the ring, then the epilogue stores it.
//
// Next-item prefetch (direct epilogues): once an item's last wgmma is issued, every ring slot but the one it reads
// is free, so the next item's first kStages - 1 stages are issued into them before the wgmma drains and the epilogue
// runs: the next item's MMAs then start on landed data instead of after a pipeline fill. The main loop itself is
// the same for every item (no cross-item logic per stage). The combine-row epilogue stages its tile in the ring's
// first slots, so there the next item's first stages go into the slots past the tile before the epilogue and the rest
// after it (one-CTA-per-SM shapes; the three-CTA shapes load all after it: kEarlyStages below).
template <int kTile, int kWarpGroups, int kCtasPerSm, int kBlocksPerStage, bool kCombineRows, bool kFp8>
__device__ __forceinline__ void gemm_items(const GroupedGemmArgs& args, const RowSplit split, uint8_t* smem,
                                           TileCursor& cursor, const bool persistent,
                                           const unsigned long long wave_epoch) {
  using G = Geometry<kTile, kWarpGroups, kCtasPerSm, kBlocksPerStage, kFp8>;
  constexpr int kThreads = G::kThreads;
  constexpr int kStages = G::kStages;
  constexpr int kAcc = kTile / 2;
  constexpr bool kPrefetchNextItem = !kCombineRows;
  // The combine-row epilogue stages its output tile in the ring's first kTileSlots slots; the slots wholly past it
  // take the next item's first kEarlyStages stages before the epilogue (the rest after it), so that less of the
  // pipeline refill waits behind the epilogue (w2 at 128 rows per expert: the FP8 kernel's combine-row form cost
  // 0.12 ms over its direct form without this, bench/RESULTS.md, forty-first session).
  constexpr int kTileSlots =
      kCombineRows ? (kTile * CombineTile<kWarpGroups>::kBytesPerRow + G::kStageBytes - 1) / G::kStageBytes : 0;
  // Only for the one-CTA-per-SM shapes (tiles 64 / 128): with three CTAs per SM (tiles 16 / 32) the others' MMAs run
  // under one CTA's epilogue, and the early loads measured slower there in the one call that timed them (w2 at 16
  // rows per expert 0.413 against 0.386-0.391 ms in two earlier calls; bench/RESULTS.md, forty-first session).
  // The FP8 form fills every free slot; the exact form leaves one of them for after the epilogue: with the bf16 tile
  // (one slot more free than the fp32 tile it replaced), filling that slot too made the exact w2 3-4% slower at 128
  // and routed ~256 rows per expert (tile 128: 2 of 3 stages early against 1), while the FP8 form gained 2-3% from it
  // (4 of 5 against 2; bench/RESULTS.md, forty-second session). (kTileSlots >= 1, so at most kStages - 1 stages, what
  // one fill loads.)
  constexpr int kEarlyStages = !kCombineRows || kCtasPerSm > 1 ? 0 : kStages - kTileSlots - (kFp8 ? 0 : 1);
  static_assert(kTile <= kThreads, "thread t < kTile loads token t's epilogue factor (and combine-row address)");
  __shared__ WorkItem items[2];  // the item being multiplied and the next one (by item_seq parity)
  __shared__ __align__(16) float tile_factors[kTile];  // the epilogue's per-token factors (token_factor)
  __shared__ uint64_t tile_destinations[kCombineRows ? kTile : 1];  // combine-row addresses (combine_row_address)
  const int warp_group = threadIdx.x / 128;
  const int thread_in_group = threadIdx.x % 128;
  const int num_weight_tiles = args.n / kTileRows;
  const int num_weight_ctas = (num_weight_tiles + kWarpGroups - 1) / kWarpGroups;
  const int num_k_blocks = args.k / kKBlock;
  const uint32_t smem_base = cp_async::smem_address(smem);

  // Loader state: the item being loaded and everything its stage loads need; per k-block only a k offset and the
  // ring slot change (the slot advances incrementally: kStages is not a power of two, and % would cost a division).
  // Weights: [expert][weight tile][k-block][thread] x 16 B of codes; scales [expert][weight tile][k-block] x 256 B.
  const bool copies_scales = thread_in_group < kTileScaleBytes / 16;  // 16 lanes x 16 B per tile and k-block
  const uint32_t values_dst = G::kValuesOffset + threadIdx.x * kValueBytes;
  const uint32_t scales_dst = G::kScalesOffset + warp_group * kTileScaleBytes + thread_in_group * 16;
  // Token tile: kTile rows x 8 chunks of 16 B. Thread t copies chunk t % 8 of rows t / 8 + i * kRowsPerCopy (8
  // consecutive lanes copy one row's 128 contiguous bytes); rows past the expert's count are zero-filled (source
  // size 0, from a valid address). kRowsPerCopy is a multiple of 8, so a thread's rows share one swizzle phase
  // and its copies are a base address plus a constant stride (no per-copy address registers).
  constexpr int kRowsPerCopy = kThreads / 8;
  constexpr int kCopies = (kTile + kRowsPerCopy - 1) / kRowsPerCopy;
  const int copy_chunk = threadIdx.x % 8, copy_row = threadIdx.x / 8;
  const int64_t token_src_step = static_cast<int64_t>(kRowsPerCopy) * args.x_row_stride;
  const uint32_t token_dst = G::kTokensOffset + copy_row * 128 + ((copy_chunk ^ (copy_row % 8)) * 16);
  constexpr uint32_t token_dst_step = kRowsPerCopy * 128;
  const uint8_t* w_values = nullptr;
  const uint8_t* w_scales = nullptr;
  const uint16_t* tile_src = nullptr;
  const uint16_t* token_src = nullptr;
  int load_valid_rows = 0;
  int next_item = blockIdx.x;  // the next item to start; -1: none (waves: >= 0 until the counter runs out)
  int item_seq = 0;            // items started (uniform over the CTA); the last one is in items[(item_seq - 1) & 1]
  // Waves: dynamic scheduling (CTAs that start late, on SMs the receive freed, take fewer items). Thread 0 takes the
  // item from the work counter and publishes it in shared memory: warp 0 takes it for find_tile from lane 0, and
  // find_tile's barrier publishes it to the CTA (thread 0 rewrites it only after later barriers, when every thread
  // has read it). (Taking the next item one ahead hid the atomic's round trip but left the last items reserved by
  // busy CTAs: slower at 128 tokens per rank, bench/RESULTS.md.)
  const bool waves = args.wave.area != nullptr;
  __shared__ int wave_item;

  // Starts item `next_item` (its loader state and WorkItem), or finds there is none (returns false). Every thread
  // calls it: find_tile ends in a barrier.
  auto begin_next_item = [&]() {
    FoundTile tile;
    int item = next_item;
    if (waves && item >= 0 && threadIdx.x == 0) {
      item = static_cast<int>(atomicAdd(args.wave.area + kWaveWorkCounter, 1ull));
      wave_item = item;
    }
    if (item < 0 || !find_tile<kTile>(args, split, item / num_weight_ctas, cursor, &tile, wave_epoch)) {
      next_item = -1;
      return false;
    }
    if (waves) item = wave_item;
    // (The launcher bounds items + grid < 2^31.)
    next_item = waves ? 0 : (persistent ? item + static_cast<int>(gridDim.x) : -1);
    const int weight_cta = item % num_weight_ctas;
    const int weight_tile = weight_cta * kWarpGroups + warp_group;
    // The last CTA may own fewer than kWarpGroups tiles: its spare warpgroups compute tile 0 again and store
    // nothing. (Skipping the MMA instead would put wgmma on a divergent path, which ptxas serialises.)
    const int64_t tile_index =
        static_cast<int64_t>(tile.expert) * num_weight_tiles + (weight_tile < num_weight_tiles ? weight_tile : 0);
    const int first_row = tile.first_row;
    load_valid_rows = tile.valid_rows;
    w_values = reinterpret_cast<const uint8_t*>(args.w_values) +
               (tile_index * num_k_blocks * 128 + thread_in_group) * kValueBytes;
    w_scales = args.w_scales + tile_index * num_k_blocks * kTileScaleBytes + (copies_scales ? thread_in_group * 16 : 0);
    tile_src = args.x + static_cast<int64_t>(first_row) * args.x_row_stride + copy_chunk * 8;
    token_src = tile_src + static_cast<int64_t>(copy_row) * args.x_row_stride;  // copy 0's row
    // Read by the item's epilogue, after the barrier that publishes the item's first stage.
    if (threadIdx.x == 0) items[item_seq & 1] = WorkItem{tile, weight_cta};
    ++item_seq;
    return true;
  };

  int load_slot = 0;  // ring slot of the next stage to load
  auto load_stage = [&](int stage_index) {  // k-blocks stage_index * kBlocksPerStage + 0 .. kBlocksPerStage - 1
    const int first_block = stage_index * kBlocksPerStage;
    if (first_block < num_k_blocks) {
#pragma unroll
      for (int b = 0; b < kBlocksPerStage; ++b) {
        const int k_block = first_block + b;
        if (b > 0 && k_block >= num_k_blocks) break;  // a partial last stage (odd number of k-blocks)
        const uint32_t block = smem_base + load_slot * G::kStageBytes + b * G::kBlockBytes;
        cp_async::copy16_zfill(block + values_dst, w_values + static_cast<int64_t>(k_block) * (128 * kValueBytes),
                               16);
        if (copies_scales) {
          cp_async::copy16_zfill(block + scales_dst, w_scales + k_block * kTileScaleBytes, 16);
        }
        // fp16: each k-block's own 128-byte token rows (64 k). FP8: one 128-byte row per token holds the stage's
        // two k-blocks (128 k of e4m3, 64 uint16 elements of x), copied with k-block 0 (K % 128 == 0: no partial
        // stage).
        if (!kFp8 || b == 0) {
#pragma unroll
          for (int i = 0; i < kCopies; ++i) {
            const int row = copy_row + i * kRowsPerCopy;
            if (kTile % kRowsPerCopy == 0 || row < kTile) {
              const bool valid = row < load_valid_rows;
              cp_async::copy16_zfill(block + token_dst + i * token_dst_step,
                                     (valid ? token_src + i * token_src_step : tile_src) +
                                         k_block * (kFp8 ? kKBlock / 2 : kKBlock),
                                     valid ? 16 : 0);
            }
          }
        }
      }
      load_slot = load_slot + 1 == kStages ? 0 : load_slot + 1;
    }
    cp_async::commit();  // always one group per call, so wait_group counts stay uniform
  };

  const int row_r0 = 16 * (thread_in_group / 32) + (thread_in_group % 32) / 4;  // tile rows r0 and r0 + 8
  // This thread's A fragments of k-block `sub` of ring slot `slot` (fp16x2, mma.m16n8k16 order) from its private
  // smem bytes and its warpgroup's scale codes (written by other lanes: read after the stage barrier).
  auto convert = [&](int slot, int sub, uint32_t (&a)[4][4]) {
    const uint8_t* stage = smem + slot * G::kStageBytes + sub * G::kBlockBytes;
    decode_a_fragments(stage + G::kValuesOffset + threadIdx.x * kValueBytes,
                       stage + G::kScalesOffset + warp_group * kTileScaleBytes, row_r0, a);
  };
  // FP8 mode: this thread's A fragments of k-block `sub` as e4m3, two k32 steps of 4 registers. The weights are
  // decoded to the exact fp16 values v * s * 2^-7 as decode_a_fragments does, scaled by 16 (exact in fp16, subnormals
  // included) and rounded to e4m3 (RNE): v * s * 2^-3 is at most 336, so never saturated, and real weights' block
  // values (scale codes mostly 0x69..0x7E, moe.pack_weights) stay in E4M3's normal range, where the rounding costs at
  // most 2^-5 relative; values below 2^-10 become 0. That rounding is the inexact step. The packing is the fp16 one: in
  // k32 step q, registers a0 / a1 (rows r0 / r1) take k-step 2q's pairs (0, 2) / (1, 3), i.e. columns c, c + 1,
  // c + 8, c + 9 of that 16-column group (c = 2 (lane % 4)), and a2 / a3 k-step 2q + 1's. wgmma reads them as the
  // columns 4 (lane % 4) .. + 3 (a0, a1) and 16 + 4 (lane % 4) .. + 3 (a2, a3) of its 32-wide step, so the activations
  // are stored with the same permutation inside each 16-column group (expand_nvfp4_rows(precision="fp8_inexact")):
  // every product pairs the same k on both sides, and the sum over k is unchanged.
  auto convert_fp8 = [&](int slot, int sub, uint32_t (&a)[2][4]) {
    uint32_t h[4][4];
    convert(slot, sub, h);
    const __half2 sixteen = __float2half2_rn(16.0f);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h[s][r]), sixteen);
        h[s][r] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      a[q][0] = wgmma::e4m3x4_from_f16x2(h[2 * q][0], h[2 * q][2]);
      a[q][1] = wgmma::e4m3x4_from_f16x2(h[2 * q][1], h[2 * q][3]);
      a[q][2] = wgmma::e4m3x4_from_f16x2(h[2 * q + 1][0], h[2 * q + 1][2]);
      a[q][3] = wgmma::e4m3x4_from_f16x2(h[2 * q + 1][1], h[2 * q + 1][3]);
    }
  };
  using AFragments = uint32_t[kFp8 ? 2 : 4][4];  // one k-block's A fragments (k-steps of 16, or of 32 in FP8)
  auto convert_block = [&](int slot, int sub, AFragments& a) {
    if constexpr (kFp8) {
      convert_fp8(slot, sub, a);
    } else {
      convert(slot, sub, a);
    }
  };
  // Wide token tiles (kTile > 128: 72 accumulators) cannot hold two whole k-blocks of A fragments (2 x 16
  // registers) within the 128-register cap of 512 threads: ptxas then serialises every wgmma (C7512) and spills A
  // fragments inside the k-loop. They double-buffer A per group of kStepsPerGroup k-steps instead (2 x 8 registers
  // with two k-steps per group; one k-step, 2 x 4, also fits): group g + 1 of a k-block is converted while group g's
  // wgmma runs, one commit group per group. The k order per accumulator is the same (k-steps 0..3 of each k-block in
  // turn). Tile 144 (4 x 1, two k-blocks per stage): 128 registers, no spills, no C7512 (CUDA 13.0).
  constexpr int kStepsPerGroup = kTile > 128 ? 2 : 4;
  constexpr int kGroups = 4 / kStepsPerGroup;
  static_assert(!kFp8 || kGroups == 1, "FP8 mode has no wide-tile (grouped k-step) form");
  static_assert(kGroups == 1 || kGroups % 2 == 0, "group g of a k-block uses A set g % 2, the same for every k-block");
  using AGroup = uint32_t[kStepsPerGroup][4];  // one A register set
  uint32_t group_scales[2] = {0u, 0u};  // the k-block's scale words (rows r0, r0 + 8), read at its group 0
  auto convert_group = [&](int slot, int sub, auto group_constant, AGroup& a) {
    constexpr int kGroup = decltype(group_constant)::value;
    const uint8_t* stage = smem + slot * G::kStageBytes + sub * G::kBlockBytes;
    const uint8_t* tile_scales = stage + G::kScalesOffset + warp_group * kTileScaleBytes;
    decode_k_step_group<kStepsPerGroup, kGroup>(stage + G::kValuesOffset + threadIdx.x * kValueBytes, tile_scales,
                                                row_r0, group_scales, a);
  };
  auto wait_stage = [&]() {
    wgmma::fence_proxy_async_shared();  // this thread's landed copies, visible to wgmma's async proxy
    __syncthreads();                    // ... and everyone's
  };

  float acc[kAcc];
  // A fragments of even / odd k-blocks (kGroups == 1), or of even / odd k-step groups: one is converted while the
  // other's wgmma runs (wgmma reads its register operands asynchronously).
  std::conditional_t<kGroups == 1, AFragments, AGroup> a_even, a_odd;
  int slot = 0;  // ring slot of the k-block being multiplied
  // The first kStages - 1 stages of the item just begun, from ring slot load_slot on.
  auto fill = [&]() {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) load_stage(s);
  };

  if (!begin_next_item()) return;
  fill();
  while (true) {
    cp_async::wait<kStages - 2>();  // the item's first stage
    wait_stage();
    if constexpr (kGroups == 1) {
      convert_block(slot, 0, a_even);
    } else {
      convert_group(slot, 0, std::integral_constant<int, 0>{}, a_even);
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

    // At the last k-block of a stage (not the item's last): wait for the next stage and publish it (the barrier also
    // means every warpgroup has retired the wgmma of the stage before this one), refill that one's slot kStages - 1
    // stages ahead, and move to the next slot.
    auto next_stage = [&](int k_block) {
      const int stage_index = k_block / kBlocksPerStage;
      cp_async::wait<kStages - 3>();  // stage stage_index + 1
      wait_stage();
      load_stage(stage_index + kStages - 1);  // into the slot of stage stage_index - 1
      slot = slot + 1 == kStages ? 0 : slot + 1;
    };
    // One k-block (k-block kSub of its stage): issue its wgmma, retire the previous one (so its A registers are
    // free, and at a stage's last k-block so is the previous stage's slot), then -- at a stage's last k-block --
    // publish the next stage and refill the freed slot kStages - 1 stages ahead; convert the next A fragments
    // while this wgmma runs. fence_operand keeps the compiler from reusing or moving registers that an in-flight
    // wgmma still reads (A) or writes (accumulators).
    auto step = [&](int k_block, auto sub_constant, AFragments& a_cur, AFragments& a_next) {
      constexpr int kSub = decltype(sub_constant)::value;
      wgmma::fence_operand(acc);
      wgmma::fence_operand(a_cur);
      wgmma::fence();
      // k-step s starts 32 B further (16 fp16 or 32 e4m3 values): + 2 in the descriptor's start field (address >> 4;
      // no carry out of it, shared addresses stay below 2^18).
      const uint64_t desc =
          wgmma::make_descriptor_sw128(smem_base + slot * G::kStageBytes + G::mma_tokens_offset(kSub));
      if constexpr (kFp8) {
#pragma unroll
        for (int s = 0; s < 2; ++s) wgmma::MmaRSE4M3<kTile>::run(acc, a_cur[s], desc + 2 * s);
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) wgmma::MmaRS<kTile>::run(acc, a_cur[s], desc + 2 * s);
      }
      wgmma::commit_group();
      wgmma::fence_operand(acc);
      wgmma::wait_group<1>();  // wgmma(k_block - 1) retired
      wgmma::fence_operand(a_next);
      if (k_block + 1 < num_k_blocks) {
        if (kSub == kBlocksPerStage - 1) {
          next_stage(k_block);
          convert_block(slot, 0, a_next);
        } else {
          convert_block(slot, kSub + 1, a_next);  // the next k-block of this stage (published with it)
        }
      }
    };
    // The same per group of k-steps (kGroups > 1): group g of k-block `k_block` (k-block kSub of its stage) reads A
    // set g % 2; after its commit, wait_group<1> retires the previous group (the previous k-block's last one for
    // g = 0), whose set the next group is converted into. At a stage's last k-block, the last group publishes the
    // next stage and refills the freed slot as `step` does (every warpgroup has retired all but its last group).
    auto group = [&](int k_block, auto sub_constant, auto group_constant, AGroup& a_cur,
                     AGroup& a_next) {
      constexpr int kSub = decltype(sub_constant)::value;
      constexpr int kGroup = decltype(group_constant)::value;
      wgmma::fence_operand(acc);
      wgmma::fence_operand(a_cur);
      wgmma::fence();
      const uint64_t desc =
          wgmma::make_descriptor_sw128(smem_base + slot * G::kStageBytes + G::mma_tokens_offset(kSub));
#pragma unroll
      for (int i = 0; i < kStepsPerGroup; ++i) {
        wgmma::MmaRS<kTile>::run(acc, a_cur[i], desc + 2 * (kGroup * kStepsPerGroup + i));
      }
      wgmma::commit_group();
      wgmma::fence_operand(acc);
      wgmma::wait_group<1>();  // the previous group retired
      wgmma::fence_operand(a_next);
      if (kGroup + 1 < kGroups) {
        convert_group(slot, kSub, std::integral_constant<int, (kGroup + 1) % kGroups>{}, a_next);
      } else if (k_block + 1 < num_k_blocks) {
        if (kSub == kBlocksPerStage - 1) {
          next_stage(k_block);
          convert_group(slot, 0, std::integral_constant<int, 0>{}, a_next);
        } else {
          convert_group(slot, (kSub + 1) % kBlocksPerStage, std::integral_constant<int, 0>{}, a_next);
        }
      }
    };
    auto step_groups = [&](int k_block, auto sub_constant) {
      group(k_block, sub_constant, std::integral_constant<int, 0>{}, a_even, a_odd);
      group(k_block, sub_constant, std::integral_constant<int, 1 % kGroups>{}, a_odd, a_even);
      if (kGroups == 4) {
        group(k_block, sub_constant, std::integral_constant<int, 2 % kGroups>{}, a_even, a_odd);
        group(k_block, sub_constant, std::integral_constant<int, 3 % kGroups>{}, a_odd, a_even);
      }
    };
    // Even k-blocks are k-block 0 of their stage; odd ones k-block 1 (or 0 with one k-block per stage).
    static_assert(kBlocksPerStage == 1 || kBlocksPerStage == 2, "k-blocks alternate between two A fragment sets");
    for (int k_block = 0; k_block < num_k_blocks; k_block += 2) {
      if constexpr (kGroups == 1) {
        step(k_block, std::integral_constant<int, 0>{}, a_even, a_odd);
        if (k_block + 1 < num_k_blocks) {
          step(k_block + 1, std::integral_constant<int, 1 % kBlocksPerStage>{}, a_odd, a_even);
        }
      } else {
        step_groups(k_block, std::integral_constant<int, 0>{});
        if (k_block + 1 < num_k_blocks) step_groups(k_block + 1, std::integral_constant<int, 1 % kBlocksPerStage>{});
      }
    }
    const WorkItem item = items[(item_seq - 1) & 1];
    // The epilogue's token factors: loaded now, stored to shared memory after the last wgmma has drained.
    const float factor = threadIdx.x < kTile ? token_factor<kFp8>(args, item, threadIdx.x) : 0.0f;
    uint64_t destination = 0;
    if (kCombineRows && threadIdx.x < item.valid_rows) {
      destination = combine_row_address(args.combine, item.first_row + threadIdx.x);
    }
    // Prefetch: only the last wgmma is in flight and it reads only `slot` (find_tile's barrier: every warpgroup has
    // retired the others and finished its conversions), so the next item's first stages go into the other slots.
    const int next_slot = slot + 1 == kStages ? 0 : slot + 1;
    bool has_next = false;
    auto start_next_item = [&]() {  // the next item, its first stages issued into the free ring slots
      has_next = begin_next_item();
      if (has_next) {
        load_slot = next_slot;
        fill();
      }
    };
    if (kPrefetchNextItem) start_next_item();
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
    // The previous item's epilogue read tile_factors before this item's stage barriers.
    if (threadIdx.x < kTile) {
      tile_factors[threadIdx.x] = factor;
      if (kCombineRows) tile_destinations[threadIdx.x] = destination;
    }
    if constexpr (kCombineRows) {
      // Every warpgroup takes part (spare ones stage columns >= n, which are not stored): the tile reuses the ring,
      // free once every copy has landed and every warpgroup's wgmma has retired.
      static_assert(kTile * CombineTile<kWarpGroups>::kBytesPerRow <= kStages * G::kStageBytes,
                    "the combine tile must fit in the pipeline ring");
      cp_async::wait<0>();
      __syncthreads();  // also publishes tile_factors and tile_destinations
      if constexpr (kEarlyStages > 0) {
        // The whole ring is free now: the next item's first stages go into the slots past the staged tile (its
        // stage 0 in slot kTileSlots), then the epilogue, then -- once every warp has read the tile -- the rest.
        has_next = begin_next_item();
        if (has_next) {
          load_slot = kTileSlots;
#pragma unroll
          for (int s = 0; s < kEarlyStages; ++s) load_stage(s);
        }
        store_combine_rows<kTile, kWarpGroups>(args, acc, tile_factors, tile_destinations,
                                               reinterpret_cast<__nv_bfloat16*>(smem), item);
        if (has_next) {
          __syncthreads();  // the staged tile's last reads, before its slots are refilled
#pragma unroll
          for (int s = kEarlyStages; s < kStages - 1; ++s) load_stage(s);
        }
      } else {
        store_combine_rows<kTile, kWarpGroups>(args, acc, tile_factors, tile_destinations,
                                               reinterpret_cast<__nv_bfloat16*>(smem), item);
        // The next item's loads start now (find_tile's barrier orders this epilogue's ring reads before them).
        start_next_item();
      }
    } else {
      __syncthreads();  // publishes tile_factors
      store_rows<kTile, kWarpGroups>(args, acc, tile_factors, item);
    }
    if (!has_next) return;
    slot = kEarlyStages > 0 ? kTileSlots : next_slot;  // where the next item's stage 0 went
  }
}

#endif  // EP_COMM_HAS_WGMMA

// Work items: item = tile slot * weight CTAs + weight CTA (weight CTAs fastest, so the CTAs running at one time share
// a few token tiles in L2). `persistent`: each CTA walks the items blockIdx.x, blockIdx.x + gridDim.x, ... until the
// slot is past the last tile, on a grid of what fits on the GPU at once (work_item_grid), so that a launch sized for
// the worst case (rows / tile + experts slots, without reading the counts on the host) pays neither a CTA launch
// nor a scan for every empty slot, and each CTA reads the expert counts once (TileCursor). Otherwise one item per
// CTA on a grid of every slot (measured faster for the 2-warpgroup, 3-CTA/SM shapes of the small token tiles when K
// is long: launch_tile). With waves (persistent too) CTAs take items from the wave work counter, so late CTAs take
// fewer (waves.h).
template <int kTile, int kWarpGroups, int kCtasPerSm, int kBlocksPerStage, bool kCombineRows, bool kFp8>
__global__ void __launch_bounds__(kWarpGroups * 128, kCtasPerSm)
    grouped_gemm_nvfp4_kernel(const GroupedGemmArgs args, const RowSplit split, const bool persistent) {
#if EP_COMM_HAS_WGMMA
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The 128-byte swizzle needs 1024-byte aligned tiles: align the ring explicitly (static shared memory may
  // precede the dynamic block).
  uint8_t* smem = smem_raw + ((1024 - (cp_async::smem_address(smem_raw) & 1023)) & 1023);
  __shared__ TileCursor cursor;
  __shared__ unsigned long long wave_epoch;
  if (threadIdx.x == 0) {
    cursor.base = 0;
    cursor.tiles_before = 0;
    cursor.loaded = false;
    wave_epoch = 0;
    if (args.wave.area != nullptr) {  // waves: the receive running beside us publishes the layout first
      const unsigned long long epoch = *reinterpret_cast<const volatile unsigned long long*>(args.wave.epoch);
      wave::wait_layout(args.wave, epoch);
      wave_epoch = epoch;
    }
  }
  __syncthreads();
  // Overlapped split: the next part may start now; its CTAs get SMs as this launch's CTAs finish.
  if (split.triggers_dependent()) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  gemm_items<kTile, kWarpGroups, kCtasPerSm, kBlocksPerStage, kCombineRows, kFp8>(args, split, smem, cursor,
                                                                                  persistent, wave_epoch);
  // Waves: complete only after the receive has; overlapped parts 3 and 2: only after the part launched before has
  // (kernels behind the last part keep plain stream order with all of them).
  if (args.wave.area != nullptr || split.is_dependent()) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

}  // namespace

namespace grouped_gemm_detail {

// Test hook: EP_COMM_GEMM_MAX_CTAS=n (n > 0) makes every launch -- the combine-row kernels too -- persistent on at
// most n CTAs, so that small problems run many work items per CTA (next-item prefetch, odd k-block counts at item
// boundaries, the scan cursor). 0 when unset or "0", -1 when set to anything else (launches are then refused).
int max_ctas_override() {
  static const int value = [] {
    const char* env = std::getenv("EP_COMM_GEMM_MAX_CTAS");
    if (!env || !*env) return 0;
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    return (*end != '\0' || n < 0 || n > (1L << 20)) ? -1 : static_cast<int>(n);
  }();
  return value;
}

}  // namespace grouped_gemm_detail

namespace {

template <int kTile, int kWarpGroups, int kCtasPerSm, int kBlocksPerStage = 1, bool kCombineRows = false,
          bool kFp8 = false>
cudaError_t launch_tile(const GroupedGemmArgs& args, const RowSplit split, int64_t tile_slots, cudaStream_t stream) {
  using G = Geometry<kTile, kWarpGroups, kCtasPerSm, kBlocksPerStage, kFp8>;
  auto* kernel = grouped_gemm_nvfp4_kernel<kTile, kWarpGroups, kCtasPerSm, kBlocksPerStage, kCombineRows, kFp8>;
  // The shared-memory opt-in is per kernel and device.
  static std::atomic<uint64_t> configured{0};
  const cudaError_t status = once_per_device(configured, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  });
  if (status != cudaSuccess) return status;
  // Persistent (as many CTAs as are resident at once, at most one per work item of the bound) for the one-CTA-per-SM
  // shapes of the large token tiles and for the remainder launch, whose slots are mostly empty; one CTA per item for
  // the small-tile shapes unless K is short (below). Same-call A/B on H200 against one CTA per item (bench/RESULTS.md,
  // eighth session): 128 rows per expert -2% (w1 + w2), MoE layer at 4096 tokens -1.7%; 16 rows per expert +3% if
  // persistent too (before the next-item prefetch of the ninth session).
  const bool waves = args.wave.area != nullptr;
  // The small-tile shapes too when K is short: an item of K <= 2048 (w2) is too short to amortize a CTA's launch and
  // pipeline fill, which the persistent CTAs' next-item prefetch hides. Measured on H200 (bench/RESULTS.md,
  // sixteenth session; 16 / 32 rows per expert): w2 (K = 2048) 0.44 -> 0.40 and 0.53 -> 0.47 ms persistent, w1
  // (K = 7168) 0.68 -> 0.71 and 0.78 -> 0.82 ms (the block scheduler's dynamic placement wins there).
  constexpr int64_t kPersistentSmallTileMaxK = 2048;
  const bool persistent = kCtasPerSm == 1 || split.part >= 2 || max_ctas_override() > 0 || waves ||
                          args.k <= kPersistentSmallTileMaxK;
  const int64_t weight_ctas = (args.n / kTileRows + kWarpGroups - 1) / kWarpGroups;
  int64_t grid = 0;
  const cudaError_t sized = work_item_grid(kernel, G::kThreads, G::kSmemBytes, weight_ctas * tile_slots, persistent,
                                           &grid);
  if (sized != cudaSuccess || grid == 0) return sized;
  // Waves: the programmatic dependent of the dispatch receive launched just before on this stream (waves.h);
  // overlapped parts 3 and 2: of the part launched before (RowSplit::overlap).
  const bool programmatic = waves || split.is_dependent();
  return launch_with_pdl(kernel, static_cast<unsigned>(grid), G::kThreads, G::kSmemBytes, stream, programmatic, args,
                         split, persistent);
}


// A tuning environment variable that must be one of `allowed` when set: 0 when unset, -1 when set to anything
// else, otherwise its digits read as one number ("4" -> 4, "2x3" -> 23: warpgroups then CTAs per SM).
int tuning_choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* env = std::getenv(name);
  if (!env || !*env) return 0;
  for (const char* a : allowed) {
    if (std::strcmp(env, a) != 0) continue;
    int value = 0;
    for (const char* c = a; *c; ++c) {
      if (*c >= '0' && *c <= '9') value = 10 * value + (*c - '0');
    }
    return value;
  }
  return -1;
}

// The default kernel of each token tile: 2 warpgroups x 3 CTAs per SM for tiles 16 / 32, 4 x 1 for 64 / 128 and the
// exact mode's wide tile 144 (the FP8 mode has none: nullptr, as for any other tile); the warp-specialized form
// (grouped_gemm_ws.cu) instead for the exact mode's tiles 128 and 144 when `warp_specialized`.
template <bool kCombineRows, bool kFp8>
LaunchFn default_kernel(int tile, bool warp_specialized) {
  if constexpr (!kFp8) {
    if (warp_specialized && (tile == 128 || tile == 144)) return warp_specialized_launch(tile, kCombineRows);
  }
  constexpr int kBlocks = kFp8 ? 2 : kDefaultBlocksPerStage;  // an FP8 stage holds two k-blocks (Geometry)
  switch (tile) {
    case 16: return launch_tile<16, 2, 3, kBlocks, kCombineRows, kFp8>;
    case 32: return launch_tile<32, 2, 3, kBlocks, kCombineRows, kFp8>;
    case 64: return launch_tile<64, 4, 1, kBlocks, kCombineRows, kFp8>;
    case 128: return launch_tile<128, 4, 1, kBlocks, kCombineRows, kFp8>;
    case 144:
      if constexpr (kFp8) return nullptr;
      else return launch_tile<144, 4, 1, kBlocks, kCombineRows, kFp8>;
    default: return nullptr;
  }
}

// The kernel for one launch of a token tile, or nullptr when a tuning override names a shape without a compiled
// kernel. Warpgroups per CTA: 4 (256 weight rows, one CTA per SM, each token tile read from L2 half as often) for
// token tiles of 64 and 128, where the MMA dominates; 2 with three CTAs per SM for
// 16 and 32, where the weight conversion dominates (issue-bound: ncu shows ~80% of issue slots busy at 16 rows per
// expert) and more resident warps hide its latencies. Measured on H200 (bench/RESULTS.md): 4 warpgroups are 1.3x
// faster at 128 rows per expert; at 16 rows 2x3 is 1.09x faster than 2x2 and 1.02x faster than 1x4. Tuning
// overrides (other values are refused): EP_COMM_GEMM_WARPGROUPS=2|4 for every tile (as many CTAs per SM as fit:
// 4 / warpgroups, one k-block per stage); EP_COMM_GEMM_SMALL_CTA=1x4|2x2|2x3|4x1 (warpgroups x CTAs per SM) for the
// token tiles 16 and 32; EP_COMM_GEMM_KBLOCKS_PER_STAGE=1|2 (pipeline stage size) for the default shapes. The
// combine-row epilogue (out_type 2) always takes the default kernel of its tile.
//
// Token tiles 128 and 144 of the exact mode take the warp-specialized form (grouped_gemm_ws.cu) instead of the
// default shape: bitwise the same results, 0.88-0.99x the time per launch kind (H200, bench/RESULTS.md, fifty-ninth
// session: w1 1.445-1.477 vs 1.530-1.555 ms and w2 0.79-0.81 vs 0.88-0.90 ms at 128 rows per expert, MoE layer
// experts 4.63-4.78 vs 5.13-5.26 ms at 4096 tokens). EP_COMM_GEMM_WS=0 keeps the classic kernel (A/B and bisection);
// so does a classic tuning override (EP_COMM_GEMM_WARPGROUPS or EP_COMM_GEMM_KBLOCKS_PER_STAGE set: those tune the
// classic kernel), and so does a driver without the tensor-map encoder (`tma_available` false; same results, slower).
LaunchFn select_kernel(int tile, bool combine_rows, bool fp8, bool tma_available) {
  static const int forced_warp_groups = tuning_choice("EP_COMM_GEMM_WARPGROUPS", {"2", "4"});
  static const int forced_small_cta = tuning_choice("EP_COMM_GEMM_SMALL_CTA", {"1x4", "2x2", "2x3", "4x1"});
  static const int forced_blocks_per_stage = tuning_choice("EP_COMM_GEMM_KBLOCKS_PER_STAGE", {"1", "2"});
  static const bool form_allowed = env_choice("EP_COMM_GEMM_WS", {"1", "0"}) == 0;
  const bool warp_specialized = form_allowed && tma_available;
  // The combine-row epilogue exists for the default kernels only (no tuning matrix): it ignores the tuning variables
  // (read above, once per process), so a tuning run of the bf16 kernels (or a mistyped value) leaves MoELayer's w2
  // working. (Only the test hook EP_COMM_GEMM_MAX_CTAS applies to it: launch_tile, work_item_grid.)
  if (combine_rows) {
    return fp8 ? default_kernel<true, true>(tile, false) : default_kernel<true, false>(tile, warp_specialized);
  }
  if (forced_warp_groups < 0 || forced_small_cta < 0 || forced_blocks_per_stage < 0) return nullptr;
  // The inexact FP8 mode's direct epilogues: the default shapes only too. The tuning variables do not apply to it (a
  // malformed one is still refused, above); neither does EP_COMM_GEMM_WIDE_TILE.
  if (fp8) return default_kernel<false, true>(tile, false);
  const bool tuned = forced_warp_groups != 0 || forced_blocks_per_stage != 0 || (tile <= 32 && forced_small_cta != 0);
  if (!tuned) return default_kernel<false, false>(tile, warp_specialized);
  const int blocks_per_stage = forced_blocks_per_stage ? forced_blocks_per_stage : kDefaultBlocksPerStage;
  int shape = forced_warp_groups ? 10 * forced_warp_groups + 4 / forced_warp_groups : (tile <= 32 ? 23 : 41);
  if (tile <= 32 && forced_small_cta) shape = forced_small_cta;
  const int key = tile * 100 + shape;  // tile, warpgroups, CTAs per SM
  if (blocks_per_stage == 2) {
    switch (key) {
      case 1623: return launch_tile<16, 2, 3, 2>;
      case 3223: return launch_tile<32, 2, 3, 2>;
      case 6441: return launch_tile<64, 4, 1, 2>;
      case 12841: return launch_tile<128, 4, 1, 2>;
      case 14441: return launch_tile<144, 4, 1, 2>;
      default: break;  // the tuning shapes have one k-block per stage
    }
  }
  switch (key) {
    case 1614: return launch_tile<16, 1, 4>;
    case 1622: return launch_tile<16, 2, 2>;
    case 1623: return launch_tile<16, 2, 3>;
    case 1641: return launch_tile<16, 4, 1>;
    case 3214: return launch_tile<32, 1, 4>;
    case 3222: return launch_tile<32, 2, 2>;
    case 3223: return launch_tile<32, 2, 3>;
    case 3241: return launch_tile<32, 4, 1>;
    case 6422: return launch_tile<64, 2, 2>;
    case 6441: return launch_tile<64, 4, 1>;
    case 12822: return launch_tile<128, 2, 2>;
    case 12841: return launch_tile<128, 4, 1>;
    default: return nullptr;
  }
}

}  // namespace

bool device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // the caller reports "not sm_90"; a later launch must not report this query's failure
    return false;
  }
  return major == 9 && minor == 0;
}

int grouped_gemm_auto_token_tile(int64_t num_rows_total, int num_experts) {
  const int64_t rows_per_expert = num_experts > 0 ? num_rows_total / num_experts : num_rows_total;
  if (rows_per_expert <= 16) return 16;
  if (rows_per_expert <= 32) return 32;
  if (rows_per_expert <= 64) return 64;
  return 128;
}

cudaError_t launch_grouped_gemm_nvfp4(const GroupedGemmArgs& args, cudaStream_t stream) {
  // FP8: x rows are e4m3 bytes, x_row_stride still counts 2-byte units; K % 128 (whole stages). Its operand rows come
  // from expand_nvfp4_rows, the quantizer's FP8 form or a wave receive's FP8 form; every epilogue and waves apply.
  if (args.num_experts <= 0 || args.n <= 0 || args.k <= 0 || args.n % kTileRows != 0 || args.k % kKBlock != 0 ||
      args.num_rows_total < 0 || args.x_row_stride < (args.fp8 ? args.k / 2 : args.k) || args.x_row_stride % 8 != 0 ||
      args.out_type < 0 || args.out_type > 2 || (args.swiglu && args.n % 16 != 0) ||
      (args.fp8 && args.k % (2 * kKBlock) != 0)) {
    return cudaErrorInvalidValue;
  }
  // Both forms copy x, the codes and the scales in 16-byte pieces (cp.async; bulk copies and TMA).
  if (reinterpret_cast<uintptr_t>(args.x) % 16 != 0 || reinterpret_cast<uintptr_t>(args.w_values) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(args.w_scales) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const bool combine_rows = args.out_type == 2;
  if (combine_rows) {
    const GroupedGemmArgs::CombineRows& c = args.combine;
    if (args.swiglu || !c.bases || !c.src_rank || !c.src_token || !c.topk_slot || c.topk <= 0 || c.num_ranks <= 0 ||
        c.max_tokens <= 0 || c.offset < 0 ||
        c.offset % 16 != 0 || c.row_bytes % 16 != 0 || c.scale_offset < args.n ||
        c.scale_offset + args.n / 32 > c.row_bytes) {
      return cudaErrorInvalidValue;  // 16-byte code stores: aligned area and rows
    }
  } else if (args.out_row_stride < (args.swiglu ? args.n / 2 : args.n) || args.out_row_stride % 2 != 0 ||
             (args.row_amax != nullptr && !args.swiglu) ||
             reinterpret_cast<uintptr_t>(args.out) % (args.out_type == 0 ? 8 : 4) != 0) {
    return cudaErrorInvalidValue;  // the epilogue stores column pairs: even row stride, aligned output
  }
  if (args.num_rows_total == 0) return cudaSuccess;
  if (!device_is_sm90()) return cudaErrorNotSupported;
  const bool auto_tile = args.token_tile == 0;
  const int tile = auto_tile ? grouped_gemm_auto_token_tile(args.num_rows_total, args.num_experts) : args.token_tile;
  if (tile != 16 && tile != 32 && tile != 64 && tile != 128) return cudaErrorInvalidValue;
  int tail_tile = args.tail_tile >= 0 ? args.tail_tile : (tile == 128 ? 32 : 0);
  if (tail_tile != 0 && tail_tile != 16 && tail_tile != 32 && tail_tile != 64) return cudaErrorInvalidValue;
  if (tail_tile >= tile) {
    // A remainder tile must be smaller than the main one. With an explicit token tile that is a caller error; with
    // the automatic tile (chosen from the row count) the split is simply off for this call.
    if (!auto_tile) return cudaErrorInvalidValue;
    tail_tile = 0;
  }
  // Every kernel is resolved before any launches, so a refused tuning override cannot leave out half written.
  // (The form's TMA needs the driver's tensor-map encoder: without it the classic kernel runs, same results.)
  const bool tma_available = tensor_map_encoder() != nullptr;
  const LaunchFn main_kernel = select_kernel(tile, combine_rows, args.fp8, tma_available);
  const LaunchFn tail_kernel = tail_tile ? select_kernel(tail_tile, combine_rows, args.fp8, tma_available) : nullptr;
  if (!main_kernel || (tail_tile && !tail_kernel)) return cudaErrorInvalidValue;
  // Wide last tiles (RowSplit::wide_tile): with the split on and token tile 128, on by default (EP_COMM_GEMM_WIDE_TILE=144;
  // =0 off). Measured on H200 at routed ~256 rows per expert (bench/RESULTS.md, eighteenth session): w1 3.31-3.36 vs
  // 3.44-3.45 ms, w2 1.86-1.87 vs 1.98 ms, MoE layer (world 1, graph) 5.80-5.81 vs 6.12-6.13 ms. Only the default CTA
  // shape has a 144 kernel: under a tuning override without one the wide launch is simply left out.
  static const bool wide_allowed = env_choice("EP_COMM_GEMM_WIDE_TILE", {"144", "0"}) == 0;
  const LaunchFn wide_kernel = wide_allowed && !args.fp8 && tail_tile != 0 && tile == 128
                                   ? select_kernel(144, combine_rows, false, tma_available)
                                   : nullptr;
  const int wide_tile = wide_kernel ? 144 : 0;
  // sum_e ceil(count_e / tile) <= rows / tile + E bounds the tiles of any launch (segments do not overlap:
  // expert_offsets is non-decreasing).
  const int64_t tile_slots = (args.num_rows_total + tile - 1) / tile + args.num_experts;
  if (tail_tile == 0) return main_kernel(args, RowSplit{}, tile_slots, stream);
  // The two parts overlap (RowSplit::overlap) unless waves (the remainder rows may still be arriving while the main
  // part runs) or EP_COMM_GEMM_TAIL_OVERLAP=0 (measurements).
  static const bool overlap_allowed = env_choice("EP_COMM_GEMM_TAIL_OVERLAP", {"1", "0"}) == 0;
  const bool overlap = overlap_allowed && args.wave.area == nullptr;
  cudaError_t status = main_kernel(args, RowSplit{1, tile, tail_tile, overlap, wide_tile}, tile_slots, stream);
  if (status != cudaSuccess) return status;
  // With waves the main part has completed (after the receive, see the kernel's end) before the later parts start:
  // they need no waves.
  GroupedGemmArgs later_args = args;
  later_args.wave = WaveSync{};
  if (wide_tile) {
    const int64_t wide_slots = (args.num_rows_total + wide_tile - 1) / wide_tile + args.num_experts;
    status = wide_kernel(later_args, RowSplit{3, tile, tail_tile, overlap, wide_tile}, wide_slots, stream);
    if (status != cudaSuccess) return status;
  }
  // Every small remainder fits one tail tile: at most one tile per expert.
  const int64_t tail_slots = args.num_experts < tile_slots ? args.num_experts : tile_slots;
  return tail_kernel(later_args, RowSplit{2, tile, tail_tile, overlap, wide_tile}, tail_slots, stream);
}

}  // namespace ep_comm
