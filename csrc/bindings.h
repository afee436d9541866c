// Registration hooks: each kernel family binds its own launchers (thin, torch-free: pointers, sizes and the
// CUDA stream travel as integers). bindings.cpp defines the module and calls every hook.
#pragma once
#include <pybind11/pybind11.h>

void register_formats(pybind11::module_& m);  // bind_formats.cpp: NVFP4 / MXFP8 / RHT+S2F6 kernels
void register_nvlink(pybind11::module_& m);   // bind_nvlink.cpp: layout, dispatch, combine over NVLink
void register_gemm(pybind11::module_& m);     // bind_gemm.cpp: NVFP4 grouped GEMM for the experts (sm_90a)
