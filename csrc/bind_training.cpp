// Python binding of combine's backward rows kernel (training_rows.h). Thin: ep_comm/training.py validates and
// allocates.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "training_rows.h"

namespace py = pybind11;

void register_training(py::module_& m) {
  using ep_comm::binding::as_stream;
  using ep_comm::binding::check;
  using ep_comm::binding::ptr;
  m.def(
      "combine_backward_rows",
      [](uintptr_t g, uintptr_t expert_out, uintptr_t row_weight, uintptr_t src_rank, int64_t num_rows,
         int64_t hidden, uintptr_t grad_expert_out, uintptr_t dots, uintptr_t stream) {
        check(ep_comm::launch_combine_backward_rows(ptr<const uint16_t>(g), ptr<const uint16_t>(expert_out),
                                                    ptr<const float>(row_weight), ptr<const int32_t>(src_rank),
                                                    num_rows, hidden, ptr<uint16_t>(grad_expert_out),
                                                    ptr<float>(dots), as_stream(stream)),
              "combine_backward_rows");
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("g"), py::arg("expert_out"), py::arg("row_weight"),
      py::arg("src_rank"), py::arg("num_rows"), py::arg("hidden"), py::arg("grad_expert_out"), py::arg("dots"),
      py::arg("stream"),
      "Combine's backward on the expert rank: f(w * g) rows and FP32 dots <g, expert_out> (training_rows.h)");
}
