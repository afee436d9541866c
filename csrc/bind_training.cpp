// Python bindings of the training kernels: combine's backward rows (training_rows.h), the trainable experts' row
// kernels (training_experts.h) and their weight-gradient GEMM (grouped_wgrad.h). Thin: ep_comm/training.py and
// ep_comm/training_experts.py validate and allocate.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "grouped_wgrad.h"
#include "training_experts.h"
#include "training_rows.h"

namespace py = pybind11;

void register_training(py::module_& m) {
  using ep_comm::binding::as_stream;
  using ep_comm::binding::check;
  using ep_comm::binding::ptr;
  m.def(
      "combine_backward_rows",
      [](uintptr_t g, uintptr_t expert_out, uintptr_t row_weight, uintptr_t src_rank, int64_t num_rows,
         int64_t hidden, uintptr_t grad_expert_out, uintptr_t dots, uintptr_t topk_slot, int64_t weight_columns,
         uintptr_t weight_rows, uintptr_t stream) {
        check(ep_comm::launch_combine_backward_rows(
                  ptr<const uint16_t>(g), ptr<const uint16_t>(expert_out), ptr<const float>(row_weight),
                  ptr<const int32_t>(src_rank), num_rows, hidden, ptr<uint16_t>(grad_expert_out), ptr<float>(dots),
                  ptr<const int32_t>(topk_slot), weight_columns, ptr<uint16_t>(weight_rows), as_stream(stream)),
              "combine_backward_rows");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("g"), py::arg("expert_out"), py::arg("row_weight"),
      py::arg("src_rank"), py::arg("num_rows"), py::arg("hidden"), py::arg("grad_expert_out"), py::arg("dots"),
      py::arg("topk_slot"), py::arg("weight_columns"), py::arg("weight_rows"), py::arg("stream"),
      "Combine's backward on the expert rank: f(w * g) rows, FP32 dots <g, expert_out> and (weight_rows != 0) the "
      "dots as three bf16 parts in their top-k slot's columns (training_rows.h)");
  m.def(
      "mxfp8_round_trips",
      [](uintptr_t x, uintptr_t src_rank, int64_t num_rows, int64_t hidden, int64_t padded_rows, uint64_t seed_rows,
         uint64_t seed_tokens, uintptr_t rows_out, uintptr_t tokens_out, uintptr_t stream,
         uintptr_t seed_rows_on_device, uintptr_t seed_tokens_on_device) {
        check(ep_comm::launch_mxfp8_round_trips(ptr<const uint16_t>(x), ptr<const int32_t>(src_rank), num_rows,
                                                hidden, padded_rows, seed_rows, seed_tokens,
                                                ptr<const uint64_t>(seed_rows_on_device),
                                                ptr<const uint64_t>(seed_tokens_on_device), ptr<uint16_t>(rows_out),
                                                ptr<uint16_t>(tokens_out), as_stream(stream)),
              "mxfp8_round_trips");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("src_rank"), py::arg("num_rows"),
      py::arg("hidden"), py::arg("padded_rows"), py::arg("seed_rows"), py::arg("seed_tokens"), py::arg("rows_out"),
      py::arg("tokens_out"), py::arg("stream"), py::arg("seed_rows_on_device") = 0,
      py::arg("seed_tokens_on_device") = 0,
      "MXFP8 (stochastic) round trips of bf16 rows along K and of their transpose along the tokens, one read "
      "(training_experts.h)");
  m.def(
      "mix_seeds",
      [](uintptr_t in, bool increment_in, const std::vector<uint64_t>& xor_values, uintptr_t out, uintptr_t stream) {
        ep_comm::SeedMixArgs args;
        if (xor_values.size() > static_cast<size_t>(ep_comm::kMaxMixedSeeds)) {
          throw std::invalid_argument("mix_seeds: at most " + std::to_string(ep_comm::kMaxMixedSeeds) + " seeds");
        }
        args.in = ptr<uint64_t>(in);
        args.increment_in = increment_in;
        for (size_t j = 0; j < xor_values.size(); ++j) args.xor_values[j] = xor_values[j];
        args.count = static_cast<int>(xor_values.size());
        args.out = ptr<uint64_t>(out);
        check(ep_comm::launch_mix_seeds(args, as_stream(stream)), "mix_seeds");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("in"), py::arg("increment_in"), py::arg("xor_values"),
      py::arg("out"), py::arg("stream"),
      "out[j] = mix64(*in ^ xor_values[j]) on the device, *in incremented first if asked (training_experts.h)");
  m.def(
      "swiglu_rows",
      [](uintptr_t gate_up, uintptr_t factor, uintptr_t src_rank, int64_t num_rows, int64_t intermediate,
         int64_t padded_rows, uintptr_t out, uintptr_t stream) {
        check(ep_comm::launch_swiglu_rows(ptr<const uint16_t>(gate_up), ptr<const float>(factor),
                                          ptr<const int32_t>(src_rank), num_rows, intermediate, padded_rows,
                                          ptr<float>(out), as_stream(stream)),
              "swiglu_rows");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("gate_up"), py::arg("factor"), py::arg("src_rank"),
      py::arg("num_rows"), py::arg("intermediate"), py::arg("padded_rows"), py::arg("out"), py::arg("stream"),
      "silu(gate * factor) * (up * factor) of w1's bf16 rows, fp32, zero rows up to padded_rows (training_experts.h)");
  m.def(
      "swiglu_backward_rows",
      [](uintptr_t d_hidden, uintptr_t d_factor, uintptr_t gate_up, uintptr_t factor, uintptr_t src_rank,
         int64_t num_rows, int64_t intermediate, uintptr_t d_gate_up, uintptr_t stream) {
        check(ep_comm::launch_swiglu_backward_rows(ptr<const uint16_t>(d_hidden), ptr<const float>(d_factor),
                                                   ptr<const uint16_t>(gate_up), ptr<const float>(factor),
                                                   ptr<const int32_t>(src_rank), num_rows, intermediate,
                                                   ptr<uint16_t>(d_gate_up), as_stream(stream)),
              "swiglu_backward_rows");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("d_hidden"), py::arg("d_factor"), py::arg("gate_up"),
      py::arg("factor"), py::arg("src_rank"), py::arg("num_rows"), py::arg("intermediate"), py::arg("d_gate_up"),
      py::arg("stream"), "SwiGLU's backward on row-scaled bf16 rows, bf16 out (training_experts.h)");
  m.def(
      "scale_rows",
      [](uintptr_t x, uintptr_t factor, uintptr_t src_rank, int64_t num_rows, int64_t hidden, uintptr_t stream) {
        check(ep_comm::launch_scale_rows(ptr<uint16_t>(x), ptr<const float>(factor), ptr<const int32_t>(src_rank),
                                         num_rows, hidden, as_stream(stream)),
              "scale_rows");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("factor"), py::arg("src_rank"),
      py::arg("num_rows"), py::arg("hidden"), py::arg("stream"),
      "In place: bf16 rows times their fp32 factor, zero rows not in use (training_experts.h)");
  m.def(
      "widen_bf16",
      [](uintptr_t x, uintptr_t out, int64_t n, uintptr_t stream) {
        check(ep_comm::launch_widen_bf16(ptr<const uint16_t>(x), ptr<float>(out), n, as_stream(stream)),
              "widen_bf16");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("out"), py::arg("n"), py::arg("stream"),
      "bf16 -> fp32, n elements (training_experts.h)");
  m.def(
      "grouped_wgrad_bf16",
      [](uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb, uintptr_t group_ends, int num_experts, int64_t m_rows,
         int64_t n_rows, int64_t k_total, uintptr_t out, bool accumulate, uintptr_t stream) {
        ep_comm::GroupedWgradArgs args;
        args.a = ptr<const uint16_t>(a);
        args.lda = lda;
        args.b = ptr<const uint16_t>(b);
        args.ldb = ldb;
        args.group_ends = ptr<const int32_t>(group_ends);
        args.num_experts = num_experts;
        args.m_rows = m_rows;
        args.n_rows = n_rows;
        args.k_total = k_total;
        args.out = ptr<float>(out);
        args.accumulate = accumulate;
        check(ep_comm::launch_grouped_wgrad_bf16(args, as_stream(stream)), "grouped_wgrad_bf16");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("a"), py::arg("lda"), py::arg("b"), py::arg("ldb"),
      py::arg("group_ends"), py::arg("num_experts"), py::arg("m_rows"), py::arg("n_rows"), py::arg("k_total"),
      py::arg("out"), py::arg("accumulate"), py::arg("stream"),
      "out[e] (+)= a[:, segment e] @ b[:, segment e]^T, bf16 in, fp32 out, segments along K (grouped_wgrad.h)");
}
