// Scalar quantization primitives shared by every format kernel, the dispatch/combine kernels and the
// CPU emulation (formats_host.cpp). Each function implements one rule of docs/NUMERICS.md and must stay
// bit-identical to it, on the device and on the host alike.
//
// Arithmetic rules:
//  * every fp32 operation goes through qm_mul / qm_add / qm_sub / qm_div: on the device these are the
//    __f*_rn intrinsics, which the compiler never contracts into FMAs and never flushes to zero; on the
//    host they are plain operators in separate inline functions. The host build must not contract either:
//    formats_host.cpp is compiled with -std=c++17 (ISO mode: GCC defaults to -ffp-contract=off) for
//    baseline x86-64 (no FMA instructions). NUMERICS.md wants no subnormal flushing: no fast math, no FTZ.
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

// ---------------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------------
// E2M1 (FP4): code = s e1 e0 m, values {0, .5, 1, 1.5, 2, 3, 4, 6}.
QM_HD uint8_t e2m1_encode_soft(float v) {
  const float a = qm_abs(v);
  if (qm_isnan(v)) return 0x7;
  // NUMERICS thresholds: ties at 0.25, 1.25, 2.5, 5 round down (to the even code), at 0.75, 1.75, 3.5 up.
  const uint32_t mag = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
                       static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
                       static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
                       static_cast<uint32_t>(a > 5.0f);
  return static_cast<uint8_t>(mag | ((float_bits(v) >> 28) & 0x8u));
}

// Two E2M1 codes in one byte: `lo` (lower element index) in bits 3:0, `hi` in bits 7:4.
QM_HD uint8_t e2m1x2_encode(float lo, float hi) {
#if defined(EP_COMM_SM100_NATIVE)
  // PTX: the first source goes to d[7:4], the second to d[3:0].
  uint32_t out;
  asm("{\n\t.reg .b8 byte0;\n\tcvt.rn.satfinite.e2m1x2.f32 byte0, %1, %2;\n\tcvt.u32.u8 %0, byte0;\n\t}"
      : "=r"(out)
      : "f"(hi), "f"(lo));
  return static_cast<uint8_t>(out);
#else
  return static_cast<uint8_t>(e2m1_encode_soft(lo) | (e2m1_encode_soft(hi) << 4));
#endif
}

QM_HD uint8_t e2m1_encode(float v) {
#if defined(EP_COMM_SM100_NATIVE)
  return static_cast<uint8_t>(e2m1x2_encode(v, 0.0f) & 0xF);
#else
  return e2m1_encode_soft(v);
#endif
}

// Magnitude bits of an E2M1 code as fp32: 0 -> 0, 1 -> 0.5 (0x3F000000), c >= 2 -> (c + 252) << 22.
QM_HD float e2m1_decode(uint8_t code) {
  const uint32_t c = code & 0x7u;
  const uint32_t mag = c == 0 ? 0u : (c + 251u + (c >= 2 ? 1u : 0u)) << 22;
  return bits_float(mag | ((static_cast<uint32_t>(code) & 0x8u) << 28));
}

// The 8 E2M1 codes of a 32-bit word of packed NVFP4 codes (low nibble first), each times `scale`, into y[0..7]:
// the per-code decode of the NVFP4 dequantize kernel and of the wave dispatch receive (integer ops and one FMUL per
// value).
QM_HD void e2m1x8_decode_scaled(uint32_t word, float scale, float* y) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t byte = (word >> (8 * i)) & 0xFFu;
    y[2 * i] = qm_mul(e2m1_decode(static_cast<uint8_t>(byte & 0xF)), scale);
    y[2 * i + 1] = qm_mul(e2m1_decode(static_cast<uint8_t>(byte >> 4)), scale);
  }
}

// ---------------------------------------------------------------------------------------------------
// E4M3 (FN): clamp to [-448, 448], RNE (subnormals included), NaN -> 0x7F (whatever the NaN's sign).
QM_HD uint8_t e4m3_encode_soft(float v) {
  const uint32_t bits = float_bits(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return 0x7F;
  if (abs_bits > 0x43E00000u) abs_bits = 0x43E00000u;  // 448, satfinite (Inf included)
  uint32_t code;
  if (abs_bits < 0x3C800000u) {
    // |v| < 2^-6: subnormal E4M3, value m * 2^-9; m = RNE(|v| * 2^9) in [0, 8] (8 = the min normal 0x08).
    const float scaled = qm_mul(bits_float(abs_bits), 512.0f);  // exact: a power-of-two scale-up
    code = static_cast<uint32_t>(qm_rint_small(scaled));
  } else {
    // Normal: keep 3 mantissa bits with RNE on the 20 dropped bits; a carry bumps the exponent, which is
    // exactly right. E4M3 exponent = fp32 exponent - 120.
    const uint32_t rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
    code = (rounded >> 20) - (120u << 3);
  }
  return static_cast<uint8_t>(code | sign);
}

// Two E4M3 bytes: `lo` in bits 7:0, `hi` in bits 15:8 (memory order lo, hi). The hardware form maps a NaN
// produced by device arithmetic (always the canonical +NaN) to 0x7F; callers never pass raw input NaNs.
QM_HD uint16_t e4m3x2_encode(float lo, float hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  uint16_t out;
  // PTX: the first source goes to d[15:8], the second to d[7:0].
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
#else
  return static_cast<uint16_t>(e4m3_encode_soft(lo) | (e4m3_encode_soft(hi) << 8));
#endif
}

QM_HD uint8_t e4m3_encode(float v) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  return static_cast<uint8_t>(e4m3x2_encode(v, 0.0f) & 0xFF);
#else
  return e4m3_encode_soft(v);
#endif
}

QM_HD float e4m3_decode_soft(uint8_t b) {
  const uint32_t sign = (static_cast<uint32_t>(b) & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu;
  const uint32_t m = b & 0x7u;
  if (e == 15 && m == 7) return bits_float(0x7FC00000u | sign);
  if (e == 0) return bits_float(float_bits(qm_mul(static_cast<float>(m), 0.001953125f)) | sign);  // m * 2^-9
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

// Two E4M3 bytes (lo in bits 7:0) to fp32. Every E4M3 value is exact in fp16, so the sm_89+ hardware path
// (e4m3x2 -> f16x2 -> f32) gives the same values as the software decode; NaN stays NaN.
QM_HD void e4m3x2_decode(uint16_t pair, float& lo, float& hi);

// One E4M3 byte: the hardware pair decode on sm_89+ (three instructions instead of a branchy bit assembly with
// an int-to-float conversion for subnormals; same values, NaN stays NaN), else the software rule.
QM_HD float e4m3_decode(uint8_t b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  float lo, hi;
  e4m3x2_decode(b, lo, hi);
  return lo;
#else
  return e4m3_decode_soft(b);
#endif
}

// The grouped GEMM's inexact FP8 operand values of 8 NVFP4 elements (one code word; scale = fp8_operand_scale of the
// block's E4M3 scale byte, decoded once per block): pairs[k] = the E4M3 bytes (RNE, saturating: e4m3x2_encode) of
// e2m1 * scale * 2^-3 (exact in fp32 before the rounding) of elements 2k (low byte) and 2k + 1. The FP8 expansion, the
// quantizer's FP8 form (nvfp4.cu) and the wave receive's FP8 rows (nvlink_dispatch.cu) build their column-permuted
// blocks (grouped_gemm.py FP8_COLUMN_ORDER) from these, so they give the same bits.
QM_HD float fp8_operand_scale(uint8_t scale_byte) {
  return qm_mul(e4m3_decode(scale_byte), 0.125f);  // 2^-3: a power of two, exact
}
QM_HD void fp8_operand_pairs8(uint32_t code_word, float scale, uint32_t pairs[4]) {
  float y[8];
  e2m1x8_decode_scaled(code_word, scale, y);
#pragma unroll
  for (int k = 0; k < 4; ++k) pairs[k] = e4m3x2_encode(y[2 * k], y[2 * k + 1]);
}

QM_HD void e4m3x2_decode(uint16_t pair, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  float f_lo, f_hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f_lo) : "h"(static_cast<uint16_t>(halves & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f_hi) : "h"(static_cast<uint16_t>(halves >> 16)));
  lo = f_lo;
  hi = f_hi;
#else
  lo = e4m3_decode_soft(static_cast<uint8_t>(pair & 0xFF));
  hi = e4m3_decode_soft(static_cast<uint8_t>(pair >> 8));
#endif
}

// e4m3x2_decode of half kHalf (0: bits 15:0, 1: bits 31:16) of `pairs`; on the device the half is taken as a register
// half (no shift instruction). Exact.
template <int kHalf>
QM_HD void e4m3x2_decode_half(uint32_t pairs, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  uint32_t halves;
  if (kHalf == 0) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(halves) : "r"(pairs));
  } else {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, h;\n\t}" : "=r"(halves) : "r"(pairs));
  }
  float f_lo, f_hi;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(f_lo), "=f"(f_hi) : "r"(halves));
  lo = f_lo;
  hi = f_hi;
#else
  e4m3x2_decode(static_cast<uint16_t>(pairs >> (16 * kHalf)), lo, hi);
#endif
}

// ---------------------------------------------------------------------------------------------------
// UE8M0 scales.
// MXFP8 (NVIDIA rule): b = round-up-to-power-of-two(f(amax * f(1/448))), satfinite; NaN -> 0xFF.
QM_HD uint8_t ue8m0_rp_encode_soft(float t) {
  const uint32_t bits = float_bits(t) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0xFF;
  const uint32_t e = bits >> 23;
  const uint32_t m = bits & 0x7FFFFFu;
  uint32_t b = e >= 1 ? e + (m != 0 ? 1u : 0u) : (m > 0x400000u ? 1u : 0u);
  return static_cast<uint8_t>(b > 0xFEu ? 0xFEu : b);
}

QM_HD uint8_t ue8m0_mxfp8_scale(float amax) {
  const float t = qm_mul(amax, 1.0f / 448.0f);  // f(1/448) = 0x3B124925, folded at compile time
#if defined(EP_COMM_SM100_NATIVE) && defined(EP_COMM_NATIVE_UE8M0)
  // Opt-in: the hardware's handling of subnormal t (amax < ~5e-36) was not observed; the software form
  // is the definition.
  uint16_t out;
  asm("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.0f), "f"(t));
  return static_cast<uint8_t>(out & 0xFF);
#else
  return ue8m0_rp_encode_soft(t);
#endif
}

// S2F6: smallest e with amax / 2^e <= 127/64: b = exponent + (mantissa > 0x7E0000), clamp 0xFE; 0 -> 0.
QM_HD uint8_t ue8m0_s2f6_scale(float amax) {
  const uint32_t bits = float_bits(amax) & 0x7FFFFFFFu;
  const uint32_t b = (bits >> 23) + ((bits & 0x7FFFFFu) > 0x7E0000u ? 1u : 0u);
  return static_cast<uint8_t>(b > 0xFEu ? 0xFEu : b);
}

// ---------------------------------------------------------------------------------------------------
// S2F6: int8 value code * 2^-6 times the block scale 2^(b - 127).
// t = f(f(v * 2^(127 - b)) * 64); code = RNE(t) clamped to [-128, 127]; NaN -> 127.
QM_HD int8_t s2f6_encode_with_multiplier(float v, float scale_multiplier) {
  if (qm_isnan(v)) return 127;
  float t = qm_mul(qm_mul(v, scale_multiplier), 64.0f);
  t = qm_min(qm_max(t, -128.0f), 127.0f);  // clamp before rounding: the magic add needs |t| < 2^22
  return static_cast<int8_t>(static_cast<int>(qm_rint_small(t)));
}

QM_HD int8_t s2f6_encode(float v, uint8_t scale_byte) {
  return s2f6_encode_with_multiplier(v, ue8m0_inverse(scale_byte));
}

// S2F6 fast forms: the pieces of the kernels' packing (s2f6_lane.cuh pack_codes / pack_codes_rht16, where the
// proofs are) and, per value, the code they give. Valid for every value v of a block whose scale byte is `scale`
// (ue8m0_s2f6_scale(|v|) <= scale, or v NaN): then the low byte of the returned word is s2f6_encode(v, scale)
// (s2f6_rht_code_bits_fast: s2f6_encode(f(v * c), scale), c = f(1/sqrt(32))). exhaustive_check "s2f6_fast" checks
// both over fp32 bit patterns.
QM_HD float s2f6_fast_multiplier(uint8_t scale) {  // 2^(133 - b), a normal fp32 for 6 <= b <= 254
  return bits_float((260u - scale) << 23);
}
QM_HD float s2f6_rht_fast_multiplier(uint8_t scale) {  // c * 2^(133 - b), exact and normal for 9 <= b <= 253
  return bits_float(kRhtScaleBits + (static_cast<uint32_t>(133 - static_cast<int>(scale)) << 23));
}
// bits(f(t' + 1.5 * 2^23)), t' = t clamped to [-128, 127] (NaN -> 127): the low byte is RNE(t') as an int8.
QM_HD uint32_t s2f6_rounded_bits(float t) {
  t = qm_max(qm_min(t, 127.0f), -128.0f);
  return float_bits(qm_add(t, kRoundMagic));
}
// The same when t >= -127 is known (the block's own scale): only the upper clamp, which also maps NaN to 127.
QM_HD uint32_t s2f6_rounded_bits_upper(float t) { return float_bits(qm_add(qm_min(t, 127.0f), kRoundMagic)); }

QM_HD uint32_t s2f6_code_bits_fast(float v, uint8_t scale) {
  if (scale >= 6 && scale <= 253) return s2f6_rounded_bits_upper(qm_mul(v, s2f6_fast_multiplier(scale)));
  if (scale >= 6) return s2f6_rounded_bits(qm_mul(v, s2f6_fast_multiplier(scale)));
  return s2f6_rounded_bits(qm_mul(qm_mul(v, ue8m0_inverse(scale)), 64.0f));
}
QM_HD uint32_t s2f6_rht_code_bits_fast(float v, uint8_t scale) {
  if (scale >= 9 && scale <= 253) return s2f6_rounded_bits_upper(qm_mul(v, s2f6_rht_fast_multiplier(scale)));
  return s2f6_code_bits_fast(qm_mul(v, bits_float(kRhtScaleBits)), scale);
}

// Two S2F6 codes (lo in bits 7:0) with the block's scale byte and its encode multiplier 2^(127 - b).
// The native form (opt-in, CUDA >= 13.1, sm_100a family) divides by the scale inside the conversion: it can
// only differ from the two fp32 multiplies when v * 2^(127 - b) is subnormal, where both give code 0.
QM_HD uint16_t s2f6x2_encode(float lo, float hi, uint8_t scale_byte, float scale_multiplier) {
#if defined(EP_COMM_S2F6_NATIVE)
  uint16_t out;
  const uint16_t scale_pair = static_cast<uint16_t>(scale_byte * 0x0101u);
  // PTX 9.1: d[15:8] = S2F6(a / 2^(sf[15:8] - 127)), d[7:0] = S2F6(b / 2^(sf[7:0] - 127)).
  asm("cvt.rn.satfinite.scaled::n2::ue8m0.s2f6x2.f32 %0, %1, %2, %3;"
      : "=h"(out)
      : "f"(hi), "f"(lo), "h"(scale_pair));
  return out;
#else
  (void)scale_byte;
  return static_cast<uint16_t>(static_cast<uint8_t>(s2f6_encode_with_multiplier(lo, scale_multiplier)) |
                               (static_cast<uint8_t>(s2f6_encode_with_multiplier(hi, scale_multiplier)) << 8));
#endif
}

// code * 2^-6 * 2^(b - 127) = code * 2^(b - 133): both products of NUMERICS are exact, so one multiply by
// the (possibly subnormal) power of two gives the same bits. b = 0xFF decodes to NaN.
QM_HD float s2f6_decode_multiplier(uint8_t scale_byte) {
  return scale_byte == 0xFF ? bits_float(0x7FC00000u) : pow2f(static_cast<int>(scale_byte) - 133);
}
QM_HD float s2f6_decode(int8_t code, uint8_t scale_byte) {
  return qm_mul(static_cast<float>(code), s2f6_decode_multiplier(scale_byte));
}

// ---------------------------------------------------------------------------------------------------
// Counter-based random bits (NUMERICS "Random bits"): the murmur3 finalizer.
QM_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

QM_HD uint32_t sr_key(uint64_t seed) {
  return fmix32(static_cast<uint32_t>(seed) ^ 0x9E3779B9u) ^
         fmix32(static_cast<uint32_t>(seed >> 32) ^ 0x7F4A7C15u);
}

// The key of a seed given either by value or in device memory (seed_on_device non-null: read when the kernel runs,
// so that a CUDA-graph replay rounds with the seed written there before it, not the one of the capture).
QM_HD uint32_t sr_key_of(uint32_t key_of_value, const uint64_t* seed_on_device) {
  return seed_on_device != nullptr ? sr_key(*seed_on_device) : key_of_value;
}

// splitmix64's finalizer (ep_comm.training_experts._mix64): the seeds of the trainable experts' roundings are
// derived with it, on the device when they live there.
QM_HD uint64_t mix64(uint64_t value) {
  uint64_t z = value + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// SR needs 16 random bits per element, so one fmix32 word serves a pair of elements: pair p = index >> 1
// holds elements 2p (low half of the word) and 2p + 1 (high half). The pair's high word is hashed into the
// key first (pair_key), so that pairs 2^32 apart get unrelated words.
QM_HD uint32_t rbits_pair_key(uint32_t key, uint64_t pair) {
  return fmix32(static_cast<uint32_t>(pair >> 32) ^ key);
}
QM_HD uint32_t rbits_pair_word(uint32_t key, uint64_t pair) {
  return fmix32(static_cast<uint32_t>(pair) ^ rbits_pair_key(key, pair));
}
// The 16 random bits of element `index` (the definition; kernels use the per-block form below).
QM_HD uint32_t rbits(uint32_t key, uint64_t index) {
  return (rbits_pair_word(key, index >> 1) >> (16 * (index & 1))) & 0xFFFFu;
}

// The pair words of one MX block (elements base .. base + 31, base % 32 == 0): pairs p0 + j, j < 16, with
// p0 = base / 2 a multiple of 16; the work shared by the 16 pairs is done once. Exact: p0 + j has p0's high
// word (no carry) and the low word lo | j = lo ^ j (lo = low word of p0, a multiple of 16), so fmix32's input
// is h = (lo ^ pair_key) ^ j; since j < 2^16, h >> 16 = (lo ^ pair_key) >> 16, and fmix32's first step
// h ^ (h >> 16) is c ^ j with c = (lo ^ pair_key) ^ ((lo ^ pair_key) >> 16).
// fmix32's first multiply of the 16 words, (c ^ j) * K1 (K1 = 0x85EBCA6B), is shared too: XOR with a single bit 2^i
// adds d_i = (c ^ 2^i) - c (+2^i where c's bit i is 0, else -2^i), and the bits of j act independently, so
// c ^ j = c + sum of d_i over the bits i of j, exactly, as integers. For j = a + 4b (a, b < 4) that is
// c ^ j = (c ^ a) + (c ^ 4b) - c, and multiplication by K1 distributes modulo 2^32:
// (c ^ j) K1 = (c ^ a) K1 + (c ^ 4b) K1 - c K1 (mod 2^32). The block keeps lo[a] = (c ^ a) K1 and
// hi[b - 1] = (c ^ 4b) K1 (lo[3] and hi[2] themselves formed by the same identity), so a pair word's first
// multiply is one three-input add (none for a == 0 or b == 0) instead of an XOR and a multiply: 11 + 9 instead
// of 31 instructions per block on the GPU.
// Element base + 2j draws rbits_block_word(block, j) & 0xFFFF, element base + 2j + 1 draws the word >> 16.
// Checked against rbits itself by host_exhaustive_check ("sr_e4m3"), every j, many keys and bases.
struct RbitsBlock {
  uint32_t lo[4];  // (c ^ a) * K1, a = 0..3
  uint32_t hi[3];  // (c ^ 4b) * K1, b = 1..3
};
// rbits_block_keyed takes the block's pair key rbits_pair_key(key, base >> 1) from the caller (a kernel whose flat
// indices all lie below 2^33 has the one pair key rbits_pair_key(key, 0) for every block: computed once).
QM_HD RbitsBlock rbits_block_keyed(uint32_t pair_key, uint64_t base) {
  const uint64_t p0 = base >> 1;
  const uint32_t h = static_cast<uint32_t>(p0) ^ pair_key;
  const uint32_t c = h ^ (h >> 16);
  RbitsBlock block;
  block.lo[0] = c * 0x85EBCA6Bu;
  block.lo[1] = (c ^ 1u) * 0x85EBCA6Bu;
  block.lo[2] = (c ^ 2u) * 0x85EBCA6Bu;
  block.lo[3] = block.lo[1] + block.lo[2] - block.lo[0];  // (c ^ 3) K1
  block.hi[0] = (c ^ 4u) * 0x85EBCA6Bu;
  block.hi[1] = (c ^ 8u) * 0x85EBCA6Bu;
  block.hi[2] = block.hi[0] + block.hi[1] - block.lo[0];  // (c ^ 12) K1
  return block;
}
QM_HD RbitsBlock rbits_block(uint32_t key, uint64_t base) {
  return rbits_block_keyed(rbits_pair_key(key, base >> 1), base);
}
QM_HD uint32_t rbits_block_word(const RbitsBlock& block, uint32_t j) {
  const uint32_t a = j & 3u;
  const uint32_t b = (j >> 2) & 3u;
  // fmix32 of (low word ^ pair_key), after its first step and first multiply: (c ^ j) * K1
  uint32_t h = b == 0 ? block.lo[a] : (a == 0 ? block.hi[b - 1] : block.lo[a] + block.hi[b - 1] - block.lo[0]);
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Stochastic rounding of v onto the E4M3 grid with 16 random bits (the low 16 of r); returns the rounded
// fp32 value (exactly representable in E4M3, so e4m3_encode of it is exact). NaN stays NaN; |v| is
// clamped to 448 before the random bits are added, so SR never saturates into NaN.
// The definition (NUMERICS "MXFP8 / Stochastic"), used as is below 2^-6 (the E4M3 subnormal range):
QM_HD float sr_e4m3_definition(float v, uint32_t r) {
  if (qm_isnan(v)) return v;
  const float a = qm_min(qm_abs(v), 448.0f);
  // E = max(floor(log2 a), -6): the fp32 exponent for normal a; a < 2^-6 (incl. 0) uses the subnormal ulp.
  int exponent = static_cast<int>(float_bits(a) >> 23) - 127;
  if (exponent < -6) exponent = -6;
  const float ulp = pow2f(exponent - 3);
  const float t = qm_mul(a, pow2f(3 - exponent));  // a / ulp, exact (< 16)
  const float lo = static_cast<float>(static_cast<int>(t));  // floor: t >= 0
  const uint32_t frac16 = static_cast<uint32_t>(qm_mul(qm_sub(t, lo), 65536.0f));  // exact, < 65536
  const uint32_t round_up = (frac16 + (r & 0xFFFFu)) >= 65536u ? 1u : 0u;
  const float mag = qm_mul(qm_add(lo, static_cast<float>(round_up)), ulp);  // exact
  return bits_float(float_bits(mag) | (float_bits(v) & 0x80000000u));
}

// a + offset rounded toward zero, for offset = 0 (any a >= 0: exact, a itself) or offset = 2^-6 with
// a in [0, 2^-6) (the exact sum lies in [2^-6, 2^-5), whose ulp is 2^-29, so the result is
// 2^-6 + floor(a * 2^29) * 2^-29, i.e. the bits 0x3C800000 + floor(a * 2^29)). The device uses the IEEE
// round-toward-zero add; the host writes that value out (a * 2^29 < 2^23 is exact, the cast truncates).
QM_HD float add_offset_rz(float a, float offset) {
#if defined(__CUDA_ARCH__)
  return __fadd_rz(a, offset);
#else
  return offset == 0.0f ? a : bits_float(0x3C800000u + static_cast<uint32_t>(a * 536870912.0f));
#endif
}

// Same result as sr_e4m3_definition for every v and r, branch-free, on the integer pipes (no float<->int
// conversions, quarter-rate on the GPU). With a = min(|v|, 448):
//  * a in [2^-6, 448] (offset 0, w = bits(a)): t = a / ulp = 8 + m / 2^20 (m the fp32 mantissa), so lo and the
//    16 fraction bits D are bits 22..20 and 19..4 of a; ((w >> 4) + r16) >> 16 is (w >> 20) + (D + r16 >= 2^16),
//    and shifting it back by 20 adds one ulp (1 << 20) exactly when rounding up (a carry into the exponent is
//    the next binade's 8 * ulp, correct).
//  * a in [0, 2^-6) (E = -6, ulp = 2^-9): w = bits(2^-6 + floor(a 2^29) 2^-29) (add_offset_rz), so
//    w >> 4 = 0x03C80000 + floor(a 2^25) with floor(a 2^25) = lo * 2^16 + D (lo = floor(a 2^9)); the same
//    integer steps give bits(2^-6 + (lo + up) 2^-9), and subtracting 2^-6 is exact (Sterbenz): (lo + up) ulp.
//    a = 0 gives 0 (D = 0, lo = 0).
//  * NaN v returns v (the definition's NaN rule); +-Inf clamps to 448 like the definition.
// Checked against sr_e4m3_definition over fp32 bit patterns by host_exhaustive_check ("sr_e4m3").
// The kernels use it only for the rare blocks that sr_e4m3_fast cannot take (sr_fast_block_ok).
QM_HD float sr_e4m3(float v, uint32_t r) {
  const float a = qm_min(qm_abs(v), 448.0f);
  const float offset = a < 0x1p-6f ? 0x1p-6f : 0.0f;
  const uint32_t w = float_bits(add_offset_rz(a, offset));
  const uint32_t mag_bits = (((w >> 4) + (r & 0xFFFFu)) >> 16) << 20;
  const float mag = qm_sub(bits_float(mag_bits), offset);
  const float out = bits_float(float_bits(mag) | (float_bits(v) & 0x80000000u));
  return qm_isnan(v) ? v : out;
}

// f(a * b) rounded toward zero, for b a power of two (the only use: sr_e4m3_fast's scaling) and |a * b| <= FLT_MAX.
// The device uses the IEEE round-toward-zero multiply (no flush to zero); the host forms the exact product in
// double (a has 24 bits, b is a power of two >= 2^-149: no rounding, no underflow) and truncates it to the fp32
// grid: exact when it is a normal fp32 number, else floor(|a b| 2^149) units of 2^-149, with the sign.
QM_HD float mul_rz_pow2(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rz(a, b);
#else
  const double exact = static_cast<double>(a) * static_cast<double>(b);
  const double magnitude = exact < 0.0 ? -exact : exact;
  if (!(magnitude < 0x1p-126)) return static_cast<float>(exact);  // normal (or NaN): exact
  const uint32_t units = static_cast<uint32_t>(magnitude * 0x1p149);  // < 2^23, the cast truncates
  return bits_float(units | ((float_bits(a) ^ float_bits(b)) & 0x80000000u));
#endif
}

// The largest scale byte b whose SR multiplier q = 2^(7 - b) (below) is an fp32 number (2^-149).
constexpr int kSrFastMaxScale = 156;
// q = p * 2^-120 for p = ue8m0_inverse(b) = 2^(127 - b), b <= kSrFastMaxScale.
QM_HD float sr_fast_multiplier(uint8_t scale_byte) { return pow2f(7 - static_cast<int>(scale_byte)); }

// sr_e4m3_definition(f(x * p), r16) for p = 2^(127 - b) with b <= kSrFastMaxScale, q = sr_fast_multiplier(b),
// |f(x * p)| <= 448 (no NaN; the caller checks the block: sr_fast_block_ok) and r16 < 2^16. One round-toward-zero
// multiply, an add and a mask, one exact multiply; no clamp, no case for the E4M3 subnormal range:
// y = f_rz(x * q) is v * 2^-120 (v = f(x p)) in a domain where the E4M3 grid lines up with the fp32 format: the
// E4M3 minimum normal 2^-6 becomes the fp32 minimum normal 2^-126, and E4M3's subnormal step 2^-9 becomes 2^20
// units of fp32's subnormal step 2^-149. In bits w = bits(y), for a = |v| (the definition's lo, D, up, ulp):
//  * a >= 2^-6: y = v 2^-120 exactly (a normal product of a power of two; f(x q) and f(f(x p) 2^-120) agree as
//    both products are exact), so w has a's mantissa m: t = a / ulp = 8 + m / 2^20, lo = 8 + m[22:20], and
//    D = floor(frac(t) 2^16) = m[19:4]. The low 20 bits of w + (r16 << 4) are 16 (D + r16) + w[3:0] < 2^21, so
//    exactly one carry reaches bit 20 iff D + r16 >= 2^16 (the definition's round-up); bits 30..20 of w
//    (exponent and m[22:20]: lo * ulp) plus that carry are (lo + up) * ulp, a mantissa overflow stepping into
//    the next binade (16 ulp = 8 times its ulp), which is the correct value. The mask drops bits 19..0.
//  * a < 2^-6 (E = -6, ulp = 2^-9): y is an fp32 subnormal, w = floor(a 2^29) (the truncating multiply: the
//    exact a 2^-120 = (a 2^29) 2^-149); floor(a 2^29) = lo 2^20 + D 2^4 + (3 lower bits), as lo = floor(a 2^9)
//    and D = floor(frac(a 2^9) 2^16). The same carry argument gives w' = (lo + up) 2^20, the value
//    (lo + up) 2^-129, and (lo + up) = 8 gives 2^-126, the fp32 minimum normal, as it should (2^-6 after scaling
//    back). When f(x p) itself is below 2^-126 (then lo = D = 0 and the definition gives +-0) both |x q| and
//    |f(x p)| 2^-120 are below 2^-149: y = +-0, result +-0.
//  * Scaling back by 2^120 is exact (the result is 0 or in [2^-9, 448]). The magnitude bits stay below 2^31
//    (at most bits(448 * 2^-120) + 2^20), so the sign bit is x's, as the definition's copysign; +-0 stays +-0
//    (w + (r16 << 4) < w + 2^20). (lo + up) * ulp <= 448 since 448 is on the grid (a = 448 has D = 0).
// Checked against sr_e4m3_definition by host_exhaustive_check ("sr_e4m3") over fp32 bit patterns, several b.
QM_HD float sr_e4m3_fast(float x, float q, uint32_t r16) {
  const uint32_t w = float_bits(mul_rz_pow2(x, q));
  return qm_mul(bits_float((w + (r16 << 4)) & 0xFFF00000u), 0x1p120f);
}

// max(acc, |x|), NaN if either is NaN (the scale's amax ignores NaN; this one flags NaN blocks for the SR path).
QM_HD float qm_max_abs_nan(float acc, float x) {
#if defined(__CUDA_ARCH__)
  float out;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(out) : "f"(acc), "f"(fabsf(x)));  // FMNMX.NAN, |x| folded in
  return out;
#else
  return (qm_isnan(acc) || qm_isnan(x)) ? bits_float(0x7FC00000u) : qm_max(acc, qm_abs(x));
#endif
}
// Whether sr_e4m3_fast holds for every element of an MX block, from amax_nan = the qm_max_abs_nan of its |x|,
// its scale byte b and p = ue8m0_inverse(b): b <= kSrFastMaxScale and f(amax_nan * p) <= 448 (false for NaN and
// Inf; every f(|x| p) <= f(amax_nan p) since rounding is monotone). For finite blocks the second holds by the
// choice of b (f(1/448) > 1/448), for every finite amax but one (0x1.c00002p-119, where t = f(amax / 448) is
// subnormal and rounds down; checked by enumeration), so in practice only NaN / Inf blocks and blocks with amax
// above 448 * 2^29 take the general form.
QM_HD bool sr_fast_block_ok(float amax_nan, uint8_t scale_byte, float p) {
  return scale_byte <= kSrFastMaxScale && qm_mul(amax_nan, p) <= 448.0f;
}

// ue8m0_rp_encode_soft(t) for t >= +0 or +Inf (not NaN), without its clamp to 0xFE (0xFF for t = +Inf and for
// t >= 2^127, which t = f(amax / 448) < 2^120 never reaches for a finite amax). Branch-free: with B = bits(t),
//  * t normal or Inf (B >= 0x800000; e >= 1): (B + 0x7FFFFF) >> 23 = e + (m != 0), the rule's e + (m != 0 ? 1 : 0)
//    (m <= 0x7FFFFF, so the carry into bit 23 happens iff m != 0; e <= 255 keeps the sum below 2^32);
//  * t subnormal or zero (B < 0x800000; e = 0, m = B): (B + 0x3FFFFF) >> 23 is 1 iff B >= 0x400001 (the sum is below
//    0xC00000 < 2^24), the rule's (m > 0x400000 ? 1 : 0).
// A NaN t gives some value (the callers handle NaN before using it). Checked on the host against ue8m0_rp_encode_soft
// (clamped) for every non-negative non-NaN pattern, and, through mxfp8_encode32_stochastic's use (scale byte, fast
// test, multiplier), against the previous code for every non-negative and every NaN amax pattern (2026-12-01).
QM_HD uint32_t ue8m0_rp_bits_nonnan(float t) {
  const uint32_t bits = float_bits(t);
  return (bits + (bits >= 0x800000u ? 0x7FFFFFu : 0x3FFFFFu)) >> 23;
}
// sr_fast_block_ok(amax_nan, b, ue8m0_inverse(b)) for b = ue8m0_rp_bits_nonnan(f(amax_nan / 448)) (any value when
// amax_nan is NaN), without forming p = 2^(127 - b): for b <= 156, p is a normal power of two and
// f(amax_nan * p) <= 448  <=>  amax_nan <= T = 448 * 2^(b - 127) = 1.75 * 2^(b - 119), whose bits are
// ((b + 8) << 23) | 0x600000 = (b << 23) + 0x04600000 (a normal number: exponent field b + 8 in [8, 164]). Proof of the
// equivalence, with a = amax_nan: a NaN: both false (f(NaN * p) <= 448 and NaN <= T are false). a = +Inf: both false.
// a finite: if a * p is in the normal range, f(a p) = a p exactly (a power-of-two scaling) and a p <= 448 <=> a <= T;
// if a p >= 2^128 (f = Inf), both are false (a p > 448 means a > T); if a p < 2^-126, f(a p) <= 2^-126 <= 448 and
// a < 448 / p = T: both true. The float compare a <= T is false for NaN, as the original's.
QM_HD bool sr_fast_block_ok_bits(float amax_nan, uint32_t b) {
  return b <= static_cast<uint32_t>(kSrFastMaxScale) && amax_nan <= bits_float((b << 23) + 0x04600000u);
}
// sr_fast_multiplier(b) = 2^(7 - b) for b <= kSrFastMaxScale, as f(2^(127 - b) * 2^-120): 2^(127 - b) = bits((254 - b)
// << 23) is normal for b <= 253, and the product is a power of two >= 2^-149 (b <= 156), exact even where subnormal
// (b >= 134).
QM_HD float sr_fast_multiplier_from(uint32_t b) { return qm_mul(bits_float((254u - b) << 23), 0x1p-120f); }

// ---------------------------------------------------------------------------------------------------
// MXFP8 block encoders: one MX block of 32 fp32 values -> the UE8M0 scale byte and 32 E4M3 codes. The kernels
// (mxfp8.cu: quantize and the transposed requantization) and the host emulation call these same functions.
// The block amax max(0, |x_0|, ..., |x_31|), NaN ignored (all NaN: 0), by a pairwise tree: max is exact and does not
// depend on the order, so the tree gives the serial form's value, but its longest dependency chain is 6 max
// instructions instead of 32 (the transposed requantization waited on that chain, ncu 2026-12-01).
// The pairwise tree of both amax forms below; max_abs(a, v) = max(a, |v|) in the form's NaN convention (the operands
// above the leaves are >= +0 or NaN, so |.| changes none of them).
template <typename MaxAbs>
QM_HD float max_abs_tree32(const float x[32], MaxAbs max_abs) {
  float m[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) m[j] = max_abs(qm_abs(x[2 * j]), x[2 * j + 1]);
  // Levels of 8, 4, 2 and 1 pairs, written out (a loop over the level width was not unrolled: m went to the stack).
#pragma unroll
  for (int j = 0; j < 8; ++j) m[j] = max_abs(m[j], m[j + 8]);
#pragma unroll
  for (int j = 0; j < 4; ++j) m[j] = max_abs(m[j], m[j + 4]);
  m[0] = max_abs(m[0], m[2]);
  m[1] = max_abs(m[1], m[3]);
  return max_abs(m[0], m[1]);
}
struct MaxAbsIgnoreNan {
  QM_HD float operator()(float a, float v) const { return qm_max(a, qm_abs(v)); }
};
struct MaxAbsPropagateNan {
  QM_HD float operator()(float a, float v) const { return qm_max_abs_nan(a, v); }
};
QM_HD float block_amax32(const float x[32]) {
  return qm_max(0.0f, max_abs_tree32(x, MaxAbsIgnoreNan{}));  // the serial form starts from 0: all NaN gives 0
}
// The same with NaN propagated (qm_max_abs_nan: NaN if any element is NaN).
QM_HD float block_amax32_nan(const float x[32]) {
  return max_abs_tree32(x, MaxAbsPropagateNan{});  // >= +0 or NaN: a starting 0 would change nothing
}

// Encodes one MX block of 32 fp32 values: returns its scale byte; words[w] = codes 4w .. 4w + 3 (little-endian).
// The scale without ue8m0_mxfp8_scale's NaN case and ue8m0_inverse's 0xFF case: block_amax32 is +0 .. +Inf, never
// NaN, so t = f(amax / 448) is not NaN, the scale byte is min(ue8m0_rp_bits_nonnan(t), 0xFE) (checked for every
// non-negative amax pattern, see ue8m0_rp_bits_nonnan), and p = 2^(127 - b) (ue8m0_inverse_finite).
QM_HD uint8_t mxfp8_encode32_nearest(const float x[32], uint32_t words[8]) {
  const uint32_t b = ue8m0_rp_bits_nonnan(qm_mul(block_amax32(x), 1.0f / 448.0f));
  const uint8_t scale = static_cast<uint8_t>(b > 0xFEu ? 0xFEu : b);
  const float p = ue8m0_inverse_finite(scale);
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    words[w] = static_cast<uint32_t>(e4m3x2_encode(qm_mul(x[4 * w], p), qm_mul(x[4 * w + 1], p))) |
               (static_cast<uint32_t>(e4m3x2_encode(qm_mul(x[4 * w + 2], p), qm_mul(x[4 * w + 3], p)))
                << 16);
  }
  return scale;
}

// The 8 code words of a block with stochastic rounding, element j drawing the random bits of index0 + j
// (index0 % 32 == 0): they are the low / high halves of the block's 16 pair words (rbits_block: one fmix32
// per two elements). kFast: sr_e4m3_fast with q = sr_fast_multiplier(b); else sr_e4m3 of f(x * p).
template <bool kFast>
QM_HD void sr_encode32(const float x[32], float p, float q, const RbitsBlock& hash, uint32_t words[8]) {
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    // Elements 4w .. 4w + 3 are pairs 2w and 2w + 1: the even element takes the low half of its pair's word.
    const uint32_t pair_words[2] = {rbits_block_word(hash, 2 * w), rbits_block_word(hash, 2 * w + 1)};
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t r16 = (pair_words[k / 2] >> (16 * (k % 2))) & 0xFFFFu;
      v[k] = kFast ? sr_e4m3_fast(x[4 * w + k], q, r16) : sr_e4m3(qm_mul(x[4 * w + k], p), r16);
    }
    words[w] = static_cast<uint32_t>(e4m3x2_encode(v[0], v[1])) |
               (static_cast<uint32_t>(e4m3x2_encode(v[2], v[3])) << 16);
  }
}

// The stochastic form of mxfp8_encode32_nearest; index0 = the flat index of x[0], a multiple of 32 (row * K + column
// with K % 32 == 0, or k * R + rb with R % 32 == 0). Every finite block with a scale byte <= 156 takes
// sr_e4m3_fast (a truncating multiply, an add, a mask and a multiply per element); NaN / Inf blocks and huge ones
// (amax > 448 * 2^29) take the general sr_e4m3 (sr_fast_block_ok_bits). Both give sr_e4m3_definition's bits.
// `hash` = rbits_block(key, index0) (or rbits_block_keyed with the block's pair key).
// The scale byte: for a non-NaN amax_nan (+0 .. +Inf) ue8m0_mxfp8_scale(amax_nan) = min(b, 0xFE) with
// b = ue8m0_rp_bits_nonnan(f(amax_nan / 448)); the fast path has b <= 156, so it returns b itself. A NaN block fails
// the fast test whatever b is, and takes its scale from block_amax32 (NaN ignored) as before.
QM_HD uint8_t mxfp8_encode32_stochastic_hashed(const float x[32], const RbitsBlock& hash, uint32_t words[8]) {
  const float amax_nan = block_amax32_nan(x);
  // b, unclamped and without the NaN case (ue8m0_rp_bits_nonnan); a NaN block fails the test below (amax_nan <= T is
  // false) and recomputes its scale, an Inf block (b = 255 here) fails it too and clamps b below.
  const uint32_t b = ue8m0_rp_bits_nonnan(qm_mul(amax_nan, 1.0f / 448.0f));
  if (sr_fast_block_ok_bits(amax_nan, b)) {
    sr_encode32<true>(x, 0.0f, sr_fast_multiplier_from(b), hash, words);
    return static_cast<uint8_t>(b);
  }
  // The general path: the NUMERICS scale (the scale's amax ignores NaN; clamped to 0xFE), p = 2^(127 - b).
  const uint8_t scale =
      qm_isnan(amax_nan) ? ue8m0_mxfp8_scale(block_amax32(x)) : static_cast<uint8_t>(b > 0xFEu ? 0xFEu : b);
  sr_encode32<false>(x, ue8m0_inverse(scale), 0.0f, hash, words);
  return scale;
}
QM_HD uint8_t mxfp8_encode32_stochastic(const float x[32], uint32_t key, int64_t index0, uint32_t words[8]) {
  return mxfp8_encode32_stochastic_hashed(x, rbits_block(key, static_cast<uint64_t>(index0)), words);
}

// ---------------------------------------------------------------------------------------------------

// Correctly rounded 1 / d (the device's reciprocal sequence instead of a general division; same bits).
QM_HD float qm_rcp(float d) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(d);
#else
  return 1.0f / d;
#endif
}

// Block encode factor inv = min(f(1 / f(fp32(s) * S_dec)), FLT_MAX) (1/0 = Inf -> FLT_MAX). Always > 0.
QM_HD float nvfp4_block_inverse_value(float scale, float s_dec) {
  return qm_min(qm_rcp(qm_mul(scale, s_dec)), kFltMax);
}
QM_HD float nvfp4_block_inverse(uint8_t scale_byte, float s_dec) {
  return nvfp4_block_inverse_value(e4m3_decode(scale_byte), s_dec);
}

// nvfp4_block_inverse_value for the 4/6 fast path: the same value whenever the row's approx_ok holds (the only case
// where the fast path's result is used), without the reciprocal's range check, slow-path branch and reconvergence.
// On the device, 1 / d is rcp.rn's own fast sequence -- r = MUFU.RCP(d), e = f(d r - 1), f(r - r e) (ptxas expands
// rcp.rn.f32 to exactly this, with -e formed by an FADD.FTZ that cannot flush: e is 0 or a multiple of 2^-47) --
// which ptxas takes for every d with a biased exponent in [1, 252]. With approx_ok, d = f(scale * S_dec) is 0 or lies
// in [2^-101, 2^99] (scale 0 or in [2^-9, 448], S_dec = f(1 / f(6M / amax)) with 1536 <= 6M <= 2688 and
// 2^-80 <= amax <= 2^100): a nonzero d takes that branch, the same bits; d = 0 gives f(0 * Inf - 1) = NaN and a NaN
// reciprocal, and min(NaN, FLT_MAX) = FLT_MAX = min(1 / 0, FLT_MAX) (fminf returns the non-NaN operand). The host form
// is the IEEE division. (Not checkable on the host: the device sequence is ptxas's; tests/test_formats_cuda.py
// compares the kernels with the reference.)
QM_HD float qm_rcp_fast(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(d, r, -1.0f);
  return __fmaf_rn(r, -e, r);
#else
  return 1.0f / d;
#endif
}
// The fast path's inv_s = f(inv * 2^-6) (nvfp4_candidate_scaled's domain) in one step, from s_dec_64 = f(S_dec * 2^6):
// with approx_ok, d = f(scale * S_dec) is 0 or a normal number in [2^-101, 2^99] (see qm_rcp_fast), so
// f(scale * s_dec_64) = 64 d exactly (S_dec * 64 is exact, and scaling by 2^6 commutes with rounding away from
// underflow and overflow), 1 / (64 d) = (1 / d) * 2^-6 is normal and rounds as 1 / d does, and inv = f(1 / d) <= 2^101
// is below FLT_MAX: the result is f(inv * 2^-6) exactly. d = 0: NaN, min -> f(FLT_MAX * 2^-6), the scaled FLT_MAX.
QM_HD float nvfp4_block_inverse_scaled_fast(float scale, float s_dec_64) {
  return qm_min(qm_rcp_fast(qm_mul(scale, s_dec_64)), kFltMax * 0x1p-6f);  // 2^-6: kE2m1DomainScale
}

// E2M1 rounding of a magnitude a >= 0 (or NaN): returns the code 0..7 and sets *rounded to its value.
// Same result as e2m1_encode_soft(a) (checked exhaustively over all non-negative fp32), in ~9 operations:
// with a clamped to 6 (NaN -> 6), let e = max(floor(log2 a), 0) and M = 2^(e + 22); the fp32 sum a + M has
// ulp 2^(e-1), the E2M1 step in that binade (0.5 below 1), so it rounds a to the E2M1 grid with ties to the
// even mantissa; k = bits(a + M) - bits(M) counts steps and the code is 2e + k.
QM_HD uint32_t e2m1_round_magnitude(float a, float* rounded) {
  a = qm_min(a, 6.0f);
  const uint32_t exp_bits = float_bits(a) & 0x7F800000u;
  const uint32_t binade = exp_bits > 0x3F800000u ? exp_bits : 0x3F800000u;  // max(e, 0) as fp32 exponent bits
  const float magic = bits_float(binade + (22u << 23));
  const float sum = qm_add(a, magic);
  *rounded = qm_sub(sum, magic);
  return ((binade - 0x3F800000u) >> 22) + (float_bits(sum) - float_bits(magic));
}

// The E2M1 sign bit (0x8) of x: its sign bit, except NaN (-> code 0x7, no sign). min(x, +Inf) is x for
// every non-NaN x (-0 included) and +Inf for NaN, so its sign bit is the answer (one FMNMX on the device).
QM_HD uint32_t e2m1_sign(float x) {
  return (float_bits(qm_min(x, bits_float(0x7F800000u))) >> 28) & 0x8u;
}

QM_HD float qm_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

// Markstein's division step, f(n / d) without a division from inv_d = f(1 / d): q0 = f(n * inv_d), the remainder
// n - q0 * d exact in one fma, then f(q0 + rem * inv_d). Where it equals the IEEE quotient is each caller's claim, and
// each has its exhaustive host check: div_six_markstein ("div_six"), div_six_m_markstein ("markstein_1536" / "_2688"),
// nvfp4_outer_scales' S_enc with inv_d = qm_rcp_fast(amax) ("outer_scales").
QM_HD float div_markstein(float n, float d, float inv_d) {
  const float q0 = qm_mul(n, inv_d);
  return qm_fma(qm_fma(-q0, d, n), inv_d, q0);
}

// NVFP4 outer (per-row or per-tensor) scales from the outer amax and the E4M3 bound M (256 or 448).
// The amax must be >= 0 (or +Inf / NaN); a negative amax is not a valid input.
struct Nvfp4Outer {
  float s_enc;
  float s_dec;
  // Whether the fast 4/6 path's error bound holds for every block of the row: 6M is 1536 or 2688 and
  // 2^-80 <= amax <= 2^100. Then every nonzero numerator n = f(f(r * s) * amax), r in [0.5, 6], s in
  // [2^-9, 448] (every nonzero E4M3 scale) lies in [2^-90, 2^112], inside [2^-100, FLT_MAX], so n, n / 6M, g
  // and r * g are normal fp32 numbers; a zero scale gives d = g = 0 exactly.
  bool approx_ok;
  float inv_six_m;  // f(1 / 6M), for the 4/6 error terms
};

// f(1 / f(6M)): the 4/6 error's and the dequantize factor's divisor, computed once per row or launch.
QM_HD float nvfp4_inv_six_m(float e4m3_max) { return qm_div(1.0f, qm_mul(6.0f, e4m3_max)); }

// inv_six_m: nvfp4_inv_six_m(e4m3_max), which a kernel's launcher can compute once on the host (the same IEEE
// division) instead of every thread. With approx_ok (6M = 1536 or 2688, 2^-80 <= amax <= 2^100) S_enc = f(6M / amax)
// lies in [2^-90, 2^92] and S_dec = f(1 / S_enc) is its correctly rounded reciprocal, both normal and with biased
// exponents inside qm_rcp_fast's range: a reciprocal and one Markstein step give the IEEE quotient's bits
// (host_exhaustive_check "outer_scales", every such amax and both M), without the IEEE division's range check, branch
// to its slow path and the register saves around that call (forty-eighth session). The min with FLT_MAX and the
// zero / Inf / NaN cases cannot arise there.
QM_HD Nvfp4Outer nvfp4_outer_scales(float amax, float e4m3_max, float inv_six_m) {
  const float six_m = qm_mul(6.0f, e4m3_max);  // 1536 or 2688, exact
  const bool approx_ok = (six_m == 1536.0f || six_m == 2688.0f) && amax >= 0x1p-80f && amax <= 0x1p100f;
  if (approx_ok) {
    const float s_enc = div_markstein(six_m, amax, qm_rcp_fast(amax));
    return Nvfp4Outer{s_enc, qm_rcp_fast(s_enc), true, inv_six_m};
  }
  float s_enc = qm_min(qm_div(six_m, amax), kFltMax);
  if (amax == 0.0f || s_enc == 0.0f || qm_isnan(amax)) s_enc = 1.0f;
  return Nvfp4Outer{s_enc, qm_div(1.0f, s_enc), false, inv_six_m};
}
QM_HD Nvfp4Outer nvfp4_outer_scales(float amax, float e4m3_max) {
  return nvfp4_outer_scales(amax, e4m3_max, nvfp4_inv_six_m(e4m3_max));
}

// f(n / six_m) for six_m in {1536, 2688} without a division: q0 = f(n * f(1/six_m)), the remainder
// n - q0 * six_m is exact in one FMA, and f(q0 + rem * f(1/six_m)) is the correctly rounded quotient
// (Markstein). Checked exhaustively for every positive finite fp32 n against the IEEE division: equal
// unless the quotient is subnormal (n < 2^-114). Callers use it only when every n of a block lies in
// [2^-100, FLT_MAX] or is zero (the sign of a zero quotient is irrelevant where it is used).
QM_HD float div_six_m_markstein(float n, float six_m, float inv_six_m) { return div_markstein(n, six_m, inv_six_m); }

// Block amax over 16 values: NaN ignored (fmaxf), Inf kept.
QM_HD float block_amax16(const float x[16]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = qm_max(a, qm_abs(x[i]));
  return a;
}

// tree_sum of 16 values (NUMERICS notation): v[i] += v[i + n/2] for i < n/2, halving n.
// Written out stage by stage: nvcc did not unroll the `half >>= 1` loop and emulated the register indexing
// with ~60 predicated moves per stage.
QM_HD float tree_sum16(float v[16]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = qm_add(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = qm_add(v[i], v[i + 4]);
#pragma unroll
  for (int i = 0; i < 2; ++i) v[i] = qm_add(v[i], v[i + 2]);
  return qm_add(v[0], v[1]);
}

// Squared 4/6 error terms of one candidate (inv, scale) and its magnitude codes; kMarkstein picks the division.
template <bool kMarkstein>
QM_HD float nvfp4_candidate_error(const float x[16], float inv, float scale, float amax, float six_m,
                                  float inv_six_m, uint32_t magnitude_nibbles[2]) {
  float sq[16];
  uint32_t nibbles[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float ax = qm_abs(x[i]);
    float r;
    nibbles[i / 8] |= e2m1_round_magnitude(qm_mul(ax, inv), &r) << (4 * (i % 8));
    const float n = qm_mul(qm_mul(r, scale), amax);  // r * s is exact (2 x 4 significant bits)
    const float d = kMarkstein ? div_six_m_markstein(n, six_m, inv_six_m) : qm_div(n, six_m);
    const float diff = qm_sub(d, ax);
    sq[i] = qm_mul(diff, diff);
  }
  magnitude_nibbles[0] = nibbles[0];
  magnitude_nibbles[1] = nibbles[1];
  return tree_sum16(sq);
}

// One 4/6 candidate with block scale byte s: magnitude codes of the 16 elements (e2m1(|x_i| * inv)) packed
// as nibbles (element i at bits 4(i%8) of word i/8), and the block's squared error
// err = tree_sum(f(f(d_i - x_i)^2)), d_i = f(f(f(e2m1val * s) * amax) / 6M).
// Computed on magnitudes: d_i has the sign of x_i (inv > 0), so f(d_i - x_i)^2 == f(|d_i| - |x_i|)^2
// exactly (round-to-nearest is symmetric; zeros and NaN/Inf give the same squares).
QM_HD float nvfp4_candidate(const float x[16], uint8_t scale_byte, float s_dec, float amax, float six_m,
                            uint32_t magnitude_nibbles[2]) {
  const float inv = nvfp4_block_inverse(scale_byte, s_dec);
  const float scale = e4m3_decode(scale_byte);
  const float inv_six_m = qm_div(1.0f, six_m);
  // Markstein division is exact when every nonzero numerator n = f(f(r * s) * amax), r in {0.5 .. 6}, lies in
  // [2^-100, FLT_MAX]; n is monotone in r, so the block's extremes decide.
  const float n_min = qm_mul(qm_mul(0.5f, scale), amax);
  const float n_max = qm_mul(qm_mul(6.0f, scale), amax);
  const bool known_divisor = six_m == 1536.0f || six_m == 2688.0f;
  if (known_divisor && (n_min >= 0x1p-100f || scale == 0.0f) && n_max <= kFltMax) {
    return nvfp4_candidate_error<true>(x, inv, scale, amax, six_m, inv_six_m, magnitude_nibbles);
  }
  return nvfp4_candidate_error<false>(x, inv, scale, amax, six_m, inv_six_m, magnitude_nibbles);
}

// Adds the signs of x to magnitude nibbles: the result is the block's 8 packed bytes as two little-endian
// words (element 2j in the low nibble of byte j).
QM_HD void add_e2m1_signs(const float x[16], uint32_t nibbles[2]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) nibbles[i / 8] |= e2m1_sign(x[i]) << (4 * (i % 8));
}

// The 4/6 choice exactly as NUMERICS writes it: both candidates' codes and errors, map-4 iff err_4 < err_6.
// Kept as the definition: the fast path below falls back to it, and the host tests compare against it.
// Returns use4; words4 gets map-4's magnitude nibbles, words map-6's.
QM_HD bool nvfp4_four_over_six_exact(const float x[16], uint8_t s6, uint8_t s4, float s_dec, float amax,
                                     float six_m, uint32_t words[2], uint32_t words4[2]) {
  const float err6 = nvfp4_candidate(x, s6, s_dec, amax, six_m, words);
  const float err4 = nvfp4_candidate(x, s4, s_dec, amax, six_m, words4);
  return err4 < err6;  // NaN compares false: map-6
}

// The fast NVFP4 paths round and pack in a domain scaled by 2^-6: r_s = 2^-6 * r for an E2M1 value r lies on the
// E4M3 grid with code(r) << 2 as its E4M3 byte (2^-7 = 4 * 2^-9 is the subnormal 0x04, 2^-6 (1 + m/2) * 2^e for
// e in {0, 1, 2} is 0x08 + 8e + 4m), so the hardware's pair conversion packs two codes at once.
constexpr float kE2m1DomainScale = 0x1p-6f;
constexpr float kE2m1ScaledBound = 7.0f * 0x1p-6f;  // 7 in the scaled domain

// E2M1 rounding in the scaled domain, without the clamp at 6: for 0 <= a_s < 7 * 2^-6 (not NaN) with a_s = 2^-6 * a,
// returns 2^-6 * (e2m1_round_magnitude's rounded a). With e = max(floor(log2 a), 0) the fp32 sum a + 2^(e + 22) has
// ulp 2^(e-1), the E2M1 step (0.5 below 1), so it rounds a to the grid with ties to even, and in [4, 8) (ulp 2) a in
// [6, 7) rounds to 6 as min(a, 6) does. Here the same sums scaled by 2^-6 (binade floor 2^-6, magic >= 2^16): every
// sum is a normal number, so the addition commutes with the power-of-two scaling; a_s below 2^-126 (a below 2^-120)
// rounds to 0, as a does. Checked for every a < 7 by host_exhaustive_check ("e2m1_magnitude").
// The magic is applied as floor * 2^22 inside two FMAs instead of an integer add and two FADDs (one instruction
// fewer per element and candidate): floor = 2^max(floor(log2 a_s), -6) is a normal power of two, so for every finite
// a_s < 2^104 the product floor * (+-2^22) = +-magic is exact and fma(floor, 2^22, a_s) rounds the exact a_s + magic
// once, i.e. is f(a_s + magic) bit for bit; likewise fma(floor, -2^22, sum) is f(sum - magic). (A NaN a_s still gives
// NaN, the addend propagates; the callers' a_s are below 7 * 2^-6 whenever the result is used.)
QM_HD float e2m1_round_scaled(float a_s) {
  const uint32_t exp_bits = float_bits(a_s) & 0x7F800000u;
  const float binade_floor = bits_float(exp_bits > 0x3C800000u ? exp_bits : 0x3C800000u);
  return qm_fma(binade_floor, -0x1p22f, qm_fma(binade_floor, 0x1p22f, a_s));
}

// prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b:a} (a = bytes 0-3), replaced by
// 0xFF / 0x00 (its top bit replicated) when bit 3 of that selector nibble is set.
QM_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(sel));
  return out;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0x00u;
    out |= byte << (8 * i);
  }
  return out;
#endif
}

// Sign bytes of 4 elements in pair order: bytes 0, 1, 2, 3 are 0xFF when the sign bit of element 0, 2, 1, 3 is set,
// else 0x00 (the byte order of e2m1_codes4_scaled, what e2m1_pack8_codes takes). From fp32 values: three byte
// permutes. From two bf16 / fp16 pairs as loaded (element 2j in the low half of word j): one, reading the high byte of
// each half directly -- the kernels that hold the raw input use this form.
QM_HD uint32_t sign_bytes4(const float x[4]) {
  return byte_perm(byte_perm(float_bits(x[0]), float_bits(x[2]), 0xFBu),
                   byte_perm(float_bits(x[1]), float_bits(x[3]), 0xFBu), 0x5410u);
}
QM_HD uint32_t sign_bytes4_16bit(uint32_t pair01, uint32_t pair23) { return byte_perm(pair01, pair23, 0xFBD9u); }

// High 32 bits of the 64-bit product a * b (IMAD.HI on the device).
QM_HD uint32_t qm_umulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The E4M3 bytes of 4 scaled magnitudes (r_s[k] = 2^-6 * an E2M1 value, as e2m1_round_scaled returns) in pair order:
// bytes 0, 1, 2, 3 = elements 0, 2, 1, 3, each code << 2 (two pair conversions). A value off the scaled E2M1 grid
// gives a byte with nonzero low bits: NaN 0x7F, a saturated value 0x7E.
QM_HD uint32_t e2m1_codes4_scaled(const float r_s[4]) {
  return static_cast<uint32_t>(e4m3x2_encode(r_s[0], r_s[2])) |
         (static_cast<uint32_t>(e4m3x2_encode(r_s[1], r_s[3])) << 16);
}

// One packed NVFP4 word (element i in bits 4i .. 4i + 3, its sign -- also for zero magnitudes -- at 4i + 3) from the
// code words of elements 0-3 and 4-7 (e2m1_codes4_scaled, codes on the grid) and their sign bytes (sign_bytes4 /
// sign_bytes4_16bit). Per 4 elements: n = codes | (signs & 0x20202020) has byte k = (code | sign << 3) << 2 (bit 5 is
// free: code << 2 <= 28), i.e. the signed nibbles of elements 0, 2, 1, 3 shifted left by 2; then
// umulhi(n, 2^30 + 2^18) = floor(n / 4 + n / 2^14) = (n >> 2) + (n >> 14) (n / 4 is an integer): n >> 2 puts the
// nibbles of elements 0 and 2 in bits 0-3 and 8-11, n >> 14 those of elements 1 and 3 (bytes 2 and 3, bits 18-21 and
// 26-29) in bits 4-7 and 12-15 and nothing else below bit 16 (bits 0-13 of n drop out, bits 16-17 and 24-25 are zero),
// so the low 16 bits of the sum are the four nibbles in place, without carries. One byte permute joins the two low
// halves. Same bits as the NUMERICS packing of the codes of r_s * 2^6 with those signs (host_exhaustive_check
// "e2m1_magnitude", through e2m1_pack8_scaled).
QM_HD uint32_t e2m1_pack8_codes(uint32_t codes_lo, uint32_t codes_hi, uint32_t signs_lo, uint32_t signs_hi) {
  const uint32_t lo = qm_umulhi(codes_lo | (signs_lo & 0x20202020u), 0x40040000u);
  const uint32_t hi = qm_umulhi(codes_hi | (signs_hi & 0x20202020u), 0x40040000u);
  return byte_perm(lo, hi, 0x5410u);
}

// The same from 8 scaled magnitudes. not_on_grid (optional): or-ed with the low two bits of each E4M3 byte, which are
// zero for every value on the scaled E2M1 grid and nonzero for NaN (0x7F) or a value the conversion saturated (0x7E):
// the plain fast path's NaN test.
QM_HD uint32_t e2m1_pack8_scaled(const float r_s[8], uint32_t signs_lo, uint32_t signs_hi,
                                 uint32_t* not_on_grid = nullptr) {
  const uint32_t codes_lo = e2m1_codes4_scaled(r_s);
  const uint32_t codes_hi = e2m1_codes4_scaled(r_s + 4);
  if (not_on_grid != nullptr) *not_on_grid |= (codes_lo | codes_hi) & 0x03030303u;
  return e2m1_pack8_codes(codes_lo, codes_hi, signs_lo, signs_hi);
}

// The block's 4 sign-byte words: sign_bytes if given (the kernels' sign_bytes4_16bit of the raw pairs), else from x.
QM_HD void block_sign_bytes(const float x[16], const uint32_t* sign_bytes, uint32_t signs[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) signs[q] = sign_bytes != nullptr ? sign_bytes[q] : sign_bytes4(x + 4 * q);
}

// The two packed words of a 16-element block from its scaled magnitudes; sign_bytes: the block's 4 sign-byte words
// (sign_bytes4 / sign_bytes4_16bit), or nullptr to take them from x.
QM_HD void e2m1_pack16_scaled(const float r_s[16], const float x[16], const uint32_t* sign_bytes, uint32_t words[2],
                               uint32_t* not_on_grid = nullptr) {
  uint32_t signs[4];
  block_sign_bytes(x, sign_bytes, signs);
  words[0] = e2m1_pack8_scaled(r_s, signs[0], signs[1], not_on_grid);
  words[1] = e2m1_pack8_scaled(r_s + 8, signs[2], signs[3], not_on_grid);
}

// Plain (no 4/6) codes of a block, the fast way, when every element is non-NaN, inv >= 2^-100 (so inv_s = inv * 2^-6
// is exact) and f(block_amax * inv_s) < 7 * 2^-6 (so every f(|x_i| * inv) < 7: rounding is monotonic, and
// f(|x_i| * inv_s) is 2^-6 f(|x_i| * inv) or, below 2^-126, rounds to 0 like it): e2m1_round_scaled is then
// e2m1_round_magnitude's rounding scaled by 2^-6 (no clamp needed) and e2m1_pack16_scaled packs codes and signs.
// Returns false otherwise -- NaN or Inf elements, zero or small subnormal scales, huge outer amax -- and the caller
// takes the general form (words then hold garbage, which the general form overwrites). NaN detection from the
// codes: under the bound every non-NaN element's scaled value is on the E2M1 grid (E4M3 byte code << 2, low bits
// zero), while a NaN element converts to 0x7F: one OR per 4 elements instead of an FADD chain over the elements. (An
// Inf element never gets here -- block_amax keeps Inf, so the bound fails first -- and would be caught anyway: its
// binade floor is Inf, so e2m1_round_scaled gives f(Inf - Inf) = NaN, 0x7F.)
QM_HD bool nvfp4_plain_codes_fast(const float x[16], float block_amax, float inv, const uint32_t* sign_bytes,
                                  uint32_t words[2]) {
  const float inv_s = qm_mul(inv, kE2m1DomainScale);
  if (!(inv >= 0x1p-100f) || !(qm_mul(block_amax, inv_s) < kE2m1ScaledBound)) return false;
  float r_s[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) r_s[i] = e2m1_round_scaled(qm_mul(qm_abs(x[i]), inv_s));
  uint32_t not_on_grid = 0u;
  e2m1_pack16_scaled(r_s, x, sign_bytes, words, &not_on_grid);
  return not_on_grid == 0u;
}

// Fast 4/6 candidate in the scaled domain: r_s[i] = 2^-6 * r_i, r_i the E2M1 rounding of f(|x_i| * inv) exactly as
// nvfp4_candidate rounds it (given f(block_amax * inv_s) < 7 * 2^-6 with inv_s = f(inv * 2^-6) exact: see
// nvfp4_plain_codes_fast), and an approximate error A = f(A_even + A_odd), A_even / A_odd the fma chains over the
// even / odd i of t_i^2 (two chains: half the dependent latency of one), t_i = f(r_i * g - |x_i|) (one fma, computed
// as f(r_s[i] * g_s - |x_i|) with g_s = g * 2^6 exact: the same exact product), g = f(f(s * amax) * f(1 / 6M)).
// ~7 operations per element (no division, no separate square and sum). The values r_s go straight into E4M3 code
// words (codes[q] = e2m1_codes4_scaled of elements 4q .. 4q + 3): 8 pair conversions per candidate, after which the
// 16 floats are dead -- the caller selects the chosen candidate's 4 words instead of 16 values and packs once.
QM_HD float nvfp4_candidate_scaled(const float x[16], float inv_s, float g_s, uint32_t codes[4]) {
  float acc[2] = {0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float r_s[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * q + k;
      const float ax = qm_abs(x[i]);
      r_s[k] = e2m1_round_scaled(qm_mul(ax, inv_s));
      const float t = qm_fma(r_s[k], g_s, -ax);
      acc[i % 2] = qm_fma(t, t, acc[i % 2]);
    }
    codes[q] = e2m1_codes4_scaled(r_s);
  }
  return qm_add(acc[0], acc[1]);
}

// The decision threshold of the two candidates (A_k from nvfp4_candidate_scaled, g_k_s = g_k * 2^6 its error factor in
// the scaled domain): T = f(f(g4_s^2 + f(g6_s^2)) * 2^-27 + f(f(A_4 + A_6) * 2^-14 + 2^-118)) (fused multiply-adds),
// more than (1+u) (E_4 + E_6) for the bounds E_k >= |err_k - A_k|. Five instructions for both candidates. Proof: above
// nvfp4_four_six_block16_fast.
QM_HD float nvfp4_decision_threshold(float approx4, float approx6, float g4_s, float g6_s) {
  const float g_squares = qm_fma(g4_s, g4_s, qm_mul(g6_s, g6_s));
  return qm_fma(g_squares, 0x1p-27f, qm_fma(qm_add(approx4, approx6), 0x1p-14f, 0x1p-118f));
}

// The exact 4/6 formula, out of line on the device: the fast path below decides all but a few blocks, and
// one copy of this code (instead of one per unrolled call site) keeps the kernels' instruction footprint small.
#if defined(__CUDACC__)
inline __host__ __device__ __noinline__
#else
inline
#endif
bool nvfp4_four_over_six_exact_outlined(const float* x, uint8_t s6, uint8_t s4, float s_dec, float amax,
                                        float six_m, uint32_t* words, uint32_t* words4) {
  return nvfp4_four_over_six_exact(x, s6, s4, s_dec, amax, six_m, words, words4);
}

// 4/6 selection of one block (nvfp4_four_six_block16_fast below): the same codes, scales and choices as nvfp4_four_over_six_exact (the NUMERICS formula) for
// every input, cheaper. The fast path applies when outer.approx_ok (the bound below holds for every scale)
// and both candidates' largest scaled magnitudes f(block_amax * inv) are < 7 (map-6's bound implies map-4's),
// so the unclamped E2M1 rounding equals the clamped one. It fails for Inf elements, zero or small subnormal
// scales, and saturated scales when the block amax exceeds the row amax — a question of speed only, those blocks
// take the exact formula:
//  (1) s4 == s6: both candidates are the same computation, err_4 == err_6 bit for bit (or both NaN), so
//      err_4 < err_6 is false: map-6 (candidate 4, computed anyway to keep the path straight-line, is dropped).
//  (2) Otherwise the exact codes of both candidates and an approximate error A_k (nvfp4_candidate_scaled) with
//      a rigorous bound E_k >= |err_k - A_k| (below). With D = f(A_6 - A_4), D' = f(A_4 - A_6) and the computed
//      threshold T (nvfp4_decision_threshold), which exceeds (1+u) (E_4 + E_6): D > T proves err_4 < err_6
//      (map-4), D' > T proves err_4 > err_6 (map-6). Only near-ties (|err_4 - err_6| within ~2^-13 relative)
//      remain.
//  A NaN element makes A_6 NaN (t = f(r * g - NaN)); the fast path then decides nothing, in (1) as in (2).
//  (3) Anything else (near-ties, NaN/Inf elements, extreme amax, unusual M, zero or saturated scales): the
//      exact formula.
//
// Proof of |err_k - A_k| <= E_k = 1.688e-5 A_k + 4.83e-6 G_k^2 + 2^-143 (u = 2^-24; every quantity of one candidate,
// s > 0 first; s = 0 is below).
//  Let a_i = |x_i| (finite: otherwise A or the bound is Inf/NaN and the comparisons in (2) are false), r_i
//  the E2M1 value (the same in both computations), G = s * amax / 6M (real), delta_i = r_i * G (real),
//  e_i = delta_i - a_i. approx_ok makes n_i = f(r_i s amax) (r_i s is exact) and the quotient normal, so
//  d_i = f(n_i / 6M) = delta_i (1 + alpha_i), |alpha_i| <= (1+u)^2 - 1; likewise g = f(f(s amax) f(1/6M))
//  = G (1 + beta), |beta| <= (1+u)^3 - 1. Let D_i = d_i - a_i, P_i = r_i g - a_i (real), W = sum D_i^2,
//  V = sum P_i^2, h = 6 G ((1+u)^2 + (1+u)^4 - 2) <= 36.001 u G >= |D_i - P_i| = r_i |d_i / r_i - g| (r_i <= 6;
//  (1+u)^3 would do since P_i uses the exact r_i g, the larger h only loosens the bound).
//  * err = tree_sum f(f(D_i (1+eps))^2): a subtraction has relative error <= u (exact when the result is
//    subnormal), the square relative u plus absolute 2^-150 if it underflows, each of the 4 tree levels
//    adds non-negative numbers with relative error u. So |err - W| <= rho W + c, rho = (1+u)^7 - 1,
//    c = 16 * 2^-150 (1+u)^4.
//  * A = f(A_even + A_odd), two fma chains of 8 squares of t_i = f(P_i) = P_i (1 + eps_i) + eta_i, |eps_i| <= u,
//    |eta_i| <= 2^-150 (one fma rounding; absolute only where the result is subnormal): each fma rounds a
//    non-negative exact t^2 + acc once (relative u, or absolute 2^-150 when subnormal), and the final add once
//    (exact when subnormal), so every term sees at most 9 roundings -- within the bounds written for one chain of 16:
//    |A - V| <= rho' V + c' + sum 2 |P_i| eta_i (1+u) + 16 * 2^-300, rho' = (1+u)^18 - 1,
//    c' = 16 * 2^-150 (1+u)^16; sum 2 |P_i| eta_i (1+u) <= 2^-147 (1+u) sqrt(V) <= 2^-23 V + 2^-271 (AM-GM), so
//    |A - V| <= rho'' V + c'' with rho'' = rho' + 2^-23, c'' = c' + 2^-271.
//  * |W - V| <= sum |D_i - P_i| |D_i + P_i| <= sum h (2 |P_i| + h) <= 8 h sqrt(V) + 16 h^2 (Cauchy-Schwarz:
//    sum |P_i| <= 4 sqrt(V)) <= lambda V + 16 h^2 (1 + 1/lambda) with lambda = 2^-16 (AM-GM:
//    8 h sqrt(V) <= lambda V + 16 h^2 / lambda).
//  * |err - A| <= (1+rho)|W - V| + (rho + rho'') V + c + c''
//              <= V ((1+rho) lambda + rho + rho'') + 16 h^2 (1+rho)(1 + 1/lambda) + c + c''
//              <= 1.687e-5 V + 4.83e-6 G^2 + 2^-144, and V <= (A + c'') / (1 - rho''), so
//    |err - A| <= 1.688e-5 A + 4.83e-6 G^2 + 2^-143.
//  * s = 0: G = g = 0, so d_i = 0 and t_i = f(-a_i) = -a_i exactly, D_i = P_i = -a_i, h = 0 and the same
//    bounds hold.
// The threshold T = f(f(g_4s^2 + f(g_6s^2)) 2^-27 + f(f(A_4 + A_6) 2^-14 + 2^-118)), g_ks = 2^6 g_k exactly (see
//  the fast path), every operand >= +0: each fused multiply-add and the add round once, by a factor >= 1 - u, or,
//  where the result is subnormal, by at most 2^-150 (the two inner ones only; the outer two are >= 2^-118, normal),
//  so T >= (1-u)^3 (2^-14 (A_4 + A_6) + 2^-15 (g_4^2 + g_6^2) + 2^-118) - 2^-176 (2^-27 g_ks^2 = 2^-15 g_k^2), and
//  with g_k >= G_k (1 - 3.01u): T / (1+u) >= 6.1e-5 (A_4 + A_6) + 3.05e-5 (G_4^2 + G_6^2) + (1 - 4u) 2^-118 - 2^-175,
//  more than E_4 + E_6 = 1.688e-5 (A_4 + A_6) + 4.83e-6 (G_4^2 + G_6^2) + 2^-142 (margins 3.6, 6.3, 2^23).
//  An overflow to Inf (huge A or g) makes T Inf and both tests false.
// Decision: if D = f(A_6 - A_4) > T, then A_6 - A_4 >= D / (1+u) > T / (1+u) > E_4 + E_6, so
//  err_4 <= A_4 + E_4 < A_6 - E_6 <= err_6: map-4, as the exact formula. Symmetrically D' > T gives
//  err_4 > err_6: map-6. Inf/NaN anywhere makes both tests false.
// (Until the forty-eighth session: per-candidate bounds B_k = f(f(f(A 2^-15) + f(f(g g) 2^-16)) + 2^-120) and the
//  test D > 2 f(B_4 + B_6); the same proof with a 1.8x margin on the A term. The threshold form takes 5 instructions
//  instead of 12.)
// Checked against the exact formula on random and adversarial blocks (ties, e4m3 boundaries, all-equal,
// outliers, subnormals) by tests/test_formats_host.py (host_nvfp4_quantize vs the torch reference).
// (The functions below: nvfp4_four_six_block16_fast is this fast path, nvfp4_four_six_block16_general the exact
// formula, nvfp4_quantize_block16_words the two together.)

// Block scale bytes from the block amax and the outer scales. Plain: s = e4m3(f(a_b * f(S_enc * f(1/6)))). 4/6: s6 (low
// byte) and s4 (high byte) in one pair conversion (same bits as two e4m3_encode calls; base is never NaN: block_amax
// ignores NaN and S_enc is finite and nonzero).
QM_HD uint8_t nvfp4_plain_scale_byte(float block_amax, const Nvfp4Outer& outer) {
  return e4m3_encode(qm_mul(block_amax, qm_mul(outer.s_enc, 1.0f / 6.0f)));
}
QM_HD uint16_t nvfp4_four_six_scale_pair(float block_amax, const Nvfp4Outer& outer) {
  const float base = qm_mul(qm_div(block_amax, 6.0f), outer.s_enc);
  return e4m3x2_encode(qm_min(base, 448.0f), qm_min(qm_mul(1.5f, base), 448.0f));
}

// f(a / 6) without a division (an FMUL and two FMAs, no special-case branch): q0 = f(a * f(1/6)), the remainder
// a - 6 q0 is exact in one FMA, and f(q0 + rem * f(1/6)) is the correctly rounded quotient (Markstein) whenever it is
// a normal number. host_exhaustive_check "div_six" over every non-negative fp32 a: equal to f(a / 6) unless
// f(a / 6) < 2^-126, where both are below 2^-125; a = Inf gives NaN (f(Inf - Inf) in the remainder).
QM_HD float div_six_markstein(float a) {
  constexpr float kInvSix = 1.0f / 6.0f;  // f(1/6) = 0x3E2AAAAB, rounded at compile time
  return div_markstein(a, 6.0f, kInvSix);
}

// nvfp4_four_six_scale_pair for the fast path: the same bytes whenever outer.approx_ok (the only case where the fast
// path's result is used), by div_six_markstein instead of the IEEE division (which costs a range check, a branch to a
// slow path and its reconvergence per block). With approx_ok, S_enc = f(6M / amax) <= 2688 * 2^80 < 2^92, so:
// (1) f(a / 6) normal: the quotients are equal; (2) f(a / 6) < 2^-126 (both quotients below 2^-125): both bases are
// below 2^-33 and encode to E4M3 0x00, as does 1.5 times them; (3) a = Inf: base is NaN instead of Inf, and
// min(NaN, 448) = min(Inf, 448) = 448 (fminf returns the non-NaN operand), so both bytes are 0x7E either way.
// host_exhaustive_check "div_six" compares the two pair functions for every non-negative a at the largest S_enc.
QM_HD uint16_t nvfp4_four_six_scale_pair_fast(float block_amax, const Nvfp4Outer& outer) {
  const float base = qm_mul(div_six_markstein(block_amax), outer.s_enc);
  return e4m3x2_encode(qm_min(base, 448.0f), qm_min(qm_mul(1.5f, base), 448.0f));
}

// The plain codes by the NUMERICS rule (the general form of nvfp4_plain_codes_fast): words = the packed codes of x
// with block factor inv, signs included.
QM_HD void nvfp4_plain_codes_general(const float x[16], float inv, uint32_t words[2]) {
  words[0] = 0;
  words[1] = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float unused;
    words[i / 8] |= e2m1_round_magnitude(qm_mul(qm_abs(x[i]), inv), &unused) << (4 * (i % 8));
  }
  add_e2m1_signs(x, words);
}

// One 4/6 block through the fast path, straight-line (no data-dependent branch but the reciprocals' rare special
// cases): both candidates are always computed, so that a kernel can interleave the blocks it holds, and `decided`
// says whether the result stands. When it is false, `words` and `scale` are meaningless and the caller takes
// nvfp4_four_six_block16_general. `sign_bytes`: see nvfp4_quantize_block16_words.
struct Nvfp4BlockFast {
  uint32_t words[2];
  uint8_t scale;
  bool decided;
};

QM_HD Nvfp4BlockFast nvfp4_four_six_block16_fast(const float x[16], float block_amax, const Nvfp4Outer& outer,
                                                 float amax, const uint32_t* sign_bytes) {
  Nvfp4BlockFast out;
  const uint16_t scale_pair = nvfp4_four_six_scale_pair_fast(block_amax, outer);  // s6 in the low byte, s4 high
  float scale6, scale4;
  e4m3x2_decode(scale_pair, scale6, scale4);
  const float s_dec_64 = qm_mul(outer.s_dec, 64.0f);
  const float inv6_s = nvfp4_block_inverse_scaled_fast(scale6, s_dec_64);  // f(inv6 * 2^-6)
  const float inv4_s = nvfp4_block_inverse_scaled_fast(scale4, s_dec_64);
  // f(block_amax * inv4) <= f(block_amax * inv6): s4 >= s6 (E4M3 encoding is monotone and 1.5 base >= base),
  // so scale4 >= scale6 and inv4 <= inv6 (rounded products and the reciprocal are monotone). One test covers both.
  // The candidates round in the domain scaled by 2^-6 (nvfp4_candidate_scaled): approx_ok bounds every inv to
  // [2^-99, 2^101] or FLT_MAX (zero scale), so inv * 2^-6 and g * 2^6 are exact, and the test below is
  // f(block_amax * inv6) < 7 scaled by 2^-6 (both products are normal, or the scaled one is below 2^-126 and
  // the unscaled one below 2^-120 < 7). Outside approx_ok (or the bound) the values below are computed all the
  // same and discarded.
  const bool in_range = outer.approx_ok && qm_mul(block_amax, inv6_s) < kE2m1ScaledBound;
  // g_k * 2^6 = f(f(s_k * amax) * f(1 / 6M) * 2^6) exactly: with approx_ok, f(s_k * amax) is 0 or in [2^-89, 2^109]
  // (s_k 0 or in [2^-9, 448]), so both products with f(1 / 6M) (~2^-11) and its 2^6 multiple are normal, and a
  // power-of-two factor commutes with their rounding. One multiply per candidate fewer than g_k, then * 2^6.
  const float inv_six_m_64 = qm_mul(outer.inv_six_m, 64.0f);
  const float g6_s = qm_mul(qm_mul(scale6, amax), inv_six_m_64);
  const float g4_s = qm_mul(qm_mul(scale4, amax), inv_six_m_64);
  uint32_t codes6[4];
  uint32_t codes4[4];
  const float approx6 = nvfp4_candidate_scaled(x, inv6_s, g6_s, codes6);
  const float approx4 = nvfp4_candidate_scaled(x, inv4_s, g4_s, codes4);
  const float threshold = nvfp4_decision_threshold(approx4, approx6, g4_s, g6_s);
  const bool four_better = qm_sub(approx6, approx4) > threshold;
  const bool six_better = qm_sub(approx4, approx6) > threshold;
  // Step (1): identical candidates (s4 == s6) decide map-6 unless an element is NaN; step (2): the bound.
  // s4 == s6 is tested on the decoded scales (one float compare instead of extracting two bytes): both bytes lie in
  // [0x00, 0x7E] (min(base, 448) with base >= 0 or NaN, never -0), where E4M3 decoding is injective. When s4 == s6 both
  // candidates are the same computation, so approx4 and approx6 are the same bits: approx6 - approx4 is 0 or NaN and
  // threshold > 0 or NaN, so four_better and six_better are false -- hence chosen4 = four_better, and step (1) only
  // adds its own case to `decided` (approx6 == approx6: not NaN).
  const bool same = scale4 == scale6;
  const bool chosen4 = four_better;
  out.decided = in_range && (four_better || six_better || (same && approx6 == approx6));
  uint32_t chosen[4];  // the chosen candidate's code words (when decided: on the grid, no NaN element)
#pragma unroll
  for (int q = 0; q < 4; ++q) chosen[q] = chosen4 ? codes4[q] : codes6[q];
  uint32_t signs[4];
  block_sign_bytes(x, sign_bytes, signs);
  out.words[0] = e2m1_pack8_codes(chosen[0], chosen[1], signs[0], signs[1]);
  out.words[1] = e2m1_pack8_codes(chosen[2], chosen[3], signs[2], signs[3]);
  out.scale = static_cast<uint8_t>(chosen4 ? scale_pair >> 8 : scale_pair);  // s4 : s6
  return out;
}

// The general form of a 4/6 block, for what the fast path leaves undecided (NaN / Inf elements, zero or saturated
// scales, extreme outer amax, near-ties): the NUMERICS formula as written.
QM_HD void nvfp4_four_six_block16_general(const float x[16], float block_amax, const Nvfp4Outer& outer, float amax,
                                          float e4m3_max, uint32_t words[2], uint8_t* scale_byte) {
  words[0] = 0;
  words[1] = 0;
  const uint16_t scale_pair = nvfp4_four_six_scale_pair(block_amax, outer);
  const uint8_t s6 = static_cast<uint8_t>(scale_pair & 0xFFu);
  const uint8_t s4 = static_cast<uint8_t>(scale_pair >> 8);
  uint32_t words4[2] = {0u, 0u};
  const bool chosen4 =
      nvfp4_four_over_six_exact_outlined(x, s6, s4, outer.s_dec, amax, qm_mul(6.0f, e4m3_max), words, words4);
  if (chosen4) {
    words[0] = words4[0];
    words[1] = words4[1];
  }
  add_e2m1_signs(x, words);
  *scale_byte = chosen4 ? s4 : s6;
}

// One block, plain or 4/6, into two packed words (bytes 0-3, 4-7) and the E4M3 scale byte, with precomputed outer
// scales: `amax` is the outer amax (the 4/6 error is measured in the input domain, which needs it), `e4m3_max` is M,
// `block_amax` the block's max |x_i| (NaN ignored: block_amax16). The fast paths, then the general form where they
// do not decide. `decided_fast` (optional, tests): whether the fast path decided the 4/6 choice (false: the exact
// formula did), or, without 4/6, whether nvfp4_plain_codes_fast produced the codes. `sign_bytes` (optional): the
// block's sign bytes as 4 words (sign_bytes4_16bit of the raw bf16 / fp16 pairs: one byte permute per 4 elements
// instead of three), used by the fast paths' packing; nullptr takes them from x.
QM_HD void nvfp4_quantize_block16_words(const float x[16], float block_amax, const Nvfp4Outer& outer, float amax,
                                        float e4m3_max, bool four_over_six, uint32_t words[2],
                                        uint8_t* scale_byte, bool* decided_fast = nullptr,
                                        const uint32_t* sign_bytes = nullptr) {
  if (!four_over_six) {  // the plain fast path writes its codes straight into words (one block at a time)
    const uint8_t s = nvfp4_plain_scale_byte(block_amax, outer);
    const float inv = nvfp4_block_inverse(s, outer.s_dec);
    *scale_byte = s;
    const bool fast = nvfp4_plain_codes_fast(x, block_amax, inv, sign_bytes, words);
    if (decided_fast != nullptr) *decided_fast = fast;
    if (fast) return;
    nvfp4_plain_codes_general(x, inv, words);
    return;
  }
  const Nvfp4BlockFast fast = nvfp4_four_six_block16_fast(x, block_amax, outer, amax, sign_bytes);
  if (decided_fast != nullptr) *decided_fast = fast.decided;
  if (fast.decided) {
    words[0] = fast.words[0];
    words[1] = fast.words[1];
    *scale_byte = fast.scale;
  } else {
    nvfp4_four_six_block16_general(x, block_amax, outer, amax, e4m3_max, words, scale_byte);
  }
}

QM_HD void nvfp4_quantize_block16_words(const float x[16], const Nvfp4Outer& outer, float amax, float e4m3_max,
                                        bool four_over_six, uint32_t words[2], uint8_t* scale_byte) {
  nvfp4_quantize_block16_words(x, block_amax16(x), outer, amax, e4m3_max, four_over_six, words, scale_byte);
}

QM_HD void nvfp4_quantize_block16_outer(const float x[16], const Nvfp4Outer& outer, float amax, float e4m3_max,
                                        bool four_over_six, uint8_t packed[8], uint8_t* scale_byte) {
  uint32_t words[2];
  nvfp4_quantize_block16_words(x, outer, amax, e4m3_max, four_over_six, words, scale_byte);
#pragma unroll
  for (int k = 0; k < 8; ++k) packed[k] = static_cast<uint8_t>(words[k / 4] >> (8 * (k % 4)));
}

// Dequantize factor final_b = f(f(fp32(s_b) * amax) * f(1/(6M))); y_i = f(e2m1val(q_i) * final_b).
QM_HD float nvfp4_dequant_scale_from(float scale, float amax, float inv_six_m) {
  return qm_mul(qm_mul(scale, amax), inv_six_m);
}
QM_HD float nvfp4_dequant_scale(uint8_t scale_byte, float amax, float e4m3_max) {
  return nvfp4_dequant_scale_from(e4m3_decode(scale_byte), amax, nvfp4_inv_six_m(e4m3_max));
}

// f(e2m1val(code) * scale) (NUMERICS "NVFP4 / Dequantize") for the 16 codes of one NVFP4 block, given as two
// little-endian words (element 2i in the low nibble of byte i), through the E4M3 pair decode (hardware on sm_89+,
// the software rule elsewhere) instead of a per-code select chain: the E2M1 code s e1 e0 m becomes the E4M3 byte
// s 0 0 e1 e0 m 0 0, whose value is exactly e2m1val * 2^-6 for every code (E4M3's exponent bias 7 is E2M1's 1
// plus 6, and E4M3's subnormals (m / 2) 2^-6 match E2M1's 0.m). e2m1x2_from_e4m3x2 scales the pair back by 2^6
// (exact: a power-of-two scaling of a normal or zero fp32 value), so each element is e2m1val itself, and
// y = f(e2m1val * scale) is one fp32 multiply by the scale as it is: the definition, for every scale (zero, subnormal,
// huge, Inf, NaN) and every code (+-0 included), with no case split. The host emulation (nvfp4_block_decode) decodes
// through it; no kernel does any more. The transposed requantization (mxfp8.cu) stages the E4M3 images
// (e2m1_codes_as_e4m3_bytes) and multiplies e2m1val * 2^-6 (e4m3x2_decode_half) by f(final_b * 64): the same real
// product, exact because its launcher takes M = 256 or 448 only (forty-seventh session; until then it decoded through
// this function, with the scaling by 2^6 done in f16 on the device). The NVFP4 dequantize kernel keeps its per-code
// decode (measured faster there, nvfp4.cu). All give the same bits.
//
// The two E2M1 values whose E4M3 images (above) are the bytes of `pair` (lo in bits 7:0): e4m3val * 2^6, exact.
template <int kHalf>
QM_HD void e2m1x2_from_e4m3x2(uint32_t pairs, float& lo, float& hi) {
  e4m3x2_decode_half<kHalf>(pairs, lo, hi);
  lo = qm_mul(lo, 64.0f);
  hi = qm_mul(hi, 64.0f);
}
// The E4M3 images (above) of the 8 E2M1 codes of word w: byte m of `even` is element 2m's, byte m of `odd` element
// 2m + 1's. The odd elements' bytes keep the high nibble's sign bit 7 and shift its bits 6..4 to 4..2; the even
// elements' bytes are the same transform of the word shifted left by 4. The transposed requantization stages these
// bytes (mxfp8.cu).
QM_HD void e2m1_codes_as_e4m3_bytes(uint32_t w, uint32_t& even, uint32_t& odd) {
  odd = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
  even = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
}
// Elements 4q .. 4q + 3 (q = 0 or 1) of the 8 codes in word w, decoded as above: bytes 2q and 2q + 1 of the images
// are elements 4q + {0, 2} (even) and 4q + {1, 3} (odd). nvfp4_block_decode is four of these.
QM_HD void nvfp4_quad_decode(uint32_t w, int q, float scale, float y[4]) {
  uint32_t even, odd;
  e2m1_codes_as_e4m3_bytes(w, even, odd);
  float v[4];
  if (q == 0) {
    e2m1x2_from_e4m3x2<0>(even, v[0], v[2]);
    e2m1x2_from_e4m3x2<0>(odd, v[1], v[3]);
  } else {
    e2m1x2_from_e4m3x2<1>(even, v[0], v[2]);
    e2m1x2_from_e4m3x2<1>(odd, v[1], v[3]);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = qm_mul(v[k], scale);
}
QM_HD void nvfp4_block_decode(uint32_t word0, uint32_t word1, float scale, float y[16]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // elements 8 * half .. 8 * half + 7
#pragma unroll
    for (int q = 0; q < 2; ++q) nvfp4_quad_decode(half == 0 ? word0 : word1, q, scale, y + 8 * half + 4 * q);
  }
}

// ---------------------------------------------------------------------------------------------------
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
