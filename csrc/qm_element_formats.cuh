// Element and scale formats, one value at a time (quant_math.cuh): E2M1, E4M3, UE8M0 and S2F6 encode / decode.
#pragma once

#include "qm_arith.cuh"

namespace ep_comm {
namespace qm {

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

}  // namespace qm
}  // namespace ep_comm
