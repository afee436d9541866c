// Combine over NVLink: weighted local reduction + RHT-32 + S2F6 on the expert rank, stored straight into
// the source rank's combine area; dequantize-accumulate + inverse RHT on the source rank.
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

__device__ __forceinline__ uint4 pack_bf16x16_lo(const float* v) {
  uint4 r;
  unsigned int* w = reinterpret_cast<unsigned int*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = bf16_bits_rn(v[2 * i]) | (static_cast<unsigned int>(bf16_bits_rn(v[2 * i + 1])) << 16);
  return r;
}

// Encode the lane's 16 fp32 values (whole warp calls; `active` lanes store) into a combine row at
// element offset e0: S2F6 after the forward RHT, or BF16.
__device__ __forceinline__ void encode_store(const NvlinkConfig& cfg, float v[16], char* dst_row, int e0, bool active,
                                             int lane) {
  if (cfg.comb_fmt == kCombS2f6) {
    uint8_t b;
    const uint4 codes = quantize_lane16<true>(v, cfg.sign_mask, lane, &b);  // the s2f6_quantize kernel's code
    if (active) {
      st_v4(dst_row + e0, codes);
      if ((lane & 1) == 0) *reinterpret_cast<uint8_t*>(dst_row + cfg.comb_scale_off + e0 / 32) = b;
    }
  } else if (active) {
    st_v4(dst_row + 2 * e0, pack_bf16x16_lo(v));
    st_v4(dst_row + 2 * e0 + 16, pack_bf16x16_lo(v + 8));
  }
}

__global__ void __launch_bounds__(kCommThreads) combine_send_kernel(NvlinkConfig cfg, CombineArgs args) {
  __shared__ int slot_rows[kCommThreads / 32][kMaxTopk];
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
  if (args.wait_only) {  // rows come from a later kernel (the GEMM's epilogue)
    block_wait_all_peers(cfg, cfg.off_comb_consumed, (epoch - 1ull) * cfg.comb_recv_blocks,
                         kStageCombineWaitConsumed, epoch);
    return;
  }
  const int lane = threadIdx.x % 32;
  const int topk = cfg.topk;
  const int hidden = cfg.hidden;
  const int world = cfg.world;

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
  block_wait_all_peers(cfg, cfg.off_comb_consumed, (epoch - 1ull) * cfg.comb_recv_blocks,
                       kStageCombineWaitConsumed, epoch);

  const int warps_per_block = blockDim.x / 32;
  const int warp_in_block = threadIdx.x / 32;
  const int global_warp = blockIdx.x * warps_per_block + warp_in_block;
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
      slot_rows[warp_in_block][i] = row;
      slot_weights[warp_in_block][i] = args.row_weight[row];
      slot_ids[warp_in_block][i] = lane;
    }
    __syncwarp();
    const int t = args.recv_tok[item];
    char* const area = peer_ptr(cfg, s, cfg.off_combine);
    const int* rows = slot_rows[warp_in_block];

    if (args.local_reduce) {
      char* dst = area + (static_cast<long long>(t) * topk + args.recv_ord[item]) * cfg.comb_row_bytes;
      // Software pipeline over the token's column groups: the first U rows of the next group are loaded
      // before the current group is reduced and encoded, so HBM reads overlap the RHT/S2F6 math. The sum
      // order (rows ascending) is unchanged.
      uint4 pa[U], pb[U];
      {
        const int e0 = part * 512 + lane * 16;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (e0 < hidden && u < n) {
            const unsigned short* p = args.expert_out + static_cast<long long>(rows[u]) * hidden + e0;
            pa[u] = ld_input_v4(p);
            pb[u] = ld_input_v4(p + 8);
          }
        }
      }
      for (int base = part * 512; base < hidden; base += base_stride) {
        const int e0 = base + lane * 16;
        const bool active = e0 < hidden;  // hidden % 32 == 0: both lanes of a chunk agree
        uint4 va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          va[u] = pa[u];
          vb[u] = pb[u];
        }
        {
          const int e1 = e0 + base_stride;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (e1 < hidden && u < n) {
              const unsigned short* p = args.expert_out + static_cast<long long>(rows[u]) * hidden + e1;
              pa[u] = ld_input_v4(p);
              pb[u] = ld_input_v4(p + 8);
            }
          }
        }
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
        if (active) {
          for (int r0 = 0; r0 < n; r0 += U) {
            if (r0 > 0) {
#pragma unroll
              for (int u = 0; u < U; ++u) {
                if (r0 + u < n) {
                  const unsigned short* p = args.expert_out + static_cast<long long>(rows[r0 + u]) * hidden + e0;
                  va[u] = ld_input_v4(p);
                  vb[u] = ld_input_v4(p + 8);
                }
              }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
              if (r0 + u < n) {
                const float w = slot_weights[warp_in_block][r0 + u];
                float xv[16];
                bf16x16_to_float(va[u], vb[u], xv);
#pragma unroll
                for (int i = 0; i < 16; ++i) acc[i] = qm_add(acc[i], qm_mul(w, xv[i]));
              }
            }
          }
        }
        encode_store(cfg, acc, dst, e0, active, lane);
      }
    } else {
      for (int r = 0; r < n; ++r) {
        char* dst = area + (static_cast<long long>(t) * topk + slot_ids[warp_in_block][r]) * cfg.comb_row_bytes;
        const unsigned short* src = args.expert_out + static_cast<long long>(rows[r]) * hidden;
        for (int base = part * 512; base < hidden; base += base_stride) {
          const int e0 = base + lane * 16;
          const bool active = e0 < hidden;
          float xv[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) xv[i] = 0.0f;
          if (active) bf16x16_to_float(ld_input_v4(src + e0), ld_input_v4(src + e0 + 8), xv);
          encode_store(cfg, xv, dst, e0, active, lane);
        }
      }
    }
  }

  block_signal_all_peers(cfg, cfg.off_comb_ready);
}

// One combine row's 16 elements at e0 (S2F6: 16 code bytes + the chunk's scale byte; BF16: 32 bytes).
__device__ __forceinline__ void load_term(const char* src, int e0, bool s2f6, long long scale_off, uint4& a, uint4& b,
                                          unsigned int& sb) {
  if (s2f6) {
    a = ld_coherent_v4(src + e0);
    sb = ld_coherent_u8(src + scale_off + e0 / 32);
  } else {
    a = ld_coherent_v4(src + 2 * e0);
    b = ld_coherent_v4(src + 2 * e0 + 16);
  }
}

// kExpertRows: the local_reduce=False S2F6 path (one row per (token, expert)), its own instantiation so that its
// eight loads in flight do not raise the register allocation of the general path.
template <bool kExpertRows>
__global__ void __launch_bounds__(kCommThreads) combine_recv_kernel(NvlinkConfig cfg, CombineArgs args) {
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
  const int global_warp = blockIdx.x * warps_per_block + warp_in_block;
  const int num_warps = gridDim.x * warps_per_block;
  const char* area = cfg.local_base + cfg.off_combine;

  const int split = split_factor(args.num_tokens, num_warps, (hidden + 511) / 512);
  const long long num_parts = static_cast<long long>(args.num_tokens) * split;
  const int base_stride = 512 * split;
  constexpr int U = 4;  // combine rows loaded before accumulating (order of the sum unchanged)
  const bool s2f6 = cfg.comb_fmt == kCombS2f6;

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
  // before any block waits (no block depends on another block of this grid, so residency cannot deadlock it).
  if (args.publish_rows && blockIdx.x == 0 && threadIdx.x == 0) {
    signal_all_peers_once(cfg, cfg.off_comb_ready, static_cast<unsigned long long>(cfg.comb_send_blocks));
  }
  block_wait_all_peers(cfg, cfg.off_comb_ready, epoch * cfg.comb_send_blocks, kStageCombineWaitReady, epoch);

  for (long long fp = global_warp; fp < num_parts; fp += num_warps) {
    const int t = static_cast<int>(fp / split);
    const int part = static_cast<int>(fp - static_cast<long long>(t) * split);
    if (fp != global_warp) n = load_terms(t);
    unsigned short* out_row = args.out + static_cast<long long>(t) * hidden;
    if constexpr (kExpertRows) {
      // One row per (token, expert): up to top-k terms (8 at DeepSeek shapes). All terms of a column group are
      // loaded before any is decoded -- one memory latency per group -- where the 2-row prefetch and batches of 4
      // below (made for the ~2 rows of a local_reduce token) would wait three times. Same sum order. (Also loading
      // the next group's terms while decoding this one measured within noise on 2xH200: not kept.)
      constexpr int kTerms = 8;
      for (int base = part * 512; base < hidden; base += base_stride) {
        const int e0 = base + lane * 16;
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
        if (e0 < hidden) {
          for (int r0 = 0; r0 < n; r0 += kTerms) {
            uint4 codes[kTerms], unused;
            unsigned int scales[kTerms];
#pragma unroll
            for (int u = 0; u < kTerms; ++u) {
              if (r0 + u < n) {
                const char* src = area + static_cast<long long>(term_rows[warp_in_block][r0 + u]) * cfg.comb_row_bytes;
                load_term(src, e0, true, cfg.comb_scale_off, codes[u], unused, scales[u]);
              }
            }
#pragma unroll
            for (int u = 0; u < kTerms; ++u) {
              if (r0 + u < n) {
                const float wr = term_weights[warp_in_block][r0 + u];
                float v[16];
                unpack_codes16_fast(codes[u], static_cast<uint8_t>(scales[u]), v);
#pragma unroll
                for (int i = 0; i < 16; ++i) acc[i] = qm_add(acc[i], qm_mul(wr, v[i]));
              }
            }
          }
        }
        rht32_inverse_lane16(acc, cfg.sign_mask, lane);
        if (e0 < hidden) {
          st_v4(out_row + e0, pack_bf16x16_lo(acc));
          st_v4(out_row + e0 + 8, pack_bf16x16_lo(acc + 8));
        }
      }
      continue;
    }
    // Software pipeline: the first P rows of the next column group are loaded before the current group is
    // decoded, accumulated and inverse-transformed (P = 2 covers every row of a 2-rank local_reduce token).
    constexpr int P = 2;
    uint4 qa[P], qb[P];
    unsigned int qs[P];
    {
      const int e0 = part * 512 + lane * 16;
#pragma unroll
      for (int u = 0; u < P; ++u) {
        if (e0 < hidden && u < n) {
          const char* src = area + static_cast<long long>(term_rows[warp_in_block][u]) * cfg.comb_row_bytes;
          load_term(src, e0, s2f6, cfg.comb_scale_off, qa[u], qb[u], qs[u]);
        }
      }
    }
    for (int base = part * 512; base < hidden; base += base_stride) {
      const int e0 = base + lane * 16;
      const bool active = e0 < hidden;
      uint4 ca[P], cb[P];
      unsigned int cs[P];
#pragma unroll
      for (int u = 0; u < P; ++u) {
        ca[u] = qa[u];
        cb[u] = qb[u];
        cs[u] = qs[u];
      }
      {
        const int e1 = e0 + base_stride;
#pragma unroll
        for (int u = 0; u < P; ++u) {
          if (e1 < hidden && u < n) {
            const char* src = area + static_cast<long long>(term_rows[warp_in_block][u]) * cfg.comb_row_bytes;
            load_term(src, e1, s2f6, cfg.comb_scale_off, qa[u], qb[u], qs[u]);
          }
        }
      }
      float acc[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
      if (active) {
        for (int r0 = 0; r0 < n; r0 += U) {
          uint4 va[U], vb[U];
          unsigned int sb[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (r0 + u < n) {
              if (r0 == 0 && u < P) {
                va[u] = ca[u < P ? u : 0];
                vb[u] = cb[u < P ? u : 0];
                sb[u] = cs[u < P ? u : 0];
              } else {
                const char* src = area + static_cast<long long>(term_rows[warp_in_block][r0 + u]) * cfg.comb_row_bytes;
                load_term(src, e0, s2f6, cfg.comb_scale_off, va[u], vb[u], sb[u]);
              }
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (r0 + u < n) {
              const float wr = term_weights[warp_in_block][r0 + u];
              float v[16];
              if (s2f6) {
                unpack_codes16_fast(va[u], static_cast<uint8_t>(sb[u]), v);
              } else {
                bf16x16_to_float(va[u], vb[u], v);
              }
#pragma unroll
              for (int i = 0; i < 16; ++i) acc[i] = qm_add(acc[i], qm_mul(wr, v[i]));
            }
          }
        }
      }
      if (s2f6) rht32_inverse_lane16(acc, cfg.sign_mask, lane);  // also on zeros: the signs make -0.0, as the reference
      if (active) {
        st_v4(out_row + e0, pack_bf16x16_lo(acc));
        st_v4(out_row + e0 + 8, pack_bf16x16_lo(acc + 8));
      }
    }
  }

  // Done reading the combine area: the expert ranks may overwrite it.
  block_signal_all_peers(cfg, cfg.off_comb_consumed);
}

}  // namespace

void launch_combine_send(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream) {
  // wait_only: every block would only wait on the same flags, and the next kernel on the stream waits for the
  // whole grid anyway: one block does it.
  const int grid = args.wait_only ? 1 : cfg.comb_send_blocks;
  check_cuda(launch_kernel(combine_send_kernel, grid, kCommThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                           combine_pdl(), cfg, args),
             "combine send kernel launch");
}

void launch_combine_recv(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream) {
  const bool expert_rows = !args.local_reduce && cfg.comb_fmt == kCombS2f6;
  check_cuda(launch_kernel(expert_rows ? combine_recv_kernel<true> : combine_recv_kernel<false>, cfg.comb_recv_blocks,
                           kCommThreads, 0, reinterpret_cast<cudaStream_t>(stream), combine_pdl(), cfg, args),
             "combine receive kernel launch");
}

}  // namespace nvlink
}  // namespace ep_comm
