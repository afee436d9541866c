// S2F6 and RHT-32 pieces for kernels that hold an aligned chunk of 32 in two lanes (16 elements each: the
// quantize and dequantize-accumulate kernels of s2f6.cu, the NVLink combine) or four lanes (8 each: dequantize).
// Bit-identical to the serial rules of quant_math.cuh (docs/NUMERICS.md "RHT-32", "S2F6 quantize"); each
// helper says why. Device code; the per-value arithmetic of the code packing is in quant_math.cuh
// (s2f6_code_bits_fast / s2f6_rht_code_bits_fast), which the host checks against s2f6_encode.
#pragma once

#include <cstdint>

#include "quant_math.cuh"

namespace ep_comm {
namespace s2f6_lane {

// rht_sign(v, sign_mask, first + k) for k = 0..N-1 with bits = sign_mask >> first: bit k of `bits` moved to bit 31
// (one shift and one LOP3 per value instead of a variable shift, a mask and a xor).
template <int N>
__device__ __forceinline__ void apply_signs(float v[N], uint32_t bits) {
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = __uint_as_float(__float_as_uint(v[k]) ^ ((bits << (31 - k)) & 0x80000000u));
}

// Unnormalized FWHT-32 of a 2-lane chunk, lane g = lane & 1 holding elements 16g .. 16g + 15: stages h = 1..8 in
// registers, h = 16 pairs the lane with lane ^ 1. The serial rule gives the lower element f(v + p) and the upper
// f(p - v); both are one FFMA, fma(v, s, p) with s = +1 (lower) or -1 (upper): the product v * s is exact, so the
// FMA rounds p + v or p - v once, the same value (zeros' signs included) as the add / subtract. Every lane of the
// warp must call this (full-mask shuffles).
__device__ __forceinline__ void fwht32_lane16(float v[16], int lane) {
  qm::fwht_serial<16>(v);
  const float s = (lane & 1) ? -1.0f : 1.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = __fmaf_rn(v[k], s, __shfl_xor_sync(0xFFFFFFFFu, v[k], 1));
}

// The same for a 4-lane chunk, lane g = lane & 3 holding elements 8g .. 8g + 7: stages h = 1, 2, 4 in registers,
// h = 8 and 16 pair the lane with lane ^ 1 and lane ^ 2 (one FFMA each, as above).
__device__ __forceinline__ void fwht32_lane8(float v[8], int lane) {
  qm::fwht_serial<8>(v);
#pragma unroll
  for (int lane_bit = 1; lane_bit <= 2; lane_bit <<= 1) {
    const float s = (lane & lane_bit) ? -1.0f : 1.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __fmaf_rn(v[k], s, __shfl_xor_sync(0xFFFFFFFFu, v[k], lane_bit));
  }
}

// The inverse RHT-32's last two steps on a lane's N values after the FWHT: the 1/sqrt(32) scaling, then the
// signs (bits = the lane's N bits of the sign mask) -- qm::rht32_inverse's operations in the same order.
template <int N>
__device__ __forceinline__ void scale_and_sign(float v[N], uint32_t bits) {
  const float c = __uint_as_float(qm::kRhtScaleBits);
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = qm::qm_mul(v[k], c);
  apply_signs<N>(v, bits);
}

// The same for the 8 values of a 4-lane chunk (elements (lane & 3) * 8 + k), for the dequantize kernel.
__device__ __forceinline__ void rht32_inverse_lane8(float v[8], uint32_t sign_mask, int lane) {
  fwht32_lane8(v, lane);
  scale_and_sign<8>(v, sign_mask >> ((lane & 3) * 8));
}

#if defined(EP_COMM_S2F6_NATIVE)
__device__ __forceinline__ uint2 pack_codes(const float v[8], uint8_t scale) {
  const float multiplier = qm::ue8m0_inverse(scale);
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    words[w] = static_cast<uint32_t>(qm::s2f6x2_encode(v[4 * w], v[4 * w + 1], scale, multiplier)) |
               (static_cast<uint32_t>(qm::s2f6x2_encode(v[4 * w + 2], v[4 * w + 3], scale, multiplier)) << 16);
  }
  return make_uint2(words[0], words[1]);
}
#else
// 8 codes of qm::s2f6_encode(v[k], scale) (scale <= 0xFE, as ue8m0_s2f6_scale gives), packed lowest element in
// the lowest byte. Same bits as the rule, fewer instructions:
//  * t: for scale >= 6, f(v * 2^(133 - b)) (one multiply) equals the rule's f(f(v * 2^(127 - b)) * 64) whenever
//    |t| >= 2^-120: then v * 2^(127 - b) is normal (or 0 / Inf) and scaling by a power of two is exact, so both
//    are v * 2^(133 - b) rounded once; otherwise both |t| < 1/2 and both give code 0. No overflow: |v| <= amax <
//    2^(b - 126), so |v * 2^(133 - b)| < 128 (Inf stays Inf). For scale < 6, 2^(133 - b) is not an fp32: the
//    rule's two multiplies are kept.
//  * clamp as max(min(t, 127), -128): for a non-NaN t the same as the rule's min(max(t, -128), 127); for t = NaN
//    (iff v is NaN: the multipliers are finite and > 0) fminf returns 127, the rule's NaN code.
//  * rounding: s = f(t + 1.5 * 2^23) lies in [2^23, 2^24) (ulp 1) and is 1.5 * 2^23 + RNE(t) (the magic is even,
//    so ties pick the same neighbour), i.e. bits 0x4B400000 + RNE(t): the low byte is the int8 code that
//    qm_rint_small + the int conversion give, without the subtraction and the quarter-rate F2I.
//    (qm::s2f6_rounded_bits; qm::s2f6_code_bits_fast is this packing for one value, checked on the host.)
//  * for 6 <= b <= 253 the lower clamp is a no-op and the upper one only maps NaN: b = ue8m0_s2f6_scale(amax)
//    is the smallest e with amax * 2^(127 - e) <= 127/64 unless clamped to 0xFE (amax >= 2^127 * 127/64 or
//    Inf), and |v| <= amax for every value of the block, so |v * 2^(133 - b)| <= 127 and its rounding too
//    (127 is an fp32); min(t, 127) keeps such a t and turns NaN into 127, and t >= -127 > -128.
// Bytes 0 of four words, lowest first (the low byte of each rounded-bits word is its code).
__device__ __forceinline__ uint32_t low_bytes4(const uint32_t s[4]) {
  return __byte_perm(__byte_perm(s[0], s[1], 0x0040), __byte_perm(s[2], s[3], 0x0040), 0x5410);
}

__device__ __forceinline__ uint2 pack_codes(const float v[8], uint8_t scale) {
  uint32_t s[8];
  if (scale >= 6 && scale <= 253) {
    const float multiplier = qm::s2f6_fast_multiplier(scale);  // 2^(133 - b)
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = qm::s2f6_rounded_bits_upper(qm::qm_mul(v[k], multiplier));
  } else if (scale >= 6) {
    const float multiplier = qm::s2f6_fast_multiplier(scale);  // 2^(133 - b), b = 254
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = qm::s2f6_rounded_bits(qm::qm_mul(v[k], multiplier));
  } else {
    const float multiplier = qm::ue8m0_inverse(scale);  // 2^(127 - b), normal for b < 6
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = qm::s2f6_rounded_bits(qm::qm_mul(qm::qm_mul(v[k], multiplier), 64.0f));
  }
  return make_uint2(low_bytes4(s), low_bytes4(s + 4));
}
#endif

__device__ __forceinline__ uint4 pack_codes16(const float v[16], uint8_t scale) {
  const uint2 lo = pack_codes(v, scale);
  const uint2 hi = pack_codes(v + 8, scale);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// 16 codes of qm::s2f6_encode(f(v[k] * c), scale) for the RHT: v is the FWHT output before its scaling by
// c = f(1/sqrt(32)) (the quantize kernel finds the scale from f(amax(|v|) * c), the amax of the scaled values:
// rounding is monotonic). In the software path, for 9 <= b <= 253 the two multiplies f(f(v * c) * 2^(133 - b))
// are one, f(v * m) with m = c * 2^(133 - b) (exact: c times a power of two, a normal fp32 for those b). Same value:
// with u = v * c exact, when |u| >= 2^-126 and |u * 2^(133 - b)| >= 2^-126 scaling by the power of two commutes
// with the rounding; when |u * 2^(133 - b)| < 2^-126 both results are below 1/2 (code 0); when |u| < 2^-126,
// 133 - b <= 124 keeps both below 2^-2 (code 0). The clamp argument of pack_codes then holds unchanged.
// Other b (zero or subnormal blocks, huge values) take pack_codes on f(v * c).
__device__ __forceinline__ uint4 pack_codes_rht16(const float v[16], uint8_t scale) {
  const float c = __uint_as_float(qm::kRhtScaleBits);
#if !defined(EP_COMM_S2F6_NATIVE)
  if (scale >= 9 && scale <= 253) {
    const float m = qm::s2f6_rht_fast_multiplier(scale);
    uint32_t s[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) s[k] = qm::s2f6_rounded_bits_upper(qm::qm_mul(v[k], m));
    return make_uint4(low_bytes4(s), low_bytes4(s + 4), low_bytes4(s + 8), low_bytes4(s + 12));
  }
#endif
  float y[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) y[k] = qm::qm_mul(v[k], c);
  return pack_codes16(y, scale);
}

// The RHT-32 signs of a lane's 16 values of a 2-lane chunk: words[k] has bit 31 set where sign_mask bit
// (16 * (lane & 1) + k) is. Built once per thread in kernels whose sign mask is fixed, so that each sign costs one XOR
// instead of apply_signs' shift and XOR (the same bits: v ^ words[k]).
struct RhtSigns16 {
  uint32_t words[16];
  __device__ __forceinline__ RhtSigns16(uint32_t sign_mask, int lane) {
    const uint32_t bits = sign_mask >> ((lane & 1) * 16);
#pragma unroll
    for (int k = 0; k < 16; ++k) words[k] = ((bits >> k) & 1u) << 31;
  }
  __device__ __forceinline__ void apply(float v[16]) const {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = __uint_as_float(__float_as_uint(v[k]) ^ words[k]);
  }
};

// The signs of a lane's 16 values from the sign mask, applied as apply_signs does (shift and XOR per value): for
// kernels that would rather not keep 16 sign words in registers.
struct RhtSignBits16 {
  uint32_t bits;
  __device__ __forceinline__ RhtSignBits16(uint32_t sign_mask, int lane) : bits(sign_mask >> ((lane & 1) * 16)) {}
  __device__ __forceinline__ void apply(float v[16]) const { apply_signs<16>(v, bits); }
};

// RHT-32 inverse of the lane's 16 values of a 2-lane chunk: FWHT, then f(v * c), then the signs (RhtSigns16 or
// RhtSignBits16: the same bits, NaN included). Every lane of the warp must call this.
template <typename Signs>
__device__ __forceinline__ void rht32_inverse_lane16(float v[16], const Signs& signs, int lane) {
  fwht32_lane16(v, lane);
  const float c = __uint_as_float(qm::kRhtScaleBits);
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = qm::qm_mul(v[k], c);
  signs.apply(v);
}

__device__ __forceinline__ void rht32_inverse_lane16(float v[16], uint32_t sign_mask, int lane) {
  rht32_inverse_lane16(v, RhtSignBits16(sign_mask, lane), lane);
}

// S2F6 codes of the lane's 16 values of a 2-lane chunk and the chunk's scale byte (*scale), with the forward RHT
// first when kHadamard: signs (RhtSigns16 or RhtSignBits16: the same bits), the FWHT, and the 1/sqrt(32) scaling
// folded into the code multiplier -- the block amax of the scaled values is f(amax * c) since rounding is monotonic.
// Every lane of the warp must call this.
template <bool kHadamard, typename Signs>
__device__ __forceinline__ uint4 quantize_lane16(float v[16], const Signs& signs, int lane, uint8_t* scale) {
  if (kHadamard) {
    signs.apply(v);
    fwht32_lane16(v, lane);
  }
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) amax = qm::qm_max(amax, qm::qm_abs(v[k]));
  amax = qm::qm_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  if (kHadamard) amax = qm::qm_mul(amax, __uint_as_float(qm::kRhtScaleBits));
  *scale = qm::ue8m0_s2f6_scale(amax);
  return kHadamard ? pack_codes_rht16(v, *scale) : pack_codes16(v, *scale);
}

template <bool kHadamard>
__device__ __forceinline__ uint4 quantize_lane16(float v[16], uint32_t sign_mask, int lane, uint8_t* scale) {
  return quantize_lane16<kHadamard>(v, RhtSignBits16(sign_mask, lane), lane, scale);
}

// code * multiplier for 8 int8 codes. The int8 -> fp32 conversion goes through the mantissa of 2^23
// (bits 0x4B000000 | (byte ^ 0x80) = 2^23 + 128 + code) and one exact subtraction: the same value as an
// I2F, on the full-rate pipes instead of the quarter-rate conversion unit.
__device__ __forceinline__ void unpack_codes(uint2 raw, float multiplier, float v[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t byte = ((k < 4 ? raw.x : raw.y) >> (8 * (k % 4))) & 0xFFu;
    const float code = qm::qm_sub(__uint_as_float(0x4B000000u | (byte ^ 0x80u)), 8388736.0f);
    v[k] = qm::qm_mul(code, multiplier);
  }
}

// The decoded values f(code * 2^-6) * 2^(b - 127) = code * 2^(b - 133) of 8 codes, exactly as unpack_codes(raw,
// s2f6_decode_multiplier(scale)) gives them. For b <= 237 the exponent goes into the magic number: with
// E = b + 17 (in [17, 254], a normal exponent field) and u = byte ^ 0x80 = code + 128 in [0, 255],
// X = bits(E << 23 | u) = 2^(b - 133) (2^23 + u) and B = bits(E << 23 | 0x80) = 2^(b - 133) (2^23 + 128), so
// X - B = code * 2^(b - 133) exactly; that value is an fp32 (an integer multiple of 2^-149 with 8 significant
// bits), so the correctly rounded subtraction returns it (code 0: X = B, +0 like 0.0f * multiplier). One PRMT
// and one FSUB per value. b in [238, 255] (huge scales, 0xFF = NaN) takes the general form.
constexpr uint8_t kMagicMaxScale = 237;  // the largest scale byte the magic-number decode takes

// The magic-number form alone: scale must be <= kMagicMaxScale.
template <int kValues>
__device__ __forceinline__ void unpack_codes_magic(const uint32_t* raw_words, uint8_t scale, float* v) {
  const uint32_t base = ((static_cast<uint32_t>(scale) + 17u) << 23) | 0x80u;
  const float bias = __uint_as_float(base);
#pragma unroll
  for (int w = 0; w < kValues / 4; ++w) {
    const uint32_t word = raw_words[w] ^ 0x80808080u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // byte 0 from byte k of the word, bytes 1..3 from base (0, then the exponent)
      v[4 * w + k] = qm::qm_sub(__uint_as_float(__byte_perm(word, base, 0x7650u | k)), bias);
    }
  }
}

template <int kValues>
__device__ __forceinline__ void unpack_codes_fast(const uint32_t* raw_words, uint8_t scale, float* v) {
  if (scale <= kMagicMaxScale) {
    unpack_codes_magic<kValues>(raw_words, scale, v);
  } else {
    const float multiplier = qm::s2f6_decode_multiplier(scale);
#pragma unroll
    for (int w = 0; w < kValues / 8; ++w) unpack_codes(make_uint2(raw_words[2 * w], raw_words[2 * w + 1]), multiplier, v + 8 * w);
  }
}

__device__ __forceinline__ void unpack_codes_fast(uint2 raw, uint8_t scale, float v[8]) {
  const uint32_t words[2] = {raw.x, raw.y};
  unpack_codes_fast<8>(words, scale, v);
}

// The 16 decoded values of a lane's 16 codes (one chunk, one scale byte): one scale test and one magic base for
// all 16 (two 8-value calls made the compiler test the scale and build the base twice, with a divergence
// barrier around each).
__device__ __forceinline__ void unpack_codes16_fast(uint4 raw, uint8_t scale, float v[16]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  unpack_codes_fast<16>(words, scale, v);
}

}  // namespace s2f6_lane
}  // namespace ep_comm
