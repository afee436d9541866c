// Bulk asynchronous global -> shared copies (cp.async.bulk: the TMA unit without a tensor map, sm_90+) whose
// completion is counted in bytes on a shared-memory mbarrier. One thread issues a whole row with one instruction and
// every thread waits on the barrier's phase, so a kernel can keep rows in flight without spending registers or issue
// slots on them (the staged NVFP4 quantizer, nvfp4.cu).
//
// Protocol per barrier and use: one arrival (arrive_expect_tx with the bytes of the copies that follow, 0 for none)
// completes the phase once those bytes have landed; waiters pass the phase parity, which flips with every use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep_comm {
namespace bulk {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier expecting `count` arrivals per phase. Make it visible to the async proxy (fence_barrier_init) and to
// the other threads (a CTA barrier) before the first copy or wait.
__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// This thread's arrival for the current phase, which then also waits for `bytes` of copy transactions.
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n"
      "}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

// `bytes` (a multiple of 16; src and dst 16-byte aligned) from global memory to this CTA's shared memory, counted on
// `bar`. src is a generic pointer to global memory (the same address on sm_90).
__device__ __forceinline__ void copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Returns once the barrier's phase with this parity has completed (try_wait suspends the thread for a while between
// polls, so waiting warps leave the issue slots to the others).
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

}  // namespace bulk
}  // namespace ep_comm
