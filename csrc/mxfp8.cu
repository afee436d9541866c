// MXFP8 quantize (nearest / stochastic), dequantize, and NVFP4 -> transposed MXFP8 requantization.
// Arithmetic: quant_math.cuh (docs/NUMERICS.md, "MXFP8" and "Random bits").
//
// Quantize / dequantize: one thread per 32-element block, consecutive threads on consecutive blocks, so
// a warp moves 2 KiB (bf16 in) and 1 KiB (codes out) of contiguous memory with 16-byte accesses.
#include "formats.h"
#include "quant_math.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

constexpr int kThreads = 256;

// One MX block of 32 fp32 values -> its scale byte and 32 codes as two 16-byte vectors (codes 0..15 / 16..31), through
// the shared block encoders of quant_math.cuh (the host emulation calls the same functions).
__device__ __forceinline__ void words_to_vectors(const uint32_t words[8], uint4 out[2]) {
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
}
__device__ __forceinline__ uint8_t mxfp8_encode32_nearest(const float x[32], uint4 out[2]) {
  uint32_t words[8];
  const uint8_t scale = qm::mxfp8_encode32_nearest(x, words);
  words_to_vectors(words, out);
  return scale;
}
__device__ __forceinline__ uint8_t mxfp8_encode32_stochastic(const float x[32], uint32_t key, int64_t index0,
                                                             uint4 out[2]) {
  uint32_t words[8];
  const uint8_t scale = qm::mxfp8_encode32_stochastic(x, key, index0, words);
  words_to_vectors(words, out);
  return scale;
}
__device__ __forceinline__ uint8_t mxfp8_encode32_stochastic_hashed(const float x[32], const qm::RbitsBlock& hash,
                                                                    uint4 out[2]) {
  uint32_t words[8];
  const uint8_t scale = qm::mxfp8_encode32_stochastic_hashed(x, hash, words);
  words_to_vectors(words, out);
  return scale;
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
  uint4 codes[2];
  const uint8_t scale = kStochastic ? mxfp8_encode32_stochastic(x, qm::sr_key_of(key, args.seed_on_device),
                                                                row * args.hidden + column, codes)
                                    : mxfp8_encode32_nearest(x, codes);
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
    const uint32_t words[2] = {raw[i].x, raw[i].y};
    float y[8];
    qm::mxfp8_decode_words<2>(words, scale[i], y);
    vec::store_row_segment<Out, 8>(out + c * 8, y);
  }
}

// NVFP4 [R, K] -> MXFP8 [K, R]. A CTA takes a tile of kTileRows input rows x kTileCols columns:
//  phase 1: each thread takes one 16-column block of 4 consecutive input rows and stages it in shared memory without
//           decoding it: for each of the 16 columns, the 4 rows' codes as one word of bytes (the E4M3 images of the
//           E2M1 codes, qm::e2m1_codes_as_e4m3_bytes: 4 bytes per 4 elements), and for each row its decode factor
//           final_b = f(f(fp32(s_b) * amax) * f(1/6M)) times 64 (one float per row and 16 columns; exact, below);
//  phase 2: each thread takes columns c and c + 8 of one 16-column block (output rows k0 + c, k0 + c + 8) and one
//           32-row block: decodes the block's 32 codes (the hardware E4M3 pair decode) and multiplies each by its
//           row's factor -- y = f(e2m1val * final_b), the NUMERICS decode (phase 1 explains the factor's form) --
//           then amax, scale, encode, 32-byte store;
//           the 4 lanes holding the 4 row blocks of one output row (row blocks r0/32 .. r0/32 + 3, adjacent in
//           out_scales) gather their scale bytes by two shuffles and one of them stores the word (when the tile is
//           full, R % 128 == 0 and out_scales is 4-byte aligned, so the word is aligned) instead of 4 byte stores R/32
//           bytes apart.
// Staging codes and factors instead of the decoded fp32 values moves ~1.3 bytes of shared memory per element (a code
// byte written and read, the factors' 4 bytes per 16 elements written and read, 8 lanes reading each) instead of 8
// (Nsight Compute, forty-sixth session: the shared-memory queue was the largest stall, 1.47 cycles per issue).
// Two CTA barriers per tile: phase 1's writes before phase 2's reads, and phase 2's reads before the next tile's
// phase 1 overwrites the tile. Phase 2 gives the 4 row blocks of one output row to 4 consecutive lanes, so a warp
// stores 8 output rows x 128 contiguous bytes (whole sectors) instead of 32 rows x 32 bytes.
// Shared memory (no bank conflicts, below):
//  codes: column c's byte of tile row r at c * kCodePitch + (c / 16) * 32 + r. Phase 1, the 4-byte store of one
//         column: lane l of warp w (block g = l / 8, rows 32w + 4 (l % 8)) hits bank 4c + 8g + 8w + l % 8 (mod 32):
//         distinct. Phase 2, 16-byte loads: a quarter warp (columns c, c + 1 x row blocks 0..3) starts at 16-byte
//         chunks c + 2 rb + const (mod 8): distinct.
//  factors: row r's factor of block g at g * kFactorPitch + r + (r / 32) * 4 (floats). Phase 1, one 16-byte store of 4
//         rows: a quarter warp's 8 row quads are consecutive chunks. Phase 2: a quarter warp reads 4 row blocks (each
//         by 2 lanes, a broadcast) at chunks rb + const (mod 8): distinct.
// (Before the forty-seventh session phase 1 stored each column's 4 decoded fp32 values as one 16-byte store and
// phase 2 read its block's 32 values as 8 float4. Before 2026-12-01 a thread dequantized a whole tile row and stored
// its 64 values one word at a time: 64 stores per thread and tile instead of 16, and the shared-memory queue was the
// kernel's largest stall, 12% of the samples.)
constexpr int kTileRows = 128;
constexpr int kTileCols = 64;
constexpr int kCodePitch = 144;    // bytes per column: >= kTileRows, 16 (mod 32) (see above)
constexpr int kFactorPitch = 144;  // floats per 16-column block: >= kTileRows + 3 * 4
constexpr int kCodeTileBytes = kTileCols * kCodePitch + (kTileCols / 16) * 32;
__device__ __forceinline__ int code_byte(int column, int row) { return column * kCodePitch + (column / 16) * 32 + row; }
__device__ __forceinline__ int factor_word(int block, int row) { return block * kFactorPitch + row + (row / 32) * 4; }

// The 4x4 byte transpose: out[j] byte i = in[i] byte j.
__device__ __forceinline__ void transpose_bytes4x4(const uint32_t in[4], uint32_t out[4]) {
  const uint32_t rows01_lo = qm::byte_perm(in[0], in[1], 0x5140u);  // in0.b0 in1.b0 in0.b1 in1.b1
  const uint32_t rows01_hi = qm::byte_perm(in[0], in[1], 0x7362u);  // in0.b2 in1.b2 in0.b3 in1.b3
  const uint32_t rows23_lo = qm::byte_perm(in[2], in[3], 0x5140u);
  const uint32_t rows23_hi = qm::byte_perm(in[2], in[3], 0x7362u);
  out[0] = qm::byte_perm(rows01_lo, rows23_lo, 0x5410u);
  out[1] = qm::byte_perm(rows01_lo, rows23_lo, 0x7632u);
  out[2] = qm::byte_perm(rows01_hi, rows23_hi, 0x5410u);
  out[3] = qm::byte_perm(rows01_hi, rows23_hi, 0x7632u);
}

// One thread's input for a tile: 16-column block b of tile rows 4 * quad .. 4 * quad + 3 (codes, scale bytes, row
// amaxes), loaded into registers one tile ahead of its use. Nothing here computes on a loaded value: the first
// instruction that reads a load's register waits for it. (An earlier form loaded the 4 scale bytes of a row as one
// word and split it right after the load: the warp stalled there, before its current tile's encoding instead of
// during it; ncu, 2026-12-01: 7% of the kernel's stall samples on that one shift.)
constexpr int kQuadRows = 4;
struct TileQuadInput {
  uint2 codes[kQuadRows];      // 16 codes of each row
  uint32_t scales[kQuadRows];  // its scale byte
  float row_amax[kQuadRows];
};

// Rows r .. r + 3 (all valid or none: R % 32 == 0), columns kb .. kb + 15 (kb < K or none: K % 16 == 0), into `in`;
// out of range, `in` keeps what it held (phase 1 tests the same condition before it reads `in`, so the stale values are
// never used; not zeroing them saves the register clears on every tile).
__device__ __forceinline__ void load_tile_quad(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                                               const float* __restrict__ amax, int64_t num_rows, int64_t hidden,
                                               int64_t r, int64_t kb, TileQuadInput& in) {
  if (r >= num_rows || kb >= hidden) return;
  // r, kb and hidden are non-negative: unsigned shifts instead of signed divisions (no rounding fix-ups).
  const uint64_t code_pitch = static_cast<uint64_t>(hidden) >> 1;
  const uint64_t scale_pitch = static_cast<uint64_t>(hidden) >> 4;
  const uint8_t* code_row = data + static_cast<uint64_t>(r) * code_pitch + (static_cast<uint64_t>(kb) >> 1);
  const uint8_t* scale_row = scales + static_cast<uint64_t>(r) * scale_pitch + (static_cast<uint64_t>(kb) >> 4);
#pragma unroll
  for (int i = 0; i < kQuadRows; ++i) {
    // 8 code bytes per block, 8-byte aligned because K % 16 == 0.
    in.codes[i] = __ldg(reinterpret_cast<const uint2*>(code_row + i * code_pitch));
    in.scales[i] = __ldg(scale_row + i * scale_pitch);
    in.row_amax[i] = __ldg(amax + r + i);
  }
}

// Persistent CTAs walk the tiles (tile = row tile + num_row_tiles * column tile); the loads of a CTA's next tile
// are issued right after its current tile is staged in shared memory, so they are in flight during the current
// tile's encoding (phase 2, the long one) instead of after it. inv_six_m = qm::nvfp4_inv_six_m(M), computed once by
// the launcher.
template <bool kStochastic>
__global__ void __launch_bounds__(kTileRows, 6) nvfp4_to_mxfp8_transposed_kernel(
    const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, const float* __restrict__ amax,
    int64_t num_rows, int64_t hidden, int64_t num_row_tiles, int64_t num_tiles, float inv_six_m, uint32_t key,
    const uint64_t* __restrict__ seed_on_device, bool low_indices, uint32_t low_pair_key,
    uint8_t* __restrict__ out_data, uint8_t* __restrict__ out_scales) {
  __shared__ __align__(16) uint8_t code_tile[kCodeTileBytes];
  __shared__ __align__(16) float factor_tile[(kTileCols / 16) * kFactorPitch];
  const int t = threadIdx.x;
  int64_t tile_index = blockIdx.x;
  if (tile_index >= num_tiles) return;
  // The stochastic rounding's keys (those of a seed in device memory computed here, once per thread).
  const uint32_t rounding_key = kStochastic ? qm::sr_key_of(key, seed_on_device) : key;
  const uint32_t rounding_low_pair_key =
      kStochastic && seed_on_device != nullptr ? qm::rbits_pair_key(rounding_key, 0) : low_pair_key;
  // This thread's place in phase 1: block (lane / 8) of tile rows quad_row .. quad_row + 3.
  const int lane = t % 32;
  const int block = lane / 8;
  const int block_col = block * 16;
  const int quad_row = (t / 32) * 32 + (lane % 8) * kQuadRows;
  uint8_t* const block_codes = code_tile + code_byte(block_col, quad_row);  // its staged codes, column block_col
  float* const block_factors = factor_tile + factor_word(block, quad_row);   // its rows' staged factors
  static_assert(kTileRows == 4 * 32 && kTileCols == 4 * 16, "phase 1: a warp takes 32 rows x 4 blocks");
  // The tile's (row tile, column tile) = (tile_index % num_row_tiles, tile_index / num_row_tiles), stepped without a
  // division per tile: with gridDim.x = step_col * num_row_tiles + step_row (0 <= step_row < num_row_tiles), the next
  // tile's row tile is row_tile + step_row, less num_row_tiles (and one more column tile) when that reaches
  // num_row_tiles (it stays below 2 * num_row_tiles: one wrap at most).
  int64_t row_tile = tile_index % num_row_tiles;
  int64_t col_tile = tile_index / num_row_tiles;
  const int64_t step_col = static_cast<int64_t>(gridDim.x) / num_row_tiles;
  const int64_t step_row = static_cast<int64_t>(gridDim.x) - step_col * num_row_tiles;
  TileQuadInput next = {};
  load_tile_quad(data, scales, amax, num_rows, hidden, row_tile * kTileRows + quad_row,
                 col_tile * kTileCols + block_col, next);

  for (; tile_index < num_tiles; tile_index += gridDim.x) {
    const int64_t r0 = row_tile * kTileRows;
    const int64_t k0 = col_tile * kTileCols;
    row_tile += step_row;
    col_tile += step_col;
    if (row_tile >= num_row_tiles) {
      row_tile -= num_row_tiles;
      ++col_tile;
    }
    const TileQuadInput in = next;
    if (r0 + quad_row < num_rows && k0 + block_col < hidden) {
      float scale_values[kQuadRows];  // fp32(s_b), two per hardware decode (exact, like e4m3_decode)
      qm::e4m3x2_decode(static_cast<uint16_t>(in.scales[0] | (in.scales[1] << 8)), scale_values[0], scale_values[1]);
      qm::e4m3x2_decode(static_cast<uint16_t>(in.scales[2] | (in.scales[3] << 8)), scale_values[2], scale_values[3]);
      // The staged factor is f(final_b * 64), exact: with M = 256 or 448 (the launcher refuses others) a finite
      // final_b = f(f(s_b * amax) * f(1/6M)) is at most ~FLT_MAX / 1536 < 2^118, so the product stays below 2^124, and
      // a power-of-two scaling of a subnormal, zero, Inf or NaN is exact too. Phase 2 multiplies it by the E4M3 image
      // of the code, e2m1val * 2^-6 (exact): the same real product e2m1val * final_b, rounded once, as the NUMERICS
      // decode f(e2m1val * final_b).
      float factor[kQuadRows];
#pragma unroll
      for (int i = 0; i < kQuadRows; ++i) {
        factor[i] = qm::qm_mul(qm::nvfp4_dequant_scale_from(scale_values[i], in.row_amax[i], inv_six_m), 64.0f);
      }
      *reinterpret_cast<float4*>(block_factors) = make_float4(factor[0], factor[1], factor[2], factor[3]);
      // Per half (word) of the block: the 4 rows' even and odd elements as E4M3 bytes, transposed to one word per
      // column (byte i = row quad_row + i), one 4-byte store each.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t even[kQuadRows], odd[kQuadRows];
#pragma unroll
        for (int i = 0; i < kQuadRows; ++i) {
          qm::e2m1_codes_as_e4m3_bytes(half == 0 ? in.codes[i].x : in.codes[i].y, even[i], odd[i]);
        }
        uint32_t even_columns[4], odd_columns[4];  // columns 8 half + 2m and 8 half + 2m + 1
        transpose_bytes4x4(even, even_columns);
        transpose_bytes4x4(odd, odd_columns);
#pragma unroll
        for (int m = 0; m < 4; ++m) {  // columns block_col + j: code_byte(block_col, quad_row) + j * kCodePitch
          const int j = 8 * half + 2 * m;
          *reinterpret_cast<uint32_t*>(block_codes + j * kCodePitch) = even_columns[m];
          *reinterpret_cast<uint32_t*>(block_codes + (j + 1) * kCodePitch) = odd_columns[m];
        }
      }
    }
    __syncthreads();
    const int64_t following = tile_index + gridDim.x;
    if (following < num_tiles) {
      load_tile_quad(data, scales, amax, num_rows, hidden, row_tile * kTileRows + quad_row,
                     col_tile * kTileCols + block_col, next);
    }

    // Whether the 4 scale bytes of an output row go out as one aligned word (else each lane stores its own byte).
    constexpr int kRowBlocks = kTileRows / 32;
    const int64_t row_blocks = num_rows / 32;
    const bool scale_words = r0 + kTileRows <= num_rows && row_blocks % kRowBlocks == 0 &&
                             (reinterpret_cast<uintptr_t>(out_scales) & 3u) == 0;
    constexpr int kPasses = kTileCols * kRowBlocks / kTileRows;
    uint32_t pass_scale[kPasses];  // this lane's scale byte of each pass (0 where it had no block)
    // Pass p takes tile column col_first + 8 p, i.e. output row k = k0 + col_first + 8 p, with col_first =
    // 16 (u / 8) + u % 8 for u = t / 4 (warp w: the columns of block w), and row block t % 4 in both passes: its flat
    // output index k * R + rb is pass 0's plus 8 p R, and its scale byte's index k * R / 32 + rb / 32 pass 0's plus
    // 8 p R / 32 (rb >= 0, so rb / 32 = rb >> 5). Both passes' columns are in block u / 8: the same row factors,
    // read again in the second pass (a broadcast load; holding them would take 32 more registers).
    const int row_block = t % kRowBlocks;  // which 32 input rows: consecutive lanes
    const int64_t rb = r0 + row_block * 32;
    const int unit = t / kRowBlocks;
    const int col_first = (unit / 8) * 16 + unit % 8;
    const int64_t k_first = k0 + col_first;
    const int64_t index_first = k_first * num_rows + rb;
    static_assert(kTileRows / kRowBlocks == 32 && kPasses == 2, "a thread takes columns c and c + 8 of one block");
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int col = col_first + 8 * pass;  // output row within the tile
      const int64_t k = k_first + 8 * pass;
      const int64_t index0 = index_first + 8 * pass * num_rows;  // flat index of the block's first element
      pass_scale[pass] = 0;
      if (k < hidden && rb < num_rows) {
        float x[32];
        const uint4* codes_in = reinterpret_cast<const uint4*>(code_tile + code_byte(col, row_block * 32));
        const float4* factors = reinterpret_cast<const float4*>(factor_tile + factor_word(col / 16, row_block * 32));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 code_words = codes_in[h];  // rows 16 h .. 16 h + 15 of the block, 4 per word
          const uint32_t words[4] = {code_words.x, code_words.y, code_words.z, code_words.w};
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const float4 factor = factors[4 * h + m];  // rows 16 h + 4 m .. + 3
            float v[4];  // e2m1val * 2^-6 of rows 16 h + 4 m .. + 3 (exact)
            qm::e4m3x2_decode_half<0>(words[m], v[0], v[1]);
            qm::e4m3x2_decode_half<1>(words[m], v[2], v[3]);
            float* y = x + 16 * h + 4 * m;
            y[0] = qm::qm_mul(v[0], factor.x);
            y[1] = qm::qm_mul(v[1], factor.y);
            y[2] = qm::qm_mul(v[2], factor.z);
            y[3] = qm::qm_mul(v[3], factor.w);
          }
        }
        uint4 codes[2];
        if (kStochastic) {
          const uint32_t pair_key = low_indices ? rounding_low_pair_key
                                                : qm::rbits_pair_key(rounding_key, static_cast<uint64_t>(index0) >> 1);
          pass_scale[pass] = mxfp8_encode32_stochastic_hashed(x, qm::rbits_block_keyed(pair_key, index0), codes);
        } else {
          pass_scale[pass] = mxfp8_encode32_nearest(x, codes);
        }
        uint8_t* dst = out_data + index0;
        vec::store16(dst, codes[0]);
        vec::store16(dst + 16, codes[1]);
      }
    }
    // The scale bytes, after both passes (their shuffles' latencies overlap): lanes 4m .. 4m + 3 hold row blocks 0..3
    // of the same output row, and every lane of the warp takes part in the shuffles.
    static_assert(kRowBlocks == 4 && kTileRows % 32 == 0, "the scale word gathers 4 consecutive lanes");
    const int64_t scale_first = k_first * row_blocks + (rb >> 5);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int64_t k = k_first + 8 * pass;
      uint32_t word = pass_scale[pass] << (8 * row_block);
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 1);
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 2);
      uint8_t* scale_dst = out_scales + scale_first + 8 * pass * row_blocks;
      if (scale_words) {
        if (row_block == 0 && k < hidden) *reinterpret_cast<uint32_t*>(scale_dst) = word;  // r0 / 32 % 4 == 0: aligned
      } else if (k < hidden && rb < num_rows) {
        *scale_dst = static_cast<uint8_t>(pass_scale[pass]);
      }
    }
    __syncthreads();  // the next tile's phase 1 overwrites the tile
  }
}

}  // namespace

cudaError_t launch_mxfp8_quantize(const Mxfp8QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  const int64_t blocks_per_row = args.hidden / 32;
  const int64_t total = args.num_rows * blocks_per_row;
  if (total == 0) return cudaSuccess;
  if (!rows_aligned(args.data, args.data_row_stride, 16)) return cudaErrorInvalidValue;  // 16-byte code stores
  const int64_t grid = ceil_div(total, kThreads);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  const uint32_t key = qm::sr_key(args.seed);
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (!rows_aligned(args.x, args.x_row_stride * static_cast<int64_t>(sizeof(T)), 16)) {
      return cudaErrorInvalidValue;  // 16-byte loads of x
    }
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
  // 8 code bytes per load, 16-byte stores of out.
  if (!rows_aligned(data, 0, 8) || !rows_aligned(out, 0, 16)) return cudaErrorInvalidValue;
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
                                             uint64_t seed, const uint64_t* seed_on_device, uint8_t* out_data,
                                             uint8_t* out_scales, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 16 != 0 || num_rows < 0 || num_rows % 32 != 0) return cudaErrorInvalidValue;
  if (e4m3_max != 256.0f && e4m3_max != 448.0f) return cudaErrorInvalidValue;  // the kernel's exact factor * 64
  if (num_rows == 0) return cudaSuccess;
  // 8 code bytes per load (rows of K / 2 bytes, K % 16 == 0), 16-byte code stores (rows of R bytes, R % 32 == 0);
  // out_scales may be unaligned (the kernel then stores bytes).
  if (!rows_aligned(data, 0, 8) || !rows_aligned(out_data, 0, 16)) return cudaErrorInvalidValue;
  const int64_t num_row_tiles = ceil_div(num_rows, kTileRows);
  const int64_t num_tiles = num_row_tiles * ceil_div(hidden, kTileCols);
  const auto kernel = stochastic ? nvfp4_to_mxfp8_transposed_kernel<true> : nvfp4_to_mxfp8_transposed_kernel<false>;
  // Persistent: as many CTAs as fit at once (6 per SM: 80 registers; the tile is 11.4 KiB). 7 and 8 CTAs (72 and 64
  // registers, with spills) measured 1.3% and 9% slower (forty-seventh session).
  int64_t grid = 0;
  const cudaError_t err = resident_grid(kernel, kTileRows, num_tiles, &grid);
  if (err != cudaSuccess) return err;
  const uint32_t key = qm::sr_key(seed);
  const float inv_six_m = qm::nvfp4_inv_six_m(e4m3_max);
  // Every flat output index is below R * K; when that is at most 2^33 every pair index (index >> 1) is below 2^32, so
  // every block's pair key (rbits_block_keyed) is rbits_pair_key(key, 0), computed here once.
  const bool low_indices = num_rows * hidden <= (int64_t{1} << 33);
  const uint32_t low_pair_key = qm::rbits_pair_key(key, 0);
  kernel<<<static_cast<unsigned>(grid), kTileRows, 0, stream>>>(data, scales, amax, num_rows, hidden, num_row_tiles,
                                                                num_tiles, inv_six_m, key, seed_on_device, low_indices,
                                                                low_pair_key, out_data, out_scales);
  return cudaGetLastError();
}

}  // namespace ep_comm
