// Exhaustive GPU checks of the device-only forms in csrc/qm_*.cuh: the `#if defined(__CUDA_ARCH__)` branches (PTX
// conversions, round-toward-zero intrinsics, the MUFU reciprocal sequence, prmt) that the host emulation cannot reach,
// because it compiles the other branch. Each is compared over (nearly) every fp32 bit pattern it is used on with
// the form the host emulation runs, which tests/test_formats_host.py proves against the torch reference; the
// kernels' own tests (tests/test_formats_cuda.py) compare whole kernels with the reference on random and edge data.
// Built and run by tests/test_device_forms.py with the extension's nvcc flags (no FMA contraction, no fast math).
// Prints one line per check: "<name> <mismatches> <checked>".
#include <cstdint>
#include <cstdio>

#include "quant_math.cuh"

using namespace ep_comm::qm;

namespace {

enum Check { kRcpFast, kE4m3x2Encode, kE4m3x2Decode, kAddOffsetRz, kMulRzPow2, kSrFast, kMaxAbsNan, kBytePerm,
             kScaledCodesEqual, kNumChecks };
const char* const kNames[kNumChecks] = {"rcp_fast", "e4m3x2_encode", "e4m3x2_decode", "add_offset_rz",
                                        "mul_rz_pow2", "sr_e4m3_fast", "max_abs_nan", "byte_perm",
                                        "scaled_codes_decode_equal"};

struct Counts {
  unsigned long long mismatches[kNumChecks];
  unsigned long long checked[kNumChecks];
};

// Per-thread tallies, added once per thread (not once per element).
struct Tally {
  unsigned long long bad = 0, seen = 0;
  __device__ void add(bool ok) { bad += ok ? 0 : 1; ++seen; }
  __device__ void flush(Counts* counts, Check check) {
    atomicAdd(&counts->mismatches[check], bad);
    atomicAdd(&counts->checked[check], seen);
  }
};

__device__ uint64_t thread_index() { return blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; }
__device__ uint64_t thread_count() { return static_cast<uint64_t>(gridDim.x) * blockDim.x; }

__device__ bool same_or_both_nan(float a, float b) {
  return float_bits(a) == float_bits(b) || (qm_isnan(a) && qm_isnan(b));
}

// qm_rcp_fast (MUFU.RCP and one Newton step) against the IEEE reciprocal for every d the fast path can pass it:
// [2^-101, 2^99] (qm_nvfp4_block.cuh), and the zero case through nvfp4_block_inverse_scaled_fast.
__global__ void check_rcp_fast(Counts* counts) {
  Tally tally;
  for (uint64_t bits = 0x0D000000u + thread_index(); bits <= 0x71000000u; bits += thread_count()) {
    const float d = bits_float(static_cast<uint32_t>(bits));
    tally.add(float_bits(qm_rcp_fast(d)) == float_bits(__frcp_rn(d)));
  }
  if (thread_index() == 0) tally.add(float_bits(nvfp4_block_inverse_scaled_fast(0.0f, 1.0f)) ==
                                     float_bits(qm_mul(kFltMax, 0x1p-6f)));
  tally.flush(counts, kRcpFast);
}

// The sm_89+ pair conversion against the software rule, for every non-NaN fp32 pattern in both positions (callers
// never pass raw NaNs: e4m3x2_encode's comment), and the pair decode for all 65536 byte pairs.
__global__ void check_e4m3x2(Counts* counts) {
  Tally encode, decode;
  for (uint64_t bits = thread_index(); bits <= 0xFFFFFFFFull; bits += thread_count()) {
    const float v = bits_float(static_cast<uint32_t>(bits));
    const float w = bits_float(fmix32(static_cast<uint32_t>(bits)));
    if (qm_isnan(v) || qm_isnan(w)) continue;
    encode.add(e4m3x2_encode(v, w) == (e4m3_encode_soft(v) | (e4m3_encode_soft(w) << 8)));
    encode.add(e4m3x2_encode(w, v) == (e4m3_encode_soft(w) | (e4m3_encode_soft(v) << 8)));
  }
  for (uint64_t pair = thread_index(); pair < 0x10000u; pair += thread_count()) {
    float lo, hi;
    e4m3x2_decode(static_cast<uint16_t>(pair), lo, hi);
    decode.add(same_or_both_nan(lo, e4m3_decode_soft(static_cast<uint8_t>(pair & 0xFF))) &&
               same_or_both_nan(hi, e4m3_decode_soft(static_cast<uint8_t>(pair >> 8))) &&
               same_or_both_nan(e4m3_decode(static_cast<uint8_t>(pair & 0xFF)), lo));
  }
  encode.flush(counts, kE4m3x2Encode);
  decode.flush(counts, kE4m3x2Decode);
}

// The round-toward-zero forms of sr_e4m3 / sr_e4m3_fast against the values their host forms write out.
__global__ void check_round_toward_zero(Counts* counts) {
  Tally add_rz, mul_rz;
  // add_offset_rz(a, 2^-6) for every a in [0, 2^-6): bits 0x3C800000 + floor(a * 2^29); with offset 0: a itself.
  for (uint64_t bits = thread_index(); bits < 0x3C800000u; bits += thread_count()) {
    const float a = bits_float(static_cast<uint32_t>(bits));
    add_rz.add(float_bits(add_offset_rz(a, 0x1p-6f)) ==
               0x3C800000u + static_cast<uint32_t>(static_cast<double>(a) * 536870912.0));
    add_rz.add(float_bits(add_offset_rz(a, 0.0f)) == float_bits(a));
  }
  // mul_rz_pow2(x, q) for the multipliers sr_e4m3_fast uses (scale bytes 0 .. 156) and every x with a finite
  // product: the exact product in double, truncated to the fp32 grid (normal: exact; else units of 2^-149).
  const uint8_t scale_bytes[7] = {0, 60, 120, 127, 134, 150, 156};
  for (const uint8_t b : scale_bytes) {
    const float q = sr_fast_multiplier_from(b);
    for (uint64_t bits = thread_index(); bits <= 0xFFFFFFFFull; bits += thread_count()) {
      const float x = bits_float(static_cast<uint32_t>(bits));
      const double exact = static_cast<double>(x) * static_cast<double>(q);
      if (qm_isnan(x) || !(exact <= 3.4028234663852886e38 && exact >= -3.4028234663852886e38)) continue;
      const double magnitude = exact < 0.0 ? -exact : exact;
      const uint32_t sign = float_bits(x) & 0x80000000u;
      uint32_t expected;
      if (magnitude >= 0x1p-126) {
        expected = float_bits(static_cast<float>(exact));  // exact: q is a power of two, the product normal
      } else {
        expected = static_cast<uint32_t>(magnitude * 0x1p149) | sign;
      }
      mul_rz.add(float_bits(mul_rz_pow2(x, q)) == expected);
    }
  }
  add_rz.flush(counts, kAddOffsetRz);
  mul_rz.flush(counts, kMulRzPow2);
}

// sr_e4m3_fast against the NUMERICS definition on its domain (|f(x * p)| <= 448, scale byte <= 156), with the
// extreme random words and a hashed one.
__global__ void check_sr_fast(Counts* counts, uint8_t b) {
  Tally tally;
  const float p = ue8m0_inverse(b);
  const float q = sr_fast_multiplier_from(b);
  for (uint64_t bits = thread_index(); bits <= 0xFFFFFFFFull; bits += thread_count()) {
    const float x = bits_float(static_cast<uint32_t>(bits));
    const float v = qm_mul(x, p);
    if (!(qm_abs(v) <= 448.0f)) continue;
    const uint32_t words[4] = {0u, 0xFFFFu, 0x8000u, fmix32(static_cast<uint32_t>(bits)) & 0xFFFFu};
    for (const uint32_t r : words) tally.add(float_bits(sr_e4m3_fast(x, q, r)) == float_bits(sr_e4m3_definition(v, r)));
  }
  tally.flush(counts, kSrFast);
}

// qm_max_abs_nan (max.NaN with |x| folded in) against its host form: NaN if either is NaN, else max(acc, |x|);
// acc >= +0 as in the kernels (it starts at 0).
__global__ void check_max_abs_nan(Counts* counts) {
  Tally tally;
  for (uint64_t bits = thread_index(); bits <= 0xFFFFFFFFull; bits += thread_count()) {
    const float x = bits_float(static_cast<uint32_t>(bits));
    const float acc = bits_float(fmix32(static_cast<uint32_t>(bits)) & 0x7FFFFFFFu);
    const float expected = (qm_isnan(acc) || qm_isnan(x)) ? bits_float(0x7FC00000u) : qm_max(acc, qm_abs(x));
    tally.add(same_or_both_nan(qm_max_abs_nan(acc, x), expected));
  }
  tally.flush(counts, kMaxAbsNan);
}

// byte_perm (prmt.b32) against its host form (byte_perm_soft) on hashed operands and every selector the 16 bits can
// hold (the kernels' selectors use nibbles 0-15 in each of four positions).
__global__ void check_byte_perm(Counts* counts) {
  Tally tally;
  for (uint64_t i = thread_index(); i < (1ull << 26); i += thread_count()) {
    const uint32_t a = fmix32(static_cast<uint32_t>(i) * 2u + 1u);
    const uint32_t b = fmix32(static_cast<uint32_t>(i) * 2u + 2u);
    const uint32_t sel = static_cast<uint32_t>(i) & 0xFFFFu;
    tally.add(byte_perm(a, b, sel) == byte_perm_soft(a, b, sel));
  }
  tally.flush(counts, kBytePerm);
}

// e2m1_scaled_codes_decode_equal (the 4/6 fast path's exact-tie test; on the device fp16 pair decodes and f16x2
// multiplies) against its host form (fp32 products of the decoded bytes), for every pair of E4M3 scales it can get
// (bytes 0x00 .. 0x7E: 0 or [2^-9, 448]) and every pair of codes (bytes code << 2) at each of the 16 positions of
// blocks that are otherwise all zero codes, and in blocks uniform in that pair of codes.
__global__ void check_scaled_codes_equal(Counts* counts) {
  Tally tally;
  constexpr uint64_t kCases = 127ull * 127ull * 64ull * 17ull;
  for (uint64_t i = thread_index(); i < kCases; i += thread_count()) {
    const uint32_t position = static_cast<uint32_t>(i % 17);  // 16: the uniform block
    const uint32_t code_pair = static_cast<uint32_t>((i / 17) % 64);
    const uint32_t scale_pair = static_cast<uint32_t>(i / (17 * 64));
    const uint8_t byte_a = static_cast<uint8_t>((code_pair & 7u) << 2), byte_b = static_cast<uint8_t>((code_pair >> 3) << 2);
    const float scale_a = e4m3_decode_soft(static_cast<uint8_t>(scale_pair % 127));
    const float scale_b = e4m3_decode_soft(static_cast<uint8_t>(scale_pair / 127));
    uint32_t codes_a[4], codes_b[4];
    for (int q = 0; q < 4; ++q) {
      codes_a[q] = position == 16 ? byte_a * 0x01010101u : 0u;
      codes_b[q] = position == 16 ? byte_b * 0x01010101u : 0u;
    }
    if (position < 16) {
      codes_a[position / 4] |= static_cast<uint32_t>(byte_a) << (8 * (position % 4));
      codes_b[position / 4] |= static_cast<uint32_t>(byte_b) << (8 * (position % 4));
    }
    const bool expected = float_bits(qm_mul(e4m3_decode_soft(byte_a), scale_a)) ==
                          float_bits(qm_mul(e4m3_decode_soft(byte_b), scale_b));
    tally.add(e2m1_scaled_codes_decode_equal(codes_a, scale_a, codes_b, scale_b) == expected);
  }
  tally.flush(counts, kScaledCodesEqual);
}

bool ok(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
  return false;
}

}  // namespace

int main() {
  Counts* counts = nullptr;
  if (!ok(cudaMallocManaged(&counts, sizeof(Counts)), "cudaMallocManaged")) return 2;
  for (int c = 0; c < kNumChecks; ++c) counts->mismatches[c] = counts->checked[c] = 0;
  const int blocks = 4096, threads = 256;
  check_rcp_fast<<<blocks, threads>>>(counts);
  check_e4m3x2<<<blocks, threads>>>(counts);
  check_round_toward_zero<<<blocks, threads>>>(counts);
  for (const int b : {0, 1, 60, 120, 127, 133, 134, 150, 156}) check_sr_fast<<<blocks, threads>>>(counts, b);
  check_max_abs_nan<<<blocks, threads>>>(counts);
  check_byte_perm<<<blocks, threads>>>(counts);
  check_scaled_codes_equal<<<blocks, threads>>>(counts);
  if (!ok(cudaGetLastError(), "launch") || !ok(cudaDeviceSynchronize(), "run")) return 2;
  for (int c = 0; c < kNumChecks; ++c) std::printf("%s %llu %llu\n", kNames[c], counts->mismatches[c], counts->checked[c]);
  return 0;
}
