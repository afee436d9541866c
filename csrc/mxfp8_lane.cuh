// MXFP8 (nearest) pieces for kernels that hold an aligned block of 32 in two lanes, 16 elements each (lanes 2i and
// 2i + 1): the NVLink combine's MXFP8 rows. The same bits as the MXFP8 quantize and dequantize kernels (mxfp8.cu) and
// the serial rules of docs/NUMERICS.md "MXFP8": the scale and codes come from the functions mxfp8_encode32_nearest is
// built from, the decode is mxfp8_dequantize_kernel's. Device code.
#pragma once

#include <cstdint>

#include "quant_math.cuh"

namespace ep_comm {
namespace mxfp8_lane {

// The E4M3 codes of the lane's 16 values (element k in byte k) and, in *scale, the block's UE8M0 byte (both lanes of
// the block get it). The block amax is max(0, |x_0|, ..., |x_31|) with NaN ignored, as block_amax32: fmaxf is exact
// and order-free, so the lane's max and one exchange with lane ^ 1 give the serial value. Every lane of the warp must
// call this (full-mask shuffle).
__device__ __forceinline__ uint4 quantize_lane16(const float v[16], uint8_t* scale) {
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) amax = qm::qm_max(amax, qm::qm_abs(v[k]));
  amax = qm::qm_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  float p;
  *scale = qm::mxfp8_nearest_scale(amax, &p);
  uint32_t words[4];
  qm::mxfp8_encode_words_nearest<4>(v, p, words);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// The 16 values of a lane's codes (byte k = element k) under the block's scale byte (qm::mxfp8_decode_words, the
// mxfp8_dequantize kernel's decode).
__device__ __forceinline__ void decode_lane16(const uint4& codes, uint8_t scale, float v[16]) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  qm::mxfp8_decode_words<4>(words, scale, v);
}

}  // namespace mxfp8_lane
}  // namespace ep_comm
