// The base of the scalar quantization primitives (quant_math.cuh): bit casts and correctly rounded fp32
// arithmetic, the host/device function macro, the Blackwell-native conversion switches and shared constants.
//
// Arithmetic rules:
//  * every fp32 operation goes through qm_mul / qm_add / qm_sub / qm_div: on the device these are the
//    __f*_rn intrinsics, which the compiler never contracts into FMAs and never flushes to zero; on the
//    host they are plain operators in separate inline functions. The host build must not contract either:
//    the C++ sources are compiled with -ffp-contract=off (setup.py: in C++ GCC contracts by default, also with
//    -std=c++17, wherever the target has FMA instructions) for baseline x86-64 (no FMA instructions);
//    host_exhaustive_check "no_contraction" probes it. NUMERICS.md wants no subnormal flushing: no fast math, no FTZ.
//    Deliberate FMAs (qm_fma: the exact division of the 4/6 error, and the error terms of the fast 4/6 path)
//    are explicit on both sides.
//  * Roundings to an integer use the "add and subtract 1.5 * 2^23" trick: an fp32 add rounds to nearest
//    even, so (t + 12582912) - 12582912 is RNE(t) for |t| < 2^22, identically on host and device.
//  * Faster forms of a rule (e2m1_round_magnitude, e2m1_round_scaled, div_six_m_markstein) are checked against the
//    rule over every fp32 input, e2m1_pack8_scaled for every code in every position beside varied neighbours
//    (host_exhaustive_check, tests/test_formats_host.py).
//
// Blackwell-native conversions (sm_100a/sm_103a) sit behind EP_COMM_SM100_NATIVE and give the same bits as
// the software forms (the software forms are the definition): e2m1x2 always; ue8m0x2 only with
// EP_COMM_NATIVE_UE8M0 (its handling of subnormal inputs was not observed); s2f6x2 only with
// EP_COMM_NATIVE_S2F6 and CUDA >= 13.1. Define EP_COMM_NO_NATIVE_CVT to force the software forms everywhere
// (useful when validating a new GPU generation against the host emulation).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define QM_HD __host__ __device__ __forceinline__
#else
#define QM_HD inline
#endif

// sm_100a/sm_103a with the arch-specific feature set: e2m1x2 / ue8m0x2 conversions exist in hardware.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && defined(__CUDA_ARCH_FEAT_SM100_ALL) && \
    !defined(EP_COMM_NO_NATIVE_CVT)
#define EP_COMM_SM100_NATIVE 1
#endif
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1030) && defined(__CUDA_ARCH_FEAT_SM103_ALL) && \
    !defined(EP_COMM_NO_NATIVE_CVT)
#define EP_COMM_SM100_NATIVE 1
#endif
// cvt ... s2f6x2 needs PTX ISA 9.1, i.e. CUDA 13.1: nvcc 13.0 cannot assemble it, hence the version guard.
// Opt-in (EP_COMM_NATIVE_S2F6) because it has never run here: its saturation of -Inf (-2.0 = 0x80 or
// 0x81?) is undocumented (FORMATS-RESEARCH.md §8.3); every finite input gives s2f6_encode's bits.
#if defined(EP_COMM_SM100_NATIVE) && defined(EP_COMM_NATIVE_S2F6) && \
    (__CUDACC_VER_MAJOR__ > 13 || (__CUDACC_VER_MAJOR__ == 13 && __CUDACC_VER_MINOR__ >= 1))
#define EP_COMM_S2F6_NATIVE 1
#endif

namespace ep_comm {
namespace qm {

constexpr float kFltMax = 3.402823466e+38f;
constexpr float kRoundMagic = 12582912.0f;     // 1.5 * 2^23: (t + magic) - magic == RNE(t), |t| < 2^22
constexpr uint32_t kDefaultSignMask = 0x6A09E667u;
constexpr uint32_t kRhtScaleBits = 0x3E3504F3u;  // f(1/sqrt(32)) = 0.17677669f


// Bit casts and correctly rounded fp32 arithmetic.
QM_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

QM_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

QM_HD float qm_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QM_HD float qm_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QM_HD float qm_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
QM_HD float qm_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// |v| (clears the sign bit, NaN included); on the device fabsf folds into the consuming instruction.
QM_HD float qm_abs(float v) {
#if defined(__CUDA_ARCH__)
  return fabsf(v);
#else
  return bits_float(float_bits(v) & 0x7FFFFFFFu);
#endif
}
QM_HD bool qm_isnan(float v) { return (float_bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }
// min / max returning the non-NaN operand when one is NaN (quiet or signalling). The device's fminf/fmaxf
// (FMNMX) do exactly that; glibc's return NaN for a signalling NaN, hence the explicit host form.
QM_HD float qm_min(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return qm_isnan(a) ? b : (qm_isnan(b) ? a : (b < a ? b : a));
#endif
}
QM_HD float qm_max(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return qm_isnan(a) ? b : (qm_isnan(b) ? a : (b > a ? b : a));
#endif
}
// Round to the nearest integer, ties to even, for |t| < 2^22 (exact: one fp32 add, one fp32 subtract).
QM_HD float qm_rint_small(float t) { return qm_sub(qm_add(t, kRoundMagic), kRoundMagic); }

// 2^e as an fp32 value for e in [-149, 127] (subnormal below -126). Exact.
QM_HD float pow2f(int e) {
  return e >= -126 ? bits_float(static_cast<uint32_t>(e + 127) << 23) : bits_float(1u << (e + 149));
}

// A UE8M0 byte's value 2^(b - 127); 0xFF is NaN.
QM_HD float ue8m0_to_float(uint8_t b) {
  return b == 0xFF ? bits_float(0x7FC00000u) : pow2f(static_cast<int>(b) - 127);
}
// 2^(127 - b): the encode multiplier of a UE8M0 scale (2^-127 is subnormal); 0xFF gives NaN.
QM_HD float ue8m0_inverse(uint8_t b) {
  return b == 0xFF ? bits_float(0x7FC00000u) : pow2f(127 - static_cast<int>(b));
}
// ue8m0_inverse(b) for b <= 0xFE, branch-free: 2^(127 - b) is the normal number bits((254 - b) << 23) for b <= 253 and
// the subnormal 2^-127 = bits(0x400000) for b = 254 (all 255 bytes checked on the host).
QM_HD float ue8m0_inverse_finite(uint8_t b) {
  return bits_float(b < 0xFE ? (254u - b) << 23 : 0x400000u);
}

}  // namespace qm
}  // namespace ep_comm
