// PTX wrappers for Hopper warpgroup MMA (sm_90a): wgmma.mma_async with the A operand in registers ("RS"),
// FP16 x FP16 -> FP32, shape m64nNk16 (and E4M3 x E4M3 -> FP32, m64nNk32, for the inexact FP8 mode), B from shared
// memory through a matrix descriptor; BF16 x BF16 -> FP32 with both operands in shared memory ("SS", m64n256k16);
// plus the fences and group waits around them. Only compiled into sm_90a code
// (wgmma does not exist on sm_100a); callers guard with EP_COMM_HAS_WGMMA. The operand lists are long by nature: one
// "+f" per accumulator register.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EP_COMM_HAS_WGMMA 1
#else
#define EP_COMM_HAS_WGMMA 0
#endif

namespace ep_comm {
namespace wgmma {

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: rows of 128 B (64 16-bit k values)
// whose 16-byte chunk c is stored at chunk c ^ (row % 8), 8-row groups 1024 B apart (the stride offset; the leading
// offset is unused: one swizzle atom spans all of a k16 step), tiles 1024-byte aligned. start = tile base + 32 B per
// k16 step; the hardware applies the XOR to the final address.
__device__ __forceinline__ uint64_t make_descriptor_sw128(uint32_t start) {
  return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

#if EP_COMM_HAS_WGMMA
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to the async proxy that
// wgmma reads B through; executed by the writers before the CTA barrier that publishes the stage.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Tells the compiler the registers are read and written here, so it neither moves their uses across this point
// nor reuses them before it: wgmma reads A and writes the accumulators asynchronously, between mma_async and
// the wait_group that retires it, which the compiler cannot see.
template <int N>
__device__ __forceinline__ void fence_operand(float (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void fence_operand(uint32_t (&regs)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(regs[i][j])::"memory");
  }
}

// acc[N/2] += A(64x16, registers a[4], fp16x2 in the mma.m16n8k16 A-fragment order per warp) * B(16xN, smem).
// scale-d is always true (accumulate): callers zero-initialise the accumulators.
template <int N>
struct MmaRS;


template <>
struct MmaRS<16> {
  __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

template <>
struct MmaRS<32> {
  __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

template <>
struct MmaRS<64> {
  __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

// The first 64 accumulator registers of an m64nN wgmma (its operands %0..%63): all of N = 128, most of N = 144.
#define EP_COMM_WGMMA_ACC64_REGS                                                                                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "  \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define EP_COMM_WGMMA_ACC64_OPERANDS(d)                                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),       \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),       \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),       \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),       \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

template <>
struct MmaRS<128> {
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{" EP_COMM_WGMMA_ACC64_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : EP_COMM_WGMMA_ACC64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

// N = 144 (wide last tiles: an expert of 257..288 rows in two tiles of <= 144 instead of 2 x 128 + a remainder).
template <>
struct MmaRS<144> {
  __device__ __forceinline__ static void run(float (&d)[72], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %77, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n144k16.f32.f16.f16 "
        "{" EP_COMM_WGMMA_ACC64_REGS ", %64, %65, %66, %67, %68, %69, %70, %71}, "
        "{%72, %73, %74, %75}, %76, p, 1, 1, 0;\n"
        "}\n"
        : EP_COMM_WGMMA_ACC64_OPERANDS(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]),
          "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};


// FP8 (inexact mode, grouped_gemm.cu kFp8): acc += A(64x32 e4m3, registers a[4], 4 bytes each in the mma.m16n8k32
// 8-bit A-fragment order per warp: a0 row g / a1 row g + 8 at k 4t..4t+3, a2 / a3 the same rows at k 16 + 4t..) *
// B(32xN e4m3, smem, K-major). wgmma's FP8 forms take no transpose flags.
template <int N>
struct MmaRSE4M3;

#define EP_COMM_WGMMA_E4M3(N, ACC_REGS, A_FIRST, DESC, PRED)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                               \
  "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "                                                      \
  "{" ACC_REGS "}, {" A_FIRST "}, " DESC ", p, 1, 1;\n"                                                           \
  "}\n"

template <>
struct MmaRSE4M3<16> {
  __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(EP_COMM_WGMMA_E4M3(16, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", "%12", "%13")
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

template <>
struct MmaRSE4M3<32> {
  __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(EP_COMM_WGMMA_E4M3(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
                                    "%16, %17, %18, %19", "%20", "%21")
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

template <>
struct MmaRSE4M3<64> {
  __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(EP_COMM_WGMMA_E4M3(64,
                                    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
                                    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                                    "%32, %33, %34, %35", "%36", "%37")
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};

template <>
struct MmaRSE4M3<128> {
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(EP_COMM_WGMMA_E4M3(128, EP_COMM_WGMMA_ACC64_REGS, "%64, %65, %66, %67", "%68", "%69")
                 : EP_COMM_WGMMA_ACC64_OPERANDS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
};
#undef EP_COMM_WGMMA_E4M3

// acc[128] += A(64x16 bf16, smem, K-major) * B(16x256 bf16, smem, K-major), both through matrix descriptors ("SS";
// the trainable experts' weight-gradient GEMM, grouped_wgrad.cu). No transposes (both operands K-major). One m64n256
// instruction reads A once per 256 columns (two m64n128 ones read it twice: shared-memory bandwidth).
// The other 64 (%64..%127) of an m64n256 wgmma, after EP_COMM_WGMMA_ACC64_REGS / _OPERANDS.
#define EP_COMM_WGMMA_ACC_HIGH64_REGS \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, "  \
  "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, "  \
  "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "  \
  "%123, %124, %125, %126, %127"
#define EP_COMM_WGMMA_ACC_HIGH64_OPERANDS(d) \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), \
      "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), \
      "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
      "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
__device__ __forceinline__ void mma_ss_bf16_n256(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{" EP_COMM_WGMMA_ACC64_REGS ", " EP_COMM_WGMMA_ACC_HIGH64_REGS "}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : EP_COMM_WGMMA_ACC64_OPERANDS(d), EP_COMM_WGMMA_ACC_HIGH64_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
#undef EP_COMM_WGMMA_ACC_HIGH64_REGS
#undef EP_COMM_WGMMA_ACC_HIGH64_OPERANDS

// Four e4m3 bytes (RNE, saturating to +-448) from two fp16x2: lo's halves become bytes 0 and 1, hi's bytes 2 and 3.
__device__ __forceinline__ uint32_t e4m3x4_from_f16x2(uint32_t lo, uint32_t hi) {
  uint32_t out;
  asm("{\n.reg .b16 l, h;\n"
      "cvt.rn.satfinite.e4m3x2.f16x2 l, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f16x2 h, %2;\n"
      "mov.b32 %0, {l, h};\n}\n"
      : "=r"(out)
      : "r"(lo), "r"(hi));
  return out;
}

#endif  // EP_COMM_HAS_WGMMA

}  // namespace wgmma
}  // namespace ep_comm
