// The ep_comm._C module. It holds no torch types: Python passes tensor.data_ptr() and
// torch.cuda.current_stream().cuda_stream as integers, so the build never depends on a torch ABI.
#include <cuda_runtime.h>

#include "bindings.h"
#include "stall_announcer.h"

namespace {

// Devices the driver exposes; 0 on a machine without a GPU or driver (then kernels cannot run, but the
// host-emulation entry points still can).
int visible_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls report their own errors
    return 0;
  }
  return count;
}

// The id of the CUDA-graph capture `stream` belongs to, 0 when it is not capturing, -1 when its capture was
// invalidated (it will fail at its end). Buffer keys its ordering of one call after the previous one on it: an event
// recorded inside one capture may only be waited on inside that same capture. The legacy default stream (handle 0)
// cannot capture and is not queried (CUDA refuses queries of it while another stream captures in global mode).
long long stream_capture_id(uintptr_t stream) {
  if (stream == 0) return 0;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  ep_comm::binding::check(cudaStreamGetCaptureInfo(ep_comm::binding::as_stream(stream), &status, &id),
                          "stream_capture_id");
  if (status == cudaStreamCaptureStatusNone) return 0;
  if (status != cudaStreamCaptureStatusActive) return -1;
  return static_cast<long long>(id & 0x7FFFFFFFFFFFFFFFull) + 1;  // > 0: CUDA's ids may start at 0
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_comm CUDA core (torch-free): quantization kernels, NVLink dispatch/combine, NVFP4 grouped GEMM";
  m.def("visible_device_count", &visible_device_count, "CUDA devices visible to this process (0 without a GPU)");
  m.def("stream_capture_id", &stream_capture_id, pybind11::arg("stream"),
        "Capture id of a raw cudaStream_t: 0 when not capturing, -1 for an invalidated capture, else > 0");
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  pybind11::class_<ep_comm::StallAnnouncer>(
      m, "StallAnnouncer",
      "StallAnnouncer(message, seconds): writes message to stderr (fd 2) once unless stop() comes within seconds; a "
      "native thread, so it fires while the caller's thread holds the GIL in a blocked call")
      .def(pybind11::init<std::string, double>(), pybind11::arg("message"), pybind11::arg("seconds"))
      .def("stop", &ep_comm::StallAnnouncer::stop, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "End the timer (idempotent); True when the message was written");
  register_formats(m);
  register_nvlink(m);
  register_gemm(m);
  register_training(m);
  // The FP8 mode's later operand-row forms, built together: the quantizer's (block_values_fp8), the wave receive's
  // (dispatch_arena_waves' fp8) and the combine-row epilogue's (its fp8). Python checks it before using any of them,
  // so that a _C built before them keeps running the rest.
  m.attr("fp8_operand_forms") = true;
}
