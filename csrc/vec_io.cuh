// 16-byte vector loads/stores of bf16 / fp16 / fp32 rows, converted to and from fp32 registers.
// Widening to fp32 is exact; narrowing rounds to nearest even (cvt.rn, subnormals kept, no saturation).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "formats.h"

namespace ep_comm {
namespace vec {

// Element type traits: how many elements one 16-byte vector holds and how they widen / narrow.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 pack(const float* in) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void unpack_word(uint32_t w, float* out) {
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xFFFF0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    unpack_word(v.x, out);
    unpack_word(v.y, out + 2);
    unpack_word(v.z, out + 4);
    unpack_word(v.w, out + 6);
  }
  __device__ __forceinline__ static uint32_t pack_word(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // cvt.rn.bf16x2.f32: lo in the low half
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static uint4 pack(const float* in) {
    return make_uint4(pack_word(in[0], in[1]), pack_word(in[2], in[3]), pack_word(in[4], in[5]),
                      pack_word(in[6], in[7]));
  }
};

// max |x_i| of 16 bf16 values (two 16-byte vectors), NaN ignored as qm::block_amax16 does, Inf kept: on packed pairs
// (__hmax2 returns the non-NaN operand like fmaxf; |.| and max are exact, and widening the result is exact), 8 pair
// operations instead of 16. Both halves NaN only when every element of that half is NaN; block_amax16 starts from 0.
__device__ __forceinline__ float bf16_block16_amax(const uint4& lo, const uint4& hi) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  __nv_bfloat162 m = __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[0]));
#pragma unroll
  for (int i = 1; i < 8; ++i) m = __hmax2(m, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[i])));
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&m);
  return fmaxf(fmaxf(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u)), 0.0f);
}

template <>
struct Elem<__half> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void unpack_word(uint32_t w, float* out) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    out[0] = f.x;
    out[1] = f.y;
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    unpack_word(v.x, out);
    unpack_word(v.y, out + 2);
    unpack_word(v.z, out + 4);
    unpack_word(v.w, out + 6);
  }
  __device__ __forceinline__ static uint32_t pack_word(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static uint4 pack(const float* in) {
    return make_uint4(pack_word(in[0], in[1]), pack_word(in[2], in[3]), pack_word(in[4], in[5]),
                      pack_word(in[6], in[7]));
  }
};

// Read-only streaming load of 16 bytes (the inputs are read once).
__device__ __forceinline__ uint4 load16(const void* ptr) { return __ldg(reinterpret_cast<const uint4*>(ptr)); }
__device__ __forceinline__ void store16(void* ptr, const uint4& v) { *reinterpret_cast<uint4*>(ptr) = v; }

// N consecutive elements (N a multiple of the vector width) from `src` into fp32 registers.
template <typename T, int N>
__device__ __forceinline__ void load_row_segment(const T* src, float* out) {
  constexpr int kPer = Elem<T>::kPerVec;
  static_assert(N % kPer == 0, "segment must be whole 16-byte vectors");
  uint4 raw[N / kPer];
#pragma unroll
  for (int v = 0; v < N / kPer; ++v) raw[v] = load16(src + v * kPer);
#pragma unroll
  for (int v = 0; v < N / kPer; ++v) Elem<T>::unpack(raw[v], out + v * kPer);
}

template <typename T, int N>
__device__ __forceinline__ void store_row_segment(T* dst, const float* in) {
  constexpr int kPer = Elem<T>::kPerVec;
  static_assert(N % kPer == 0, "segment must be whole 16-byte vectors");
#pragma unroll
  for (int v = 0; v < N / kPer; ++v) store16(dst + v * kPer, Elem<T>::pack(in + v * kPer));
}

}  // namespace vec

// Launch-size helper shared by the format kernels' launchers.
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid of a persistent kernel: at most `wanted` blocks and no more than fit on the current device at once (the
// kernel's occupancy at `threads` per block and `dynamic_smem` bytes of dynamic shared memory), so every block is
// resident and walks its share of the work.
template <typename Kernel>
cudaError_t resident_grid(Kernel kernel, int threads, int64_t wanted, int64_t* blocks, size_t dynamic_smem = 0) {
  int device = 0, num_sms = 0, blocks_per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, dynamic_smem);
  }
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(num_sms) * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  *blocks = wanted < resident ? wanted : resident;
  return cudaSuccess;
}

// A kernel's one-time setup on the current device (its shared-memory opt-ins), once per device instead of on every
// launch: `configured` is the kernel's own flag word (bit d: device d done; devices past 63 configure every time),
// configure() returns a cudaError_t. Threads may race here (the bindings release the GIL): configuring twice is
// harmless.
template <typename Configure>
cudaError_t once_per_device(std::atomic<uint64_t>& configured, Configure configure) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (configured.load() & bit) != 0) return cudaSuccess;
  status = configure();
  if (status == cudaSuccess) configured.fetch_or(bit);
  return status;
}

// Row (and column) of a flat index without a 64-bit (or a MUFU-based 32-bit) division: for 2 <= d < 2^31 and
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

inline RowDiv make_row_div(int64_t d, int64_t total) {
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

namespace vec {

// Calls fn.template operator()<T>() with T the C++ type of an ElemType code.
template <typename Fn>
cudaError_t dispatch_elem_type(int elem_type, Fn&& fn) {
  switch (static_cast<ElemType>(elem_type)) {
    case ElemType::kFloat32:
      return fn(float{});
    case ElemType::kBFloat16:
      return fn(__nv_bfloat16{});
    case ElemType::kFloat16:
      return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace vec
}  // namespace ep_comm
