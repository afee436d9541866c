// Python binding of the NVFP4 grouped GEMM (grouped_gemm.h). Thin: pointers, sizes and the stream arrive as
// integers; ep_comm/grouped_gemm.py validates, allocates and documents the shapes.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "bindings.h"
#include "grouped_gemm.h"

namespace py = pybind11;

namespace {

using ep_comm::binding::as_stream;
using ep_comm::binding::check;
using ep_comm::binding::ptr;

// The fields both entry points share: operands, weights, the dispatch layout and the tiles.
ep_comm::GroupedGemmArgs operand_args(uintptr_t x, int64_t x_row_stride, uintptr_t row_factor, uintptr_t w_values,
                                      uintptr_t w_scales, uintptr_t w_factor, uintptr_t expert_offsets,
                                      uintptr_t num_tokens_per_expert, int num_experts, int n, int k,
                                      int64_t num_rows_total, int token_tile, int tail_tile) {
  ep_comm::GroupedGemmArgs args;
  args.x = ptr<const uint16_t>(x);
  args.x_row_stride = x_row_stride;
  args.row_factor = ptr<const float>(row_factor);
  args.w_values = ptr<const uint32_t>(w_values);
  args.w_scales = ptr<const uint8_t>(w_scales);
  args.w_factor = ptr<const float>(w_factor);
  args.expert_offsets = ptr<const int32_t>(expert_offsets);
  args.num_tokens_per_expert = ptr<const int32_t>(num_tokens_per_expert);
  args.num_experts = num_experts;
  args.n = n;
  args.k = k;
  args.num_rows_total = num_rows_total;
  args.token_tile = token_tile;
  args.tail_tile = tail_tile;
  return args;
}

void launch(const ep_comm::GroupedGemmArgs& args, uintptr_t stream, const char* what, const char* invalid_detail) {
  const cudaError_t status = ep_comm::launch_grouped_gemm_nvfp4(args, as_stream(stream));
  if (status == cudaErrorNotSupported) {
    cudaGetLastError();  // (see check: never left for a later launch to report)
    throw std::runtime_error("grouped_gemm_nvfp4: needs an sm_90 (Hopper) GPU: the kernel is built on wgmma");
  }
  check(status, what, invalid_detail);
}

void grouped_gemm_nvfp4(uintptr_t x, int64_t x_row_stride, uintptr_t row_factor, uintptr_t w_values,
                        uintptr_t w_scales, uintptr_t w_factor, uintptr_t expert_offsets,
                        uintptr_t num_tokens_per_expert, int num_experts, int n, int k, int64_t num_rows_total,
                        uintptr_t out, int out_type, int64_t out_row_stride, bool swiglu, int token_tile,
                        int tail_tile, uintptr_t row_amax, uintptr_t wave_area, uintptr_t wave_epoch,
                        uintptr_t wave_abort, uintptr_t wave_error_word, uint64_t wave_timeout_ns, uintptr_t stream,
                        bool fp8) {
  ep_comm::GroupedGemmArgs args = operand_args(x, x_row_stride, row_factor, w_values, w_scales, w_factor,
                                               expert_offsets, num_tokens_per_expert, num_experts, n, k,
                                               num_rows_total, token_tile, tail_tile);
  args.out = ptr<void>(out);
  args.out_type = out_type;
  args.out_row_stride = out_row_stride;
  args.swiglu = swiglu;
  args.row_amax = ptr<float>(row_amax);
  args.fp8 = fp8;
  if (wave_area != 0) {  // waves.h: the programmatic dependent of the wave dispatch receive just launched
    if (!wave_epoch || !wave_abort || !wave_error_word) throw std::invalid_argument("waves need all four addresses");
    args.wave.area = ptr<unsigned long long>(wave_area);
    args.wave.epoch = ptr<const unsigned long long>(wave_epoch);
    args.wave.abort = ptr<unsigned int>(wave_abort);
    args.wave.error_word = ptr<unsigned long long>(wave_error_word);
    args.wave.timeout_ns = wave_timeout_ns;
  }
  launch(args, stream, "grouped_gemm_nvfp4",
         "n % 64, k % 64, strides, token_tile in {0, 16, 32, 64, 128}, tail_tile in {-1, 0, 16, 32, 64} below it, "
         "out_type 0/1, row_amax only with swiglu, a tuning override without a compiled kernel, too many token "
         "tiles for one grid, or FP8 with k % 128 != 0 or waves");
}

// The same GEMM with the combine-row epilogue (out_type 2, grouped_gemm.h CombineRows): no out tensor; every valid
// row is stored as RHT + S2F6 into the combine area of its source rank.
void grouped_gemm_nvfp4_combine_rows(uintptr_t x, int64_t x_row_stride, uintptr_t row_factor, uintptr_t w_values,
                                     uintptr_t w_scales, uintptr_t w_factor, uintptr_t expert_offsets,
                                     uintptr_t num_tokens_per_expert, int num_experts, int n, int k,
                                     int64_t num_rows_total, int token_tile, int tail_tile, uintptr_t bases,
                                     int64_t area_offset, uintptr_t src_rank, uintptr_t src_token, uintptr_t topk_slot,
                                     int topk, int num_ranks, int64_t max_tokens, int64_t row_bytes,
                                     int64_t scale_offset, uint32_t sign_mask,
                                     uintptr_t abort_flag, uintptr_t stream, bool fp8) {
  ep_comm::GroupedGemmArgs args = operand_args(x, x_row_stride, row_factor, w_values, w_scales, w_factor,
                                               expert_offsets, num_tokens_per_expert, num_experts, n, k,
                                               num_rows_total, token_tile, tail_tile);
  args.out_type = 2;
  args.fp8 = fp8;
  args.combine.bases = ptr<const uint64_t>(bases);
  args.combine.offset = area_offset;
  args.combine.src_rank = ptr<const int32_t>(src_rank);
  args.combine.src_token = ptr<const int32_t>(src_token);
  args.combine.topk_slot = ptr<const int32_t>(topk_slot);
  args.combine.topk = topk;
  args.combine.num_ranks = num_ranks;
  args.combine.max_tokens = max_tokens;
  args.combine.row_bytes = row_bytes;
  args.combine.scale_offset = scale_offset;
  args.combine.sign_mask = sign_mask;
  args.combine.abort = ptr<const unsigned int>(abort_flag);
  launch(args, stream, "grouped_gemm_nvfp4 (combine rows)",
         "n % 64, k % 64, token_tile / tail_tile, no SwiGLU, 16-byte aligned combine rows with room for the "
         "scales, or too many token tiles for one grid");
}

}  // namespace

void register_gemm(py::module_& m) {
  m.def("grouped_gemm_nvfp4", &grouped_gemm_nvfp4, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
        py::arg("x_row_stride"), py::arg("row_factor"), py::arg("w_values"), py::arg("w_scales"), py::arg("w_factor"),
        py::arg("expert_offsets"), py::arg("num_tokens_per_expert"), py::arg("num_experts"), py::arg("n"),
        py::arg("k"), py::arg("num_rows_total"), py::arg("out"), py::arg("out_type"), py::arg("out_row_stride"),
        py::arg("swiglu"), py::arg("token_tile"), py::arg("tail_tile"), py::arg("row_amax"), py::arg("wave_area"),
        py::arg("wave_epoch"), py::arg("wave_abort"), py::arg("wave_error_word"), py::arg("wave_timeout_ns"),
        py::arg("stream"), py::arg("fp8") = false,
        "NVFP4 grouped GEMM (sm_90a): y = x . w_e^T * row_factor * w_factor[e] per expert segment; see "
        "ep_comm/grouped_gemm.py");
  m.def("grouped_gemm_nvfp4_combine_rows", &grouped_gemm_nvfp4_combine_rows, py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("x_row_stride"), py::arg("row_factor"), py::arg("w_values"), py::arg("w_scales"),
        py::arg("w_factor"), py::arg("expert_offsets"), py::arg("num_tokens_per_expert"), py::arg("num_experts"),
        py::arg("n"), py::arg("k"), py::arg("num_rows_total"), py::arg("token_tile"), py::arg("tail_tile"),
        py::arg("bases"), py::arg("area_offset"), py::arg("src_rank"), py::arg("src_token"), py::arg("topk_slot"),
        py::arg("topk"), py::arg("num_ranks"), py::arg("max_tokens"), py::arg("row_bytes"), py::arg("scale_offset"),
        py::arg("sign_mask"), py::arg("abort_flag"),
        py::arg("stream"), py::arg("fp8") = false,
        "NVFP4 grouped GEMM (sm_90a) whose epilogue stores RHT + S2F6 combine rows (see ep_comm/grouped_gemm.py)");
  // The inexact FP8 mode's marker: a _C built before it has no fp8 argument (ep_comm/grouped_gemm.py checks).
  m.attr("grouped_gemm_fp8") = true;
  m.def("grouped_gemm_auto_token_tile", &ep_comm::grouped_gemm_auto_token_tile, py::arg("num_rows_total"),
        py::arg("num_experts"), "token tile the launcher picks for token_tile = 0");
}
