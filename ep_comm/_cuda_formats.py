"""Torch glue for the compiled format kernels (`ep_comm._C`, csrc/formats.h).

`formats.py` validates inputs and calls these functions for CUDA tensors (impl="auto"/"cuda"); they allocate
the outputs on the input's device, launch on the current stream and return the same containers as the
reference. The `host_*` functions run the kernels' arithmetic (csrc/quant_math.cuh) on CPU tensors: the CPU
test tier uses them to prove the bit manipulation against the torch reference without a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _ext
from .formats import (MXFP8Tensor, NVFP4Tensor, S2F6Tensor, _check_mxfp8, _check_nvfp4, _check_rounding,
                      _check_s2f6, _check_seed)

_ELEM_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/formats.h ElemType
_NVFP4_ACTIVATION_M = 256.0
_NVFP4_WEIGHT_M = 448.0


def _lib():
    return _ext.require_cuda_extension("the CUDA format kernels")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, K] tensor whose rows start 16-byte aligned with unit stride along K (a copy if needed)."""
    k = x.shape[-1]
    # 2-D with several rows: checked as it is (a reshape is ~1-2 µs of host time per call on the GPU machines' CPUs).
    # One row goes through reshape, which gives it the row stride K whatever its stride was (the kernels' check
    # below exempts one row, the binding's rows_aligned does not).
    rows = x if x.dim() == 2 and x.shape[0] != 1 else x.reshape(-1, k)
    row_bytes = rows.stride(0) * rows.element_size()
    if rows.stride(-1) != 1 or rows.data_ptr() % 16 != 0 or (rows.shape[0] > 1 and row_bytes % 16 != 0):
        # A copy, not contiguous(): that returns a contiguous view at a misaligned storage offset (a flat buffer sliced
        # at an odd element) as it is, and the kernels' 16-byte loads of it fault.
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows


def _dense_input(x: torch.Tensor) -> torch.Tensor:
    """Inputs the kernels read natively (bf16 / fp16 / fp32); anything else is widened exactly to fp32."""
    return x if x.dtype in _ELEM_TYPES else x.float()


def _output(shape, dtype: torch.dtype, device: torch.device):
    """(tensor the kernel writes, dtype code, dtype asked for): a kernel-native dtype is written directly."""
    native = dtype if dtype in _ELEM_TYPES else torch.float32
    return torch.empty(shape, dtype=native, device=device), _ELEM_TYPES[native]


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


# ----------------------------------------------------------------------------------------------------------
# CUDA kernels (same signatures as the reference paths formats.py dispatches from)
# ----------------------------------------------------------------------------------------------------------
def _launch_nvfp4_quantize(x: torch.Tensor, four_over_six: bool, amax: Optional[torch.Tensor],
                           num_rows_limit: Optional[torch.Tensor], data=None, scales=None, amax_out=None,
                           block_values=None, row_factor=None, block_values_fp8: bool = False) -> None:
    """The quantize kernel on x's rows into either codes (data [R, K/2], scales [R, K/16], amax_out [R]) or, 4/6 only,
    GEMM operand rows (block_values fp16 [R, K], or E4M3 bytes [R, K] with block_values_fp8, row_factor [R]); the
    outputs are contiguous and allocated by the caller."""
    k = x.shape[-1]
    rows = _rows(_dense_input(x))
    num_rows = rows.shape[0]
    amax_in = None if amax is None else amax.reshape(num_rows).float().contiguous()
    e4m3_max = _NVFP4_ACTIVATION_M if four_over_six else _NVFP4_WEIGHT_M
    device = x.device  # (a new torch.device object per access)
    with _ext.cuda_device(device):
        _lib().nvfp4_quantize(rows.data_ptr(), _ELEM_TYPES[rows.dtype], rows.stride(0), num_rows, k, _ptr(amax_in),
                              e4m3_max, four_over_six, _ptr(data), k // 2, _ptr(scales), k // 16, _ptr(amax_out), 0,
                              _ext.current_raw_stream(device), _ptr(num_rows_limit), _ptr(block_values), k,
                              _ptr(row_factor), **({"block_values_fp8": True} if block_values_fp8 else {}))


def nvfp4_quantize(x: torch.Tensor, four_over_six: bool, amax: Optional[torch.Tensor],
                   num_rows_limit: Optional[torch.Tensor] = None) -> NVFP4Tensor:
    """num_rows_limit: optional device int32 scalar tensor; rows at or past it are not quantized (their outputs are
    left unwritten) -- for capacity-sized buffers whose used row count is only known on the device."""
    lead_shape, k, device = x.shape[:-1], x.shape[-1], x.device
    # Allocated in their final shapes and dtypes (contiguous, so the kernel's row-major [R, ...] view of each is the
    # same memory): no reshape or view per output afterwards (with _rows' 2-D case, 4-6 µs of host time per call on
    # an H100 machine: bench/RESULTS.md, eightieth session).
    data = torch.empty((*lead_shape, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((*lead_shape, k // 16), dtype=torch.float8_e4m3fn, device=device)
    amax_out = torch.empty(lead_shape, dtype=torch.float32, device=device)
    _launch_nvfp4_quantize(x, four_over_six, amax, num_rows_limit, data=data, scales=scales, amax_out=amax_out)
    e4m3_max = _NVFP4_ACTIVATION_M if four_over_six else _NVFP4_WEIGHT_M
    return NVFP4Tensor(data=data, scales=scales, amax=amax_out, e4m3_max=e4m3_max)


def nvfp4_quantize_block_values(x: torch.Tensor, amax: Optional[torch.Tensor],
                                num_rows_limit: Optional[torch.Tensor] = None, fp8: bool = False):
    """NVFP4 4/6 of x [R, K] straight into the grouped GEMM operand form: (values fp16 [R, K] = e2m1 * e4m3 block
    scale, row_factor fp32 [R] = amax * fp32(1 / (6 M))), the bits of `grouped_gemm.expand_nvfp4_rows` applied to
    `nvfp4_quantize(x, True, amax)`, in one kernel. fp8: the inexact FP8 mode's rows instead (values float8_e4m3fn
    [R, K], row_factor * 8: expand_nvfp4_rows(..., precision="fp8_inexact")). num_rows_limit as nvfp4_quantize (rows
    past it unwritten)."""
    num_rows, k = x.shape[:-1].numel(), x.shape[-1]
    values = torch.empty(num_rows, k, dtype=torch.float8_e4m3fn if fp8 else torch.float16, device=x.device)
    row_factor = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    _launch_nvfp4_quantize(x, True, amax, num_rows_limit, block_values=values, row_factor=row_factor,
                           block_values_fp8=fp8)
    return values, row_factor


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype, block_values: bool = False) -> torch.Tensor:
    """block_values: the E2M1 x E4M3 values without the outer scale (the kernel's amax == nullptr form; exact in
    bf16 / fp16: at most 6 significant bits, 2^-10 .. 2688)."""
    lib = _lib()
    k = q.data.shape[-1] * 2
    data = _ext.aligned_contiguous(q.data.reshape(-1, k // 2), 8)
    scales = q.scales.view(torch.uint8).reshape(-1, k // 16).contiguous()
    amax = None if block_values else q.amax.reshape(-1).float().contiguous()
    num_rows = data.shape[0]
    out, out_type = _output((num_rows, k), dtype, q.data.device)
    with _ext.cuda_device(q.data.device):
        lib.nvfp4_dequantize(data.data_ptr(), scales.data_ptr(), _ptr(amax), num_rows, k, float(q.e4m3_max),
                             out.data_ptr(), out_type, _ext.current_raw_stream(q.data.device))
    return out.reshape(*q.data.shape[:-1], k).to(dtype)


def _seed_args(seed) -> tuple:
    """(value, device pointer) of a seed for the kernels: an int goes by value, a one-element int64 tensor on the
    kernel's device by address (read when the kernel runs; formats._check_seed_arg checked it)."""
    if isinstance(seed, torch.Tensor):
        return 0, seed.data_ptr()
    return seed & 0xFFFFFFFFFFFFFFFF, 0


def mxfp8_quantize(x: torch.Tensor, rounding: str, seed) -> MXFP8Tensor:
    lib = _lib()
    lead_shape, k = x.shape[:-1], x.shape[-1]
    rows = _rows(_dense_input(x))
    num_rows = rows.shape[0]
    # Final shapes and dtypes, contiguous (as in nvfp4_quantize: no reshape or view afterwards).
    data = torch.empty((*lead_shape, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*lead_shape, k // 32), dtype=torch.float8_e8m0fnu, device=x.device)
    seed_value, seed_on_device = _seed_args(seed)
    with _ext.cuda_device(x.device):
        lib.mxfp8_quantize(rows.data_ptr(), _ELEM_TYPES[rows.dtype], rows.stride(0), num_rows, k,
                           rounding == "stochastic", seed_value, data.data_ptr(), k,
                           scales.data_ptr(), k // 32, _ext.current_raw_stream(x.device), seed_on_device)
    return MXFP8Tensor(data=data, scales=scales)


def mxfp8_dequantize(m: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    lib = _lib()
    k = m.data.shape[-1]
    data = _ext.aligned_contiguous(m.data.view(torch.uint8).reshape(-1, k), 8)
    scales = m.scales.view(torch.uint8).reshape(-1, k // 32).contiguous()
    num_rows = data.shape[0]
    out, out_type = _output((num_rows, k), dtype, m.data.device)
    with _ext.cuda_device(m.data.device):
        lib.mxfp8_dequantize(data.data_ptr(), scales.data_ptr(), num_rows, k, out.data_ptr(), out_type,
                             _ext.current_raw_stream(m.data.device))
    return out.reshape(m.data.shape).to(dtype)


def nvfp4_to_mxfp8_transposed(q: NVFP4Tensor, rounding: str, seed) -> MXFP8Tensor:
    lib = _lib()
    num_rows, k = q.data.shape[0], q.data.shape[1] * 2
    data = _ext.aligned_contiguous(q.data, 8)
    scales = q.scales.view(torch.uint8).contiguous()
    amax = q.amax.float().contiguous()
    out_data = torch.empty(k, num_rows, dtype=torch.uint8, device=q.data.device)
    out_scales = torch.empty(k, num_rows // 32, dtype=torch.uint8, device=q.data.device)
    seed_value, seed_on_device = _seed_args(seed)
    with _ext.cuda_device(q.data.device):
        lib.nvfp4_to_mxfp8_transposed(data.data_ptr(), scales.data_ptr(), amax.data_ptr(), num_rows, k,
                                      float(q.e4m3_max), rounding == "stochastic", seed_value,
                                      out_data.data_ptr(), out_scales.data_ptr(),
                                      _ext.current_raw_stream(q.data.device), seed_on_device)
    return MXFP8Tensor(data=out_data.view(torch.float8_e4m3fn), scales=out_scales.view(torch.float8_e8m0fnu))


def s2f6_quantize(x: torch.Tensor, hadamard: bool, sign_mask: int) -> S2F6Tensor:
    lib = _lib()
    lead_shape, k = x.shape[:-1], x.shape[-1]
    rows = _rows(_dense_input(x))
    num_rows = rows.shape[0]
    # Final shapes and dtypes, contiguous (as in nvfp4_quantize: no reshape or view afterwards).
    data = torch.empty((*lead_shape, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((*lead_shape, k // 32), dtype=torch.float8_e8m0fnu, device=x.device)
    with _ext.cuda_device(x.device):
        lib.s2f6_quantize(rows.data_ptr(), _ELEM_TYPES[rows.dtype], rows.stride(0), num_rows, k, hadamard,
                          sign_mask, data.data_ptr(), k, scales.data_ptr(), k // 32, _ext.current_raw_stream(x.device))
    return S2F6Tensor(data=data, scales=scales, hadamard=hadamard, sign_mask=sign_mask)


def s2f6_dequantize(s: S2F6Tensor, dtype: torch.dtype) -> torch.Tensor:
    lib = _lib()
    k = s.data.shape[-1]
    data = _ext.aligned_contiguous(s.data.reshape(-1, k), 8)
    scales = s.scales.view(torch.uint8).reshape(-1, k // 32).contiguous()
    num_rows = data.shape[0]
    out, out_type = _output((num_rows, k), dtype, s.data.device)
    with _ext.cuda_device(s.data.device):
        lib.s2f6_dequantize(data.data_ptr(), scales.data_ptr(), num_rows, k, s.hadamard, s.sign_mask,
                            out.data_ptr(), out_type, _ext.current_raw_stream(s.data.device))
    return out.reshape(s.data.shape).to(dtype)


def s2f6_dequantize_accumulate(s: S2F6Tensor, row_index: torch.Tensor, weights: Optional[torch.Tensor],
                               out_dtype: torch.dtype) -> torch.Tensor:
    """Indices outside [0, N) are skipped by the kernel like -1 (memory-safe; formats.py decides policy)."""
    lib = _lib()
    num_src_rows, k = s.data.shape
    data = _ext.aligned_contiguous(s.data, 16)
    scales = s.scales.view(torch.uint8).contiguous()
    index = row_index.contiguous()
    weights = None if weights is None else weights.float().contiguous()
    num_out_rows, num_terms = index.shape
    out, out_type = _output((num_out_rows, k), out_dtype, s.data.device)
    with _ext.cuda_device(s.data.device):
        lib.s2f6_dequantize_accumulate(data.data_ptr(), scales.data_ptr(), num_src_rows, k, index.data_ptr(),
                                       index.dtype == torch.int64, _ptr(weights), num_out_rows, num_terms,
                                       s.hadamard, s.sign_mask, out.data_ptr(), out_type,
                                       _ext.current_raw_stream(s.data.device))
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------
# CPU emulation (same arithmetic as the kernels, host memory): results match the reference's containers
# ----------------------------------------------------------------------------------------------------------
def _host(t: torch.Tensor, name: str = "x") -> torch.Tensor:
    """t itself, refused unless it is a CPU tensor: the emulation reads every pointer on the host, where a CUDA address
    (a CUDA amax, row_index or container field too, not only x) would crash the process."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"the host_* emulation takes CPU tensors; {name} is "
                         f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t


def _host_f32(x: torch.Tensor) -> torch.Tensor:
    return _host(x).float().contiguous()


def _host_rows(x: torch.Tensor, block: int):
    """x as contiguous fp32 rows [R, K] and K, with K a positive multiple of `block` (the emulation's loops assume
    whole blocks: S2F6 and the RHT with another K would write past the scales)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"x must be a tensor [..., K] with K a positive multiple of {block}, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    k = x.shape[-1]
    return _host_f32(x).reshape(-1, k), k


def host_nvfp4_quantize(x: torch.Tensor, four_over_six: bool = True,
                        amax: Optional[torch.Tensor] = None) -> NVFP4Tensor:
    xf, k = _host_rows(x, 16)
    lead_shape = x.shape[:-1]
    num_rows = xf.shape[0]
    amax_in = None if amax is None else torch.broadcast_to(_host(torch.as_tensor(amax, dtype=torch.float32), "amax"),
                                                           lead_shape).reshape(num_rows).contiguous()
    e4m3_max = _NVFP4_ACTIVATION_M if four_over_six else _NVFP4_WEIGHT_M
    data = torch.empty(num_rows, k // 2, dtype=torch.uint8)
    scales = torch.empty(num_rows, k // 16, dtype=torch.uint8)
    amax_out = torch.empty(num_rows, dtype=torch.float32)
    _lib().host_nvfp4_quantize(xf.data_ptr(), num_rows, k, _ptr(amax_in), e4m3_max, four_over_six, data.data_ptr(),
                               scales.data_ptr(), amax_out.data_ptr())
    return NVFP4Tensor(data=data.reshape(*lead_shape, k // 2),
                       scales=scales.reshape(*lead_shape, k // 16).view(torch.float8_e4m3fn),
                       amax=amax_out.reshape(lead_shape), e4m3_max=e4m3_max)


def host_nvfp4_dequantize(q: NVFP4Tensor) -> torch.Tensor:
    _check_nvfp4(q)
    _host(q.data, "q")
    k = q.data.shape[-1] * 2
    data = q.data.reshape(-1, k // 2).contiguous()
    scales = q.scales.view(torch.uint8).reshape(-1, k // 16).contiguous()
    amax = q.amax.reshape(-1).float().contiguous()
    out = torch.empty(data.shape[0], k, dtype=torch.float32)
    _lib().host_nvfp4_dequantize(data.data_ptr(), scales.data_ptr(), amax.data_ptr(), data.shape[0], k,
                                 float(q.e4m3_max), out.data_ptr())
    return out.reshape(*q.data.shape[:-1], k)


def host_mxfp8_quantize(x: torch.Tensor, rounding: str = "nearest", seed: int = 0) -> MXFP8Tensor:
    # Checked as the public functions check them: the test oracle must not take a misspelt rounding as nearest or a
    # negative seed modulo 2^64.
    _check_rounding(rounding)
    seed = _check_seed(seed)
    xf, k = _host_rows(x, 32)
    lead_shape = x.shape[:-1]
    data = torch.empty(xf.shape, dtype=torch.uint8)
    scales = torch.empty(xf.shape[0], k // 32, dtype=torch.uint8)
    _lib().host_mxfp8_quantize(xf.data_ptr(), xf.shape[0], k, rounding == "stochastic", seed,
                               data.data_ptr(), scales.data_ptr())
    return MXFP8Tensor(data=data.reshape(*lead_shape, k).view(torch.float8_e4m3fn),
                       scales=scales.reshape(*lead_shape, k // 32).view(torch.float8_e8m0fnu))


def host_mxfp8_dequantize(m: MXFP8Tensor) -> torch.Tensor:
    _check_mxfp8(m)
    _host(m.data, "m")
    k = m.data.shape[-1]
    if k == 0:  # [K, 0] from a requantization of 0 rows, as mxfp8_dequantize takes it (reshape(-1, 0) is ambiguous)
        return torch.empty(m.data.shape, dtype=torch.float32)
    data = m.data.view(torch.uint8).reshape(-1, k).contiguous()
    scales = m.scales.view(torch.uint8).reshape(-1, k // 32).contiguous()
    out = torch.empty(data.shape, dtype=torch.float32)
    _lib().host_mxfp8_dequantize(data.data_ptr(), scales.data_ptr(), data.shape[0], k, out.data_ptr())
    return out.reshape(m.data.shape)


def host_nvfp4_to_mxfp8_transposed(q: NVFP4Tensor, rounding: str = "stochastic", seed: int = 0) -> MXFP8Tensor:
    # Checked as the public functions check them: the test oracle must not take a misspelt rounding as nearest or a
    # negative seed modulo 2^64.
    _check_rounding(rounding)
    seed = _check_seed(seed)
    _check_nvfp4(q)
    _host(q.data, "q")
    # The loops take whole blocks of 32 rows: another row count would read and write past the buffers.
    if q.data.dim() != 2 or q.data.shape[0] % 32 != 0:
        raise ValueError(f"expects a 2-D NVFP4Tensor with a multiple of 32 rows, got data {tuple(q.data.shape)}")
    num_rows, k = q.data.shape[0], q.data.shape[1] * 2
    data = q.data.contiguous()
    scales = q.scales.view(torch.uint8).contiguous()
    amax = q.amax.float().contiguous()
    out_data = torch.empty(k, num_rows, dtype=torch.uint8)
    out_scales = torch.empty(k, num_rows // 32, dtype=torch.uint8)
    _lib().host_nvfp4_to_mxfp8_transposed(data.data_ptr(), scales.data_ptr(), amax.data_ptr(), num_rows, k,
                                          float(q.e4m3_max), rounding == "stochastic", seed,
                                          out_data.data_ptr(), out_scales.data_ptr())
    return MXFP8Tensor(data=out_data.view(torch.float8_e4m3fn), scales=out_scales.view(torch.float8_e8m0fnu))


def host_rht(x: torch.Tensor, sign_mask: int, inverse: bool = False) -> torch.Tensor:
    xf, k = _host_rows(x, 32)
    out = torch.empty(xf.shape, dtype=torch.float32)
    _lib().host_rht(xf.data_ptr(), xf.shape[0], k, sign_mask, inverse, out.data_ptr())
    return out.reshape(x.shape)


def host_s2f6_quantize(x: torch.Tensor, hadamard: bool = True, sign_mask: int = 0x6A09E667) -> S2F6Tensor:
    xf, k = _host_rows(x, 32)
    lead_shape = x.shape[:-1]
    data = torch.empty(xf.shape, dtype=torch.int8)
    scales = torch.empty(xf.shape[0], k // 32, dtype=torch.uint8)
    _lib().host_s2f6_quantize(xf.data_ptr(), xf.shape[0], k, hadamard, sign_mask, data.data_ptr(), scales.data_ptr())
    return S2F6Tensor(data=data.reshape(*lead_shape, k),
                      scales=scales.reshape(*lead_shape, k // 32).view(torch.float8_e8m0fnu),
                      hadamard=hadamard, sign_mask=sign_mask)


def host_s2f6_dequantize(s: S2F6Tensor) -> torch.Tensor:
    _check_s2f6(s)
    _host(s.data, "s")
    k = s.data.shape[-1]
    data = s.data.reshape(-1, k).contiguous()
    scales = s.scales.view(torch.uint8).reshape(-1, k // 32).contiguous()
    out = torch.empty(data.shape, dtype=torch.float32)
    _lib().host_s2f6_dequantize(data.data_ptr(), scales.data_ptr(), data.shape[0], k, s.hadamard, s.sign_mask,
                                out.data_ptr())
    return out.reshape(s.data.shape)


def host_s2f6_dequantize_accumulate(s: S2F6Tensor, row_index: torch.Tensor, weights: Optional[torch.Tensor] = None,
                                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    _check_s2f6(s)
    _host(s.data, "s")
    # The loops read row_index and weights [M, J] as flat M * J arrays: a smaller weights would be read past its end.
    if s.data.dim() != 2 or _host(row_index, "row_index").dim() != 2 or row_index.is_floating_point():
        raise ValueError(f"expects s [N, K] and an integer row_index [M, J], got {tuple(s.data.shape)} and "
                         f"{tuple(row_index.shape)} {row_index.dtype}")
    if weights is not None and _host(weights, "weights").shape != row_index.shape:
        raise ValueError(f"weights must have the shape of row_index {tuple(row_index.shape)}, got "
                         f"{tuple(weights.shape)}")
    num_src_rows, k = s.data.shape
    data = s.data.contiguous()
    scales = s.scales.view(torch.uint8).contiguous()
    index = row_index.to(torch.int64).contiguous()
    weights = None if weights is None else weights.float().contiguous()
    out = torch.empty(index.shape[0], k, dtype=torch.float32)
    _lib().host_s2f6_dequantize_accumulate(data.data_ptr(), scales.data_ptr(), num_src_rows, k, index.data_ptr(),
                                           _ptr(weights), index.shape[0], index.shape[1], s.hadamard, s.sign_mask,
                                           out.data_ptr())
    return out.to(out_dtype)


def _host_elementwise(name: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    xf = _host_f32(x).reshape(-1)
    out = torch.empty(xf.shape, dtype=out_dtype)
    getattr(_lib(), name)(xf.data_ptr(), xf.numel(), out.data_ptr())
    return out.reshape(x.shape)


def host_e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    return _host_elementwise("host_e2m1_encode", x, torch.uint8)


def host_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    return _host_elementwise("host_e4m3_encode", x, torch.uint8)


def host_ue8m0_mxfp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return _host_elementwise("host_ue8m0_mxfp8_scale", amax, torch.uint8)


def host_ue8m0_s2f6_scale(amax: torch.Tensor) -> torch.Tensor:
    return _host_elementwise("host_ue8m0_s2f6_scale", amax, torch.uint8)


def host_bf16_round(x: torch.Tensor) -> torch.Tensor:
    """RNE to bf16 bit patterns (int16 tensor holding the uint16 bits)."""
    return _host_elementwise("host_bf16_round", x, torch.int16)


def host_rbits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """rbits(seed, index) as an int64 tensor of 16-bit values (docs/NUMERICS.md "Random bits")."""
    seed = _check_seed(seed)
    idx = _host(index, "index").to(torch.int64).contiguous().reshape(-1)
    out = torch.empty(idx.shape, dtype=torch.int32)
    _lib().host_rbits(seed, idx.data_ptr(), idx.numel(), out.data_ptr())
    return out.to(torch.int64).reshape(index.shape)


def host_sr_e4m3(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of the stochastic rounding of x with the given 32-bit random words (low 16 bits used)."""
    xf = _host_f32(x).reshape(-1)
    if _host(random_bits, "random_bits").numel() != xf.numel():  # one word per element, read as a flat array
        raise ValueError(f"random_bits must have one word per element of x ({xf.numel()}), got {random_bits.numel()}")
    bits = (random_bits.to(torch.int64) & 0xFFFFFFFF).reshape(-1)
    bits32 = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).contiguous()
    out = torch.empty(xf.shape, dtype=torch.uint8)
    _lib().host_sr_e4m3(xf.data_ptr(), bits32.data_ptr(), xf.numel(), out.data_ptr())
    return out.reshape(x.shape)


def _host_rows_and_amax(x: torch.Tensor, amax):
    """x as contiguous fp32 rows [R, K], the outer amax broadcast to one float32 per row, and K."""
    xf, k = _host_rows(x, 16)
    amax = _host(torch.as_tensor(amax, dtype=torch.float32), "amax")
    row_amax = torch.broadcast_to(amax, (xf.shape[0],)).contiguous()
    return xf, row_amax, k


def _host_nvfp4_decisions(x: torch.Tensor, amax: torch.Tensor, four_over_six: bool, e4m3_max: float) -> torch.Tensor:
    """uint8 [rows, K/16]: how the quantizer decides each block: 0 the general form (the exact 4/6 formula), 1 the
    fast path (with 4/6: its error bound; without: the plain fast codes), 2 the fast path's 4/6 exact-tie step."""
    xf, row_amax, k = _host_rows_and_amax(x, amax)
    decided = torch.empty(xf.shape[0], k // 16, dtype=torch.uint8)
    _lib().host_nvfp4_fast_decided(xf.data_ptr(), xf.shape[0], k, row_amax.data_ptr(), e4m3_max, four_over_six,
                                   decided.data_ptr())
    return decided


def host_nvfp4_fast_decided(x: torch.Tensor, amax: torch.Tensor, four_over_six: bool = True,
                            e4m3_max: float = _NVFP4_ACTIVATION_M) -> torch.Tensor:
    """bool [rows, K/16]: whether the quantizer's fast path handles each block (with 4/6: decides the choice by
    its bound or as an exact tie; without: the plain fast codes); False: the general form (the exact 4/6 formula)."""
    return _host_nvfp4_decisions(x, amax, four_over_six, e4m3_max) != 0


def host_nvfp4_four_six_exact_ties(x: torch.Tensor, amax: torch.Tensor, e4m3_max: float = _NVFP4_ACTIVATION_M):
    """bool [rows, K/16]: the 4/6 blocks the fast path decides as exact ties: left undecided by its error bound, both
    candidates decode every element to the same value, so their errors are equal and the choice is map-6 without the
    exact formula (qm::nvfp4_four_six_block16_fast, step (3))."""
    return _host_nvfp4_decisions(x, amax, True, e4m3_max) == 2


def host_nvfp4_four_over_six_errors(x: torch.Tensor, amax: torch.Tensor, e4m3_max: float = _NVFP4_ACTIVATION_M):
    """(err_6, err_4) float32 [rows, K/16]: the 4/6 candidate errors the quantizer compares, per block."""
    xf, row_amax, k = _host_rows_and_amax(x, amax)
    err6 = torch.empty(xf.shape[0], k // 16, dtype=torch.float32)
    err4 = torch.empty_like(err6)
    _lib().host_nvfp4_four_over_six_errors(xf.data_ptr(), xf.shape[0], k, row_amax.data_ptr(), e4m3_max,
                                           err6.data_ptr(), err4.data_ptr())
    return err6, err4
