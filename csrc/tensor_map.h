// The driver's tensor-map encoder (cuTensorMapEncodeTiled), reached through the runtime's driver entry point so that
// the module needs no link against libcuda. Host code only; the TMA kernels (grouped_wgrad.cu, grouped_gemm_ws.cu)
// take the encoded maps as __grid_constant__ parameters.
#pragma once

#include <cuda.h>  // (CUtensorMap and its enums only)
#include <cstdint>
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

// A K-major operand of 2-byte elements (`dtype` fp16 or bf16) for wgmma: [rows, k] with a row stride of `ld`
// elements, in boxes of 64 k (128 bytes) x box_rows rows, 128-byte swizzle (the wgmma B / A shared-memory layout);
// rows past the tensor read as zeros. False when the driver refuses the map.
inline bool encode_k_major_operand(EncodeTiled encode, CUtensorMap* map, CUtensorMapDataType dtype, const void* data,
                                   int64_t rows, int64_t ld, int64_t k, uint32_t box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, dtype, 2, const_cast<void*>(data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace ep_comm
