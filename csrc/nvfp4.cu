// NVFP4 quantize (4/6 or plain) and dequantize kernels. Arithmetic: quant_math.cuh (docs/NUMERICS.md).
//
// Quantize layout: a CTA holds `rows_per_cta` rows, `threads_per_row` threads each (a multiple of 32).
// Thread t of a row owns the 16-element blocks t, t + T, t + 2T, ... (T = threads_per_row), so a warp
// reads 32 consecutive blocks (1 KiB of bf16) per load instruction pair and writes 256 consecutive bytes
// of codes. When the row fits in registers (Shape::kRawBytes per thread, at most Shape::kMaxThreads threads:
// K <= 8192 bf16 for 4/6, 16384 for plain by default) it is read from HBM once and kept in registers while
// the row amax is reduced; longer rows take a second pass (L2).
//
// Tried and measured slower on H200 (fourth session): a persistent grid that stages the next row group in
// shared memory with cp.async while quantizing the current one (4/6 240 -> 299 us, plain 131 -> 175 us).

#include <algorithm>
#include <type_traits>

#include "env_choice.h"
#include "formats.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

// Thread shape of the quantize kernel: each thread keeps kRawBytes of raw input per round in registers (128:
// 4 bf16 / 2 fp32 blocks), a row takes at most kMaxThreads threads, and the kernel is compiled for min_ctas()
// CTAs of kMaxThreads per SM (the register budget). Measured on H200 (bench/RESULTS.md, fourth and fifteenth
// sessions): plain takes occupancy (4 CTAs: 97.4 us on 64 MiB against 105.3 with 3 CTAs and 80 registers -- with
// codes packed by pair conversions the plain path fits 64 registers without spills), 4/6 takes two blocks per thread
// at 3 CTAs (its two candidates need the 80 registers: 220 us against 400 at 64 registers): narrow for bf16 / fp16,
// occupancy for fp32 (1.14x faster than narrow's one block per thread although it spills ~50 bytes; sixteenth
// session). Since the sixteenth session's instruction cuts, narrow 4/6 fits 72 registers with few spills (ptxas,
// nvcc 13.0: 40 bytes stored, 68 loaded -- row constants such as the outer scales), so a 7168-wide bf16 row's CTA of
// 224 threads runs 4 per SM instead of 3: 189.4 -> 183.0 us (same-call A/B).
// kMinCtasHeavyArg: the CTAs per SM for the kernels that need more registers -- fp16 input and 4/6.
// kRegisters46Arg (nonzero): the register cap of the 4/6 kernels, instead of what kMinCtasHeavyArg CTAs of
// kMaxThreadsArg threads allow -- so that shorter CTAs (a 7168-wide bf16 row takes 224 threads) fit one more per SM.
template <int kRawBytesArg, int kMaxThreadsArg, int kMinCtasArg, int kMinCtasHeavyArg = kMinCtasArg,
          int kRegisters46Arg = 0>
struct QuantShape {
  static constexpr int kRawBytes = kRawBytesArg;
  static constexpr int kMaxThreads = kMaxThreadsArg;
  template <typename T>
  static constexpr int blocks_per_thread() {
    return kRawBytes / (16 * static_cast<int>(sizeof(T)));
  }
  // 4/6 takes kMinCtasHeavyArg for every input type: its two candidates need the registers (a forced occupancy
  // shape then builds the same 4/6 kernel as before the 4-CTA plain form).
  template <typename T, bool kFourOverSix>
  static constexpr int min_ctas() {
    return std::is_same<T, __half>::value || kFourOverSix ? kMinCtasHeavyArg : kMinCtasArg;
  }
  // Registers per thread (__maxnreg__): what min_ctas() CTAs of kMaxThreads threads allow (the cap a minimum block
  // count in __launch_bounds__ sets), or kRegisters46Arg for 4/6.
  template <typename T, bool kFourOverSix>
  static constexpr int max_registers() {
    constexpr int kFit = 65536 / (kMaxThreads * min_ctas<T, kFourOverSix>());
    return kFourOverSix && kRegisters46Arg != 0 ? kRegisters46Arg : (kFit > 255 ? 255 : kFit & ~7);
  }
};
using WideShape = QuantShape<128, 512, 1>;       // fewest threads, most registers (rows up to 32768 bf16)
using OccupancyShape = QuantShape<128, 256, 4, 3>;  // plain: 4 CTAs of 256 threads per SM (<= 64 registers); fp16
                                                    // and 4/6: 3 (they spill at 64; fp16's amax and signs go
                                                    // through fp32)
using NarrowShape = QuantShape<64, 256, 3, 3, 72>;  // half the raw registers, twice the threads per row; 4/6 at 72
                                                     // registers: 4 CTAs of 224 threads (7168-wide bf16 rows)
constexpr int kTargetCtaThreads = 256;

// Raw 16-byte vectors of one 16-element block (2 for bf16/fp16, 4 for fp32).
template <typename T>
struct RawBlock16 {
  static constexpr int kVecs = 16 / vec::Elem<T>::kPerVec;
  uint4 raw[kVecs];

  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) raw[v] = vec::load16(src + v * vec::Elem<T>::kPerVec);
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) raw[v] = make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void unpack(float x[16]) const {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) vec::Elem<T>::unpack(raw[v], x + v * vec::Elem<T>::kPerVec);
  }
  // max |x_i| with NaN ignored (qm::block_amax16's value); bf16 on packed pairs (vec::bf16_block16_amax), fp16 and
  // fp32 through fp32.
  __device__ __forceinline__ float amax() const {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      return vec::bf16_block16_amax(raw[0], raw[1]);
    } else {
      float x[16];
      unpack(x);
      return qm::block_amax16(x);
    }
  }
  // The block's sign bytes for the fast paths' packing (qm::sign_bytes4_16bit: one byte permute per 4 elements), in
  // `out` for 16-bit inputs; nullptr for fp32 inputs, whose signs the quantizer takes from the unpacked values.
  __device__ __forceinline__ const uint32_t* sign_bytes(uint32_t out[4]) const {
    if constexpr (sizeof(T) == 2) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
#pragma unroll
      for (int q = 0; q < 4; ++q) out[q] = qm::sign_bytes4_16bit(w[2 * q], w[2 * q + 1]);
      return out;
    } else {
      return nullptr;
    }
  }
};

// Max over the threads of one row (threads_per_row consecutive threads of threadIdx.x). All threads of
// the CTA must call it (it synchronizes when a row spans several warps). kMaxWarps: the most warps a row spans
// (Shape::kMaxThreads / 32). The row's warp maxima are read by a fixed, unrolled sequence of kMaxWarps predicated
// loads: a loop over warps_per_row compiled to unrolled-by-16/8/4 bodies plus a remainder loop, ~60 instructions per
// warp for 7 warps where this takes ~25 (the 4/6 kernel executes ~1000 per warp).
template <int kMaxWarps>
__device__ __forceinline__ float row_max(float v, float* warp_max) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) v = qm::qm_max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  const int warps_per_row = blockDim.x / 32;
  if (warps_per_row == 1) return v;
  float* row_warps = warp_max + threadIdx.y * warps_per_row;  // this row's warps' slots
  if (threadIdx.x % 32 == 0) row_warps[threadIdx.x / 32] = v;
  __syncthreads();
  float row = 0.0f;
#pragma unroll
  for (int w = 0; w < kMaxWarps; ++w) {
    if (w < warps_per_row) row = qm::qm_max(row, row_warps[w]);
  }
  return row;
}

// Block values (args.block_values) for the grouped GEMM: the e2m1 * e4m3 values of a block, decoded from its codes and
// scale exactly as nvfp4_dequantize_kernel does with amax == nullptr and fp16 out (same functions, so the same bits as
// quantize + expand_nvfp4_rows).
__device__ __forceinline__ void store_block_values(const uint32_t words[2], uint8_t scale_byte, __half* dst) {
  const float scale = qm::e4m3_decode(scale_byte);
  float y[16];
  qm::e2m1x8_decode_scaled(words[0], scale, y);
  qm::e2m1x8_decode_scaled(words[1], scale, y + 8);
  vec::store_row_segment<__half, 16>(dst, y);
}

// The grouped GEMM's inexact FP8 operand block (ep_comm/grouped_gemm.py, precision "fp8_inexact") of one NVFP4 block
// (code words, scale byte; qm::fp8_operand_pairs8), stored column o holding column 2 (o / 4) + o % 2 + 8 ((o % 4) / 2):
// the order in which the GEMM's fp16 weight fragments feed wgmma's E4M3 steps (grouped_gemm.cu, convert_fp8). The
// expansion kernel and the quantizer's FP8 form both write it.
__device__ __forceinline__ uint4 fp8_operand_block(uint32_t word_lo, uint32_t word_hi, uint8_t scale_byte) {
  const float scale = qm::fp8_operand_scale(scale_byte);
  uint32_t lo[4], hi[4];  // columns 2q, 2q + 1 and 2q + 8, 2q + 9
  qm::fp8_operand_pairs8(word_lo, scale, lo);
  qm::fp8_operand_pairs8(word_hi, scale, hi);
  // stored columns 4q .. 4q + 3 hold columns 2q, 2q + 1, 2q + 8, 2q + 9
  return make_uint4(lo[0] | (hi[0] << 16), lo[1] | (hi[1] << 16), lo[2] | (hi[2] << 16), lo[3] | (hi[3] << 16));
}

// kBlockValues: write args.block_values and args.row_factor instead of codes, scales and amax (4/6 only); kFp8Values:
// in the FP8 operand form (args.block_values_fp8; its own instantiation, so the fp16 form's code is unchanged).
template <typename T, bool kFourOverSix, typename Shape, bool kBlockValues = false, bool kFp8Values = false>
__global__ void __launch_bounds__(Shape::kMaxThreads) __maxnreg__((Shape::template max_registers<T, kFourOverSix>()))
    nvfp4_quantize_kernel(Nvfp4QuantizeArgs args, float inv_six_m,  // qm::nvfp4_inv_six_m(M), from the host
                          int64_t prefetch_rows_ahead) {                // 0, or l2_prefetch_rows_ahead's distance
  static_assert(!kBlockValues || kFourOverSix, "block values are the 4/6 form only");
  static_assert(!kFp8Values || kBlockValues, "the FP8 form is a block-values form");
  __shared__ float warp_max[Shape::kMaxThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // The rows this launch quantizes: num_rows, or fewer where the device says so (grouped GEMM, waves); read once, for
  // the row test and the prefetch (which would otherwise read rows past the limit that nobody quantizes).
  const int64_t rows_in_use =
      args.num_rows_limit == nullptr ? args.num_rows : std::min<int64_t>(args.num_rows, __ldg(args.num_rows_limit));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The row that a CTA one wave later will quantize, into L2: one bulk prefetch per row, no registers or waits (the
  // launcher caps the distance against the L2 size; see l2_prefetch_rows_ahead).
  if (prefetch_rows_ahead > 0 && threadIdx.x == 0 && row + prefetch_rows_ahead < rows_in_use) {
    const T* ahead = static_cast<const T*>(args.x) + (row + prefetch_rows_ahead) * args.x_row_stride;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(ahead),
                 "r"(static_cast<uint32_t>(args.hidden * static_cast<int64_t>(sizeof(T))))
                 : "memory");
  }
#endif
  const bool row_valid = row < rows_in_use;
  const int num_blocks = static_cast<int>(args.hidden / 16);
  const int threads_per_row = blockDim.x;
  constexpr int kBlocksPerThread = Shape::template blocks_per_thread<T>();
  const int per_round = threads_per_row * kBlocksPerThread;
  const bool single_round = num_blocks <= per_round;
  const T* x_row = static_cast<const T*>(args.x) + (row_valid ? row : 0) * args.x_row_stride;

  RawBlock16<T> blocks[kBlocksPerThread];
  float block_amax[kBlocksPerThread];  // kept from the amax pass when the row is held in registers
  auto load_round = [&](int first) {
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = first + threadIdx.x + i * threads_per_row;
      if (row_valid && b < num_blocks) {
        blocks[i].load(x_row + static_cast<int64_t>(b) * 16);
      } else if (kFourOverSix && first == 0) {
        blocks[i].clear();  // 4/6: quantized below with the others (straight-line), never stored
      }
    }
  };
  auto round_amax = [&](int first) {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = first + threadIdx.x + i * threads_per_row;
      block_amax[i] = row_valid && b < num_blocks ? blocks[i].amax() : 0.0f;
      a = qm::qm_max(a, block_amax[i]);
    }
    return a;
  };

  if (single_round) load_round(0);
  float amax;
  if (args.amax_in == nullptr) {
    float local = 0.0f;
    if (single_round) {
      local = round_amax(0);
    } else {
      for (int first = 0; first < num_blocks; first += per_round) {
        load_round(first);
        local = qm::qm_max(local, round_amax(first));
      }
    }
    amax = row_max<Shape::kMaxThreads / 32>(local, warp_max);  // NaN-free: fmaxf ignores NaN elements
  } else {
    amax = row_valid ? args.amax_in[row] : 0.0f;
  }
  if (!row_valid) return;  // no barrier follows
  const int64_t dst = args.dst_rows != nullptr ? args.dst_rows[row] : row;
  if (dst < 0) return;

  const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax, args.e4m3_max, inv_six_m);
  uint8_t* data_row = args.data + dst * args.data_row_stride;
  uint8_t* scale_row = args.scales + dst * args.scales_row_stride;
  // Block values: fp16 (2 bytes per element) or, FP8 form, E4M3 bytes.
  uint8_t* values_row =
      static_cast<uint8_t*>(args.block_values) + dst * args.block_values_row_stride * (kFp8Values ? 1 : 2);
  if (threadIdx.x == 0) {
    // expand_nvfp4_rows' row factor: amax * fp32(1 / (6 M)), the constant rounded once from double as torch does
    // (times 8 in the FP8 form, exact: its values carry 2^-3).
    if (kBlockValues) {
      const float factor = qm::qm_mul(amax, static_cast<float>(1.0 / (6.0 * static_cast<double>(args.e4m3_max))));
      args.row_factor[dst] = kFp8Values ? factor * 8.0f : factor;
    } else if (args.amax_out != nullptr) {
      args.amax_out[dst] = amax;
    }
  }

  const bool amax_kept = single_round && args.amax_in == nullptr;
  auto this_block_amax = [&](int i) { return amax_kept ? block_amax[i] : blocks[i].amax(); };
  for (int first = 0; first < num_blocks; first += per_round) {
    if (!single_round) load_round(first);
    // 4/6: every block of the round through the straight-line fast path first, so that their instructions interleave
    // (each candidate's error sum is a dependent chain): 231 -> 220 us on H200 (fourteenth session); then the general
    // form where the fast path did not decide, and the stores. Plain: block by block (interleaving its 4 blocks
    // spilled registers and measured 22% slower).
    if constexpr (kFourOverSix) {
      qm::Nvfp4BlockFast fast[kBlocksPerThread];
#pragma unroll
      for (int i = 0; i < kBlocksPerThread; ++i) {
        float x[16];
        blocks[i].unpack(x);
        uint32_t signs[4];
        fast[i] = qm::nvfp4_four_six_block16_fast(x, this_block_amax(i), outer, amax, blocks[i].sign_bytes(signs));
      }
#pragma unroll
      for (int i = 0; i < kBlocksPerThread; ++i) {
        const int b = first + threadIdx.x + i * threads_per_row;
        if (b >= num_blocks) continue;
        if (!fast[i].decided) {  // by value: `fast` is never address-taken and stays in registers
          float x[16];
          blocks[i].unpack(x);
          fast[i] = qm::nvfp4_four_six_block16_general_value(x, this_block_amax(i), outer, amax, args.e4m3_max);
        }
        if constexpr (kBlockValues) {
          if constexpr (kFp8Values) {
            reinterpret_cast<uint4*>(values_row)[b] =
                fp8_operand_block(fast[i].words[0], fast[i].words[1], fast[i].scale);
          } else {
            store_block_values(fast[i].words, fast[i].scale,
                               reinterpret_cast<__half*>(values_row) + static_cast<int64_t>(b) * 16);
          }
        } else {
          *reinterpret_cast<uint2*>(data_row + static_cast<int64_t>(b) * 8) =
              make_uint2(fast[i].words[0], fast[i].words[1]);
          scale_row[b] = fast[i].scale;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlocksPerThread; ++i) {
        const int b = first + threadIdx.x + i * threads_per_row;
        if (b >= num_blocks) continue;
        float x[16];
        blocks[i].unpack(x);
        uint32_t words[2];
        uint8_t scale;
        uint32_t signs[4];
        qm::nvfp4_quantize_block16_words(x, this_block_amax(i), outer, amax, args.e4m3_max, false, words, &scale,
                                         nullptr, blocks[i].sign_bytes(signs));
        *reinterpret_cast<uint2*>(data_row + static_cast<int64_t>(b) * 8) = make_uint2(words[0], words[1]);
        scale_row[b] = scale;
      }
    }
  }
}

// The 16-element block of this thread in the one-thread-per-block decode kernels (below): its index and row, or
// false past the last block or at / past the device row limit.
__device__ __forceinline__ bool decode_block_of_thread(int64_t num_rows, int64_t blocks_per_row, RowDiv row_div,
                                                       const int32_t* num_rows_limit, int64_t* block, int64_t* row) {
  *block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (*block >= num_rows * blocks_per_row) return false;
  *row = row_of(*block, row_div);
  return num_rows_limit == nullptr || *row < __ldg(num_rows_limit);
}

// One thread per 16-element block: 8 code bytes + 1 scale byte -> 16 outputs. inv_six_m = qm::nvfp4_inv_six_m(M),
// computed once by the launcher; row_div divides by blocks_per_row without a 64-bit division per thread.
template <typename Out>
__global__ void __launch_bounds__(256) nvfp4_dequantize_kernel(const uint8_t* __restrict__ data,
                                                               const uint8_t* __restrict__ scales,
                                                               const float* __restrict__ amax, int64_t num_rows,
                                                               int64_t blocks_per_row, RowDiv row_div,
                                                               float inv_six_m, Out* __restrict__ out,
                                                               const int32_t* __restrict__ num_rows_limit) {
  int64_t block = 0, row = 0;
  if (!decode_block_of_thread(num_rows, blocks_per_row, row_div, num_rows_limit, &block, &row)) return;
  const uint2 word = __ldg(reinterpret_cast<const uint2*>(data) + block);
  // amax == nullptr: block values only (e2m1 * e4m3, exact in fp16) -- the grouped GEMM's activation operand,
  // whose per-row outer scale is applied in the GEMM epilogue instead.
  const float scale = qm::e4m3_decode(__ldg(scales + block));
  const float final_scale = amax == nullptr ? scale : qm::nvfp4_dequant_scale_from(scale, __ldg(amax + row), inv_six_m);
  // Per-code decode (integer ops + one FMUL per value): measured 85.6% of copy on H200 against 72.4% with
  // qm::nvfp4_block_decode's hardware E4M3 pair decode (2026-11-30), which the transposed kernel's decode also uses.
  float y[16];
  qm::e2m1x8_decode_scaled(word.x, final_scale, y);
  qm::e2m1x8_decode_scaled(word.y, final_scale, y + 8);
  vec::store_row_segment<Out, 16>(out + block * 16, y);
}

// The grouped GEMM's inexact FP8 operand rows (ep_comm/grouped_gemm.py, precision "fp8_inexact") of NVFP4 rows:
// fp8_operand_block per 16-block. One thread per block, one 16-byte store.
__global__ void __launch_bounds__(256) nvfp4_expand_fp8_kernel(const uint8_t* __restrict__ data,
                                                               const uint8_t* __restrict__ scales, int64_t num_rows,
                                                               int64_t blocks_per_row, RowDiv row_div,
                                                               uint8_t* __restrict__ out,
                                                               const int32_t* __restrict__ num_rows_limit) {
  int64_t block = 0, row = 0;
  if (!decode_block_of_thread(num_rows, blocks_per_row, row_div, num_rows_limit, &block, &row)) return;
  const uint2 word = __ldg(reinterpret_cast<const uint2*>(data) + block);
  reinterpret_cast<uint4*>(out)[block] = fp8_operand_block(word.x, word.y, __ldg(scales + block));
}

// EP_COMM_NVFP4_PREFETCH = on (default) | off: the 4/6 codes kernel prefetches into L2 the row that a CTA one wave
// later (every CTA the device holds at once) will quantize, so that wave finds its rows in L2 instead of waiting on
// HBM at its start, when every warp of the SM loads at once. One wave, capped at half the L2: two waves ahead measured
// slower (+4.5% for bf16 rows, +48% for fp32 rows, whose prefetched rows outran the 50 MB L2). One wave, same-call
// A/B on one H100 (bench/RESULTS.md, seventy-seventh session): fp32 rows 2.9% faster, bf16 rows with the amax given
// 1.6%, bf16 rows 0.5% (within the spread; 1.7% in the seventy-sixth session's uncapped experiment).
// *rows_ahead = 0 (no prefetch) when off, or when the launch has no second wave. Host cost per 4/6 launch: the
// current device and its SM count; where the CTAs outnumber the SMs, an occupancy query too (resident_grid; not
// cached: the occupancy depends on the row width's CTA shape) and, past one wave, the L2 size: ~0.5-0.8 us per launch
// past one wave, measured (one H100, eighty-first session: 4.8-5.2 us per launch with the prefetch on, 4.3-4.4 off).
// None of these is a stream operation, so CUDA graph capture is unaffected.
bool l2_prefetch_on() {
  static const bool on = env_choice("EP_COMM_NVFP4_PREFETCH", {"on", "off"}) == 0;
  return on;
}
template <typename Kernel>
cudaError_t l2_prefetch_rows_ahead(Kernel kernel, dim3 block, int64_t grid, const Nvfp4QuantizeArgs& args,
                                   size_t elem_bytes, int64_t* rows_ahead) {
  *rows_ahead = 0;
  if (!l2_prefetch_on()) return cudaSuccess;
  int device = 0, num_sms = 0, l2_bytes = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  if (grid <= num_sms) return cudaSuccess;  // one wave for sure, without the occupancy query (small launches)
  int64_t wave_ctas = 0;  // the CTAs the device holds at once (resident_grid: SMs times occupancy)
  status = resident_grid(kernel, static_cast<int>(block.x * block.y), grid, &wave_ctas);
  if (status != cudaSuccess) return status;
  if (wave_ctas >= grid) return cudaSuccess;  // one wave at most: nothing comes later to prefetch for
  status = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
  if (status != cudaSuccess) return status;
  const int64_t row_bytes = args.hidden * static_cast<int64_t>(elem_bytes);
  *rows_ahead = std::min<int64_t>(wave_ctas * block.y, (static_cast<int64_t>(l2_bytes) / 2) / row_bytes);
  return cudaSuccess;
}

template <typename T, typename Shape, bool kBlockValues = false, bool kFp8Values = false>
cudaError_t launch_quantize(const Nvfp4QuantizeArgs& args, cudaStream_t stream) {
  const int64_t num_blocks = args.hidden / 16;
  // Enough threads per row to hold it in registers (one round), a multiple of 32, at most Shape::kMaxThreads
  // (longer rows take several rounds).
  const int64_t wanted = ceil_div(ceil_div(num_blocks, Shape::template blocks_per_thread<T>()), 32) * 32;
  const int threads_per_row = static_cast<int>(std::min<int64_t>(Shape::kMaxThreads, std::max<int64_t>(32, wanted)));
  const int rows_per_cta = std::max(1, std::min(kTargetCtaThreads, Shape::kMaxThreads) / threads_per_row);
  const dim3 block(threads_per_row, rows_per_cta);
  const int64_t grid = ceil_div(args.num_rows, rows_per_cta);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  const unsigned grid_x = static_cast<unsigned>(grid);
  const float inv_six_m = qm::nvfp4_inv_six_m(args.e4m3_max);  // once here, not in every thread
  if constexpr (kBlockValues) {
    nvfp4_quantize_kernel<T, true, Shape, true, kFp8Values><<<grid_x, block, 0, stream>>>(args, inv_six_m, 0);
  } else if (args.four_over_six) {
    const auto kernel = nvfp4_quantize_kernel<T, true, Shape>;
    int64_t ahead = 0;
    const cudaError_t status = l2_prefetch_rows_ahead(kernel, block, grid, args, sizeof(T), &ahead);
    if (status != cudaSuccess) return status;
    kernel<<<grid_x, block, 0, stream>>>(args, inv_six_m, ahead);
  } else {
    nvfp4_quantize_kernel<T, false, Shape><<<grid_x, block, 0, stream>>>(args, inv_six_m, 0);
  }
  return cudaGetLastError();
}

// EP_COMM_NVFP4_QUANT_SHAPE = wide | occupancy | narrow overrides the thread shape (for measurements); by
// default (unset or auto) 4/6 takes two blocks of 16 per thread -- narrow for 16-bit input, occupancy (the same 3
// CTAs per SM, 128 raw bytes) for fp32 -- and plain takes occupancy, the fastest for each on H200 (RESULTS.md:
// fp32 4/6, the MoE layer's w2 input, 94 -> 83 us for 16384 x 2048 rows, sixteenth session).
int quantize_shape_choice(bool four_over_six, int x_type) {
  static const int forced = env_choice("EP_COMM_NVFP4_QUANT_SHAPE", {"auto", "wide", "occupancy", "narrow"});
  if (forced != 0) return forced;
  return four_over_six && static_cast<ElemType>(x_type) != ElemType::kFloat32 ? 3 : 2;
}

}  // namespace

cudaError_t launch_nvfp4_quantize(const Nvfp4QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 16 != 0 || args.num_rows < 0 || args.hidden / 16 > INT32_MAX / 2) {
    return cudaErrorInvalidValue;
  }
  const bool block_values = args.block_values != nullptr;
  if (block_values && (!args.four_over_six || args.row_factor == nullptr || args.block_values_row_stride < args.hidden ||
                       args.block_values_row_stride % (args.block_values_fp8 ? 16 : 8) != 0 ||
                       reinterpret_cast<uintptr_t>(args.block_values) % 16)) {
    return cudaErrorInvalidValue;  // 16-byte stores of fp16 block values (FP8: of a whole block)
  }
  if (args.num_rows == 0) return cudaSuccess;
  // Codes: one 8-byte store per block (block values write no codes).
  if (!block_values && !rows_aligned(args.data, args.data_row_stride, 8)) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (!rows_aligned(args.x, args.x_row_stride * static_cast<int64_t>(sizeof(T)), 16)) {
      return cudaErrorInvalidValue;  // 16-byte loads of x
    }
    auto launch = [&](auto block_values_tag, auto fp8_tag) {
      constexpr bool kBlockValues = decltype(block_values_tag)::value;
      constexpr bool kFp8 = decltype(fp8_tag)::value;
      switch (quantize_shape_choice(args.four_over_six, args.x_type)) {
        case 1: return launch_quantize<T, WideShape, kBlockValues, kFp8>(args, stream);
        case 2: return launch_quantize<T, OccupancyShape, kBlockValues, kFp8>(args, stream);
        default: return launch_quantize<T, NarrowShape, kBlockValues, kFp8>(args, stream);
      }
    };
    if (!block_values) return launch(std::false_type{}, std::false_type{});
    return args.block_values_fp8 ? launch(std::true_type{}, std::true_type{})
                                 : launch(std::true_type{}, std::false_type{});
  });
}

// The one-thread-per-16-block decode kernels (dequantize, FP8 expansion): sizes and alignment checked (8 code bytes per
// load, 16-byte stores of out), the block count and grid of 256-thread CTAs; cudaSuccess with total_blocks == 0: nothing
// to launch.
constexpr int kDecodeThreads = 256;
static cudaError_t decode_grid(const void* data, const void* out, int64_t num_rows, int64_t hidden,
                               int64_t* total_blocks, int64_t* grid) {
  if (hidden <= 0 || hidden % 16 != 0 || num_rows < 0) return cudaErrorInvalidValue;
  *total_blocks = num_rows * (hidden / 16);
  *grid = ceil_div(*total_blocks, kDecodeThreads);
  if (*total_blocks == 0) return cudaSuccess;
  if (!rows_aligned(data, 0, 8) || !rows_aligned(out, 0, 16) || *grid > INT32_MAX) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t launch_nvfp4_dequantize(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                                    int64_t hidden, float e4m3_max, void* out, int out_type, cudaStream_t stream,
                                    const int32_t* num_rows_limit) {
  int64_t total_blocks = 0, grid = 0;
  const cudaError_t sizes = decode_grid(data, out, num_rows, hidden, &total_blocks, &grid);
  if (sizes != cudaSuccess || total_blocks == 0) return sizes;
  constexpr int kThreads = kDecodeThreads;
  return vec::dispatch_elem_type(out_type, [&](auto tag) {
    using Out = decltype(tag);
    const float inv_six_m = qm::nvfp4_inv_six_m(e4m3_max);
    nvfp4_dequantize_kernel<Out><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        data, scales, amax, num_rows, hidden / 16, make_row_div(hidden / 16, total_blocks), inv_six_m,
        static_cast<Out*>(out), num_rows_limit);
    return cudaGetLastError();
  });
}

cudaError_t launch_nvfp4_expand_fp8(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                    uint8_t* out, cudaStream_t stream, const int32_t* num_rows_limit) {
  int64_t total_blocks = 0, grid = 0;
  const cudaError_t sizes = decode_grid(data, out, num_rows, hidden, &total_blocks, &grid);
  if (sizes != cudaSuccess || total_blocks == 0) return sizes;
  nvfp4_expand_fp8_kernel<<<static_cast<unsigned>(grid), kDecodeThreads, 0, stream>>>(
      data, scales, num_rows, hidden / 16, make_row_div(hidden / 16, total_blocks), out, num_rows_limit);
  return cudaGetLastError();
}

cudaError_t formats_kernel_image_status() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, nvfp4_dequantize_kernel<float>);
}

}  // namespace ep_comm
