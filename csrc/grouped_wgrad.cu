// Weight-gradient grouped GEMM (grouped_wgrad.h): BF16 x BF16 -> FP32 on Hopper with wgmma, both operands K-major
// in shared memory ("SS"), groups along the contraction.
//
// CTA tile 128 (m) x 256 (n): two warpgroups, warpgroup g computing rows 64 g .. 64 g + 63 with one m64n256k16
// wgmma per k16 step, 128 FP32 accumulators per thread. k-blocks of 64 (one 128-byte row per operand row, the
// 128-byte swizzle of wgmma.cuh), a ring of kStages stages of 48 KiB, one CTA per SM. Persistent: CTA c takes work
// items c, c + grid, ... (item = expert, m tile, n tile; n fastest, so the CTAs running at one time share their
// expert's operands in L2). The loads run kStages - 2 k-blocks ahead of the MMAs in the CTA's flat sequence of
// k-blocks over all its items, so the next item's first k-blocks are in flight while an item drains its last wgmma
// and stores its tile: the epilogue's 128 KiB of FP32 stores overlap loads, not an empty pipeline. Each k-block's
// loads are issued after its wgmma, so they run under it.
//
// Every thread cp.async's 4 chunks of 16 bytes of the a tile and 8 of the b tile per k-block: fixed 16-byte column
// chunk c = tid % 8, rows tid / 8 + 32 j, so its swizzled shared-memory column (c ^ (row % 8)) is the same for all
// its chunks. A chunk outside the expert's segment or past the last row is zero-filled; a chunk cut by a segment
// boundary that is not a multiple of 8 (not the trainable experts' case: their segments are multiples of 32) is
// copied element by element with the mask.
//
// Measured on one H200 (bench/RESULTS.md, fifty-first session; bench/profile_wgrad.py, w2's shape: 7168 x 2048, 32
// experts of 1040 tokens): 1.87-1.95 ms, 500-525 TFLOP/s; both weight gradients of bench_training_experts.py 5.94-6.04
// ms against 7.54-7.65 ms for torch._grouped_mm (BF16 out) + the widening to FP32. torch's CUTLASS kernel alone runs at ~650
// TFLOP/s. Where the rest goes (Nsight Compute): the tensor pipe is busy 61-64% of the time; a third of the stall
// samples are in the epilogue (every SM stores its 128 KiB tile while its tensor cores idle: nothing else runs on the
// SM), and the per-k-block code waits on the load queue (12 cp.async per thread). What would close the gap: TMA loads
// from a producer warp (one instruction per tile instead of 3072 per k-block) with mbarriers instead of the CTA
// barrier, and two consumer warpgroups on different tiles so that one's epilogue overlaps the other's MMAs. First
// version (per-chunk checks on every load, loads before the MMAs, two n128 MMAs per k16 step): 273 TFLOP/s.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cp_async.cuh"
#include "grouped_gemm.h"
#include "grouped_wgrad.h"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;
constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kStages = 4;
constexpr int kTileABytes = kTileM * 128;
constexpr int kTileBBytes = kTileN * 128;
constexpr int kStageBytes = kTileABytes + kTileBBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + room to align the ring to 1024 B

#if EP_COMM_HAS_WGMMA  // (the helpers are sm_90a code only, as the kernel body)
constexpr int kBlockK = 64;                // one 128-byte swizzle row of bf16
constexpr int kCachedExperts = 1024;       // segment ends kept in shared memory (4 KiB)
constexpr int kRowsPerPass = kThreads / 8;  // rows one pass of all threads' 16-byte chunks covers

// Where one CTA's flat sequence of k-blocks stands: the item, its k-block and the item's segment. Uniform across the
// CTA (every thread computes the same from the same loads).
struct Cursor {
  int64_t item;
  int kb, nk;
  int64_t m0, n0, out_matrix;  // out_matrix: e * m_rows * n_rows
  int64_t seg_begin, seg_end, k_begin;
  // This thread's first chunk of k-block 0 in a and b (rows m0 / n0 + tid / 8, column k_begin + 8 (tid % 8)); valid
  // as addresses only where the row is.
  const uint16_t* a_src;
  const uint16_t* b_src;
  bool full_tile;  // every row of the tile exists (m0 + 128 <= m_rows, n0 + 256 <= n_rows)
};

// ends: the segment ends (shared memory for up to kCachedExperts experts, else args.group_ends).
__device__ __forceinline__ void locate(const GroupedWgradArgs& args, const int32_t* ends, int64_t tiles_m,
                                       int64_t tiles_n, int64_t item, Cursor& c) {
  const int64_t per_expert = tiles_m * tiles_n;
  const int e = static_cast<int>(item / per_expert);
  const int64_t r = item - e * per_expert;
  c.item = item;
  c.kb = 0;
  c.m0 = (r / tiles_n) * kTileM;
  c.n0 = (r % tiles_n) * kTileN;
  c.out_matrix = static_cast<int64_t>(e) * args.m_rows * args.n_rows;
  int64_t begin = e == 0 ? 0 : ends[e - 1];
  int64_t end = ends[e];
  begin = begin < 0 ? 0 : (begin > args.k_total ? args.k_total : begin);
  end = end < begin ? begin : (end > args.k_total ? args.k_total : end);
  c.seg_begin = begin;
  c.seg_end = end;
  c.k_begin = begin & ~int64_t{7};  // 16-byte aligned chunks
  c.nk = end > begin ? static_cast<int>((end - c.k_begin + kBlockK - 1) / kBlockK) : 0;
  const int64_t column = c.k_begin + 8 * (threadIdx.x % 8);
  c.a_src = args.a + (c.m0 + threadIdx.x / 8) * args.lda + column;
  c.b_src = args.b + (c.n0 + threadIdx.x / 8) * args.ldb + column;
  c.full_tile = c.m0 + kTileM <= args.m_rows && c.n0 + kTileN <= args.n_rows;
}

// One 16-byte chunk (8 columns from col) of operand row `row` (row < rows checked by the caller) into dst.
__device__ __forceinline__ void load_chunk(uint32_t dst, const uint16_t* row_ptr, int64_t col, const Cursor& c,
                                           bool row_valid) {
  const int64_t lo = col > c.seg_begin ? col : c.seg_begin;
  const int64_t hi = col + 8 < c.seg_end ? col + 8 : c.seg_end;
  if (!row_valid || lo >= hi) {
    cp_async::copy16_zfill(dst, row_ptr, 0);  // (nothing is read: any valid address)
  } else if (lo == col && hi == col + 8) {
    cp_async::copy16(dst, row_ptr + col);
  } else {  // a segment boundary inside the chunk
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c0 = col + 2 * i;
      const uint32_t v0 = c0 >= lo && c0 < hi ? row_ptr[c0] : 0u;
      const uint32_t v1 = c0 + 1 >= lo && c0 + 1 < hi ? row_ptr[c0 + 1] : 0u;
      words[i] = v0 | (v1 << 16);
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(words[0]), "r"(words[1]),
                 "r"(words[2]), "r"(words[3])
                 : "memory");
  }
}

// One operand's kRows-row tile (rows first_row.., of rows_total) of a k-block through load_chunk: this thread's
// chunks at column col of rows tid / 8 + 32 j, into dst (its swizzled column already added) + row * 128.
template <int kRows>
__device__ __forceinline__ void load_tile_checked(const uint16_t* operand, int64_t ld, int64_t rows_total,
                                                  int64_t first_row, uint32_t dst, int64_t col, const Cursor& c) {
#pragma unroll
  for (int j = 0; j < kRows / kRowsPerPass; ++j) {
    const int row = static_cast<int>(threadIdx.x / 8) + j * kRowsPerPass;
    const bool valid = first_row + row < rows_total;
    load_chunk(dst + row * 128, operand + (valid ? first_row + row : 0) * ld, col, c, valid);
  }
}

// The a and b tiles of the cursor's current k-block into ring slot `slot`. A k-block inside the segment of a full
// tile (every k-block but the last of a segment whose length is not a multiple of 64 and the first of one that does
// not start on a multiple of 8, in every tile but those at the matrix edges) takes the short path: 12 unconditional copies from the thread's two source pointers (the per-chunk checks
// cost ~25 instructions each, which the MMA-issuing warps paid on every k-block: a third of the tensor pipe's time).
__device__ __forceinline__ void load_stage(const GroupedWgradArgs& args, const Cursor& c, uint32_t slot_base) {
  const int row0 = threadIdx.x / 8;
  const int chunk = threadIdx.x % 8;
  const uint32_t swizzled = static_cast<uint32_t>(((chunk ^ (row0 % 8)) * 16));
  const int64_t k0 = c.k_begin + static_cast<int64_t>(c.kb) * kBlockK;
  if (c.full_tile && k0 >= c.seg_begin && k0 + kBlockK <= c.seg_end) {
    const uint16_t* a = c.a_src + static_cast<int64_t>(c.kb) * kBlockK;
    const uint16_t* b = c.b_src + static_cast<int64_t>(c.kb) * kBlockK;
    const int64_t a_step = kRowsPerPass * args.lda, b_step = kRowsPerPass * args.ldb;
    const uint32_t dst = slot_base + row0 * 128 + swizzled;
#pragma unroll
    for (int j = 0; j < kTileM / kRowsPerPass; ++j) cp_async::copy16(dst + j * kRowsPerPass * 128, a + j * a_step);
#pragma unroll
    for (int j = 0; j < kTileN / kRowsPerPass; ++j) {
      cp_async::copy16(dst + kTileABytes + j * kRowsPerPass * 128, b + j * b_step);
    }
    return;
  }
  const int64_t col = k0 + 8 * chunk;
  load_tile_checked<kTileM>(args.a, args.lda, args.m_rows, c.m0, slot_base + swizzled, col, c);
  load_tile_checked<kTileN>(args.b, args.ldb, args.n_rows, c.n0, slot_base + kTileABytes + swizzled, col, c);
}

// The loader's cursor to the next k-block of the flat sequence (skipping empty items); false past the last one.
__device__ __forceinline__ bool advance(const GroupedWgradArgs& args, const int32_t* ends, int64_t tiles_m,
                                        int64_t tiles_n, int64_t items, Cursor& c) {
  if (++c.kb < c.nk) return true;
  for (int64_t item = c.item + gridDim.x; item < items; item += gridDim.x) {
    locate(args, ends, tiles_m, tiles_n, item, c);
    if (c.nk > 0) return true;
  }
  return false;
}
#endif  // EP_COMM_HAS_WGMMA

__global__ void __launch_bounds__(kThreads, 1) grouped_wgrad_bf16_kernel(const GroupedWgradArgs args) {
#if EP_COMM_HAS_WGMMA
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = cp_async::smem_address(smem_raw) +
                        ((1024 - (cp_async::smem_address(smem_raw) & 1023)) & 1023);  // 1024-aligned tiles
  const int64_t tiles_m = (args.m_rows + kTileM - 1) / kTileM;
  const int64_t tiles_n = (args.n_rows + kTileN - 1) / kTileN;
  const int64_t items = tiles_m * tiles_n * args.num_experts;
  // The segment ends in shared memory: every item start reads two of them, once for the loads and once for the MMAs,
  // and from global memory that dependent round trip stalled the MMA-issuing warps at every item.
  __shared__ int32_t cached_ends[kCachedExperts];
  const bool cached = args.num_experts <= kCachedExperts;
  if (cached) {
    for (int e = threadIdx.x; e < args.num_experts; e += kThreads) cached_ends[e] = __ldg(args.group_ends + e);
  }
  __syncthreads();
  const int32_t* ends = cached ? cached_ends : args.group_ends;

  // The loader: first k-block of the CTA's first non-empty item.
  Cursor load;
  bool loading = false;
  for (int64_t item = blockIdx.x; item < items && !loading; item += gridDim.x) {
    locate(args, ends, tiles_m, tiles_n, item, load);
    loading = load.nk > 0;
  }
  int64_t issued = 0;  // k-blocks issued (the flat index of the next)
  // One commit group per k-block (empty once the sequence has ended), so that "k-block f has landed" is always
  // "at most kStages - 3 groups pending" at the consumer's wait.
  auto issue = [&]() {
    if (loading) {
      load_stage(args, load, ring + static_cast<uint32_t>(issued % kStages) * kStageBytes);
      ++issued;
      loading = advance(args, ends, tiles_m, tiles_n, items, load);
    }
    cp_async::commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) issue();

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;
  int64_t consumed = 0;
  float acc[128];
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    Cursor c;
    locate(args, ends, tiles_m, tiles_n, item, c);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < c.nk; ++kb) {
      cp_async::wait<kStages - 3>();           // this thread's copies of k-block `consumed` have landed
      wgmma::fence_proxy_async_shared();       // ... and are visible to wgmma's async proxy
      __syncthreads();                         // everyone's (and every warpgroup has retired consumed - 2)
      const uint32_t slot = ring + static_cast<uint32_t>(consumed % kStages) * kStageBytes;
      const uint64_t desc_a = wgmma::make_descriptor_sw128(slot + warpgroup * 64 * 128);
      const uint64_t desc_b = wgmma::make_descriptor_sw128(slot + kTileABytes);
      wgmma::fence_operand(acc);
      wgmma::fence();
#pragma unroll
      for (int s = 0; s < kBlockK / 16; ++s) {  // k16 step s: 32 B further, + 2 in the start field (address >> 4)
        wgmma::mma_ss_bf16_n256(acc, desc_a + 2 * s, desc_b + 2 * s);
      }
      wgmma::commit_group();
      // While it runs: k-block consumed + kStages - 2 into the slot of consumed - 2, which every warpgroup has retired
      // (the barrier above is after each one's wait for consumed - 2).
      issue();
      wgmma::fence_operand(acc);
      wgmma::wait_group<1>();  // k-block consumed - 1 retired
      ++consumed;
    }
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
    // Accumulator i of lane l in warp w: row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
    // Lanes l and l ^ 1 trade halves so that each stores 4 consecutive columns of one row (16-byte stores: half the
    // store instructions of column pairs, whose queue throttled the epilogue): the even lane row r, the odd one r + 8.
    // Plain stores: L2 takes the burst of every SM's epilogue (the items end together) and writes it back during the
    // next items; streaming (evict-first) stores measured 3% slower (bench/RESULTS.md, fifty-first session).
    const bool odd = lane % 2 == 1;
    const int64_t m = c.m0 + warpgroup * 64 + 16 * warp + lane / 4 + (odd ? 8 : 0);
    const int64_t n_first = c.n0 + 2 * (lane % 4) - (odd ? 2 : 0);
    const bool row_valid = m < args.m_rows;  // (the shuffles stay outside it: the partner lane's row may exist)
    float* row = args.out + c.out_matrix + (row_valid ? m : 0) * args.n_rows + n_first;
#pragma unroll
    for (int q = 0; q < 32; ++q) {  // 8-column group q: acc[4 q + 0, 1] row r, acc[4 q + 2, 3] row r + 8
      const float got0 = __shfl_xor_sync(0xFFFFFFFFu, odd ? acc[4 * q] : acc[4 * q + 2], 1);
      const float got1 = __shfl_xor_sync(0xFFFFFFFFu, odd ? acc[4 * q + 1] : acc[4 * q + 3], 1);
      const float4 v = odd ? make_float4(got0, got1, acc[4 * q + 2], acc[4 * q + 3])
                           : make_float4(acc[4 * q], acc[4 * q + 1], got0, got1);
      if (row_valid && (c.full_tile || n_first + 8 * q < args.n_rows)) {
        *reinterpret_cast<float4*>(row + 8 * q) = v;
      }
    }
  }
  cp_async::wait<0>();  // (only empty groups can be pending here)
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

}  // namespace

cudaError_t launch_grouped_wgrad_bf16(const GroupedWgradArgs& args, cudaStream_t stream) {
  if (args.num_experts < 0 || args.m_rows < 0 || args.n_rows < 0 || args.k_total < 0 || args.m_rows % 8 != 0 ||
      args.n_rows % 8 != 0 || args.lda < args.k_total || args.ldb < args.k_total || args.lda % 8 != 0 ||
      args.ldb % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = ceil_div(args.m_rows, kTileM) * ceil_div(args.n_rows, kTileN) * args.num_experts;
  if (items == 0) return cudaSuccess;
  if (args.out == nullptr || args.group_ends == nullptr || !rows_aligned(args.out, 0, 16) ||
      (args.k_total > 0 && (args.a == nullptr || args.b == nullptr || !rows_aligned(args.a, 0, 16) ||
                            !rows_aligned(args.b, 0, 16)))) {
    return cudaErrorInvalidValue;
  }
  if (!device_is_sm90()) return cudaErrorNotSupported;
  static std::atomic<uint64_t> configured{0};
  cudaError_t status = once_per_device(configured, [] {
    return cudaFuncSetAttribute(grouped_wgrad_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  });
  if (status != cudaSuccess) return status;
  int64_t grid = 0;
  status = resident_grid(grouped_wgrad_bf16_kernel, kThreads, items, &grid, kSmemBytes);
  if (status != cudaSuccess) return status;
  grouped_wgrad_bf16_kernel<<<static_cast<unsigned>(grid), kThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace ep_comm
