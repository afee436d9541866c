// The serial RHT-32 of one aligned chunk and BF16 round to nearest even (quant_math.cuh).
#pragma once

#include "qm_arith.cuh"

namespace ep_comm {
namespace qm {

// RHT-32 (NUMERICS "RHT-32"): serial form on one aligned chunk of 32 values held by one thread.
QM_HD float rht_sign(float v, uint32_t sign_mask, int j) {
  return bits_float(float_bits(v) ^ (((sign_mask >> j) & 1u) << 31));
}

// Unnormalized FWHT, pairs (j, j + h) with (j & h) == 0 get (v_j + v_{j+h}, v_j - v_{j+h}).
template <int N>
QM_HD void fwht_serial(float v[N]) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if ((j & h) == 0) {
        const float a = v[j];
        const float b = v[j + h];
        v[j] = qm_add(a, b);
        v[j + h] = qm_sub(a, b);
      }
    }
  }
}

QM_HD void rht32_forward(float v[32], uint32_t sign_mask) {
  const float c = bits_float(kRhtScaleBits);
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = rht_sign(v[j], sign_mask, j);
  fwht_serial<32>(v);
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = qm_mul(v[j], c);
}

QM_HD void rht32_inverse(float v[32], uint32_t sign_mask) {
  const float c = bits_float(kRhtScaleBits);
  fwht_serial<32>(v);
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = rht_sign(qm_mul(v[j], c), sign_mask, j);
}

// ---------------------------------------------------------------------------------------------------
// BF16 round to nearest even (NaN -> 0x7FC0 like torch on the CPU; the GPU's cvt gives another NaN).
QM_HD uint16_t bf16_bits_rn(float v) {
  const uint32_t bits = float_bits(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace qm
}  // namespace ep_comm
