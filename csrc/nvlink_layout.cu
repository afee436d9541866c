// Dispatch layout on the sending rank: where every (token, slot) goes, by prefix sums over this rank's
// own tokens (no atomics, so the placement is deterministic and canonical).
//
// For key (t, k) with expert e (flattened index q = t * K + k, i.e. canonical order "by token, then slot"):
//   pos[q]  = number of keys q' < q with the same expert          (row of (t, k) inside (this rank, e))
//   slot[q] = number of tokens t' < t that go to rank e / E_local  (staging slot at that rank), only for
//             the first slot of the token that targets that rank; -1 for the others and masked slots.
// plus per-expert row counts and per-rank token counts.
//
// Multi-block: block c owns the chunk of tokens [c * chunk_tokens, (c + 1) * chunk_tokens) (chunk_tokens
// from layout_chunk_tokens(T), so at most kLayoutMaxChunks blocks). Inside the block, warp w owns a
// contiguous range of the chunk's keys and ranks them in 32-key steps with __match_any_sync against a
// per-warp running histogram in shared memory; a scan over warps turns the per-warp histograms into each
// warp's base (added in a second pass) and the block's histogram, stored in layout_base[c]. The last block
// to finish (a done-counter; placement itself uses no atomics) turns layout_base into an exclusive scan over
// chunks and writes the totals (counts); a call of one chunk writes its counts directly. scratch_pos /
// scratch_slot are therefore relative to the chunk: the consumer (dispatch send) adds
// layout_base[t / chunk_tokens][key]. Keys of the "rank" kind live after
// the E experts in the same histogram.
#include <cuda_runtime.h>

#include <stdexcept>

#include "env_choice.h"
#include "nvlink.h"

namespace ep_comm {
namespace nvlink {
namespace {

constexpr int kLayoutMaxWarps = 16;

__device__ __forceinline__ int load_expert(const void* idx, int is64, long long q, int num_experts) {
  long long e = is64 ? __ldg(reinterpret_cast<const long long*>(idx) + q)
                     : static_cast<long long>(__ldg(reinterpret_cast<const int*>(idx) + q));
  return (e < 0 || e >= num_experts) ? -1 : static_cast<int>(e);  // out of range: the Buffer rejects it
}

// The call's total for key kind c (experts first, then destination ranks): the count the send publishes.
__device__ __forceinline__ void store_key_count(const NvlinkConfig& cfg, int c, int total) {
  if (c < cfg.num_experts) cfg.expert_count[c] = total;
  else cfg.rank_count[c - cfg.num_experts] = total;
}

// Last layout block: layout_base[chunk][key] becomes the exclusive scan over chunks, the totals the counts.
// Thread c owns column c; all of its kN chunk values are in flight at once (one L2 round trip), then the
// scan runs in registers (same integer sums, same order). kN >= num_chunks.
template <int kN>
__device__ __forceinline__ void scan_chunk_columns(const NvlinkConfig& cfg, int num_chunks, int num_keys_kinds) {
  for (int c = threadIdx.x; c < num_keys_kinds; c += blockDim.x) {
    int* col = cfg.layout_base + c;
    int v[kN];
#pragma unroll
    for (int ch = 0; ch < kN; ++ch) {
      v[ch] = ch < num_chunks ? __ldcg(col + static_cast<long long>(ch) * num_keys_kinds) : 0;
    }
    int run = 0;
#pragma unroll
    for (int ch = 0; ch < kN; ++ch) {
      if (ch < num_chunks) col[static_cast<long long>(ch) * num_keys_kinds] = run;
      run += v[ch];
    }
    store_key_count(cfg, c, run);
  }
}

__global__ void __launch_bounds__(kLayoutMaxWarps * 32) layout_kernel(NvlinkConfig cfg, DispatchArgs args) {
  extern __shared__ int hist[];  // [num_warps][E + W]
  __shared__ bool last_block;
  pdl_prologue();
  const int num_warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_keys_kinds = cfg.num_experts + cfg.world;
  const int topk = cfg.topk;
  const int chunk = blockIdx.x;
  const long long t_begin = static_cast<long long>(chunk) * args.chunk_tokens;
  const long long t_end = min(t_begin + args.chunk_tokens, static_cast<long long>(args.num_tokens));
  const long long key_begin = t_begin * topk;
  const long long num_keys = t_end > t_begin ? (t_end - t_begin) * topk : 0;

  if (chunk == 0 && threadIdx.x == 0) {
    const unsigned long long epoch = cfg.state->disp_epoch + 1ull;  // this dispatch's epoch
    cfg.state->disp_epoch = epoch;
    // The handle's copy, with this Buffer's tag: a combine on it tells the peers which dispatch its rows follow.
    *args.dispatch_epoch = dispatch_word(epoch, cfg.buffer_tag);
  }
  for (int i = threadIdx.x; i < num_warps * num_keys_kinds; i += blockDim.x) hist[i] = 0;
  __syncthreads();

  long long per_warp = (num_keys + num_warps - 1) / num_warps;
  per_warp = (per_warp + 31) / 32 * 32;
  const long long begin = key_begin + min(per_warp * warp, num_keys);
  const long long end = key_begin + min(per_warp * (warp + 1), num_keys);
  int* my_hist = hist + warp * num_keys_kinds;
  const unsigned int lanes_below = (1u << lane) - 1u;

  // Pass 1: rank each key inside this warp's range.
  for (long long base = begin; base < end; base += 32) {
    const long long q = base + lane;
    const bool valid = q < end;
    const int e = valid ? load_expert(args.topk_idx, args.idx_is_int64, q, cfg.num_experts) : -1;
    const long long t = valid ? q / topk : 0;
    const int k = valid ? static_cast<int>(q - t * topk) : 0;
    const int d = e >= 0 ? e / cfg.num_local : -1;
    // An earlier slot on the same rank d holds an expert in [d * E_local, (d + 1) * E_local): two compares per slot
    // instead of an integer division (masked slots load as -1, below every rank's range; when d is -1, first is
    // already false). The divisions were ~0.8 us of a one-token dispatch (world 1, bench/RESULTS.md, thirty-sixth
    // session); taking the earlier slots from other lanes by shuffles instead of these L1 reloads gained nothing.
    const int rank_lo = d * cfg.num_local;
    const int rank_hi = rank_lo + cfg.num_local;
    bool first = d >= 0;
    for (int kk = 0; kk < k; ++kk) {
      const int other = load_expert(args.topk_idx, args.idx_is_int64, t * topk + kk, cfg.num_experts);
      if (other >= rank_lo && other < rank_hi) first = false;
    }
    // Expert keys.
    const unsigned int peers_e = __match_any_sync(0xFFFFFFFFu, e);
    const int count_e = e >= 0 ? my_hist[e] : 0;
    const int pos_local = count_e + __popc(peers_e & lanes_below);
    // Rank keys (first slot per destination rank only).
    const int rank_key = first ? cfg.num_experts + d : -1;
    const unsigned int peers_r = __match_any_sync(0xFFFFFFFFu, rank_key);
    const int count_r = rank_key >= 0 ? my_hist[rank_key] : 0;
    const int slot_local = count_r + __popc(peers_r & lanes_below);
    __syncwarp();
    // The highest lane of each group publishes the group's new running count.
    if (e >= 0 && lane == 31 - __clz(peers_e)) my_hist[e] = count_e + __popc(peers_e);
    if (rank_key >= 0 && lane == 31 - __clz(peers_r)) my_hist[rank_key] = count_r + __popc(peers_r);
    __syncwarp();
    if (valid) {
      args.send_idx[q] = e;
      args.send_w[q] = __ldg(args.topk_weights + q);
      cfg.scratch_pos[q] = e >= 0 ? pos_local : -1;
      cfg.scratch_slot[q] = first ? slot_local : -1;
    }
  }
  __syncthreads();

  // Exclusive scan over warps, per key kind; the block's totals are this chunk's histogram. One block (one chunk, calls
  // of up to kLayoutMinChunkTokens tokens): its totals are the counts and its base over earlier chunks is 0, written
  // here, and it skips the done-counter, fences and read-back below (world 1, one token: NVFP4 dispatch 18.4 -> 16.4
  // us, bench/RESULTS.md, thirty-fifth session). Larger calls keep their chunks: one block for 128 tokens, with this
  // path, made the dispatch 24-33% slower than 8 blocks.
  const bool single_chunk = gridDim.x == 1;
  int* chunk_hist = cfg.layout_base + static_cast<long long>(chunk) * num_keys_kinds;
  for (int c = threadIdx.x; c < num_keys_kinds; c += blockDim.x) {
    int run = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int v = hist[w * num_keys_kinds + c];
      hist[w * num_keys_kinds + c] = run;
      run += v;
    }
    if (single_chunk) {
      chunk_hist[c] = 0;
      store_key_count(cfg, c, run);
    } else {
      chunk_hist[c] = run;
    }
  }
  __syncthreads();

  // Pass 2: add the warp's base (same thread, same keys as pass 1: its own writes are visible).
  // The three loads are independent (one round trip instead of two dependent ones).
  for (long long base = begin; base < end; base += 32) {
    const long long q = base + lane;
    if (q >= end) continue;
    const int e = args.send_idx[q];
    const int pos = cfg.scratch_pos[q];
    const int slot = cfg.scratch_slot[q];
    if (e < 0) continue;
    cfg.scratch_pos[q] = pos + my_hist[e];
    if (slot >= 0) cfg.scratch_slot[q] = slot + my_hist[cfg.num_experts + e / cfg.num_local];
  }

  if (single_chunk) return;  // the counts are written above; the consumers wait for this grid's completion

  // Last block: exclusive scan of the chunk histograms over chunks; totals are the counts.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int done = atomicAdd(&cfg.state->layout_done_blocks, 1u);
    last_block = done == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  // Width of the unrolled scan: the smallest power of two >= the chunk count. A fixed width of
  // kLayoutMaxChunks issues every predicated load/store (~1200 instructions per column, ~3 us on the
  // critical path at 8 chunks, i.e. 128 tokens); the sums and their order are the same for every width.
  const int num_chunks = gridDim.x;  // <= kLayoutMaxChunks
  if (num_chunks <= 4) scan_chunk_columns<4>(cfg, num_chunks, num_keys_kinds);
  else if (num_chunks <= 8) scan_chunk_columns<8>(cfg, num_chunks, num_keys_kinds);
  else if (num_chunks <= 16) scan_chunk_columns<16>(cfg, num_chunks, num_keys_kinds);
  else if (num_chunks <= 32) scan_chunk_columns<32>(cfg, num_chunks, num_keys_kinds);
  else scan_chunk_columns<kLayoutMaxChunks>(cfg, num_chunks, num_keys_kinds);
  if (threadIdx.x == 0) cfg.state->layout_done_blocks = 0u;  // next call (stream-ordered) starts from 0
}

size_t layout_smem(const NvlinkConfig& cfg, int warps) {
  return static_cast<size_t>(warps) * layout_warp_smem(cfg.num_experts, cfg.world);
}

}  // namespace

// Programmatic dependent launch per operation. Measured on 2xH200 (graph us per call, bench/RESULTS.md, twelfth
// session; the first measurement, 2026-11-29, found only the 4096-token dispatch slower, 197 vs 181 us):
//   combine:  1 token 12.2-12.8 vs 14.0-16.9, 128 tokens 17.7-18.2 vs 19.6-24.2, 4096 tokens 243.7-246.6 vs 242.7-243.7
//   dispatch: 1 token 22.2-23.7 vs 22.8-26.1, 128 tokens 28.4 vs 28.3-33.7, 4096 tokens 155.9-156.7 vs 136.3-139.3
// so the combine always takes it and the dispatch up to kDispatchPdlMaxTokens tokens per rank.
// EP_COMM_NVLINK_PDL=1 / 0 forces it on / off everywhere, auto (or unset) is this choice (read once).
constexpr int kDispatchPdlMaxTokens = 512;

namespace {
int pdl_override() {  // -1: the measured choice, 0 / 1: forced
  static const int mode = env_choice("EP_COMM_NVLINK_PDL", {"auto", "0", "1"}) - 1;
  return mode;
}
}  // namespace

bool dispatch_pdl(int num_tokens) {
  const int mode = pdl_override();
  return mode >= 0 ? mode == 1 : num_tokens <= kDispatchPdlMaxTokens;
}

bool combine_pdl() {
  const int mode = pdl_override();
  return mode >= 0 ? mode == 1 : true;
}

bool dispatch_pdl_allowed() { return pdl_override() != 0; }

bool dispatch_compact_copy() {
  static const bool on = env_choice("EP_COMM_NVLINK_COMPACT_COPY", {"1", "0"}) == 0;
  return on;
}

bool dispatch_stream_recv() {
  static const bool on = env_choice("EP_COMM_NVLINK_STREAM_RECV", {"1", "0"}) == 0;
  return on;
}

size_t layout_warp_smem(int num_experts, int world) {
  return (static_cast<size_t>(num_experts) + static_cast<size_t>(world)) * sizeof(int);
}

// Warps of a layout block: at least 8, and one thread per key kind (E + W) where that fits, so that the last block's
// scan over chunks takes every column in one round (256 experts + 2 ranks on 256 threads took two).
int layout_warps(const NvlinkConfig& cfg) {
  const int num_keys_kinds = cfg.num_experts + cfg.world;
  const size_t per_warp = layout_warp_smem(cfg.num_experts, cfg.world);
  int warps = (num_keys_kinds + 31) / 32;
  if (warps < 8) warps = 8;
  if (warps > kLayoutMaxWarps) warps = kLayoutMaxWarps;
  const int smem_warps = static_cast<int>(kMaxDynamicSmem / per_warp);
  if (warps > smem_warps) warps = smem_warps;
  if (warps < 1) throw std::runtime_error("ep_comm nvlink: too many experts for the layout kernel's shared memory");
  return warps;
}

void prepare_layout_kernel(const NvlinkConfig& cfg) {
  const int warps = layout_warps(cfg);
  raise_dynamic_smem_limit(reinterpret_cast<const void*>(layout_kernel), layout_smem(cfg, warps),
                           "cudaFuncSetAttribute(layout)");
}

void launch_layout(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream) {
  const int warps = layout_warps(cfg);
  if (args.chunk_tokens < 1) throw std::runtime_error("ep_comm nvlink: layout chunk_tokens unset");
  int chunks = (args.num_tokens + args.chunk_tokens - 1) / args.chunk_tokens;
  if (chunks < 1) chunks = 1;  // T = 0: one block still bumps the epoch and writes zero counts
  if (chunks > kLayoutMaxChunks) throw std::runtime_error("ep_comm nvlink: too many layout chunks");
  check_cuda(launch_kernel(layout_kernel, chunks, warps * 32, layout_smem(cfg, warps), reinterpret_cast<cudaStream_t>(stream),
                           dispatch_pdl(args.num_tokens), cfg, args),
        "layout kernel launch");
}

}  // namespace nvlink
}  // namespace ep_comm
