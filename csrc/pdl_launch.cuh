// Kernel launch with the programmatic-stream-serialization attribute (programmatic dependent launch, sm_90):
// `allowed` lets the kernel start before its predecessor on the stream has finished -- the kernels then order
// themselves with griddepcontrol (nvlink.h pdl_prologue, waves.h); without it the launch is an ordinary one.
// Used by the NVLink kernels (EP_COMM_NVLINK_PDL) and by the grouped GEMM behind a wave receive. Host code only.
#pragma once

#if defined(__CUDACC__)
#include <cuda_runtime.h>

namespace ep_comm {

template <typename... KernelArgs, typename... Args>
cudaError_t launch_with_pdl(void (*kernel)(KernelArgs...), unsigned int grid, unsigned int block, size_t smem,
                            cudaStream_t stream, bool allowed, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = allowed ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace ep_comm
#endif  // __CUDACC__
