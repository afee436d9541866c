// RHT-32 + S2F6 quantize, dequantize, and dequantize-accumulate (the receive side of combine).
// Arithmetic: quant_math.cuh (docs/NUMERICS.md, "RHT-32", "S2F6 quantize", "Combine accumulation").
//
// Layout: one thread per 8 consecutive elements; the 4 lanes 4q..4q+3 of a warp hold one aligned chunk of
// 32 (the S2F6 block and the RHT chunk), so the FWHT runs 3 stages in registers and 2 across lanes, and
// the block amax is a 4-lane reduction. A warp reads/writes 256 contiguous elements with 16-byte (or 8-byte
// for int8 codes) accesses. No thread leaves before the shuffles: out-of-range lanes compute on zeros and
// skip their stores (hidden % 32 == 0 keeps every chunk inside one row and one warp).
#include "formats.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;
constexpr int kAccumulateBatch = 8;  // source rows loaded before they are summed (in order)

// Row / column of a flat unit index without a 64-bit (or a MUFU-based 32-bit) division: for 2 <= d < 2^31 and
// n < 2^31, floor(n / d) = umulhi(n, m) >> (p - 32) with l = ceil(log2 d), p = 31 + l, m = ceil(2^p / d).
// Proof: m = (2^p + e) / d with 0 <= e < d <= 2^l, so n m / 2^p = n / d + n e / (d 2^p) and the second term is
// < 2^31 2^l / (d 2^(31 + l)) = 1 / d; n / d = q + r / d with r <= d - 1, so the sum stays below q + 1 and its
// floor is q. m < 2^32 (d > 2^(l - 1), or m = 2^31 for d = 2^l) and floor(floor(x / 2^32) / 2^s) = floor(x / 2^(32 + s)).
// `fast` is false (plain 64-bit division) when some index may reach 2^31.
struct RowDiv {
  int64_t d = 1;
  uint32_t mul = 0;
  uint32_t shift = 0;
  bool fast = false;
};

RowDiv make_row_div(int64_t d, int64_t total) {
  RowDiv r;
  r.d = d;
  if (d >= 2 && d <= INT32_MAX && total <= INT32_MAX) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    const int p = 31 + l;
    r.mul = static_cast<uint32_t>(((uint64_t{1} << p) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
    r.shift = static_cast<uint32_t>(p - 32);
    r.fast = true;
  }
  return r;
}

// n must be a valid unit (0 <= n < total).
__device__ __forceinline__ int64_t row_of(int64_t n, const RowDiv& div) {
  if (div.fast) return static_cast<int64_t>(__umulhi(static_cast<uint32_t>(n), div.mul) >> div.shift);
  return n / div.d;
}

// rht_sign(v, sign_mask, first + k) for k = 0..7 with bits = sign_mask >> first: bit k of `bits` moved to bit 31
// (one shift and one LOP3 per value instead of a variable shift, a mask and a xor).
__device__ __forceinline__ void apply_signs8(float v[8], uint32_t bits) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = __uint_as_float(__float_as_uint(v[k]) ^ ((bits << (31 - k)) & 0x80000000u));
}

// RHT-32 of the lane's 8 values of a 4-lane chunk (elements (lane & 3) * 8 + k): the serial qm::rht32_forward /
// rht32_inverse's operations in the same order, with the FWHT split by qm::fwht32_lane8 and the signs by apply_signs8.
__device__ __forceinline__ void rht32_forward_lane8(float v[8], uint32_t sign_mask, int lane) {
  apply_signs8(v, sign_mask >> ((lane & 3) * 8));
  qm::fwht32_lane8(v, lane);
  const float c = __uint_as_float(qm::kRhtScaleBits);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = qm::qm_mul(v[k], c);
}

__device__ __forceinline__ void rht32_inverse_lane8(float v[8], uint32_t sign_mask, int lane) {
  qm::fwht32_lane8(v, lane);
  const float c = __uint_as_float(qm::kRhtScaleBits);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = qm::qm_mul(v[k], c);
  apply_signs8(v, sign_mask >> ((lane & 3) * 8));
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
__device__ __forceinline__ uint32_t s2f6_rounded_bits(float t) {
  t = qm::qm_max(qm::qm_min(t, 127.0f), -128.0f);
  return __float_as_uint(qm::qm_add(t, qm::kRoundMagic));
}

//  * for 6 <= b <= 253 the lower clamp is a no-op and the upper one only maps NaN: b = ue8m0_s2f6_scale(amax)
//    is the smallest e with amax * 2^(127 - e) <= 127/64 unless clamped to 0xFE (amax >= 2^127 * 127/64 or
//    Inf), and |v| <= amax for every value of the block, so |v * 2^(133 - b)| <= 127 and its rounding too
//    (127 is an fp32); min(t, 127) keeps such a t and turns NaN into 127, and t >= -127 > -128.
__device__ __forceinline__ uint2 pack_codes(const float v[8], uint8_t scale) {
  uint32_t s[8];
  if (scale >= 6 && scale <= 253) {
    const float multiplier = __uint_as_float((260u - scale) << 23);  // 2^(133 - b)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      s[k] = __float_as_uint(qm::qm_add(qm::qm_min(qm::qm_mul(v[k], multiplier), 127.0f), qm::kRoundMagic));
    }
  } else if (scale >= 6) {
    const float multiplier = __uint_as_float((260u - scale) << 23);  // 2^(133 - b), b = 254
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = s2f6_rounded_bits(qm::qm_mul(v[k], multiplier));
  } else {
    const float multiplier = qm::ue8m0_inverse(scale);  // 2^(127 - b), normal for b < 6
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = s2f6_rounded_bits(qm::qm_mul(qm::qm_mul(v[k], multiplier), 64.0f));
  }
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    words[w] = __byte_perm(__byte_perm(s[4 * w], s[4 * w + 1], 0x0040), __byte_perm(s[4 * w + 2], s[4 * w + 3], 0x0040),
                           0x5410);
  }
  return make_uint2(words[0], words[1]);
}
#endif

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
__device__ __forceinline__ void unpack_codes_fast(uint2 raw, uint8_t scale, float v[8]) {
  if (scale <= 237) {
    const uint32_t base = ((static_cast<uint32_t>(scale) + 17u) << 23) | 0x80u;
    const float bias = __uint_as_float(base);
    const uint32_t words[2] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      // byte 0 from byte k % 4 of the word, bytes 1..3 from base (0, then the exponent)
      v[k] = qm::qm_sub(__uint_as_float(__byte_perm(words[k / 4], base, 0x7650u | (k % 4))), bias);
    }
  } else {
    unpack_codes(raw, qm::s2f6_decode_multiplier(scale), v);
  }
}

// Dequantize: each thread takes kUnits 8-element units kThreads apart (the 4-lane groups stay aligned: kThreads % 32 ==
// 0) and issues all their loads before any math, for more bytes in flight per SM (measured 66.5% -> 83.0% of
// copy on an H200; the same change made quantize slower, 44.6% -> 38.5%, so quantize keeps one unit per thread).
constexpr int kUnits = 4;

template <typename T, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_quantize_kernel(S2f6QuantizeArgs args, int64_t groups_per_row,
                                                                 RowDiv div) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const bool valid = unit < args.num_rows * groups_per_row;
  int64_t row = 0;
  int64_t column = 0;
  float v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = 0.0f;
  if (valid) {
    row = row_of(unit, div);
    column = (unit - row * groups_per_row) * 8;
    vec::load_row_segment<T, 8>(static_cast<const T*>(args.x) + row * args.x_row_stride + column, v);
  }
  if (kHadamard) rht32_forward_lane8(v, args.sign_mask, lane);
  float local = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) local = qm::qm_max(local, qm::qm_abs(v[k]));
  const uint8_t scale = qm::ue8m0_s2f6_scale(qm::group4_max(local));
  if (!valid) return;
  *reinterpret_cast<uint2*>(args.data + row * args.data_row_stride + column) =
      pack_codes(v, scale);
  if ((lane & 3) == 0) args.scales[row * args.scales_row_stride + column / 32] = scale;
}

template <typename Out, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_dequantize_kernel(const int8_t* __restrict__ data,
                                                                   const uint8_t* __restrict__ scales,
                                                                   int64_t total_units, uint32_t sign_mask,
                                                                   Out* __restrict__ out) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnits) + threadIdx.x;
  uint2 raw[kUnits];
  uint8_t scale[kUnits];
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int64_t unit = base + i * kThreads;
    raw[i] = make_uint2(0u, 0u);
    scale[i] = 0;
    if (unit < total_units) {
      raw[i] = __ldg(reinterpret_cast<const uint2*>(data) + unit);
      scale[i] = __ldg(scales + unit / 4);
    }
  }
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int64_t unit = base + i * kThreads;
    const bool valid = unit < total_units;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.0f;
    if (valid) unpack_codes_fast(raw[i], scale[i], v);
    if (kHadamard) rht32_inverse_lane8(v, sign_mask, static_cast<int>(threadIdx.x % 32));
    if (valid) vec::store_row_segment<Out, 8>(out + unit * 8, v);
  }
}

template <typename Index, typename Out, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_accumulate_kernel(S2f6AccumulateArgs args, int64_t groups_per_row,
                                                                   RowDiv div) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = unit < args.num_out_rows * groups_per_row;
  const int64_t out_row = valid ? row_of(unit, div) : 0;
  const int64_t group = unit - out_row * groups_per_row;  // 8-element group within the row
  const Index* index_row = static_cast<const Index*>(args.row_index) + out_row * args.num_terms;
  const float* weight_row = args.weights != nullptr ? args.weights + out_row * args.num_terms : nullptr;
  const uint2* codes = reinterpret_cast<const uint2*>(args.data);

  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
  const int64_t num_terms = valid ? args.num_terms : 0;
  for (int64_t first = 0; first < num_terms; first += kAccumulateBatch) {
    // Issue the batch's loads first (memory parallelism), then add in ascending j (the NUMERICS order).
    // Three phases so that no load waits behind another batch member's: every index and weight of the batch
    // (independent of each other), then every code and scale (dependent on the indices only), then the math.
    int64_t src[kAccumulateBatch];
    float weight[kAccumulateBatch];
#pragma unroll
    for (int i = 0; i < kAccumulateBatch; ++i) {
      const int64_t j = first + i;
      src[i] = j < num_terms ? static_cast<int64_t>(__ldg(index_row + j)) : -1;
      // An in-bounds weight that is used only when the index is (unused terms are skipped below).
      weight[i] = (j < num_terms && weight_row != nullptr) ? __ldg(weight_row + j) : 1.0f;
    }
    uint2 raw[kAccumulateBatch];
    uint8_t scale[kAccumulateBatch];
    bool used[kAccumulateBatch];
#pragma unroll
    for (int i = 0; i < kAccumulateBatch; ++i) {
      used[i] = src[i] >= 0 && src[i] < args.num_src_rows;
      raw[i] = make_uint2(0u, 0u);
      scale[i] = 0;
      if (used[i]) {
        raw[i] = __ldg(codes + src[i] * groups_per_row + group);
        scale[i] = __ldg(args.scales + src[i] * (groups_per_row / 4) + group / 4);
      }
    }
#pragma unroll
    for (int i = 0; i < kAccumulateBatch; ++i) {
      if (!used[i]) continue;
      float v[8];
      unpack_codes_fast(raw[i], scale[i], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = qm::qm_add(acc[k], qm::qm_mul(weight[i], v[k]));
    }
  }
  if (kHadamard) rht32_inverse_lane8(acc, args.sign_mask, static_cast<int>(threadIdx.x % 32));
  if (valid) vec::store_row_segment<Out, 8>(static_cast<Out*>(args.out) + out_row * args.hidden + group * 8, acc);
}

}  // namespace

cudaError_t launch_s2f6_quantize(const S2f6QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  const int64_t groups_per_row = args.hidden / 8;
  const int64_t total = args.num_rows * groups_per_row;
  if (total == 0) return cudaSuccess;
  const int64_t grid = ceil_div(total, kThreads);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  const RowDiv div = make_row_div(groups_per_row, total);
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (args.hadamard) {
      s2f6_quantize_kernel<T, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, groups_per_row, div);
    } else {
      s2f6_quantize_kernel<T, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, groups_per_row, div);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_s2f6_dequantize(const int8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                   bool hadamard, uint32_t sign_mask, void* out, int out_type, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 32 != 0 || num_rows < 0) return cudaErrorInvalidValue;
  const int64_t total = num_rows * (hidden / 8);
  if (total == 0) return cudaSuccess;
  const int64_t grid = ceil_div(total, kThreads * kUnits);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(out_type, [&](auto tag) {
    using Out = decltype(tag);
    if (hadamard) {
      s2f6_dequantize_kernel<Out, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
          data, scales, total, sign_mask, static_cast<Out*>(out));
    } else {
      s2f6_dequantize_kernel<Out, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
          data, scales, total, sign_mask, static_cast<Out*>(out));
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_s2f6_dequantize_accumulate(const S2f6AccumulateArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_out_rows < 0 || args.num_terms < 0 ||
      args.num_src_rows < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t groups_per_row = args.hidden / 8;
  const int64_t total = args.num_out_rows * groups_per_row;
  if (total == 0) return cudaSuccess;
  const int64_t grid = ceil_div(total, kThreads);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  const RowDiv div = make_row_div(groups_per_row, total);
  return vec::dispatch_elem_type(args.out_type, [&](auto tag) {
    using Out = decltype(tag);
    const auto launch = [&](auto index_tag) {
      using Index = decltype(index_tag);
      if (args.hadamard) {
        s2f6_accumulate_kernel<Index, Out, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
            args, groups_per_row, div);
      } else {
        s2f6_accumulate_kernel<Index, Out, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
            args, groups_per_row, div);
      }
    };
    if (args.index_is_int64) {
      launch(int64_t{});
    } else {
      launch(int32_t{});
    }
    return cudaGetLastError();
  });
}

}  // namespace ep_comm
