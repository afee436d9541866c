// Shared-memory mbarriers (sm_90) for a producer/consumer handoff inside one CTA: init, arrive, and a wait on a
// phase's parity. A barrier counts `count` arrivals per phase; phase p is complete once they have all arrived, and a
// waiter for parity p & 1 returns once phase p is complete (callers never run more than one phase ahead of the
// waiters, so one parity bit is enough). Arrive has release and the wait acquire semantics at CTA scope.
#pragma once

#include <cstdint>

namespace ep_comm {
namespace mbarrier {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void init(uint32_t address, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(address), "r"(count) : "memory");
}
__device__ __forceinline__ void arrive(uint32_t address) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(address) : "memory");
}
// try_wait suspends the thread for a while if the phase is not complete yet; retried until it is.
__device__ __forceinline__ void wait_parity(uint32_t address, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(address), "r"(parity)
                 : "memory");
  } while (done == 0);
}
#endif

}  // namespace mbarrier
}  // namespace ep_comm
