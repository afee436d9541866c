// Counter-based random bits, stochastic rounding onto E4M3 and the MXFP8 block encoders (nearest and stochastic)
// (quant_math.cuh).
#pragma once

#include "qm_arith.cuh"
#include "qm_element_formats.cuh"

namespace ep_comm {
namespace qm {

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

// One splitmix64 step, the increment then the finalizer (ep_comm.training_experts._mix64): the seeds of the
// trainable experts' roundings are derived with it, on the device when they live there.
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

// The nearest-rounding scale of an MX block from its amax (+0 .. +Inf, never NaN: block_amax32 ignores NaN): the scale
// byte without ue8m0_mxfp8_scale's NaN case and ue8m0_inverse's 0xFF case -- t = f(amax / 448) is not NaN, the byte is
// min(ue8m0_rp_bits_nonnan(t), 0xFE) (checked for every non-negative amax pattern, see ue8m0_rp_bits_nonnan) -- and
// *p = 2^(127 - b), the encode multiplier (ue8m0_inverse_finite).
QM_HD uint8_t mxfp8_nearest_scale(float amax, float* p) {
  const uint32_t b = ue8m0_rp_bits_nonnan(qm_mul(amax, 1.0f / 448.0f));
  const uint8_t scale = static_cast<uint8_t>(b > 0xFEu ? 0xFEu : b);
  *p = ue8m0_inverse_finite(scale);
  return scale;
}

// words[w] = the E4M3 codes (RNE, satfinite) of f(x[4w + k] * p), k = 0..3, little-endian: kWords words.
template <int kWords>
QM_HD void mxfp8_encode_words_nearest(const float* x, float p, uint32_t* words) {
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    words[w] = static_cast<uint32_t>(e4m3x2_encode(qm_mul(x[4 * w], p), qm_mul(x[4 * w + 1], p))) |
               (static_cast<uint32_t>(e4m3x2_encode(qm_mul(x[4 * w + 2], p), qm_mul(x[4 * w + 3], p)))
                << 16);
  }
}

// The MXFP8 decode of kWords code words (codes 4w .. 4w + 3 little-endian, as the encoders write them) under the
// block's scale byte: y = f(e4m3val * 2^(b - 127)), NaN for b = 0xFF (the E4M3 pair decode is exact).
template <int kWords>
QM_HD void mxfp8_decode_words(const uint32_t* words, uint8_t scale, float* y) {
  const float multiplier = ue8m0_to_float(scale);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    e4m3x2_decode_half<0>(words[w], y[4 * w], y[4 * w + 1]);
    e4m3x2_decode_half<1>(words[w], y[4 * w + 2], y[4 * w + 3]);
  }
#pragma unroll
  for (int k = 0; k < 4 * kWords; ++k) y[k] = qm_mul(y[k], multiplier);
}

// Encodes one MX block of 32 fp32 values: returns its scale byte; words[w] = codes 4w .. 4w + 3 (little-endian).
QM_HD uint8_t mxfp8_encode32_nearest(const float x[32], uint32_t words[8]) {
  float p;
  const uint8_t scale = mxfp8_nearest_scale(block_amax32(x), &p);
  mxfp8_encode_words_nearest<8>(x, p, words);
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

}  // namespace qm
}  // namespace ep_comm
