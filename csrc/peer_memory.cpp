// Peer memory without NVSHMEM: CUDA IPC for one node (the fallback when nvshmem4py is missing or fails to
// start), and host-mapped memory for the device error word. Plain CUDA runtime calls, no kernels.
//
// Every function selects `device` first: this module links its own (static) CUDA runtime, whose notion of
// the current device must match the caller's (torch's) before any allocation or handle operation.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "nvlink.h"

namespace ep_comm {
namespace nvlink {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a sticky error so the next call reports its own
    throw std::runtime_error(std::string("ep_comm peer memory: ") + what + ": " + cudaGetErrorString(err));
  }
}

void select(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

}  // namespace

uintptr_t device_alloc_zeroed(int device, size_t bytes) {
  select(device);
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, bytes), "cudaMalloc");
  try {
    check(cudaMemset(ptr, 0, bytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after memset");
  } catch (...) {
    cudaFree(ptr);
    throw;
  }
  return reinterpret_cast<uintptr_t>(ptr);
}

void device_free(int device, uintptr_t ptr) {
  select(device);
  check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

void ipc_get_handle(int device, uintptr_t ptr, unsigned char out[64]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "CUDA IPC handles are 64 bytes");
  select(device);
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
  std::memcpy(out, &handle, sizeof(handle));
}

uintptr_t ipc_open_handle(int device, const unsigned char in[64]) {
  select(device);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, in, sizeof(handle));
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(ptr);
}

void ipc_close_handle(int device, uintptr_t ptr) {
  select(device);
  check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

PeerLink peer_link(int device, int peer) {
  if (device == peer) return PeerLink{true, true};
  int access = 0, atomics = 0;
  check(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, device, peer),
        "cudaDeviceGetP2PAttribute(AccessSupported)");
  check(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, device, peer),
        "cudaDeviceGetP2PAttribute(NativeAtomicSupported)");
  return PeerLink{access != 0, atomics != 0};
}

void host_mapped_alloc(int device, size_t bytes, uintptr_t* host_ptr, uintptr_t* device_ptr) {
  select(device);  // otherwise the static runtime would create a context on device 0
  void* host = nullptr;
  check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  std::memset(host, 0, bytes);
  void* dev = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaHostGetDevicePointer");
  }
  *host_ptr = reinterpret_cast<uintptr_t>(host);
  *device_ptr = reinterpret_cast<uintptr_t>(dev);
}

void host_mapped_free(uintptr_t host_ptr) { check(cudaFreeHost(reinterpret_cast<void*>(host_ptr)), "cudaFreeHost"); }

}  // namespace nvlink
}  // namespace ep_comm
