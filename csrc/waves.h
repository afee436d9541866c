// Waves: the NVLink dispatch receive hands the w1 grouped GEMM its rows expert by expert while it still runs.
//
// The receive (producer, nvlink_dispatch.cu) writes the GEMM's operand rows in expert-major order and counts the
// rows of each local expert as they land; the GEMM (consumer, grouped_gemm.cu) is launched right behind it as its
// programmatic dependent (PDL), so its CTAs take the SMs the receive leaves free and start each token tile as soon
// as that tile's expert is complete. The receive executes griddepcontrol.launch_dependents only once all of its
// blocks run (the dependent grid is released when every primary block has triggered), so waiting GEMM CTAs can
// never keep a receive block from running: no deadlock whatever the grid sizes. Each GEMM CTA ends with
// griddepcontrol.wait, so the GEMM completes only after the receive has: kernels launched after it keep plain stream
// order with both.
//
// Sync area (device memory, one per Buffer; u64 words; never reset, so no memset per call):
//   [0] layout ready: the receive stores the dispatch epoch (release) once expert_offsets / num_tokens_per_expert
//       are written and the work counter is zeroed;
//   [1] the GEMM's work counter (dynamic tile scheduling: CTAs that start late, on SMs the receive freed, simply
//       take fewer tiles);
//   [2 + j] rows of local expert j written in this call, tagged with the call: (epoch_lo32 << 32) | rows. The first
//       writer of a call replaces an older tag by a compare-and-swap, later writers add their rows.
// Torch-free; included by the NVLink receive and the grouped GEMM.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "spin_wait.cuh"
#endif

namespace ep_comm {

constexpr int kWaveLayoutReady = 0;
constexpr int kWaveWorkCounter = 1;
constexpr int kWaveRowsDone = 2;
// Stage code in the nvlink error word (after nvlink::Stage's 1..4): the GEMM waited too long for a wave's rows.
constexpr int kStageWaveWaitRows = 5;

struct WaveSync {
  const unsigned long long* epoch = nullptr;  // the dispatch's call number (stable while the receive and GEMM run)
  unsigned long long* area = nullptr;         // the sync area above; nullptr = no waves
  unsigned long long* error_word = nullptr;   // the Buffer's host-mapped error word (timeouts)
  unsigned int* abort = nullptr;              // the Buffer's abort flag: set on a timeout, later waits give up
  unsigned long long timeout_ns = 0;
};

#if defined(__CUDACC__)
namespace wave {

__device__ __forceinline__ void st_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The high word of a row counter: the call it counts for.
__device__ __forceinline__ unsigned long long call_tag(unsigned long long epoch) { return (epoch & 0xFFFFFFFFull) << 32; }

// `rows` more rows of local expert j are written (the caller's stores precede this call in its thread, or were made
// visible to it by __syncwarp / __syncthreads): release, then count.
__device__ __forceinline__ void count_rows(unsigned long long* area, int j, int rows, unsigned long long epoch) {
  __threadfence();
  unsigned long long* counter = area + kWaveRowsDone + j;
  const unsigned long long tag = call_tag(epoch);
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(counter);
  while ((seen & ~0xFFFFFFFFull) != tag) {  // an older call's count: the first writer of this call replaces it
    const unsigned long long previous = atomicCAS(counter, seen, tag | static_cast<unsigned long long>(rows));
    if (previous == seen) return;
    seen = previous;
  }
  atomicAdd(counter, static_cast<unsigned long long>(rows));
}

// Spin until done(*p) (acquire loads at GPU scope; spin_until: a timeout records stage 5 and `what` -- the local
// expert, or kErrorNoPeer for the layout -- in the Buffer's error word, never a hang).
template <typename Done>
__device__ __forceinline__ bool wait_until(const WaveSync& ws, const unsigned long long* p, Done done, int what) {
  return spin_until([p] { return ld_acquire_gpu(p); }, done, ws.abort, ws.error_word, ws.timeout_ns,
                    [&ws, what] { return timeout_error_word(kStageWaveWaitRows, what, *ws.epoch); });
}

// The layout of dispatch `epoch` is published (the word only grows).
__device__ __forceinline__ bool wait_layout(const WaveSync& ws, unsigned long long epoch) {
  return wait_until(ws, ws.area + kWaveLayoutReady, [epoch](unsigned long long v) { return v >= epoch; },
                    kErrorNoPeer);
}

// All `rows` rows of local expert j are in for dispatch `epoch`: the tag must be this call's exactly (an ordered
// compare of the whole word would let an older call's count pass once the 32-bit tag wraps).
__device__ __forceinline__ bool wait_rows(const WaveSync& ws, int j, unsigned long long epoch, int rows) {
  const unsigned long long tag = call_tag(epoch);
  return wait_until(ws, ws.area + kWaveRowsDone + j, [tag, rows](unsigned long long v) {
    return (v & ~0xFFFFFFFFull) == tag && (v & 0xFFFFFFFFull) >= static_cast<unsigned long long>(rows);
  }, j);
}

}  // namespace wave
#endif  // __CUDACC__

}  // namespace ep_comm
