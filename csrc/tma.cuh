// PTX wrappers for Hopper's tensor memory accelerator (TMA) and the shared-memory barriers (mbarrier) that its
// loads complete on: tiled 2-D loads global -> shared (multicast to the CTAs of a cluster too), tiled 3-D stores and
// reduce-adds shared -> global in bulk groups, the barrier operations around the loads (remote arrivals, cluster
// barrier) and named CTA barriers for subsets of warps. sm_90+ device code only
// (callers guard with EP_COMM_HAS_WGMMA or their own __CUDA_ARCH__ test); the tensor maps are encoded on the host
// (cuTensorMapEncodeTiled) and passed as __grid_constant__ kernel parameters, whose generic address is `map`.
#pragma once

#include <cstdint>

#include "spin_wait.cuh"

namespace ep_comm {
namespace tma {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// After the initializing thread's inits, before the CTA barrier that publishes them: makes them visible to the async
// proxy (the TMA's complete_tx) too.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also raises the bytes the current phase waits for (the TMA loads issued next complete them).
__device__ __forceinline__ void arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts its phase "-1", parity 1, as
// completed: a producer's first wait on an empty slot passes). A barrier that never completes is a bug of the kernel
// that uses it (every arrival is the kernel's own): after 10 s this traps (the launch fails with an error) instead of
// hanging the GPU. No printf: a function call inside a wgmma loop makes ptxas serialize every wgmma of the kernel.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  if (try_wait(bar, parity)) return;
  const unsigned long long start = global_timer_ns();
  while (!try_wait(bar, parity)) {  // (try_wait itself suspends the thread for a while: no hot spin)
    if (global_timer_ns() - start > 10000000000ull) __trap();
  }
}

// The same wait without the timeout, for code in which a trap is not allowed: ptxas (CUDA 13.0) budgets a warp whose
// code after `setmaxnreg.inc` contains a trap at the launch's register count, not at the claimed one, and then spills
// and serializes every wgmma (C7512). The kernel that uses it must bound the wait elsewhere (grouped_gemm_ws.cu's
// consumers: their producer waits, with the timeout, until its consumers are done).
__device__ __forceinline__ void wait_untimed(uint32_t bar, uint32_t parity) {
  while (!try_wait(bar, parity)) {
  }
}

// Tile [c1 .. c1 + box1) x [c0 .. c0 + box0) of a 2-D tensor map (c0 innermost) into shared memory at dst, completing
// its bytes on `bar`. Elements outside the tensor are zero-filled (and counted).
__device__ __forceinline__ void load_2d(uint32_t dst, const void* map, uint32_t bar, int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
// The same tile into shared memory at the same offset dst in every CTA of the cluster in cta_mask (bit i: rank i),
// completing its bytes on the barrier at offset `bar` in each of them.
__device__ __forceinline__ void load_2d_multicast(uint32_t dst, const void* map, uint32_t bar, int32_t c0, int32_t c1,
                                                  uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
// `bytes` contiguous bytes (a multiple of 16; both addresses 16-byte aligned) from global memory into shared memory at
// dst, completing them on `bar` (a bulk copy, no tensor map: for operands stored in the order shared memory wants).
__device__ __forceinline__ void load_bytes(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// One plain arrival (release at CTA scope): publishes this thread's earlier shared-memory writes to the waiters.
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Tile [c2] x [c1 .. c1 + box1) x [c0 .. c0 + box0) of a 3-D tensor map from shared memory at src (laid out as the
// map's swizzle says) to global memory, in this thread's bulk group; elements outside the tensor are not written. The
// writing threads make src visible to the async proxy first (fence.proxy.async.shared::cta).
__device__ __forceinline__ void store_3d(const void* map, uint32_t src, int32_t c0, int32_t c1, int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// The same tile added into global memory (element-wise reduce-add of the map's type, performed in L2; elements outside
// the tensor untouched), in this thread's bulk group.
__device__ __forceinline__ void reduce_add_3d(const void* map, uint32_t src, int32_t c0, int32_t c1, int32_t c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// Closes this thread's bulk group of the stores issued since the last commit.
__device__ __forceinline__ void commit_stores() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until every committed bulk store of this thread has read its shared-memory source (it may be rewritten).
__device__ __forceinline__ void wait_store_reads() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until every committed bulk store of this thread has completed (its writes are done).
__device__ __forceinline__ void wait_stores() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// One arrival on the barrier at offset `bar` in the shared memory of cluster CTA `cta_rank`. The default semantics
// (release at CTA scope): what it publishes is that wgmma reads this thread waited for are done, not data. With
// .release.cluster every arrival waited on a memory barrier (ncu: 5.4 membar stall cycles per issued instruction,
// the cluster kernel 1.5x slower than without clusters).
__device__ __forceinline__ void arrive_in_cta(uint32_t bar, uint32_t cta_rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta_rank)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every thread of every CTA of the cluster (release / acquire at cluster scope): after barrier inits, before exit.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
// CTA barrier `id` (1..15; 0 is __syncthreads') among `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif

}  // namespace tma
}  // namespace ep_comm
