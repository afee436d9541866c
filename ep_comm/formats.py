"""Wire and GEMM formats: NVFP4, MXFP8, RHT-32 + S2F6 — the torch reference and the dispatch to CUDA kernels.

Every function here follows docs/NUMERICS.md operation for operation; the CUDA kernels in `csrc/` are
bit-identical to it. The reference is plain torch (CPU or CUDA tensors). With `impl="auto"` (default) a
CUDA tensor goes to the compiled kernels when `ep_comm._C` is available, else to the reference — and
`ep_comm.cuda_extension_error()` says why; `impl="reference"` / `impl="cuda"` force a path
(`"cuda"` raises when it is unavailable).

Containers are frozen dataclasses whose fields use torch's own dtypes (`float8_e4m3fn`,
`float8_e8m0fnu`, `int8`; packed FP4 as `uint8`, lower element index in the low nibble). Every tensor field
of at least one dimension can be viewed as `uint8` bytes with `.view(torch.uint8)` (the 0-d amax of a 1-D input:
`.reshape(1)` first).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import operator
import struct
import threading
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _ext
from ._compile import eager_only

__all__ = [
    "NVFP4Tensor", "MXFP8Tensor", "S2F6Tensor", "DEFAULT_SIGN_MASK",
    "nvfp4_quantize", "nvfp4_dequantize", "mxfp8_quantize", "mxfp8_dequantize", "nvfp4_to_mxfp8_transposed",
    "rht", "inverse_rht", "s2f6_quantize", "s2f6_dequantize", "s2f6_dequantize_accumulate", "dequantize",
    "e2m1_encode", "e2m1_decode", "e4m3_encode", "e4m3_decode", "ue8m0_mxfp8_scale", "ue8m0_s2f6_scale",
    "ue8m0_decode", "rbits",
]

DEFAULT_SIGN_MASK = 0x6A09E667  # bit i set -> element i of each 32-chunk is negated before the Hadamard
FLT_MAX = 3.4028234663852886e38
NVFP4_BLOCK = 16
MX_BLOCK = 32
E4M3_MAX = 448.0
NVFP4_ACTIVATION_E4M3_MAX = 256.0  # the 4/6 global bound M (leaves room for the 1.5x map-to-4 scale)
NVFP4_WEIGHT_E4M3_MAX = 448.0

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------------------
_FLOAT4_X2 = getattr(torch, "float4_e2m1fn_x2", None)  # torch's packed FP4 dtype (absent from older torch)


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class NVFP4Tensor:
    """NVFP4 along the last axis (blocks of 16).

    data: uint8 [..., K/2], two E2M1 codes per byte, element 2j in the low nibble. torch's packed
        float4_e2m1fn_x2 (the same bytes) is accepted too and kept as its uint8 view (no copy).
    scales: float8_e4m3fn [..., K/16], one block decode scale per 16 elements (never negative).
    amax: float32 [...], the outer FP32 amax of each row (per token; per-tensor/per-expert amaxes are
        broadcast to rows), +0.0 or more, or +Inf, never NaN. The outer decode scale is amax / (6 * e4m3_max).
    e4m3_max: the bound M used for the outer scale: 256 for activations with 4/6, 448 for plain NVFP4.
    The quantizers compute such amaxes, and refuse a given one that is negative, -0.0 or NaN, except with
    check_amax=False or inside a CUDA-graph capture (no device->host read there). The dequantizers check the fields'
    shapes, dtypes and devices but not these values (that would be a device->host read per call): a container with a
    negative scale byte or a negative amax decodes with its signs flipped, a -0.0 amax decodes its zeros as -0.0, and
    a NaN amax decodes to NaN.
    """

    data: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    e4m3_max: float

    def __post_init__(self):
        # One byte layout for every consumer (the reference's bit operations do not take the float4 dtype).
        if isinstance(self.data, torch.Tensor) and self.data.dtype == _FLOAT4_X2:
            object.__setattr__(self, "data", self.data.view(torch.uint8))

    @property
    def shape(self) -> torch.Size:
        """The quantized tensor's shape [..., K] (data holds K / 2 bytes per row)."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class MXFP8Tensor:
    """MXFP8 along the last axis: data float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K/32]."""

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The quantized tensor's shape [..., K] (one data byte per element)."""
        return self.data.shape


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class S2F6Tensor:
    """S2F6 (int8 fixed point, value = code * 2^-6 * 2^(scale - 127)) along the last axis, blocks of 32.

    data: int8 [..., K]; scales: float8_e8m0fnu [..., K/32].
    hadamard: whether the values were rotated by the RHT-32 before quantization (then dequantization
        applies the inverse; default True, as s2f6_quantize and the combine wire format); sign_mask: the RHT sign
        vector.
    """

    data: torch.Tensor
    scales: torch.Tensor
    hadamard: bool = True
    sign_mask: int = DEFAULT_SIGN_MASK

    @property
    def shape(self) -> torch.Size:
        """The quantized tensor's shape [..., K] (one data byte per element)."""
        return self.data.shape


# The containers are plain tensors and numbers: allowed in torch.load's default weights-only unpickling (torch >= 2.4), so
# that saved NVFP4 weights load without weights_only=False (which would run arbitrary pickled code). Import ep_comm
# before torch.load, so that this has run.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([NVFP4Tensor, MXFP8Tensor, S2F6Tensor])


# ----------------------------------------------------------------------------------------------------------
# Input checks and implementation choice
# ----------------------------------------------------------------------------------------------------------
_FLOAT_INPUTS = (torch.bfloat16, torch.float32, torch.float16)


# docs/NUMERICS.md: no implementation flushes subnormals. torch.set_flush_denormal(True) makes the CPU flush them (FTZ
# and DAZ) on the thread that called it, and on every thread started from it afterwards: torch's intra-op threads
# started while it was on flush too, whatever the calling thread does later. So a CPU result could depend on which
# thread computed which rows. The GPU never flushes. The guard below keeps subnormals on both: the calling thread's
# flag is switched off for the call, and where the intra-op threads flush, the call runs on one intra-op thread.
# The test value is made from its bits: a literal such as 1e-310 would read as 0.0 when the module is compiled on a
# thread that flushes (no .pyc: PYTHONDONTWRITEBYTECODE, a read-only install), and the guard would never engage.
_SUBNORMAL = struct.unpack("<d", struct.pack("<Q", 1 << 44))[0]  # 2^-1030, a subnormal double
_ONE = 1.0  # a variable, not a constant expression: _SUBNORMAL * _ONE is computed at run time


def _thread_flushes_subnormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormals (torch.set_flush_denormal sets the SSE control word
    that Python's floats use too): one Python float product."""
    return _SUBNORMAL * _ONE == 0.0


# at::internal::GRAIN_SIZE: an elementwise op of n elements runs on min(threads, n / GRAIN) intra-op threads, each
# taking a contiguous share.
_INTRA_OP_GRAIN = 32768
_intra_op_threads_checked = {}  # torch.get_num_threads() -> whether all those threads keep subnormals
_one_thread_lock = threading.RLock()


def _intra_op_threads_keep_subnormals() -> bool:
    """Whether torch's intra-op threads keep subnormals, asked once per thread count: an elementwise product whose
    inputs and results are subnormal (flushed under DAZ or FTZ), large enough to give every thread its share. Call it
    only where this thread keeps subnormals (it takes part in the product)."""
    threads = torch.get_num_threads()
    keeps = _intra_op_threads_checked.get(threads)
    if keeps is None:
        subnormals = torch.full((threads * _INTRA_OP_GRAIN,), 0x00400000, dtype=torch.int32).view(torch.float32)
        halved = torch.mul(subnormals, 0.5).view(torch.int32)  # 2^-127 * 0.5 = 2^-128: bits 0x00200000
        keeps = bool((halved == 0x00200000).all())
        _intra_op_threads_checked[threads] = keeps
    return keeps


@contextlib.contextmanager
def _on_one_intra_op_thread():
    """torch.set_num_threads(1) within the block, restored on exit (a lock: the thread count is process-wide)."""
    with _one_thread_lock:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def ieee_subnormals():
    """Within the block, CPU arithmetic keeps subnormals (NUMERICS.md), whatever torch.set_flush_denormal set: this
    thread's flag is off (restored on exit), and where torch's intra-op threads flush (they were started while the flag
    was on) the block runs on one intra-op thread (with a warning, once)."""
    thread_flushes = _thread_flushes_subnormals()
    if thread_flushes:
        torch.set_flush_denormal(False)
    try:
        if _intra_op_threads_keep_subnormals():
            yield
        else:
            _ext.warn_once("ep_comm.formats: torch's intra-op threads flush subnormals (torch.set_flush_denormal(True) "
                           "was on when they started); the CPU format computations run on one thread to keep them "
                           "(docs/NUMERICS.md)")
            with _on_one_intra_op_thread():
                yield
    finally:
        if thread_flushes:
            torch.set_flush_denormal(True)


def _keeps_subnormals(function):
    """Decorator of every public function of this module that computes format bits: `function` runs inside
    ieee_subnormals(), and eagerly under torch.compile (_compile.eager_only)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        # The common case, checked inline without a context manager (CUDA paths call this too): this thread keeps
        # subnormals, and so do the intra-op threads at this count (None: not checked yet; ieee_subnormals checks).
        if _SUBNORMAL * _ONE != 0.0 and _intra_op_threads_checked.get(torch.get_num_threads()):
            return function(*args, **kwargs)
        with ieee_subnormals():
            return function(*args, **kwargs)
    return eager_only(wrapper)


def _no_grad(function):
    """torch.no_grad() as a decorator, entered only where grad mode is on: under torch.inference_mode() or no_grad, as
    serving code calls the formats, the context's enter and exit are skipped (with _cuda_formats() below, 1.5-2.8 µs
    of host time per eager quantize call on an H100 machine: bench/RESULTS.md, eightieth session). The format
    functions are not differentiable on either path (the kernels' outputs have no grad_fn), and the reference path
    keeps no graph behind its results."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        with torch.no_grad():
            return function(*args, **kwargs)
    return wrapper


def _check_float_input(x, name: str, block: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    _check_dense(name, x)
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension")
    if x.shape[-1] % block != 0 or x.shape[-1] == 0:
        raise ValueError(f"the last dimension of {name} ({x.shape[-1]}) must be a positive multiple of {block}")


def _check_dense(name: str, tensor: torch.Tensor) -> None:
    """A sparse (or other non-strided) tensor: a TypeError naming the argument, instead of torch's error from deep
    inside (and, in Buffer's checks that every rank runs together, instead of failing on one rank alone)."""
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")


def _check_out_dtype(dtype, name: str = "dtype") -> None:
    """A dequantizer's output dtype: float32, bfloat16, float16 or float64 (the values are computed in fp32, then
    rounded to it). float8 dtypes are refused: that would be a second, lossy quantization, silently saturating."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"{name} must be a floating-point torch.dtype of 16 bits or more, got {dtype!r}")


IMPLS = ("auto", "reference", "cuda")  # the quantization paths a caller may ask for (`impl=` / `format_impl=`)


def _check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be 'auto', 'reference' or 'cuda', got {impl!r}")


def _use_cuda(impl: str, *tensors: torch.Tensor) -> bool:
    _check_impl(impl)
    if impl == "reference":
        return False
    on_cuda = True
    for t in tensors:  # (a loop, not all() over a generator: this runs on every format call)
        on_cuda = on_cuda and t.is_cuda
    if impl == "cuda":
        if not on_cuda:
            raise ValueError("impl='cuda' needs CUDA tensors")
        _ext.require_cuda_extension("impl='cuda'")
        problem = _kernel_image_problem(tensors[0].device)
        if problem:
            raise RuntimeError(f"impl='cuda': {problem}; or use impl='reference'")
        return True
    if not on_cuda:
        return False
    problem = _cuda_kernels_problem(tensors[0].device)
    if not problem:
        return True
    return _reference_fallback("ep_comm.formats", "CUDA tensors go to the torch reference", problem)


def _reference_fallback(what: str, fallback: str, problem: str) -> bool:
    """impl="auto" where the kernels cannot run (`problem`): a warning, once, and False (use the torch reference) --
    except inside a CUDA-graph capture, where the reference cannot run (it copies constants to the device with a
    sync, and the GEMM's reads counts on the host): a clear error instead of a broken capture."""
    if _is_capturing():
        raise RuntimeError(f"{what}: the CUDA kernels cannot run here ({problem}) and the torch reference cannot run "
                           f"inside a CUDA graph capture")
    _ext.warn_once(f"{what}: {fallback}: {problem}")
    return False


def _cuda_kernels_problem(device: torch.device) -> str:
    """Why ep_comm._C's kernels cannot run on the CUDA device: no extension, or _kernel_image_problem; "" if they can."""
    if not _ext.cuda_extension_available():
        return f"ep_comm._C is unavailable: {_ext.cuda_extension_error()}"
    return _kernel_image_problem(device)


_problem_on_device = {}  # device index -> why the format kernels cannot run there ("" when they can; asked once)


def _kernel_image_problem(device: torch.device) -> str:
    """Why ep_comm._C's kernels cannot run on the CUDA device (its format kernels stand for all: one build, one arch
    list), or "": no kernel image for its architecture, or a driver older than the CUDA runtime _C links statically
    (the same CUDA call fails either way; the error says which)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    problem = _problem_on_device.get(index)
    if problem is None:
        image_error = getattr(_ext._C, "formats_kernel_image_error", None)
        runnable = getattr(_ext._C, "formats_kernels_runnable", None)
        with _ext.cuda_device(index):
            if image_error is not None:
                error = str(image_error())
            elif runnable is not None:  # an older build: a bool only
                error = "" if runnable() else "cudaErrorNoKernelImageForDevice"
            else:  # older still: assume runnable, as before
                error = ""
        name = _device_name(torch.device("cuda", index))
        if not error:
            problem = ""
        elif "NoKernelImage" in error:
            problem = (f"ep_comm._C's kernels were not built for this GPU ({name}); rebuild with its architecture in "
                       f"EP_COMM_CUDA_ARCHS")
        elif "InsufficientDriver" in error:
            problem = (f"ep_comm._C's kernels cannot run on this GPU ({name}): {error} -- the driver is older than the "
                       f"CUDA runtime ep_comm._C was built with; update the driver or build with an older toolkit")
        else:
            problem = f"ep_comm._C's kernels cannot run on this GPU ({name}): {error}"
        _problem_on_device[index] = problem
    return problem


def _kernels_runnable(device: torch.device) -> bool:
    return not _kernel_image_problem(device)


def _device_name(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"


def _check_amax_values(amax: torch.Tensor) -> None:
    """Refuses a given outer amax that is negative, -0.0 or NaN, outside a CUDA-graph capture (a device->host read).
    +Inf stays allowed: it is what the computed amax of a row holding an Inf is. -0.0 is refused because the decode
    multiplies by the stored amax: it would turn every decoded zero of the row into -0.0."""
    if not _is_capturing() and amax.numel() and bool((torch.signbit(amax) | torch.isnan(amax)).any()):
        raise ValueError("amax must be non-negative and not NaN (+0.0 or more, -0.0 refused: it is an absolute "
                         "maximum, and a computed amax ignores NaN elements)")


def _is_capturing() -> bool:
    """Value checks need a device->host copy, which CUDA graph capture forbids: they are skipped there.

    torch.cuda.is_initialized(), not is_available(): no capture can run before torch initialised CUDA, and
    is_available() reads the environment and asks the driver on every call (~8 us of host time per call on the H200
    machine, four calls per dispatch + combine pair: bench/profile_host.py, twenty-seventh session)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_cuda_formats_module = None  # ep_comm._cuda_formats, imported on first use (it imports this module)


def _cuda_formats():
    """ep_comm._cuda_formats, kept after the first call: a `from . import` statement goes through the import
    machinery on every call, even for a loaded module (its share of the public call's host time in cProfile:
    bench/profile_quantize_host.py)."""
    global _cuda_formats_module
    if _cuda_formats_module is None:
        from . import _cuda_formats
        _cuda_formats_module = _cuda_formats
    return _cuda_formats_module


# ----------------------------------------------------------------------------------------------------------
# Bit helpers (int64 tensors holding unsigned 32-bit values)
# ----------------------------------------------------------------------------------------------------------
def _f32(value: float, device) -> torch.Tensor:
    """A 0-dim fp32 constant: value rounded once to fp32 (RNE), used so no op runs in float64."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^exponent for integer exponents in [-127, 127] (2^-127 is a subnormal)."""
    exponent = exponent.to(torch.int64)
    bits = torch.where(exponent == -127, torch.full_like(exponent, 0x400000), (exponent + 127) << 23)
    return _from_bits(bits)


def _num_rows(x: torch.Tensor) -> int:
    """Rows of x viewed as [rows, last dim] (explicit, so empty tensors reshape too)."""
    return math.prod(x.shape[:-1])


def _nan_to_zero_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def _tree_sum_last(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two) pairing i with i + n/2, halving n (docs/NUMERICS.md)."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


# ----------------------------------------------------------------------------------------------------------
# Element encoders / decoders (public so tests and kernels can be checked against them)
# ----------------------------------------------------------------------------------------------------------
_ENCODER_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widen to fp32 exactly (float64 would round)


def _check_encoder_input(v, name: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dtype not in _ENCODER_INPUT_DTYPES:
        raise TypeError(f"{name} takes a float32, bfloat16 or float16 tensor (its values rounded as fp32 values), got "
                        f"{getattr(v, 'dtype', type(v).__name__)}")


@_keeps_subnormals
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code (uint8 0..15), round-to-nearest-even with saturation; NaN -> 0x7; -0.0 -> 0x8. v: float32,
    bfloat16 or float16 (float64 is refused: rounding it to fp32 first would round twice)."""
    _check_encoder_input(v, "e2m1_encode")
    v = v.float()
    a = v.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    nan = torch.isnan(v)
    code = torch.where(torch.signbit(v) & ~nan, code | 8, code)
    return torch.where(nan, torch.full_like(code, 7), code)


def _pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes int [..., K] -> uint8 [..., K/2], element 2j in the low nibble (the NVFP4Tensor.data layout)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack_e2m1_codes(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int64 codes [..., K] (element 2j from the low nibble): the inverse of _pack_e2m1_codes."""
    d = data.to(torch.int64)
    return torch.stack((d & 0xF, d >> 4), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


@_keeps_subnormals
def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer tensor; the low 4 bits of each element: sign bit 3, magnitude code bits 0-2) -> their
    values as float32, same shape: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0.0)."""
    if not isinstance(code, torch.Tensor) or code.is_floating_point() or code.is_complex() or code.dtype == torch.bool:
        got = getattr(code, "dtype", type(code).__name__)
        raise TypeError(f"e2m1_decode takes an integer tensor of codes, got {got}")
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=code.device)
    return table[code.to(torch.int64) & 0xF]


@_keeps_subnormals
def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 byte (uint8), RNE with satfinite (|v| > 448 -> 448); NaN -> 0x7F. v: float32, bfloat16 or float16
    (float64 is refused: rounding it to fp32 first would round twice)."""
    _check_encoder_input(v, "e4m3_encode")
    v = v.float()
    code = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(code, 0x7F), code)


def _check_bytes(t, name: str, dtypes) -> None:
    """The byte decoders reinterpret bytes: an integer tensor of another width would be read as its bytes."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise TypeError(f"{name} must be a tensor of bytes ({', '.join(str(d) for d in dtypes)}), got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")


@_keeps_subnormals
def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> fp32."""
    _check_bytes(code, "code", (torch.uint8, torch.float8_e4m3fn))
    return code.view(torch.uint8).view(torch.float8_e4m3fn).float()


@_keeps_subnormals
def ue8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 2^(b - 127); 0xFF -> NaN."""
    _check_bytes(scale, "scale", (torch.uint8, torch.float8_e8m0fnu))
    b = scale.view(torch.uint8).to(torch.int64)
    value = _pow2(torch.clamp(b, max=254) - 127)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


@_keeps_subnormals
def ue8m0_mxfp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVIDIA MXFP8 scale byte: round-up power of two of fp32(amax * fp32(1/448)); never clips elements.

    amax: float32 / bfloat16 / float16 [...], the blocks' maxima of |x| (the sign bit is not read: a negative value
    counts as its magnitude); NaN -> 0xFF (the quantizer itself takes NaN-ignoring maxima). Returns uint8 [...]."""
    _check_encoder_input(amax, "ue8m0_mxfp8_scale")
    t = amax.float() * _f32(1.0 / 448.0, amax.device)
    bits = _bits(t)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    b = torch.where(exponent >= 1, exponent + (mantissa != 0).to(torch.int64), (mantissa > 0x400000).to(torch.int64))
    b = torch.clamp(b, max=254)
    b = torch.where(torch.isnan(t), torch.full_like(b, 255), b)
    return b.to(torch.uint8)


@_keeps_subnormals
def ue8m0_s2f6_scale(amax: torch.Tensor) -> torch.Tensor:
    """S2F6 block scale byte: smallest e with amax / 2^e <= 127/64 (blocks never saturate, except those with amax
    above 127/64 * 2^127, where the byte clamps at 0xFE: docs/NUMERICS.md, known limits).

    amax: float32 / bfloat16 / float16 [...], the blocks' maxima of |x| (the sign bit is not read: a negative value
    counts as its magnitude). S2F6 has no NaN scale: the quantizer takes NaN-ignoring maxima, and a NaN amax given
    here reads as the largest exponent (0xFE), as Inf does. Returns uint8 [...]."""
    _check_encoder_input(amax, "ue8m0_s2f6_scale")
    bits = _bits(amax.float())
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    b = torch.clamp(exponent + (mantissa > 0x7E0000).to(torch.int64), max=254)
    return b.to(torch.uint8)


def _mul_u32(h: torch.Tensor, constant: int) -> torch.Tensor:
    """(h * constant) mod 2^32 for h in [0, 2^32) without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (h * low + (((h * high) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul_u32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul_u32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@eager_only
def sr_key(seed: int) -> int:
    """32-bit key of a stochastic-rounding seed, an int in [0, 2^64) as `rbits` takes it (docs/NUMERICS.md)."""
    seed = _check_seed(seed)
    return _fmix32_int((seed & 0xFFFFFFFF) ^ 0x9E3779B9) ^ _fmix32_int((seed >> 32) ^ 0x7F4A7C15)


@eager_only
def rbits(seed: SeedArg, index: torch.Tensor) -> torch.Tensor:
    """16 counter-based random bits (int64 tensor in [0, 2^16)) for each element index (docs/NUMERICS.md).

    One fmix32 word per pair of elements: pair p = index >> 1, word = fmix32((p mod 2^32) ^ fmix32((p >> 32) ^ key));
    the even element takes the word's low 16 bits, the odd one its high 16 bits. The index is taken as an unsigned
    64-bit value (a negative one as itself mod 2^64), as the CUDA kernels and the host emulation do.
    seed: as mxfp8_quantize takes it, so that the same seed object gives the same bits: an int in [0, 2^64) or a
    one-element integer tensor (int64: the seed's 64 bits in two's complement; a CUDA one is read here, a sync);
    index: an integer tensor of any shape (the result's shape).
    """
    if not isinstance(index, torch.Tensor) or index.is_floating_point() or index.is_complex() or \
            index.dtype == torch.bool:
        raise TypeError("index must be an integer tensor, got " +
                        (str(index.dtype) if isinstance(index, torch.Tensor) else type(index).__name__))
    seed = _seed_value(_check_seed_arg(seed, index.device))
    index = index.to(torch.int64)
    key = sr_key(seed)
    pair = (index >> 1) & 0x7FFFFFFFFFFFFFFF  # the unsigned shift: int64's >> copies the sign bit
    pair_key = _fmix32(((pair >> 32) & 0xFFFFFFFF) ^ key)
    word = _fmix32((pair & 0xFFFFFFFF) ^ pair_key)
    return (word >> (16 * (index & 1))) & 0xFFFF


def _e4m3_stochastic(v: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32 values to E4M3 with 16 random bits each (the low 16 of random_bits; rbits gives
    exactly 16), clamped to +-448 before rounding."""
    a = torch.minimum(v.abs(), _f32(E4M3_MAX, v.device))
    _, exponent = torch.frexp(a)
    floor_log2 = torch.where(a > 0, exponent.to(torch.int64) - 1, torch.full_like(exponent, -6, dtype=torch.int64))
    unit_exponent = torch.clamp(floor_log2, min=-6) - 3
    ulp = _pow2(unit_exponent)
    inv_ulp = _pow2(-unit_exponent)
    t = a * inv_ulp
    lo = torch.floor(t)
    fraction = torch.floor((t - lo) * 65536.0).to(torch.int64)
    up = (fraction + (random_bits & 0xFFFF)) >= 65536
    magnitude = (lo + up.to(torch.float32)) * ulp
    rounded = torch.where(torch.signbit(v), -magnitude, magnitude)
    rounded = torch.where(torch.isnan(v), v, rounded)
    return e4m3_encode(rounded)


# ----------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------
def _nvfp4_outer_scales(amax: torch.Tensor, e4m3_max: float):
    device = amax.device
    s_enc = _f32(6.0 * e4m3_max, device) / amax
    s_enc = torch.minimum(s_enc, _f32(FLT_MAX, device))
    bad = (amax == 0) | (s_enc == 0) | torch.isnan(amax)
    s_enc = torch.where(bad, torch.ones_like(s_enc), s_enc)
    s_dec = _f32(1.0, device) / s_enc
    return s_enc, s_dec


def _nvfp4_encode_with_scale(xb: torch.Tensor, scale_code: torch.Tensor, s_dec: torch.Tensor):
    """Codes of blocks xb [..., n, 16] for E4M3 scale bytes [..., n] (inv = min(1/(s * S_dec), FLT_MAX))."""
    inv = _f32(1.0, xb.device) / (e4m3_decode(scale_code) * s_dec[..., None])
    inv = torch.minimum(inv, _f32(FLT_MAX, xb.device))
    return e2m1_encode(xb * inv[..., None])


@_no_grad
@_keeps_subnormals
def nvfp4_quantize(x: torch.Tensor, four_over_six: bool = True, amax: Optional[torch.Tensor] = None,
                   scale_granularity: str = "row", impl: str = "auto", check_amax: bool = True) -> NVFP4Tensor:
    """Quantize x [..., K] (bf16/fp16/fp32, K % 16 == 0) to NVFP4 along the last axis.

    four_over_six: 4/6 adaptive block scaling with MSE selection and M = 256 (activations, the dispatch
        payload); False: plain NVFP4 with M = 448 (weights).
    amax: optional outer amax: a scalar (one value for the tensor), or a tensor with exactly x.dim() - 1
        dimensions broadcastable to the rows x.shape[:-1]: per row [...], or per expert [E, 1] for x [E, N, K]
        (keepdim form). A 1-D [E] amax for a 3-D x is refused: right-aligned broadcasting would apply it per
        row position, not per expert. By default the amax is computed per row (scale_granularity="row") or
        once for the tensor ("tensor"); a given amax is used as given, whatever scale_granularity says. A given
        amax below a row's true max |x| saturates that row's largest values, and amax 0 decodes the whole row to 0
        (nothing checks it: it is the caller's scale). A Python number is rounded to fp32 through a Python float, i.e.
        twice for an int above 2^53, which can land one fp32 step from a single rounding (above FLT_MAX: Inf). +Inf
        is allowed, as the computed amax of a row holding an Inf, and decodes its whole row to +-Inf or NaN. The
        result holds a copy of it.
    check_amax: refuse a given amax that is NaN, negative or -0.0 (outside a CUDA-graph capture: a device->host
        read).
        False skips that read, so the call never syncs (the trainable experts' per-step weight quantization; as
        grouped_gemm.quantize_expanded_rows's check_amax): such an amax is then taken as given, and what it decodes
        to is not specified.
    Returns an NVFP4Tensor with data [..., K/2], scales [..., K/16], amax [...] float32.
    """
    _check_float_input(x, "x", NVFP4_BLOCK)
    if not isinstance(four_over_six, bool):  # None or "False" would pick a format silently
        raise TypeError(f"four_over_six must be a bool, got {four_over_six!r}")
    if scale_granularity not in ("row", "tensor"):
        raise ValueError(f"scale_granularity must be 'row' or 'tensor', got {scale_granularity!r}")
    if not isinstance(check_amax, bool):  # (None or 0 would skip the check silently)
        raise TypeError(f"check_amax must be a bool, got {check_amax!r}")
    if amax is not None:
        if not isinstance(amax, torch.Tensor):
            if isinstance(amax, bool) or not isinstance(amax, numbers.Real):
                raise TypeError(f"amax must be a tensor or a real number, got {type(amax).__name__}")
            # Rounded to fp32 as a float64 tensor amax is (above FLT_MAX: Inf, which the outer-scale rule takes);
            # torch.full, not torch.tensor: no host->device copy (a sync, and refused inside a CUDA-graph capture).
            try:
                as_double = float(amax)
            except OverflowError:  # an int beyond the float range: positive ones are +Inf, as documented
                as_double = math.inf if amax > 0 else -math.inf
            value = float(torch.tensor(as_double, dtype=torch.float64).float())
            amax = torch.full((), value, dtype=torch.float32, device=x.device)
        if not amax.is_floating_point():
            raise TypeError(f"amax must be a floating-point tensor, got {amax.dtype}")
        if amax.device != x.device:
            raise ValueError(f"amax is on {amax.device} but x is on {x.device}")
        if amax.numel() != 1 and amax.dim() != x.dim() - 1:
            raise ValueError(f"amax of shape {tuple(amax.shape)} is ambiguous for x of shape {tuple(x.shape)}: give "
                             f"a scalar or {x.dim() - 1} dimensions broadcastable to the rows {tuple(x.shape[:-1])} "
                             f"(per expert: [E, 1])")
        if amax.numel() == 1:
            amax = amax.reshape(())
        try:
            # A copy, always: the result must not share the caller's tensor (an amax history updated in place
            # would change what this NVFP4Tensor decodes to).
            amax = torch.broadcast_to(amax.detach().float(), x.shape[:-1]).clone(memory_format=torch.contiguous_format)
        except RuntimeError as error:
            raise ValueError(f"amax of shape {tuple(amax.shape)} does not broadcast to the rows of x "
                             f"{tuple(x.shape[:-1])}") from error
        if check_amax:
            _check_amax_values(amax)
    elif scale_granularity == "tensor":
        # An empty tensor has amax 0 (torch's amax() refuses an empty input).
        whole = (_nan_to_zero_abs(x.float()).amax() if x.numel()
                 else torch.zeros((), dtype=torch.float32, device=x.device))
        amax = torch.broadcast_to(whole, x.shape[:-1]).contiguous()
    if _use_cuda(impl, x):
        return _cuda_formats().nvfp4_quantize(x, four_over_six, amax)
    return _nvfp4_quantize_reference(x, four_over_six, amax)


def _nvfp4_quantize_reference(x: torch.Tensor, four_over_six: bool, amax: Optional[torch.Tensor]) -> NVFP4Tensor:
    xf = x.float()
    lead_shape = xf.shape[:-1]
    k = xf.shape[-1]
    xb = xf.reshape(_num_rows(xf), k // NVFP4_BLOCK, NVFP4_BLOCK)
    if amax is None:
        row_amax = _nan_to_zero_abs(xf).amax(dim=-1).reshape(-1) if xf.numel() else xf.new_zeros(xb.shape[0])
    else:
        row_amax = amax.reshape(-1).float()
    e4m3_max = NVFP4_ACTIVATION_E4M3_MAX if four_over_six else NVFP4_WEIGHT_E4M3_MAX
    device = x.device
    s_enc, s_dec = _nvfp4_outer_scales(row_amax, e4m3_max)
    block_amax = _nan_to_zero_abs(xb).amax(dim=-1) if xb.numel() else xb.new_zeros(xb.shape[:-1])
    if not four_over_six:
        scale_code = e4m3_encode(block_amax * (s_enc * _f32(1.0 / 6.0, device))[:, None])
        codes = _nvfp4_encode_with_scale(xb, scale_code, s_dec)
    else:
        base = (block_amax / _f32(6.0, device)) * s_enc[:, None]
        cap = _f32(E4M3_MAX, device)
        scale6 = e4m3_encode(torch.minimum(base, cap))
        scale4 = e4m3_encode(torch.minimum(base * _f32(1.5, device), cap))
        codes6 = _nvfp4_encode_with_scale(xb, scale6, s_dec)
        codes4 = _nvfp4_encode_with_scale(xb, scale4, s_dec)
        six_m = _f32(6.0 * e4m3_max, device)

        def block_error(codes, scale_code):
            decoded = ((e2m1_decode(codes) * e4m3_decode(scale_code)[..., None]) * row_amax[:, None, None]) / six_m
            diff = decoded - xb
            return _tree_sum_last(diff * diff)

        pick4 = block_error(codes4, scale4) < block_error(codes6, scale6)
        scale_code = torch.where(pick4, scale4, scale6)
        codes = torch.where(pick4[..., None], codes4, codes6)
    codes = codes.reshape(xb.shape[0], k)
    data = _pack_e2m1_codes(codes)
    return NVFP4Tensor(
        data=data.reshape(*lead_shape, k // 2),
        scales=scale_code.reshape(*lead_shape, k // NVFP4_BLOCK).view(torch.float8_e4m3fn),
        amax=row_amax.reshape(lead_shape).contiguous(),
        e4m3_max=e4m3_max,
    )


def _as_int(value, name: str) -> int:
    """An int from any integer type (numpy and torch integer scalars included); TypeError for anything else."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _check_rounding(rounding) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")


def _check_seed(seed) -> int:
    seed = _as_int(seed, "seed")
    if not 0 <= seed < 2**64:  # NUMERICS: the key uses the seed's two 32-bit halves; more bits would be dropped
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed


SeedArg = Union[int, torch.Tensor]


def _check_seed_arg(seed, device: torch.device) -> SeedArg:
    """A stochastic rounding's seed, as an int in [0, 2^64) or a CUDA seed tensor. A one-element int64 tensor holds the
    seed's 64 bits (two's complement: seed - 2^64 for seeds from 2^63). On a GPU it must be on `device`; the kernels
    read it when they run, so a CUDA graph replays with the value written there before the replay, not the
    capture's. On the CPU it is read now. Other integer scalars (ints, numpy's, other CPU tensors) are the seed."""
    if isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.numel() == 1:
        if not seed.is_cuda:
            return _seed_value(seed)
        if seed.device != device:
            raise ValueError(f"the seed tensor is on {seed.device} but the tensor it rounds is on {device} (the "
                             f"kernels read the seed where they run)")
        return seed
    if isinstance(seed, torch.Tensor) and seed.is_cuda:
        raise TypeError(f"a seed tensor on the GPU must hold one int64 element, got {seed.dtype} of shape "
                        f"{tuple(seed.shape)}")
    if isinstance(seed, torch.Tensor) and (seed.numel() != 1 or seed.dtype == torch.bool
                                           or seed.dtype.is_floating_point or seed.dtype.is_complex):
        raise TypeError(f"a seed tensor must hold one integer element (int64 for all 64 bits), got {seed.dtype} of "
                        f"shape {tuple(seed.shape)}")
    if isinstance(seed, torch.Tensor):
        # .item(), not operator.index: the latter goes through int64 and fails for uint64 seeds from 2^63.
        return _check_seed(int(seed.reshape(()).item()))
    return _check_seed(seed)


def _seed_value(seed: SeedArg) -> int:
    """The seed as an int in [0, 2^64) (the torch reference's form; reading a CUDA seed tensor syncs)."""
    if isinstance(seed, torch.Tensor):
        return int(seed.reshape(()).item()) & 0xFFFFFFFFFFFFFFFF
    return seed


def _check_same_device(container, *names: str) -> None:
    """data and the fields `names` of a format container are tensors (a scalar or numpy field of a hand-built container
    would fail obscurely later), the latter on data's device (a kernel given a CUDA data pointer would read a CPU
    scales or amax pointer as a device address). Named, not found through dataclasses.fields: this runs on every
    container check, MoELayer's forward included."""
    data = container.data
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{type(container).__name__}.data must be a torch.Tensor, got {type(data).__name__}")
    for name in names:
        value = getattr(container, name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(container).__name__}.{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.device != data.device:
            raise ValueError(f"{type(container).__name__}.{name} is on {value.device} but data is on {data.device}: "
                             f"move every field together")


def _check_container_dims(kind: str, data: torch.Tensor, scales: torch.Tensor, allow_empty_k: bool = False) -> None:
    """data and scales with at least one dimension and a non-empty last one: what the quantizers make (they refuse
    K = 0), so the reference and the CUDA path (which cannot reshape [N, 0] rows) take the same containers.
    allow_empty_k: K = 0 is allowed too (MXFP8: nvfp4_to_mxfp8_transposed of 0 rows gives [K, 0]; its consumers
    return an empty result without reaching a kernel)."""
    if data.dim() == 0 or scales.dim() == 0 or (data.shape[-1] == 0 and not allow_empty_k):
        raise ValueError(f"{kind} needs data and scales with a non-empty last dimension, got data "
                         f"{tuple(data.shape)} and scales {tuple(scales.shape)}")


def _check_nvfp4(q) -> None:
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"expected an NVFP4Tensor, got {type(q).__name__}")
    _check_same_device(q, "scales", "amax")
    _check_container_dims("NVFP4Tensor", q.data, q.scales)
    k = q.data.shape[-1] * 2
    if (q.data.dtype != torch.uint8 or q.scales.dtype not in (torch.float8_e4m3fn, torch.uint8)
            or q.amax.dtype != torch.float32 or q.scales.shape[-1] * NVFP4_BLOCK != k
            or q.scales.shape[:-1] != q.data.shape[:-1] or q.amax.shape != q.data.shape[:-1]):
        raise ValueError("inconsistent NVFP4Tensor: data uint8 [..., K/2], scales float8_e4m3fn [..., K/16], amax "
                         f"float32 [...] expected; got data {tuple(q.data.shape)} {q.data.dtype}, scales "
                         f"{tuple(q.scales.shape)} {q.scales.dtype}, amax {tuple(q.amax.shape)} {q.amax.dtype}")
    # The two bounds nvfp4_quantize writes; the kernels and the reference derive 1 / (6M) differently for other values.
    if isinstance(q.e4m3_max, bool) or not isinstance(q.e4m3_max, numbers.Real) \
            or q.e4m3_max not in (NVFP4_ACTIVATION_E4M3_MAX, NVFP4_WEIGHT_E4M3_MAX):
        raise ValueError(f"NVFP4Tensor.e4m3_max must be {NVFP4_ACTIVATION_E4M3_MAX} (4/6 activations) or "
                         f"{NVFP4_WEIGHT_E4M3_MAX} (plain), got {q.e4m3_max!r}")


@_no_grad
@_keeps_subnormals
def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """NVFP4Tensor -> dense [..., K] in `dtype` (values computed in fp32, then rounded)."""
    _check_nvfp4(q)
    _check_out_dtype(dtype)
    if _use_cuda(impl, q.data):
        return _cuda_formats().nvfp4_dequantize(q, dtype)
    return _nvfp4_dequantize_reference(q).to(dtype)


def _nvfp4_dequantize_reference(q: NVFP4Tensor) -> torch.Tensor:
    device = q.data.device
    codes = _unpack_e2m1_codes(q.data).reshape(*q.data.shape[:-1], q.scales.shape[-1], NVFP4_BLOCK)
    scale = e4m3_decode(q.scales.view(torch.uint8))
    final = (scale * q.amax.float()[..., None]) * _f32(1.0 / (6.0 * q.e4m3_max), device)
    values = e2m1_decode(codes) * final[..., None]
    return values.reshape(*q.data.shape[:-1], q.data.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------------------
@_no_grad
@_keeps_subnormals
def mxfp8_quantize(x: torch.Tensor, rounding: str = "nearest", seed: SeedArg = 0,
                   impl: str = "auto") -> MXFP8Tensor:
    """Quantize x [..., K] (K % 32 == 0; bfloat16, float16 or float32) to MXFP8: E4M3 elements, UE8M0 scale per 32
    (NVIDIA rule). Returns MXFP8Tensor(data float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K / 32]).

    rounding: "nearest" (RNE) or "stochastic" (counter-based random bits from (seed, flat element index);
        the same seed gives the same bits on CPU and GPU; clamped to +-448 before rounding, unbiased to
        within 2^-16 ulp: the fraction is truncated to 16 bits).
    seed: an int in [0, 2^64), or a one-element int64 tensor holding its bits (two's complement). On the GPU (x's
        device) the kernel reads it when it runs: a CUDA graph that captured this call rounds with the value the
        tensor holds at each replay. (The torch reference reads it on the host.)
    """
    _check_float_input(x, "x", MX_BLOCK)
    _check_rounding(rounding)
    seed = _check_seed_arg(seed, x.device)
    if _use_cuda(impl, x):
        return _cuda_formats().mxfp8_quantize(x, rounding, seed)
    return _mxfp8_quantize_reference(x.float(), rounding, seed)


def _mxfp8_quantize_reference(xf: torch.Tensor, rounding: str, seed: SeedArg,
                              index: Optional[torch.Tensor] = None) -> MXFP8Tensor:
    """index: the stochastic rounding's counter of each element (int64, xf's shape); default its flat place in xf.
    (A given index serves a slice of a larger tensor, whose counters start elsewhere: tests at sizes past 2^32.) seed:
    read only for stochastic rounding (a CUDA seed tensor on the host, here)."""
    k = xf.shape[-1]
    xb = xf.reshape(_num_rows(xf), k // MX_BLOCK, MX_BLOCK)
    block_amax = _nan_to_zero_abs(xb).amax(dim=-1) if xb.numel() else xb.new_zeros(xb.shape[:-1])
    scale = ue8m0_mxfp8_scale(block_amax)
    b = scale.to(torch.int64)
    p = _pow2(127 - torch.clamp(b, max=254))
    p = torch.where(b == 255, torch.full_like(p, float("nan")), p)
    v = xb * p[..., None]
    if rounding == "nearest":
        codes = e4m3_encode(v)
    else:
        if index is None:
            index = torch.arange(v.numel(), device=v.device, dtype=torch.int64)
        codes = _e4m3_stochastic(v, rbits(_seed_value(seed), index.reshape(v.shape)))
    return MXFP8Tensor(data=codes.reshape(xf.shape).view(torch.float8_e4m3fn),
                       scales=scale.reshape(*xf.shape[:-1], k // MX_BLOCK).view(torch.float8_e8m0fnu))


@_no_grad
@_keeps_subnormals
def mxfp8_dequantize(m: MXFP8Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """MXFP8Tensor (data float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K / 32]) -> dense [..., K] in `dtype`
    (float32, bfloat16, float16 or float64): element * 2^(scale - 127), computed in fp32, then rounded. K = 0 (what
    nvfp4_to_mxfp8_transposed gives for 0 rows) gives an empty [..., 0]."""
    _check_mxfp8(m)
    _check_out_dtype(dtype)
    use_cuda = _use_cuda(impl, m.data)  # (its checks of impl apply to K = 0 too)
    if m.data.shape[-1] == 0:  # nothing to decode; the CUDA glue cannot reshape [N, 0] rows
        return torch.empty(m.data.shape, dtype=dtype, device=m.data.device)
    if use_cuda:
        return _cuda_formats().mxfp8_dequantize(m, dtype)
    k = m.data.shape[-1]
    values = e4m3_decode(m.data.view(torch.uint8)).reshape(*m.data.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    values = values * ue8m0_decode(m.scales)[..., None]
    return values.reshape(m.data.shape).to(dtype)


def _check_mxfp8(m) -> None:
    if not isinstance(m, MXFP8Tensor):
        raise TypeError(f"expected an MXFP8Tensor, got {type(m).__name__}")
    _check_same_device(m, "scales")
    _check_container_dims("MXFP8Tensor", m.data, m.scales, allow_empty_k=True)
    if (m.data.dtype not in (torch.float8_e4m3fn, torch.uint8) or m.scales.dtype not in (torch.float8_e8m0fnu,
                                                                                            torch.uint8)
            or m.scales.shape[:-1] != m.data.shape[:-1]
            or m.scales.shape[-1] * MX_BLOCK != m.data.shape[-1]):
        raise ValueError(f"inconsistent MXFP8Tensor: data float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K/32] "
                         f"expected; got data {tuple(m.data.shape)} {m.data.dtype}, scales {tuple(m.scales.shape)} "
                         f"{m.scales.dtype}")


@_keeps_subnormals
def nvfp4_to_mxfp8_transposed(q: NVFP4Tensor, rounding: str = "stochastic", seed: SeedArg = 0,
                              impl: str = "auto") -> MXFP8Tensor:
    """Requantize a saved NVFP4 activation [R, K] to MXFP8 along the other axis: returns [K, R] MXFP8.

    Dequantize (fp32), transpose, quantize blocks of 32 along R (R % 32 == 0; R = 0 gives [K, 0]) — what the
    weight-gradient GEMM of backward needs. Stochastic rounding uses the flat index of the [K, R] output and
    `seed`: the random bits depend on (seed, index) only, so vary the seed per call (e.g. step and layer), or the
    rounding noise repeats at every position from call to call. seed: an int, or a one-element int64 tensor on q's
    device read when the kernel runs (as for mxfp8_quantize: CUDA-graph replays see its new values).
    """
    _check_nvfp4(q)
    if q.data.dim() != 2:
        raise ValueError(f"nvfp4_to_mxfp8_transposed expects a 2-D NVFP4Tensor, got {q.data.dim()}-D")
    rows = q.data.shape[0]
    if rows % MX_BLOCK != 0:  # 0 rows (an expert without tokens) give [K, 0]
        raise ValueError(f"the row count ({rows}) must be a multiple of {MX_BLOCK}")
    _check_rounding(rounding)
    seed = _check_seed_arg(seed, q.data.device)
    if _use_cuda(impl, q.data):
        return _cuda_formats().nvfp4_to_mxfp8_transposed(q, rounding, seed)
    dense = _nvfp4_dequantize_reference(q)
    return _mxfp8_quantize_reference(dense.t().contiguous(), rounding, seed)


# ----------------------------------------------------------------------------------------------------------
# RHT-32 and S2F6
# ----------------------------------------------------------------------------------------------------------
def _check_sign_mask(sign_mask) -> int:
    sign_mask = _as_int(sign_mask, "sign_mask")
    if not 0 <= sign_mask < 2**32:
        raise ValueError(f"sign_mask must be a 32-bit unsigned int, got {sign_mask!r}")
    return sign_mask


def _signs(sign_mask: int, device) -> torch.Tensor:
    sign_mask = _check_sign_mask(sign_mask)
    bits = [(sign_mask >> i) & 1 for i in range(32)]
    return torch.tensor([-1.0 if bit else 1.0 for bit in bits], dtype=torch.float32, device=device)


def _fwht32_scaled(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized FWHT over the last axis (32) in NUMERICS order, then times fp32(1/sqrt(32))."""
    lead = v.shape[:-1]
    for h in (1, 2, 4, 8, 16):
        pairs = v.reshape(*lead, 32 // (2 * h), 2, h)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((low + high, low - high), dim=-2).reshape(*lead, 32)
    return v * _f32(1.0 / math.sqrt(32.0), v.device)


@_keeps_subnormals
def rht(x: torch.Tensor, sign_mask: int = DEFAULT_SIGN_MASK) -> torch.Tensor:
    """Random Hadamard transform on each aligned 32-chunk of the last axis: y = H32 (s * x) / sqrt(32).
    x: bfloat16, float16 or float32 [..., K], K % 32 == 0; returns float32 [..., K]. s_j = -1 where bit j of
    sign_mask is set."""
    _check_float_input(x, "x", MX_BLOCK)
    xf = x.float()
    chunks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // 32, 32) * _signs(sign_mask, x.device)
    return _fwht32_scaled(chunks).reshape(xf.shape)


@_keeps_subnormals
def inverse_rht(y: torch.Tensor, sign_mask: int = DEFAULT_SIGN_MASK) -> torch.Tensor:
    """Inverse of `rht`: x = s * (H32 y) / sqrt(32). y: bfloat16, float16 or float32 [..., K], K % 32 == 0; returns
    float32 [..., K]."""
    _check_float_input(y, "y", MX_BLOCK)
    yf = y.float()
    chunks = _fwht32_scaled(yf.reshape(*yf.shape[:-1], yf.shape[-1] // 32, 32))
    return (chunks * _signs(sign_mask, y.device)).reshape(yf.shape)


@_no_grad
@_keeps_subnormals
def s2f6_quantize(x: torch.Tensor, hadamard: bool = True, sign_mask: int = DEFAULT_SIGN_MASK,
                  impl: str = "auto") -> S2F6Tensor:
    """Quantize x [..., K] (K % 32 == 0) to S2F6 with a UE8M0 scale per 32, after the RHT-32 if `hadamard`.

    8.25 bits per value. The scale is the smallest power of two for which the block does not saturate (blocks with
    amax above 127/64 * 2^127 do: the scale clamps at 0xFE; docs/NUMERICS.md, known limits).
    """
    _check_float_input(x, "x", MX_BLOCK)
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    sign_mask = _check_sign_mask(sign_mask)
    if _use_cuda(impl, x):
        return _cuda_formats().s2f6_quantize(x, hadamard, sign_mask)
    return _s2f6_quantize_reference(x, hadamard, sign_mask)


def _s2f6_quantize_reference(x: torch.Tensor, hadamard: bool, sign_mask: int) -> S2F6Tensor:
    v = rht(x, sign_mask) if hadamard else x.float()
    k = v.shape[-1]
    vb = v.reshape(_num_rows(v), k // MX_BLOCK, MX_BLOCK)
    block_amax = _nan_to_zero_abs(vb).amax(dim=-1) if vb.numel() else vb.new_zeros(vb.shape[:-1])
    scale = ue8m0_s2f6_scale(block_amax)
    p = _pow2(127 - scale.to(torch.int64))
    t = (vb * p[..., None]) * _f32(64.0, v.device)
    codes = torch.round(t).clamp(-128, 127)
    codes = torch.where(torch.isnan(t), torch.full_like(codes, 127), codes).to(torch.int8)
    return S2F6Tensor(data=codes.reshape(v.shape), scales=scale.reshape(*v.shape[:-1], k // MX_BLOCK).view(
        torch.float8_e8m0fnu), hadamard=hadamard, sign_mask=sign_mask)


def _check_s2f6(s) -> None:
    if not isinstance(s, S2F6Tensor):
        raise TypeError(f"expected an S2F6Tensor, got {type(s).__name__}")
    _check_same_device(s, "scales")
    _check_container_dims("S2F6Tensor", s.data, s.scales)
    if (s.data.dtype != torch.int8 or s.scales.dtype not in (torch.float8_e8m0fnu, torch.uint8)
            or s.scales.shape[:-1] != s.data.shape[:-1]
            or s.scales.shape[-1] * MX_BLOCK != s.data.shape[-1]):
        raise ValueError(f"inconsistent S2F6Tensor: int8 data [..., K] and float8_e8m0fnu (or uint8) scales "
                         f"[..., K / {MX_BLOCK}] expected; got data {tuple(s.data.shape)} {s.data.dtype}, "
                         f"scales {tuple(s.scales.shape)} {s.scales.dtype}")
    if not isinstance(s.hadamard, bool):
        raise TypeError(f"S2F6Tensor.hadamard must be a bool, got {s.hadamard!r}")
    _check_sign_mask(s.sign_mask)  # the kernels take it as a uint32


def _s2f6_decode_rotated(s: S2F6Tensor) -> torch.Tensor:
    """S2F6 -> fp32 values in the quantized (rotated) domain, no inverse RHT."""
    k = s.data.shape[-1]
    codes = s.data.float().reshape(*s.data.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    values = (codes * _f32(2.0 ** -6, s.data.device)) * ue8m0_decode(s.scales)[..., None]
    return values.reshape(s.data.shape)


@_no_grad
@_keeps_subnormals
def s2f6_dequantize(s: S2F6Tensor, hadamard: Optional[bool] = None, dtype: torch.dtype = torch.float32,
                    impl: str = "auto") -> torch.Tensor:
    """S2F6Tensor -> dense [..., K] in `dtype`.

    hadamard: None (default) follows s.hadamard (inverse RHT applied when the values were rotated);
        True asserts they were rotated (ValueError otherwise); False returns the rotated-domain values.
    """
    _check_s2f6(s)
    _check_out_dtype(dtype)
    if hadamard is not None and not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be None or a bool, got {hadamard!r}")
    if hadamard is not None:
        if hadamard and not s.hadamard:
            raise ValueError("hadamard=True but this S2F6Tensor was quantized without the RHT")
        s = dataclasses.replace(s, hadamard=bool(hadamard))
    if _use_cuda(impl, s.data):
        return _cuda_formats().s2f6_dequantize(s, dtype)
    values = _s2f6_decode_rotated(s)
    if s.hadamard:
        values = inverse_rht(values, s.sign_mask)
    return values.to(dtype)


@eager_only
def dequantize(x, dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """Any payload of this library as a dense tensor in `dtype` (float32, bfloat16, float16 or float64): an
    NVFP4Tensor, MXFP8Tensor or S2F6Tensor through its own dequantizer (S2F6: inverse RHT applied when it was rotated),
    a plain float32 / bfloat16 / float16 / float64 tensor (a BF16 dispatch payload) converted by x.to(dtype) (a
    float8 or float4 tensor, a container's field alone, is refused): x itself when it already has that dtype
    (no copy: the payload's storage, autograd kept, as for any .to), where the containers' dequantizers always return a
    new tensor without autograd. E.g. `dequantize(result.x)` for a DispatchResult of any dispatch format."""
    if isinstance(x, NVFP4Tensor):
        return nvfp4_dequantize(x, dtype=dtype, impl=impl)
    if isinstance(x, MXFP8Tensor):
        return mxfp8_dequantize(x, dtype=dtype, impl=impl)
    if isinstance(x, S2F6Tensor):
        return s2f6_dequantize(x, dtype=dtype, impl=impl)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        _check_impl(impl)  # (as the containers' dequantizers check it, though unused here)
        if x.element_size() < 2:  # a container's float8 / float4 field alone: no block scale to apply
            raise TypeError(f"dequantize takes a plain tensor only as a dense payload (float32, bfloat16, float16 or "
                            f"float64), got {x.dtype}: pass the whole NVFP4Tensor / MXFP8Tensor / S2F6Tensor, not "
                            f"one of its fields")
        _check_out_dtype(dtype)
        return x.to(dtype)
    raise TypeError(f"expected an NVFP4Tensor, MXFP8Tensor, S2F6Tensor or a floating-point tensor, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")


@_no_grad
@_keeps_subnormals
def s2f6_dequantize_accumulate(s: S2F6Tensor, row_index: torch.Tensor, weights: Optional[torch.Tensor] = None,
                               out_dtype: torch.dtype = torch.bfloat16, impl: str = "auto") -> torch.Tensor:
    """The receive side of combine: out[m] = invRHT(sum_j w[m, j] * deq(s[row_index[m, j]])) -> out_dtype.

    s: S2F6Tensor [N, K]; row_index: int [M, J] (row of s, or -1 to skip); weights: float32 [M, J] or None.
    The sum runs in fp32 in ascending j (acc = acc + w * v), in the rotated domain; the inverse RHT is
    applied once (when s.hadamard). Rows whose every index is -1 come out as zeros (some -0.0 after the inverse
    RHT).
    """
    _check_s2f6(s)
    if s.data.dim() != 2:
        raise ValueError(f"s must be 2-D [N, K], got {tuple(s.data.shape)}")
    if not isinstance(row_index, torch.Tensor) or row_index.dim() != 2 or row_index.dtype not in (
            torch.int32, torch.int64):
        raise TypeError("row_index must be an int32/int64 tensor [M, J]")
    if row_index.device != s.data.device:
        raise ValueError(f"row_index is on {row_index.device} but s is on {s.data.device}")
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"weights must be a float32 tensor or None, got {type(weights).__name__}")
        if weights.shape != row_index.shape or weights.dtype != torch.float32:
            raise ValueError(f"weights must be float32 of shape {tuple(row_index.shape)}, got "
                             f"{tuple(weights.shape)} {weights.dtype}")
        if weights.device != s.data.device:
            raise ValueError(f"weights are on {weights.device} but s is on {s.data.device}")
    _check_out_dtype(out_dtype, "out_dtype")
    if not _is_capturing() and row_index.numel():
        low, high = int(row_index.min()), int(row_index.max())
        if low < -1 or high >= s.data.shape[0]:
            raise ValueError(f"row_index values must be in [-1, {s.data.shape[0]}); got range [{low}, {high}]")
    if _use_cuda(impl, s.data, row_index):
        return _cuda_formats().s2f6_dequantize_accumulate(s, row_index, weights, out_dtype)
    values = _s2f6_decode_rotated(s)
    return _accumulate_rows(values, row_index, weights, s.sign_mask if s.hadamard else None).to(out_dtype)


@_keeps_subnormals
def _accumulate_rows(values: torch.Tensor, row_index: torch.Tensor, weights: Optional[torch.Tensor],
                     sign_mask: Optional[int]) -> torch.Tensor:
    """acc[m] = sum_j w[m, j] * values[row_index[m, j]] in ascending j (fp32); inverse RHT if sign_mask given."""
    num_out, num_terms = row_index.shape
    num_rows = values.shape[0]
    acc = torch.zeros(num_out, values.shape[-1], dtype=torch.float32, device=values.device)
    if num_rows == 0:
        values = values.new_zeros(1, values.shape[-1])
    for j in range(num_terms):
        index = row_index[:, j].to(torch.int64)
        # Indices outside [0, N) contribute nothing, as in the kernel (during a capture the caller's range check is
        # skipped: an index past N must not become an out-of-bounds gather here).
        valid = (index >= 0) & (index < num_rows)
        term = values[index.clamp(min=0, max=max(num_rows - 1, 0))]
        if weights is not None:
            term = term * weights[:, j:j + 1]
        acc = torch.where(valid[:, None], acc + term, acc)
    if sign_mask is not None:
        acc = inverse_rht(acc, sign_mask)
    return acc
