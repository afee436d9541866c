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
// CTA = kWarpGroups (2 or 4) warpgroups; warpgroup g owns weight tile mt = cta * kWarpGroups + g (64 rows) and all
// of the CTA's token tile (kTile tokens of one expert). Every thread streams its own packed weight bytes
// (16 B of codes per 64-wide k-block) with cp.async into a private smem slot; 16 lanes of each warpgroup copy
// the tile's 256 scale bytes; the token tile is shared and published with a barrier. kStages-deep ring of
// stages of kBlocksPerStage k-blocks; stage st + kStages - 1 is loaded into the slot of st - 1 once every wgmma
// that read it has retired.
//
// Weight decode (layout in ep_comm/grouped_gemm.py): for pair j of a k-step word w,
//   ((w & F_j) * M_j) & 0x8E008E00 (32-bit; decode_pair0..3 below) is the fp16x2 of the two E2M1 values * 2^-14
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
#include "pdl_launch.cuh"
#include "s2f6_lane.cuh"
#include "tensor_map.h"
#include "tma.cuh"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

constexpr int kKBlock = 64;      // k elements per k-block (4 wgmma k-steps of 16)
constexpr int kTileRows = 64;    // weight rows per warpgroup (wgmma M)
constexpr int kValueBytes = 16;  // per thread per k-block: 4 words of E2M1 codes
constexpr int kTileScaleBytes = 256;  // per warpgroup tile per k-block: 64 rows x 4 k-steps, one byte each
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

// fp16x2 a * (b's low or high half in both halves): the broadcast folds into HMUL2's operand (R.H0_H0 / R.H1_H1).
template <int kHalf>
__device__ __forceinline__ uint32_t hmul2_broadcast(uint32_t a, uint32_t b) {
  const __half2 b2 = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), kHalf == 0 ? __low2half2(b2) : __high2half2(b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Pair decode masks and multipliers (see the file header): field of pair j in the k-step word, and 2^a + 2^b.
constexpr uint32_t kPairMask = 0x8E008E00u;  // fp16x2 sign + 3 magnitude bits of both halves
__device__ __forceinline__ uint32_t decode_pair0(uint32_t w) { return w & kPairMask; }
__device__ __forceinline__ uint32_t decode_pair1(uint32_t w) { return (w << 3) & kPairMask; }
__device__ __forceinline__ uint32_t decode_pair2(uint32_t w) { return ((w & 0x40384038u) * 66u) & kPairMask; }
__device__ __forceinline__ uint32_t decode_pair3(uint32_t w) { return ((w & 0x20072007u) * 516u) & kPairMask; }

// One k-step's A fragment (fp16x2, mma.m16n8k16 A order) from its code word w and the fp16 scale * 2^7 halves of rows
// r0 and r0 + 8 (kHalf: which half of the scale words holds this k-step's scale).
template <int kHalf>
__device__ __forceinline__ void decode_k_step(const uint32_t w, uint32_t scale_r0, uint32_t scale_r1,
                                              uint32_t (&out)[4]) {
  out[0] = hmul2_broadcast<kHalf>(decode_pair0(w), scale_r0);
  out[1] = hmul2_broadcast<kHalf>(decode_pair1(w), scale_r1);
  out[2] = hmul2_broadcast<kHalf>(decode_pair2(w), scale_r0);
  out[3] = hmul2_broadcast<kHalf>(decode_pair3(w), scale_r1);
}

// A thread's A fragments of one 64-row weight tile and k-block: its 16 bytes of codes at `values` (4 k-step words)
// and the tile's 256 scale bytes at `tile_scales` (row r at 4 r, byte s = k-step s), of which it reads rows r0 and
// r0 + 8.
__device__ __forceinline__ void decode_a_fragments(const uint8_t* values, const uint8_t* tile_scales, int row_r0,
                                                   uint32_t (&a)[4][4]) {
  const uint4 words = *reinterpret_cast<const uint4*>(values);
  const uint32_t scales_r0 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * row_r0);
  const uint32_t scales_r1 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * (row_r0 + 8));
  // fp16 scale * 2^7 = code << 7: k-steps 0 and 2 in the halves of `even`, 1 and 3 in the halves of `odd`.
  const uint32_t even_r0 = (scales_r0 << 7) & 0x7F807F80u, odd_r0 = (scales_r0 >> 1) & 0x7F807F80u;
  const uint32_t even_r1 = (scales_r1 << 7) & 0x7F807F80u, odd_r1 = (scales_r1 >> 1) & 0x7F807F80u;
  decode_k_step<0>(words.x, even_r0, even_r1, a[0]);
  decode_k_step<0>(words.y, odd_r0, odd_r1, a[1]);
  decode_k_step<1>(words.z, even_r0, even_r1, a[2]);
  decode_k_step<1>(words.w, odd_r0, odd_r1, a[3]);
}

// Counts are clamped to [0, segment length] (expert_offsets[e + 1] - expert_offsets[e]) and segments to the rows
// of x, so inconsistent offsets/counts cannot make the kernel read or write outside its buffers.
__device__ __forceinline__ int clamped_count(const GroupedGemmArgs& args, int e) {
  // __ldcg, not __ldg: with waves the dispatch receive writes these while the kernel runs (waves.h), and a
  // non-coherent load could return a stale cached line.
  const int64_t begin = __ldcg(args.expert_offsets + e), end = __ldcg(args.expert_offsets + e + 1);
  const int64_t stop = end < args.num_rows_total ? end : args.num_rows_total;
  const int64_t requested = __ldcg(args.num_tokens_per_expert + e);
  const int64_t count = requested < stop - begin ? requested : stop - begin;
  return begin < 0 || count < 0 ? 0 : static_cast<int>(count);
}

// Which rows of an expert one launch covers. A token tile of 128 wastes most of its MMA work on an expert whose
// count is just past a multiple of 128 (random routing at ~256 rows per expert leaves a remainder of a few rows
// in about half of the experts). Split launches leave such remainders -- count % main_tile in 1 .. tail_rows -- to
// a second launch with a small token tile, which costs a weight pass at small-tile speed instead of a full tile.
//
// Wide last tiles (wide_tile > 0; the default since 2026-12-01, EP_COMM_GEMM_WIDE_TILE=0 turns them off): an expert whose
// count is at most wide_tile * floor(count / main_tile) but not a multiple of main_tile -- e.g. 257..288 rows with
// tiles of 128 and 144 -- is computed whole by a third launch with token tile wide_tile, in as many tiles as main_tile
// would need without its remainder: no extra pass over the expert's weights, for wide_tile / main_tile times the MMA
// work of those tiles. Such an expert is in neither part 1 nor part 2.
struct RowSplit {
  int part = 0;       // 0: all rows; 1: all but a small remainder; 2: only the small remainder; 3: the wide experts
  int main_tile = 0;  // token tile of the part-1 launch
  int tail_rows = 0;  // remainders of 1 .. tail_rows rows are small
  // Parts 1, 3 and 2 (launched in that order) overlap (not with waves): each later launch is a programmatic dependent
  // of the one before, so its CTAs take the SMs that the earlier one's last, partial round of items leaves idle (the
  // parts write disjoint rows and read only inputs complete before part 1); each dependent completes only after the
  // launch before it (its CTAs end in griddepcontrol.wait), so the kernels behind the last one on the stream see all.
  bool overlap = false;
  int wide_tile = 0;  // token tile of the part-3 launch; 0: no part 3
  // Parts 1 and 3 release their dependents as soon as their CTAs start; parts 3 and 2 are the dependents.
  __host__ __device__ bool triggers_dependent() const { return overlap && (part == 1 || part == 3); }
  __host__ __device__ bool is_dependent() const { return overlap && (part == 2 || part == 3); }
};

// (first row within the expert, rows) that `split` assigns to this launch for expert e.
__device__ __forceinline__ int2 rows_of_part(const GroupedGemmArgs& args, const RowSplit split, int e) {
  const int count = clamped_count(args, e);
  if (split.part == 0) return make_int2(0, count);
  const int remainder = count % split.main_tile;
  // count <= wide_tile * (count / main_tile), written without the product of count-sized terms.
  const bool wide = split.wide_tile > 0 && remainder > 0 &&
                    remainder <= (count / split.main_tile) * (split.wide_tile - split.main_tile);
  if (split.part == 3) return wide ? make_int2(0, count) : make_int2(count, 0);
  const bool small = !wide && remainder > 0 && remainder <= split.tail_rows;
  if (split.part == 1) return make_int2(0, wide ? 0 : small ? count - remainder : count);
  return small ? make_int2(count - remainder, remainder) : make_int2(count, 0);
}

// Warp 0's place in the scan of the experts' tiles (find_tile), kept in shared memory so that it costs the main
// loop no registers: the 32-expert chunk at `base`, the tiles of the experts before it, and -- once loaded -- the
// chunk's inclusive prefix of tiles per lane and each lane's expert rows (first row in x, rows of this launch's
// part; loaded = false: not yet). A persistent CTA visits non-decreasing tile slots, so the scan resumes where the
// previous item stopped: each CTA reads every expert's count once per launch instead of scanning from expert 0 for
// every tile.
struct TileCursor {
  int inclusive[32];
  int first_row[32];
  int rows[32];
  int base;
  int tiles_before;
  bool loaded;
};

// A token tile found by find_tile: its expert, its first row in x (and out) and its rows below the expert's count
// (the rest of the tile is zero-filled and not stored).
struct FoundTile {
  int expert;
  int first_row;
  int valid_rows;
};

// Which expert and token tile tile slot `slot` is, in the concatenation of every expert's ceil(rows / kTile) tiles
// (rows: this launch's part, rows_of_part). Returns false when the slot is past the last tile. All threads of the
// CTA call it (it ends in a barrier); `slot` only matters in lane 0 of warp 0 (see below); `cursor` starts zeroed
// (base 0, tiles_before 0, loaded false) and only warp 0 touches it. The tile's rows come from the scan's own loads, so the caller needs no
// further (dependent) global load to start the tile.
// Waves (args.wave.area set): lane 0 also waits, before the barrier, until every row of the tile's expert has been
// received (acquire): the barrier then orders the whole CTA's loads of the tile after it, with no barrier of its own.
// The other lanes take the slot from lane 0 of warp 0 (with waves only thread 0 holds the item it took).
//
// The scan itself is scan_tiles: warp 0 runs it (lane = threadIdx.x) and every lane gets the result; the
// warp-specialized kernel's producer warp (warp 0 too) calls it directly, after a __syncwarp that orders its lane 0's
// cursor writes of the previous call before the other lanes' reads.
template <int kTile>
__device__ __forceinline__ FoundTile scan_tiles(const GroupedGemmArgs& args, const RowSplit split, const int slot,
                                                TileCursor& cursor) {
  const int lane = threadIdx.x;
  FoundTile result{-1, 0, 0};
  int base = cursor.base, tiles_before = cursor.tiles_before;
  const bool resume = cursor.loaded;
  int inclusive = resume ? cursor.inclusive[lane] : 0;
  int lane_first_row = resume ? cursor.first_row[lane] : 0;
  int lane_rows = resume ? cursor.rows[lane] : 0;
  bool loaded = resume;
  while (base < args.num_experts) {
    if (!loaded) {
      const int e = base + lane;
      const int2 part_rows = e < args.num_experts ? rows_of_part(args, split, e) : make_int2(0, 0);
      lane_first_row = e < args.num_experts ? static_cast<int>(__ldcg(args.expert_offsets + e)) + part_rows.x : 0;
      lane_rows = part_rows.y;
      inclusive = (lane_rows + kTile - 1) / kTile;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (lane >= offset) inclusive += v;
      }
      loaded = true;
    }
    const int below = __shfl_up_sync(0xFFFFFFFFu, inclusive, 1);  // every lane shuffles (lane 0 gets its own)
    const int tiles = inclusive - (lane > 0 ? below : 0);
    const int exclusive = tiles_before + inclusive - tiles;
    const unsigned hit = __ballot_sync(0xFFFFFFFFu, slot >= exclusive && slot < exclusive + tiles);
    if (hit) {
      const int src = __ffs(hit) - 1;
      const int tile_in_expert = slot - __shfl_sync(0xFFFFFFFFu, exclusive, src);
      result.expert = base + src;
      result.first_row = __shfl_sync(0xFFFFFFFFu, lane_first_row, src) + tile_in_expert * kTile;
      result.valid_rows = min(kTile, __shfl_sync(0xFFFFFFFFu, lane_rows, src) - tile_in_expert * kTile);
      break;
    }
    tiles_before += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    base += 32;
    loaded = false;
  }
  cursor.inclusive[lane] = inclusive;
  cursor.first_row[lane] = lane_first_row;
  cursor.rows[lane] = lane_rows;
  if (lane == 0) {
    cursor.base = base;
    cursor.tiles_before = tiles_before;
    cursor.loaded = loaded;
  }
  return result;
}

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

// What the epilogue needs of a work item: its token tile and weight CTA, written by the loader when it starts the
// item's loads (shared memory: with the next-item prefetch the loader starts item n + 1 before item n's epilogue,
// see gemm_items).
struct WorkItem : FoundTile {
  int weight_cta;
};

// Both epilogues scale token t of the tile by f[t] = row_factor[first_row + t] * weight_factor (weight_factor =
// w_factor[e] * 2^7, which undoes the decode's 2^-7), 0 past the count (those values are computed, never stored).
// gemm_items loads the kTile factors once per item into shared memory (one L2 round trip, issued before the last
// wgmma drains). Loading each token pair's factors where the epilogue used them cost one dependent L2 round trip per
// 8 tokens: ncu put a quarter of w2's stall samples in that epilogue (bench/RESULTS.md, ninth session).
// (FP8 mode: the weights are decoded times 2^-3 instead, so the factor is w_factor[e] * 2^3.)
template <bool kFp8>
__device__ __forceinline__ float token_factor(const GroupedGemmArgs& args, const WorkItem& item, int token) {
  const float weight_factor = __ldg(args.w_factor + item.expert) * (kFp8 ? 8.0f : 128.0f);
  // (__ldcg: with waves the receive writes row_factor while the kernel runs; a cached line could be stale.)
  return token < item.valid_rows ? __ldcg(args.row_factor + item.first_row + token) * weight_factor : 0.0f;
}

// Combine-row epilogue (out_type 2), after the main loop. The CTA's output tile goes through shared memory (the
// ring, free by then), because in the accumulator layout (swap AB) one token's 32-column RHT chunk is spread over two
// warps (16 columns each, 8 lanes x 2 registers), while the S2F6 lane helpers want it in two lanes of 16 consecutive
// values -- the layout of the NVLink combine send, whose bytes this reproduces. (Staging the bf16 / fp32 outputs the
// same way, for 16-byte stores instead of column pairs, measured no faster for w2 and 4-5% slower for w1 on H200:
// the direct stores below stay.)
// The tile holds the bf16 values the epilogue rounds to anyway (the combine row quantizes bf16(acc * factor), as the
// bf16 epilogue followed by the combine send does): one pair conversion (cvt.rn.bf16x2.f32) and one 4-byte store per
// column pair instead of two single conversions, two widenings and an 8-byte store, and half the shared memory, so
// that more of the ring is free for the next item's early loads (kTileSlots in gemm_items).
// Shared tile: bf16 [kTile][kWarpGroups * 64 + 8], rows 16-byte aligned (padded by 8 values: a row is an odd number of
// 16-byte granules). Bank conflicts: the accumulator writes (per instruction, 4 token rows two apart x 8 lanes'
// consecutive column pairs, 32 bytes per row) land 2 * row stride = 8 (mod 32) banks apart: all 32 banks. A lane's row
// read is two 16-byte granules, 2k and 2k + 1 (k = its 16-column group); lanes with k % 8 >= 4 read the odd one first,
// so that each 8-lane phase of a 16-byte load touches 8 different granules mod 8 (granule 2k mod 8 alone would repeat).
template <int kWarpGroups>
struct CombineTile {
  static constexpr int kStride = kWarpGroups * 64 + 8;  // bf16 values per row
  static constexpr int kBytesPerRow = kStride * 2;
  static_assert(kBytesPerRow % 16 == 0 && (kBytesPerRow / 16) % 2 == 1, "rows: an odd number of 16-byte granules");
  static __device__ __forceinline__ int index(int token, int column) { return token * kStride + column; }
};

// Where row `row`'s combine row goes: bases[src_rank] + offset + (src_token * topk + topk_slot) * row_bytes (the
// CombineRows contract in grouped_gemm.h), or 0 -- store nothing -- when (src_rank, src_token, topk_slot) names no row
// of the areas (a padding row's -1s: a caller may count padding in, and bases[-1] would be a wild address, local or
// over NVLink). gemm_items computes it once per token and item (two dependent L2 round trips, issued before the last
// wgmma drains) into shared memory, instead of in each row pass after the quantize.
__device__ __forceinline__ uint64_t combine_row_address(const GroupedGemmArgs::CombineRows& c, int row) {
  const int rank = __ldg(c.src_rank + row), token = __ldg(c.src_token + row), slot = __ldg(c.topk_slot + row);
  // One unsigned compare per bound also refuses negatives.
  if (static_cast<unsigned>(rank) >= static_cast<unsigned>(c.num_ranks) ||
      static_cast<uint64_t>(static_cast<uint32_t>(token)) >= static_cast<uint64_t>(c.max_tokens) ||
      static_cast<unsigned>(slot) >= static_cast<unsigned>(c.topk)) {
    return 0;
  }
  const int64_t dst_row = static_cast<int64_t>(token) * c.topk + slot;
  return __ldg(c.bases + rank) + static_cast<uint64_t>(c.offset + dst_row * c.row_bytes);
}

// A warpgroup's accumulators (weight tile columns `column` .. of the swap-AB layout, see below) into the staged tile,
// times the token factors, rounded to bf16: tokens kFirst .. kFirst + kTokens - 1 of the token tile (multiples of 8),
// as rows 0 .. kTokens - 1 of the staged tile.
template <int kTile, int kWarpGroups, int kFirst = 0, int kTokens = kTile>
__device__ __forceinline__ void stage_combine_tile(const float (&acc)[kTile / 2], const float* factors,
                                                   __nv_bfloat16* tile, const int column) {
  static_assert(kFirst % 8 == 0 && kTokens % 8 == 0 && kFirst + kTokens <= kTile, "whole 8-token groups");
  using Tile = CombineTile<kWarpGroups>;
  const int lane = threadIdx.x % 32;
  auto put2 = [&](int token, float lo, float hi) {
    *reinterpret_cast<__nv_bfloat162*>(tile + Tile::index(token - kFirst, column)) = __floats2bfloat162_rn(lo, hi);
  };
#pragma unroll
  for (int i = kFirst / 2; i < (kFirst + kTokens) / 2; i += 4) {
    const int t0 = 8 * (i / 4) + 2 * (lane % 4);
    const float2 f = *reinterpret_cast<const float2*>(factors + t0);  // tokens t0, t0 + 1
    put2(t0, acc[i] * f.x, acc[i + 2] * f.x);
    put2(t0 + 1, acc[i + 1] * f.y, acc[i + 3] * f.y);
  }
}

// The staged tile's kTile rows (tokens token_base .. of the work item), RHT-32 + S2F6, into their combine rows: warp
// `warp` of `kWarps` takes its share of the tokens (kWarpGroups * 64 columns: kWarpGroups * 4 lanes per token).
template <int kTile, int kWarpGroups, int kWarps>
__device__ __forceinline__ void send_combine_rows(const GroupedGemmArgs& args, const uint64_t* destinations,
                                                  const __nv_bfloat16* tile, const WorkItem item, const int warp,
                                                  const int token_base = 0) {
  using Tile = CombineTile<kWarpGroups>;
  const int lane = threadIdx.x % 32;
  const int weight_cta = item.weight_cta, valid_rows = item.valid_rows;
  // Rows: kWarpGroups * 4 lanes per token, lanes 2j and 2j + 1 one 32-chunk (the RHT/S2F6 lane layout).
  constexpr int kCols = kWarpGroups * 64;
  constexpr int kLanesPerToken = kCols / 16;
  constexpr int kTokensPerPass = 32 / kLanesPerToken;
  const int local_column = 16 * (lane % kLanesPerToken);
  const int64_t out_column = static_cast<int64_t>(weight_cta) * kCols + local_column;
  const bool column_valid = out_column < args.n;  // 32-chunks lie wholly inside or outside [0, n): n % 64 == 0
  const GroupedGemmArgs::CombineRows& c = args.combine;
  // Read once per tile, after the tile's work: a set flag stays set (CombineRows::abort).
  const bool stopped = c.abort != nullptr && *reinterpret_cast<const volatile unsigned int*>(c.abort) != 0u;
  for (int t_base = warp * kTokensPerPass; t_base < kTile; t_base += kWarps * kTokensPerPass) {
    const int token = t_base + lane / kLanesPerToken;
    // The lane's two granules (columns local_column .. + 7 and + 8 .. + 15), the odd one first for k % 8 >= 4 (see
    // CombineTile), put back in order by selects (an index into v that depends on the lane would put v in local
    // memory); each bf16 widens exactly (low half: shift, high half: mask).
    const bool odd_first = ((lane % kLanesPerToken) & 4) != 0;
    const __nv_bfloat16* row = tile + Tile::index(token, local_column);
    const uint4 first = *reinterpret_cast<const uint4*>(row + (odd_first ? 8 : 0));
    const uint4 second = *reinterpret_cast<const uint4*>(row + (odd_first ? 0 : 8));
    const uint32_t words[8] = {odd_first ? second.x : first.x, odd_first ? second.y : first.y,
                               odd_first ? second.z : first.z, odd_first ? second.w : first.w,
                               odd_first ? first.x : second.x, odd_first ? first.y : second.y,
                               odd_first ? first.z : second.z, odd_first ? first.w : second.w};
    float v[16];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      v[2 * w] = __uint_as_float(words[w] << 16);
      v[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
    }
    uint8_t scale;
    const uint4 codes = s2f6_lane::quantize_lane16<true>(v, c.sign_mask, lane, &scale);  // whole warp
    const uint64_t destination = token_base + token < valid_rows ? destinations[token_base + token] : 0;
    if (destination != 0 && column_valid && !stopped) {
      char* dst = reinterpret_cast<char*>(static_cast<uintptr_t>(destination));
      *reinterpret_cast<uint4*>(dst + out_column) = codes;
      if ((lane & 1) == 0) dst[c.scale_offset + out_column / 32] = static_cast<char>(scale);
    }
  }
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
// Direct epilogues (out_type 0 / 1: OutT = float or bf16 rows). Accumulator 4j + m of lane l in warp w of the
// warpgroup: packed weight row 16 w + l / 4 + 8 (m / 2), token 8 j + 2 (l % 4) + m % 2.
template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* dst, float lo, float hi) {
  if constexpr (std::is_same<OutT, float>::value) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(lo, hi);
  }
}

// Without SwiGLU (w2). pack_gemm_weights orders the rows of each 16-row group in column pairs (packed row g < 8 is
// row 2 g, g + 8 is row 2 g + 1), so a thread's rows r0 and r0 + 8 are output columns c and c + 1 (c even) and it
// stores each of its two tokens' pairs itself: 4 FMUL, 2 conversions and 2 stores per j, no shuffle and no select.
// (With the plain row order, columns r0 and r0 + 8 were 8 apart: lanes l and l ^ 4 swapped values with two shuffles
// and six selects per j first.) Each store instruction writes 32 contiguous bytes (bf16) of 4 token rows.
template <int kTile, typename OutT>
__device__ __forceinline__ void store_column_pairs_as(const GroupedGemmArgs& args, const float (&acc)[kTile / 2],
                                                      const float* factors, const WorkItem item, int weight_tile) {
  const int thread_in_group = threadIdx.x % 128;
  const int warp = thread_in_group / 32, lane = thread_in_group % 32;
  const int token0 = 2 * (lane % 4);  // + 8 j: tokens token0 and token0 + 1
  const int64_t column = static_cast<int64_t>(weight_tile) * kTileRows + 16 * warp + 2 * (lane / 4);
  OutT* out = static_cast<OutT*>(args.out) + (item.first_row + token0) * args.out_row_stride + column;
  const int64_t rows8 = 8 * args.out_row_stride;
#pragma unroll
  for (int j = 0; j < kTile / 8; ++j) {
    const float2 f = *reinterpret_cast<const float2*>(factors + 8 * j + token0);  // tokens t0, t0 + 1
    OutT* dst = out + j * rows8;
    if (8 * j + token0 < item.valid_rows) store_pair(dst, acc[4 * j] * f.x, acc[4 * j + 2] * f.x);
    if (8 * j + token0 + 1 < item.valid_rows) {
      store_pair(dst + args.out_row_stride, acc[4 * j + 1] * f.y, acc[4 * j + 3] * f.y);
    }
  }
}

// With SwiGLU (w1): packed rows 16 q + g (g < 8) are gate 8 q + g, rows 16 q + 8 + g the matching up rows, so the
// lane's gate/up pair gives output column 8 q + lane / 4 of the [R, I] result, one column for two tokens. Lanes l and
// l ^ 4 hold columns c and c + 1 (c even) for the same two tokens: one shuffle gives the even lane both columns of the
// first token and the odd lane both columns of the second -- one 2-wide store each, rows 8 j apart.
template <int kTile, typename OutT>
__device__ __forceinline__ void store_swiglu_as(const GroupedGemmArgs& args, const float (&acc)[kTile / 2],
                                                const float* factors, const WorkItem item, int weight_tile) {
  const int thread_in_group = threadIdx.x % 128;
  const int warp = thread_in_group / 32, lane = thread_in_group % 32;
  const bool even_column = (lane / 4) % 2 == 0;
  const int my_token = 2 * (lane % 4) + (even_column ? 0 : 1);  // + 8 j
  const int64_t column = static_cast<int64_t>(weight_tile) * 32 + 8 * warp + (lane / 4 & ~1);
  OutT* out = static_cast<OutT*>(args.out) + (item.first_row + my_token) * args.out_row_stride + column;
  const int64_t rows8 = 8 * args.out_row_stride;
#pragma unroll
  for (int j = 0; j < kTile / 8; ++j) {
    const float2 f = *reinterpret_cast<const float2*>(factors + 8 * j + 2 * (lane % 4));  // tokens t0, t0 + 1
    const float g_t0 = acc[4 * j] * f.x, g_t1 = acc[4 * j + 1] * f.y;      // gate (row r0)
    const float u_t0 = acc[4 * j + 2] * f.x, u_t1 = acc[4 * j + 3] * f.y;  // up (row r0 + 8)
    const bool stored = 8 * j + my_token < item.valid_rows;  // the shuffles run in every lane
    const float h_t0 = g_t0 / (1.0f + expf(-g_t0)) * u_t0;
    const float h_t1 = g_t1 / (1.0f + expf(-g_t1)) * u_t1;
    const float other = __shfl_xor_sync(0xFFFFFFFFu, even_column ? h_t1 : h_t0, 4);
    if (stored) store_pair(out + j * rows8, even_column ? h_t0 : other, even_column ? other : h_t1);
    if (args.row_amax != nullptr) {
      // Max |h| as stored (bf16 output: rounded first) of tokens t0 and t0 + 1 over the warp's 8 columns (lanes
      // with the same lane % 4), NaN as 0 (fmaxf returns the other operand); the max of non-negative floats is
      // the max of their bit patterns.
      auto as_stored = [](float v) {
        if constexpr (std::is_same<OutT, float>::value) return v;
        else return __bfloat162float(__float2bfloat16_rn(v));
      };
      float m0 = fmaxf(fabsf(as_stored(h_t0)), 0.0f), m1 = fmaxf(fabsf(as_stored(h_t1)), 0.0f);
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        m0 = fmaxf(m0, __shfl_xor_sync(0xFFFFFFFFu, m0, offset));
        m1 = fmaxf(m1, __shfl_xor_sync(0xFFFFFFFFu, m1, offset));
      }
      const int t0 = 8 * j + 2 * lane;  // lanes 0..3 hold the maxima of their token pair
      if (lane < 4 && t0 < item.valid_rows) {
        atomicMax(reinterpret_cast<int*>(args.row_amax + item.first_row + t0), __float_as_int(m0));
      }
      if (lane < 4 && t0 + 1 < item.valid_rows) {
        atomicMax(reinterpret_cast<int*>(args.row_amax + item.first_row + t0 + 1), __float_as_int(m1));
      }
    }
  }
}

// Weight tile `weight_tile`'s outputs from the warpgroup's accumulators (fp32 / bf16 rows, SwiGLU or not).
template <int kTile>
__device__ __forceinline__ void store_tile_rows(const GroupedGemmArgs& args, const float (&acc)[kTile / 2],
                                                const float* factors, const WorkItem item, const int weight_tile) {
  // One branch per item instead of per value: each form is its own unrolled loop.
  if (args.out_type == 0) {
    if (args.swiglu) store_swiglu_as<kTile, float>(args, acc, factors, item, weight_tile);
    else store_column_pairs_as<kTile, float>(args, acc, factors, item, weight_tile);
  } else {
    if (args.swiglu) store_swiglu_as<kTile, __nv_bfloat16>(args, acc, factors, item, weight_tile);
    else store_column_pairs_as<kTile, __nv_bfloat16>(args, acc, factors, item, weight_tile);
  }
}

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
  // decoded to the exact fp16 values v * s * 2^-7 as above (decode_a_fragments), scaled by 16 (exact in fp16, subnormals
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
  uint32_t group_scales_r0 = 0, group_scales_r1 = 0;
  auto convert_group = [&](int slot, int sub, auto group_constant, AGroup& a) {
    constexpr int kGroup = decltype(group_constant)::value;
    const uint8_t* stage = smem + slot * G::kStageBytes + sub * G::kBlockBytes;
    if (kGroup == 0) {  // the k-block's scale words, kept for its later groups
      const uint8_t* tile_scales = stage + G::kScalesOffset + warp_group * kTileScaleBytes;
      group_scales_r0 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * row_r0);
      group_scales_r1 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * (row_r0 + 8));
    }
    const uint32_t scales_r0 = group_scales_r0, scales_r1 = group_scales_r1;
#pragma unroll
    for (int i = 0; i < kStepsPerGroup; ++i) {
      const int k_step = kGroup * kStepsPerGroup + i;  // compile-time after unrolling
      const uint32_t w = *reinterpret_cast<const uint32_t*>(stage + G::kValuesOffset + threadIdx.x * kValueBytes +
                                                            4 * k_step);
      // k-steps 0 / 2: (code << 7) halves; 1 / 3: (code >> 1) halves; low half for k-steps 0, 1, high for 2, 3.
      const uint32_t s0 = (k_step % 2 == 0 ? scales_r0 << 7 : scales_r0 >> 1) & 0x7F807F80u;
      const uint32_t s1 = (k_step % 2 == 0 ? scales_r1 << 7 : scales_r1 >> 1) & 0x7F807F80u;
      if (k_step < 2) {
        decode_k_step<0>(w, s0, s1, a[i]);
      } else {
        decode_k_step<1>(w, s0, s1, a[i]);
      }
    }
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
// slot is past the last tile, on a grid of what fits on the GPU at once (launch_tile), so that a launch sized for
// the worst case (rows / tile + experts slots, without reading the counts on the host) pays neither a CTA launch
// nor a scan for every empty slot, and each CTA reads the expert counts once (TileCursor). Otherwise one item per
// CTA on a grid of every slot (measured faster for the 2-warpgroup, 3-CTA/SM shapes of the small token tiles when K
// is long: launch_tile). With
// waves (persistent too) CTAs take items from the wave work counter, so late CTAs take fewer (waves.h).
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

// ---------------------------------------------------------------------------------------------------------------------
// Warp-specialized form (experimental, opt-in: EP_COMM_GEMM_WS=1, or 2 for clusters of two CTAs; token tile 128, exact
// mode, every epilogue (the combine rows' through a staging area past a 3-stage ring), waves with one CTA per
// cluster; docs/GEMM.md §4(a)). The same work items, k order per output
// element and epilogue formulas as the classic kernel above, so its results are bitwise the classic kernel's. What
// differs is who does what:
// * warpgroup 0 is the producer. Its warp 0 finds the items (scan_tiles) and its lane 0 issues every load of a stage
//   as bulk copies completing on the stage's "full" mbarrier: the four weight tiles' codes and scales (stored in the
//   packed order shared memory wants: one contiguous copy per tile and stage) and the token tile by TMA (a tensor map
//   over x, 128-byte swizzle: the wgmma B layout). It runs up to kStages stages ahead, across work items, so the next
//   item's loads land while the consumers run the epilogue. It gives registers back (setmaxnreg.dec).
// * warpgroups 1 and 2 are consumers of 128 weight rows each (two 64-row tiles: two m64n128 accumulators, 128
//   registers, and the even / odd A sets of both tiles, 64 registers), claiming 232 registers (setmaxnreg.inc; the
//   launch cap of 384 threads is 168). They wait on "full", decode, issue the wgmma and release the stage on "empty"
//   once its last wgmma has retired: no CTA barrier, no cp.async bookkeeping and no load addresses in the MMA warps.
// * clusters of two (kCluster = 2): the two CTAs take the same token tile against weight CTAs 2 w and 2 w + 1, each
//   loads half of the token rows and multicasts them into both (the token tile is the larger operand: 16 KiB per
//   k-block against 9 KiB of weights), and a stage is refilled only once the consumers of both CTAs have released it.
// Rows of a token tile past the expert's count are not zero-filled: the TMA reads whatever rows follow in x (zeros
// past its end; behind a wave receive, rows of other experts that may still be landing). Such a row only feeds its own
// output column (the token), which the epilogue never stores.
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
  CUtensorMap x_map;  // fp16 x [num_rows_total, k], box 64 (k) x kTile / kCluster (rows), 128-byte swizzle
  GroupedGemmArgs args;
  RowSplit split;
};

#if EP_COMM_HAS_WGMMA
// The producer warp: every stage of the CTA's items into the ring, and each item's entry (an entry with expert -1,
// published by a plain arrival on the next stage's "full" barrier, ends the consumers); then it waits, with the
// timeout, until every consumer warp is done (ws_consume).
template <int kCluster, int kTile, bool kCombineRows>
__device__ __forceinline__ void ws_produce(const WsParams& p, TileCursor& cursor, WorkItem* items, uint32_t ring,
                                           uint32_t full_bars, uint32_t empty_bars, uint32_t done_bar) {
  using G = WsGeometry<kTile, kCombineRows>;
  constexpr int kStages = G::kStages;
  const GroupedGemmArgs& args = p.args;
  const int lane = threadIdx.x;  // warp 0
  const int rank = kCluster > 1 ? static_cast<int>(tma::cluster_rank()) : 0;
  const int num_weight_tiles = args.n / kTileRows;
  const int num_weight_ctas = (num_weight_tiles + ws::kWeightTiles - 1) / ws::kWeightTiles;
  const int weight_groups = (num_weight_ctas + kCluster - 1) / kCluster;  // cluster items per token tile
  const int num_k_blocks = args.k / kKBlock;
  const int stages_per_item = (num_k_blocks + ws::kBlocksPerStage - 1) / ws::kBlocksPerStage;
  const uint8_t* w_values = reinterpret_cast<const uint8_t*>(args.w_values);
  // Waves (one CTA per cluster only): the receive running beside us publishes the layout first; items come from the
  // wave work counter (dynamic: CTAs that start late, on SMs the receive frees, take fewer), and a tile's loads start
  // once every row of its expert is in (as find_tile does for the classic kernel).
  const bool waves = kCluster == 1 && args.wave.area != nullptr;
  unsigned long long wave_epoch = 0;
  if (waves && lane == 0) {
    wave_epoch = *reinterpret_cast<const volatile unsigned long long*>(args.wave.epoch);
    wave::wait_layout(args.wave, wave_epoch);
  }
  if (lane == 0) tma::prefetch_map(&p.x_map);
  uint32_t flat = 0;  // stages issued so far (ring slot flat % kStages, pass flat / kStages)
  int seq = 0;        // items started
  // (The launcher bounds cluster items + clusters < 2^31.)
  for (int cluster_item = blockIdx.x / kCluster;; cluster_item += gridDim.x / kCluster) {
    if (waves) {
      int taken = 0;
      if (lane == 0) taken = static_cast<int>(atomicAdd(args.wave.area + kWaveWorkCounter, 1ull));
      cluster_item = __shfl_sync(0xFFFFFFFFu, taken, 0);
    }
    __syncwarp();  // lane 0's cursor writes of the previous scan (and its layout wait), before the other lanes read
    const FoundTile tile = scan_tiles<kTile>(args, p.split, cluster_item / weight_groups, cursor);
    const int weight_cta = (cluster_item % weight_groups) * kCluster + rank;
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
          if constexpr (kCluster == 1) {
            tma::load_2d(tokens, &p.x_map, full, k0, tile.first_row);
          } else {
            constexpr int kRows = kTile / kCluster;
            tma::load_2d_multicast(tokens + rank * kRows * 128, &p.x_map, full, k0, tile.first_row + rank * kRows,
                                   static_cast<uint16_t>((1u << kCluster) - 1));
          }
        }
      }
    } else {
      flat += stages_per_item;
    }
  }
  if (lane == 0) tma::wait(done_bar, 0);
}

// A consumer warp's release of a ring slot: to the producer of every CTA of the cluster (each CTA's slot holds token
// rows its peer loaded).
template <int kCluster>
__device__ __forceinline__ void ws_release(uint32_t empty_bar) {
  if constexpr (kCluster == 1) {
    tma::arrive(empty_bar);
  } else {
#pragma unroll
    for (int cta = 0; cta < kCluster; ++cta) tma::arrive_in_cta(empty_bar, cta);
  }
}

// A consumer warpgroup (`consumer` 0 or 1: weight tiles 2 consumer and 2 consumer + 1 of the CTA's four). Its waits
// have no timeout (tma::wait_untimed: a trap here would cost every wgmma its registers); each warp arrives on
// `done_bar` when it leaves, and the producer waits for that with the timeout, so a barrier that never completes traps
// there instead of hanging.
// `smem` is the ring's generic address, `ring` its shared-window address.
template <int kCluster, int kTile, bool kCombineRows>
__device__ __forceinline__ void ws_consume(const GroupedGemmArgs& args, const WorkItem* items,
                                           float (*tile_factors)[kTile], uint64_t (*tile_destinations)[kTile],
                                           const uint8_t* smem, uint32_t ring, uint32_t full_bars,
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
      if (kGroup == 0) {
        const uint8_t* scales = stage + ws::kScalesOffset + (j * ws::kBlocksPerStage + sub) * kTileScaleBytes;
        group_scales[t][0] = *reinterpret_cast<const uint32_t*>(scales + 4 * row_r0);
        group_scales[t][1] = *reinterpret_cast<const uint32_t*>(scales + 4 * (row_r0 + 8));
      }
#pragma unroll
      for (int i = 0; i < kStepsPerGroup; ++i) {
        const int k_step = kGroup * kStepsPerGroup + i;  // compile-time after unrolling
        const uint32_t w = *reinterpret_cast<const uint32_t*>(values + 4 * k_step);
        // k-steps 0 / 2: (code << 7) halves; 1 / 3: (code >> 1) halves; low half for k-steps 0, 1, high for 2, 3.
        const uint32_t s0 = (k_step % 2 == 0 ? group_scales[t][0] << 7 : group_scales[t][0] >> 1) & 0x7F807F80u;
        const uint32_t s1 = (k_step % 2 == 0 ? group_scales[t][1] << 7 : group_scales[t][1] >> 1) & 0x7F807F80u;
        if (k_step < 2) {
          decode_k_step<0>(w, s0, s1, (t == 0 ? a0 : a1)[i]);
        } else {
          decode_k_step<1>(w, s0, s1, (t == 0 ? a0 : a1)[i]);
        }
      }
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
        if (lane == 0) ws_release<kCluster>(empty_bars + 8 * ((flat - 1) % kStages));
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
    if (lane == 0) ws_release<kCluster>(empty_bars + 8 * (flat % kStages));  // the item's last stage
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
      __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(
          const_cast<uint8_t*>(smem) + G::kStagingOffset);
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

template <int kCluster, int kTile, bool kCombineRows>
__global__ void __launch_bounds__(ws::kThreads, 1) grouped_gemm_nvfp4_ws_kernel(const __grid_constant__ WsParams p) {
#if EP_COMM_HAS_WGMMA
  constexpr int kStages = WsGeometry<kTile, kCombineRows>::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (The same offset in both CTAs of a cluster: the multicast loads write at the same address in each.)
  const uint8_t* smem = smem_raw + ((1024 - (cp_async::smem_address(smem_raw) & 1023)) & 1023);
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
      tma::barrier_init(empty_bars + 8 * s, kCluster * ws::kConsumers * 4);  // every consumer warp of the cluster
    }
    tma::barrier_init(done_bar, ws::kConsumers * 4);  // every consumer warp of this CTA, once
    tma::fence_barrier_init();
  }
  // The peer's barriers must be initialized before this CTA's loads and releases reach them.
  if constexpr (kCluster > 1) {
    tma::cluster_sync();
  } else {
    __syncthreads();
  }
  // Overlapped split: the next part may start now; its CTAs get SMs as this launch's CTAs finish.
  if (p.split.triggers_dependent()) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Each role ends on its own (no code after the branches): ptxas budgets the code after a setmaxnreg at its count,
  // and a shared tail would be reached with both.
  auto finish = [&]() {
    // No CTA exits while its peer may still load into it or arrive on its barriers.
    if constexpr (kCluster > 1) tma::cluster_sync();
    // Waves: complete only after the receive has; overlapped parts 3 and 2: only after the part launched before has.
    if (p.args.wave.area != nullptr || p.split.is_dependent()) asm volatile("griddepcontrol.wait;" ::: "memory");
  };
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(ws::kProducerRegisters));
    if (threadIdx.x < 32) {
      ws_produce<kCluster, kTile, kCombineRows>(p, cursor, items, ring, full_bars, empty_bars, done_bar);
    }
    finish();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws::kConsumerRegisters));
  ws_consume<kCluster, kTile, kCombineRows>(p.args, items, tile_factors, tile_destinations, smem, ring, full_bars,
                                            empty_bars, done_bar);
  finish();
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

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
  const int max_ctas = max_ctas_override();
  if (max_ctas < 0) return cudaErrorInvalidValue;
  const bool waves = args.wave.area != nullptr;
  // The small-tile shapes too when K is short: an item of K <= 2048 (w2) is too short to amortize a CTA's launch and
  // pipeline fill, which the persistent CTAs' next-item prefetch hides. Measured on H200 (bench/RESULTS.md,
  // sixteenth session; 16 / 32 rows per expert): w2 (K = 2048) 0.44 -> 0.40 and 0.53 -> 0.47 ms persistent, w1
  // (K = 7168) 0.68 -> 0.71 and 0.78 -> 0.82 ms (the block scheduler's dynamic placement wins there).
  constexpr int64_t kPersistentSmallTileMaxK = 2048;
  const bool persistent = kCtasPerSm == 1 || split.part >= 2 || max_ctas > 0 || waves ||
                          args.k <= kPersistentSmallTileMaxK;
  const int64_t weight_ctas = (args.n / kTileRows + kWarpGroups - 1) / kWarpGroups;
  const int64_t items = weight_ctas * tile_slots;
  int64_t grid = items;
  if (persistent) {
    const cudaError_t occupancy = resident_grid(kernel, G::kThreads, items, &grid, G::kSmemBytes);
    if (occupancy != cudaSuccess) return occupancy;
    if (max_ctas > 0 && grid > max_ctas) grid = max_ctas;
  }
  if (grid == 0) return cudaSuccess;
  // Item indices are ints: the last one a CTA computes before stopping is below items + grid (one CTA per item:
  // the first item only).
  if (items + (persistent ? grid : 0) > INT32_MAX) return cudaErrorInvalidValue;
  // Waves: the programmatic dependent of the dispatch receive launched just before on this stream (waves.h);
  // overlapped parts 3 and 2: of the part launched before (RowSplit::overlap).
  const bool programmatic = waves || split.is_dependent();
  return launch_with_pdl(kernel, static_cast<unsigned>(grid), G::kThreads, G::kSmemBytes, stream, programmatic, args,
                         split, persistent);
}

// The warp-specialized tile-128 kernel's launch (EP_COMM_GEMM_WS=1: one CTA per cluster, 2: two), persistent: as
// many clusters as are resident at once, at most one per cluster item (a token tile against kCluster weight CTAs).
template <int kCluster, int kTile, bool kCombineRows>
cudaError_t launch_ws_tile(const GroupedGemmArgs& args, const RowSplit split, int64_t tile_slots, cudaStream_t stream) {
  using G = WsGeometry<kTile, kCombineRows>;
  // Waves take items one by one from the wave counter: clusters of one CTA only (the kernel skips the waves protocol
  // in clusters of two).
  if (kCluster > 1 && args.wave.area != nullptr) {
    return launch_ws_tile<1, kTile, kCombineRows>(args, split, tile_slots, stream);
  }
  auto* kernel = grouped_gemm_nvfp4_ws_kernel<kCluster, kTile, kCombineRows>;
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  WsParams params{};
  params.args = args;
  params.split = split;
  // x as a [num_rows_total, k] fp16 tensor in boxes of 64 k x (128 / kCluster) rows, 128-byte swizzle (the wgmma B
  // layout); rows past its end read as zeros.
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(args.k), static_cast<cuuint64_t>(args.num_rows_total)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(args.x_row_stride) * 2};
  const cuuint32_t box[2] = {kKBlock, kTile / kCluster};
  const cuuint32_t element_strides[2] = {1, 1};
  if (encode(&params.x_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<uint16_t*>(args.x), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return cudaErrorInvalidValue;
  }
  static std::atomic<uint64_t> configured{0};
  cudaError_t status = once_per_device(configured, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  });
  if (status != cudaSuccess) return status;
  const int max_ctas = max_ctas_override();
  if (max_ctas < 0) return cudaErrorInvalidValue;
  const int64_t weight_ctas = (args.n / kTileRows + ws::kWeightTiles - 1) / ws::kWeightTiles;
  const int64_t cluster_items = (weight_ctas + kCluster - 1) / kCluster * tile_slots;
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  // Waves: the programmatic dependent of the dispatch receive launched just before on this stream (waves.h).
  attributes[0].val.programmaticStreamSerializationAllowed = args.wave.area != nullptr || split.is_dependent() ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = kCluster;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kCluster);
  config.blockDim = dim3(ws::kThreads);
  config.dynamicSmemBytes = G::kSmemBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = kCluster > 1 ? 2 : 1;
  int64_t clusters = 0;
  if constexpr (kCluster == 1) {
    status = resident_grid(kernel, ws::kThreads, cluster_items, &clusters, G::kSmemBytes);
  } else {
    int resident = 0;
    status = cudaOccupancyMaxActiveClusters(&resident, kernel, &config);
    if (status != cudaSuccess) return status;
    // No cluster of two fits (a partition of the GPU without two free SMs in one GPC): one CTA per cluster instead.
    if (resident < 1) return launch_ws_tile<1, kTile, kCombineRows>(args, split, tile_slots, stream);
    clusters = cluster_items < resident ? cluster_items : resident;
  }
  if (status != cudaSuccess) return status;
  // (With clusters of two, EP_COMM_GEMM_MAX_CTAS=1 still launches one cluster: two CTAs.)
  if (max_ctas > 0 && clusters * kCluster > max_ctas) clusters = max_ctas / kCluster > 0 ? max_ctas / kCluster : 1;
  if (clusters == 0) return cudaSuccess;
  // Cluster item indices are ints: the last one a cluster computes before stopping is below cluster_items + clusters.
  if (cluster_items + clusters > INT32_MAX) return cudaErrorInvalidValue;
  config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  return cudaLaunchKernelEx(&config, kernel, params);
}

using LaunchFn = cudaError_t (*)(const GroupedGemmArgs&, RowSplit, int64_t, cudaStream_t);

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

// The default CTA shape of each token tile, for the kernels that take no tuning override (the combine-row epilogue and
// the FP8 mode): 2 warpgroups x 3 CTAs per SM for tiles 16 / 32, 4 x 1 for 64 / 128 and the exact mode's wide tile 144
// (the FP8 mode has none: nullptr, as for any other tile).
template <bool kCombineRows, bool kFp8>
LaunchFn default_shape_kernel(int tile) {
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

// The kernel for one launch of a token tile, with the CTA shape chosen for it, or nullptr when a tuning override
// names a shape without a compiled kernel. Warpgroups per CTA: 4 (256 weight rows, one CTA per SM, each token tile
// read from L2 half as often) for token tiles of 64 and 128, where the MMA dominates; 2 with three CTAs per SM for
// 16 and 32, where the weight conversion dominates (issue-bound: ncu shows ~80% of issue slots busy at 16 rows per
// expert) and more resident warps hide its latencies. Measured on H200 (bench/RESULTS.md): 4 warpgroups are 1.3x
// faster at 128 rows per expert; at 16 rows 2x3 is 1.09x faster than 2x2 and 1.02x faster than 1x4. Tuning
// overrides (other values are refused): EP_COMM_GEMM_WARPGROUPS=2|4 for every tile (as many CTAs per SM as fit:
// 4 / warpgroups, one k-block per stage); EP_COMM_GEMM_SMALL_CTA=1x4|2x2|2x3|4x1 (warpgroups x CTAs per SM) for the
// token tiles 16 and 32; EP_COMM_GEMM_KBLOCKS_PER_STAGE=1|2 (pipeline stage size) for the default shapes. The
// combine-row epilogue (out_type 2) always takes the default shape of its tile.
LaunchFn select_kernel(int tile, bool combine_rows, bool fp8) {
  static const int forced_warp_groups = tuning_choice("EP_COMM_GEMM_WARPGROUPS", {"2", "4"});
  static const int forced_small_cta = tuning_choice("EP_COMM_GEMM_SMALL_CTA", {"1x4", "2x2", "2x3", "4x1"});
  static const int forced_blocks_per_stage = tuning_choice("EP_COMM_GEMM_KBLOCKS_PER_STAGE", {"1", "2"});
  // The combine-row epilogue exists for the default shapes only (no tuning matrix): it ignores the tuning variables
  // (read above, once per process), so a tuning run of the bf16 kernels (or a mistyped value) leaves MoELayer's w2
  // working. (Only the test hook EP_COMM_GEMM_MAX_CTAS applies to it: launch_tile.)
  if (combine_rows) return fp8 ? default_shape_kernel<true, true>(tile) : default_shape_kernel<true, false>(tile);
  if (forced_warp_groups < 0 || forced_small_cta < 0 || forced_blocks_per_stage < 0) return nullptr;
  // The inexact FP8 mode's direct epilogues: the default shapes only too. The tuning variables do not apply to it (a
  // malformed one is still refused, above); neither does EP_COMM_GEMM_WIDE_TILE.
  if (fp8) return default_shape_kernel<false, true>(tile);
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
  LaunchFn main_kernel = select_kernel(tile, combine_rows, args.fp8);
  // The warp-specialized form (experimental, EP_COMM_GEMM_WS=1|2; "0" or unset: off) replaces the tile-128 kernel of
  // the exact mode (not a refused tuning override: main_kernel null); its bulk copies need 16-byte aligned operands.
  // Behind a wave receive it runs with one CTA per cluster (the wave work counter hands out items one by one).
  static const int ws_cluster = env_choice("EP_COMM_GEMM_WS", {"0", "1", "2"});
  const bool ws_form = ws_cluster > 0 && !args.fp8 && reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.w_values) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.w_scales) % 16 == 0;
  if (ws_form && main_kernel != nullptr && tile == 128) {
    const bool one = ws_cluster == 1 || args.wave.area != nullptr;
    main_kernel = combine_rows ? (one ? launch_ws_tile<1, 128, true> : launch_ws_tile<2, 128, true>)
                               : (one ? launch_ws_tile<1, 128, false> : launch_ws_tile<2, 128, false>);
  }
  const LaunchFn tail_kernel = tail_tile ? select_kernel(tail_tile, combine_rows, args.fp8) : nullptr;
  if (!main_kernel || (tail_tile && !tail_kernel)) return cudaErrorInvalidValue;
  // Wide last tiles (RowSplit::wide_tile): with the split on and token tile 128, on by default (EP_COMM_GEMM_WIDE_TILE=144;
  // =0 off). Measured on H200 at routed ~256 rows per expert (bench/RESULTS.md, eighteenth session): w1 3.31-3.36 vs
  // 3.44-3.45 ms, w2 1.86-1.87 vs 1.98 ms, MoE layer (world 1, graph) 5.80-5.81 vs 6.12-6.13 ms. Only the default CTA
  // shape has a 144 kernel: under a tuning override without one the wide launch is simply left out.
  static const bool wide_allowed = env_choice("EP_COMM_GEMM_WIDE_TILE", {"144", "0"}) == 0;
  LaunchFn wide_kernel =
      wide_allowed && !args.fp8 && tail_tile != 0 && tile == 128 ? select_kernel(144, combine_rows, false) : nullptr;
  // The warp-specialized form's tile 144 (A double-buffered per group of two k-steps; combine rows staged in two
  // halves). The wide launch never runs behind waves.
  if (ws_form && wide_kernel != nullptr) {
    wide_kernel = combine_rows ? (ws_cluster == 1 ? launch_ws_tile<1, 144, true> : launch_ws_tile<2, 144, true>)
                               : (ws_cluster == 1 ? launch_ws_tile<1, 144, false> : launch_ws_tile<2, 144, false>);
  }
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
