// RHT-32 + S2F6 quantize, dequantize, and dequantize-accumulate (the receive side of combine).
// Arithmetic: quant_math.cuh (docs/NUMERICS.md, "RHT-32", "S2F6 quantize", "Combine accumulation").
//
// Quantize and dequantize-accumulate: one lane per 16 consecutive elements, so the two lanes 2q, 2q+1 of a warp
// hold one aligned chunk of 32 (the S2F6 block and the RHT chunk): the FWHT runs 4 stages in registers and one
// across the lane pair, and the block amax is a 2-lane reduction. A warp takes one segment of 512 elements of
// one row (kSegment), so the row is found once per warp and the per-row work of the accumulation (its source
// rows and weights) is staged once per warp and reused by all 16 elements of every lane. Quantize: every lane
// reads 16 contiguous input elements (16-byte loads) and writes 16 code bytes (one 16-byte store).
// Dequantize-accumulate: each term's 512 code bytes and 16 scale bytes of the segment go through a per-warp
// double buffer in shared memory filled with cp.async (loads in flight without holding registers).
// Dequantize: one thread per 8 elements, 4 lanes per chunk (3 FWHT stages in registers, 2 across lanes).
// No lane leaves before the shuffles: out-of-range lanes compute on zeros and skip their stores (hidden % 32
// == 0 keeps every chunk inside one row and one lane pair / lane quad).
#include "cp_async.cuh"
#include "formats.h"
#include "quant_math.cuh"
#include "s2f6_lane.cuh"
#include "vec_io.cuh"

namespace ep_comm {
namespace {

using namespace s2f6_lane;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneValues = 16;               // quantize / accumulate: elements per lane
constexpr int kSegment = 32 * kLaneValues;    // elements of one row per warp

// Dequantize: each thread takes kUnits 8-element units kThreads apart (the 4-lane groups stay aligned: kThreads % 32 ==
// 0) and issues all their loads before any math, for more bytes in flight per SM (measured 66.5% -> 83.0% of
// copy on an H200).
constexpr int kUnits = 4;

// Warp `segment` of the flat (row, 512-element segment) space: its row and this lane's first column.
struct LanePiece {
  int64_t row;
  int64_t column;
  bool valid;  // column < hidden (the row's last segment may be partial)
};
__device__ __forceinline__ LanePiece lane_piece(int64_t segment, int64_t segments_per_row, const RowDiv& div,
                                                int64_t hidden, int lane) {
  LanePiece p;
  p.row = row_of(segment, div);
  p.column = (segment - p.row * segments_per_row) * kSegment + lane * kLaneValues;
  p.valid = p.column < hidden;
  return p;
}

template <typename T, bool kHadamard>
__global__ void __launch_bounds__(kThreads) s2f6_quantize_kernel(S2f6QuantizeArgs args, int64_t segments_per_row,
                                                                 int64_t num_segments, RowDiv div) {
  const int64_t segment = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (segment >= num_segments) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const LanePiece piece = lane_piece(segment, segments_per_row, div, args.hidden, lane);
  float v[kLaneValues];
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) v[k] = 0.0f;
  if (piece.valid) {
    vec::load_row_segment<T, kLaneValues>(static_cast<const T*>(args.x) + piece.row * args.x_row_stride + piece.column,
                                          v);
  }
  uint8_t scale;
  const uint4 codes = quantize_lane16<kHadamard>(v, args.sign_mask, lane, &scale);
  if (!piece.valid) return;
  vec::store16(args.data + piece.row * args.data_row_stride + piece.column, codes);
  if ((lane & 1) == 0) args.scales[piece.row * args.scales_row_stride + piece.column / 32] = scale;
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

// Dequantize-accumulate. Persistent warps walk the (row, 512-element segment) units; a unit's terms are taken in
// chunks of kChunkTerms consecutive terms (a unit with no terms is one empty chunk), and each warp streams its
// chunks through a private double buffer in shared memory filled by cp.async: while the warp sums chunk c, chunk
// c + 1's codes and scales are in flight, so the memory pipe stays busy during the adds and across units without
// holding registers. The kernel is bound by instruction issue more than by bytes in flight, so the sum path is
// kept short: one scale test per chunk (warp vote) and a straight-line path when all 8 terms are used. Measured
// (H200, % of copy, bench/RESULTS.md fifth and sixth sessions): register batches of 4 terms with 3 CTAs per SM,
// 67% (8 in flight with 2 CTAs, 60%); this double buffer with the per-term scale test, 70-71%; with the vote and
// the straight-line path, 72.5-73.3%. The index / weight
// words of the chunk after the next are loaded while a chunk is summed, so staging never waits on a dependent
// load. Every lane sums its 16 elements over a chunk's terms in ascending term order (NUMERICS "Combine
// accumulation"); skipped terms (index < 0 or >= num_src_rows) add nothing.
constexpr int kChunkTerms = 8;
constexpr int kChunkBuffers = 2;
constexpr int kSegmentScales = kSegment / 32;  // scale bytes of one term's segment
constexpr int kAccumulateCtasPerSm = 3;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// One chunk in shared memory. Lane l copies and later reads back codes[t][l] alone (its own 16 code bytes), so
// the codes need no cross-lane synchronisation beyond cp.async.wait_group; scales, weights and used_mask are
// written by some lanes and read by all (wait_group, then __syncwarp).
struct ChunkBuffer {
  uint4 codes[kChunkTerms][32];                 // term t: the segment's 512 code bytes
  uint8_t scales[kChunkTerms][kSegmentScales];  // term t: the segment's 16 scale bytes
  float weights[kChunkTerms];
  uint32_t used_mask;  // bit t: term t is summed (inside the row's terms, index in [0, num_src_rows))
};
// 68,352 bytes per CTA: dynamic shared memory (above the 48 KB static limit).
constexpr size_t kAccumulateSmem = sizeof(ChunkBuffer) * kChunkBuffers * kWarps;
static_assert(kAccumulateCtasPerSm * (kAccumulateSmem + 1024) <= 228 * 1024,
              "kAccumulateCtasPerSm CTAs (1 KB reserved each) must fit in an H100 / H200 SM's 228 KB");

// The next chunk a warp stages: unit `segment` (in row `row`), terms [first_term, first_term + kChunkTerms).
// Past the warp's last unit (segment >= num_segments) it stages empty chunks.
struct ChunkCursor {
  int64_t segment;
  int64_t row;
  int64_t first_term;
};

// The chunk after `c` in the warp's stream: the unit's next terms, else the warp's next unit from term 0.
__device__ __forceinline__ void advance(ChunkCursor& c, int64_t num_terms, int64_t warp_stride,
                                        int64_t num_segments, const RowDiv& div) {
  c.first_term += kChunkTerms;
  if (c.first_term < num_terms) return;
  c.first_term = 0;
  c.segment += warp_stride;
  if (c.segment < num_segments) c.row = row_of(c.segment, div);
}

struct TermWords {  // lane j < kChunkTerms: term j of a chunk (raw index and weight; src = -1 past the row's terms)
  int64_t src = -1;
  float weight = 1.0f;
};

template <typename Index>
__device__ __forceinline__ TermWords load_term_words(const S2f6AccumulateArgs& args, const ChunkCursor& chunk,
                                                     int64_t num_segments, int lane) {
  TermWords t;
  const int64_t j = chunk.first_term + lane;
  if (chunk.segment < num_segments && lane < kChunkTerms && j < args.num_terms) {
    const int64_t at = chunk.row * args.num_terms + j;
    t.src = static_cast<int64_t>(__ldg(static_cast<const Index*>(args.row_index) + at));
    if (args.weights != nullptr) t.weight = __ldg(args.weights + at);
  }
  return t;
}

// Scale bytes when they are not 4 aligned words inside the row (hidden % 128 != 0, or an unaligned scales
// pointer): lane l loads byte l % 16 of terms l / 16 + 2 i with plain loads when the chunk is staged and stores
// them to the chunk's buffer one chunk later, before the wait for it (the loads land during the sum in between).
constexpr int kPendingScales = kChunkTerms * kSegmentScales / 32;
struct PendingScales {
  uint32_t bytes[kPendingScales];
};

__device__ __forceinline__ int pending_term(int lane, int i) { return lane / kSegmentScales + 2 * i; }

__device__ __forceinline__ void store_pending_scales(const PendingScales& pending, int lane, ChunkBuffer& buffer) {
#pragma unroll
  for (int i = 0; i < kPendingScales; ++i) {
    buffer.scales[pending_term(lane, i)][lane % kSegmentScales] = static_cast<uint8_t>(pending.bytes[i]);
  }
}

// Issues the copies of `chunk` (term words `words`) into `buffer` as one cp.async group and stages its weights
// and used terms. Lanes whose 16 elements are past the row end copy nothing; a skipped term copies nothing.
__device__ __forceinline__ void stage_chunk(const S2f6AccumulateArgs& args, const ChunkCursor& chunk,
                                            const TermWords& words, int64_t segments_per_row, bool scale_words,
                                            int lane, ChunkBuffer& buffer, PendingScales& pending) {
  // false for lanes >= kChunkTerms, terms past the row's, and past the warp's last unit
  const bool used = words.src >= 0 && words.src < args.num_src_rows;
  const uint32_t used_mask = __ballot_sync(kFullMask, used);
  __syncwarp();  // every lane has read this buffer's previous chunk
  if (lane < kChunkTerms) buffer.weights[lane] = words.weight;
  if (lane == 0) buffer.used_mask = used_mask;
  const int64_t segment_column = (chunk.segment - chunk.row * segments_per_row) * kSegment;
  const int64_t column = segment_column + lane * kLaneValues;
  const int64_t scales_per_row = args.hidden / 32;
  const int64_t first_scale = segment_column / 32;
  // Per term only the source row changes: its code byte offset src * hidden (scale offset src * hidden / 32,
  // exact as hidden % 32 == 0) is formed once in the term's lane and shuffled; addresses and predicates once.
  const int64_t code_offset = used ? words.src * args.hidden : 0;
  const bool copy_codes = column < args.hidden;
  // Word `lane` of the 16 scale bytes: inside the row whole or not at all (scales_per_row % 4 == 0).
  const bool copy_scale_word =
      scale_words && lane < kSegmentScales / 4 && first_scale + 4 * lane < scales_per_row;
  const int8_t* const codes_src = args.data + column;
  const uint8_t* const scales_src = args.scales + first_scale + 4 * lane;
  const uint32_t codes_dst = cp_async::smem_address(&buffer.codes[0][lane]);  // term t: + t * kSegment bytes
  const uint32_t scales_dst = cp_async::smem_address(&buffer.scales[0][4 * lane]);  // + t * kSegmentScales
#pragma unroll
  for (int t = 0; t < kChunkTerms; ++t) {
    if (((used_mask >> t) & 1u) == 0) continue;  // warp-uniform
    const int64_t src_offset = __shfl_sync(kFullMask, code_offset, t);  // >= 0: a used term
    if (copy_codes) cp_async::copy16(codes_dst + t * kSegment, codes_src + src_offset);
    if (copy_scale_word) {
      cp_async::copy4(scales_dst + t * kSegmentScales, scales_src + static_cast<uint64_t>(src_offset) / 32);
    }
  }
  cp_async::commit();
  if (!scale_words) {
    const int byte = lane % kSegmentScales;
#pragma unroll
    for (int i = 0; i < kPendingScales; ++i) {
      const int t = pending_term(lane, i);
      const int64_t src_offset = __shfl_sync(kFullMask, code_offset, t);
      pending.bytes[i] = 0;
      if (((used_mask >> t) & 1u) != 0 && first_scale + byte < scales_per_row) {
        pending.bytes[i] = __ldg(args.scales + static_cast<uint64_t>(src_offset) / 32 + first_scale + byte);
      }
    }
  }
}

// acc += weight * decoded over the chunk's used terms in ascending order.
// kMagicOnly: every used term's scale is <= kMagicMaxScale in every valid lane (tested once per chunk), so the
// decode needs no per-term branch; kAllUsed: every term of the chunk is summed (no per-term test). Lanes past the
// row end (partial last segment) copied nothing and decode whatever their buffer slots hold with scale 0: their
// sums are never stored, and the inverse RHT only mixes lanes of one 32-element chunk, which is past the row end
// for both or for neither.
template <bool kMagicOnly, bool kAllUsed>
__device__ __forceinline__ void add_terms(const ChunkBuffer& buffer, uint32_t used_mask,
                                          const uint8_t (&scale)[kChunkTerms], int lane, float acc[kLaneValues]) {
#pragma unroll
  for (int t = 0; t < kChunkTerms; ++t) {
    if (!kAllUsed && ((used_mask >> t) & 1u) == 0) continue;  // warp-uniform (one row per warp)
    const uint4 raw = buffer.codes[t][lane];
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    const float weight = buffer.weights[t];
    float v[kLaneValues];
    if (kMagicOnly) {
      unpack_codes_magic<kLaneValues>(words, scale[t], v);
    } else {
      unpack_codes_fast<kLaneValues>(words, scale[t], v);
    }
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) acc[k] = qm::qm_add(acc[k], qm::qm_mul(weight, v[k]));
  }
}

__device__ __forceinline__ void add_chunk(const ChunkBuffer& buffer, bool lane_valid, int lane,
                                          float acc[kLaneValues]) {
  const uint32_t used_mask = buffer.used_mask;
  uint8_t scale[kChunkTerms];
  bool magic_only = true;
#pragma unroll
  for (int t = 0; t < kChunkTerms; ++t) {
    scale[t] = lane_valid ? buffer.scales[t][lane / 2] : uint8_t{0};
    if ((used_mask >> t) & 1u) magic_only = magic_only && scale[t] <= kMagicMaxScale;
  }
  if (!__all_sync(kFullMask, magic_only)) {
    add_terms<false, false>(buffer, used_mask, scale, lane, acc);
  } else if (used_mask == (1u << kChunkTerms) - 1u) {
    add_terms<true, true>(buffer, used_mask, scale, lane, acc);
  } else {
    add_terms<true, false>(buffer, used_mask, scale, lane, acc);
  }
}

// scale_words: the segment's 16 scale bytes are 4 aligned words of the row (hidden % 128 == 0, scales 4-byte
// aligned), copied by lanes 0..3 with cp.async; otherwise PendingScales.
template <typename Index, typename Out, bool kHadamard>
__global__ void __launch_bounds__(kThreads, kAccumulateCtasPerSm)
    s2f6_accumulate_kernel(S2f6AccumulateArgs args, int64_t segments_per_row, int64_t num_segments, RowDiv div,
                           bool scale_words) {
  extern __shared__ uint4 accumulate_smem[];  // kAccumulateSmem bytes: kChunkBuffers ChunkBuffers per warp
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  ChunkBuffer* const buffers = reinterpret_cast<ChunkBuffer*>(accumulate_smem) + warp * kChunkBuffers;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  int64_t segment = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (segment >= num_segments) return;  // the whole warp

  // Stage the first chunk. From then on `next` holds the term words of the chunk at `cursor`, the next to stage.
  ChunkCursor cursor{segment, row_of(segment, div), 0};
  TermWords next = load_term_words<Index>(args, cursor, num_segments, lane);
  PendingScales pending{};
  stage_chunk(args, cursor, next, segments_per_row, scale_words, lane, buffers[0], pending);
  advance(cursor, args.num_terms, warp_stride, num_segments, div);
  next = load_term_words<Index>(args, cursor, num_segments, lane);
  int buffer = 0;  // the buffer of the chunk summed next

  for (; segment < num_segments; segment += warp_stride) {
    const LanePiece piece = lane_piece(segment, segments_per_row, div, args.hidden, lane);
    float acc[kLaneValues];
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) acc[k] = 0.0f;
    // The unit's chunks in the order they were staged: terms from 0 by kChunkTerms, one empty chunk if none.
    for (int64_t first_term = 0; first_term == 0 || first_term < args.num_terms; first_term += kChunkTerms) {
      if (!scale_words) store_pending_scales(pending, lane, buffers[buffer]);
      stage_chunk(args, cursor, next, segments_per_row, scale_words, lane, buffers[buffer ^ 1], pending);
      advance(cursor, args.num_terms, warp_stride, num_segments, div);
      next = load_term_words<Index>(args, cursor, num_segments, lane);  // in flight during the sum
      cp_async::wait<1>();  // this chunk's group; the one just issued stays in flight
      __syncwarp();        // the scale words, weights and used_mask other lanes wrote
      add_chunk(buffers[buffer], piece.valid, lane, acc);
      buffer ^= 1;
    }
    if (kHadamard) rht32_inverse_lane16(acc, args.sign_mask, lane);
    if (piece.valid) {
      vec::store_row_segment<Out, kLaneValues>(static_cast<Out*>(args.out) + piece.row * args.hidden + piece.column,
                                               acc);
    }
  }
}

// Grid of the warp-per-segment kernels: (row, 512-element segment) pairs, kWarps per block.
struct SegmentGrid {
  int64_t segments_per_row = 0;
  int64_t num_segments = 0;
  int64_t blocks = 0;
  RowDiv div;
};

SegmentGrid make_segment_grid(int64_t num_rows, int64_t hidden) {
  SegmentGrid g;
  g.segments_per_row = ceil_div(hidden, kSegment);
  g.num_segments = num_rows * g.segments_per_row;
  g.blocks = ceil_div(g.num_segments, kWarps);
  g.div = make_row_div(g.segments_per_row, g.num_segments);
  return g;
}

}  // namespace

cudaError_t launch_s2f6_quantize(const S2f6QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  if (args.num_rows == 0) return cudaSuccess;
  if (!rows_aligned(args.data, args.data_row_stride, 16)) return cudaErrorInvalidValue;  // 16-byte code stores
  const SegmentGrid g = make_segment_grid(args.num_rows, args.hidden);
  if (g.blocks > INT32_MAX) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (!rows_aligned(args.x, args.x_row_stride * static_cast<int64_t>(sizeof(T)), 16)) return cudaErrorInvalidValue;
    const auto kernel = args.hadamard ? s2f6_quantize_kernel<T, true> : s2f6_quantize_kernel<T, false>;
    kernel<<<static_cast<unsigned>(g.blocks), kThreads, 0, stream>>>(args, g.segments_per_row, g.num_segments, g.div);
    return cudaGetLastError();
  });
}

cudaError_t launch_s2f6_dequantize(const int8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden,
                                   bool hadamard, uint32_t sign_mask, void* out, int out_type, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 32 != 0 || num_rows < 0) return cudaErrorInvalidValue;
  const int64_t total = num_rows * (hidden / 8);
  if (total == 0) return cudaSuccess;
  // 8 code bytes per load, 16-byte stores of out.
  if (!rows_aligned(data, 0, 8) || !rows_aligned(out, 0, 16)) return cudaErrorInvalidValue;
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
  if (args.num_out_rows == 0) return cudaSuccess;
  // 16-byte accesses of data and out.
  if (!rows_aligned(args.data, 0, 16) || !rows_aligned(args.out, 0, 16)) return cudaErrorInvalidValue;
  const SegmentGrid g = make_segment_grid(args.num_out_rows, args.hidden);
  const bool scale_words = args.hidden % 128 == 0 && (reinterpret_cast<uintptr_t>(args.scales) & 3u) == 0;
  return vec::dispatch_elem_type(args.out_type, [&](auto tag) {
    using Out = decltype(tag);
    const auto launch = [&](auto index_tag) {
      using Index = decltype(index_tag);
      const auto kernel = args.hadamard ? s2f6_accumulate_kernel<Index, Out, true>
                                        : s2f6_accumulate_kernel<Index, Out, false>;
      // Chunk buffers above the 48 KB default; the largest carveout so kAccumulateCtasPerSm CTAs fit. Once per kernel
      // (this lambda's instantiation is per Index and Out; the array per RHT variant) and device.
      static std::atomic<uint64_t> configured[2];
      cudaError_t err = once_per_device(configured[args.hadamard ? 1 : 0], [&] {
        cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(kAccumulateSmem));
        if (status == cudaSuccess) {
          status = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared);
        }
        return status;
      });
      int64_t blocks = 0;  // persistent warps: kAccumulateCtasPerSm per SM (launch bounds and shared memory)
      if (err == cudaSuccess) err = resident_grid(kernel, kThreads, g.blocks, &blocks, kAccumulateSmem);
      if (err != cudaSuccess) return err;
      kernel<<<static_cast<unsigned>(blocks), kThreads, kAccumulateSmem, stream>>>(
          args, g.segments_per_row, g.num_segments, g.div, scale_words);
      return cudaGetLastError();
    };
    return args.index_is_int64 ? launch(int64_t{}) : launch(int32_t{});
  });
}

}  // namespace ep_comm
