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
constexpr int kAccumulateBatch = 4;  // source rows loaded before they are summed (in order)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// Dequantize: each thread takes kUnits 8-element units kThreads apart (the 4-lane groups stay aligned: kThreads % 32 ==
// 0) and issues all their loads before any math, for more bytes in flight per SM (measured 66.5% -> 83.0% of
// copy on an H200; the same change made quantize slower, 44.6% -> 38.5%, so quantize keeps one unit per thread).
constexpr int kUnits = 4;

template <typename T, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_quantize_kernel(S2f6QuantizeArgs args, int64_t groups_per_row) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const bool valid = unit < args.num_rows * groups_per_row;
  int64_t row = 0;
  int64_t column = 0;
  float v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = 0.0f;
  if (valid) {
    row = unit / groups_per_row;
    column = (unit - row * groups_per_row) * 8;
    vec::load_row_segment<T, 8>(static_cast<const T*>(args.x) + row * args.x_row_stride + column, v);
  }
  if (kHadamard) qm::rht32_forward_lane8(v, args.sign_mask, lane);
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
    if (valid) unpack_codes(raw[i], qm::s2f6_decode_multiplier(scale[i]), v);
    if (kHadamard) qm::rht32_inverse_lane8(v, sign_mask, static_cast<int>(threadIdx.x % 32));
    if (valid) vec::store_row_segment<Out, 8>(out + unit * 8, v);
  }
}

template <typename Index, typename Out, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_accumulate_kernel(S2f6AccumulateArgs args, int64_t groups_per_row) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = unit < args.num_out_rows * groups_per_row;
  const int64_t out_row = valid ? unit / groups_per_row : 0;
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
    uint2 raw[kAccumulateBatch];
    uint8_t scale[kAccumulateBatch];
    float weight[kAccumulateBatch];
    bool used[kAccumulateBatch];
#pragma unroll
    for (int i = 0; i < kAccumulateBatch; ++i) {
      const int64_t j = first + i;
      const int64_t src = j < num_terms ? static_cast<int64_t>(__ldg(index_row + j)) : -1;
      used[i] = src >= 0 && src < args.num_src_rows;
      weight[i] = (used[i] && weight_row != nullptr) ? __ldg(weight_row + j) : 1.0f;
      if (used[i]) {
        raw[i] = __ldg(codes + src * groups_per_row + group);
        scale[i] = __ldg(args.scales + src * (groups_per_row / 4) + group / 4);
      }
    }
#pragma unroll
    for (int i = 0; i < kAccumulateBatch; ++i) {
      if (!used[i]) continue;
      float v[8];
      unpack_codes(raw[i], qm::s2f6_decode_multiplier(scale[i]), v);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = qm::qm_add(acc[k], qm::qm_mul(weight[i], v[k]));
    }
  }
  if (kHadamard) qm::rht32_inverse_lane8(acc, args.sign_mask, static_cast<int>(threadIdx.x % 32));
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
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (args.hadamard) {
      s2f6_quantize_kernel<T, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, groups_per_row);
    } else {
      s2f6_quantize_kernel<T, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, groups_per_row);
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
  return vec::dispatch_elem_type(args.out_type, [&](auto tag) {
    using Out = decltype(tag);
    const auto launch = [&](auto index_tag) {
      using Index = decltype(index_tag);
      if (args.hadamard) {
        s2f6_accumulate_kernel<Index, Out, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
            args, groups_per_row);
      } else {
        s2f6_accumulate_kernel<Index, Out, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
            args, groups_per_row);
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
