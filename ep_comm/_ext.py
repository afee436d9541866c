"""Loads the compiled core `ep_comm._C` and remembers why it is unavailable, so nothing falls back silently."""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import ContextManager, Optional, Union

import torch

_C = None
_IMPORT_ERROR: Optional[BaseException] = None

try:  # the extension is optional: the pure-Python package (reference backend, formats) works without it
    _C = importlib.import_module("ep_comm._C")
except ImportError as error:  # pragma: no cover - depends on the build
    _IMPORT_ERROR = error


def cuda_extension_available() -> bool:
    """Whether the C++/CUDA core `ep_comm._C` was built and imports (needed by the nvlink backend and the CUDA
    kernels; without it the reference backend and the torch formats still work). `cuda_extension_error()` says
    why not."""
    return _C is not None


def cuda_extension_error() -> Optional[str]:
    """The original import error of `ep_comm._C` (and the build failure setup.py recorded, if any), or None."""
    if _IMPORT_ERROR is None:
        return None
    message = f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"
    build_error = os.path.join(os.path.dirname(__file__), "_C_build_error.txt")
    if os.path.exists(build_error):
        with open(build_error) as handle:
            message += f" ({handle.read().strip()})"
    return message


def aligned_contiguous(t: torch.Tensor, alignment: int = 16) -> torch.Tensor:
    """t contiguous and starting `alignment`-byte aligned (a copy only when needed): what the kernels' 8- and 16-byte
    vector loads and stores need. contiguous() alone keeps a view's storage offset, which may be any element or byte
    (a flat buffer sliced at an odd offset), and the misaligned vector accesses would fault on the device."""
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


def require_cuda_extension(what: str):
    """Return the `_C` module or raise a RuntimeError that says what needed it and why it is missing."""
    if _C is None:
        raise RuntimeError(
            f"{what} needs the compiled core ep_comm._C, which is unavailable: {cuda_extension_error()}. "
            "Build it with nvcc present (`EP_COMM_BUILD_CUDA=1 pip install -e .`), or use backend='reference' / "
            "impl='reference'.")
    return _C


_warned = set()


def warn_once(message: str) -> None:
    """A RuntimeWarning shown once per process: fallbacks are announced, never silent, and never spam."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# torch's private accessor of the current stream as a raw cudaStream_t (what torch.compile's generated code calls),
# absent from CPU-only builds. torch.cuda.current_stream(device).cuda_stream goes through several Python layers: 7 µs
# per call on the H200 machine's CPU, a tenth of a small dispatch's host path (bench/profile_host.py).
_raw_stream_of_device = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(device: Union[torch.device, int]) -> int:
    """The current CUDA stream of `device` (a CUDA torch.device or a device index) as an integer cudaStream_t."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    if _raw_stream_of_device is not None:
        return _raw_stream_of_device(index)
    return torch.cuda.current_stream(index).cuda_stream


_SOME_CAPTURE = -2  # capture_id without the extension: every capture looks like this one


def capture_id(raw_stream: int) -> int:
    """The id of the CUDA-graph capture the raw stream `raw_stream` belongs to: 0 when it is not capturing, -1 when its
    capture was invalidated, else a positive id (cudaStreamGetCaptureInfo), so that Buffer orders a call after its
    previous one only inside the same capture. Without the compiled core, -2 for any capture of the current stream
    (captures cannot be told apart then)."""
    if raw_stream == 0:  # the legacy default stream never captures
        return 0
    if _C is not None:
        return _C.stream_capture_id(raw_stream)
    return _SOME_CAPTURE if torch.cuda.is_current_stream_capturing() else 0


_already_current = contextlib.nullcontext()  # no state: one instance serves every call


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device `index` as a string: the one spelling every rank's identity and the nvlink peer check
    compare (buffer._gpu_identity, backends.nvlink._peer_link_problem)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_device(device: Union[torch.device, int]) -> ContextManager:
    """`torch.cuda.device(device)`, or a no-op context when `device` (a CUDA torch.device or an index) is the current
    device already, as it is for almost every call: entering and leaving torch.cuda.device costs several µs of host
    time per kernel launch (bench/profile_host.py)."""
    index = device if isinstance(device, int) else device.index
    if index is None or index == torch.cuda.current_device():
        return _already_current
    return torch.cuda.device(index)
