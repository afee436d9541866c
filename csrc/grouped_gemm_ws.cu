// NVFP4 x NVFP4 grouped GEMM, warp-specialized form: the default kernel of the exact mode's token tiles 128 and 144
// (select_kernel in grouped_gemm.cu; EP_COMM_GEMM_WS=0 keeps the classic kernel). docs/GEMM.md §4(a).
//
// The same work items, k order per output element and epilogue formulas as the classic kernel (grouped_gemm.cu; the
// shared pieces are in grouped_gemm_tiles.cuh), so its results are bitwise the classic kernel's
// (tests/test_grouped_gemm.py checks that). What differs is who does what:
// * warpgroup 0 is the producer. Its warp 0 finds the items (scan_tiles) and its lane 0 issues every load of a stage
//   as bulk copies completing on the stage's "full" mbarrier: the four weight tiles' codes and scales (stored in the
//   packed order shared memory wants: one contiguous copy per tile and stage) and the token tile by TMA (a tensor map
//   over x, 128-byte swizzle: the wgmma B layout). It runs up to kStages stages ahead, across work items, so the next
//   item's loads land while the consumers run the epilogue. It gives registers back (setmaxnreg.dec).
// * warpgroups 1 and 2 are consumers of 128 weight rows each (two 64-row tiles: two m64n128 accumulators, 128
//   registers, and the even / odd A sets of both tiles, 64 registers), claiming 232 registers (setmaxnreg.inc; the
//   launch cap of 384 threads is 168). They wait on "full", decode, issue the wgmma and release the stage on "empty"
//   once its last wgmma has retired: no CTA barrier, no cp.async bookkeeping and no load addresses in the MMA warps.
// Measured on H200 against the classic kernel's default shape (bench/RESULTS.md, fifty-ninth session): w1 0.94x and
// w2 0.88x the time at 128 rows per expert, 0.88-0.93x for the experts of the MoE layer at 4096 tokens (docs/GEMM.md
// §4(a)). A variant with clusters of two CTAs sharing the token tile by TMA multicast measured no better overall
// (at 128 rows per expert w1 and w2 equal, combine rows and the whole MLP 2-3% slower; at ~256 w1 slower, w2 and the
// MLP equal or slightly faster) and was removed.
// Rows of a token tile past the expert's count are not zero-filled: the TMA reads whatever rows follow in x (zeros
// past its end; behind a wave receive, rows of other experts that may still be landing). Such a row only feeds its own
// output column (the token), which the epilogue never stores.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "grouped_gemm.h"
#include "grouped_gemm_tiles.cuh"
#include "pdl_launch.cuh"
#include "tensor_map.h"
#include "tma.cuh"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

using namespace grouped_gemm_detail;

namespace ws {
constexpr int kConsumers = 2;    // consumer warpgroups
constexpr int kWeightTiles = 4;  // 64-row weight tiles per CTA (256 weight rows), two per consumer
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBlocksPerStage = 2;
constexpr int kTileValueBytes = 128 * kValueBytes;  // one tile's codes of one k-block
// A stage: codes [tile][k-block][thread] x 16 B, scales [tile][k-block] x 256 B, tokens [k-block][row] x 128 B.
constexpr int kScalesOffset = kWeightTiles * kBlocksPerStage * kTileValueBytes;                   // 16 KiB
constexpr int kTokensOffset = kScalesOffset + kWeightTiles * kBlocksPerStage * kTileScaleBytes;  // 18 KiB
constexpr int kMaxStages = 4;
// Work items in flight between the producer and the consumers: the producer writes item n's entry once the slot of
// item n's first stage is free, i.e. after the consumers released a stage of item n - kStages or later, which they do
// only after reading that item's entry; so kStages + 1 entries suffice.
constexpr int kItemSlots = 8;
static_assert(kItemSlots >= kMaxStages + 1, "an item entry is rewritten only after its consumers have read it");
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
// The launch gets 168 registers per thread (65536 / 384, rounded down to a multiple of 8; ptxas reports that count
// for a kernel with setmaxnreg): the consumers' setmaxnreg.inc waits until the pool of 168 x 384 covers their claim
// and the producer's remainder, so a claim beyond it would hang (the producer's watchdog would then trap).
constexpr int kLaunchRegisters = (65536 / kThreads) / 8 * 8;
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= kLaunchRegisters * kThreads,
              "the register pool of the launch");
}  // namespace ws

// Token tile kTile (128, or 144: the wide last tiles of RowSplit part 3). The ring of the
// direct epilogues: 4 stages. The combine-row epilogue (kCombineRows) stages its bf16 output tile (CombineTile, 66 KiB)
// outside the ring, which the producer keeps filling with the next item's stages meanwhile: 3 stages then, so that
// ring and tile fit the 227 KiB a CTA may have.
template <int kTile, bool kCombineRows>
struct WsGeometry {
  static constexpr int kTokenBlockBytes = kTile * 128;
  static constexpr int kStageBytes = ws::kTokensOffset + ws::kBlocksPerStage * kTokenBlockBytes;  // 50 / 54 KiB
  static_assert(ws::kTokensOffset % 1024 == 0 && kStageBytes % 1024 == 0, "token tiles start 1024-byte aligned");
  static constexpr int kStages = kCombineRows ? 3 : ws::kMaxStages;
  static constexpr int kStagingOffset = kStages * kStageBytes;  // 1024-aligned
  // Tokens staged at a time: the whole tile of 128; a tile of 144 in two halves of 72 (144 rows beside the ring would
  // not fit).
  static constexpr int kStagedTokens = kTile > 128 ? kTile / 2 : kTile;
  static constexpr int kStagingBytes =
      kCombineRows ? kStagedTokens * CombineTile<ws::kWeightTiles>::kBytesPerRow : 0;
  static constexpr int kSmemBytes = kStagingOffset + kStagingBytes + 1024;  // + room to align the ring
  static_assert(kSmemBytes + 8 * 1024 <= 232448, "the ring, the staging and the static shared memory in 227 KiB");
  static_assert(kTile % 8 == 0 && kTile <= 256, "a TMA box of at most 256 rows, 8-row swizzle groups");
};

struct WsParams {
  CUtensorMap x_map;  // fp16 x [num_rows_total, k], box 64 (k) x kTile (rows), 128-byte swizzle
  GroupedGemmArgs args;
  RowSplit split;
};

#if EP_COMM_HAS_WGMMA
// The producer warp: every stage of the CTA's items into the ring, and each item's entry (an entry with expert -1,
// published by a plain arrival on the next stage's "full" barrier, ends the consumers); then it waits, with the
// timeout, until every consumer warp is done (ws_consume).
template <int kTile, bool kCombineRows>
__device__ __forceinline__ void ws_produce(const WsParams& p, TileCursor& cursor, WorkItem* items, uint32_t ring,
                                           uint32_t full_bars, uint32_t empty_bars, uint32_t done_bar) {
  using G = WsGeometry<kTile, kCombineRows>;
  constexpr int kStages = G::kStages;
  const GroupedGemmArgs& args = p.args;
  const int lane = threadIdx.x;  // warp 0
  const int num_weight_tiles = args.n / kTileRows;
  const int num_weight_ctas = (num_weight_tiles + ws::kWeightTiles - 1) / ws::kWeightTiles;
  const int num_k_blocks = args.k / kKBlock;
  const int stages_per_item = (num_k_blocks + ws::kBlocksPerStage - 1) / ws::kBlocksPerStage;
  const uint8_t* w_values = reinterpret_cast<const uint8_t*>(args.w_values);
  // Waves: the receive running beside us publishes the layout first; items come from the
  // wave work counter (dynamic: CTAs that start late, on SMs the receive frees, take fewer), and a tile's loads start
  // once every row of its expert is in (as find_tile does for the classic kernel).
  const bool waves = args.wave.area != nullptr;
  unsigned long long wave_epoch = 0;
  if (waves && lane == 0) {
    wave_epoch = *reinterpret_cast<const volatile unsigned long long*>(args.wave.epoch);
    wave::wait_layout(args.wave, wave_epoch);
  }
  if (lane == 0) tma::prefetch_map(&p.x_map);
  // Lane 0 issues every load and reads these; the other lanes take part in scan_tiles only, but keep them in step (an
  // add per item; dropping it changes the compiled kernels, so it waits for a session that can test and time that).
  uint32_t flat = 0;  // stages issued so far (ring slot flat % kStages, pass flat / kStages)
  int seq = 0;        // items started
  // (The launcher bounds items + CTAs < 2^31.) Item = token tile slot * weight CTAs + weight CTA, as in the classic
  // kernel.
  for (int item = blockIdx.x;; item += gridDim.x) {
    if (waves) {
      int taken = 0;
      if (lane == 0) taken = static_cast<int>(atomicAdd(args.wave.area + kWaveWorkCounter, 1ull));
      item = __shfl_sync(0xFFFFFFFFu, taken, 0);
    }
    __syncwarp();  // lane 0's cursor writes of the previous scan (and its layout wait), before the other lanes read
    const FoundTile tile = scan_tiles<kTile>(args, p.split, item / num_weight_ctas, cursor);
    const int weight_cta = item % num_weight_ctas;
    if (lane == 0) {
      if (waves && tile.expert >= 0) {
        wave::wait_rows(args.wave, tile.expert, wave_epoch, clamped_count(args, tile.expert));
        // The rows were written by the receive's generic stores and acquired above; the TMA reads them through the
        // async proxy.
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
      const uint32_t s = flat % kStages;
      tma::wait(empty_bars + 8 * s, ((flat / kStages) & 1) ^ 1);
      items[seq % ws::kItemSlots] = WorkItem{tile, weight_cta};
      if (tile.expert < 0) tma::arrive(full_bars + 8 * s);  // no more items: the consumers stop here
    }
    ++seq;
    if (tile.expert < 0) break;
    if (lane == 0) {
      int64_t tile_index[ws::kWeightTiles];
#pragma unroll
      for (int j = 0; j < ws::kWeightTiles; ++j) {
        // A spare tile of the last weight CTA loads tile 0 again (computed, never stored: the classic kernel's rule).
        const int weight_tile = weight_cta * ws::kWeightTiles + j;
        tile_index[j] = static_cast<int64_t>(tile.expert) * num_weight_tiles +
                        (weight_tile < num_weight_tiles ? weight_tile : 0);
      }
      for (int st = 0; st < stages_per_item; ++st, ++flat) {
        const uint32_t s = flat % kStages;
        if (st > 0) tma::wait(empty_bars + 8 * s, ((flat / kStages) & 1) ^ 1);
        const uint32_t stage = ring + s * G::kStageBytes;
        const uint32_t full = full_bars + 8 * s;
        const int first_block = st * ws::kBlocksPerStage;
        const int blocks = num_k_blocks - first_block < ws::kBlocksPerStage ? num_k_blocks - first_block
                                                                             : ws::kBlocksPerStage;
        tma::arrive_expect_bytes(
            full, blocks * (ws::kWeightTiles * (ws::kTileValueBytes + kTileScaleBytes) + G::kTokenBlockBytes));
#pragma unroll
        for (int j = 0; j < ws::kWeightTiles; ++j) {
          const int64_t block = tile_index[j] * num_k_blocks + first_block;
          tma::load_bytes(stage + j * ws::kBlocksPerStage * ws::kTileValueBytes, w_values + block * ws::kTileValueBytes,
                          blocks * ws::kTileValueBytes, full);
          tma::load_bytes(stage + ws::kScalesOffset + j * ws::kBlocksPerStage * kTileScaleBytes,
                          args.w_scales + block * kTileScaleBytes, blocks * kTileScaleBytes, full);
        }
        for (int b = 0; b < blocks; ++b) {
          const uint32_t tokens = stage + ws::kTokensOffset + b * G::kTokenBlockBytes;
          const int32_t k0 = (first_block + b) * kKBlock;
          tma::load_2d(tokens, &p.x_map, full, k0, tile.first_row);
        }
      }
    } else {
      flat += stages_per_item;
    }
  }
  if (lane == 0) tma::wait(done_bar, 0);
}

// A consumer warpgroup (`consumer` 0 or 1: weight tiles 2 consumer and 2 consumer + 1 of the CTA's four). Its waits
// have no timeout (tma::wait_untimed: a trap here would cost every wgmma its registers); each warp arrives on
// `done_bar` when it leaves, and the producer waits for that with the timeout, so a barrier that never completes traps
// there instead of hanging.
// `smem` is the ring's generic address (the combine-row staging area lies past the ring), `ring` its shared-window
// address.
template <int kTile, bool kCombineRows>
__device__ __forceinline__ void ws_consume(const GroupedGemmArgs& args, const WorkItem* items,
                                           float (*tile_factors)[kTile], uint64_t (*tile_destinations)[kTile],
                                           uint8_t* smem, uint32_t ring, uint32_t full_bars,
                                           uint32_t empty_bars, uint32_t done_bar) {
  using G = WsGeometry<kTile, kCombineRows>;
  constexpr int kStages = G::kStages;
  const int consumer = threadIdx.x / 128 - 1;
  const int thread_in_group = threadIdx.x % 128;
  const int lane = threadIdx.x % 32;
  const int row_r0 = 16 * (thread_in_group / 32) + lane / 4;  // tile rows r0 and r0 + 8
  const int num_weight_tiles = args.n / kTileRows;
  const int num_k_blocks = args.k / kKBlock;
  uint32_t flat = 0;  // stages consumed so far
  int seq = 0;
  float acc0[kTile / 2], acc1[kTile / 2];
  // Tiles above 128 tokens (72 accumulators per tile) cannot also hold two whole k-blocks of A fragments of both tiles
  // in 232 registers (ptxas serializes every wgmma): they double-buffer A per group of two k-steps, as the classic
  // kernel's wide tile does (the k order per accumulator is the same).
  constexpr int kStepsPerGroup = kTile > 128 ? 2 : 4;
  constexpr int kGroups = 4 / kStepsPerGroup;
  using AFragments = uint32_t[kStepsPerGroup][4];
  AFragments a0_even, a1_even, a0_odd, a1_odd;  // [k-step][register] of tiles 0 / 1, even / odd k-blocks (groups)
  // This consumer's A fragments of both its tiles, group kGroup's k-steps of k-block `sub` of the stage at ring offset
  // `stage_offset`; the k-block's scale words are read at its group 0 and kept (tile t, rows r0 / r0 + 8).
  uint32_t group_scales[2][2] = {{0u, 0u}, {0u, 0u}};
  auto decode_group = [&](uint32_t stage_offset, int sub, auto group_constant, AFragments& a0, AFragments& a1) {
    constexpr int kGroup = decltype(group_constant)::value;
    const uint8_t* stage = smem + stage_offset;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int j = 2 * consumer + t;
      const uint8_t* values =
          stage + (j * ws::kBlocksPerStage + sub) * ws::kTileValueBytes + thread_in_group * kValueBytes;
      const uint8_t* scales = stage + ws::kScalesOffset + (j * ws::kBlocksPerStage + sub) * kTileScaleBytes;
      decode_k_step_group<kStepsPerGroup, kGroup>(values, scales, row_r0, group_scales[t], t == 0 ? a0 : a1);
    }
  };
  while (true) {
    uint32_t s = flat % kStages;
    tma::wait_untimed(full_bars + 8 * s, (flat / kStages) & 1);
    const WorkItem item = items[seq % ws::kItemSlots];
    ++seq;
    if (item.expert < 0) break;
    decode_group(s * G::kStageBytes, 0, std::integral_constant<int, 0>{}, a0_even, a1_even);
#pragma unroll
    for (int i = 0; i < kTile / 2; ++i) acc0[i] = acc1[i] = 0.0f;
    // Group kGroup of k-block `k_block` (k-block kSub of its stage; one group of four k-steps per k-block at tile 128,
    // two of two at 144): its wgmma (the k-steps of both tiles, the tiles interleaved) read A set even / odd, which
    // alternates group by group; after its commit, wait_group<1> retires the group before it -- the previous
    // k-block's last one for group 0, so at a stage's first k-block the previous stage is then free -- and the next
    // group is decoded into that group's set (waiting for its stage first when it starts one).
    auto group = [&](int k_block, auto sub_constant, auto group_constant, AFragments& c0, AFragments& c1,
                     AFragments& n0, AFragments& n1) {
      constexpr int kSub = decltype(sub_constant)::value;
      constexpr int kGroup = decltype(group_constant)::value;
      wgmma::fence_operand(acc0);
      wgmma::fence_operand(acc1);
      wgmma::fence_operand(c0);
      wgmma::fence_operand(c1);
      wgmma::fence();
      const uint64_t desc =
          wgmma::make_descriptor_sw128(ring + s * G::kStageBytes + ws::kTokensOffset + kSub * G::kTokenBlockBytes);
#pragma unroll
      for (int i = 0; i < kStepsPerGroup; ++i) {
        const int k_step = kGroup * kStepsPerGroup + i;
        wgmma::MmaRS<kTile>::run(acc0, c0[i], desc + 2 * k_step);
        wgmma::MmaRS<kTile>::run(acc1, c1[i], desc + 2 * k_step);
      }
      wgmma::commit_group();
      wgmma::fence_operand(acc0);
      wgmma::fence_operand(acc1);
      wgmma::wait_group<1>();  // the previous group retired
      wgmma::fence_operand(n0);
      wgmma::fence_operand(n1);
      if (kGroup == 0 && kSub == 0 && k_block > 0) {  // that group was the previous stage's last
        __syncwarp();
        if (lane == 0) tma::arrive(empty_bars + 8 * ((flat - 1) % kStages));
      }
      if (kGroup + 1 < kGroups) {
        decode_group(s * G::kStageBytes, kSub, std::integral_constant<int, (kGroup + 1) % kGroups>{}, n0, n1);
      } else if (k_block + 1 < num_k_blocks) {
        if (kSub == ws::kBlocksPerStage - 1) {
          ++flat;
          s = flat % kStages;
          tma::wait_untimed(full_bars + 8 * s, (flat / kStages) & 1);
          decode_group(s * G::kStageBytes, 0, std::integral_constant<int, 0>{}, n0, n1);
        } else {
          decode_group(s * G::kStageBytes, kSub + 1, std::integral_constant<int, 0>{}, n0, n1);
        }
      }
    };
    static_assert(ws::kBlocksPerStage == 2, "even k-blocks are k-block 0 of their stage, odd ones k-block 1");
    static_assert(kGroups == 1 || kGroups == 2, "one or two k-step groups per k-block");
    for (int k_block = 0; k_block < num_k_blocks; k_block += 2) {
      if constexpr (kGroups == 1) {
        group(k_block, std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{}, a0_even, a1_even, a0_odd,
              a1_odd);
        if (k_block + 1 < num_k_blocks) {
          group(k_block + 1, std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{}, a0_odd, a1_odd,
                a0_even, a1_even);
        }
      } else {
        group(k_block, std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{}, a0_even, a1_even, a0_odd,
              a1_odd);
        group(k_block, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{}, a0_odd, a1_odd, a0_even,
              a1_even);
        if (k_block + 1 < num_k_blocks) {
          group(k_block + 1, std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{}, a0_even, a1_even,
                a0_odd, a1_odd);
          group(k_block + 1, std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, a0_odd, a1_odd,
                a0_even, a1_even);
        }
      }
    }
    // The epilogue's token factors (and the combine rows' addresses), token t loaded by consumer thread t (tokens
    // 128.. of a tile of 144 by consumer 1), issued before the last wgmma drains.
    const int my_token = 128 * consumer + thread_in_group;
    const float factor = my_token < kTile ? token_factor<false>(args, item, my_token) : 0.0f;
    uint64_t destination = 0;
    if (kCombineRows && my_token < item.valid_rows) {
      destination = combine_row_address(args.combine, item.first_row + my_token);
    }
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc0);
    wgmma::fence_operand(acc1);
    __syncwarp();
    if (lane == 0) tma::arrive(empty_bars + 8 * (flat % kStages));  // the item's last stage
    ++flat;
    // Two buffers by item parity: an item's factors (and combine-row addresses) are rewritten two items later, after
    // the barrier of the item in between, which every consumer passes only after this item's epilogue.
    float* factors = tile_factors[seq & 1];
    if (my_token < kTile) {
      factors[my_token] = factor;
      if (kCombineRows) tile_destinations[seq & 1][my_token] = destination;
    }
    tma::named_barrier(1, 128 * ws::kConsumers);  // (also: every consumer is done with the previous item's staging)
    if constexpr (kCombineRows) {
      // The combine-row epilogue of the classic kernel, over the 256 columns of both consumers (4 tiles of 64, the
      // spare ones staged and not stored) and the 8 consumer warps, through the staging area past the ring.
      __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(smem + G::kStagingOffset);
      const int column = 16 * (thread_in_group / 32) + 2 * (lane / 4);
      constexpr int kStaged = G::kStagedTokens;
      auto stage_and_send = [&](auto first_constant) {  // tokens kFirst .. kFirst + kStaged - 1
        constexpr int kFirst = decltype(first_constant)::value;
        stage_combine_tile<kTile, ws::kWeightTiles, kFirst, kStaged>(acc0, factors, staging,
                                                                     64 * (2 * consumer) + column);
        stage_combine_tile<kTile, ws::kWeightTiles, kFirst, kStaged>(acc1, factors, staging,
                                                                     64 * (2 * consumer + 1) + column);
        tma::named_barrier(1, 128 * ws::kConsumers);
        send_combine_rows<kStaged, ws::kWeightTiles, 4 * ws::kConsumers>(args, tile_destinations[seq & 1], staging,
                                                                         item, (threadIdx.x - 128) / 32, kFirst);
      };
      stage_and_send(std::integral_constant<int, 0>{});
      if constexpr (kStaged < kTile) {
        static_assert(2 * kStaged == kTile, "two halves");
        tma::named_barrier(1, 128 * ws::kConsumers);  // every consumer is done with the first half's staging
        stage_and_send(std::integral_constant<int, kStaged>{});
      }
    } else {
      const int weight_tile = item.weight_cta * ws::kWeightTiles + 2 * consumer;
      if (weight_tile < num_weight_tiles) store_tile_rows<kTile>(args, acc0, factors, item, weight_tile);
      if (weight_tile + 1 < num_weight_tiles) store_tile_rows<kTile>(args, acc1, factors, item, weight_tile + 1);
    }
  }
  __syncwarp();
  if (lane == 0) tma::arrive(done_bar);  // the producer's watchdog (its wait on done_bar has the timeout)
}
#endif  // EP_COMM_HAS_WGMMA

template <int kTile, bool kCombineRows>
__global__ void __launch_bounds__(ws::kThreads, 1) grouped_gemm_nvfp4_ws_kernel(const __grid_constant__ WsParams p) {
#if EP_COMM_HAS_WGMMA
  constexpr int kStages = WsGeometry<kTile, kCombineRows>::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (cp_async::smem_address(smem_raw) & 1023)) & 1023);
  const uint32_t ring = cp_async::smem_address(smem);
  __shared__ __align__(8) uint64_t full_barriers[kStages];
  __shared__ __align__(8) uint64_t empty_barriers[kStages];
  __shared__ __align__(8) uint64_t done_barrier;
  __shared__ WorkItem items[ws::kItemSlots];
  __shared__ __align__(16) float tile_factors[2][kTile];
  __shared__ uint64_t tile_destinations[kCombineRows ? 2 : 1][kTile];  // combine-row addresses
  __shared__ TileCursor cursor;
  const uint32_t full_bars = cp_async::smem_address(full_barriers);
  const uint32_t empty_bars = cp_async::smem_address(empty_barriers);
  const uint32_t done_bar = cp_async::smem_address(&done_barrier);
  if (threadIdx.x == 0) {
    cursor.base = 0;
    cursor.tiles_before = 0;
    cursor.loaded = false;
    for (int s = 0; s < kStages; ++s) {
      tma::barrier_init(full_bars + 8 * s, 1);  // the producer's arrive_expect_bytes (+ the loads' bytes)
      tma::barrier_init(empty_bars + 8 * s, ws::kConsumers * 4);  // every consumer warp
    }
    tma::barrier_init(done_bar, ws::kConsumers * 4);  // every consumer warp of this CTA, once
    tma::fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialized before any load or wait reaches them
  // Overlapped split: the next part may start now; its CTAs get SMs as this launch's CTAs finish.
  if (p.split.triggers_dependent()) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Each role ends on its own (no code after the branches): ptxas budgets the code after a setmaxnreg at its count,
  // and a shared tail would be reached with both.
  auto finish = [&]() {
    // Waves: complete only after the receive has; overlapped parts 3 and 2: only after the part launched before has.
    if (p.args.wave.area != nullptr || p.split.is_dependent()) asm volatile("griddepcontrol.wait;" ::: "memory");
  };
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(ws::kProducerRegisters));
    if (threadIdx.x < 32) {
      ws_produce<kTile, kCombineRows>(p, cursor, items, ring, full_bars, empty_bars, done_bar);
    }
    finish();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws::kConsumerRegisters));
  ws_consume<kTile, kCombineRows>(p.args, items, tile_factors, tile_destinations, smem, ring, full_bars, empty_bars,
                                  done_bar);
  finish();
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

// The launch, persistent: as many CTAs as are resident at once (one per SM), at most one per work item (a token tile
// against a weight CTA of 256 rows).
template <int kTile, bool kCombineRows>
cudaError_t launch_ws_tile(const GroupedGemmArgs& args, const RowSplit split, int64_t tile_slots, cudaStream_t stream) {
  using G = WsGeometry<kTile, kCombineRows>;
  auto* kernel = grouped_gemm_nvfp4_ws_kernel<kTile, kCombineRows>;
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  WsParams params{};
  params.args = args;
  params.split = split;
  // x as a [num_rows_total, k] fp16 tensor in boxes of 64 k x kTile rows (the wgmma B layout); rows past its end read
  // as zeros.
  static_assert(kKBlock == 64, "boxes of 64 k: encode_k_major_operand");
  if (!encode_k_major_operand(encode, &params.x_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, args.x, args.num_rows_total,
                              args.x_row_stride, args.k, kTile)) {
    return cudaErrorInvalidValue;
  }
  static std::atomic<uint64_t> configured{0};
  cudaError_t status = once_per_device(configured, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  });
  if (status != cudaSuccess) return status;
  const int64_t weight_ctas = (args.n / kTileRows + ws::kWeightTiles - 1) / ws::kWeightTiles;
  int64_t grid = 0;
  status = work_item_grid(kernel, ws::kThreads, G::kSmemBytes, weight_ctas * tile_slots, true, &grid);
  if (status != cudaSuccess || grid == 0) return status;
  // Waves: the programmatic dependent of the dispatch receive launched just before on this stream (waves.h);
  // overlapped parts 3 and 2: of the part launched before (RowSplit::overlap).
  const bool programmatic = args.wave.area != nullptr || split.is_dependent();
  return launch_with_pdl(kernel, static_cast<unsigned>(grid), ws::kThreads, G::kSmemBytes, stream, programmatic,
                         params);
}

}  // namespace

namespace grouped_gemm_detail {

LaunchFn warp_specialized_launch(int tile, bool combine_rows) {
  switch (tile) {
    case 128: return combine_rows ? launch_ws_tile<128, true> : launch_ws_tile<128, false>;
    case 144: return combine_rows ? launch_ws_tile<144, true> : launch_ws_tile<144, false>;
    default: return nullptr;
  }
}

}  // namespace grouped_gemm_detail
}  // namespace ep_comm
