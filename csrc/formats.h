// Launchers of the quantization kernels (nvfp4.cu, mxfp8.cu, s2f6.cu) and their CPU emulations
// (formats_host.cpp). Torch-free: tensors arrive as raw pointers, sizes and strides as int64, the stream
// as a cudaStream_t. Every function follows docs/NUMERICS.md bit for bit.
//
// Conventions
//  * A "row" is one vector along the quantized axis of `hidden` (K) elements; rows are independent.
//  * Element strides are in elements of the input type, byte strides in bytes. Unless a stride is given,
//    tensors are contiguous [num_rows, ...].
//  * Packed NVFP4 data: two E2M1 codes per byte, element 2j in the low nibble ([rows, K/2]); NVFP4 scales:
//    E4M3 bytes [rows, K/16]; amax: fp32 per row. MXFP8: E4M3 bytes [rows, K] + UE8M0 bytes [rows, K/32].
//    S2F6: int8 [rows, K] + UE8M0 bytes [rows, K/32].
//  * Shapes: K % 16 == 0 (NVFP4) or K % 32 == 0 (MXFP8, S2F6); sizes >= 0. Tested by the launchers.
//  * Alignment, tested by the launchers (for calls with rows) before anything is launched, since a misaligned vector
//    access would fault on the device and lose the CUDA context. Base and row stride (in bytes) aligned to the access:
//    dense rows (x, out) 16; codes written (NVFP4 data: 8 per block; MXFP8, S2F6 and the transposed form's out_data:
//    16); codes read (8; S2F6 accumulate: 16); fp16 block values 16. Rows of a contiguous tensor from the torch
//    caching allocator are aligned.
//  * Left to the caller (ep_comm/_cuda_formats.py, and bind_formats.cpp for raw calls): non-null addresses for
//    what a call with rows reads or writes, and buffers as large as the shapes say.
//  * Launchers return cudaSuccess or the launch error. Bad arguments (shape, alignment or size limits) give
//    cudaErrorInvalidValue in every launcher -- not cudaErrorMisalignedAddress, which CUDA reports for a device fault
//    that did happen: here nothing was launched and the context is intact. They never synchronize.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

// Element type of a dense input or output.
enum class ElemType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ------------------------------------------------------------------------------------------------------
// NVFP4 (blocks of 16, E4M3 block scales, fp32 outer amax per row).
struct Nvfp4QuantizeArgs {
  const void* x = nullptr;  // [num_rows, hidden] of x_type, row i at x + i * x_row_stride elements
  int x_type = 0;           // ElemType
  int64_t x_row_stride = 0;
  int64_t num_rows = 0;
  int64_t hidden = 0;
  // Outer amax per row. Null: computed in the kernel (max |x| of the row, NaN ignored).
  const float* amax_in = nullptr;
  float e4m3_max = 256.0f;     // M: 256 with 4/6 (activations), 448 plain (weights)
  bool four_over_six = true;   // 4/6 with MSE block choice, else plain NVFP4
  // Destination: row i goes to destination row d = dst_rows ? dst_rows[i] : i (d < 0: row skipped), i.e.
  // data + d * data_row_stride (K/2 bytes), scales + d * scales_row_stride (K/16 bytes), amax_out + d.
  uint8_t* data = nullptr;
  int64_t data_row_stride = 0;
  uint8_t* scales = nullptr;
  int64_t scales_row_stride = 0;
  float* amax_out = nullptr;   // may be null (then not written)
  const int64_t* dst_rows = nullptr;
  // Optional device-side row count (e.g. expert_offsets[E] of a dispatch layout): rows >= *num_rows_limit are
  // skipped (their outputs are not written), so a capacity-sized buffer costs only its rows in use.
  const int32_t* num_rows_limit = nullptr;
  // Block values instead of codes (4/6 only; the grouped GEMM's activation operand, what launch_nvfp4_dequantize
  // writes with amax == nullptr and fp16 out): row d's e2m1 * e4m3 values (exact in fp16) go to
  // block_values + d * block_values_row_stride, and its outer factor f(amax * f32(1 / (6 M))) to row_factor + d.
  // data, scales and amax_out are then not written (may be null). One pass instead of quantize + expand.
  // block_values_fp8: the grouped GEMM's inexact FP8 operand rows instead (what launch_nvfp4_expand_fp8 writes):
  // block_values holds E4M3 bytes (row stride in bytes), row_factor 8 f(amax * f32(1 / (6 M))).
  void* block_values = nullptr;  // fp16 bits, or E4M3 bytes with block_values_fp8
  int64_t block_values_row_stride = 0;  // in elements (2 or 1 bytes)
  float* row_factor = nullptr;
  bool block_values_fp8 = false;
};
cudaError_t launch_nvfp4_quantize(const Nvfp4QuantizeArgs& args, cudaStream_t stream);

// out[i, j] = e2m1(q) * final_b with final_b = f(f(s_b * amax_i) * f(1 / (6 M))), rounded to out_type.
// amax == nullptr: out[i, j] = e2m1(q) * s_b (block values without the outer scale; exact in fp16).
// num_rows_limit (optional, device): rows >= *num_rows_limit are not written.
cudaError_t launch_nvfp4_dequantize(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                                    int64_t hidden, float e4m3_max, void* out, int out_type, cudaStream_t stream,
                                    const int32_t* num_rows_limit = nullptr);

// cudaSuccess when the format kernels have an image for the current device; the error otherwise (a build for other
// architectures: cudaErrorNoKernelImageForDevice / cudaErrorInvalidDeviceFunction, or no device). One kernel stands
// for all: they are compiled for the same architectures.
// The grouped GEMM's inexact FP8 operand rows: out uint8 [num_rows, hidden] (16-byte aligned), E4M3 of
// e2m1 * e4m3 * 2^-3 in the GEMM's column order within each 16-block (ep_comm/grouped_gemm.py FP8_COLUMN_ORDER); rows
// at or past *num_rows_limit (when given) are not written.
cudaError_t launch_nvfp4_expand_fp8(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                    uint8_t* out, cudaStream_t stream, const int32_t* num_rows_limit);
cudaError_t formats_kernel_image_status();

// ------------------------------------------------------------------------------------------------------
// MXFP8 (blocks of 32, E4M3 elements, UE8M0 scales, NVIDIA scale rule).
struct Mxfp8QuantizeArgs {
  const void* x = nullptr;  // [num_rows, hidden] of x_type, row stride x_row_stride elements
  int x_type = 0;
  int64_t x_row_stride = 0;
  int64_t num_rows = 0;
  int64_t hidden = 0;
  bool stochastic = false;  // SR with rbits(seed, row * hidden + column)
  uint64_t seed = 0;
  const uint64_t* seed_on_device = nullptr;  // non-null: the seed is read here when the kernel runs (graph replays)
  uint8_t* data = nullptr;  // row i at data + i * data_row_stride (hidden bytes)
  int64_t data_row_stride = 0;
  uint8_t* scales = nullptr;  // row i at scales + i * scales_row_stride (hidden / 32 bytes)
  int64_t scales_row_stride = 0;
};
cudaError_t launch_mxfp8_quantize(const Mxfp8QuantizeArgs& args, cudaStream_t stream);

cudaError_t launch_mxfp8_dequantize(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                    void* out, int out_type, cudaStream_t stream);

// NVFP4 [num_rows = R, hidden = K] -> dequantize (fp32) -> transpose -> MXFP8 [K, R] with blocks of 32 along
// R (R % 32 == 0). Stochastic rounding indexes the [K, R] output: rbits(seed, k * R + r), the seed read from
// seed_on_device when the kernel runs if that is non-null. e4m3_max: M of the input, 256 or 448 (others give
// cudaErrorInvalidValue: the kernel's decode factor f(final_b * 64) is exact for these).
cudaError_t launch_nvfp4_to_mxfp8_transposed(const uint8_t* data, const uint8_t* scales, const float* amax,
                                             int64_t num_rows, int64_t hidden, float e4m3_max, bool stochastic,
                                             uint64_t seed, const uint64_t* seed_on_device, uint8_t* out_data,
                                             uint8_t* out_scales, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------------
// RHT-32 + S2F6 (blocks of 32, UE8M0 scales).
struct S2f6QuantizeArgs {
  const void* x = nullptr;  // [num_rows, hidden] of x_type, row stride x_row_stride elements
  int x_type = 0;
  int64_t x_row_stride = 0;
  int64_t num_rows = 0;
  int64_t hidden = 0;
  bool hadamard = true;  // RHT-32 on each aligned chunk before quantizing
  uint32_t sign_mask = 0x6A09E667u;
  int8_t* data = nullptr;  // row i at data + i * data_row_stride (hidden bytes)
  int64_t data_row_stride = 0;
  uint8_t* scales = nullptr;  // row i at scales + i * scales_row_stride (hidden / 32 bytes)
  int64_t scales_row_stride = 0;
};
cudaError_t launch_s2f6_quantize(const S2f6QuantizeArgs& args, cudaStream_t stream);

// Decode (and inverse RHT when hadamard) to out_type [num_rows, hidden].
cudaError_t launch_s2f6_dequantize(const int8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                   bool hadamard, uint32_t sign_mask, void* out, int out_type, cudaStream_t stream);

// The receive side of combine: for each output row m,
//   acc = 0; for j in 0..num_terms-1: src = row_index[m, j]; if 0 <= src < num_src_rows:
//       acc = f(acc + f(w[m, j] * deq(src)))        (w = 1 when weights is null; the product is then exact)
//   out[m] = out_type(hadamard ? inverse_rht(acc) : acc)
// row_index: int32 or int64 [num_out_rows, num_terms]; an index < 0 (or >= num_src_rows) contributes nothing.
struct S2f6AccumulateArgs {
  const int8_t* data = nullptr;    // [num_src_rows, hidden]
  const uint8_t* scales = nullptr;  // [num_src_rows, hidden / 32]
  int64_t num_src_rows = 0;
  int64_t hidden = 0;
  const void* row_index = nullptr;
  bool index_is_int64 = true;
  const float* weights = nullptr;  // [num_out_rows, num_terms] or null
  int64_t num_out_rows = 0;
  int64_t num_terms = 0;
  bool hadamard = true;
  uint32_t sign_mask = 0x6A09E667u;
  void* out = nullptr;  // [num_out_rows, hidden] of out_type
  int out_type = 1;
};
cudaError_t launch_s2f6_dequantize_accumulate(const S2f6AccumulateArgs& args, cudaStream_t stream);

// Whether rows at p, p + row_stride_bytes, p + 2 * row_stride_bytes, ... all start `alignment`-byte aligned (a power of
// two; row_stride_bytes 0: the base only). The launchers test it before a kernel reads or writes rows in 8- or 16-byte
// vectors: a misaligned vector access would fault on the device and lose the CUDA context. The bindings test it too,
// for a message that names the operand.
inline bool rows_aligned(uintptr_t address, int64_t row_stride_bytes, uintptr_t alignment) {
  return ((address | static_cast<uintptr_t>(row_stride_bytes)) & (alignment - 1)) == 0;
}
inline bool rows_aligned(const void* p, int64_t row_stride_bytes, uintptr_t alignment) {
  return rows_aligned(reinterpret_cast<uintptr_t>(p), row_stride_bytes, alignment);
}

// ------------------------------------------------------------------------------------------------------
// CPU emulation (formats_host.cpp): the same quant_math.cuh primitives run on host memory, so a CPU-only
// build can prove the bit manipulation against the torch reference. fp32 inputs/outputs only (bf16
// inputs widen exactly; the caller converts). Contiguous tensors. Same semantics as the launchers.
namespace host {
void nvfp4_quantize(const float* x, int64_t num_rows, int64_t hidden, const float* amax_in, float e4m3_max,
                    bool four_over_six, uint8_t* data, uint8_t* scales, float* amax_out);
void nvfp4_dequantize(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                      int64_t hidden, float e4m3_max, float* out);
void mxfp8_quantize(const float* x, int64_t num_rows, int64_t hidden, bool stochastic, uint64_t seed,
                    uint8_t* data, uint8_t* scales);
void mxfp8_dequantize(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden, float* out);
void nvfp4_to_mxfp8_transposed(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                               int64_t hidden, float e4m3_max, bool stochastic, uint64_t seed, uint8_t* out_data,
                               uint8_t* out_scales);
void rht(const float* x, int64_t num_rows, int64_t hidden, uint32_t sign_mask, bool inverse, float* out);
void s2f6_quantize(const float* x, int64_t num_rows, int64_t hidden, bool hadamard, uint32_t sign_mask,
                   int8_t* data, uint8_t* scales);
void s2f6_dequantize(const int8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden, bool hadamard,
                     uint32_t sign_mask, float* out);
// fp32 result before the final cast (the caller rounds to bf16 like the kernel does).
void s2f6_dequantize_accumulate(const int8_t* data, const uint8_t* scales, int64_t num_src_rows, int64_t hidden,
                                const int64_t* row_index, const float* weights, int64_t num_out_rows,
                                int64_t num_terms, bool hadamard, uint32_t sign_mask, float* out);
// The two 4/6 candidate errors (err_6, err_4 of docs/NUMERICS.md) of every 16-element block of x
// [num_rows, hidden] with the per-row outer amax: exposes the selection arithmetic to bitwise tests.
void nvfp4_four_over_six_errors(const float* x, int64_t num_rows, int64_t hidden, const float* amax, float e4m3_max,
                                float* err6, float* err4);
// Per block of x [num_rows, hidden]: 1 if the quantizer's fast path handles the block (with 4/6: decides the
// choice by the bound; without: nvfp4_plain_codes_fast), 2 if it decides a 4/6 block as an exact tie (its step (3):
// both candidates decode every element to the same value, so their errors are equal and the choice is map-6), 0 if
// the general form has to (a guard for the kernels' speed: correctness tests pass either way).
void nvfp4_fast_decided(const float* x, int64_t num_rows, int64_t hidden, const float* amax, float e4m3_max,
                        bool four_over_six, uint8_t* decided);
// Checks a fast form against its definition over fp32 bit patterns (every `stride`-th one; 1 = all):
//   kE2m1Magnitude: e2m1_round_magnitude vs e2m1_encode_soft / e2m1_decode, all non-negative floats and NaNs;
//   kMarkstein1536 / kMarkstein2688: div_six_m_markstein vs IEEE division, every n in [2^-100, FLT_MAX];
//   kSrE4m3: sr_e4m3 and the kernels' sr_e4m3_fast (where sr_fast_block_ok admits it, under 8 scale bytes) vs
//            sr_e4m3_definition, every v >= 0 (and -v) with random words 0, 0xFFFF, 0x8000 and a hash; and the
//            per-block random bits (rbits_block / rbits_block_word) vs rbits.
//   kDivSix: div_six_markstein vs f(a / 6) (equal wherever the quotient is normal, both below 2^-125 elsewhere) and
//            nvfp4_four_six_scale_pair_fast vs nvfp4_four_six_scale_pair under approx_ok outer scales (the largest
//            S_enc for both M, and amax = 1), every a in [0, +Inf].
//   kOuterScales: nvfp4_outer_scales' division-free S_enc (qm_rcp_fast, div_markstein) and S_dec (qm_rcp_fast) vs
//            the IEEE divisions f(6M / amax) and f(1 / S_enc), for M = 256 and 448 and every amax in [2^-80, 2^100].
// Returns the number of mismatches (0 expected).
enum class ExhaustiveCheck : int {
  kE2m1Magnitude = 0,
  kMarkstein1536 = 1,
  kMarkstein2688 = 2,
  kSrE4m3 = 3,
  kS2f6Fast = 4,
  kDivSix = 5,
  kOuterScales = 6,
  kNoContraction = 7,  // not a fast form: a probe that this file was compiled without FMA contraction
};
int64_t exhaustive_check(ExhaustiveCheck check, uint32_t stride);
// Element-level primitives, one value each (for exhaustive / test-vector checks).
void e2m1_encode(const float* x, int64_t n, uint8_t* out);
void e4m3_encode(const float* x, int64_t n, uint8_t* out);
void ue8m0_mxfp8_scale(const float* amax, int64_t n, uint8_t* out);
void ue8m0_s2f6_scale(const float* amax, int64_t n, uint8_t* out);
void rbits(uint64_t seed, const int64_t* index, int64_t n, uint32_t* out);
void sr_e4m3(const float* x, const uint32_t* random_bits, int64_t n, uint8_t* out);
void bf16_round(const float* x, int64_t n, uint16_t* out);
}  // namespace host

}  // namespace ep_comm
