// Giving up towards the peers: a rank whose call raised before launching anything (inputs it rejected, e.g.) will never
// send that call's rows, so its peers, whose kernels for that call are already waiting on it, would wait until their
// timeout and then report a timeout that names no cause. Instead this rank sets every peer's abort word to
// kAbortByPeer | its rank (spin_wait.cuh): the peers' waits give up at once, their error word names this rank, and
// their host raises at its next check. One small kernel; the Buffer (Python) never launches another call afterwards.
#include <cuda_runtime.h>

#include "nvlink.h"

namespace ep_comm {
namespace nvlink {
namespace {

__global__ void give_up_kernel(NvlinkConfig cfg) {
  const unsigned int notice = kAbortByPeer | static_cast<unsigned int>(cfg.rank);
  for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) {
    if (p == cfg.rank) continue;
    unsigned int* word = reinterpret_cast<unsigned int*>(peer_ptr(cfg, p, cfg.off_abort));
    // Compare-and-swap from 0: a peer that already gave up on its own keeps its first reason.
    atomicCAS_system(word, 0u, notice);
  }
  __threadfence_system();
}

}  // namespace

void launch_give_up(const NvlinkConfig& cfg, uintptr_t stream) {
  give_up_kernel<<<1, 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(cfg);
  check_cuda(cudaGetLastError(), "give-up kernel launch");
}

}  // namespace nvlink
}  // namespace ep_comm
