// The grouped GEMM's shared device pieces: operand constants, the NVFP4 weight decode, the tile scan, the epilogues.
// Used by both kernel forms -- the classic one (grouped_gemm.cu: every warpgroup loads and computes) and the
// warp-specialized one (grouped_gemm_ws.cu: a producer warp feeds consumer warpgroups), which must give bitwise the
// same results: the same decode, the same work items and the same epilogue formulas live here once. The weight
// decode's derivation is in grouped_gemm.cu's header comment. Internal to csrc (not part of the torch-free API in
// grouped_gemm.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "grouped_gemm.h"
#include "s2f6_lane.cuh"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace grouped_gemm_detail {

constexpr int kKBlock = 64;      // k elements per k-block (4 wgmma k-steps of 16)
constexpr int kTileRows = 64;    // weight rows per warpgroup (wgmma M)
constexpr int kValueBytes = 16;  // per thread per k-block: 4 words of E2M1 codes
constexpr int kTileScaleBytes = 256;  // per warpgroup tile per k-block: 64 rows x 4 k-steps, one byte each

// fp16x2 a * (b's low or high half in both halves): the broadcast folds into HMUL2's operand (R.H0_H0 / R.H1_H1).
template <int kHalf>
__device__ __forceinline__ uint32_t hmul2_broadcast(uint32_t a, uint32_t b) {
  const __half2 b2 = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), kHalf == 0 ? __low2half2(b2) : __high2half2(b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Pair decode masks and multipliers (see grouped_gemm.cu's header comment): field of pair j in the k-step word, and 2^a + 2^b.
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

// The fp16 scale * 2^7 halves of k-step `k_step` (0..3, a constant after unrolling) from a row's 4-byte scale word
// (one E4M3 code per k-step): fp16 scale * 2^7 = code << 7, so k-steps 0 and 2 are the halves of word << 7 and 1 and
// 3 those of word >> 1 (masked); decode_k_step<0> takes the low half (k-steps 0, 1), <1> the high one (2, 3).
__device__ __forceinline__ uint32_t k_step_scales(uint32_t scale_word, int k_step) {
  return (k_step % 2 == 0 ? scale_word << 7 : scale_word >> 1) & 0x7F807F80u;
}

// k-step `k_step`'s A fragment from its code word w and the scale words of rows r0 and r0 + 8.
__device__ __forceinline__ void decode_scaled_k_step(const uint32_t w, uint32_t scales_r0, uint32_t scales_r1,
                                                     int k_step, uint32_t (&out)[4]) {
  const uint32_t s0 = k_step_scales(scales_r0, k_step), s1 = k_step_scales(scales_r1, k_step);
  if (k_step < 2) {
    decode_k_step<0>(w, s0, s1, out);
  } else {
    decode_k_step<1>(w, s0, s1, out);
  }
}

// Group kGroup (kStepsPerGroup k-steps: k-steps kGroup * kStepsPerGroup ..) of a thread's A fragments of one 64-row
// weight tile and k-block, for the kernels that decode a k-block in groups (the classic kernel's wide tile, the
// warp-specialized form): `values` is the thread's 16 bytes of codes (4 k-step words), `tile_scales` the tile's 256
// scale bytes (row r at 4 r). Group 0 reads rows r0's and r0 + 8's scale words into `scale_words`, which the caller
// keeps for the k-block's later groups.
template <int kStepsPerGroup, int kGroup>
__device__ __forceinline__ void decode_k_step_group(const uint8_t* values, const uint8_t* tile_scales, int row_r0,
                                                    uint32_t (&scale_words)[2], uint32_t (&a)[kStepsPerGroup][4]) {
  static_assert((kGroup + 1) * kStepsPerGroup <= 4, "a k-block has 4 k-steps");
  if constexpr (kGroup == 0) {
    scale_words[0] = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * row_r0);
    scale_words[1] = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * (row_r0 + 8));
  }
#pragma unroll
  for (int i = 0; i < kStepsPerGroup; ++i) {
    const int k_step = kGroup * kStepsPerGroup + i;  // compile-time after unrolling
    const uint32_t w = *reinterpret_cast<const uint32_t*>(values + 4 * k_step);
    decode_scaled_k_step(w, scale_words[0], scale_words[1], k_step, a[i]);
  }
}

// A thread's A fragments of one 64-row weight tile and k-block: its 16 bytes of codes at `values` (4 k-step words)
// and the tile's 256 scale bytes at `tile_scales` (row r at 4 r, byte s = k-step s), of which it reads rows r0 and
// r0 + 8.
__device__ __forceinline__ void decode_a_fragments(const uint8_t* values, const uint8_t* tile_scales, int row_r0,
                                                   uint32_t (&a)[4][4]) {
  const uint4 words = *reinterpret_cast<const uint4*>(values);
  const uint32_t scales_r0 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * row_r0);
  const uint32_t scales_r1 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * (row_r0 + 8));
  // (Each row's two masked words once, for k-steps 0 / 2 and 1 / 3: written per k-step, ptxas schedules the FP8
  // combine-row kernel of tile 32 eight instructions longer.)
  const uint32_t even_r0 = k_step_scales(scales_r0, 0), odd_r0 = k_step_scales(scales_r0, 1);
  const uint32_t even_r1 = k_step_scales(scales_r1, 0), odd_r1 = k_step_scales(scales_r1, 1);
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
// (rows: this launch's part, rows_of_part); expert -1 when the slot is past the last tile. Warp 0 runs it
// (lane = threadIdx.x; `slot` only matters in lane 0) and every lane gets the result. `cursor` starts zeroed (base 0,
// tiles_before 0, loaded false) and only warp 0 touches it. The tile's rows come from the scan's own loads, so the
// caller needs no further (dependent) global load to start the tile. Callers: the classic kernel's find_tile
// (grouped_gemm.cu), and the warp-specialized kernel's producer warp (grouped_gemm_ws.cu), after a __syncwarp that
// orders its lane 0's cursor writes of the previous call before the other lanes' reads.
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

#endif  // EP_COMM_HAS_WGMMA

// A launch of one kernel form for one part of the rows (RowSplit) over `tile_slots` token-tile slots.
using LaunchFn = cudaError_t (*)(const GroupedGemmArgs&, RowSplit, int64_t, cudaStream_t);

// Test hook EP_COMM_GEMM_MAX_CTAS (grouped_gemm.cu): the cap on any launch's CTAs, 0 for none, -1 for a bad value.
int max_ctas_override();

// The grid of a launch over `items` work items, for both kernel forms: one CTA per item, or (persistent) as many as are
// resident at once (at `threads` per CTA and `smem_bytes` of dynamic shared memory), capped by the test hook (which
// only caps persistent launches: its callers make every launch persistent when it is set); 0 when there are no items.
// Refuses a malformed hook, and launches whose item indices would overflow an int: the last index a CTA computes
// before stopping is below items + grid (persistent), or is its first item.
template <typename Kernel>
cudaError_t work_item_grid(Kernel kernel, int threads, size_t smem_bytes, int64_t items, bool persistent,
                           int64_t* grid) {
  const int max_ctas = max_ctas_override();
  if (max_ctas < 0) return cudaErrorInvalidValue;
  *grid = items;
  if (persistent) {
    const cudaError_t occupancy = resident_grid(kernel, threads, items, grid, smem_bytes);
    if (occupancy != cudaSuccess) return occupancy;
    if (max_ctas > 0 && *grid > max_ctas) *grid = max_ctas;
  }
  return items + (persistent ? *grid : 0) > INT32_MAX ? cudaErrorInvalidValue : cudaSuccess;
}

// The warp-specialized form's launch for token tile 128 or 144 (grouped_gemm_ws.cu), or nullptr for other tiles.
LaunchFn warp_specialized_launch(int tile, bool combine_rows);

}  // namespace grouped_gemm_detail
}  // namespace ep_comm
