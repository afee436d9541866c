// MXFP8 quantize (nearest / stochastic), dequantize, and NVFP4 -> transposed MXFP8 requantization.
// Arithmetic: quant_math.cuh (docs/NUMERICS.md, "MXFP8" and "Random bits").
//
// Quantize / dequantize: one thread per 32-element block, consecutive threads on consecutive blocks, so
// a warp moves 2 KiB (bf16 in) and 1 KiB (codes out) of contiguous memory with 16-byte accesses.
#include <algorithm>

#include "formats.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;

// Encodes 32 fp32 values with the block's encode multiplier p = 2^(127 - b); SR draws rbits(key, index0 + j).
// index0 is a multiple of 32 (row * K + column with K % 32 == 0; k * R + rb with R % 32 == 0), so the hash
// work shared by the block's 32 indices is done once (rbits_block / rbits_in_block: the same bits).
template <bool kStochastic>
__device__ __forceinline__ void mxfp8_encode32(const float x[32], float p, uint32_t key, int64_t index0,
                                               uint4 out[2]) {
  const qm::RbitsBlock hash = qm::rbits_block(key, static_cast<uint64_t>(index0));
  uint32_t words[8];
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = qm::qm_mul(x[4 * w + k], p);
      if (kStochastic) v[k] = qm::sr_e4m3(v[k], qm::rbits_in_block(hash, static_cast<uint32_t>(4 * w + k)));
    }
    words[w] = static_cast<uint32_t>(qm::e4m3x2_encode(v[0], v[1])) |
               (static_cast<uint32_t>(qm::e4m3x2_encode(v[2], v[3])) << 16);
  }
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

__device__ __forceinline__ float abs_max32(const float x[32]) {
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) a = qm::qm_max(a, qm::qm_abs(x[j]));
  return a;
}

template <typename T, bool kStochastic>
__global__ void __launch_bounds__(kThreads) mxfp8_quantize_kernel(Mxfp8QuantizeArgs args, int64_t blocks_per_row,
                                                                  uint32_t key) {
  const int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (block >= args.num_rows * blocks_per_row) return;
  const int64_t row = block / blocks_per_row;
  const int64_t column = (block - row * blocks_per_row) * 32;
  float x[32];
  vec::load_row_segment<T, 32>(static_cast<const T*>(args.x) + row * args.x_row_stride + column, x);
  const uint8_t scale = qm::ue8m0_mxfp8_scale(abs_max32(x));
  uint4 codes[2];
  mxfp8_encode32<kStochastic>(x, qm::ue8m0_inverse(scale), key, row * args.hidden + column, codes);
  uint8_t* dst = args.data + row * args.data_row_stride + column;
  vec::store16(dst, codes[0]);
  vec::store16(dst + 16, codes[1]);
  args.scales[row * args.scales_row_stride + column / 32] = scale;
}

// Dequantize: one 8-element chunk (8 code bytes -> 8 outputs) per step, consecutive lanes on consecutive
// chunks, so every warp access is contiguous (256 B of codes, 512 B of bf16 out per instruction); a thread
// takes kDequantChunks chunks kThreads apart and issues all their loads before any math (MLP).
constexpr int kDequantChunks = 4;

template <typename Out>
__global__ void __launch_bounds__(kThreads) mxfp8_dequantize_kernel(const uint8_t* __restrict__ data,
                                                                    const uint8_t* __restrict__ scales,
                                                                    int64_t total_chunks, Out* __restrict__ out) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kDequantChunks) + threadIdx.x;
  uint2 raw[kDequantChunks];
  uint8_t scale[kDequantChunks];
#pragma unroll
  for (int i = 0; i < kDequantChunks; ++i) {
    const int64_t c = base + i * kThreads;
    if (c < total_chunks) {
      raw[i] = __ldg(reinterpret_cast<const uint2*>(data) + c);
      scale[i] = __ldg(scales + c / 4);
    }
  }
#pragma unroll
  for (int i = 0; i < kDequantChunks; ++i) {
    const int64_t c = base + i * kThreads;
    if (c >= total_chunks) continue;
    const float multiplier = qm::ue8m0_to_float(scale[i]);
    const uint32_t words[2] = {raw[i].x, raw[i].y};
    float y[8];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      qm::e4m3x2_decode(static_cast<uint16_t>(words[w] & 0xFFFFu), y[4 * w], y[4 * w + 1]);
      qm::e4m3x2_decode(static_cast<uint16_t>(words[w] >> 16), y[4 * w + 2], y[4 * w + 3]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = qm::qm_mul(y[j], multiplier);
    vec::store_row_segment<Out, 8>(out + c * 8, y);
  }
}

// NVFP4 [R, K] -> MXFP8 [K, R]. A CTA takes a tile of kTileRows input rows x kTileCols columns:
//  phase 1: thread t dequantizes input row r0 + t (32 code bytes, 4 scales) into smem, transposed;
//  phase 2: each (output row k, 32-row block) pair is one MX block: amax, scale, encode, 32-byte store;
//  phase 3: the tile's 4 scale bytes of each output row k (row blocks r0/32 .. r0/32 + 3, adjacent in
//           out_scales) go out as one 4-byte store (when the tile is full and R % 128 == 0, so the word is
//           aligned) instead of 4 byte stores R/32 bytes apart.
// The smem row pitch kTileRows + 1 keeps both phases free of bank conflicts.
constexpr int kTileRows = 128;
constexpr int kTileCols = 64;
constexpr int kTilePitch = kTileRows + 1;

template <bool kStochastic>
__global__ void __launch_bounds__(kTileRows) nvfp4_to_mxfp8_transposed_kernel(
    const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, const float* __restrict__ amax,
    int64_t num_rows, int64_t hidden, float e4m3_max, uint32_t key, uint8_t* __restrict__ out_data,
    uint8_t* __restrict__ out_scales) {
  __shared__ float tile[kTileCols * kTilePitch];
  __shared__ uint32_t tile_scales[kTileCols];  // byte j of word c: scale of output row k0 + c, row block j
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const int t = threadIdx.x;

  const int64_t r = r0 + t;
  if (r < num_rows) {
    const float row_amax = __ldg(amax + r);
    // 16-column blocks: 8 code bytes each (8-byte aligned because K % 16 == 0).
#pragma unroll
    for (int blk = 0; blk < kTileCols / 16; ++blk) {
      const int64_t k = k0 + blk * 16;
      if (k >= hidden) break;
      const uint2 word = __ldg(reinterpret_cast<const uint2*>(data + r * (hidden / 2) + k / 2));
      const float final_scale = qm::nvfp4_dequant_scale(__ldg(scales + r * (hidden / 16) + k / 16), row_amax,
                                                        e4m3_max);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t byte = ((i < 4 ? word.x : word.y) >> (8 * (i % 4))) & 0xFFu;
        tile[(blk * 16 + 2 * i) * kTilePitch + t] = qm::qm_mul(qm::e2m1_decode(byte & 0xF), final_scale);
        tile[(blk * 16 + 2 * i + 1) * kTilePitch + t] = qm::qm_mul(qm::e2m1_decode(byte >> 4), final_scale);
      }
    }
  }
  __syncthreads();

#pragma unroll
  for (int pass = 0; pass < kTileCols * (kTileRows / 32) / kTileRows; ++pass) {
    const int unit = t + pass * kTileRows;
    const int col = unit % kTileCols;      // output row within the tile: consecutive lanes, distinct banks
    const int row_block = unit / kTileCols;  // which 32 input rows
    const int64_t k = k0 + col;
    const int64_t rb = r0 + row_block * 32;
    if (k >= hidden || rb >= num_rows) continue;
    float x[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) x[j] = tile[col * kTilePitch + row_block * 32 + j];
    const uint8_t scale = qm::ue8m0_mxfp8_scale(abs_max32(x));
    uint4 codes[2];
    mxfp8_encode32<kStochastic>(x, qm::ue8m0_inverse(scale), key, k * num_rows + rb, codes);
    uint8_t* dst = out_data + k * num_rows + rb;
    vec::store16(dst, codes[0]);
    vec::store16(dst + 16, codes[1]);
    reinterpret_cast<uint8_t*>(tile_scales)[col * 4 + row_block] = scale;
  }
  __syncthreads();

  constexpr int kRowBlocks = kTileRows / 32;
  if (t < kTileCols && k0 + t < hidden) {
    const int64_t k = k0 + t;
    const int64_t row_blocks = num_rows / 32;
    uint8_t* dst = out_scales + k * row_blocks + r0 / 32;
    const uint32_t word = tile_scales[t];
    if (r0 + kTileRows <= num_rows && row_blocks % kRowBlocks == 0 &&
        (reinterpret_cast<uintptr_t>(out_scales) & 3u) == 0) {
      *reinterpret_cast<uint32_t*>(dst) = word;  // r0 / 32 is a multiple of 4: aligned
    } else {
      for (int j = 0; j < kRowBlocks && r0 + 32 * j < num_rows; ++j) dst[j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
}

}  // namespace

cudaError_t launch_mxfp8_quantize(const Mxfp8QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  const int64_t blocks_per_row = args.hidden / 32;
  const int64_t total = args.num_rows * blocks_per_row;
  if (total == 0) return cudaSuccess;
  const int64_t grid = ceil_div(total, kThreads);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  const uint32_t key = qm::sr_key(args.seed);
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (args.stochastic) {
      mxfp8_quantize_kernel<T, true><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, blocks_per_row, key);
    } else {
      mxfp8_quantize_kernel<T, false><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args, blocks_per_row, key);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_mxfp8_dequantize(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                    void* out, int out_type, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 32 != 0 || num_rows < 0) return cudaErrorInvalidValue;
  const int64_t total = num_rows * (hidden / 8);  // 8-element chunks
  if (total == 0) return cudaSuccess;
  const int64_t grid = ceil_div(total, kThreads * kDequantChunks);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(out_type, [&](auto tag) {
    using Out = decltype(tag);
    mxfp8_dequantize_kernel<Out><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(data, scales, total,
                                                                                       static_cast<Out*>(out));
    return cudaGetLastError();
  });
}

cudaError_t launch_nvfp4_to_mxfp8_transposed(const uint8_t* data, const uint8_t* scales, const float* amax,
                                             int64_t num_rows, int64_t hidden, float e4m3_max, bool stochastic,
                                             uint64_t seed, uint8_t* out_data, uint8_t* out_scales,
                                             cudaStream_t stream) {
  if (hidden <= 0 || hidden % 16 != 0 || num_rows < 0 || num_rows % 32 != 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const int64_t grid_rows = ceil_div(num_rows, kTileRows);
  const int64_t grid_cols = ceil_div(hidden, kTileCols);
  if (grid_rows > INT32_MAX || grid_cols > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(grid_rows), static_cast<unsigned>(grid_cols));
  const uint32_t key = qm::sr_key(seed);
  if (stochastic) {
    nvfp4_to_mxfp8_transposed_kernel<true><<<grid, kTileRows, 0, stream>>>(data, scales, amax, num_rows, hidden,
                                                                           e4m3_max, key, out_data, out_scales);
  } else {
    nvfp4_to_mxfp8_transposed_kernel<false><<<grid, kTileRows, 0, stream>>>(data, scales, amax, num_rows, hidden,
                                                                            e4m3_max, key, out_data, out_scales);
  }
  return cudaGetLastError();
}

}  // namespace ep_comm
