// Combine over NVLink: weighted local reduction + RHT-32 + S2F6 on the expert rank, stored straight into
// the source rank's combine area; dequantize-accumulate + inverse RHT on the source rank. The MXFP8 and BF16 formats
// take the same path without the rotation (MXFP8: a UE8M0 scale per 32 in the S2F6 row layout).
//
// Send (expert rank): one warp per received token (s, j) (from the dispatch handle). Each lane owns 16
// consecutive elements, lanes 2i and 2i+1 one RHT/S2F6 chunk of 32: FWHT stages h = 1..8 run in the
// lane's registers and h = 16 pairs the two lanes (shfl_xor 1) — the pairing and add order of NUMERICS.md.
//   local_reduce: acc = 0; for the token's local slots in ascending order acc = f(acc + f(w * x_row)),
//     one row per (token, this rank) into the source's area at (t, ordinal of this rank among t's ranks).
//   otherwise: each local slot's row is quantized on its own (no weight) into (t, k).
// Receive (source rank): one warp per token; acc = 0; rows in ascending rank order (local_reduce) or
// ascending slot order with acc = f(acc + f(w_k * deq)) (otherwise); inverse RHT once; bf16.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "nvlink.h"
#include "quant_math.cuh"
#include "mxfp8_lane.cuh"
#include "s2f6_lane.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace nvlink {
namespace {

using namespace ep_comm::qm;
using namespace ep_comm::s2f6_lane;

// 16 bf16 (two 16-byte vectors) to fp32, exact.
__device__ __forceinline__ void bf16x16_to_float(const uint4& a, const uint4& b, float* out) {
  vec::Elem<__nv_bfloat16>::unpack(a, out);
  vec::Elem<__nv_bfloat16>::unpack(b, out + 8);
}


// comb_desc (nvlink.h): block 0 of a combine's send tells every source what its rows belong to, after the wait for the
// sources to have read the previous combine (so a slow source still reading that one finds its descriptor unchanged)
// and before the block's ready signal (whose release covers these stores); thread p for source p.
// Both this and the receive's check run at the end of their kernels, after the rows: with the check placed between
// the receive's wait and its token loop, the S2F6 receive of 4096 tokens took 115.8 instead of 91.1 us at world 1
// (same register count, no spills: the loop was scheduled differently). At the end they cost ~0.3 us per combine at
// 128 tokens and 0.6-1.5 us at 1 token, and nothing measurable at 4096 (bench/RESULTS.md, twenty-ninth session; loading
// the handle's epoch into shared memory at the start instead measured no faster).
__device__ __forceinline__ void store_combine_descriptors(const NvlinkConfig& cfg, const CombineArgs& args) {
  if (blockIdx.x != 0) return;
  const unsigned long long descriptor = combine_descriptor(*args.dispatch_epoch, args.local_reduce);
  for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) {
    reinterpret_cast<unsigned long long*>(peer_ptr(cfg, p, cfg.off_comb_desc))[cfg.rank] = descriptor;
  }
}

// The receive's side: once every expert rank's rows are in (thread p acquired counter p), block 0's thread p compares
// expert rank p's descriptor with this rank's own and records a fault naming p where they differ (the rows are then
// another dispatch's or in the other local_reduce layout: summed, they are wrong; reading them stays in bounds, since
// both layouts index [T_max][K] rows). Every rank does this, so both sides of a mismatch report it.
__device__ __forceinline__ void check_combine_descriptors(const NvlinkConfig& cfg, const CombineArgs& args,
                                                          unsigned long long epoch) {
  if (blockIdx.x != 0) return;
  const unsigned long long descriptor = combine_descriptor(*args.dispatch_epoch, args.local_reduce);
  const volatile unsigned long long* theirs =
      reinterpret_cast<const volatile unsigned long long*>(cfg.local_base + cfg.off_comb_desc);
  for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) {
    if (theirs[p] != descriptor) {
      record_fault(cfg.abort, cfg.error_word, timeout_error_word(kStageCombineMismatch, p, epoch));
    }
  }
}

// Encode the lane's 16 fp32 values (whole warp calls; `active` lanes store) into a combine row at
// element offset e0: S2F6 after the forward RHT (the s2f6_quantize kernel's code), MXFP8 (nearest, the mxfp8_quantize
// kernel's bits), or BF16. The two code formats share the row layout: 16 code bytes at e0, the block's scale byte at
// comb_scale_off + e0 / 32 (stored by the block's even lane).
template <int kFmt>
__device__ __forceinline__ void encode_store(const NvlinkConfig& cfg, const RhtSigns16& signs, float v[16],
                                             char* dst_row, int e0, bool active, int lane) {
  if constexpr (kFmt != kCombBf16) {
    uint8_t b;
    const uint4 codes = kFmt == kCombS2f6 ? quantize_lane16<true>(v, signs, lane, &b)
                                          : mxfp8_lane::quantize_lane16(v, &b);
    if (active) {
      st_v4(dst_row + e0, codes);
      if ((lane & 1) == 0) *reinterpret_cast<uint8_t*>(dst_row + cfg.comb_scale_off + e0 / 32) = b;
    }
  } else if (active) {
    // cvt.rn.bf16x2.f32: the reference backend rounds these sums with torch's .to(bfloat16) on the GPU (cvt.rn.bf16.f32;
    // both are F2FP.BF16.F32.PACK_AB in SASS): the rule's RNE for every non-NaN value, the GPU's NaN (0x7FFF) for NaN.
    st_v4(dst_row + 2 * e0, vec::Elem<__nv_bfloat16>::pack(v));
    st_v4(dst_row + 2 * e0 + 16, vec::Elem<__nv_bfloat16>::pack(v + 8));
  }
}

// The combine format as a template argument (kFmt: a CombineFormat): no format branch in the loops, and each form gets
// its own register allocation.
template <int kFmt>
__global__ void __launch_bounds__(kCommThreads) combine_send_kernel(NvlinkConfig cfg, CombineArgs args) {
  __shared__ const unsigned short* slot_src[kCommThreads / 32][kMaxTopk];  // the token's expert rows, ascending
  __shared__ float slot_weights[kCommThreads / 32][kMaxTopk];
  __shared__ int slot_ids[kCommThreads / 32][kMaxTopk];
  __shared__ int item_start[kMaxWorld];  // tokens received from each source
  // This combine's epoch from a start ticket (block_epoch_from_ticket): every combine launches this kernel once, on
  // comb_send_blocks blocks or (wait_only) on one block that takes the whole grid's share. Taken before the block lets
  // its dependents launch (pdl_prologue): a later combine's send may start while this grid still runs (programmatic
  // launches down the stream), and must draw its tickets after every block of this one. (An epoch bumped by the
  // receive's last block cost every receive block a fence and an atomic round trip at its end.)
  unsigned long long ticket = 0ull;
  if (threadIdx.x == 0) {
    ticket = atomicAdd(&cfg.state->comb_send_tickets,
                       args.wait_only ? static_cast<unsigned long long>(cfg.comb_send_blocks) : 1ull);
  }
  const unsigned long long epoch = block_epoch_from_ticket(ticket, cfg.comb_send_blocks);
  pdl_prologue();
  if (args.wait_only) {  // rows come from a later kernel (the GEMM's epilogue; local_reduce=False rows)
    if (block_wait_all_peers(cfg, cfg.off_comb_consumed, (epoch - 1ull) * cfg.comb_recv_blocks,
                             kStageCombineWaitConsumed, epoch)) {
      store_combine_descriptors(cfg, args);  // released by the receive kernel's publish (a fence, then release)
    }
    return;
  }
  const int lane = threadIdx.x % 32;
  const int topk = cfg.topk;
  const int hidden = cfg.hidden;
  const int world = cfg.world;
  const RhtSigns16 signs(cfg.sign_mask, lane);  // S2F6 only (unused registers otherwise)

  // Received tokens per source, and the largest count. Items are interleaved over sources (slot
  // f = j * W + rotated source) so that every phase of the kernel mixes rows bound for NVLink with rows
  // for the local combine area: the NVLink stores overlap the local HBM reads and the RHT/S2F6 math
  // instead of following them (source-major order ran the local half first, then the remote half).
  // recv_count is this rank's own dispatch handle: it is read before the wait below, by the highest
  // threads (the wait polls with the lowest ones), so the load overlaps the flag poll; the wait's closing
  // __syncthreads publishes item_start and max_count.
  __shared__ int max_count;
  if (threadIdx.x == 0) max_count = 0;
  __syncthreads();
  for (int s = static_cast<int>(blockDim.x - 1u - threadIdx.x); s < world; s += blockDim.x) {
    const int cnt = args.recv_count[s];
    item_start[s] = cnt;
    atomicMax(&max_count, cnt);
  }

  // The sources' combine areas hold the previous combine's rows until they have read them.
  if (!block_wait_all_peers(cfg, cfg.off_comb_consumed, (epoch - 1ull) * cfg.comb_recv_blocks,
                            kStageCombineWaitConsumed, epoch)) {
    return;  // gave up (aborted()): nothing more into the sources' combine areas
  }

  const int warps_per_block = blockDim.x / 32;
  const int warp_in_block = threadIdx.x / 32;
  const int global_warp = grid_warp_index();
  const int num_warps = gridDim.x * warps_per_block;

  // Items: received tokens, each split into `split` parts of its 512-element column groups when there are
  // fewer tokens than warps.
  const long long num_items = static_cast<long long>(max_count) * world;  // slots, some empty
  const int split = split_factor(num_items, num_warps, (hidden + 511) / 512);
  const long long num_parts = num_items * split;
  const int base_stride = 512 * split;
  constexpr int U = 4;  // expert_out rows loaded before accumulating (order of the sum unchanged)

  for (long long fp = global_warp; fp < num_parts; fp += num_warps) {
    const long long flat = fp / split;
    const int part = static_cast<int>(fp - flat * split);
    const int j = static_cast<int>(flat / world);
    int s = static_cast<int>(flat - static_cast<long long>(j) * world) + cfg.rank;
    if (s >= world) s -= world;
    if (j >= item_start[s]) continue;  // source s sent fewer tokens
    const long long item = static_cast<long long>(s) * cfg.max_tokens + j;
    const int row = lane < topk ? args.recv_rows[item * topk + lane] : -1;
    const unsigned int mask = __ballot_sync(0xFFFFFFFFu, row >= 0);
    const int n = __popc(mask);
    if (n == 0) continue;
    __syncwarp();
    if (row >= 0) {
      const int i = __popc(mask & ((1u << lane) - 1u));
      slot_src[warp_in_block][i] = args.expert_out + static_cast<long long>(row) * hidden;
      slot_weights[warp_in_block][i] = args.row_weight[row];
      slot_ids[warp_in_block][i] = lane;
    }
    __syncwarp();
    const int t = args.recv_tok[item];
    char* const area = peer_ptr(cfg, s, cfg.off_combine);
    // Row addresses computed once per token (one shared load per row and step instead of a 64-bit multiply).
    const unsigned short* const* src_rows = slot_src[warp_in_block];

    if (args.local_reduce) {
      char* dst = area + (static_cast<long long>(t) * topk + args.recv_ord[item]) * cfg.comb_row_bytes;
      // Software pipeline over (column group, batch of U rows) steps of the token: the next step's rows are loaded
      // before the current step is summed (and, at a group's last batch, encoded), so that HBM reads overlap the
      // RHT/S2F6 math also when the token has more than U rows here (a token has ~K/W of its K experts on each
      // rank; before, rows past the first U were loaded when their group was reached, a full memory latency per
      // group). The sum order (rows ascending) is unchanged.
      const int batches = (n + U - 1) / U;
      auto load_step = [&](int base, int batch, uint4* a, uint4* b) {
        const int e0 = base + lane * 16;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int r = batch * U + u;
          if (e0 < hidden && r < n) {
            const unsigned short* p = src_rows[r] + e0;
            a[u] = ld_input_v4(p);
            b[u] = ld_input_v4(p + 8);
          }
        }
      };
      uint4 pa[U], pb[U];
      int base = part * 512, batch = 0;
      load_step(base, 0, pa, pb);
      float acc[16];
      while (base < hidden) {
        const int e0 = base + lane * 16;
        const bool active = e0 < hidden;  // hidden % 32 == 0: both lanes of a chunk agree
        uint4 va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          va[u] = pa[u];
          vb[u] = pb[u];
        }
        int next_base = base, next_batch = batch + 1;
        if (next_batch == batches) {
          next_batch = 0;
          next_base += base_stride;
        }
        if (next_base < hidden) load_step(next_base, next_batch, pa, pb);
        if (batch == 0) {
#pragma unroll
          for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
        }
        if (active) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int r = batch * U + u;
            if (r < n) {
              const float w = slot_weights[warp_in_block][r];
              float xv[16];
              bf16x16_to_float(va[u], vb[u], xv);
#pragma unroll
              for (int i = 0; i < 16; ++i) acc[i] = qm_add(acc[i], qm_mul(w, xv[i]));
            }
          }
        }
        if (batch == batches - 1) encode_store<kFmt>(cfg, signs, acc, dst, e0, active, lane);
        base = next_base;
        batch = next_batch;
      }
    } else {
      for (int r = 0; r < n; ++r) {
        char* dst = area + (static_cast<long long>(t) * topk + slot_ids[warp_in_block][r]) * cfg.comb_row_bytes;
        const unsigned short* src = src_rows[r];
        for (int base = part * 512; base < hidden; base += base_stride) {
          const int e0 = base + lane * 16;
          const bool active = e0 < hidden;
          float xv[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) xv[i] = 0.0f;
          if (active) bf16x16_to_float(ld_input_v4(src + e0), ld_input_v4(src + e0 + 8), xv);
          encode_store<kFmt>(cfg, signs, xv, dst, e0, active, lane);
        }
      }
    }
  }

  store_combine_descriptors(cfg, args);  // after the rows: no register of the hot loop above is held for it
  block_signal_all_peers(cfg, cfg.off_comb_ready);
}

// What the receive sums per token; one kernel instantiation each, so that the hot loop has no format branches and
// each mode gets its own register allocation.
enum RecvMode : int {
  kRecvS2f6Ranks = 0,    // S2F6, local_reduce: one row per (token, rank), unit weights
  kRecvBf16 = 1,         // BF16: one row per (token, rank) (local_reduce, weights 1) or per (token, expert)
  kRecvS2f6Experts = 2,  // S2F6, local_reduce=False: one row per (token, expert), weighted
  kRecvMxfp8 = 3,        // MXFP8: as BF16 (weights 1 with local_reduce), decoded from codes and scales
};

// A lane's 16 elements of one combine row: S2F6 or MXFP8 codes + the block's scale byte (kCodes), or 16 bf16 values.
template <bool kCodes>
struct TermData;
template <>
struct TermData<true> {
  uint4 codes;
  unsigned int scale;
};
template <>
struct TermData<false> {
  uint4 lo, hi;
};

// Loads from a term's row (`row`: the row's first byte; `scales`: its scale bytes, row + comb_scale_off), both
// fixed per token, so the per-group address is one add.
template <bool kCodes>
__device__ __forceinline__ TermData<kCodes> load_term(const char* row, const char* scales, int e0) {
  TermData<kCodes> d;
  if constexpr (kCodes) {
    d.codes = ld_coherent_v4(row + e0);
    d.scale = ld_coherent_u8(scales + e0 / 32);
  } else {
    d.lo = ld_coherent_v4(row + 2 * e0);
    d.hi = ld_coherent_v4(row + 2 * e0 + 16);
  }
  return d;
}

// acc = f(acc + f(w * v)) over the term's 16 decoded values v, the reference's order and rounding.
// kUnit (w = 1): f(1 * v) = v for every non-NaN v, and a NaN term makes the sum NaN either way (the output packing
// does not look at NaN payloads), so the multiply is skipped. kFirst with kUnit and S2F6: acc starts at +0 and
// f(+0 + v) = v unless v = -0, which no S2F6 decode gives (code 0 decodes to +0 on both decode paths), so acc = v.
// (MXFP8 has a -0 code: its first term is added to +0.)
template <int kFmt, bool kUnit, bool kFirst>
__device__ __forceinline__ void add_term(float acc[16], const TermData<kFmt != kCombBf16>& d, float w) {
  float v[16];
  if constexpr (kFmt == kCombS2f6) {
    unpack_codes16_fast(d.codes, static_cast<uint8_t>(d.scale), v);
  } else if constexpr (kFmt == kCombMxfp8) {
    mxfp8_lane::decode_lane16(d.codes, static_cast<uint8_t>(d.scale), v);
  } else {
    bf16x16_to_float(d.lo, d.hi, v);
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float term = kUnit ? v[i] : qm_mul(w, v[i]);
    if constexpr (kFirst && kUnit && kFmt == kCombS2f6) {
      acc[i] = term;
    } else {
      acc[i] = qm_add(kFirst ? 0.0f : acc[i], term);
    }
  }
}

// The lane's 16 output values as bf16 (cvt.rn.bf16x2.f32, round to nearest even, NaN -> 0x7FFF: what the reference
// backend writes on the GPU -- the formats kernels' bf16 output and torch's .to(bfloat16)) at out_row + e0.
__device__ __forceinline__ void store_bf16x16(unsigned short* out_row, int e0, const float v[16]) {
  st_v4(out_row + e0, vec::Elem<__nv_bfloat16>::pack(v));
  st_v4(out_row + e0 + 8, vec::Elem<__nv_bfloat16>::pack(v + 8));
}

template <int kMode>
__global__ void __launch_bounds__(kCommThreads) combine_recv_kernel(NvlinkConfig cfg, CombineArgs args) {
  constexpr int kFmt = kMode == kRecvBf16 ? kCombBf16 : kMode == kRecvMxfp8 ? kCombMxfp8 : kCombS2f6;
  constexpr bool kCodes = kFmt != kCombBf16;
  __shared__ int term_rows[kCommThreads / 32][kMaxTopk];
  __shared__ float term_weights[kCommThreads / 32][kMaxTopk];
  // This combine's epoch from a start ticket (one launch of comb_recv_blocks blocks per combine), taken before the block
  // lets its dependents launch (see the send kernel).
  unsigned long long ticket = 0ull;
  if (threadIdx.x == 0) ticket = atomicAdd(&cfg.state->comb_recv_tickets, 1ull);
  const unsigned long long epoch = block_epoch_from_ticket(ticket, cfg.comb_recv_blocks);
  pdl_prologue();
  const int lane = threadIdx.x % 32;
  const int topk = cfg.topk;
  const int hidden = cfg.hidden;

  const int warps_per_block = blockDim.x / 32;
  const int warp_in_block = threadIdx.x / 32;
  const int global_warp = grid_warp_index();
  const int num_warps = gridDim.x * warps_per_block;
  const char* area = cfg.local_base + cfg.off_combine;
  const long long row_bytes = cfg.comb_row_bytes;
  const long long scale_off = cfg.comb_scale_off;

  const int split = split_factor(args.num_tokens, num_warps, (hidden + 511) / 512);
  const long long num_parts = static_cast<long long>(args.num_tokens) * split;
  const int base_stride = 512 * split;
  const RhtSigns16 rht_signs(cfg.sign_mask, lane);  // S2F6 only (unused registers otherwise)

  // Terms of token t (this rank's own routing, local data): the combine rows to sum, in order, into this
  // warp's shared-memory list, and their count. Whole warp calls.
  auto load_terms = [&](int t) -> int {
    int e = -1;
    float w = 0.0f;
    if (lane < topk) {
      e = args.send_idx[static_cast<long long>(t) * topk + lane];
      w = args.send_w[static_cast<long long>(t) * topk + lane];
    }
    int n;
    __syncwarp();  // the previous item's readers are done with the list
    if (args.local_reduce) {
      int ordinal;
      distinct_rank_info(e >= 0 ? e / cfg.num_local : -1, topk, lane, -1, &ordinal, &n);
      if (lane < n) {
        term_rows[warp_in_block][lane] = t * topk + lane;  // ordinals 0..n-1 = ranks in ascending order
        term_weights[warp_in_block][lane] = 1.0f;           // f(1 * v) = v: the unweighted sum
      }
    } else {
      const unsigned int mask = __ballot_sync(0xFFFFFFFFu, e >= 0);
      n = __popc(mask);
      if (e >= 0) {
        const int i = __popc(mask & ((1u << lane) - 1u));
        term_rows[warp_in_block][i] = t * topk + lane;
        term_weights[warp_in_block][i] = w;
      }
    }
    __syncwarp();
    return n;
  };

  // The warp's first token's terms are prepared before waiting for the expert ranks' rows (they only need
  // this rank's routing), so that work overlaps the wait.
  int n = 0;
  if (global_warp < num_parts) n = load_terms(static_cast<int>(global_warp / split));

  // Rows stored by the GEMM's combine-row epilogue (finished before this kernel): published here, by one thread,
  // before that block waits. Every block waits for this rank's own counter too, so the publisher must be a block that
  // has started: the one that drew this launch's first ticket (the start tickets of one launch are drawn before any
  // later launch's: see above), not block 0, which need not be resident when the others are (a large grid, or SMs
  // held by other streams).
  if (args.publish_rows && threadIdx.x == 0 && ticket % static_cast<unsigned long long>(cfg.comb_recv_blocks) == 0ull) {
    signal_all_peers_once(cfg, cfg.off_comb_ready, static_cast<unsigned long long>(cfg.comb_send_blocks));
  }
  const bool rows_in =
      block_wait_all_peers(cfg, cfg.off_comb_ready, epoch * cfg.comb_send_blocks, kStageCombineWaitReady, epoch);

  for (long long fp = global_warp; fp < num_parts; fp += num_warps) {
    const int t = static_cast<int>(fp / split);
    const int part = static_cast<int>(fp - static_cast<long long>(t) * split);
    if (fp != global_warp) n = load_terms(t);
    unsigned short* out_row = args.out + static_cast<long long>(t) * hidden;
    const int* rows = term_rows[warp_in_block];
    const float* weights = term_weights[warp_in_block];
    auto term_row = [&](int i) { return area + static_cast<long long>(rows[i]) * row_bytes; };
    auto load_term_at = [&](int i, int e0) {
      const char* row = term_row(i);
      return load_term<kCodes>(row, row + scale_off, e0);
    };
    if constexpr (kMode == kRecvS2f6Experts) {
      // One row per (token, expert): up to top-k terms (8 at DeepSeek shapes). All terms of a column group are
      // loaded before any is decoded -- one memory latency per group -- where a 2-term prefetch (made for the ~2
      // rows of a local_reduce token) would wait several times. Same sum order. (Also loading the next group's
      // terms while decoding this one measured within noise on 2xH200: not kept.)
      constexpr int kTerms = 8;
      for (int base = part * 512; base < hidden; base += base_stride) {
        const int e0 = base + lane * 16;
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
        if (e0 < hidden) {
          for (int r0 = 0; r0 < n; r0 += kTerms) {
            TermData<true> terms[kTerms];
#pragma unroll
            for (int u = 0; u < kTerms; ++u) {
              if (r0 + u < n) terms[u] = load_term_at(r0 + u, e0);
            }
#pragma unroll
            for (int u = 0; u < kTerms; ++u) {
              if (r0 + u < n) add_term<kCombS2f6, false, false>(acc, terms[u], weights[r0 + u]);
            }
          }
        }
        rht32_inverse_lane16(acc, rht_signs, lane);  // every lane: full-warp shuffles
        if (e0 < hidden) store_bf16x16(out_row, e0, acc);
      }
      continue;
    }
    // Software pipeline: the first two terms of the next column group are loaded before the current group is
    // decoded, summed and stored (two cover every term of a 2-rank local_reduce token); further terms are loaded up
    // to four at a time. BF16 and MXFP8 multiply by the weights (1 with local_reduce); S2F6 rows here are always
    // local_reduce sums.
    constexpr bool kUnit = kMode == kRecvS2f6Ranks;
    // The first two terms' rows, fixed for the token: per group only the column offset is added.
    const char* row0 = n > 0 ? term_row(0) : area;
    const char* row1 = n > 1 ? term_row(1) : area;
    const char* scales0 = row0 + scale_off;
    const char* scales1 = row1 + scale_off;
    TermData<kCodes> next0, next1;
    {
      const int e0 = part * 512 + lane * 16;
      if (e0 < hidden) {
        if (n > 0) next0 = load_term<kCodes>(row0, scales0, e0);
        if (n > 1) next1 = load_term<kCodes>(row1, scales1, e0);
      }
    }
    for (int base = part * 512; base < hidden; base += base_stride) {
      const int e0 = base + lane * 16;
      const bool active = e0 < hidden;
      const TermData<kCodes> cur0 = next0, cur1 = next1;
      const int e1 = e0 + base_stride;
      if (e1 < hidden) {
        if (n > 0) next0 = load_term<kCodes>(row0, scales0, e1);
        if (n > 1) next1 = load_term<kCodes>(row1, scales1, e1);
      }
      float acc[16];
      if (active && n > 0) {
        add_term<kFmt, kUnit, true>(acc, cur0, weights[0]);
        if (n > 1) add_term<kFmt, kUnit, false>(acc, cur1, weights[1]);
        constexpr int kMore = 4;  // further terms, loaded together (one wait for up to four)
        for (int r = 2; r < n; r += kMore) {
          TermData<kCodes> more[kMore];
#pragma unroll
          for (int u = 0; u < kMore; ++u) {
            if (r + u < n) more[u] = load_term_at(r + u, e0);
          }
#pragma unroll
          for (int u = 0; u < kMore; ++u) {
            if (r + u < n) add_term<kFmt, kUnit, false>(acc, more[u], weights[r + u]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.0f;  // no terms: zeros (and -0.0 after the inverse RHT's signs)
      }
      if constexpr (kFmt == kCombS2f6) rht32_inverse_lane16(acc, rht_signs, lane);  // every lane: full-warp shuffles
      if (active) store_bf16x16(out_row, e0, acc);
    }
  }

  // The expert ranks' descriptors, after the rows (no register of the loop above is held for it) and before the
  // consumed signal (after which an expert rank may overwrite them).
  if (rows_in) check_combine_descriptors(cfg, args, epoch);
  // Done reading the combine area: the expert ranks may overwrite it.
  block_signal_all_peers(cfg, cfg.off_comb_consumed);
}

}  // namespace

void launch_combine_send(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream) {
  // wait_only: every block would only wait on the same flags, and the next kernel on the stream waits for the
  // whole grid anyway: one block does it.
  const int grid = args.wait_only ? 1 : cfg.comb_send_blocks;
  const auto kernel = cfg.comb_fmt == kCombS2f6    ? combine_send_kernel<kCombS2f6>
                      : cfg.comb_fmt == kCombMxfp8 ? combine_send_kernel<kCombMxfp8>
                                                   : combine_send_kernel<kCombBf16>;
  check_cuda(launch_kernel(kernel, grid, kCommThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                           combine_pdl(), cfg, args),
             "combine send kernel launch");
}

void launch_combine_recv(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream) {
  const auto kernel = cfg.comb_fmt == kCombBf16    ? combine_recv_kernel<kRecvBf16>
                      : cfg.comb_fmt == kCombMxfp8 ? combine_recv_kernel<kRecvMxfp8>
                      : (args.local_reduce ? combine_recv_kernel<kRecvS2f6Ranks> : combine_recv_kernel<kRecvS2f6Experts>);
  check_cuda(launch_kernel(kernel, cfg.comb_recv_blocks, kCommThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                           combine_pdl(), cfg, args),
             "combine receive kernel launch");
}

}  // namespace nvlink
}  // namespace ep_comm
