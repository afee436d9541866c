// Compile-only probe (not built into the library; docs/GEMM.md §4(a)): does ptxas budget the code after
// setmaxnreg.inc at the claimed register count, above the launch cap of 65536 / 384 threads = 168? The consumers are
// shaped like the warp-specialized grouped GEMM that §4(a) plans: two RS warpgroups of 128 weight rows each (two m64
// n128 accumulators = 128 registers) with even / odd A fragment sets of both tiles (64 registers) and a stand-in for
// the weight decode; one producer warpgroup that gives registers back. Run from the repository root:
//   for r in 184 200 232 240; do nvcc -O3 -std=c++17 -arch=sm_90a -DCONSUMER_REGS=$r -c bench/setmaxnreg_probe.cu \
//     -o /tmp/probe.o -Xptxas -v 2>&1 | grep -E "spill|C751"; done
// and once with the setmaxnreg.inc line removed. CUDA 13.0 (2026-12-04): 232 and 240 compile with no spills and no
// C7511 / C7512 (wgmma serialized); 200 and 184 spill 80 B each and serialize every wgmma; without the inc ptxas spills
// 256 B and serializes too. So the claimed count does raise the budget of the consumer code.
#include "../csrc/wgmma.cuh"
#include <cstdint>
using namespace ep_comm;

__device__ __forceinline__ uint32_t decode(uint32_t w, uint32_t s) {
  uint32_t v = (w & 0x8E008E00u);
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(s));
  return r;
}

#ifndef MINB
#define MINB 1
#endif
#ifndef CONSUMER_REGS
#define CONSUMER_REGS 232
#endif

__global__ void __launch_bounds__(384, MINB) setmaxnreg_probe_kernel(float* out, int kblocks) {
#if EP_COMM_HAS_WGMMA
  extern __shared__ __align__(1024) uint8_t smem[];
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    for (int k = threadIdx.x; k < kblocks * 64; k += 128) reinterpret_cast<uint32_t*>(smem)[k % 8192] = k;
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
  const int t = threadIdx.x - 128;
  float acc0[64], acc1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.0f;
  uint32_t e0[4][4], e1[4][4], o0[4][4], o1[4][4];
  auto convert = [&](int k, uint32_t (&a0)[4][4], uint32_t (&a1)[4][4]) {
    const uint4 w0 = reinterpret_cast<const uint4*>(smem)[(k * 256 + t) % 4096];
    const uint4 w1 = reinterpret_cast<const uint4*>(smem)[(k * 256 + 128 + t) % 4096];
    const uint32_t s0 = reinterpret_cast<const uint32_t*>(smem)[(k * 64 + t / 4) % 8192];
    const uint32_t s1 = reinterpret_cast<const uint32_t*>(smem)[(k * 64 + 32 + t / 4) % 8192];
    const uint32_t x0[4] = {w0.x, w0.y, w0.z, w0.w}, x1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a0[s][0] = decode(x0[s], s0); a0[s][1] = decode(x0[s] << 3, s0);
      a0[s][2] = decode(x0[s] * 66u, s0 >> 1); a0[s][3] = decode(x0[s] * 516u, s0 >> 1);
      a1[s][0] = decode(x1[s], s1); a1[s][1] = decode(x1[s] << 3, s1);
      a1[s][2] = decode(x1[s] * 66u, s1 >> 1); a1[s][3] = decode(x1[s] * 516u, s1 >> 1);
    }
  };
  auto step = [&](int k, uint32_t (&c0)[4][4], uint32_t (&c1)[4][4], uint32_t (&n0)[4][4], uint32_t (&n1)[4][4]) {
    wgmma::fence_operand(acc0);
    wgmma::fence_operand(acc1);
    wgmma::fence_operand(c0);
    wgmma::fence_operand(c1);
    wgmma::fence();
    const uint64_t desc = wgmma::make_descriptor_sw128(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(smem)) +
                                                       (k % 4) * 16384);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      wgmma::MmaRS<128>::run(acc0, c0[s], desc + 2 * s);
      wgmma::MmaRS<128>::run(acc1, c1[s], desc + 2 * s);
    }
    wgmma::commit_group();
    wgmma::fence_operand(acc0);
    wgmma::fence_operand(acc1);
    wgmma::wait_group<1>();
    wgmma::fence_operand(n0);
    wgmma::fence_operand(n1);
    if (k + 1 < kblocks) convert(k + 1, n0, n1);
  };
  convert(0, e0, e1);
  for (int k = 0; k < kblocks; k += 2) {
    step(k, e0, e1, o0, o1);
    if (k + 1 < kblocks) step(k + 1, o0, o1, e0, e1);
  }
  wgmma::wait_group<0>();
  wgmma::fence_operand(acc0);
  wgmma::fence_operand(acc1);
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    out[(blockIdx.x * 256 + t) * 128 + i] = acc0[i];
    out[(blockIdx.x * 256 + t) * 128 + 64 + i] = acc1[i];
  }
#endif
}
