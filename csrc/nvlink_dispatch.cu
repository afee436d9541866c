// Dispatch over NVLink: fused quantize-and-send, then receive-and-expand into the expert-major layout.
//
// Send (rank s): one warp per token. The warp reads the bf16 row, quantizes it once in registers
// (NVFP4 4/6 with a per-token amax, MXFP8 or raw BF16) and stores each 16-byte piece directly into the
// staging slot of every destination rank (peer pointers; slots from the layout kernel), followed by the
// metadata the receiver needs (token index, the K expert ids, weights and in-expert positions). The block
// that starts first also writes this rank's counts into every peer. Each block then bumps its "ready" counter
// in every peer (release, system scope). With direct self rows (nvlink.h), the rows for this rank itself go
// straight into the expert-major output, handle included, once every source's counts are in.
//
// Receive (rank d): every block waits for all sources' counters, computes the expert segment offsets
// from the exchanged counts (redundantly, it is a few hundred integers), then warps copy staging rows
// into the expert-major output, once per local slot, and record where each slot landed (the handle
// combine needs). Padding rows are zeroed; rows past the valid prefix get src_rank = -1 metadata.
// Each block finally bumps the "consumed" counter in every source, which lets the next dispatch reuse
// the staging area. With direct self rows it skips this rank's own source (the send wrote those rows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "nvlink.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace nvlink {
namespace {

using namespace ep_comm::qm;

// 8 bf16 (one 16-byte vector) to fp32, exact.
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* out) {
  vec::Elem<__nv_bfloat16>::unpack(v, out);
}

// 32 bf16 elements (64 bytes at src) as four 16-byte vectors.
struct Chunk32 {
  uint4 v[4];
  __device__ __forceinline__ void load(const unsigned char* src) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = ld_input_v4(src + 16 * i);
  }
};

// One NVFP4 4/6 block (16 bf16 elements) through the general form, returned by value
// (nvfp4_four_six_block16_general_value: with it only the general path touches the stack; given the caller's array
// it cost the send 5 local stores and 3 loads per chunk on the fast path).
__device__ __forceinline__ Nvfp4BlockFast nvfp4_block16_general_by_value(const uint4& lo, const uint4& hi,
                                                                         const Nvfp4Outer& outer, float amax) {
  float xb[16];
  bf16x8_to_float(lo, xb);
  bf16x8_to_float(hi, xb + 8);
  return nvfp4_four_six_block16_general_value(xb, vec::bf16_block16_amax(lo, hi), outer, amax, 256.0f);
}

// 32 bf16 elements -> two NVFP4 4/6 blocks: 16 code bytes and two scale bytes (low byte first). Both blocks go
// through the straight-line fast path first (their instructions interleave), then the general form where it did not
// decide. No address of `fast` is taken (constant indices once unrolled): it stays in registers.
__device__ __forceinline__ uint4 quantize_nvfp4_chunk32(const Chunk32& chunk, Nvfp4Outer outer, float amax,
                                                    unsigned int* scales) {
  Nvfp4BlockFast fast[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint4& lo = chunk.v[2 * half];
    const uint4& hi = chunk.v[2 * half + 1];
    float xb[16];
    bf16x8_to_float(lo, xb);
    bf16x8_to_float(hi, xb + 8);
    // The block amax on bf16 pairs (exact, NaN ignored as block_amax16 does) and the sign bytes straight from the
    // raw pairs: half the instructions of the fp32 forms.
    const uint32_t signs[4] = {sign_bytes4_16bit(lo.x, lo.y), sign_bytes4_16bit(lo.z, lo.w),
                               sign_bytes4_16bit(hi.x, hi.y), sign_bytes4_16bit(hi.z, hi.w)};
    fast[half] = nvfp4_four_six_block16_fast(xb, vec::bf16_block16_amax(lo, hi), outer, amax, signs);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (!fast[half].decided)
      fast[half] = nvfp4_block16_general_by_value(chunk.v[2 * half], chunk.v[2 * half + 1], outer, amax);
  }
  *scales = static_cast<unsigned int>(fast[0].scale) | (static_cast<unsigned int>(fast[1].scale) << 8);
  return make_uint4(fast[0].words[0], fast[0].words[1], fast[1].words[0], fast[1].words[1]);
}

// MXFP8 unit h of a bf16 row (16 elements, 16 output bytes) by one lane: lanes 2i and 2i + 1 hold the two halves of
// one 32-element block and share its amax by a shuffle, so the whole warp calls this together (with h = base + lane,
// base even; an inactive lane, h >= the row's units, adds amax 0 and its result is unused). Returns the 16 E4M3 bytes
// and sets `scale` to the block's UE8M0 byte. Used by the send (staging rows; kCoherent false: x through the read-only
// path) and by the receive for this rank's own tokens (self rows from x; kCoherent true, as its BF16 copy reads x):
// the same bytes either way. The amax is taken on the raw bf16 pairs (exact, NaN ignored, as fmaxf over the fp32
// values) and each pair is widened only when it is encoded: 8 live data registers instead of 16 floats, which keeps
// the receive kernel that inlines this out of spills.
template <bool kCoherent>
__device__ __forceinline__ uint4 mxfp8_unit16(const unsigned char* xrow, int h, bool active, uint8_t& scale) {
  uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
  if (active) {
    const unsigned char* src = xrow + static_cast<long long>(h) * 32;
    lo = kCoherent ? ld_coherent_v4(src) : ld_input_v4(src);
    hi = kCoherent ? ld_coherent_v4(src + 16) : ld_input_v4(src + 16);
  }
  float a = vec::bf16_block16_amax(lo, hi);  // 0 for an inactive lane
  a = qm_max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
  scale = 0;
  if (!active) return make_uint4(0u, 0u, 0u, 0u);
  scale = ue8m0_mxfp8_scale(a);
  const float p = ue8m0_inverse(scale);
  const uint32_t raw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};  // element 2j in the low half of word j
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w0 = raw[2 * i], w1 = raw[2 * i + 1];
    const uint32_t lo_pair = e4m3x2_encode(qm_mul(__uint_as_float(w0 << 16), p),
                                           qm_mul(__uint_as_float(w0 & 0xFFFF0000u), p));
    const uint32_t hi_pair = e4m3x2_encode(qm_mul(__uint_as_float(w1 << 16), p),
                                           qm_mul(__uint_as_float(w1 & 0xFFFF0000u), p));
    words[i] = lo_pair | (hi_pair << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Row amax of a bf16 row (NaN ignored, Inf kept) by the whole warp: bf16x2 max, exact (max is order-free,
// so any grouping gives the same bits). U = 14 loads in flight per lane: an H = 7168 row (28 pieces per lane) takes
// 2 dependent load rounds (4 with U = 8, 7 with one load at a time), which is the amax latency of a small call
// (every warp of a token computes the whole row's amax before quantizing its part). `between()` runs once, after the
// first round's loads are issued and before their values are used: the caller's other loads (the token's routing,
// one of which depends on another) then wait alongside the row instead of before it (with the layout change of the
// same commit: NVFP4 dispatch -6.5% at one token, -2.1% at 128, world 1, bench/RESULTS.md, thirty-sixth session).
template <typename Between>
__device__ __forceinline__ float warp_row_amax(const unsigned char* row, int hidden, int lane, Between&& between) {
  constexpr int U = 14;
  constexpr int kAcc = 2;  // independent max chains (max is exact: the grouping changes no bit)
  __nv_bfloat162 acc[kAcc];
#pragma unroll
  for (int u = 0; u < kAcc; ++u) acc[u] = __floats2bfloat162_rn(0.0f, 0.0f);
  const int pieces = hidden / 8;
  bool between_done = false;
  for (int c0 = lane; c0 < pieces; c0 += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      v[u] = c < pieces ? ld_input_v4(row + static_cast<long long>(c) * 16) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (!between_done) {
      between();
      between_done = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned int w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
        acc[u % kAcc] = __hmax2(acc[u % kAcc], __habs2(h));  // __hmax2 returns the non-NaN operand; acc is never NaN
      }
    }
  }
  if (!between_done) between();  // a lane past the row's pieces (H < 256) issued no loads
  float a = 0.0f;
#pragma unroll
  for (int u = 0; u < kAcc; ++u) a = fmaxf(a, fmaxf(__low2float(acc[u]), __high2float(acc[u])));
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  return a;
}

// Expert-major layout of this rank's output from the exchanged counts (every source's counts must be in),
// computed by the whole block into shared memory: seg_start[s][j] = first output row of source s's rows for
// local expert j, offsets[j] = first row of expert j (segments aligned), totals[j] = rows of expert j, ntok[s] =
// staging rows from source s, item_start[s] = prefix of ntok, has_row_flags[s] = whether source s's rows carry row
// flags in this call. A few hundred integers: every block computes it.
struct ReceiveLayout {
  int* seg_start;   // [W][E_local]
  int* offsets;     // [E_local + 1]
  int* totals;      // [E_local]
  int* ntok;        // [W]
  int* item_start;  // [W + 1]
  int* has_row_flags;  // [W]
  // The ints the arrays above take, in this order: receive_layout_smem's size (counted in size_t: Python asks for
  // configurations it has not refused yet).
  static __host__ __device__ size_t ints(size_t world, size_t num_local) {
    return world * num_local + (num_local + 1) + num_local + world + (world + 1) + world;
  }
  __device__ ReceiveLayout(int* smem, int world, int num_local)
      : seg_start(smem),
        offsets(smem + world * num_local),
        totals(offsets + num_local + 1),
        ntok(totals + num_local),
        item_start(ntok + world),
        has_row_flags(item_start + world + 1) {}
};

// Inclusive prefix sum of v over the warp's lanes (whole warp).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int below = __shfl_up_sync(0xFFFFFFFFu, v, o);
    if (lane >= o) v += below;
  }
  return v;
}

__device__ void compute_receive_layout(const NvlinkConfig& cfg, const ReceiveLayout& L, long long num_rows) {
  const int world = cfg.world;
  const int num_local = cfg.num_local;
  const int* counts = reinterpret_cast<const int*>(cfg.local_base + cfg.off_counts);
  for (int i = threadIdx.x; i < world * num_local; i += blockDim.x) {
    const int s = i / num_local;
    L.seg_start[i] = static_cast<int>(ld_coherent_u32(counts + s * cfg.count_stride + (i - s * num_local)));
  }
  for (int s = threadIdx.x; s < world; s += blockDim.x) {
    L.ntok[s] = static_cast<int>(ld_coherent_u32(counts + s * cfg.count_stride + num_local));
    L.has_row_flags[s] = static_cast<int>(ld_coherent_u32(counts + s * cfg.count_stride + num_local + 1));
  }
  __syncthreads();
  // Per expert j (thread j of each round of blockDim.x experts): total rows, seg_start[s][j] the prefix over sources
  // (offset added below), and the exclusive scan of the aligned segment sizes by the whole block -- each warp scans
  // its 32 experts, warp 0 scans the warp sums. Integer sums: the same offsets as any order gives. The receive, and the
  // send with direct self rows, wait for this on a small call's critical path: with one warp scanning 32 experts per
  // step, this function took 2.8-2.9 us of a 1- or 128-token dispatch at 256 local experts, 1.6-1.7 us in this form
  // (in-kernel timer stamps at world 1 on H200, bench/RESULTS.md, thirty-third session).
  __shared__ int warp_sums[kCommThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  int carry = 0;
  for (int base = 0; base < num_local; base += blockDim.x) {
    const int j = base + threadIdx.x;
    int size = 0;
    if (j < num_local) {
      int run = 0;
      for (int s = 0; s < world; ++s) {
        const int v = L.seg_start[s * num_local + j];
        L.seg_start[s * num_local + j] = run;
        run += v;
      }
      L.totals[j] = run;
      size = (run + cfg.alignment - 1) / cfg.alignment * cfg.alignment;
    }
    const int incl = warp_inclusive_sum(size, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int v = warp_inclusive_sum(lane < num_warps ? warp_sums[lane] : 0, lane);
      if (lane < num_warps) warp_sums[lane] = v;  // inclusive over warps
    }
    __syncthreads();
    if (j < num_local) L.offsets[j] = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + incl - size;
    carry += warp_sums[num_warps - 1];
    __syncthreads();  // warp_sums is rewritten by the next round
  }
  if (warp == 0) {  // the offsets' end, and the staging items' prefix over sources (32 sources per step)
    if (lane == 0) L.offsets[num_local] = carry;
    int run = 0;
    for (int base = 0; base < world; base += 32) {
      const int s = base + lane;
      const int n = s < world ? L.ntok[s] : 0;
      const int incl = warp_inclusive_sum(n, lane);
      if (s < world) L.item_start[s] = run + incl - n;
      run += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) L.item_start[world] = run;
  }
  __syncthreads();
  // Counts that do not fit the result (only when counts of different calls meet after a timeout): recorded as a fault
  // and the layout emptied, so that nothing below writes past the result (row_in_capacity guards single rows).
  if (L.offsets[num_local] > num_rows) {
    if (threadIdx.x == 0) row_in_capacity(cfg, L.offsets[num_local], num_rows, kErrorNoPeer);
    __syncthreads();  // every thread has read offsets[num_local] above
    for (int j = threadIdx.x; j <= num_local; j += blockDim.x) {
      L.offsets[j] = 0;
      if (j < num_local) L.totals[j] = 0;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < world * num_local; i += blockDim.x) L.seg_start[i] += L.offsets[i % num_local];
  __syncthreads();
}

// Routing of this rank's token t, lane k < K: expert e (-1 masked), staging slot at the expert's rank (only on the first
// lane of each destination rank, else -1), position among this rank's rows for that expert, weight. Layout-kernel
// outputs (chunk-relative slots and positions plus per-chunk bases) and the handle copies; local data only.
__device__ __forceinline__ void token_routing(const NvlinkConfig& cfg, const DispatchArgs& args, int t, int lane,
                                              int& e, int& slot, int& pos, float& w) {
  const long long q = static_cast<long long>(t) * cfg.topk + lane;
  const int* chunk_base =
      cfg.layout_base + static_cast<long long>(t / args.chunk_tokens) * (cfg.num_experts + cfg.world);
  e = -1;
  slot = -1;
  pos = -1;
  w = 0.0f;
  if (lane < cfg.topk) {
    e = args.send_idx[q];
    slot = cfg.scratch_slot[q];
    if (e >= 0) {
      pos = cfg.scratch_pos[q] + chunk_base[e];
      if (slot >= 0) slot += chunk_base[cfg.num_experts + e / cfg.num_local];
    }
    w = args.send_w[q];
  }
}

// What this rank records for one staging row (source s, slot j) of token t: the combine handle's entry (recv_tok,
// recv_ord, and recv_rows[(s, j)][k] = the output row of slot k, -1 when slot k's expert is elsewhere) and the metadata
// of its output rows (the NVFP4 amax is the caller's). Whole warp; lane k < K passes slot k's destination rank
// (-1: masked), output row (-1: not here) and weight. The receive calls it for the staging rows it expands, the send
// for the rows it stores itself (direct self rows).
__device__ __forceinline__ void record_staging_row(const NvlinkConfig& cfg, const DispatchArgs& args, int s, int j,
                                                   int t, int lane, int slot_rank, int out_row, float w) {
  int ordinal, num_ranks;
  distinct_rank_info(slot_rank, cfg.topk, lane, cfg.rank, &ordinal, &num_ranks);
  const long long handle_index = static_cast<long long>(s) * cfg.max_tokens + j;
  if (lane < cfg.topk) args.recv_rows[handle_index * cfg.topk + lane] = out_row;
  if (out_row >= 0) {
    args.src_rank[out_row] = s;
    args.src_token[out_row] = t;
    args.topk_slot[out_row] = lane;
    args.topk_weight[out_row] = w;
    args.row_weight[out_row] = w;
  }
  if (lane == 0) {
    args.recv_tok[handle_index] = t;
    args.recv_ord[handle_index] = ordinal;
  }
}

// record_staging_row for a row this rank sends to itself without a staging row (direct self rows, self rows from
// x): its staging slot is the one the token holds at this rank, on its first lane with an expert here (`here`: lane
// k's expert is on this rank; slot and e as token_routing gives them). Whole warp.
__device__ __forceinline__ void record_own_row(const NvlinkConfig& cfg, const DispatchArgs& args, int t, int lane,
                                               int e, int slot, bool here, int out_row, float w) {
  const unsigned int holder = __ballot_sync(0xFFFFFFFFu, here && slot >= 0);
  const int my_slot = __shfl_sync(0xFFFFFFFFu, slot, __ffs(holder) - 1);
  record_staging_row(cfg, args, cfg.rank, my_slot, t, lane, lane < cfg.topk && e >= 0 ? e / cfg.num_local : -1,
                     out_row, w);
}

// One work item = (token, part g of G): the G warps of a token split its 16-byte units round-robin in
// groups of 32 (G > 1 only when there are fewer tokens than warps, i.e. small latency-bound calls).
// Templated on the format so that each path gets its own register allocation (the NVFP4 math would
// otherwise set the budget of the BF16 copy loop and vice versa).
template <int kFmt>
__global__ void __launch_bounds__(kCommThreads) dispatch_send_kernel(NvlinkConfig cfg, DispatchArgs args) {
  extern __shared__ int smem[];  // direct self rows: the receive layout (ReceiveLayout)
  __shared__ char* dest_rows[kCommThreads / 32][kMaxTopk];
  __shared__ int self_rows[kCommThreads / 32][kMaxTopk];
  __shared__ unsigned int* dest_flags[kCommThreads / 32][kMaxTopk];  // row flags of the rows in dest_rows
  __shared__ bool counts_writer;
  if (threadIdx.x == 0) {
    // The grid is the same every call and calls are stream-ordered, so ticket % grid is this block's start order. Drawn
    // before the block lets its dependents launch (block_epoch_from_ticket says why).
    counts_writer = atomicAdd(&cfg.state->send_arrivals, 1ull) % gridDim.x == 0ull;
  }
  __syncthreads();
  pdl_prologue();
  const unsigned long long epoch = cfg.state->disp_epoch;
  const int lane = threadIdx.x % 32;
  const int topk = cfg.topk;
  const int hidden = cfg.hidden;
  // Compiled for NVFP4 only (the host sets direct_self for NVFP4 only).
  const bool direct_self = kFmt == kDispNvfp4 && args.direct_self != 0;
  // BF16 / MXFP8 self rows made by the receive from x (DispatchArgs::self_from_x): no staging row for this rank itself.
  const bool skip_self_staging = direct_self || ((kFmt == kDispBf16 || kFmt == kDispMxfp8) && args.self_from_x != 0);
  const int first_expert = cfg.rank * cfg.num_local;
  const int warps_per_block = blockDim.x / 32;
  const int warp_in_block = threadIdx.x / 32;
  const int global_warp = blockIdx.x * warps_per_block + warp_in_block;
  const int num_warps = gridDim.x * warps_per_block;
  const long long staging_base = cfg.off_staging + static_cast<long long>(cfg.rank) * cfg.max_tokens * cfg.disp_row_bytes;
  // Units of 16 output bytes per row: NVFP4 32 elements, MXFP8 16 elements, BF16 8 elements.
  const int units = kFmt == kDispNvfp4 ? hidden / 32 : (kFmt == kDispMxfp8 ? hidden / 16 : hidden / 8);
  const int split = split_factor(args.num_tokens, num_warps, (units + 31) / 32);
  const long long num_items = static_cast<long long>(args.num_tokens) * split;
  // Row flags for a streaming receive: only when one warp writes a whole row (split == 1), so that the warp's release
  // covers the row. Whether they are written travels with the counts (an explicit word, not inferred from the split:
  // a rank with EP_COMM_NVLINK_STREAM_RECV=0 writes none); without them the receive waits for disp_ready.
  const bool row_flags = args.stream_recv != 0 && split == 1;
  const unsigned int flag_epoch = static_cast<unsigned int>(epoch);

  // Routing of an item's token (lane k < K: expert, staging slot at the destination, position in the
  // expert, weight) and, for NVFP4, the token's row amax (every part needs the whole row's). Local data
  // only (layout kernel outputs and x); whole warp calls.
  auto load_item = [&](long long item, int& e, int& slot, int& pos, float& w, float& amax) {
    const int t = static_cast<int>(item / split);
    amax = 0.0f;
    if (kFmt == kDispNvfp4) {  // the row's first amax loads go out before the routing loads
      const unsigned char* xrow = reinterpret_cast<const unsigned char*>(args.x) + static_cast<long long>(t) * hidden * 2;
      amax = warp_row_amax(xrow, hidden, lane, [&] { token_routing(cfg, args, t, lane, e, slot, pos, w); });
    } else {
      token_routing(cfg, args, t, lane, e, slot, pos, w);
    }
  };

  // The warp's first item is read before the wait below: only the stores into the destinations' staging
  // rows (and the counts writer's stores) must wait until the previous dispatch there has been consumed, so the
  // routing loads and the NVFP4 amax overlap the flag poll (or a wait for a late peer).
  int e = -1, slot = -1, pos = -1;
  float w = 0.0f, token_amax = 0.0f;
  if (global_warp < num_items) load_item(global_warp, e, slot, pos, w, token_amax);

  // The previous dispatch kept its staging rows as its result (DispatchArgs::row_index): its receive did not tell the
  // sources they may overwrite them. This send comes after every use of that result on this rank (stream order), so it
  // tells them now, on the receive's behalf, before waiting for the same from them (each rank releases before it
  // waits: no cycle). Decided on the device, so a graph that mixes both kinds of dispatch replays correctly.
  if (counts_writer && threadIdx.x == 0 && epoch > 1ull && cfg.state->held_epoch == epoch - 1ull) {
    signal_all_peers_once(cfg, cfg.off_disp_consumed, static_cast<unsigned long long>(cfg.disp_recv_blocks));
  }
  // The destinations' staging areas still hold the previous dispatch until they have read it.
  if (!block_wait_all_peers(cfg, cfg.off_disp_consumed, (epoch - 1ull) * cfg.disp_recv_blocks,
                            kStageDispatchWaitConsumed, epoch)) {
    return;  // gave up (aborted()): nothing more into the peers, whose staging may still be in use
  }

  // (counts_writer was drawn before the barrier at the top.)
  if (counts_writer) {
    const int per_rank = cfg.num_local + 2;  // expert counts, token count, row flags written (0/1)
    for (int i = threadIdx.x; i < cfg.world * per_rank; i += blockDim.x) {
      const int d = i / per_rank;
      const int j = i - d * per_rank;
      const int v = j < cfg.num_local ? cfg.expert_count[d * cfg.num_local + j]
                                      : (j == cfg.num_local ? cfg.rank_count[d] : (row_flags ? 1 : 0));
      int* dst = reinterpret_cast<int*>(peer_ptr(cfg, d, cfg.off_counts)) + cfg.rank * cfg.count_stride + j;
      *dst = v;
    }
    block_signal_all_peers(cfg, cfg.off_disp_counts);
  }
  // Direct self rows land at seg_start[my rank][j] + position, which depends on every source's counts.
  const ReceiveLayout layout(smem, cfg.world, cfg.num_local);
  if (direct_self) {
    if (!block_wait_all_peers(cfg, cfg.off_disp_counts, epoch, kStageDispatchWaitCounts, epoch)) return;
    compute_receive_layout(cfg, layout, args.num_rows);
  }
  const int* self_seg_start = layout.seg_start + cfg.rank * cfg.num_local;

  for (long long item = global_warp; item < num_items; item += num_warps) {
    if (item != global_warp) load_item(item, e, slot, pos, w, token_amax);
    const int t = static_cast<int>(item / split);
    const int part = static_cast<int>(item - static_cast<long long>(t) * split);
    // Lanes whose expert is on this rank write its expert-major row directly (direct_self); the staging rows
    // (one per destination rank, on the rank's first slot) are then for the other ranks only.
    // self_here: the lane's expert is on this rank (direct_self); self_lane: and its row is inside the result (always,
    // unless counts and rows of different calls met after a timeout: row_in_capacity records that).
    const bool self_here = direct_self && e >= first_expert && e < first_expert + cfg.num_local;
    const int self_row = self_here ? row_in_capacity(cfg, static_cast<long long>(self_seg_start[e - first_expert]) + pos,
                                                     args.num_rows, cfg.rank) : -1;
    const bool self_lane = self_row >= 0;
    const bool staging_lane = slot >= 0 && !(skip_self_staging && e / cfg.num_local == cfg.rank);
    const unsigned int dest_mask = __ballot_sync(0xFFFFFFFFu, staging_lane);
    const unsigned int self_mask = direct_self ? __ballot_sync(0xFFFFFFFFu, self_lane) : 0u;
    if ((dest_mask | self_mask) == 0u) continue;  // every slot masked: the token goes nowhere
    // Destination row addresses, compacted into this warp's shared-memory lists (read by every lane
    // inside possibly divergent loops, so no shuffles there).
    const int num_dest = __popc(dest_mask);
    const int num_self = __popc(self_mask);
    const unsigned int lanes_below = (1u << lane) - 1u;
    __syncwarp();  // the previous token's readers are done with the lists
    if (staging_lane) {
      const int d = e / cfg.num_local;
      const int i = __popc(dest_mask & lanes_below);
      dest_rows[warp_in_block][i] = peer_ptr(cfg, d, staging_base + static_cast<long long>(slot) * cfg.disp_row_bytes);
      dest_flags[warp_in_block][i] = reinterpret_cast<unsigned int*>(peer_ptr(cfg, d, cfg.off_row_flags)) +
                                     static_cast<long long>(cfg.rank) * cfg.max_tokens + slot;
    }
    if (self_lane) self_rows[warp_in_block][__popc(self_mask & lanes_below)] = self_row;
    __syncwarp();
    char* const* rows = dest_rows[warp_in_block];
    const int* out_rows = self_rows[warp_in_block];

    const unsigned char* xrow = reinterpret_cast<const unsigned char*>(args.x) + static_cast<long long>(t) * hidden * 2;
    const int unit_stride = 32 * split;

    if (kFmt == kDispNvfp4) {
      const Nvfp4Outer outer = nvfp4_outer_scales(token_amax, 256.0f);
      // The next chunk's loads are issued before the current chunk's 4/6 arithmetic (their L2 latency hides
      // behind it instead of stalling the warp at the top of every iteration).
      Chunk32 next;
      if (part * 32 + lane < units) next.load(xrow + static_cast<long long>(part * 32 + lane) * 64);
#pragma unroll 1
      for (int c = part * 32 + lane; c < units; c += unit_stride) {
        const Chunk32 chunk = next;
        if (c + unit_stride < units) next.load(xrow + static_cast<long long>(c + unit_stride) * 64);
        unsigned int scales;
        const uint4 packed = quantize_nvfp4_chunk32(chunk, outer, token_amax, &scales);
        for (int i = 0; i < num_dest; ++i) {
          char* row = rows[i];
          st_v4(row + static_cast<long long>(c) * 16, packed);
          *reinterpret_cast<unsigned short*>(row + cfg.disp_scale_off + 2 * c) = static_cast<unsigned short>(scales);
        }
        // Direct self rows: the receive's copy, made here. Streaming stores (evict first): these ~4 rows per token
        // would otherwise push out of L2 the input rows the warps read twice (amax pass, then this loop); measured
        // 137.6-139.4 vs 139.7-147.9 us per 4096-token dispatch with plain stores (2xH200, 2026-11-30).
        for (int i = 0; i < num_self; ++i) {
          const long long r = out_rows[i];
          __stcs(reinterpret_cast<uint4*>(args.out_data + r * cfg.disp_data_bytes) + c, packed);
          __stcs(reinterpret_cast<unsigned short*>(args.out_scales + r * cfg.disp_scale_bytes) + c,
                 static_cast<unsigned short>(scales));
        }
      }
    } else if (kFmt == kDispMxfp8) {
      for (int base = part * 32; base < units; base += unit_stride) {
        const int h = base + lane;
        const bool active = h < units;
        uint8_t b;
        const uint4 packed = mxfp8_unit16<false>(xrow, h, active, b);
        if (active) {
          for (int i = 0; i < num_dest; ++i) {
            char* row = rows[i];
            st_v4(row + static_cast<long long>(h) * 16, packed);
            if ((h & 1) == 0) *reinterpret_cast<uint8_t*>(row + cfg.disp_scale_off + h / 2) = b;
          }
        }
      }
    } else {
      // BF16: plain copy, eight independent 16-byte loads in flight per lane before the stores.
      constexpr int U = 8;
      for (int c0 = part * 32 + lane; c0 < units; c0 += unit_stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + unit_stride * u;
          if (c < units) v[u] = ld_input_v4(xrow + static_cast<long long>(c) * 16);
        }
        for (int i = 0; i < num_dest; ++i) {
          char* row = rows[i];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int c = c0 + unit_stride * u;
            if (c < units) st_v4(row + static_cast<long long>(c) * 16, v[u]);
          }
        }
      }
    }

    // Direct self rows (part 0): what the receive records for a staging row of its own rank -- the handle entry of
    // staging index (my rank, my slot) and the rows' metadata.
    if (direct_self && part == 0 && num_self > 0) {
      record_own_row(cfg, args, t, lane, e, slot, self_here, self_row, w);
      if (self_lane) args.out_amax[self_row] = token_amax;
    }

    // Metadata of every staging row (part 0 only): amax, token, then per slot expert id, weight, position.
    if (part == 0) {
      for (int i = 0; i < num_dest; ++i) {
        char* meta = rows[i] + cfg.disp_meta_off;
        int* words = reinterpret_cast<int*>(meta);
        if (lane == 0) {
          words[0] = __float_as_int(token_amax);
          words[1] = t;
        }
        if (lane < topk) {
          words[2 + lane] = e;
          words[2 + topk + lane] = __float_as_int(w);
          words[2 + 2 * topk + lane] = pos;
        }
      }
    }

    // Wave index (NVFP4, part 0): for each of the token's slots, its staging slot at the slot's rank -- held by the
    // first lane of that rank -- at [my rank][local expert][position among my rows for that expert] of that rank's
    // index, so that a wave receive can find the rows of an expert without scanning every staging row. (A position
    // past T_max only comes from duplicate ids that went unchecked; it is not stored outside the list. Direct self
    // rows have no staging slot, and this rank's receive is not a wave receive: no entry for them.)
    if (kFmt == kDispNvfp4 && part == 0) {
      const int dest = e >= 0 ? e / cfg.num_local : -1 - lane;  // masked lanes and lanes >= K: keys of their own
      const unsigned int same_dest = __match_any_sync(0xFFFFFFFFu, dest);
      const unsigned int holder = same_dest & __ballot_sync(0xFFFFFFFFu, slot >= 0);
      const int dest_slot = __shfl_sync(0xFFFFFFFFu, slot, holder ? __ffs(holder) - 1 : lane);
      if (e >= 0 && !self_here && holder && pos < cfg.max_tokens) {
        int* index = reinterpret_cast<int*>(peer_ptr(cfg, dest, cfg.off_wave_index));
        const long long list = static_cast<long long>(cfg.rank) * cfg.num_local + (e - dest * cfg.num_local);
        index[list * cfg.max_tokens + pos] = dest_slot;
      }
    }

    // Row flags: the warp's stores of this token (payload, scales, metadata) are complete at each destination before
    // its flag, one release per destination after the warp barrier (cumulative over every lane's stores, as the
    // block-wide signals are after __syncthreads). Costs the warp one round trip per token, hidden by the other warps.
    if (row_flags) {
      __syncwarp();
      if (lane < num_dest) st_release_sys_u32(dest_flags[warp_in_block][lane], flag_epoch);
    }
  }

  block_signal_all_peers(cfg, cfg.off_disp_ready);
}

// ---------------------------------------------------------------------------------------------------
// Receive and expand.

// Copy `bytes` from the staging row to the same offset of every row in the warp's list (`rows`, n
// entries, shared memory), choosing the widest unit the destination row stride allows. The lane copies
// units first, first + stride, ... (stride = 32 * warps sharing the row); on the 16-byte path eight
// independent loads are in flight before the stores (a whole NVFP4 row of H = 7168 in one round).
// `compact` (DispatchArgs::compact_copy): when a lane has at most two units (a row split across many warps, i.e. a
// small call), loops that are not unrolled copy them instead (per unit: one load, then a store per row). Same bytes.
// A small call runs this code once per lane, so the unrolled form's length is what it pays for (probably instruction
// fetch; bench/RESULTS.md, thirty-fifth session: the NVFP4 dispatch 8-9% faster at 1 and 128 tokens, world 1). Not
// for more rounds: with seven per lane (BF16 at 512 tokens) the rolled loop made the dispatch 4% slower.
constexpr int kCopyUnroll = 8;

// First round of copy_section's 16-byte path, issued early (before the metadata work of the item) so the
// payload loads overlap the metadata loads.
__device__ __forceinline__ void prefetch_section(const char* src, long long bytes, int first, int stride,
                                                 uint4 (&v)[kCopyUnroll]) {
  const long long units = bytes / 16;
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const long long c = first + static_cast<long long>(stride) * u;
    if (c < units) v[u] = ld_coherent_v4(src + c * 16);
  }
}

__device__ __forceinline__ void copy_section(const char* src, unsigned char* dst_base, long long row_stride,
                                             long long bytes, const int* rows, int n, int first, int stride,
                                             bool compact, const uint4* pre = nullptr) {
  if (bytes % 16 == 0 && compact && bytes / 16 <= 2ll * stride) {
    const long long units = bytes / 16;
#pragma unroll 1
    for (long long c = first; c < units; c += stride) {
      // (Only pre[0]: a second prefetched unit is loaded again, from L2. Taking pre[1] as well pushed the MXFP8
      // receive into spills.)
      const uint4 v = pre != nullptr && c == first ? pre[0] : ld_coherent_v4(src + c * 16);
#pragma unroll 1
      for (int i = 0; i < n; ++i) st_v4(dst_base + static_cast<long long>(rows[i]) * row_stride + c * 16, v);
    }
  } else if (bytes % 16 == 0) {
    constexpr int U = kCopyUnroll;
    const long long units = bytes / 16;
    for (long long c0 = first; c0 < units; c0 += static_cast<long long>(stride) * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long c = c0 + static_cast<long long>(stride) * u;
        if (pre != nullptr && c0 == first) v[u] = pre[u];
        else if (c < units) v[u] = ld_coherent_v4(src + c * 16);
      }
      for (int i = 0; i < n; ++i) {
        unsigned char* dst = dst_base + static_cast<long long>(rows[i]) * row_stride;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long c = c0 + static_cast<long long>(stride) * u;
          if (c < units) st_v4(dst + c * 16, v[u]);
        }
      }
    }
  } else if (bytes % 4 == 0) {
    for (long long c = first; c < bytes / 4; c += stride) {
      const unsigned int v = ld_coherent_u32(src + c * 4);
      for (int i = 0; i < n; ++i) {
        const long long row = rows[i];
        *reinterpret_cast<unsigned int*>(dst_base + row * row_stride + c * 4) = v;
      }
    }
  } else if (bytes % 2 == 0) {
    for (long long c = first; c < bytes / 2; c += stride) {
      const unsigned short v = ld_coherent_u16(src + c * 2);
      for (int i = 0; i < n; ++i) {
        const long long row = rows[i];
        *reinterpret_cast<unsigned short*>(dst_base + row * row_stride + c * 2) = v;
      }
    }
  } else {  // MXFP8 scales with H/32 odd
    for (long long c = first; c < bytes; c += stride) {
      const unsigned char v = ld_coherent_u8(src + c);
      for (int i = 0; i < n; ++i) dst_base[static_cast<long long>(rows[i]) * row_stride + c] = v;
    }
  }
}

// Zero bytes [begin, end) of `base` with the whole block: byte stores up to 16-byte alignment, then uint4.
__device__ __forceinline__ void block_zero_bytes(unsigned char* base, long long begin, long long end) {
  if (begin >= end) return;
  unsigned char* p = base + begin;
  const long long len = end - begin;
  long long head = (16 - static_cast<long long>(reinterpret_cast<uintptr_t>(p) & 15)) & 15;
  if (head > len) head = len;
  const long long body = (len - head) / 16;
  for (long long i = threadIdx.x; i < head; i += blockDim.x) p[i] = 0;
  uint4* q = reinterpret_cast<uint4*>(p + head);
  for (long long i = threadIdx.x; i < body; i += blockDim.x) q[i] = make_uint4(0u, 0u, 0u, 0u);
  for (long long i = head + body * 16 + threadIdx.x; i < len; i += blockDim.x) p[i] = 0;
}

// Wave receive (NVFP4): every valid row of the expert-major layout in row order -- so that experts complete in
// order, and the GEMM behind this kernel can start on the first ones. A warp takes a chunk of kWaveChunkRows
// consecutive rows; the row's staging slot comes from the wave index the source wrote. The warp writes the NVFP4
// payload (the bytes the plain receive writes) and the GEMM's operand row (fp16 e2m1 * e4m3 block values, exact, as
// expand_nvfp4_rows writes them, and the outer factor amax / (6 * 256), the activations' E4M3 range), then counts
// the chunk's rows for their experts (one release fence per chunk, not per row).
// Each lane moves one 4-byte code word (8 values, half a block) per step, so that every load and store of the warp
// is contiguous (128 B of codes, 16 B of scales, 512 B of fp16 values per instruction; 16 code bytes per lane made
// the fp16 stores 64 B apart, 16 cache lines per instruction), and the loads of the next step are issued before the
// stores of the current one.
// seg_start [W][E_local] (first row of source s in expert j), offsets [E_local + 1], totals [E_local]: shared memory.
// kFp8 (DispatchArgs::wave_fp8): the operand rows of the GEMM's inexact FP8 mode instead (wave_fp8_half_block), as
// expand_nvfp4_rows(precision="fp8_inexact") writes them (256 B of E4M3 values per store instruction); its own
// instantiation, so the exact path's code is as before.
constexpr int kWaveChunkRows = 4;
constexpr int kWaveWordsPerLane = 14;  // words in flight per lane and step (H = 7168: 896 words, two steps a row)

struct WaveStep {
  unsigned int code_words[kWaveWordsPerLane];
  unsigned char scale_bytes[kWaveWordsPerLane];
};

// FP8 operand values of one half block (the lane's code word: 8 values), for the inexact FP8 mode: E4M3 (RNE,
// satfinite) of e2m1 * scale * 2^-3 (qm::fp8_operand_pairs8, which nvfp4.cu's FP8 forms also build on). Lanes 2i and 2i + 1 hold
// the low (columns 0..7) and high (8..15) half of one 16-column block (the caller's words are w0 + lane + 32 u with
// w0 even). The stored block is in FP8_COLUMN_ORDER: bytes 4q..4q+3 hold columns 2q, 2q+1, 2q+8, 2q+9; the low lane
// returns bytes 0..7 (columns 0..3 and 8..11) and the high lane bytes 8..15 (columns 4..7 and 12..15), so each sends
// its partner the two pairs it does not keep in one 32-bit shuffle, and stores 8 contiguous bytes at 8 * word.
// Every lane of the warp must call it (the shuffle), also lanes whose word is past the row.
__device__ __forceinline__ uint2 wave_fp8_half_block(unsigned int code_word, unsigned char scale_byte, int lane) {
  unsigned int pair[4];  // E4M3 of this half's columns 2k (low byte) and 2k + 1
  fp8_operand_pairs8(code_word, fp8_operand_scale(scale_byte), pair);
  const bool high = (lane & 1) != 0;
  const unsigned int sent = high ? pair[0] | (pair[1] << 16) : pair[2] | (pair[3] << 16);
  const unsigned int got = __shfl_xor_sync(0xFFFFFFFFu, sent, 1);
  // Low lane: columns 0,1 | 8,9 and 2,3 | 10,11 (got: the high half's first two pairs). High lane: 4,5 | 12,13 and
  // 6,7 | 14,15 (got: the low half's last two pairs).
  if (!high) return make_uint2(pair[0] | (got << 16), pair[1] | (got & 0xFFFF0000u));
  return make_uint2((got & 0xFFFFu) | (pair[2] << 16), (got >> 16) | (pair[3] << 16));
}

template <bool kFp8>
__device__ void wave_receive_rows(const NvlinkConfig& cfg, const DispatchArgs& args, const int* seg_start,
                                  const int* offsets, const int* totals, unsigned long long epoch) {
  constexpr int U = kWaveWordsPerLane;
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const long long num_warps = static_cast<long long>(gridDim.x) * warps_per_block;
  const int num_local = cfg.num_local;
  const int words = cfg.hidden / 8;  // 4-byte code words: 8 values, half of a 16-value block
  const int steps_per_row = (words + 32 * U - 1) / (32 * U);
  const int* index = reinterpret_cast<const int*>(cfg.local_base + cfg.off_wave_index);
  // fp32(1 / (6 * 256)): what ExpandedRows' row_factor multiplies amax by (formats.NVFP4_ACTIVATION_E4M3_MAX).
  const float factor_scale = static_cast<float>(1.0 / (6.0 * 256.0));
  const long long rows_in_use = offsets[num_local];
  const long long num_chunks = (rows_in_use + kWaveChunkRows - 1) / kWaveChunkRows;
  for (long long chunk = static_cast<long long>(blockIdx.x) * warps_per_block + threadIdx.x / 32; chunk < num_chunks;
       chunk += num_warps) {
    // Lane i < kWaveChunkRows locates row first + i: its expert j and staging row (nullptr: alignment padding,
    // zeroed by the plain receive's code, or past the rows in use).
    const long long first = chunk * kWaveChunkRows;
    int my_expert = -1;
    const char* my_row = nullptr;
    if (lane < kWaveChunkRows && first + lane < rows_in_use) {
      const long long r = first + lane;
      int lo = 0, hi = num_local - 1;  // the last j with offsets[j] <= r (an empty expert shares its offset with
      while (lo < hi) {                // the next one)
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
      }
      if (r - offsets[lo] < totals[lo]) {
        int s = cfg.world - 1;  // the source: the last s whose segment starts at or before r
        while (s > 0 && seg_start[s * num_local + lo] > r) --s;
        const long long pos = r - seg_start[s * num_local + lo];
        // A position past T_max only comes from duplicate ids that went unchecked (one source sent this expert more
        // than T_max rows): the sender stored no index entry for it, and the next list's entries lie there, so it is
        // recorded as a fault and the row skipped instead of read. (A slot outside staging only when index and counts
        // belong to different calls: recorded, row skipped.)
        int slot = row_in_capacity(cfg, pos, cfg.max_tokens, s);
        if (slot >= 0) {
          slot = row_in_capacity(cfg, static_cast<int>(ld_coherent_u32(
              index + (static_cast<long long>(s) * num_local + lo) * cfg.max_tokens + pos)), cfg.max_tokens, s);
        }
        if (slot >= 0) {
          my_expert = lo;
          my_row = cfg.local_base + cfg.off_staging +
                   (static_cast<long long>(s) * cfg.max_tokens + slot) * cfg.disp_row_bytes;
        }
      }
    }
    const int num_steps = kWaveChunkRows * steps_per_row;
    auto row_of_step = [&](int step) {
      return reinterpret_cast<const char*>(
          __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(my_row), step / steps_per_row));
    };
    auto load_step = [&](int step, WaveStep& data) {
      const char* row = row_of_step(step);
      if (row == nullptr) return;
      const int w0 = (step % steps_per_row) * 32 * U + lane;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int w = w0 + 32 * u;
        if (w < words) {
          data.code_words[u] = ld_coherent_u32(row + 4ll * w);
          data.scale_bytes[u] = ld_coherent_u8(row + cfg.disp_scale_off + w / 2);
        }
      }
    };
    WaveStep current, next;
    load_step(0, next);
    for (int step = 0; step < num_steps; ++step) {
      current = next;
      if (step + 1 < num_steps) load_step(step + 1, next);  // in flight while this step is stored
      const char* row = row_of_step(step);
      if (row == nullptr) continue;
      const long long r = first + step / steps_per_row;
      unsigned char* out_codes = args.out_data + r * cfg.disp_data_bytes;
      unsigned char* out_scales = args.out_scales + r * cfg.disp_scale_bytes;
      __half* out_values = reinterpret_cast<__half*>(args.wave_values) + r * cfg.hidden;
      const int w0 = (step % steps_per_row) * 32 * U + lane;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int w = w0 + 32 * u;
        if constexpr (kFp8) {
          if (w - lane >= words) continue;  // the whole warp past the row (uniform: small H)
          // Before the range check: the shuffle runs in every lane. Both lanes of a block are in range or neither
          // (words is even); past the row, the word is garbage and only goes to a lane that stores nothing.
          const uint2 half_block = wave_fp8_half_block(current.code_words[u], current.scale_bytes[u], lane);
          unsigned char* out_fp8 = static_cast<unsigned char*>(args.wave_values) + r * cfg.hidden;  // 1 byte a value
          if (w < words) *reinterpret_cast<uint2*>(out_fp8 + 8ll * w) = half_block;
        }
        if (w >= words) continue;
        *reinterpret_cast<unsigned int*>(out_codes + 4ll * w) = current.code_words[u];
        if ((w & 1) == 0) out_scales[w / 2] = current.scale_bytes[u];
        if constexpr (!kFp8) {
          float y[8];
          e2m1x8_decode_scaled(current.code_words[u], e4m3_decode(current.scale_bytes[u]), y);
          vec::store_row_segment<__half, 8>(out_values + 8ll * w, y);
        }
      }
    }
    if (my_row != nullptr) {
      const long long r = first + lane;
      const float amax = __uint_as_float(ld_coherent_u32(my_row + cfg.disp_meta_off));
      args.out_amax[r] = amax;
      const float row_factor = qm_mul(amax, factor_scale);
      // FP8: times 8, the 2^-3 taken out of the values (exact), as expand_nvfp4_rows(precision="fp8_inexact").
      args.wave_row_factor[r] = kFp8 ? qm_mul(row_factor, 8.0f) : row_factor;
    }
    int chunk_experts[kWaveChunkRows];
#pragma unroll
    for (int i = 0; i < kWaveChunkRows; ++i) chunk_experts[i] = __shfl_sync(0xFFFFFFFFu, my_expert, i);
    __syncwarp();  // the warp's stores of the chunk, then one release and the counts for all of them
    if (lane == 0) {
      int run_expert = -1, run_rows = 0;  // runs of one expert (padding rows, -1, end a run)
#pragma unroll
      for (int i = 0; i < kWaveChunkRows; ++i) {
        const int j = chunk_experts[i];
        if (j != run_expert && run_rows > 0) {
          wave::count_rows(args.wave.area, run_expert, run_rows, epoch);
          run_rows = 0;
        }
        if (j >= 0) {
          run_expert = j;
          ++run_rows;
        }
      }
      if (run_rows > 0) wave::count_rows(args.wave.area, run_expert, run_rows, epoch);
    }
  }
}

// Streaming receive: wait until staging row j of source s is complete -- its row flag (release by the sending warp),
// or, for a source that wrote no row flags in this call (its send split rows across warps, or it does not stream),
// that source's whole send. Lane 0 polls with relaxed loads (an acquire per poll would invalidate the SM's L1 under
// every other warp's feet), then acquires once; the warp barrier orders the other lanes' loads of the row after that
// acquire.
__device__ __forceinline__ void wait_staging_row(const NvlinkConfig& cfg, int has_row_flags, int s, int j,
                                                 unsigned long long epoch, int lane) {
  if (lane == 0) {
    if (has_row_flags) {
      const unsigned int* flag =
          reinterpret_cast<const unsigned int*>(cfg.local_base + cfg.off_row_flags) + static_cast<long long>(s) *
          cfg.max_tokens + j;
      const unsigned int want = static_cast<unsigned int>(epoch);
      spin_until([flag] { return ld_relaxed_sys_u32(flag); }, [want](unsigned int v) { return v == want; },
                 cfg.abort, cfg.error_word, cfg.timeout_ns,
                 [s, epoch] { return timeout_error_word(kStageDispatchWaitReady, s, epoch); });
      (void)ld_acquire_sys_u32(flag);  // the flag stays at this epoch until this rank signals disp_consumed
    } else {
      const unsigned long long* ready = reinterpret_cast<const unsigned long long*>(cfg.local_base + cfg.off_disp_ready);
      wait_counter(cfg, ready + s, epoch * cfg.disp_send_blocks, kStageDispatchWaitReady, s, epoch);
    }
  }
  __syncwarp();
}

// Self rows from x (DispatchArgs::self_from_x, BF16 and MXFP8): this rank's token t, read from the input instead of a
// staging row its own send would have written -- the same bytes (BF16 copied, MXFP8 quantized here as the send does),
// handle entry and metadata as the staging path (record_own_row). Whole warp; `part` of `split` as for a staging row;
// `rows` is the warp's shared-memory list. kMxfp8: the MXFP8 form (its own receive kernel instantiation, so that its
// quantization registers leave the other formats' receive alone: inlined into the common kernel it pushed the main
// loop into 140 bytes of spills).
template <bool kMxfp8>
__device__ __forceinline__ void receive_own_token(const NvlinkConfig& cfg, const DispatchArgs& args, int t, int part,
                                                  int split, const int* seg_start, int* rows) {
  const int lane = threadIdx.x % 32;
  int e, slot, pos;
  float w;
  token_routing(cfg, args, t, lane, e, slot, pos, w);
  const int first_expert = cfg.rank * cfg.num_local;
  const bool here = e >= first_expert && e < first_expert + cfg.num_local;
  if (__ballot_sync(0xFFFFFFFFu, here) == 0u) return;  // no expert of this rank: no row here
  const int out_row = here ? row_in_capacity(cfg, static_cast<long long>(seg_start[cfg.rank * cfg.num_local +
                                                                            (e - first_expert)]) + pos,
                                             args.num_rows, cfg.rank) : -1;
  if (part == 0) record_own_row(cfg, args, t, lane, e, slot, here, out_row, w);
  const bool local = out_row >= 0;  // (false for a row outside the result: recorded, not written)
  const unsigned int local_mask = __ballot_sync(0xFFFFFFFFu, local);
  const int n = __popc(local_mask);
  __syncwarp();  // the previous item's readers are done with the list
  if (local) rows[__popc(local_mask & ((1u << lane) - 1u))] = out_row;
  __syncwarp();
  if constexpr (kMxfp8) {
    const unsigned char* x_row = reinterpret_cast<const unsigned char*>(args.x) + static_cast<long long>(t) * cfg.hidden * 2;
    const int units = cfg.hidden / 16;  // 16 elements (16 output bytes) each; lane pairs share a 32-element block
    for (int base = part * 32; base < units; base += 32 * split) {
      const int h = base + lane;
      const bool active = h < units;
      uint8_t b;
      const uint4 packed = mxfp8_unit16<true>(x_row, h, active, b);
      if (!active) continue;
      for (int i = 0; i < n; ++i) {
        const long long r = rows[i];
        st_v4(args.out_data + r * cfg.disp_data_bytes + static_cast<long long>(h) * 16, packed);
        if ((h & 1) == 0) args.out_scales[r * cfg.disp_scale_bytes + h / 2] = b;
      }
    }
  } else {  // BF16: the row's bytes as they are
    const char* x_row = reinterpret_cast<const char*>(args.x) + static_cast<long long>(t) * cfg.disp_data_bytes;
    copy_section(x_row, args.out_data, cfg.disp_data_bytes, cfg.disp_data_bytes, rows, n, part * 32 + lane, 32 * split,
                 args.compact_copy != 0);
  }
}

// kWaves: the wave receive (args.wave_values set; its own instantiation, so that neither path sets the other's
// register budget); kWaveFp8 with it: the FP8 operand rows (args.wave_fp8). kOwnMxfp8: MXFP8 with self rows from x
// (receive_own_token quantizes). kRowsOnly: no expansion (args.row_index set).
template <bool kWaves, bool kOwnMxfp8 = false, bool kRowsOnly = false, bool kWaveFp8 = false>
__global__ void __launch_bounds__(kCommThreads) dispatch_recv_kernel(NvlinkConfig cfg, DispatchArgs args) {
  extern __shared__ int smem[];
  const int world = cfg.world;
  const int num_local = cfg.num_local;
  const int topk = cfg.topk;
  const ReceiveLayout layout(smem, world, num_local);
  const int* seg_start = layout.seg_start;
  const int* offsets = layout.offsets;
  const int* totals = layout.totals;
  const int* ntok = layout.ntok;
  const int* item_start = layout.item_start;
  constexpr bool waves = kWaves;
  const bool streaming = !waves && args.stream_recv != 0;
  // No expansion (args.row_index set; its own instantiation, so that the expanding kernels compile as before): the
  // result is the staging rows plus, per expert-major row, the index of its staging row.
  constexpr bool rows_only = kRowsOnly;
  // This call's epoch from a start ticket (NvlinkState::disp_recv_tickets), taken before the block lets any dependent
  // launch, so that the next dispatch's receive always draws after every block of this one. A wave receive's blocks
  // share out disp_recv_blocks tickets (its grid is smaller).
  const unsigned long long share =
      waves ? cfg.disp_recv_blocks / gridDim.x + (blockIdx.x < cfg.disp_recv_blocks % gridDim.x) : 1ull;
  unsigned long long ticket = 0ull;
  if (threadIdx.x == 0) ticket = atomicAdd(&cfg.state->disp_recv_tickets, share);
  const unsigned long long epoch = block_epoch_from_ticket(ticket, cfg.disp_recv_blocks);
  if (waves) {
    // The GEMM launched behind this kernel (PDL) must not start before this kernel's own predecessors are complete
    // (it writes memory the stream may have used before): wait first, then release it.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else if (streaming) {
    // No griddepcontrol.wait: this kernel runs while the send still sends (protocol, nvlink.h). Every source's counts
    // are in only once this rank's own send has passed its griddepcontrol.wait, so no earlier kernel of the stream is
    // still running when the first output store below happens.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else {
    pdl_prologue();
  }

  if (streaming) {
    // This rank's own counts first, without a deadline (the abort flag still ends it): this kernel may have started
    // long before its own send got past the kernels ahead of it on the stream, and that time is not the peers'. The
    // deadline starts once they are in.
    const unsigned long long* counts_in = reinterpret_cast<const unsigned long long*>(cfg.local_base + cfg.off_disp_counts);
    __shared__ bool own_counts_in;
    if (threadIdx.x == 0) {
      const unsigned long long* own = counts_in + cfg.rank;
      own_counts_in = spin_until([own] { return ld_acquire_sys(own); }, [epoch](unsigned long long v) { return v >= epoch; },
                                 cfg.abort, cfg.error_word, ~0ull,
                                 [epoch] { return timeout_error_word(kStageDispatchWaitReady, 0, epoch); });
    }
    __syncthreads();
    block_wait_all_peers(cfg, cfg.off_disp_counts, epoch, kStageDispatchWaitReady, epoch);
    // Given up (the abort flag) before this rank's own counts came: then nothing says the kernels ahead of the send on
    // the stream are done, and the stores below could race with them (e.g. a combine receive still reading memory that
    // a dropped result gave back to the allocator, now this call's arena). Wait for the send grid, and so for
    // everything before it, first. The send's own waits end at once on the abort flag, so this cannot block for long;
    // on the normal path it costs nothing.
    if (!own_counts_in) asm volatile("griddepcontrol.wait;" ::: "memory");
  } else {
    block_wait_all_peers(cfg, cfg.off_disp_ready, epoch * cfg.disp_send_blocks, kStageDispatchWaitReady, epoch);
  }

  compute_receive_layout(cfg, layout, args.num_rows);

  if (blockIdx.x == 0) {
    for (int j = threadIdx.x; j <= num_local; j += blockDim.x) {
      args.expert_offsets[j] = offsets[j];
      if (j < num_local) args.num_per_expert[j] = totals[j];
    }
    for (int s = threadIdx.x; s < world; s += blockDim.x) args.recv_count[s] = ntok[s];
    if (waves) {
      // The GEMM reads the offsets and counts, and takes work items from the counter, once this is published.
      if (threadIdx.x == 0) args.wave.area[kWaveWorkCounter] = 0ull;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        wave::st_release_gpu(args.wave.area + kWaveLayoutReady, epoch);
      }
    }
  }
  if (waves) wave_receive_rows<kWaveFp8>(cfg, args, seg_start, offsets, totals, epoch);

  __shared__ int out_rows[kCommThreads / 32][kMaxTopk];
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int warp_in_block = threadIdx.x / 32;
  const int global_warp = blockIdx.x * warps_per_block + warp_in_block;
  const int num_warps = gridDim.x * warps_per_block;
  // Direct self rows: this rank's own staging rows were never written (the send stored them expanded); the items
  // skip its range. Self rows from x (BF16, MXFP8): the same range is skipped and the first own_items items are this
  // rank's own tokens instead, read from x -- first, so that they fill the time before the peers' rows arrive.
  const int self_items = args.direct_self || args.self_from_x ? ntok[cfg.rank] : 0;
  const int own_items = args.self_from_x ? args.num_tokens : 0;
  const int self_begin = item_start[cfg.rank];
  const int num_items = own_items + item_start[world] - self_items;
  const int first_expert = cfg.rank * num_local;
  // Warps per staging row (> 1 only when there are fewer rows than warps).
  // (Wave receive: the payload is written above; this loop writes the metadata only, one warp per staging row.)
  const int split = waves || rows_only
                        ? 1 : split_factor(num_items, num_warps, static_cast<int>((cfg.disp_data_bytes / 16 + 31) / 32));
  const long long num_parts = static_cast<long long>(num_items) * split;

  for (long long flat = global_warp; flat < num_parts; flat += num_warps) {
    const int part = static_cast<int>(flat % split);
    int item = static_cast<int>(flat / split);
    if (item < own_items) {
      receive_own_token<kOwnMxfp8>(cfg, args, item, part, split, seg_start, out_rows[warp_in_block]);
      continue;
    }
    item -= own_items;
    if (item >= self_begin) item += self_items;
    int s = 0;
    while (item >= item_start[s + 1]) ++s;
    const int j = item - item_start[s];
    const char* row = cfg.local_base + cfg.off_staging +
                      (static_cast<long long>(s) * cfg.max_tokens + j) * cfg.disp_row_bytes;
    if (streaming) wait_staging_row(cfg, layout.has_row_flags[s], s, j, epoch, lane);
    const int first = part * 32 + lane, stride = 32 * split;
    // Round 0 of the payload and of the scales, and the row's amax, in flight while the metadata is read and
    // decoded: every load of the item is issued before the first store (one memory round trip per item instead
    // of one per section).
    uint4 pre[kCopyUnroll];
    if (!waves && !rows_only) prefetch_section(row, cfg.disp_data_bytes, first, stride, pre);
    const bool scales_prefetched = cfg.disp_scale_bytes > 0 && cfg.disp_scale_bytes % 16 == 0 &&
                                   cfg.disp_scale_bytes / 16 <= stride;  // one 16-byte unit per lane at most
    uint4 pre_scales = make_uint4(0u, 0u, 0u, 0u);
    if (!waves && !rows_only && scales_prefetched && first < cfg.disp_scale_bytes / 16) {
      pre_scales = ld_coherent_v4(row + cfg.disp_scale_off + static_cast<long long>(first) * 16);
    }
    const char* meta = row + cfg.disp_meta_off;
    const unsigned int amax_bits = (cfg.disp_fmt == kDispNvfp4 && part == 0) ? ld_coherent_u32(meta) : 0u;
    int e = -1, pos = 0;
    float w = 0.0f;
    if (lane < topk) {
      e = static_cast<int>(ld_coherent_u32(meta + 8 + 4 * lane));
      w = __uint_as_float(ld_coherent_u32(meta + 8 + 4 * (topk + lane)));
      pos = static_cast<int>(ld_coherent_u32(meta + 8 + 4 * (2 * topk + lane)));
    }
    const int t = static_cast<int>(ld_coherent_u32(meta + 4));
    const int out_row = e >= first_expert && e < first_expert + num_local
                            ? row_in_capacity(cfg, static_cast<long long>(seg_start[s * num_local + (e - first_expert)]) +
                                                   pos, args.num_rows, s)
                            : -1;
    const bool local = out_row >= 0;
    if (part == 0) record_staging_row(cfg, args, s, j, t, lane, lane < topk && e >= 0 ? e / num_local : -1, out_row, w);
    if (rows_only) {  // no copy: each of the token's rows here names its staging row
      if (local) args.row_index[out_row] = s * cfg.max_tokens + j;
      continue;
    }
    // Compact the local rows into this warp's shared-memory list.
    const unsigned int local_mask = __ballot_sync(0xFFFFFFFFu, local);
    const int n = __popc(local_mask);
    __syncwarp();  // the previous item's readers are done with the list
    if (local) out_rows[warp_in_block][__popc(local_mask & ((1u << lane) - 1u))] = out_row;
    __syncwarp();
    if (n == 0 || waves) continue;
    const int* rows = out_rows[warp_in_block];
    copy_section(row, args.out_data, cfg.disp_data_bytes, cfg.disp_data_bytes, rows, n, first, stride,
                 args.compact_copy != 0, pre);
    if (scales_prefetched) {
      if (first < cfg.disp_scale_bytes / 16) {
        for (int i = 0; i < n; ++i) {
          st_v4(args.out_scales + static_cast<long long>(rows[i]) * cfg.disp_scale_bytes + first * 16, pre_scales);
        }
      }
    } else if (cfg.disp_scale_bytes > 0) {
      copy_section(row + cfg.disp_scale_off, args.out_scales, cfg.disp_scale_bytes, cfg.disp_scale_bytes, rows, n,
                   first, stride, args.compact_copy != 0);
    }
    // Every lane holds the amax word (a warp-uniform address: one transaction).
    if (cfg.disp_fmt == kDispNvfp4 && part == 0 && lane < n) args.out_amax[rows[lane]] = __uint_as_float(amax_bits);
  }

  // Padding rows inside the valid prefix: zero payload, -1 metadata. One block per expert segment (no
  // padding at all when alignment == 1), payload zeroed with 16-byte stores.
  if (cfg.alignment > 1) {
    for (int jexp = blockIdx.x; jexp < num_local; jexp += gridDim.x) {
      const long long pad_begin = offsets[jexp] + totals[jexp];
      const long long pad_end = offsets[jexp + 1];
      if (pad_begin >= pad_end) continue;
      for (long long r = pad_begin + threadIdx.x; r < pad_end; r += blockDim.x) {
        args.src_rank[r] = -1;
        args.src_token[r] = -1;
        args.topk_slot[r] = -1;
        args.topk_weight[r] = 0.0f;
        if (cfg.disp_fmt == kDispNvfp4) args.out_amax[r] = 0.0f;
        if (rows_only) args.row_index[r] = -1;
      }
      if (rows_only) continue;  // no payload rows to zero
      // Payload bytes of the padding rows (data and scales are each contiguous over rows).
      block_zero_bytes(args.out_data, pad_begin * cfg.disp_data_bytes, pad_end * cfg.disp_data_bytes);
      if (cfg.disp_scale_bytes > 0) {
        block_zero_bytes(args.out_scales, pad_begin * cfg.disp_scale_bytes, pad_end * cfg.disp_scale_bytes);
      }
    }
  }
  const long long thread_id = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long num_threads = static_cast<long long>(gridDim.x) * blockDim.x;
  // Rows past the valid prefix: metadata only (their payload is unspecified).
  for (long long r = offsets[num_local] + thread_id; r < args.num_rows; r += num_threads) {
    args.src_rank[r] = -1;
    args.src_token[r] = -1;
    args.topk_slot[r] = -1;
    args.topk_weight[r] = 0.0f;
    if (rows_only) args.row_index[r] = -1;
  }

  // A streaming receive did not wait for its own send at the start: one block does now, before its last signal, so
  // that (a) the grid's completion implies the send's, which is what every later kernel on the stream relies on (a
  // programmatic successor waits only for this grid; the send may still be reading x and the layout scratch, or
  // storing direct self rows), and (b) no peer is told that the counts area may be overwritten while this rank's send
  // still reads it (direct self rows compute their offsets from it: the peers wait for all disp_recv_blocks signals,
  // this block's among them). One block, the last to start: when every block waited, the blocks that had finished
  // could not retire while a narrow send (BF16: 24 blocks) still ran, so the receive blocks without a free SM started
  // only after the send -- BF16 dispatch at 4096 tokens 249.6 -> 282.4 us on 2xH200 (fifteenth session). The last
  // block to start usually starts once send blocks retire, so its wait costs nothing.
  if (streaming && threadIdx.x == 0 && ticket % cfg.disp_recv_blocks == cfg.disp_recv_blocks - 1ull) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }

  // Done reading the staging rows and counts: the sources may overwrite them. The sources wait for
  // disp_recv_blocks signals per call; a wave receive runs on fewer blocks, which share them out. Without expansion
  // the rows are the result: the next dispatch's send signals for this one (NvlinkState::held_epoch).
  if (rows_only) {
    if (threadIdx.x == 0) cfg.state->held_epoch = epoch;  // every block stores the same value
  } else if (waves) {
    __syncthreads();  // (share: this block's part of disp_recv_blocks, as for its ticket)
    for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) signal_peer(cfg, cfg.off_disp_consumed, p, share);
  } else {
    block_signal_all_peers(cfg, cfg.off_disp_consumed);
  }
}

size_t recv_smem(const NvlinkConfig& cfg) { return receive_layout_smem(cfg.world, cfg.num_local); }

}  // namespace

size_t receive_layout_smem(int world, int num_local) { return ReceiveLayout::ints(world, num_local) * sizeof(int); }

void prepare_dispatch_kernels(const NvlinkConfig& cfg) {
  // Opted in where needed: the 48 KiB default bounds static + dynamic shared memory together, and these kernels have
  // a few KiB of static arrays, so a layout just under 48 KiB needs the opt-in (cudaFuncGetAttributes reports the
  // dynamic part left). Raised only: the limit is the kernel's in the process, shared by every Buffer
  // (raise_dynamic_smem_limit).
  const struct {
    const void* kernel;
    const char* what;
  } kernels[] = {
      {reinterpret_cast<const void*>(dispatch_send_kernel<kDispNvfp4>), "cudaFuncSetAttribute(dispatch_send)"},
      {reinterpret_cast<const void*>(dispatch_recv_kernel<false>), "cudaFuncSetAttribute(dispatch_recv)"},
      {reinterpret_cast<const void*>(dispatch_recv_kernel<true>), "cudaFuncSetAttribute(dispatch_recv, waves)"},
      {reinterpret_cast<const void*>(dispatch_recv_kernel<true, false, false, true>),
       "cudaFuncSetAttribute(dispatch_recv, FP8 waves)"},
      {reinterpret_cast<const void*>(dispatch_recv_kernel<false, true>),
       "cudaFuncSetAttribute(dispatch_recv, MXFP8 self rows from x)"},
      {reinterpret_cast<const void*>(dispatch_recv_kernel<false, false, true>),
       "cudaFuncSetAttribute(dispatch_recv, rows only)"},
  };
  for (const auto& k : kernels) raise_dynamic_smem_limit(k.kernel, recv_smem(cfg), k.what);
}

void launch_dispatch_send(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream) {
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const bool pdl = dispatch_pdl(args.num_tokens);
  cudaError_t err;
  if (cfg.disp_fmt == kDispNvfp4) {
    // Shared memory for the receive layout that direct self rows need.
    err = launch_kernel(dispatch_send_kernel<kDispNvfp4>, cfg.disp_send_blocks, kCommThreads,
                        args.direct_self ? recv_smem(cfg) : 0, st, pdl, cfg, args);
  } else if (cfg.disp_fmt == kDispMxfp8) {
    err = launch_kernel(dispatch_send_kernel<kDispMxfp8>, cfg.disp_send_blocks, kCommThreads, 0, st, pdl, cfg, args);
  } else {
    err = launch_kernel(dispatch_send_kernel<kDispBf16>, cfg.disp_send_blocks, kCommThreads, 0, st, pdl, cfg, args);
  }
  check_cuda(err, "dispatch send kernel launch");
}

void launch_dispatch_recv(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream) {
  const bool waves = args.wave_values != nullptr;
  // A streaming receive is launched as the send's programmatic dependent at every size (unless PDL is off), so that it
  // runs while the send sends: on the SMs the send leaves free, and on each SM a send block leaves.
  const bool pdl = args.stream_recv ? dispatch_pdl_allowed() : dispatch_pdl(args.num_tokens);
  const auto kernel = waves ? (args.wave_fp8 ? dispatch_recv_kernel<true, false, false, true>
                                             : dispatch_recv_kernel<true>)
                            : args.row_index != nullptr
                                  ? dispatch_recv_kernel<false, false, true>
                                  : (cfg.disp_fmt == kDispMxfp8 && args.self_from_x ? dispatch_recv_kernel<false, true>
                                                                                     : dispatch_recv_kernel<false>);
  check_cuda(launch_kernel(kernel,
                           waves ? args.wave_blocks : cfg.disp_recv_blocks, kCommThreads, recv_smem(cfg),
                           reinterpret_cast<cudaStream_t>(stream), pdl, cfg, args),
             "dispatch receive kernel launch");
}

}  // namespace nvlink
}  // namespace ep_comm
