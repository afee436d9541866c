// NVFP4 x NVFP4 grouped GEMM for the MoE experts on Hopper: wgmma with the weights as the register operand.
//
// Problem transposed ("swap AB"): the weights are wgmma's A (M = weight rows), the tokens its B (N = tokens of
// one expert). Hopper has no FP4 MMA, so each thread turns its own NVFP4 weight codes into fp16 in registers:
// E2M1 * E4M3 has at most 6 significant bits, so with the weights scaled by 2^-7 every product is an exact fp16
// (normal or subnormal, see below) and the MMA accumulates exact products in FP32 -- the only difference from
// an FP32 reference is the summation order. Activations arrive as fp16 block values (e2m1 * block scale, exact)
// in the dispatch layout; both outer FP32 scales are applied in the epilogue.
//
// CTA = kWarpGroups (2 or 4) warpgroups; warpgroup g owns weight tile mt = cta * kWarpGroups + g (64 rows) and all
// of the CTA's token tile (kTile tokens of one expert). Every thread streams its own packed weight bytes
// (16 B of codes per 64-wide k-block) with cp.async into a private smem slot; 16 lanes of each warpgroup copy
// the tile's 256 scale bytes; the token tile is shared and published with a barrier. kStages-deep ring;
// stage kb + kStages - 1 is loaded into the slot of kb - 1 once that block's wgmma has retired.
//
// Weight decode (layout in ep_comm/grouped_gemm.py): for pair j of a k-step word w,
//   ((w << 3j) & 0x0E000E00) | ((w << j) & 0x80008000)   is the fp16x2 of the two E2M1 values * 2^-14
// (magnitude bits at the fp16 exponent/mantissa boundary; E2M1's subnormal 0.5 lands on fp16's subnormal
// 2^-15, so zero and 0.5 need no special case). The scale code c of E4M3 scale s gives the fp16 s * 2^7 as
// c << 7. Product: v * s * 2^-7, at least 2^-17 in magnitude (a multiple of 2^-17, exact even as an fp16
// subnormal) and at most 6 * 448 * 2^-7 = 21. fp16 HMUL2 keeps subnormals (no flush for f16 on sm_90).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "grouped_gemm.h"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

constexpr int kKBlock = 64;      // k elements per pipeline stage (4 wgmma k-steps of 16)
constexpr int kTileRows = 64;    // weight rows per warpgroup (wgmma M)
constexpr int kValueBytes = 16;  // per thread per k-block: 4 words of E2M1 codes
constexpr int kTileScaleBytes = 256;  // per warpgroup tile per k-block: 64 rows x 4 k-steps, one byte each

template <int kTile, int kWarpGroups>
struct Geometry {
  static constexpr int kThreads = kWarpGroups * 128;
  // B (token) tile of one stage, K-major, in one of two layouts (BLayout below):
  //  * kSwizzle128: token rows of 128 B (64 k) with 16-byte chunk c stored at chunk c ^ (token % 8) -- wgmma's
  //    128-byte swizzle; 8-row groups 1024 B apart; the tile starts 1024-byte aligned.
  //  * kInterleaved (no swizzle): core matrices of 8 tokens x 16 B, laid out [k-chunk 0..7][token][16 B];
  //    consecutive k-chunks kChunkStride apart (16 B of padding shifts them by 4 banks so the 8 lanes that copy
  //    one token's 128 B hit 8 different bank groups).
  static constexpr int kChunkStride = kTile * 16 + 16;        // interleaved: "leading dimension byte offset" (K)
  static constexpr int kGroupStride = 128;                    // interleaved: "stride dimension byte offset"
  static constexpr int kTokensBytes = 8 * kChunkStride > kTile * 128 ? 8 * kChunkStride : kTile * 128;
  static constexpr int kValuesOffset = 0;
  static constexpr int kScalesOffset = kThreads * kValueBytes;
  static constexpr int kTokensOffset = (kScalesOffset + kWarpGroups * kTileScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kStageBytes = (kTokensOffset + kTokensBytes + 1023) / 1024 * 1024;
  // As many stages as ~200 KiB of shared memory holds (1 CTA per SM): loads are issued kStages - 1 k-blocks
  // ahead, which must cover HBM latency under load (~1-2 us) even when a k-block's MMAs take only ~0.5 us.
  // 4 warpgroups: one CTA per SM (~200 KiB); 2 warpgroups: two CTAs per SM (~100 KiB each).
  static constexpr int kSmemBudget = (kWarpGroups == 4 ? 200 : 100) * 1024;
  static constexpr int kStages = (kSmemBudget / kStageBytes) < 16 ? (kSmemBudget / kStageBytes) : 16;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + room to align the ring to 1024 B
};

enum class BLayout : int { kInterleaved = 0, kSwizzle128 = 1 };

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 writes zeros (rows past an expert's count).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// wgmma shared-memory matrix descriptor, no swizzle: start address, K-direction and 8-row-group strides.
__device__ __forceinline__ uint64_t make_descriptor(uint32_t start, uint32_t k_stride, uint32_t group_stride) {
  return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (static_cast<uint64_t>(k_stride >> 4) << 16) |
         (static_cast<uint64_t>(group_stride >> 4) << 32);
}
// 128-byte swizzle, K-major: 8-row groups 1024 B apart (the leading offset is unused: one swizzle atom spans
// all of a k16 step); start = tile base + 32 B per k16 step, the hardware applies the XOR to the final address.
__device__ __forceinline__ uint64_t make_descriptor_sw128(uint32_t start) {
  return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Which expert and which of its token tiles this CTA works on: tile slot `slot` in the concatenation of every
// expert's ceil(count / kTile) tiles. Returns false when the slot is past the last tile.
// Counts are clamped to [0, segment length] (expert_offsets[e + 1] - expert_offsets[e]) and segments to the rows
// of x, so inconsistent offsets/counts cannot make the kernel read or write outside its buffers.
__device__ __forceinline__ int clamped_count(const GroupedGemmArgs& args, int e) {
  const int64_t begin = __ldg(args.expert_offsets + e), end = __ldg(args.expert_offsets + e + 1);
  const int64_t stop = end < args.num_rows_total ? end : args.num_rows_total;
  const int64_t requested = __ldg(args.num_tokens_per_expert + e);
  const int64_t count = requested < stop - begin ? requested : stop - begin;
  return begin < 0 || count < 0 ? 0 : static_cast<int>(count);
}

template <int kTile>
__device__ bool find_tile(const GroupedGemmArgs& args, int slot, int* expert, int* tile_in_expert) {
  const int num_experts = args.num_experts;
  __shared__ int found_expert, found_tile;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int tiles_before = 0;
    int result_expert = -1, result_tile = 0;
    for (int base = 0; base < num_experts && result_expert < 0; base += 32) {
      const int e = base + lane;
      const int count = e < num_experts ? clamped_count(args, e) : 0;
      const int tiles = (count + kTile - 1) / kTile;
      int inclusive = tiles;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (lane >= offset) inclusive += v;
      }
      const int exclusive = tiles_before + inclusive - tiles;
      const bool mine = slot >= exclusive && slot < exclusive + tiles;
      const unsigned hit = __ballot_sync(0xFFFFFFFFu, mine);
      if (hit) {
        const int src = __ffs(hit) - 1;
        result_expert = base + src;
        result_tile = slot - __shfl_sync(0xFFFFFFFFu, exclusive, src);
      }
      tiles_before += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    }
    if (lane == 0) {
      found_expert = result_expert;
      found_tile = result_tile;
    }
  }
  __syncthreads();
  *expert = found_expert;
  *tile_in_expert = found_tile;
  return found_expert >= 0;
}

template <int kTile, int kWarpGroups>
__global__ void __launch_bounds__(kWarpGroups * 128, 4 / kWarpGroups)
    grouped_gemm_nvfp4_kernel(const GroupedGemmArgs args, const BLayout b_layout) {
#if EP_COMM_HAS_WGMMA
  using G = Geometry<kTile, kWarpGroups>;
  constexpr int kThreads = G::kThreads;
  constexpr int kStages = G::kStages;
  constexpr int kAcc = kTile / 2;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The 128-byte swizzle needs 1024-byte aligned tiles: align the ring explicitly (static shared memory may
  // precede the dynamic block).
  uint8_t* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const bool swizzled = b_layout == BLayout::kSwizzle128;

  int expert, tile_in_expert;
  // 1-D grid, weight CTAs fastest: consecutive CTAs share one token tile (read from L2 by all of them).
  const int num_weight_ctas = (args.n / kTileRows + kWarpGroups - 1) / kWarpGroups;
  const int weight_cta = static_cast<int>(blockIdx.x % num_weight_ctas);
  const int tile_slot = static_cast<int>(blockIdx.x / num_weight_ctas);
  if (!find_tile<kTile>(args, tile_slot, &expert, &tile_in_expert)) return;

  const int warp_group = threadIdx.x / 128;
  const int thread_in_group = threadIdx.x % 128;
  const int num_weight_tiles = args.n / kTileRows;
  const int weight_tile = weight_cta * kWarpGroups + warp_group;
  // The last CTA may own fewer than kWarpGroups tiles: its spare warpgroups compute tile 0 again and store
  // nothing. (Skipping the MMA instead would put wgmma on a divergent path, which ptxas serialises.)
  const bool has_rows = weight_tile < num_weight_tiles;
  const int num_k_blocks = args.k / kKBlock;

  const int first_row = __ldg(args.expert_offsets + expert) + tile_in_expert * kTile;
  const int valid_rows = min(kTile, clamped_count(args, expert) - tile_in_expert * kTile);

  // Everything a stage load needs is computed once here; per k-block only a k offset and the ring slot change
  // (the slot advances incrementally: kStages is not a power of two, and % would cost a division per stage).
  // Weights: [expert][weight tile][k-block][thread] x 16 B of codes; scales [expert][weight tile][k-block] x 256 B.
  const int64_t tile_index = static_cast<int64_t>(expert) * num_weight_tiles + (has_rows ? weight_tile : 0);
  const uint8_t* w_values = reinterpret_cast<const uint8_t*>(args.w_values) +
                            (tile_index * num_k_blocks * 128 + thread_in_group) * kValueBytes;
  const bool copies_scales = thread_in_group < kTileScaleBytes / 16;  // 16 lanes x 16 B per tile and k-block
  const uint8_t* w_scales = args.w_scales + tile_index * num_k_blocks * kTileScaleBytes +
                            (copies_scales ? thread_in_group * 16 : 0);
  const uint32_t smem_base = smem_address(smem);
  const uint32_t values_dst = G::kValuesOffset + threadIdx.x * kValueBytes;
  const uint32_t scales_dst = G::kScalesOffset + warp_group * kTileScaleBytes + thread_in_group * 16;
  // Token tile: kTile rows x 8 chunks of 16 B; 8 consecutive lanes copy one row's 128 contiguous bytes; rows
  // past the expert's count are zero-filled (source size 0, from a valid address).
  constexpr int kChunks = kTile * 8;
  constexpr int kCopies = (kChunks + kThreads - 1) / kThreads;
  const uint16_t* token_src[kCopies];
  uint32_t token_dst[kCopies];
  int token_bytes[kCopies];
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int token = chunk / 8, k_chunk = chunk % 8;
    const bool valid = chunk < kChunks && token < valid_rows;
    token_src[i] = args.x + static_cast<int64_t>(valid ? first_row + token : first_row) * args.x_row_stride + k_chunk * 8;
    token_dst[i] = G::kTokensOffset + (swizzled ? token * 128 + ((k_chunk ^ (token % 8)) * 16)
                                                : k_chunk * G::kChunkStride + token * 16);
    token_bytes[i] = chunk < kChunks ? (valid ? 16 : 0) : -1;  // -1: this thread has no chunk
  }

  int load_slot = 0;  // ring slot of the next stage to load
  auto load_stage = [&](int k_block) {
    if (k_block < num_k_blocks) {
      const uint32_t stage = smem_base + load_slot * G::kStageBytes;
      cp_async16(stage + values_dst, w_values + static_cast<int64_t>(k_block) * (128 * kValueBytes), 16);
      if (copies_scales) cp_async16(stage + scales_dst, w_scales + k_block * kTileScaleBytes, 16);
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        if (token_bytes[i] >= 0) cp_async16(stage + token_dst[i], token_src[i] + k_block * kKBlock, token_bytes[i]);
      }
      load_slot = load_slot + 1 == kStages ? 0 : load_slot + 1;
    }
    cp_async_commit();  // always one group per call, so wait_group counts stay uniform
  };

  const int row_r0 = 16 * (thread_in_group / 32) + (thread_in_group % 32) / 4;  // tile rows r0 and r0 + 8
  // This thread's A fragments of k-block k_block (fp16x2, mma.m16n8k16 order) from its private smem bytes.
  auto convert = [&](int slot, uint32_t (&a)[4][4]) {
    const uint8_t* stage = smem + slot * G::kStageBytes;
    const uint4 words = *reinterpret_cast<const uint4*>(stage + G::kValuesOffset + threadIdx.x * kValueBytes);
    // Scale codes of rows r0 and r1, byte s = k-step s (written by other lanes: read after the stage barrier).
    const uint8_t* tile_scales = stage + G::kScalesOffset + warp_group * kTileScaleBytes;
    const uint32_t scales_r0 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * row_r0);
    const uint32_t scales_r1 = *reinterpret_cast<const uint32_t*>(tile_scales + 4 * (row_r0 + 8));
    const uint32_t word[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      // fp16x2 (scale, scale) of row r0 and of row r1 for k-step s: byte s, put in both halves, << 7.
      const uint32_t scale_r0 = __byte_perm(scales_r0, 0, s | 0x4040 | (s << 8)) << 7;
      const uint32_t scale_r1 = __byte_perm(scales_r1, 0, s | 0x4040 | (s << 8)) << 7;
      const uint32_t w = word[s];
      a[s][0] = hmul2_bits(w & 0x8E008E00u, scale_r0);
      a[s][1] = hmul2_bits(((w << 3) & 0x0E000E00u) | ((w << 1) & 0x80008000u), scale_r1);
      a[s][2] = hmul2_bits(((w << 6) & 0x0E000E00u) | ((w << 2) & 0x80008000u), scale_r0);
      a[s][3] = hmul2_bits(((w << 9) & 0x0E000E00u) | ((w << 3) & 0x80008000u), scale_r1);
    }
  };
  auto wait_stage = [&]() {
    wgmma::fence_proxy_async_shared();  // this thread's landed copies, visible to wgmma's async proxy
    __syncthreads();                    // ... and everyone's
  };

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  uint32_t a_even[4][4], a_odd[4][4];  // A fragments of even / odd k-blocks: one is converted while the other's
                                       // wgmma runs (wgmma reads its register operands asynchronously)

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_stage(s);
  cp_async_wait<kStages - 2>();  // stage 0
  wait_stage();
  int slot = 0;  // ring slot of the k-block being multiplied
  convert(slot, a_even);

  // One k-block: issue its wgmma, retire the previous one (so its A registers and B slot are free), then
  // publish the next stage, refill the freed slot kStages - 1 blocks ahead and convert the next A fragments
  // while this wgmma runs. fence_operand keeps the compiler from reusing or moving registers that an
  // in-flight wgmma still reads (A) or writes (accumulators).
  auto step = [&](int k_block, uint32_t (&a_cur)[4][4], uint32_t (&a_next)[4][4]) {
    wgmma::fence_operand(acc);
    wgmma::fence_operand(a_cur);
    wgmma::fence();
    const uint32_t tokens = smem_base + slot * G::kStageBytes + G::kTokensOffset;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint64_t desc = swizzled ? make_descriptor_sw128(tokens + 32 * s)
                                     : make_descriptor(tokens + 2 * s * G::kChunkStride, G::kChunkStride,
                                                       G::kGroupStride);
      wgmma::MmaRS<kTile>::run(acc, a_cur[s], desc);
    }
    wgmma::commit_group();
    wgmma::fence_operand(acc);
    wgmma::wait_group<1>();  // wgmma(k_block - 1) retired
    wgmma::fence_operand(a_next);
    if (k_block + 1 < num_k_blocks) {
      cp_async_wait<kStages - 3>();  // stage k_block + 1
      wait_stage();                  // also: every warpgroup has retired wgmma(k_block - 1)
      load_stage(k_block + kStages - 1);  // into the slot of k_block - 1
      slot = slot + 1 == kStages ? 0 : slot + 1;
      convert(slot, a_next);
    }
  };
  for (int k_block = 0; k_block < num_k_blocks; k_block += 2) {
    step(k_block, a_even, a_odd);
    if (k_block + 1 < num_k_blocks) step(k_block + 1, a_odd, a_even);
  }
  wgmma::wait_group<0>();
  wgmma::fence_operand(acc);
  if (!has_rows) return;

  // Epilogue. Accumulator i of lane l in warp w of the warpgroup: weight row 16 w + l / 4 + 8 * ((i / 2) % 2),
  // token 8 * (i / 4) + 2 * (l % 4) + i % 2. The weights were scaled by 2^-7 in the decode: undo it here.
  // Output columns are weight rows, so one thread's values are never adjacent in memory; lanes l and l ^ 4 hold
  // columns c and c + 1 (c even) for the same two tokens: one shuffle swaps a value so that the even lane owns
  // both columns of the first token and the odd lane both columns of the second -- one 2-wide store each.
  const int warp = thread_in_group / 32, lane = thread_in_group % 32;
  const float weight_factor = __ldg(args.w_factor + expert) * 128.0f;
  const int row_in_tile = 16 * warp + lane / 4;
  const bool even_column = (lane / 4) % 2 == 0;
  auto store_pair = [&](int token, int64_t column, float lo, float hi) {  // out[token][column .. column + 1]
    if (token >= valid_rows) return;
    const int64_t offset = (first_row + token) * args.out_row_stride + column;
    if (args.out_type == 0) {
      *reinterpret_cast<float2*>(static_cast<float*>(args.out) + offset) = make_float2(lo, hi);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(args.out) + offset) =
          __floats2bfloat162_rn(lo, hi);
    }
  };
  // (v_t0, v_t1): this lane's values of one column for tokens t0, t0 + 1 -> stored as column pairs.
  auto exchange_and_store = [&](int t0, int64_t column, float v_t0, float v_t1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, even_column ? v_t1 : v_t0, 4);
    if (even_column) {
      store_pair(t0, column, v_t0, other);          // (c, t0), (c + 1, t0)
    } else {
      store_pair(t0 + 1, column - 1, other, v_t1);  // (c - 1, t0 + 1), (c, t0 + 1)
    }
  };
#pragma unroll
  for (int i = 0; i < kAcc; i += 4) {
    const int t0 = 8 * (i / 4) + 2 * (lane % 4);
    // Row factors of tokens t0, t0 + 1 (0 past the count: those values are computed but never stored).
    const float f0 = t0 < valid_rows ? __ldg(args.row_factor + first_row + t0) * weight_factor : 0.0f;
    const float f1 = t0 + 1 < valid_rows ? __ldg(args.row_factor + first_row + t0 + 1) * weight_factor : 0.0f;
    const float r0_t0 = acc[i] * f0, r0_t1 = acc[i + 1] * f1;          // weight row row_in_tile
    const float r8_t0 = acc[i + 2] * f0, r8_t1 = acc[i + 3] * f1;      // weight row row_in_tile + 8
    if (args.swiglu) {
      // Packed rows 16 q + g (g < 8) are gate 8 q + g, rows 16 q + 8 + g the matching up rows.
      const float h_t0 = r0_t0 / (1.0f + expf(-r0_t0)) * r8_t0;
      const float h_t1 = r0_t1 / (1.0f + expf(-r0_t1)) * r8_t1;
      exchange_and_store(t0, static_cast<int64_t>(weight_tile) * 32 + 8 * warp + lane / 4, h_t0, h_t1);
    } else {
      const int64_t column = static_cast<int64_t>(weight_tile) * kTileRows + row_in_tile;
      exchange_and_store(t0, column, r0_t0, r0_t1);
      exchange_and_store(t0, column + 8, r8_t0, r8_t1);
    }
  }
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

template <int kTile, int kWarpGroups>
cudaError_t launch_tile(const GroupedGemmArgs& args, cudaStream_t stream) {
  using G = Geometry<kTile, kWarpGroups>;
  // The shared-memory opt-in is per kernel and device: remember which devices have it (64 is plenty).
  static std::atomic<uint64_t> configured_devices{0};  // the binding releases the GIL: threads may race here
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (!(configured_devices.load() & bit)) {
    status = cudaFuncSetAttribute(grouped_gemm_nvfp4_kernel<kTile, kWarpGroups>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  G::kSmemBytes);
    if (status != cudaSuccess) return status;
    configured_devices.fetch_or(bit);
  }
  const int64_t weight_ctas = (args.n / kTileRows + kWarpGroups - 1) / kWarpGroups;
  const int64_t tile_slots = (args.num_rows_total + kTile - 1) / kTile + args.num_experts;
  if (weight_ctas * tile_slots > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(weight_ctas * tile_slots));
  // B layout: 128-byte swizzle by default; EP_COMM_GEMM_B_SWIZZLE=0 selects the interleaved (no swizzle) layout.
  static const BLayout b_layout = [] {
    const char* env = std::getenv("EP_COMM_GEMM_B_SWIZZLE");
    return env && std::atoi(env) == 0 ? BLayout::kInterleaved : BLayout::kSwizzle128;
  }();
  grouped_gemm_nvfp4_kernel<kTile, kWarpGroups><<<grid, G::kThreads, G::kSmemBytes, stream>>>(args, b_layout);
  return cudaGetLastError();
}

bool device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
  return major == 9 && minor == 0;
}

}  // namespace

int grouped_gemm_auto_token_tile(int64_t num_rows_total, int num_experts) {
  const int64_t rows_per_expert = num_experts > 0 ? num_rows_total / num_experts : num_rows_total;
  if (rows_per_expert <= 16) return 16;
  if (rows_per_expert <= 32) return 32;
  if (rows_per_expert <= 64) return 64;
  return 128;
}

cudaError_t launch_grouped_gemm_nvfp4(const GroupedGemmArgs& args, cudaStream_t stream) {
  if (args.num_experts <= 0 || args.n <= 0 || args.k <= 0 || args.n % kTileRows != 0 || args.k % kKBlock != 0 ||
      args.num_rows_total < 0 || args.x_row_stride < args.k || args.x_row_stride % 8 != 0 ||
      (args.out_type != 0 && args.out_type != 1) || args.out_row_stride < (args.swiglu ? args.n / 2 : args.n) ||
      (args.swiglu && args.n % 16 != 0) || args.out_row_stride % 2 != 0 ||
      reinterpret_cast<uintptr_t>(args.out) % (args.out_type == 0 ? 8 : 4) != 0) {
    return cudaErrorInvalidValue;  // the epilogue stores column pairs: even row stride, aligned output
  }
  if (args.num_rows_total == 0) return cudaSuccess;
  if (!device_is_sm90()) return cudaErrorNotSupported;
  const int tile = args.token_tile ? args.token_tile : grouped_gemm_auto_token_tile(args.num_rows_total, args.num_experts);
  // Warpgroups per CTA: 4 (256 weight rows, one CTA per SM, each token tile read from L2 half as often) for
  // token tiles of 64 and 128, where the MMA dominates; 2 (128 rows, two CTAs per SM that overlap each other's
  // barriers and conversion) for 16 and 32, where the weight stream and its conversion dominate. Measured on H200
  // (bench/RESULTS.md): 4 is 1.3x faster at 128 rows per expert, 2 is 1.1x faster at 16.
  // EP_COMM_GEMM_WARPGROUPS=2|4 overrides the choice (for tuning).
  static const int forced_warp_groups = [] {
    const char* env = std::getenv("EP_COMM_GEMM_WARPGROUPS");
    return env ? std::atoi(env) : 0;
  }();
  const int warp_groups = forced_warp_groups == 2 || forced_warp_groups == 4 ? forced_warp_groups : (tile <= 32 ? 2 : 4);
  switch (tile * 10 + warp_groups) {
    case 162:
      return launch_tile<16, 2>(args, stream);
    case 164:
      return launch_tile<16, 4>(args, stream);
    case 322:
      return launch_tile<32, 2>(args, stream);
    case 324:
      return launch_tile<32, 4>(args, stream);
    case 642:
      return launch_tile<64, 2>(args, stream);
    case 644:
      return launch_tile<64, 4>(args, stream);
    case 1282:
      return launch_tile<128, 2>(args, stream);
    case 1284:
      return launch_tile<128, 4>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace ep_comm
