// Asynchronous global -> shared copies (cp.async, sm_80+) shared by the grouped GEMM and the S2F6
// dequantize-accumulate kernels. dst is a shared-space address (smem_address); src a generic pointer to global
// memory, passed as is (global and generic addresses coincide on sm_80+; the kernels' code was measured so).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep_comm {
namespace cp_async {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes through L2 only (.cg: data read once).
__device__ __forceinline__ void copy16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes of which the first src_bytes are read and the rest zero-filled (src_bytes = 0: 16 zero bytes).
__device__ __forceinline__ void copy16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4 bytes (.ca: the only cache mode for sizes below 16).
__device__ __forceinline__ void copy4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace cp_async
}  // namespace ep_comm
