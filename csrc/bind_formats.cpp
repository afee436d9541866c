// Python bindings of the format kernels (formats.h) and of their CPU emulation. Thin on purpose: pointers
// arrive as integers (tensor.data_ptr()), the stream as an integer (torch.cuda.current_stream().cuda_stream),
// shapes/strides as ints; ep_comm/_cuda_formats.py allocates and validates.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "bindings.h"
#include "formats.h"

namespace py = pybind11;

namespace {

using ep_comm::ElemType;
using ep_comm::rows_aligned;
using ep_comm::binding::as_stream;
using ep_comm::binding::check;
using ep_comm::binding::ptr;

// Backstops of what ep_comm/_cuda_formats.py guarantees, for raw calls (a bench, another module): a null address the
// kernel writes through would fault on the device and lose the CUDA context (the launchers do not test addresses for
// null), ValueError naming it instead. The alignment that the kernels' 8- and 16-byte vector accesses need is tested
// by the launchers too (formats.h; cudaErrorInvalidValue, which check() turns into a ValueError that does not say which
// operand); it is tested here again for a message that names it. Checked only where the call has rows (an empty
// tensor's address may be 0).
void require(bool ok, const char* what, const char* detail) {
  if (!ok) throw std::invalid_argument(std::string(what) + ": " + detail);
}
// Bytes of an ElemType element (0 for an unknown code: the launcher refuses it).
int64_t elem_bytes(int type) {
  switch (static_cast<ElemType>(type)) {
    case ElemType::kFloat32:
      return 4;
    case ElemType::kBFloat16:
    case ElemType::kFloat16:
      return 2;
  }
  return 0;
}
// A dense input read (x) or output written (out) in 16-byte vectors, row stride in elements.
void require_dense(uintptr_t address, int type, int64_t row_stride, const char* what, const char* name) {
  require(address != 0, what, name);
  require(row_stride >= 0, what, "the row stride must not be negative");
  require(rows_aligned(address, row_stride * elem_bytes(type), 16), what, "dense rows must start 16-byte aligned");
}

void nvfp4_quantize(uintptr_t x, int x_type, int64_t x_row_stride, int64_t num_rows, int64_t hidden, uintptr_t amax_in,
                    float e4m3_max, bool four_over_six, uintptr_t data, int64_t data_row_stride, uintptr_t scales,
                    int64_t scales_row_stride, uintptr_t amax_out, uintptr_t dst_rows, uintptr_t stream,
                    uintptr_t num_rows_limit, uintptr_t block_values, int64_t block_values_row_stride,
                    uintptr_t row_factor, bool block_values_fp8) {
  ep_comm::Nvfp4QuantizeArgs args;
  args.x = ptr<const void>(x);
  args.x_type = x_type;
  args.x_row_stride = x_row_stride;
  args.num_rows = num_rows;
  args.hidden = hidden;
  args.amax_in = ptr<const float>(amax_in);
  args.e4m3_max = e4m3_max;
  args.four_over_six = four_over_six;
  args.data = ptr<uint8_t>(data);
  args.data_row_stride = data_row_stride;
  args.scales = ptr<uint8_t>(scales);
  args.scales_row_stride = scales_row_stride;
  args.amax_out = ptr<float>(amax_out);
  args.dst_rows = ptr<const int64_t>(dst_rows);
  args.num_rows_limit = ptr<const int32_t>(num_rows_limit);
  args.block_values = ptr<void>(block_values);
  args.block_values_row_stride = block_values_row_stride;
  args.row_factor = ptr<float>(row_factor);
  args.block_values_fp8 = block_values_fp8;
  require(block_values != 0 || !block_values_fp8, "nvfp4_quantize", "block_values_fp8 needs block_values");
  if (num_rows > 0) {
    require_dense(x, x_type, x_row_stride, "nvfp4_quantize", "x is null");
    if (block_values == 0) {  // codes: 8-byte stores per block (block values: the launcher checks its operands)
      require(data != 0 && scales != 0, "nvfp4_quantize", "data and scales are required");
      require(rows_aligned(data, data_row_stride, 8), "nvfp4_quantize", "data rows must start 8-byte aligned");
    }
  }
  check(ep_comm::launch_nvfp4_quantize(args, as_stream(stream)), "nvfp4_quantize");
}

void mxfp8_quantize(uintptr_t x, int x_type, int64_t x_row_stride, int64_t num_rows, int64_t hidden, bool stochastic,
                    uint64_t seed, uintptr_t data, int64_t data_row_stride, uintptr_t scales, int64_t scales_row_stride,
                    uintptr_t stream, uintptr_t seed_on_device) {
  ep_comm::Mxfp8QuantizeArgs args;
  args.x = ptr<const void>(x);
  args.x_type = x_type;
  args.x_row_stride = x_row_stride;
  args.num_rows = num_rows;
  args.hidden = hidden;
  args.stochastic = stochastic;
  args.seed = seed;
  args.seed_on_device = ptr<const uint64_t>(seed_on_device);
  args.data = ptr<uint8_t>(data);
  args.data_row_stride = data_row_stride;
  args.scales = ptr<uint8_t>(scales);
  args.scales_row_stride = scales_row_stride;
  if (num_rows > 0) {
    require_dense(x, x_type, x_row_stride, "mxfp8_quantize", "x is null");
    require(data != 0 && scales != 0, "mxfp8_quantize", "data and scales are required");
    require(rows_aligned(data, data_row_stride, 16), "mxfp8_quantize", "data rows must start 16-byte aligned");
  }
  check(ep_comm::launch_mxfp8_quantize(args, as_stream(stream)), "mxfp8_quantize");
}

void s2f6_quantize(uintptr_t x, int x_type, int64_t x_row_stride, int64_t num_rows, int64_t hidden, bool hadamard,
                   uint32_t sign_mask, uintptr_t data, int64_t data_row_stride, uintptr_t scales,
                   int64_t scales_row_stride, uintptr_t stream) {
  ep_comm::S2f6QuantizeArgs args;
  args.x = ptr<const void>(x);
  args.x_type = x_type;
  args.x_row_stride = x_row_stride;
  args.num_rows = num_rows;
  args.hidden = hidden;
  args.hadamard = hadamard;
  args.sign_mask = sign_mask;
  args.data = ptr<int8_t>(data);
  args.data_row_stride = data_row_stride;
  args.scales = ptr<uint8_t>(scales);
  args.scales_row_stride = scales_row_stride;
  if (num_rows > 0) {
    require_dense(x, x_type, x_row_stride, "s2f6_quantize", "x is null");
    require(data != 0 && scales != 0, "s2f6_quantize", "data and scales are required");
    require(rows_aligned(data, data_row_stride, 16), "s2f6_quantize", "data rows must start 16-byte aligned");
  }
  check(ep_comm::launch_s2f6_quantize(args, as_stream(stream)), "s2f6_quantize");
}

void s2f6_dequantize_accumulate(uintptr_t data, uintptr_t scales, int64_t num_src_rows, int64_t hidden,
                                uintptr_t row_index, bool index_is_int64, uintptr_t weights, int64_t num_out_rows,
                                int64_t num_terms, bool hadamard, uint32_t sign_mask, uintptr_t out, int out_type,
                                uintptr_t stream) {
  ep_comm::S2f6AccumulateArgs args;
  args.data = ptr<const int8_t>(data);
  args.scales = ptr<const uint8_t>(scales);
  args.num_src_rows = num_src_rows;
  args.hidden = hidden;
  args.row_index = ptr<const void>(row_index);
  args.index_is_int64 = index_is_int64;
  args.weights = ptr<const float>(weights);
  args.num_out_rows = num_out_rows;
  args.num_terms = num_terms;
  args.hadamard = hadamard;
  args.sign_mask = sign_mask;
  args.out = ptr<void>(out);
  args.out_type = out_type;
  if (num_out_rows > 0) {
    require_dense(out, out_type, 0, "s2f6_dequantize_accumulate", "out is null");
    require(num_terms == 0 || row_index != 0, "s2f6_dequantize_accumulate", "row_index is null");
    require(num_src_rows == 0 || (data != 0 && scales != 0), "s2f6_dequantize_accumulate",
            "data and scales are required");
    require(rows_aligned(data, 0, 16), "s2f6_dequantize_accumulate", "data must start 16-byte aligned");
  }
  check(ep_comm::launch_s2f6_dequantize_accumulate(args, as_stream(stream)), "s2f6_dequantize_accumulate");
}

// The emulation's loops assume what the launchers test (rows of whole blocks; the transposed form, whole blocks of 32
// rows): S2F6 and the RHT walk num_rows * hidden / 32 flat chunks, which for a hidden not a multiple of 32 runs past a
// [num_rows, hidden / 32] scale buffer; the transposed form reads and writes past its buffers for rows not a multiple
// of 32.
void require_host_rows(int64_t num_rows, int64_t hidden, int64_t block, const char* what) {
  require(num_rows >= 0 && hidden > 0 && hidden % block == 0, what,
          block == 16 ? "hidden must be a positive multiple of 16 and num_rows >= 0"
                      : "hidden must be a positive multiple of 32 and num_rows >= 0");
}

// IEEE subnormals for the duration of a host-emulation call, the caller's mode restored after: the emulation must round
// as the device does, which never flushes, but runs on the caller's thread, whose SSE control word a program may have
// set to flush-to-zero / denormals-are-zero (torch.set_flush_denormal(True)). (A review found the host results then
// differed from the device's, e.g. an S2F6 code 64 at scale 2^-127 decoding to 0.) x86 only: aarch64's FPCR.FZ is not
// handled.
class IeeeDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  IeeeDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFlushBits); }
  ~IeeeDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushBits = 0x8040u;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
#endif
};

void register_host_emulation(py::module_& m) {
  namespace host = ep_comm::host;
  // Every host entry point: the GIL released, IEEE subnormals on.
  const auto release = py::call_guard<py::gil_scoped_release, IeeeDenormals>();
  m.def("host_nvfp4_quantize",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, uintptr_t amax_in, float e4m3_max, bool four_over_six,
           uintptr_t data, uintptr_t scales, uintptr_t amax_out) {
          require_host_rows(num_rows, hidden, 16, "host_nvfp4_quantize");
          host::nvfp4_quantize(ptr<const float>(x), num_rows, hidden, ptr<const float>(amax_in), e4m3_max,
                               four_over_six, ptr<uint8_t>(data), ptr<uint8_t>(scales), ptr<float>(amax_out));
        },
        release);
  m.def("host_nvfp4_dequantize",
        [](uintptr_t data, uintptr_t scales, uintptr_t amax, int64_t num_rows, int64_t hidden, float e4m3_max,
           uintptr_t out) {
          require_host_rows(num_rows, hidden, 16, "host_nvfp4_dequantize");
          require(amax != 0 || num_rows == 0, "host_nvfp4_dequantize", "amax is required (one fp32 per row)");
          host::nvfp4_dequantize(ptr<const uint8_t>(data), ptr<const uint8_t>(scales), ptr<const float>(amax),
                                 num_rows, hidden, e4m3_max, ptr<float>(out));
        },
        release);
  m.def("host_mxfp8_quantize",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, bool stochastic, uint64_t seed, uintptr_t data,
           uintptr_t scales) {
          require_host_rows(num_rows, hidden, 32, "host_mxfp8_quantize");
          host::mxfp8_quantize(ptr<const float>(x), num_rows, hidden, stochastic, seed, ptr<uint8_t>(data),
                               ptr<uint8_t>(scales));
        },
        release);
  m.def("host_mxfp8_dequantize",
        [](uintptr_t data, uintptr_t scales, int64_t num_rows, int64_t hidden, uintptr_t out) {
          require_host_rows(num_rows, hidden, 32, "host_mxfp8_dequantize");
          host::mxfp8_dequantize(ptr<const uint8_t>(data), ptr<const uint8_t>(scales), num_rows, hidden,
                                 ptr<float>(out));
        },
        release);
  m.def("host_nvfp4_to_mxfp8_transposed",
        [](uintptr_t data, uintptr_t scales, uintptr_t amax, int64_t num_rows, int64_t hidden, float e4m3_max,
           bool stochastic, uint64_t seed, uintptr_t out_data, uintptr_t out_scales) {
          require_host_rows(num_rows, hidden, 16, "host_nvfp4_to_mxfp8_transposed");
          require(num_rows % 32 == 0, "host_nvfp4_to_mxfp8_transposed", "num_rows must be a multiple of 32");
          host::nvfp4_to_mxfp8_transposed(ptr<const uint8_t>(data), ptr<const uint8_t>(scales),
                                          ptr<const float>(amax), num_rows, hidden, e4m3_max, stochastic, seed,
                                          ptr<uint8_t>(out_data), ptr<uint8_t>(out_scales));
        },
        release);
  m.def("host_rht",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, uint32_t sign_mask, bool inverse, uintptr_t out) {
          require_host_rows(num_rows, hidden, 32, "host_rht");
          host::rht(ptr<const float>(x), num_rows, hidden, sign_mask, inverse, ptr<float>(out));
        },
        release);
  m.def("host_s2f6_quantize",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, bool hadamard, uint32_t sign_mask, uintptr_t data,
           uintptr_t scales) {
          require_host_rows(num_rows, hidden, 32, "host_s2f6_quantize");
          host::s2f6_quantize(ptr<const float>(x), num_rows, hidden, hadamard, sign_mask, ptr<int8_t>(data),
                              ptr<uint8_t>(scales));
        },
        release);
  m.def("host_s2f6_dequantize",
        [](uintptr_t data, uintptr_t scales, int64_t num_rows, int64_t hidden, bool hadamard, uint32_t sign_mask,
           uintptr_t out) {
          require_host_rows(num_rows, hidden, 32, "host_s2f6_dequantize");
          host::s2f6_dequantize(ptr<const int8_t>(data), ptr<const uint8_t>(scales), num_rows, hidden, hadamard,
                                sign_mask, ptr<float>(out));
        },
        release);
  m.def("host_s2f6_dequantize_accumulate",
        [](uintptr_t data, uintptr_t scales, int64_t num_src_rows, int64_t hidden, uintptr_t row_index,
           uintptr_t weights, int64_t num_out_rows, int64_t num_terms, bool hadamard, uint32_t sign_mask,
           uintptr_t out) {
          require_host_rows(num_src_rows, hidden, 32, "host_s2f6_dequantize_accumulate");
          host::s2f6_dequantize_accumulate(ptr<const int8_t>(data), ptr<const uint8_t>(scales), num_src_rows, hidden,
                                           ptr<const int64_t>(row_index), ptr<const float>(weights), num_out_rows,
                                           num_terms, hadamard, sign_mask, ptr<float>(out));
        },
        release);
  m.def("host_nvfp4_four_over_six_errors",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, uintptr_t amax, float e4m3_max, uintptr_t err6,
           uintptr_t err4) {
          require_host_rows(num_rows, hidden, 16, "host_nvfp4_four_over_six_errors");
          require(amax != 0 || num_rows == 0, "host_nvfp4_four_over_six_errors", "amax is required (one fp32 per row)");
          host::nvfp4_four_over_six_errors(ptr<const float>(x), num_rows, hidden, ptr<const float>(amax), e4m3_max,
                                           ptr<float>(err6), ptr<float>(err4));
        },
        release);
  m.def("host_nvfp4_fast_decided",
        [](uintptr_t x, int64_t num_rows, int64_t hidden, uintptr_t amax, float e4m3_max, bool four_over_six,
           uintptr_t decided) {
          require_host_rows(num_rows, hidden, 16, "host_nvfp4_fast_decided");
          require(amax != 0 || num_rows == 0, "host_nvfp4_fast_decided", "amax is required (one fp32 per row)");
          host::nvfp4_fast_decided(ptr<const float>(x), num_rows, hidden, ptr<const float>(amax), e4m3_max,
                                   four_over_six, ptr<uint8_t>(decided));
        },
        release);
  m.def("host_exhaustive_check",
        [](const std::string& check, uint32_t stride) -> int64_t {
          host::ExhaustiveCheck which;
          if (check == "e2m1_magnitude") {
            which = host::ExhaustiveCheck::kE2m1Magnitude;
          } else if (check == "markstein_1536") {
            which = host::ExhaustiveCheck::kMarkstein1536;
          } else if (check == "markstein_2688") {
            which = host::ExhaustiveCheck::kMarkstein2688;
          } else if (check == "sr_e4m3") {
            which = host::ExhaustiveCheck::kSrE4m3;
          } else if (check == "s2f6_fast") {
            which = host::ExhaustiveCheck::kS2f6Fast;
          } else if (check == "div_six") {
            which = host::ExhaustiveCheck::kDivSix;
          } else if (check == "outer_scales") {
            which = host::ExhaustiveCheck::kOuterScales;
          } else if (check == "no_contraction") {
            which = host::ExhaustiveCheck::kNoContraction;
          } else {
            throw std::invalid_argument("unknown check " + check);
          }
          py::gil_scoped_release unlocked;
          const IeeeDenormals ieee_denormals;
          return host::exhaustive_check(which, stride);
        },
        "mismatches of a fast form vs its definition over every stride-th fp32 bit pattern (1 = all)");
  // Element-level primitives: (input pointer, count, output pointer).
  m.def("host_e2m1_encode", [](uintptr_t x, int64_t n, uintptr_t out) {
    host::e2m1_encode(ptr<const float>(x), n, ptr<uint8_t>(out));
  }, release);
  m.def("host_e4m3_encode", [](uintptr_t x, int64_t n, uintptr_t out) {
    host::e4m3_encode(ptr<const float>(x), n, ptr<uint8_t>(out));
  }, release);
  m.def("host_ue8m0_mxfp8_scale", [](uintptr_t x, int64_t n, uintptr_t out) {
    host::ue8m0_mxfp8_scale(ptr<const float>(x), n, ptr<uint8_t>(out));
  }, release);
  m.def("host_ue8m0_s2f6_scale", [](uintptr_t x, int64_t n, uintptr_t out) {
    host::ue8m0_s2f6_scale(ptr<const float>(x), n, ptr<uint8_t>(out));
  }, release);
  m.def("host_rbits", [](uint64_t seed, uintptr_t index, int64_t n, uintptr_t out) {
    host::rbits(seed, ptr<const int64_t>(index), n, ptr<uint32_t>(out));
  }, release);
  m.def("host_sr_e4m3", [](uintptr_t x, uintptr_t random_bits, int64_t n, uintptr_t out) {
    host::sr_e4m3(ptr<const float>(x), ptr<const uint32_t>(random_bits), n, ptr<uint8_t>(out));
  }, release);
  m.def("host_bf16_round", [](uintptr_t x, int64_t n, uintptr_t out) {
    host::bf16_round(ptr<const float>(x), n, ptr<uint16_t>(out));
  }, release);
}

}  // namespace

void register_formats(py::module_& m) {
  m.attr("ELEM_FLOAT32") = static_cast<int>(ElemType::kFloat32);
  m.attr("ELEM_BFLOAT16") = static_cast<int>(ElemType::kBFloat16);
  m.attr("ELEM_FLOAT16") = static_cast<int>(ElemType::kFloat16);
  const auto release = py::call_guard<py::gil_scoped_release>();

  m.def("nvfp4_quantize", &nvfp4_quantize, release, py::arg("x"), py::arg("x_type"), py::arg("x_row_stride"),
        py::arg("num_rows"), py::arg("hidden"), py::arg("amax_in"), py::arg("e4m3_max"), py::arg("four_over_six"),
        py::arg("data"), py::arg("data_row_stride"), py::arg("scales"), py::arg("scales_row_stride"),
        py::arg("amax_out"), py::arg("dst_rows"), py::arg("stream"), py::arg("num_rows_limit") = 0,
        py::arg("block_values") = 0, py::arg("block_values_row_stride") = 0, py::arg("row_factor") = 0,
        py::arg("block_values_fp8") = false,
        "NVFP4 quantize rows (4/6 or plain); amax_in 0 = per-row amax computed; dst_rows 0 = identity; "
        "num_rows_limit: 0 or a device int32 row count (rows past it are skipped); block_values (fp16) and "
        "row_factor (fp32): 4/6 straight into the grouped GEMM operand form instead of data/scales/amax_out "
        "(block_values_fp8: its inexact FP8 form, E4M3 bytes)");
  m.def("formats_kernels_runnable", []() {
          const bool runnable = ep_comm::formats_kernel_image_status() == cudaSuccess;
          if (!runnable) cudaGetLastError();  // not sticky: leave no error for the next launch to report
          return runnable;
        },
        "whether the format kernels have an image for the current CUDA device (built for its architecture)");
  m.def("formats_kernel_image_error", []() {
          const cudaError_t status = ep_comm::formats_kernel_image_status();
          if (status == cudaSuccess) return std::string();
          cudaGetLastError();  // not sticky: leave no error for the next launch to report
          return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
        },
        "why the format kernels cannot run on the current CUDA device (no image for its architecture, a driver "
        "older than the runtime, ...): the CUDA error's name and text, or '' when they can");
  m.def("nvfp4_dequantize",
        [](uintptr_t data, uintptr_t scales, uintptr_t amax, int64_t num_rows, int64_t hidden, float e4m3_max,
           uintptr_t out, int out_type, uintptr_t stream, uintptr_t num_rows_limit) {
          if (num_rows > 0) {  // amax may be null (block values)
            require(data != 0 && scales != 0, "nvfp4_dequantize", "data and scales are required");
            require(rows_aligned(data, 0, 8), "nvfp4_dequantize", "data must start 8-byte aligned");
            require_dense(out, out_type, 0, "nvfp4_dequantize", "out is null");
          }
          check(ep_comm::launch_nvfp4_dequantize(ptr<const uint8_t>(data), ptr<const uint8_t>(scales),
                                                 ptr<const float>(amax), num_rows, hidden, e4m3_max, ptr<void>(out),
                                                 out_type, as_stream(stream), ptr<const int32_t>(num_rows_limit)),
                "nvfp4_dequantize");
        },
        release, py::arg("data"), py::arg("scales"), py::arg("amax"), py::arg("num_rows"), py::arg("hidden"),
        py::arg("e4m3_max"), py::arg("out"), py::arg("out_type"), py::arg("stream"), py::arg("num_rows_limit") = 0);
  m.def("nvfp4_expand_fp8",
        [](uintptr_t data, uintptr_t scales, int64_t num_rows, int64_t hidden, uintptr_t out, uintptr_t stream,
           uintptr_t num_rows_limit) {
          if (num_rows > 0) {
            require(data != 0 && scales != 0 && out != 0, "nvfp4_expand_fp8", "data, scales and out are required");
            require(rows_aligned(data, 0, 8), "nvfp4_expand_fp8", "data must start 8-byte aligned");
            require(rows_aligned(out, 0, 16), "nvfp4_expand_fp8", "out must start 16-byte aligned");
          }
          check(ep_comm::launch_nvfp4_expand_fp8(ptr<const uint8_t>(data), ptr<const uint8_t>(scales), num_rows,
                                                 hidden, ptr<uint8_t>(out), as_stream(stream),
                                                 ptr<const int32_t>(num_rows_limit)),
                "nvfp4_expand_fp8");
        },
        release, py::arg("data"), py::arg("scales"), py::arg("num_rows"), py::arg("hidden"), py::arg("out"),
        py::arg("stream"), py::arg("num_rows_limit") = 0);
  m.def("mxfp8_quantize", &mxfp8_quantize, release, py::arg("x"), py::arg("x_type"), py::arg("x_row_stride"),
        py::arg("num_rows"), py::arg("hidden"), py::arg("stochastic"), py::arg("seed"), py::arg("data"),
        py::arg("data_row_stride"), py::arg("scales"), py::arg("scales_row_stride"), py::arg("stream"),
        py::arg("seed_on_device") = 0);
  m.def("mxfp8_dequantize",
        [](uintptr_t data, uintptr_t scales, int64_t num_rows, int64_t hidden, uintptr_t out, int out_type,
           uintptr_t stream) {
          if (num_rows > 0) {
            require(data != 0 && scales != 0, "mxfp8_dequantize", "data and scales are required");
            require(rows_aligned(data, 0, 8), "mxfp8_dequantize", "data must start 8-byte aligned");
            require_dense(out, out_type, 0, "mxfp8_dequantize", "out is null");
          }
          check(ep_comm::launch_mxfp8_dequantize(ptr<const uint8_t>(data), ptr<const uint8_t>(scales), num_rows,
                                                 hidden, ptr<void>(out), out_type, as_stream(stream)),
                "mxfp8_dequantize");
        },
        release, py::arg("data"), py::arg("scales"), py::arg("num_rows"), py::arg("hidden"), py::arg("out"),
        py::arg("out_type"), py::arg("stream"));
  m.def("nvfp4_to_mxfp8_transposed",
        [](uintptr_t data, uintptr_t scales, uintptr_t amax, int64_t num_rows, int64_t hidden, float e4m3_max,
           bool stochastic, uint64_t seed, uintptr_t out_data, uintptr_t out_scales, uintptr_t stream,
           uintptr_t seed_on_device) {
          // The kernel's decode factor f(final_b * 64) is exact for these two bounds only (mxfp8.cu).
          require(e4m3_max == 256.0f || e4m3_max == 448.0f, "nvfp4_to_mxfp8_transposed", "e4m3_max must be 256 or 448");
          if (num_rows > 0) {  // out_scales may be unaligned (byte stores then)
            require(data != 0 && scales != 0 && amax != 0 && out_data != 0 && out_scales != 0,
                    "nvfp4_to_mxfp8_transposed", "data, scales, amax, out_data and out_scales are required");
            require(rows_aligned(data, 0, 8), "nvfp4_to_mxfp8_transposed", "data must start 8-byte aligned");
            require(rows_aligned(out_data, 0, 16), "nvfp4_to_mxfp8_transposed", "out_data must start 16-byte aligned");
          }
          check(ep_comm::launch_nvfp4_to_mxfp8_transposed(ptr<const uint8_t>(data), ptr<const uint8_t>(scales),
                                                          ptr<const float>(amax), num_rows, hidden, e4m3_max,
                                                          stochastic, seed, ptr<const uint64_t>(seed_on_device),
                                                          ptr<uint8_t>(out_data), ptr<uint8_t>(out_scales),
                                                          as_stream(stream)),
                "nvfp4_to_mxfp8_transposed");
        },
        release, py::arg("data"), py::arg("scales"), py::arg("amax"), py::arg("num_rows"), py::arg("hidden"),
        py::arg("e4m3_max"), py::arg("stochastic"), py::arg("seed"), py::arg("out_data"), py::arg("out_scales"),
        py::arg("stream"), py::arg("seed_on_device") = 0);
  m.def("s2f6_quantize", &s2f6_quantize, release, py::arg("x"), py::arg("x_type"), py::arg("x_row_stride"),
        py::arg("num_rows"), py::arg("hidden"), py::arg("hadamard"), py::arg("sign_mask"), py::arg("data"),
        py::arg("data_row_stride"), py::arg("scales"), py::arg("scales_row_stride"), py::arg("stream"));
  m.def("s2f6_dequantize",
        [](uintptr_t data, uintptr_t scales, int64_t num_rows, int64_t hidden, bool hadamard, uint32_t sign_mask,
           uintptr_t out, int out_type, uintptr_t stream) {
          if (num_rows > 0) {
            require(data != 0 && scales != 0, "s2f6_dequantize", "data and scales are required");
            require(rows_aligned(data, 0, 8), "s2f6_dequantize", "data must start 8-byte aligned");
            require_dense(out, out_type, 0, "s2f6_dequantize", "out is null");
          }
          check(ep_comm::launch_s2f6_dequantize(ptr<const int8_t>(data), ptr<const uint8_t>(scales), num_rows,
                                                hidden, hadamard, sign_mask, ptr<void>(out), out_type,
                                                as_stream(stream)),
                "s2f6_dequantize");
        },
        release, py::arg("data"), py::arg("scales"), py::arg("num_rows"), py::arg("hidden"), py::arg("hadamard"),
        py::arg("sign_mask"), py::arg("out"), py::arg("out_type"), py::arg("stream"));
  m.def("s2f6_dequantize_accumulate", &s2f6_dequantize_accumulate, release, py::arg("data"), py::arg("scales"),
        py::arg("num_src_rows"), py::arg("hidden"), py::arg("row_index"), py::arg("index_is_int64"),
        py::arg("weights"), py::arg("num_out_rows"), py::arg("num_terms"), py::arg("hadamard"), py::arg("sign_mask"),
        py::arg("out"), py::arg("out_type"), py::arg("stream"));
  register_host_emulation(m);
}
