// RHT-32 + S2F6 quantize, dequantize, and dequantize-accumulate (the receive side of combine).
// Arithmetic: quant_math.cuh (docs/NUMERICS.md, "RHT-32", "S2F6 quantize", "Combine accumulation").
//
// Quantize and dequantize-accumulate: one lane per 16 consecutive elements, so the two lanes 2q, 2q+1 of a warp
// hold one aligned chunk of 32 (the S2F6 block and the RHT chunk): the FWHT runs 4 stages in registers and one
// across the lane pair, and the block amax is a 2-lane reduction. A warp takes one segment of 512 elements of
// one row (kSegment), so the row is found once per warp and the per-row work of the accumulation (its source
// rows and weights) is staged once per warp and reused by all 16 elements of every lane; every lane reads 16
// contiguous input elements (16-byte loads) and writes 16 code bytes (one 16-byte store).
// Dequantize: one thread per 8 elements, 4 lanes per chunk (3 FWHT stages in registers, 2 across lanes).
// No lane leaves before the shuffles: out-of-range lanes compute on zeros and skip their stores (hidden % 32
// == 0 keeps every chunk inside one row and one lane pair / lane quad).
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
constexpr int kStagedTerms = 32;              // accumulate: (source row, weight) pairs staged per warp at a time

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

// Dequantize-accumulate. Persistent warps walk the (row, 512-element segment) units; for each the warp stages
// the row's (source row, weight) pairs in shared memory, kStagedTerms at a time (byte offsets of the source's
// codes and scales, -1 for a skipped index), then every lane sums its 16 elements over them in ascending term
// order, loading kAccumulateBatch sources before adding them. 4 sources in flight per lane with 3 CTAs per SM
// (80 registers) measured 67% of copy on H200, 8 in flight with 2 CTAs 60% (bench/RESULTS.md, fifth session). The first kStagedTerms index/weight pairs of the
// warp's next unit are loaded while the current one is summed, so a unit costs one memory round trip (its
// codes), not two (indices, then codes).
struct TermWords {  // lane j: term j of a staging pass (raw index and weight; src = -1 past the row's terms)
  int64_t src = -1;
  float weight = 1.0f;
};

template <typename Index>
__device__ __forceinline__ TermWords load_term_words(const S2f6AccumulateArgs& args, int64_t row, int64_t first_term,
                                                     int lane) {
  TermWords t;
  const int64_t j = first_term + lane;
  if (lane < kStagedTerms && j < args.num_terms) {
    t.src = static_cast<int64_t>(__ldg(static_cast<const Index*>(args.row_index) + row * args.num_terms + j));
    if (args.weights != nullptr) t.weight = __ldg(args.weights + row * args.num_terms + j);
  }
  return t;
}

constexpr int kAccumulateBatch = 4;
constexpr int kAccumulateCtasPerSm = 3;

template <typename Index, typename Out, bool kHadamard>
__global__ void __launch_bounds__(kThreads, kAccumulateCtasPerSm) s2f6_accumulate_kernel(S2f6AccumulateArgs args,
                                                                      int64_t segments_per_row, int64_t num_segments,
                                                                      RowDiv div) {
  __shared__ longlong2 staged_offsets[kWarps][kStagedTerms];  // {codes byte offset, scales byte offset}
  __shared__ float staged_weights[kWarps][kStagedTerms];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t scales_per_row = args.hidden / 32;
  int64_t segment = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (segment >= num_segments) return;  // the whole warp
  TermWords next = load_term_words<Index>(args, row_of(segment, div), 0, lane);

  for (; segment < num_segments; segment += warp_stride) {
    const LanePiece piece = lane_piece(segment, segments_per_row, div, args.hidden, lane);
    float acc[kLaneValues];
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) acc[k] = 0.0f;
    for (int64_t first_staged = 0; first_staged < args.num_terms; first_staged += kStagedTerms) {
      const int num_staged = static_cast<int>(min(static_cast<int64_t>(kStagedTerms), args.num_terms - first_staged));
      // Pass 0 was prefetched by the previous unit; later passes (more than kStagedTerms terms) load here.
      const TermWords term = first_staged == 0 ? next : load_term_words<Index>(args, piece.row, first_staged, lane);
      __syncwarp();  // the previous pass's readers are done
      if (lane < num_staged) {
        const bool used = term.src >= 0 && term.src < args.num_src_rows;
        staged_offsets[warp][lane] =
            used ? make_longlong2(term.src * args.hidden, term.src * scales_per_row) : make_longlong2(-1, -1);
        staged_weights[warp][lane] = term.weight;
      }
      __syncwarp();
      if (first_staged == 0 && segment + warp_stride < num_segments) {
        next = load_term_words<Index>(args, row_of(segment + warp_stride, div), 0, lane);  // in flight meanwhile
      }
      for (int first = 0; first < num_staged; first += kAccumulateBatch) {
        // Every load of the batch first (memory parallelism), then the adds in ascending term order (NUMERICS).
        // Skipped terms are warp-uniform (one row per warp), so these branches never diverge.
        uint4 raw[kAccumulateBatch];
        uint8_t scale[kAccumulateBatch];
#pragma unroll
        for (int i = 0; i < kAccumulateBatch; ++i) {
          raw[i] = make_uint4(0u, 0u, 0u, 0u);
          scale[i] = 0;
          if (first + i >= num_staged) continue;
          const longlong2 offsets = staged_offsets[warp][first + i];
          if (offsets.x < 0 || !piece.valid) continue;
          raw[i] = vec::load16(args.data + offsets.x + piece.column);
          scale[i] = __ldg(args.scales + offsets.y + piece.column / 32);
        }
#pragma unroll
        for (int i = 0; i < kAccumulateBatch; ++i) {
          if (first + i >= num_staged || staged_offsets[warp][first + i].x < 0) continue;
          const float weight = staged_weights[warp][first + i];
          float v[kLaneValues];
          unpack_codes16_fast(raw[i], scale[i], v);
#pragma unroll
          for (int k = 0; k < kLaneValues; ++k) acc[k] = qm::qm_add(acc[k], qm::qm_mul(weight, v[k]));
        }
      }
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

bool aligned16(const void* p, int64_t row_stride_bytes) {
  return ((reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(row_stride_bytes)) & 15u) == 0;
}

}  // namespace

cudaError_t launch_s2f6_quantize(const S2f6QuantizeArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 32 != 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  if (args.num_rows == 0) return cudaSuccess;
  if (!aligned16(args.data, args.data_row_stride)) return cudaErrorMisalignedAddress;  // 16-byte code stores
  const SegmentGrid g = make_segment_grid(args.num_rows, args.hidden);
  if (g.blocks > INT32_MAX) return cudaErrorInvalidValue;
  return vec::dispatch_elem_type(args.x_type, [&](auto tag) {
    using T = decltype(tag);
    if (!aligned16(args.x, args.x_row_stride * static_cast<int64_t>(sizeof(T)))) return cudaErrorMisalignedAddress;
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
  if (!aligned16(args.data, 0) || !aligned16(args.out, 0)) return cudaErrorMisalignedAddress;  // 16-byte accesses
  const SegmentGrid g = make_segment_grid(args.num_out_rows, args.hidden);
  return vec::dispatch_elem_type(args.out_type, [&](auto tag) {
    using Out = decltype(tag);
    const auto launch = [&](auto index_tag) {
      using Index = decltype(index_tag);
      const auto kernel = args.hadamard ? s2f6_accumulate_kernel<Index, Out, true>
                                        : s2f6_accumulate_kernel<Index, Out, false>;
      int64_t blocks = 0;  // persistent warps: kAccumulateCtasPerSm per SM (the kernel's launch bounds)
      const cudaError_t err = resident_grid(kernel, kThreads, g.blocks, &blocks);
      if (err != cudaSuccess) return err;
      kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args, g.segments_per_row, g.num_segments, g.div);
      return cudaGetLastError();
    };
    return args.index_is_int64 ? launch(int64_t{}) : launch(int32_t{});
  });
}

}  // namespace ep_comm
