// The ep_comm._C module. It holds no torch types: Python passes tensor.data_ptr() and
// torch.cuda.current_stream().cuda_stream as integers, so the build never depends on a torch ABI.
#include <cuda_runtime.h>

#include "bindings.h"

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_comm CUDA core (torch-free): quantization kernels, NVLink dispatch/combine, NVFP4 grouped GEMM";
  m.def("visible_device_count", &visible_device_count, "CUDA devices visible to this process (0 without a GPU)");
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  register_formats(m);
  register_nvlink(m);
  register_gemm(m);
}
