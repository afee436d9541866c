// Weight-gradient grouped GEMM (grouped_wgrad.h): BF16 x BF16 -> FP32 on Hopper with wgmma, both operands K-major
// in shared memory ("SS"), groups along the contraction.
//
// CTA tile 128 (m) x 256 (n), k-blocks of 64 (one 128-byte row per operand row, the 128-byte swizzle of wgmma.cuh),
// three warpgroups with fixed roles ("warp-specialized"), clusters of two CTAs:
// * one producer thread (warpgroup 0) issues the TMA loads into a ring of kStages slots of 48 KiB, each with a "full"
//   mbarrier (the loads' bytes) and an "empty" one (the consumer warps' releases). It runs up to kStages k-blocks
//   ahead, across work items: the next item's first k-blocks land while the consumers finish the current one.
// * two consumer warpgroups, warpgroup g computing rows 64 g .. 64 g + 63 with one m64n256k16 wgmma per k16 step,
//   128 FP32 accumulators per thread; each warp releases a slot once its wgmma reading it has retired.
// * the two CTAs of a cluster take the two m tiles of one cluster item (expert, 256 rows of m, n tile): they share its
//   b tile, so each loads its own a tile and half of the b tile, multicast into both (TMA .multicast::cluster). A
//   slot is refilled once the consumer warps of both CTAs have released it (remote mbarrier arrivals).
// Persistent: cluster c takes cluster items c, c + clusters, ... (n fastest, so the clusters running at one time share
// their expert's operands in L2).
//
// A segment's k-blocks start at its first column rounded down to 16 (TMA coordinates at 32-byte steps). The k16 steps
// of its last k-block that lie past its end multiply an all-zero operand instead (a stride-0 descriptor over 1 KiB of
// zeros), so segments whose boundaries are multiples of 16 (the trainable experts': multiples of 32) cost no extra
// work. Only a boundary inside a k16 step (not the dispatch layout's case) makes the consumers zero that k-block's
// columns outside the segment in both tiles (shared-memory stores, 12 16-byte chunks per thread) before its wgmma.
// Rows past m_rows / n_rows and columns past k_total are the TMA's zero fill. The epilogue goes through 2 KiB of
// shared memory per consumer warp, 32 columns at a time, written out by TMA stores in whole 128-byte lines (TMA
// reduce-adds into the output when args.accumulate).
//
// Measured on one H200 (bench/RESULTS.md, fifty-third session; bench/profile_wgrad.py, 32 experts of 1040 tokens):
// ~604 TFLOP/s at w2's shape (7168 x 2048) and ~590 at w1's (4096 x 7168), against 548-556 / 530-543 for the same
// kernel storing straight from the accumulators in the same runs. The kernel is bound by its output more than by its
// MMAs: without the epilogue's stores (a timing-only variant, wrong results) it ran at 878 / 857 TFLOP/s, and with the
// stores but without the MMAs almost as long as whole. Tried and dropped: without clusters (531 / 517, fifty-second
// session); an epilogue staged through 128 KiB of shared memory, which forces k-blocks of 32 (520 / 509); remote
// arrivals with .release.cluster semantics (a memory barrier each: 352 / 348); clusters of 4 or 8 CTAs sharing the b
// tile (2-4% slower; the operand loads were not the limit); ping-pong consumers, each warpgroup on its own 64 x 256
// items, the two taking turns at the tensor cores so that one's epilogue runs beside the other's MMAs (8-16% slower;
// by count, its 40 KiB stages plus the wgmma reads move ~1.26x the shared-memory bytes per MMA of the 128 x 256 tile,
// past the 128 bytes per cycle an SM has -- an estimate, not measured; fifty-third session).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "formats.h"
#include "grouped_gemm.h"
#include "grouped_wgrad.h"
#include "tensor_map.h"
#include "tma.cuh"
#include "vec_io.cuh"
#include "wgmma.cuh"

namespace ep_comm {
namespace {

constexpr int kConsumerThreads = 256;
constexpr int kThreads = 128 + kConsumerThreads;
constexpr int kCluster = 2;  // CTAs per cluster: m tiles sharing one b tile
constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kBlockK = 64;
constexpr int kStages = 4;
constexpr int kRowBytes = kBlockK * 2;  // one 128-byte swizzle row
constexpr int kStageBytes = (kTileM + kTileN) * kRowBytes;
constexpr int kCachedExperts = 1024;  // segment ends kept in shared memory (4 KiB)
constexpr int kZeroBytes = 1024;  // 8 rows of 128 zero bytes: the operand of a k16 step past a segment's end
constexpr int kStagingBytesPerWarp = 16 * 128;  // the epilogue's staging: 16 rows x 32 FP32 columns per consumer warp
constexpr int kStagingBytes = (kConsumerThreads / 32) * kStagingBytesPerWarp;
// + room to align the ring to 1024 bytes, the zeros, the staging, the full and empty barriers, the cached ends
constexpr int kSmemBytes =
    1024 + kStages * kStageBytes + kZeroBytes + kStagingBytes + 2 * kStages * 8 + kCachedExperts * 4;

struct KernelParams {
  CUtensorMap a;    // bf16 [m_rows, k_total], box 64 x 128
  CUtensorMap b;    // bf16 [n_rows, k_total], box 64 x 128 (half a b tile)
  CUtensorMap out;  // fp32 [num_experts, m_rows, n_rows], box 32 x 16 x 1, 128-byte swizzle
  GroupedWgradArgs args;
};

#if EP_COMM_HAS_WGMMA
constexpr int kTileABytes = kTileM * kRowBytes;
constexpr int kHalfBBytes = 128 * kRowBytes;  // what one CTA of the cluster loads of the b tile

// One work item's place: its output tile and its segment's k-blocks. Every role computes the same from the same ends.
struct Item {
  int expert;
  int32_t m0, n0;
  int64_t seg_begin, seg_end;
  int32_t first_k, nk;  // k-blocks at first_k + kBlockK kb, kb < nk; first_k: seg_begin rounded down to 16
};

// tiles_m: cluster m tiles (kCluster * 128 rows; rank = this CTA's in the cluster).
__device__ __forceinline__ Item locate(const GroupedWgradArgs& args, const int32_t* ends, int64_t tiles_m,
                                       int64_t tiles_n, int64_t item, int rank) {
  const int64_t per_expert = tiles_m * tiles_n;
  Item it;
  it.expert = static_cast<int>(item / per_expert);
  const int64_t r = item - it.expert * per_expert;
  it.m0 = static_cast<int32_t>(((r / tiles_n) * kCluster + rank) * kTileM);
  it.n0 = static_cast<int32_t>((r % tiles_n) * kTileN);
  int64_t begin = it.expert == 0 ? 0 : ends[it.expert - 1];
  int64_t end = ends[it.expert];
  begin = begin < 0 ? 0 : (begin > args.k_total ? args.k_total : begin);
  end = end < begin ? begin : (end > args.k_total ? args.k_total : end);
  it.seg_begin = begin;
  it.seg_end = end;
  it.first_k = static_cast<int32_t>(begin & ~int64_t{15});
  it.nk = end > begin ? static_cast<int32_t>((end - it.first_k + kBlockK - 1) / kBlockK) : 0;
  return it;
}

// Zeroes the columns outside [begin, end) of the k-block at k0 in both tiles of a ring slot: 384 rows of 128 bytes
// (the a tile's 128, then the b tile's 256: one swizzle pattern across both), 16-byte chunk c of row r stored at
// c ^ (r % 8). Called by the 256 consumer threads together.
__device__ void zero_outside_segment(uint32_t slot, int64_t k0, int64_t begin, int64_t end, int consumer_thread) {
  constexpr int kChunksPerRow = kBlockK / 8;
  for (int i = consumer_thread; i < (kTileM + kTileN) * kChunksPerRow; i += kConsumerThreads) {
    const int row = i / kChunksPerRow;
    const int chunk = i % kChunksPerRow;
    const int64_t col = k0 + 8 * chunk;
    if (col >= begin && col + 8 <= end) continue;
    const uint32_t address = slot + static_cast<uint32_t>(row * kRowBytes + (chunk ^ (row % 8)) * 16);
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    if (col + 8 > begin && col < end) {  // cut inside the chunk: keep the columns in the segment
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                   : "r"(address));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool keep = col + j >= begin && col + j < end;
        if (!keep) words[j / 2] &= j % 2 == 0 ? 0xFFFF0000u : 0x0000FFFFu;
      }
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(words[0]), "r"(words[1]),
                 "r"(words[2]), "r"(words[3])
                 : "memory");
  }
}

// Writes columns 32 c .. 32 c + 31 of a consumer warp's 16 accumulator rows into its staging area, 16-byte granule g of
// row r at g ^ (r % 8) (the 128-byte swizzle: conflict-free for these 8-byte writes, and the output map's layout).
// Accumulator i of lane l (m64n256 fragment): row l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
__device__ __forceinline__ void stage_chunk(const float (&acc)[128], int chunk, int lane, uint32_t staging) {
#pragma unroll
  for (int qq = 0; qq < 4; ++qq) {
    const int q = 4 * chunk + qq;
    const int granule = 2 * qq + (lane % 4) / 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = lane / 4 + 8 * half;
      const uint32_t address = staging + r * 128 + (granule ^ (r % 8)) * 16 + 8 * (lane % 2);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(acc[4 * q + 2 * half]),
                   "f"(acc[4 * q + 2 * half + 1])
                   : "memory");
    }
  }
}

// The epilogue of a consumer warp (rows m_first .. m_first + 15 of the item's tile): in 32-column chunks through its
// staging area, each chunk one TMA store (box 32 x 16 of the output map, whose 128-byte swizzle is the staging's), so
// whole 128-byte lines reach L2 and the TMA unit, not the warp, waits for them. Straight from the accumulators each
// store instruction wrote one 32-byte sector in each of 16 rows, and the kernel ran 8-10% slower; the same staging
// with 16-byte stores of whole lines by the warp measured ~1-2% slower than the TMA stores (bench/RESULTS.md,
// fifty-third session). The staging area is rewritten only once the previous chunk's store has read it. kAccumulate:
// the TMA adds the chunk into the output instead (args.accumulate).
template <bool kAccumulate>
__device__ __forceinline__ void store_accumulators(const float (&acc)[128], const KernelParams& p, const Item& item,
                                                   int64_t m_first, int lane, uint32_t staging) {
#pragma unroll
  for (int chunk = 0; chunk < kTileN / 32; ++chunk) {
    if (lane == 0) tma::wait_store_reads();
    __syncwarp();
    stage_chunk(acc, chunk, lane, staging);
    wgmma::fence_proxy_async_shared();  // the writes, visible to the TMA's reads
    __syncwarp();
    if (lane == 0) {
      const int32_t col = item.n0 + 32 * chunk, row = static_cast<int32_t>(m_first);
      if constexpr (kAccumulate) {
        tma::reduce_add_3d(&p.out, staging, col, row, item.expert);
      } else {
        tma::store_3d(&p.out, staging, col, row, item.expert);
      }
      tma::commit_stores();
    }
  }
}

// The producer thread: every k-block of the CTA's items into the ring; its a tile, and b rows 128 rank .. 128 rank +
// 127 of the item's b tile into every CTA of the cluster.
__device__ void produce(const KernelParams& p, const int32_t* ends, int64_t tiles_m, int64_t tiles_n, int64_t items,
                        int64_t first_item, int64_t item_step, int rank, uint32_t ring, uint32_t full_bars,
                        uint32_t empty_bars) {
  tma::prefetch_map(&p.a);
  tma::prefetch_map(&p.b);
  uint32_t flat = 0;  // k-blocks issued so far (ring slot flat % kStages, pass flat / kStages)
  for (int64_t index = first_item; index < items; index += item_step) {
    const Item item = locate(p.args, ends, tiles_m, tiles_n, index, rank);
    for (int kb = 0; kb < item.nk; ++kb, ++flat) {
      const uint32_t s = flat % kStages;
      // every consumer warp of the cluster released the slot's previous k-block (this CTA's loads write into all)
      tma::wait(empty_bars + 8 * s, ((flat / kStages) & 1) ^ 1);
      const uint32_t slot = ring + s * kStageBytes;
      const uint32_t full = full_bars + 8 * s;
      const int32_t k0 = item.first_k + kb * kBlockK;
      tma::arrive_expect_bytes(full, kStageBytes);  // (the peer's half of b counts on this barrier too)
      tma::load_2d(slot, &p.a, full, k0, item.m0);
      tma::load_2d_multicast(slot + kTileABytes + rank * kHalfBBytes, &p.b, full, k0, item.n0 + 128 * rank,
                             static_cast<uint16_t>((1u << kCluster) - 1));
    }
  }
}

// A consumer warp's release of a ring slot: to the producer of every CTA of the cluster.
__device__ __forceinline__ void release(uint32_t empty_bar) {
#pragma unroll
  for (int cta = 0; cta < kCluster; ++cta) tma::arrive_in_cta(empty_bar, cta);
}
#endif  // EP_COMM_HAS_WGMMA

template <bool kAccumulate>
__global__ void __launch_bounds__(kThreads, 1) grouped_wgrad_bf16_kernel(const __grid_constant__ KernelParams p) {
#if EP_COMM_HAS_WGMMA
  const GroupedWgradArgs& args = p.args;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t ring = base + ((1024 - (base & 1023)) & 1023);  // (the same offset in both CTAs of a cluster)
  const uint32_t zeros = ring + kStages * kStageBytes;  // (1024-aligned)
  const uint32_t staging = zeros + kZeroBytes;  // (1024-aligned: the TMA store's swizzle needs it)
  const uint32_t full_bars = staging + kStagingBytes;
  const uint32_t empty_bars = full_bars + kStages * 8;
  int32_t* cached_ends = reinterpret_cast<int32_t*>(smem_raw + (empty_bars + kStages * 8 - base));
  const int64_t tiles_m = (args.m_rows + kTileM * kCluster - 1) / (kTileM * kCluster);
  const int64_t tiles_n = (args.n_rows + kTileN - 1) / kTileN;
  const int64_t items = tiles_m * tiles_n * args.num_experts;
  const int rank = static_cast<int>(tma::cluster_rank());
  const int64_t first_item = blockIdx.x / kCluster, item_step = gridDim.x / kCluster;
  // The segment ends in shared memory: every role reads two per item, and from global memory that dependent round
  // trip stalled the MMA-issuing warps at every item start (first version).
  const bool cached = args.num_experts <= kCachedExperts;
  if (cached) {
    for (int e = threadIdx.x; e < args.num_experts; e += kThreads) cached_ends[e] = __ldg(args.group_ends + e);
  }
  for (int i = threadIdx.x; i < kZeroBytes / 16; i += kThreads) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(zeros + 16 * i), "r"(0u) : "memory");
  }
  wgmma::fence_proxy_async_shared();  // (the zeros, visible to wgmma; published by the cluster barrier below)
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::barrier_init(full_bars + 8 * s, 1);  // the producer's arrive_expect_bytes (+ the loads' bytes)
      // one arrival per consumer warp of every CTA of the cluster (each CTA's slot holds b rows its peer loaded)
      tma::barrier_init(empty_bars + 8 * s, kCluster * kConsumerThreads / 32);
    }
    tma::fence_barrier_init();
  }
  // The roles part here. The peer's barriers must be initialized before this CTA's loads and releases reach them.
  tma::cluster_sync();
  const int32_t* ends = cached ? cached_ends : args.group_ends;

  if (threadIdx.x < 128) {  // producer warpgroup: one thread issues everything, the rest have nothing to do
    if (threadIdx.x == 0) {
      produce(p, ends, tiles_m, tiles_n, items, first_item, item_step, rank, ring, full_bars, empty_bars);
    }
    __syncwarp();
    tma::cluster_sync();  // (no CTA exits while its peer may still load into it or arrive on its barriers)
    return;
  }

  const int consumer_thread = threadIdx.x - 128;
  const int warpgroup = consumer_thread / 128;
  const int warp = (consumer_thread % 128) / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t warp_staging = staging + (consumer_thread / 32) * kStagingBytesPerWarp;
  if (lane == 0) tma::prefetch_map(&p.out);
  // A descriptor of the zeros with stride 0 between 8-row groups: every group reads the same 1 KiB, so it is an
  // all-zero operand of any height. The k16 steps past a segment's end multiply it instead of the slot's columns
  // (which may hold the next segment's values, or NaN): a select, not a branch around the wgmma (ptxas serializes
  // every wgmma of a kernel that issues one under a condition it cannot prove uniform).
  const uint64_t zero_desc = wgmma::make_descriptor_sw128(zeros) & ~(uint64_t{0x3FFF} << 32);
  uint32_t flat = 0;
  float acc[128];
  for (int64_t index = first_item; index < items; index += item_step) {
    const Item item = locate(args, ends, tiles_m, tiles_n, index, rank);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < item.nk; ++kb, ++flat) {
      const uint32_t s = flat % kStages;
      const uint32_t slot = ring + s * kStageBytes;
      tma::wait(full_bars + 8 * s, (flat / kStages) & 1);
      const int64_t k0 = item.first_k + static_cast<int64_t>(kb) * kBlockK;
      // k16 steps with columns in the segment (all four but in a segment's last k-block); the columns outside it are
      // zeroed only where a boundary falls inside a step (segments whose ends are not multiples of 16).
      const int64_t valid = item.seg_end - k0 < kBlockK ? item.seg_end - k0 : kBlockK;
      const int steps = static_cast<int>((valid + 15) / 16);
      if (k0 < item.seg_begin || valid % 16 != 0) {  // (uniform across the consumers)
        zero_outside_segment(slot, k0, item.seg_begin, item.seg_end, consumer_thread);
        wgmma::fence_proxy_async_shared();  // the zeros, visible to wgmma's async proxy
        tma::named_barrier(1, kConsumerThreads);
      }
      const uint64_t desc_a = wgmma::make_descriptor_sw128(slot + warpgroup * 64 * kRowBytes);
      const uint64_t desc_b = wgmma::make_descriptor_sw128(slot + kTileABytes);
      wgmma::fence_operand(acc);
      wgmma::fence();
#pragma unroll
      for (int k16 = 0; k16 < kBlockK / 16; ++k16) {  // k16 step: 32 B further, + 2 in the start field (address >> 4)
        wgmma::mma_ss_bf16_n256(acc, k16 < steps ? desc_a + 2 * k16 : zero_desc,
                                k16 < steps ? desc_b + 2 * k16 : zero_desc);
      }
      wgmma::commit_group();
      wgmma::fence_operand(acc);
      wgmma::wait_group<1>();  // the previous k-block's wgmma has retired: its slot goes back to the producers
      if (kb > 0 && lane == 0) release(empty_bars + 8 * ((flat - 1) % kStages));
    }
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
    if (item.nk > 0 && lane == 0) release(empty_bars + 8 * ((flat - 1) % kStages));
    store_accumulators<kAccumulate>(acc, p, item, item.m0 + warpgroup * 64 + 16 * warp, lane, warp_staging);
  }
  if (lane == 0) tma::wait_stores();  // (the last stores complete before the CTA exits)
  tma::cluster_sync();
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses such devices
#endif
}

// A K-major bf16 operand [rows, k_total] (row stride ld elements) in boxes of 64 x 128, 128-byte swizzle.
bool encode_operand(EncodeTiled encode, CUtensorMap* map, const uint16_t* data, int64_t rows, int64_t ld,
                    int64_t k_total) {
  static_assert(kBlockK == 64, "boxes of 64 k: encode_k_major_operand");
  return encode_k_major_operand(encode, map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, data, rows, ld, k_total, 128);
}

// The output [num_experts, m_rows, n_rows] fp32 in boxes of 32 x 16 x 1 (one warp's staged chunk), 128-byte swizzle:
// the staging's own layout. Rows and columns past the tensor are not written.
bool encode_output(EncodeTiled encode, CUtensorMap* map, const GroupedWgradArgs& args) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(args.n_rows), static_cast<cuuint64_t>(args.m_rows),
                              static_cast<cuuint64_t>(args.num_experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(args.n_rows) * 4,
                                 static_cast<cuuint64_t>(args.m_rows) * args.n_rows * 4};
  const cuuint32_t box[3] = {32, 16, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, args.out, dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t launch_grouped_wgrad_bf16(const GroupedWgradArgs& args, cudaStream_t stream) {
  constexpr int64_t kMaxCoordinate = 0x7FFFFFFF;  // TMA coordinates are int32
  // (a tile's start, locate()'s m0 / n0, can lie up to a cluster's m rows / a tile's n columns past the last row)
  if (args.num_experts < 0 || args.m_rows < 0 || args.n_rows < 0 || args.k_total < 0 || args.m_rows % 8 != 0 ||
      args.n_rows % 8 != 0 || args.lda < args.k_total || args.ldb < args.k_total || args.lda % 8 != 0 ||
      args.ldb % 8 != 0 || args.m_rows > kMaxCoordinate - kCluster * kTileM ||
      args.n_rows > kMaxCoordinate - kTileN || args.k_total > kMaxCoordinate - kBlockK) {
    return cudaErrorInvalidValue;
  }
  const int64_t cluster_items = ceil_div(args.m_rows, kTileM * kCluster) * ceil_div(args.n_rows, kTileN) *
                                args.num_experts;
  if (cluster_items == 0) return cudaSuccess;
  if (args.out == nullptr || args.group_ends == nullptr || !rows_aligned(args.out, 0, 16) ||
      (args.k_total > 0 && (args.a == nullptr || args.b == nullptr || !rows_aligned(args.a, 0, 16) ||
                            !rows_aligned(args.b, 0, 16)))) {
    return cudaErrorInvalidValue;
  }
  if (!device_is_sm90()) return cudaErrorNotSupported;
  if (args.k_total == 0) {  // every segment empty (and no tensor map has zero columns): zeros, or nothing to add
    if (args.accumulate) return cudaSuccess;
    return cudaMemsetAsync(args.out, 0, static_cast<size_t>(args.num_experts) * args.m_rows * args.n_rows *
                                            sizeof(float), stream);
  }
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  KernelParams params{};
  params.args = args;
  if (!encode_operand(encode, &params.a, args.a, args.m_rows, args.lda, args.k_total) ||
      !encode_operand(encode, &params.b, args.b, args.n_rows, args.ldb, args.k_total) ||
      !encode_output(encode, &params.out, args)) {
    return cudaErrorInvalidValue;
  }
  const auto kernel = args.accumulate ? grouped_wgrad_bf16_kernel<true> : grouped_wgrad_bf16_kernel<false>;
  static std::atomic<uint64_t> configured[2] = {0, 0};
  cudaError_t status = once_per_device(configured[args.accumulate ? 1 : 0], [kernel] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  });
  if (status != cudaSuccess) return status;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kCluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kCluster);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  // Persistent: one cluster per cluster item, at most as many as fit on the GPU at once.
  int resident_clusters = 0;
  status = cudaOccupancyMaxActiveClusters(&resident_clusters, kernel, &config);
  if (status != cudaSuccess) return status;
  if (resident_clusters < 1) return cudaErrorInvalidConfiguration;
  const int64_t clusters = cluster_items < resident_clusters ? cluster_items : resident_clusters;
  config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace ep_comm
