// Registration hooks: each kernel family binds its own launchers (thin, torch-free: pointers, sizes and the
// CUDA stream travel as integers). bindings.cpp defines the module and calls every hook.
#pragma once
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

void register_formats(pybind11::module_& m);  // bind_formats.cpp: NVFP4 / MXFP8 / RHT+S2F6 kernels
void register_nvlink(pybind11::module_& m);   // bind_nvlink.cpp: layout, dispatch, combine over NVLink
void register_gemm(pybind11::module_& m);     // bind_gemm.cpp: NVFP4 grouped GEMM for the experts (sm_90a)
void register_training(pybind11::module_& m); // bind_training.cpp: combine's backward rows (ep_comm.training)

// Shared by the binding files: the integer a Python caller passed (tensor.data_ptr(), cuda_stream) as a typed
// pointer or stream, and a launcher's status as a Python exception.
namespace ep_comm::binding {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// cudaSuccess: nothing; cudaErrorInvalidValue: ValueError "<what>: invalid arguments (<invalid_detail>)";
// anything else: RuntimeError "<what> failed: <CUDA's message>".
inline void check(cudaError_t status, const char* what,
                  const char* invalid_detail = "shape, alignment or size limits") {
  if (status == cudaSuccess) return;
  // A launcher may return the status of a failed runtime call (cudaFuncSetAttribute, an occupancy query) that also
  // left it as the thread's last error: clear it, or the next launch's cudaGetLastError would report this failure as
  // its own (a no-op for sticky errors, which every later call reports anyway).
  cudaGetLastError();
  if (status == cudaErrorInvalidValue) {
    throw std::invalid_argument(std::string(what) + ": invalid arguments (" + invalid_detail + ")");
  }
  throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(status));
}

}  // namespace ep_comm::binding
