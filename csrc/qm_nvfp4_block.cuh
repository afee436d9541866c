// NVFP4 blocks of 16 (quant_math.cuh): outer and block scales, the plain and 4/6 encoders (exact formula and the
// fast paths, with their proofs) and the block decode.
#pragma once

#include "qm_arith.cuh"
#include "qm_element_formats.cuh"

namespace ep_comm {
namespace qm {

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
// 0xFF / 0x00 (its top bit replicated) when bit 3 of that selector nibble is set. byte_perm_soft is that rule in
// integer operations: the host's form, and what tests/device_checks/device_forms.cu compares the device's prmt with.
QM_HD uint32_t byte_perm_soft(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0x00u;
    out |= byte << (8 * i);
  }
  return out;
}
QM_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(sel));
  return out;
#else
  return byte_perm_soft(a, b, sel);
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

// Whether two candidates' scaled codes (e2m1_codes4_scaled words, on the grid: bytes code << 2, no NaN) decode to the
// same values, r_a,i * s_a == r_b,i * s_b for every element (r = 2^6 * the byte's E4M3 value), with s_a, s_b E4M3 scale
// values (0 or in [2^-9, 448]). The products are exact in both forms: r has at most 2 significant bits and s at most 4,
// so a product has at most 6, and its scaled form 2^-6 r s lies in {0} U [2^-16, 42]; fp32 (host) and fp16 (device:
// the hardware pair decode and one f16x2 multiply per 2 elements, subnormals kept down to 2^-24) hold it exactly. No
// product is NaN or -0, so equal values are equal bits.
QM_HD bool e2m1_scaled_codes_decode_equal(const uint32_t codes_a[4], float scale_a, const uint32_t codes_b[4],
                                          float scale_b) {
  uint32_t differ = 0u;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  uint32_t scale_a2, scale_b2;  // the scale in both f16 halves (exact: every E4M3 value is an fp16 value)
  asm("{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, %1;\n\tmov.b32 %0, {h, h};\n\t}" : "=r"(scale_a2) : "f"(scale_a));
  asm("{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, %1;\n\tmov.b32 %0, {h, h};\n\t}" : "=r"(scale_b2) : "f"(scale_b));
  // The 4 E4M3 bytes of `word` as f16 pairs (lo: bytes 0-1, hi: bytes 2-3), each times the f16x2 scale `scale2`.
  auto decode_times = [](uint32_t word, uint32_t scale2, uint32_t& lo, uint32_t& hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi) : "r"(word));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(scale2));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(scale2));
  };
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t a_lo, a_hi, b_lo, b_hi;
    decode_times(codes_a[q], scale_a2, a_lo, a_hi);
    decode_times(codes_b[q], scale_b2, b_lo, b_hi);
    differ |= (a_lo ^ b_lo) | (a_hi ^ b_hi);
  }
#else
  for (int q = 0; q < 4; ++q) {
    for (int k = 0; k < 4; ++k) {
      const uint8_t byte_a = static_cast<uint8_t>(codes_a[q] >> (8 * k));
      const uint8_t byte_b = static_cast<uint8_t>(codes_b[q] >> (8 * k));
      differ |= float_bits(qm_mul(e4m3_decode(byte_a), scale_a)) ^ float_bits(qm_mul(e4m3_decode(byte_b), scale_b));
    }
  }
#endif
  return differ == 0u;
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
//  (3) An undecided block whose candidates decode every element to the same value (an exact tie: map-6; argument
//      in the code).
//  (4) Anything else (near-ties, NaN/Inf elements, extreme amax, unusual M, zero or saturated scales): the
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
  bool exact_tie;  // decided by step (3) below (for the host probe nvfp4_fast_decided; the kernels do not read it)
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
  // Step (3): exact ties, which no error bound can decide. When every element decodes to the same value under both
  // candidates (r4_i * s4 == r6_i * s6), the exact formula computes err_4 and err_6 by the same operations on the same
  // operands -- n_i = f(f(r_i s) amax) from the same exact product r_i s, then d_i = f(n_i / 6M) (IEEE, or Markstein
  // where nvfp4_candidate proves it equal), the same differences, squares and tree sum -- so err_4 == err_6 bit for bit
  // and err_4 < err_6 is false: map-6. That is the usual case of a block holding one dominant outlier (the massive
  // channels of LLM activations): the outlier decodes exactly under both (6 s6 == 4 s4, e.g. in the row's own max
  // block) and every other element rounds to 0 under both. bench/near_tie_rates.py counts ~3 such blocks per row at
  // hidden 7168 with every 97th channel 30x, which sent ~40% of the warps through the exact formula (262 us against
  // 172 for Gaussian rows on one H100; 174 with this step: bench/RESULTS.md, eighty-second session). The codes at hand
  // are the exact formula's whenever in_range holds and no element is NaN (approx6 not NaN: with in_range no element
  // is Inf, so only a NaN element makes it NaN), as for step (2); four_better is false here (else decided), so
  // chosen = codes6: the words below are map-6's. A branch on rare blocks only: the straight-line work of every block
  // is unchanged. (4): the caller's exact formula.
  if (!out.decided && in_range && approx6 == approx6) {
    out.exact_tie = e2m1_scaled_codes_decode_equal(codes4, scale4, codes6, scale6);
    out.decided = out.exact_tie;
  } else {
    out.exact_tie = false;
  }
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

// The general form with its codes and scale returned by value (decided = true). The general form hands its outputs
// to an out-of-line call through memory: a caller that keeps Nvfp4BlockFast results takes this form, so that its
// array is never address-taken. Given that array's fields, it put the array in local memory on the fast path too
// (the standalone 4/6 kernel 4.6% slower on one H100, bench/RESULTS.md, seventy-sixth session; the dispatch send,
// twentieth session).
QM_HD Nvfp4BlockFast nvfp4_four_six_block16_general_value(const float x[16], float block_amax, const Nvfp4Outer& outer,
                                                          float amax, float e4m3_max) {
  uint32_t words[2];
  uint8_t scale;
  nvfp4_four_six_block16_general(x, block_amax, outer, amax, e4m3_max, words, &scale);
  Nvfp4BlockFast out;
  out.words[0] = words[0];
  out.words[1] = words[1];
  out.scale = scale;
  out.decided = true;
  out.exact_tie = false;
  return out;
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

}  // namespace qm
}  // namespace ep_comm
