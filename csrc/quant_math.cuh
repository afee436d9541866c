// Scalar quantization primitives shared by every format kernel, the dispatch/combine kernels and the
// CPU emulation (formats_host.cpp). Each function implements one rule of docs/NUMERICS.md and must stay
// bit-identical to it, on the device and on the host alike.
//
// The primitives live in one header per family, in dependency order:
//  * qm_arith.cuh: bit casts, correctly rounded fp32 arithmetic (the rules every other part follows), QM_HD, the
//    Blackwell-native switches;
//  * qm_element_formats.cuh: E2M1, E4M3, UE8M0, S2F6 one value at a time;
//  * qm_mxfp8_sr.cuh: counter-based random bits, stochastic rounding, the MXFP8 block encoders;
//  * qm_nvfp4_block.cuh: NVFP4 blocks of 16 (outer and block scales, plain and 4/6 encoders, decode);
//  * qm_rht_bf16.cuh: the serial RHT-32 and BF16 rounding.
// Kernels and the host emulation include this header.
#pragma once

#include "qm_arith.cuh"
#include "qm_element_formats.cuh"
#include "qm_mxfp8_sr.cuh"
#include "qm_nvfp4_block.cuh"
#include "qm_rht_bf16.cuh"
