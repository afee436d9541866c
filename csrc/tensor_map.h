// The driver's tensor-map encoder (cuTensorMapEncodeTiled), reached through the runtime's driver entry point so that
// the module needs no link against libcuda. Host code only; the TMA kernels (grouped_wgrad.cu, grouped_gemm.cu's
// warp-specialized form) take the encoded maps as __grid_constant__ parameters.
#pragma once

#include <cuda.h>  // (CUtensorMap and its enums only)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace ep_comm {

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

// Null when the driver lacks the entry point (the callers then report cudaErrorNotSupported).
inline EncodeTiled tensor_map_encoder() {
  static const EncodeTiled encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encoder;
}

}  // namespace ep_comm
