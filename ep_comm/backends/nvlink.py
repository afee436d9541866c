"""The nvlink backend: fused quantize-and-send dispatch and RHT+S2F6 combine over NVLink peer pointers.

Every rank owns one symmetric region (NVSHMEM via nvshmem4py, or CUDA IPC as a fallback) whose layout is
fixed by the BufferConfig (`_RegionLayout`); the kernels (csrc/nvlink_*.cu) store straight into peers'
regions and signal with monotonically growing counters, so nothing is memset between calls and no host
synchronization happens: dispatch and combine can be captured in a CUDA graph and replayed with new data.
The results are bit-identical to the reference backend (same quantizers, same FP32 summation order).

Protocol and reuse safety are described in csrc/nvlink.h. In short: per call, dispatch runs three kernels
(layout: prefix sums over this rank's tokens; send: quantize once per token, store into each destination
rank's staging slot; receive: wait for all sources, expand into the expert-major layout) and combine two
(send: weighted local reduction + RHT + S2F6 into the source's combine area; receive: dequantize-accumulate
in rank order + inverse RHT). Writers wait until readers have consumed the previous call's rows.

Environment:
  EP_COMM_PEER_MEMORY  auto (default: NVSHMEM, else CUDA IPC with a warning) | nvshmem | ipc
  EP_COMM_SYNC_CHECK   1: synchronize after every call and raise at once on a device-side error (debug)
  EP_COMM_ALLOW_SHARED_GPU  1: ranks may share a GPU, over CUDA IPC (correctness tests only; see _shared_gpu_allowed)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _ext, formats
from .buffer_tag import agree_buffer_tag
from .transport import check_handle_group, device_backends, group_global_ranks
from ..types import (BufferConfig, BufferSizes, CombineRowsTarget, DispatchResult, WaveDispatch, WaveSync,
                     s2f6_combine_row_layout)

_STAGES = {
    1: "dispatch send (waiting for the peer to finish reading the previous dispatch's rows)",
    2: "dispatch receive (waiting for the peer's tokens)",
    3: "combine send (waiting for the peer to finish reading the previous combine's rows)",
    4: "combine receive (waiting for the peer's expert outputs)",
    5: "wave GEMM (waiting for the dispatch receive's {what})",
    6: "dispatch send (waiting for the peer's token counts, which place this rank's own rows)",
}
_STAGE_ROW_PAST_CAPACITY = 7  # csrc/nvlink.h kStageRowPastCapacity: a dispatch row outside the result (check())
_STAGE_PEER_GAVE_UP = 8  # csrc/spin_wait.cuh kStagePeerGaveUp: a peer's call raised before launching (give_up)
_STAGE_COMBINE_MISMATCH = 9  # csrc/nvlink.h kStageCombineMismatch: a peer's combine rows follow another handle or mode
# Smallest dispatch (tokens on this rank) whose NVFP4 send stores this rank's own rows straight into the expert-major
# output (csrc/nvlink.h, "direct self rows"); smaller calls keep them in staging and skip the send's wait for the
# counts. Measured on 2xH200 (bench/RESULTS.md, eleventh session): 4096 tokens 137.6-139.4 vs 151.1-154.6 us per call,
# 1024 and 2048 tokens within noise, 128 and 512 tokens noisy either way. EP_COMM_DIRECT_SELF_MIN_TOKENS overrides it
# (tests and measurements; 0 = always, 2147483647 = never).
_DIRECT_SELF_MIN_TOKENS = 2048
_DISPATCH_FORMAT_CODE = {"nvfp4": 0, "mxfp8": 1, "bf16": 2}
_COMBINE_FORMAT_CODE = {"s2f6": 0, "bf16": 1, "mxfp8": 2}  # csrc/nvlink.h CombineFormat
_LAYOUT_MAX_CHUNKS = 64  # csrc/nvlink.h kLayoutMaxChunks (checked against the extension in __init__)
_WAVE_AREA_FIXED_WORDS = 2  # csrc/waves.h kWaveRowsDone (likewise)


# The kernels' limits are csrc/nvlink.h's (kMaxTopk, kMaxWorld, kMaxDynamicSmem, the shared-memory tables' sizes), read
# from the extension. Without it (a CPU-only install asking for a size hint: Buffer.get_buffer_size_hint) these copies
# stand in; tests/test_nvlink.py checks them against the extension wherever it is built.
_ERROR_NO_PEER = 0xFFFF  # csrc/spin_wait.cuh kErrorNoPeer: the error concerns no single peer or expert
_MAX_TOPK = 32
_MAX_WORLD = 1024
_MAX_DYNAMIC_SMEM = 200 * 1024  # per block: the layout kernel's histograms, the dispatch kernels' receive layout


def _on_buffer_device(method):
    """Runs a Buffer method with the Buffer's GPU current, and the caller's current device restored after. The C++
    entry points select the Buffer's device in this module's own (static) CUDA runtime, and that is the thread's
    current device for torch too: a call made while another GPU was current would otherwise leave that one switched.
    (A no-op when the Buffer's GPU is current, as in one process per GPU: _ext.cuda_device.)"""
    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        with _ext.cuda_device(self.device):
            return method(self, *args, **kwargs)
    return on_device


def _layout_warp_smem(num_experts: int, world: int) -> int:
    return 4 * (num_experts + world)  # E + W int32 counters (csrc/nvlink_layout.cu layout_warp_smem)


def _receive_layout_smem(world: int, num_local: int) -> int:
    return 4 * (world * num_local + 2 * num_local + 3 * world + 2)  # csrc/nvlink_dispatch.cu ReceiveLayout::ints


def _kernel_limits():
    """(max top-k, max world, max dynamic shared memory per block, layout warp bytes (E, W), receive layout bytes
    (W, E_local)): the extension's where it is built, else the copies above."""
    c = _ext._C
    if c is not None and hasattr(c, "nvlink_receive_layout_smem"):
        return (c.nvlink_max_topk, c.nvlink_max_world, c.nvlink_max_dynamic_smem, c.nvlink_layout_warp_smem,
                c.nvlink_receive_layout_smem)
    return _MAX_TOPK, _MAX_WORLD, _MAX_DYNAMIC_SMEM, _layout_warp_smem, _receive_layout_smem


_MAX_HIDDEN = 1 << 20
# (launch_layout, csrc/nvlink_layout.cu, sums T + T / 64 - 1 in an int: 2^30 keeps it far below 2^31)
_MAX_TOKENS = 1 << 30


def _check_nvlink_limits(config: BufferConfig) -> None:
    """What this backend's kernels support beyond BufferConfig.validate()."""
    max_topk, max_world, max_smem, layout_warp_smem, receive_layout_smem = _kernel_limits()
    if config.num_topk > max_topk:
        raise ValueError(f"the nvlink backend supports num_topk <= {max_topk}, got {config.num_topk}")
    if config.world_size > max_world:
        raise ValueError(f"the nvlink backend supports up to {max_world} ranks, got {config.world_size}")
    if config.hidden > _MAX_HIDDEN:  # the kernels' per-row element offsets are 32-bit (2 * hidden must fit)
        raise ValueError(f"the nvlink backend supports hidden <= {_MAX_HIDDEN}, got {config.hidden}")
    if config.max_tokens_per_rank > _MAX_TOKENS:  # the layout's chunk count (csrc/nvlink_layout.cu) sums in 32 bits
        raise ValueError(f"the nvlink backend supports max_tokens_per_rank <= {_MAX_TOKENS}, got "
                         f"{config.max_tokens_per_rank}")
    w, e = config.world_size, config.num_experts
    needed = max(layout_warp_smem(e, w), receive_layout_smem(w, e // w))
    if needed > max_smem:
        raise ValueError(f"the nvlink backend's kernels keep per-expert tables in shared memory: num_experts="
                         f"{e} with world_size={w} needs {needed} bytes, more than {max_smem}")


def _env_flag(name: str) -> bool:
    """An on/off switch: unset, empty or "0" is off, "1" is on; anything else is refused (naming the variable)."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _peer_memory_mode() -> str:
    """EP_COMM_PEER_MEMORY: auto (unset), nvshmem or ipc, any case; anything else is refused."""
    mode = os.environ.get("EP_COMM_PEER_MEMORY", "auto").lower()
    if mode not in ("auto", "nvshmem", "ipc"):
        raise ValueError(f"EP_COMM_PEER_MEMORY must be auto, nvshmem or ipc, got {mode!r}")
    return mode


# The kernels' switches (csrc/nvlink_layout.cu, read by the C++ launcher with env_choice at the first dispatch): the
# values it takes, the first being the default. They may differ between ranks (each rank's launches are its own).
_KERNEL_SWITCHES = {"EP_COMM_NVLINK_PDL": ("auto", "0", "1"), "EP_COMM_NVLINK_COMPACT_COPY": ("1", "0"),
                    "EP_COMM_NVLINK_STREAM_RECV": ("1", "0")}


def kernel_switch_problem() -> Optional[str]:
    """What is wrong with this rank's kernel switches (_KERNEL_SWITCHES), or None: the message the launcher would
    raise at the first dispatch, where a peer would only time out. The Buffer compares it across ranks."""
    for name, values in _KERNEL_SWITCHES.items():
        value = os.environ.get(name, "")
        if value and value not in values:
            return f"{name} must be one of {', '.join(values)}, not {value!r}"
    return None


def check_environment() -> None:
    """The environment a Buffer compares across ranks (EP_COMM_PEER_MEMORY, EP_COMM_ALLOW_SHARED_GPU,
    EP_COMM_SYNC_CHECK), parsed as this backend reads it, and the kernels' switches: a malformed value raises
    ValueError."""
    _peer_memory_mode()
    _env_flag("EP_COMM_ALLOW_SHARED_GPU")
    _env_flag("EP_COMM_SYNC_CHECK")
    problem = kernel_switch_problem()
    if problem is not None:
        raise ValueError(problem)


def _env_count(name: str, default: int) -> int:
    """A non-negative 32-bit count: ASCII digits only (unset or empty: the default); refused otherwise, by name."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if not (value.isascii() and value.isdigit()) or int(value) > 2**31 - 1:
        raise ValueError(f"{name} must be a whole number in [0, 2147483647], got {value!r}")
    return int(value)


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


# ----------------------------------------------------------------------------------------------------------
# Region layout (identical on every rank)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RegionLayout:
    disp_data_bytes: int
    disp_scale_off: int
    disp_scale_bytes: int
    disp_meta_off: int
    disp_row_bytes: int
    comb_row_bytes: int
    comb_scale_off: int
    off_disp_ready: int
    off_disp_consumed: int
    off_comb_ready: int
    off_comb_consumed: int
    off_counts: int
    count_stride: int
    off_staging: int
    off_combine: int
    off_wave_index: int
    off_disp_counts: int
    off_row_flags: int
    off_abort: int
    off_comb_desc: int
    total_bytes: int

    @staticmethod
    def of(cfg: BufferConfig) -> "_RegionLayout":
        h, k, w, t_max = cfg.hidden, cfg.num_topk, cfg.world_size, cfg.max_tokens_per_rank
        if cfg.dispatch_format == "nvfp4":
            data, scales = h // 2, h // 16
        elif cfg.dispatch_format == "mxfp8":
            data, scales = h, h // 32
        else:
            data, scales = 2 * h, 0
        scale_off = _align(data, 16)
        meta_off = scale_off + _align(scales, 16)
        meta_bytes = 4 * (2 + 3 * k)  # f32 amax, i32 token, i32 expert[K], f32 weight[K], i32 position[K]
        disp_row = meta_off + _align(meta_bytes, 16)
        if cfg.combine_format in ("s2f6", "mxfp8"):  # the same row layout: one code byte per value, scales after
            comb_scale_off, comb_row = s2f6_combine_row_layout(h)
        else:
            comb_scale_off, comb_row = 0, 2 * h
        flags = _align(8 * w, 128)
        off = 0
        off_disp_ready, off = off, off + flags
        off_disp_consumed, off = off, off + flags
        off_comb_ready, off = off, off + flags
        off_comb_consumed, off = off, off + flags
        off_disp_counts, off = off, off + flags
        # Combine descriptors: u64 [W], what each expert rank's latest combine rows here belong to (csrc/nvlink.h).
        off_comb_desc, off = off, off + flags
        # The abort word (u32, csrc/spin_wait.cuh): here rather than in the local state, so that a peer giving up can
        # set it (give_up).
        off_abort, off = off, off + 128
        count_stride = _align(cfg.num_local_experts + 2, 4)  # expert counts, token count, row flags (0/1)
        off_counts, off = _align(off, 256), _align(off, 256) + 4 * w * count_stride
        # Row flags: [W][T_max] u32, the epoch of the dispatch whose staging row (s, j) is complete (streaming receive).
        off_row_flags = _align(off, 256)
        off = off_row_flags + 4 * w * t_max
        off_staging = _align(off, 256)
        off = off_staging + w * t_max * disp_row
        off_combine = _align(off, 256)
        off = off_combine + t_max * k * comb_row
        # Wave index: [W][E_local][T_max] int32, the staging slot of source s's p-th row for local expert j (written
        # by every NVFP4 dispatch send, read by a wave receive: csrc/nvlink.h). Waves are NVFP4-only.
        off_wave_index = _align(off, 256)
        if cfg.dispatch_format == "nvfp4":
            off = off_wave_index + 4 * w * cfg.num_local_experts * t_max
        return _RegionLayout(disp_data_bytes=data, disp_scale_off=scale_off, disp_scale_bytes=scales,
                             disp_meta_off=meta_off, disp_row_bytes=disp_row, comb_row_bytes=comb_row,
                             comb_scale_off=comb_scale_off, off_disp_ready=off_disp_ready,
                             off_disp_consumed=off_disp_consumed, off_comb_ready=off_comb_ready,
                             off_comb_consumed=off_comb_consumed, off_counts=off_counts, count_stride=count_stride,
                             off_staging=off_staging, off_combine=off_combine, off_wave_index=off_wave_index,
                             off_disp_counts=off_disp_counts, off_row_flags=off_row_flags, off_abort=off_abort,
                             off_comb_desc=off_comb_desc,
                             total_bytes=_align(off, 1 << 21))


# ----------------------------------------------------------------------------------------------------------
# Waves: one w1 GEMM per wave dispatch
# ----------------------------------------------------------------------------------------------------------
class _LaunchTicket:
    """A host-side right to launch GPU work that reads or writes a Buffer's device state behind the Buffer's back (a
    GEMM with a WaveSync or a CombineRowsTarget): refused on a destroyed Buffer, once stale (the subclass's rule) and
    on another stream than the call that made it."""

    _what = ""            # what the ticket belongs to, for the messages
    _stale_message = ""
    _stream_message = ""

    def __init__(self, backend, stream: int):
        self._backend = backend
        self._stream = stream

    def _stale(self) -> bool:
        raise NotImplementedError

    def _check(self) -> None:
        if self._backend._destroyed:
            raise RuntimeError(f"the Buffer of this {self._what} was destroyed")
        if self._stale():
            raise RuntimeError(self._stale_message)
        if _ext.current_raw_stream(self._backend.device) != self._stream:
            raise RuntimeError(self._stream_message)


class _WaveTicket(_LaunchTicket):
    """A wave dispatch's single right to launch its w1 GEMM (WaveSync.claim, called by grouped_gemm_nvfp4 just before
    the launch). The GEMM reads the Buffer's current dispatch epoch and takes work from a counter only the receive
    resets, so it must run once, on the dispatch's stream, before any other call on the Buffer: a second launch
    would find every item taken and compute nothing, and one after a later dispatch would wait on that dispatch's
    counters. Refused on the host instead."""

    _what = "wave dispatch"
    _stale_message = ("this WaveSync is stale: a wave dispatch's w1 GEMM runs once, right after its dispatch_waves, "
                      "before any other call on that Buffer")
    _stream_message = "the w1 GEMM of a wave dispatch must run on the stream of its dispatch_waves"

    def _stale(self) -> bool:
        return self._backend._wave_ticket is not self

    def claim(self) -> None:
        self._check()
        self._backend._wave_ticket = None


class _RowsTicket(_LaunchTicket):
    """The right of a begin_combine_rows' target to be stored into (CombineRowsTarget.claim, called by
    grouped_gemm_nvfp4_combine_rows before each launch; MoELayer launches w2 in up to three parts). The epilogue
    writes straight into the peers' combine areas, which only the begin's wait makes safe and only until the finish
    publishes them: a launch after finish_combine_rows, after another begin (its src_rank / src_token / topk_slot
    would place rows at another dispatch's tokens) or after destroy() would corrupt what the peers read, with no
    fault recorded anywhere. Refused on the host instead, as is a launch on another stream than the begin's."""

    _what = "combine-rows target"
    _stale_message = ("this CombineRowsTarget is stale: its combine was finished (finish_combine_rows) or another "
                      "begin_combine_rows followed; a target takes GEMM stores only between its begin_combine_rows "
                      "and finish_combine_rows")
    _stream_message = "the combine-row GEMM must run on the stream of its begin_combine_rows"

    def __init__(self, backend, handle, stream: int):
        super().__init__(backend, stream)
        self._handle = handle

    def _stale(self) -> bool:
        return self._backend._rows_handle is not self._handle

    def claim(self) -> None:
        self._check()


# ----------------------------------------------------------------------------------------------------------
# Symmetric memory: NVSHMEM (nvshmem4py) or CUDA IPC
# ----------------------------------------------------------------------------------------------------------
_nvshmem_lock = threading.Lock()
_nvshmem_state = {"initialized": False, "group_ranks": None, "device": None, "error": None}


def _combine_sections(sections):
    """The arena sections combine reads (send_idx, send_w, row_weight, recv_count, recv_tok, recv_ord, recv_rows,
    dispatch_epoch)."""
    return tuple(sections[i] for i in (0, 1, 17, 11, 12, 13, 14, 16))


def _shared_gpu_allowed() -> bool:
    """EP_COMM_ALLOW_SHARED_GPU=1: a correctness-testing mode in which several ranks of one node may share a GPU
    (more ranks than GPUs). Their regions are mapped with CUDA IPC, and their kernels, which wait for each other,
    progress only as the driver time-slices the processes' contexts: much slower than separate GPUs, and never a
    performance figure. It lets the multi-rank protocol (peer stores, flags, counts from other ranks) be tested on a
    one-GPU machine. Read at each Buffer creation."""
    return _env_flag("EP_COMM_ALLOW_SHARED_GPU")


def _cpu_collectives(group) -> bool:
    try:
        return device_backends(group).get("cpu") == "gloo"
    except Exception:
        return False


def _nvshmem_init(group, region_bytes: int, timeout_s: float):
    """Initialize NVSHMEM once per process over `group` (UID broadcast); returns the nvshmem.core module. A rank still
    inside nvshmem.init after timeout_s says so on stderr (_announce_if_slow)."""
    import nvshmem.core as nvshmem  # noqa: F401  (ImportError -> caller falls back)
    try:
        from cuda.core import Device
    except ImportError:  # older cuda-core
        from cuda.core.experimental import Device
    import numpy as np

    with _nvshmem_lock:
        ranks = group_global_ranks(group)
        if _nvshmem_state["initialized"]:
            if _nvshmem_state["group_ranks"] != ranks:
                raise RuntimeError(f"NVSHMEM is already initialized over ranks {_nvshmem_state['group_ranks']}, "
                                   f"not {ranks}")
            return nvshmem
        if _nvshmem_state["error"] is not None:
            raise RuntimeError(_nvshmem_state["error"])
        # Our defaults, never overriding the user's: NVLink only, no multicast, a heap large enough.
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(4 << 30, _align(2 * region_bytes, 1 << 30))))
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        device = torch.cuda.current_device()
        torch.cuda.init()
        torch.empty(1, device=torch.device("cuda", device))  # make sure the context exists before NVSHMEM starts
        uid = nvshmem.get_unique_id(empty=(rank != 0))
        raw = np.asarray(uid._data).view(np.uint8).reshape(-1)
        payload = torch.from_numpy(raw.copy())
        if not _cpu_collectives(group):
            payload = payload.to(torch.device("cuda", device))
        dist.broadcast(payload, src=dist.get_global_rank(group, 0), group=group)
        raw[:] = payload.cpu().numpy()
        try:
            with _announce_if_slow("NVSHMEM initialization (nvshmem.core.init)", rank, timeout_s):
                nvshmem.init(device=Device(device), uid=uid, rank=rank, nranks=world, initializer_method="uid")
        except Exception as error:
            _nvshmem_state["error"] = f"nvshmem.core.init failed: {error}"
            raise
        _nvshmem_state["initialized"] = True
        _nvshmem_state["group_ranks"] = ranks
        _nvshmem_state["device"] = device  # NVSHMEM allocates on this GPU from now on, whichever is current
        return nvshmem


def _peer_link_problem(identities: list, rank: int, shared_gpu_allowed: bool) -> Optional[str]:
    """Why this rank's GPU cannot serve as the nvlink peer of the other ranks of its node (None: it can).

    identities: every rank's (host, GPU UUID, device index) in group-rank order (buffer._gpu_identity). The kernels
    store into their peers' memory and update its flags and counters with system-scope atomics, so each pair of ranks
    on one node needs two distinct GPUs (unless EP_COMM_ALLOW_SHARED_GPU; compared by UUID, on any host) with peer
    access and native peer atomics: NVLink has both; a PCIe link often has access only, and atomics over it are then
    not atomic. The peer's GPU is found among this process's GPUs by its UUID, so any rank-to-GPU mapping and
    CUDA_VISIBLE_DEVICES order is checked as it is. Left to the peer-memory setup: peers on other hosts (by host name;
    NVSHMEM across one NVLink domain) and GPUs this process cannot see (e.g. each rank given only its own GPU by
    CUDA_VISIBLE_DEVICES)."""
    host, uuid, device = identities[rank]
    if uuid is None:  # (is_available asks only where CUDA works)
        return "could not read this GPU's UUID (torch.cuda.get_device_properties(...).uuid), which the peer check needs"
    visible = {_ext.gpu_uuid(index): index for index in range(torch.cuda.device_count())}
    for peer, (peer_host, peer_uuid, _) in enumerate(identities):
        if peer == rank or peer_uuid is None:
            continue
        if peer_uuid == uuid:  # a UUID names one GPU, whatever host names the processes see
            if shared_gpu_allowed:
                continue
            return (f"ranks {min(rank, peer)} and {max(rank, peer)} use the same GPU (cuda:{device} here, {uuid}): "
                    f"give each rank its own GPU (torch.cuda.set_device(local_rank) before creating the Buffer); "
                    f"EP_COMM_ALLOW_SHARED_GPU=1 lets ranks share one for correctness tests only")
        peer_index = visible.get(peer_uuid) if peer_host == host else None
        if peer_index is None:
            continue
        access, native_atomics = _ext._C.nvlink_peer_link(device, peer_index)
        if not access:
            return f"GPU cuda:{device} cannot access rank {peer}'s GPU cuda:{peer_index} as a peer (no NVLink/P2P)"
        if not native_atomics:
            return (f"GPU cuda:{device} reaches rank {peer}'s GPU cuda:{peer_index} without native peer atomics "
                    f"(a PCIe link, not NVLink): the nvlink kernels' flags and counters need them")
    return None


@contextlib.contextmanager
def _announce_if_slow(what: str, rank: int, seconds: float):
    """Around a collective call that nothing of ours can bound (NVSHMEM's bootstrap, symmetric allocation and free wait
    for every rank inside the library, without a timeout): if the block has not ended after `seconds`, a native timer
    (_C.StallAnnouncer: it fires while this thread holds the GIL, as nvshmem4py's malloc / free do while they block)
    writes once to stderr what this rank waits in and why it may never return, so that a peer's failure is not a
    silent hang. The call itself goes on; if it does end after the message, that is said too."""
    message = (f"ep_comm nvlink: rank {rank} has waited {seconds:g} s in {what}, which waits for every rank and has no "
               f"timeout: a peer rank may have failed before or inside it (see its output), and then this rank never "
               f"returns from it and the job must be stopped. EP_COMM_PEER_MEMORY=ipc (one node) does without "
               f"NVSHMEM.\n")
    # Best effort: the announcement must never keep the call from being made (every rank waits in it for this one).
    announcer = None
    try:
        announcer = _ext._C.StallAnnouncer(message, seconds)
    except Exception as error:  # (an ep_comm._C built before it, or no thread to be had)
        _ext.warn_once(f"ep_comm nvlink: no announcement of NVSHMEM calls that stall ({type(error).__name__}: "
                       f"{error})")
    started = time.monotonic()
    try:
        yield
    finally:
        if announcer is not None and announcer.stop():
            print(f"ep_comm nvlink: rank {rank}: {what} ended after {time.monotonic() - started:.1f} s",
                  file=sys.stderr, flush=True)


def nvshmem_importable() -> bool:
    """Whether nvshmem4py imports here: without it peers are mapped with CUDA IPC, which needs every rank on one
    node (NVSHMEM can also map peers of other nodes of one NVLink domain)."""
    try:
        import nvshmem.core  # noqa: F401
        return True
    except Exception:
        return False


def nvshmem_may_map_peers() -> bool:
    """Whether this rank's Buffers may map their peers with NVSHMEM (which can reach other nodes of one NVLink
    domain): nvshmem4py imports, and neither EP_COMM_PEER_MEMORY=ipc nor EP_COMM_ALLOW_SHARED_GPU=1 asks for CUDA IPC,
    which needs every rank on one node. (Whether NVSHMEM then initializes is known only at setup.)"""
    try:
        ipc = _peer_memory_mode() == "ipc" or _shared_gpu_allowed()
    except ValueError:  # (a malformed switch: refused by the Buffer's environment check, with its message)
        return False
    return not ipc and nvshmem_importable()


def finalize_nvshmem() -> None:
    """Collective, optional: shut NVSHMEM down once every nvlink Buffer of this process is destroyed.
    Not registered with atexit on purpose: nvshmem finalize is collective, and ranks leave at different
    times (a rank waiting in an exit-time barrier for a peer that already exited would hang)."""
    if _nvshmem_state["initialized"]:
        try:
            import nvshmem.core as nvshmem
            nvshmem.finalize()
        except Exception:
            pass
        _nvshmem_state["initialized"] = False
        _nvshmem_state["device"] = None


class _SymmetricRegion:
    """One region per rank; `peer_bases[r]` is the local address of rank r's region (own rank: local)."""

    def __init__(self, group, nbytes: int, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s  # how long NVSHMEM's collective calls may take before a rank says it waits
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.cuda.current_device()
        self.nbytes = nbytes
        self.kind = None
        self._tensor = None
        self._nvshmem = None
        self._ipc_local = None
        self._ipc_opened: List[int] = []
        mode = _peer_memory_mode()
        if _shared_gpu_allowed():
            if mode == "nvshmem":
                raise ValueError("EP_COMM_ALLOW_SHARED_GPU=1 maps peers with CUDA IPC; it cannot be combined with "
                                 "EP_COMM_PEER_MEMORY=nvshmem")
            mode = "ipc"  # NVSHMEM refuses two PEs on one GPU without MPS; IPC maps a same-GPU peer fine
        why_not = "EP_COMM_PEER_MEMORY=ipc" if mode == "ipc" else self._setup_nvshmem()
        if why_not is not None:
            if mode == "nvshmem":
                raise RuntimeError(f"EP_COMM_PEER_MEMORY=nvshmem but NVSHMEM is unusable: {why_not}")
            if mode == "auto":
                _ext.warn_once(f"ep_comm nvlink: using CUDA IPC peer memory (single node only) because NVSHMEM is "
                           f"unavailable: {why_not}")
            self._open_ipc()

    def local_bytes(self) -> torch.Tensor:
        """This rank's region as a uint8 tensor on its GPU, without a copy: NVSHMEM's symmetric tensor, or, for CUDA
        IPC, a tensor over the raw allocation (__cuda_array_interface__; it does not own the memory, free() does)."""
        if self.kind == "nvshmem":
            return self._tensor.view(torch.uint8).reshape(-1)[:self.nbytes]
        if self.kind != "ipc":
            raise RuntimeError("the symmetric region is not allocated")

        class _Memory:  # what torch.as_tensor needs to view foreign device memory
            __cuda_array_interface__ = {"shape": (self.nbytes,), "typestr": "|u1", "data": (self._ipc_local, False),
                                        "version": 3, "strides": None}
        return torch.as_tensor(_Memory(), device=torch.device("cuda", self.device))

    def _gather(self, mine) -> list:
        """Every rank's `mine`, in rank order (a collective)."""
        values = [None] * self.world
        dist.all_gather_object(values, mine, group=self.group)
        return values

    @staticmethod
    def _first_failure(reasons) -> Optional[str]:
        """The first rank's failure reason, named by its rank (None when every rank succeeded)."""
        return next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None), None)

    def _agree(self, mine: Optional[str]) -> Optional[str]:
        """All ranks learn the first rank's failure reason (None when every rank succeeded)."""
        return self._first_failure(self._gather(mine))

    # -- NVSHMEM ------------------------------------------------------------------------------------------
    def _setup_nvshmem(self) -> Optional[str]:
        """NVSHMEM init + symmetric allocation, each step agreed by every rank before the next collective
        one (a rank that skips a collective NVSHMEM call would leave the others waiting)."""
        try:
            import nvshmem.core  # noqa: F401
            mine = None
        except Exception as error:
            mine = f"nvshmem4py is not importable ({type(error).__name__}: {error})"
        why = self._agree(mine)
        if why is not None:
            return why
        # _nvshmem_init broadcasts the unique id only on ranks where NVSHMEM is not initialized yet (and did not fail
        # before): every rank must take the same branch, or some would wait in that broadcast for the others.
        # NVSHMEM allocates on the GPU it was started on: a process that started it on another GPU than this
        # Buffer's cannot give it a symmetric region here (every rank then takes the same way out).
        started_on = _nvshmem_state["device"] if _nvshmem_state["initialized"] else None
        states = self._gather((bool(_nvshmem_state["initialized"]), _nvshmem_state["group_ranks"],
                               _nvshmem_state["error"] is not None,
                               started_on is not None and started_on != self.device))
        if len({(initialized, tuple(ranks or ())) for initialized, ranks, _, _ in states}) > 1 \
                or any(failed for _, _, failed, _ in states) and not all(failed for _, _, failed, _ in states):
            return ("NVSHMEM's state differs between the ranks (initialized over another group, or failed before, on "
                    "some ranks only): " + ", ".join(f"rank {r}: initialized={initialized} over {ranks}"
                                                       for r, (initialized, ranks, _, _) in enumerate(states)))
        moved = next((r for r, (_, _, _, other_gpu) in enumerate(states) if other_gpu), None)
        if moved is not None:
            return (f"rank {moved} started NVSHMEM on another GPU than this Buffer's (one process uses NVSHMEM on one "
                    f"GPU: make every nvlink Buffer of a process while the same GPU is current)")
        try:
            nvshmem = _nvshmem_init(self.group, self.nbytes, self.timeout_s)
            mine = None
        except Exception as error:
            nvshmem, mine = None, f"NVSHMEM init failed: {type(error).__name__}: {error}"
        why = self._agree(mine)
        if why is not None:
            return why
        tensor, peers, mine = None, [], None
        try:
            with _announce_if_slow("NVSHMEM's symmetric allocation (nvshmem.core.tensor)", self.rank, self.timeout_s):
                tensor = nvshmem.tensor((self.nbytes,), dtype=torch.uint8)
        except Exception as error:
            mine = f"symmetric allocation of {self.nbytes} bytes failed: {type(error).__name__}: {error}"
        # Who failed, and who holds a tensor: if some ranks do, a symmetric tensor cannot be freed collectively, so
        # every rank raises -- a rank that fell back to CUDA IPC alone would wait in a collective the others skip.
        votes = self._gather((mine, tensor is not None))
        why = self._first_failure(failed for failed, _ in votes)
        if why is not None:
            if any(held for _, held in votes):
                raise RuntimeError(f"NVSHMEM allocation succeeded on some ranks only ({why}); cannot fall back")
            return why
        try:
            tensor.zero_()
            for r in range(self.world):
                if r == self.rank:
                    peers.append(tensor.data_ptr())
                    continue
                peer = nvshmem.get_peer_tensor(tensor, r)
                if peer is None:
                    raise RuntimeError(f"rank {r} is not reachable over NVLink (nvshmem_ptr is NULL)")
                peers.append(peer.data_ptr())
            mine = None
        except Exception as error:
            mine = f"peer mapping failed: {type(error).__name__}: {error}"
        why = self._agree(mine)
        if why is not None:
            self._free_symmetric(nvshmem, tensor)  # every rank allocated: the collective free is safe
            return why
        self.kind, self._tensor, self._nvshmem, self.peer_bases = "nvshmem", tensor, nvshmem, peers
        self.local_base = tensor.data_ptr()
        return None

    def _free_symmetric(self, nvshmem, tensor) -> None:
        with _announce_if_slow("NVSHMEM's symmetric free (nvshmem.core.free_tensor)", self.rank, self.timeout_s):
            nvshmem.free_tensor(tensor)

    def _free_nvshmem(self) -> None:
        if self._tensor is not None:
            self._free_symmetric(self._nvshmem, self._tensor)
        self._tensor, self.kind = None, None

    # -- CUDA IPC -----------------------------------------------------------------------------------------
    def _open_ipc(self) -> None:
        """Allocate this rank's region and map every peer's, each step agreed by every rank before the next collective
        one: a rank whose allocation or mapping fails makes every rank raise (naming it) instead of leaving the others
        in the next collective until the process group's timeout, and each rank frees what it had already made."""
        c = _ext.require_cuda_extension("the nvlink backend")
        handle, mine = None, None
        try:
            self._ipc_local = c.nvlink_device_alloc(self.device, self.nbytes)  # zeroed
            handle = c.nvlink_ipc_get_handle(self.device, self._ipc_local)
        except Exception as error:
            mine = f"allocating or exporting {self.nbytes} bytes failed: {type(error).__name__}: {error}"
        handles = self._gather((handle, mine))
        why = self._first_failure(failed for _, failed in handles)
        peers, mine = [], None
        if why is None:
            try:
                for r, (peer_handle, _) in enumerate(handles):
                    if r == self.rank:
                        peers.append(self._ipc_local)
                    else:
                        address = c.nvlink_ipc_open_handle(self.device, peer_handle)
                        self._ipc_opened.append(address)
                        peers.append(address)
            except Exception as error:
                mine = f"mapping a peer's region failed: {type(error).__name__}: {error}"
            why = self._agree(mine)
        if why is not None:
            self._release_ipc(c)
            raise RuntimeError(f"CUDA IPC peer memory could not be set up ({why}); all ranks must share one node with "
                               f"NVLink peer access")
        self.kind, self.peer_bases, self.local_base = "ipc", peers, self._ipc_local

    def _release_ipc(self, c) -> None:
        """Collective (every rank calls it after the same vote, or in destroy): unmap the peers' regions, wait until no
        peer maps ours, free it."""
        for address in self._ipc_opened:
            c.nvlink_ipc_close_handle(self.device, address)
        self._ipc_opened = []
        dist.barrier(group=self.group)  # no peer maps our region any more
        if self._ipc_local is not None:
            c.nvlink_device_free(self.device, self._ipc_local)
            self._ipc_local = None

    def free(self) -> None:
        if self.kind == "nvshmem":
            self._free_nvshmem()
        elif self.kind == "ipc":
            self._release_ipc(_ext.require_cuda_extension("the nvlink backend"))
            self.kind = None


# ----------------------------------------------------------------------------------------------------------
# Handle and backend
# ----------------------------------------------------------------------------------------------------------
class _ArenaSection:
    """A handle array read from the dispatch arena when accessed: section `index` of NvlinkContext.arena_layout as
    `dtype`, [T, K] when `per_token`, else 1-D. Nothing is stored per handle (combine reads the arena in C++)."""

    def __init__(self, index: int, dtype: torch.dtype = torch.int32, per_token: bool = False):
        self.index, self.dtype, self.per_token = index, dtype, per_token

    def __get__(self, handle, owner=None):
        if handle is None:
            return self
        offset, nbytes = handle.sections[self.index]
        size = self.dtype.itemsize  # sections start 256-byte aligned
        words = handle.arena.view(self.dtype).as_strided((nbytes // size,), (1,), offset // size)
        return words.view(handle.num_tokens, handle.num_topk) if self.per_token else words

    def address(self, handle) -> int:
        """Device address of this section in `handle`'s arena (no tensor made)."""
        return handle.arena_ptr + handle.sections[self.index][0]


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class NVLinkHandle:
    """What combine needs: one dispatch's arena (fixed shapes, so graphs can capture dispatch + combine).

    arena: int32 [bytes / 4] on the device, the one allocation of a dispatch call: every DispatchResult tensor and
        the arrays below are sections of it (their byte offsets and sizes are `sections`, the C++ table for
        num_tokens), and the handle keeps it alive. owner: the NvlinkContext whose table describes it.
    The arrays, carved from the arena when read (combine reads them in C++ from the arena address instead):
    send_idx / send_w: this rank's routing [T, K] (int32 expert ids, -1 masked; fp32 weights), copied by the
        layout kernel. recv_count: [W] tokens received from each source. recv_tok / recv_ord: [W * T_max]
        source token of staging row (s, j) and this rank's ordinal among the token's destination ranks.
    recv_rows: [W * T_max * K] layout row of each slot of staging row (s, j), -1 if not local.
    dispatch_epoch: int64 [1], the dispatch word: the dispatch's call number on the device in bits 0..39 and the
        dispatching Buffer's tag (agree_buffer_tag) in bits 40..61, written by the layout kernel (so graph replays renew
        it). Combine tells the peers which dispatch its rows follow, and they check it against their own.
    row_weight: [R] fp32, the handle's own copy of DispatchResult.topk_weight (the receive writes both; combine reads
        this one, so an edit of the result's topk_weight does not change the combine).
    num_tokens: T; num_rows: R (capacity); num_topk: K.
    routing: (world size, max_tokens_per_rank, K, R, experts per rank) of the dispatching Buffer: what a combine on
        another Buffer must share (check_handle); group_ranks: its group's global ranks in group-rank order, which that
        Buffer's must equal too (the handle's tables name peers by group rank).
    stream: the raw CUDA stream the dispatch ran on (where the caching allocator gave out the arena): a combine on
        another stream marks the arena in use there (Buffer._run_on_stream).
    """

    arena: torch.Tensor
    sections: Tuple[Tuple[int, int], ...]
    num_tokens: int
    num_rows: int
    num_topk: int
    owner: Any = None
    routing: Tuple[int, ...] = ()
    group_ranks: Tuple[int, ...] = ()
    stream: int = 0

    send_idx = _ArenaSection(0, per_token=True)
    send_w = _ArenaSection(1, torch.float32, per_token=True)
    row_weight = _ArenaSection(17, torch.float32)
    recv_count = _ArenaSection(11)
    recv_tok = _ArenaSection(12)
    recv_ord = _ArenaSection(13)
    recv_rows = _ArenaSection(14)
    dispatch_epoch = _ArenaSection(16, torch.int64)

    @property
    def arena_ptr(self) -> int:
        return self.arena.data_ptr()


@dataclass(frozen=True)
class _ArenaRecipe:
    """How one dispatch call's outputs sit in its arena (cached per token count; from the C++ section table).

    words: int32 elements of the arena. sections: (byte offset, bytes) of the 18 sections (order of
    NvlinkContext.arena_layout). Each output below is one as_strided view of an alias of the arena:
    (element offset in the alias, shape). `data` / `scales` name their alias dtype too.
    """

    words: int
    sections: Tuple[Tuple[int, int], ...]
    data: Tuple[torch.dtype, int, Tuple[int, int]]
    scales: Optional[Tuple[torch.dtype, int, Tuple[int, int]]]
    amax: Optional[int]
    int_views: Tuple[Tuple[int, int], ...]  # num_per_expert, expert_offsets, src_rank, src_token, topk_slot
    topk_weight: int
    row_index: Optional[int] = None  # element offset of row_index (a dispatch without expansion only)


class NVLinkBackend:
    """Dispatch/combine with our kernels over NVLink peer pointers (see the module docstring)."""

    name = "nvlink"
    holds_unmanaged_memory = True  # the symmetric region and host-mapped words: Buffer.__del__ warns if not destroyed

    def __init__(self, group, config: BufferConfig):
        config.validate()
        ok, reason = NVLinkBackend.is_available(group)
        if not ok:
            raise RuntimeError(f"the nvlink backend is unavailable: {reason}")
        _check_nvlink_limits(config)
        c = _ext.require_cuda_extension("the nvlink backend")
        self.group = group
        self.config = config
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != config.world_size:
            raise ValueError(f"config.world_size={config.world_size} but the group has {self.world} ranks")
        self.device = torch.cuda.current_device()
        self.torch_device = torch.device("cuda", self.device)  # compared with every call's tensors (Buffer)
        self.layout = _RegionLayout.of(config)
        self._sync_check = _env_flag("EP_COMM_SYNC_CHECK")
        self._arena_recipes = {}
        self._staging = None  # _staging_payload's views, made on first use
        self._destroyed = False
        self._rows_handle = None  # the handle begin_combine_rows was given, until finish_combine_rows (order check)
        self._staging_generation = 0  # dispatches so far (an expand=False result's x is valid until the next one)
        self._wave_ticket = None  # the last wave dispatch's _WaveTicket until its w1 GEMM claims it
        self._gave_up = None  # why this rank gave up (give_up): every later call raises
        self._fault_reported = False  # check() raised on the error word (destroy() warns about one it did not)

        # Collective: before the region, so that everything between the region and the vote below is local to a rank.
        self.blocks = self._block_counts(group, config)
        self.buffer_tag = agree_buffer_tag(group)  # collective too: in every handle's dispatch word (combine check)
        self._error_host = None
        self.region = _SymmetricRegion(group, self.layout.total_bytes, config.timeout_s)
        failure = None
        try:
            dev = self.torch_device
            t_max, k = config.max_tokens_per_rank, config.num_topk
            self._peer_bases = torch.tensor(self.region.peer_bases, dtype=torch.int64, device=dev)
            self._state = torch.zeros(8, dtype=torch.int64, device=dev)  # NvlinkState (<= 64 bytes)
            if c.nvlink_state_bytes > self._state.numel() * 8:
                raise RuntimeError("NvlinkState grew past the state buffer")
            self._scratch_pos = torch.empty(t_max * k, dtype=torch.int32, device=dev)
            self._scratch_slot = torch.empty(t_max * k, dtype=torch.int32, device=dev)
            self._expert_count = torch.zeros(config.num_experts, dtype=torch.int32, device=dev)
            self._rank_count = torch.zeros(self.world, dtype=torch.int32, device=dev)
            # Per layout chunk (block) and key (E experts, then W ranks): rows/tokens of the earlier chunks.
            if (c.nvlink_layout_max_chunks, c.wave_area_fixed_words) != (_LAYOUT_MAX_CHUNKS, _WAVE_AREA_FIXED_WORDS):
                raise RuntimeError("ep_comm._C and the size hint's constants differ: rebuild ep_comm")
            # (An extension without the attribute predates it and the MXFP8 combine: S2F6 and BF16 only.)
            built = getattr(c, "nvlink_combine_format_codes",
                            (_COMBINE_FORMAT_CODE["s2f6"], _COMBINE_FORMAT_CODE["bf16"]))
            if _COMBINE_FORMAT_CODE[config.combine_format] not in built:
                raise RuntimeError(f"this ep_comm._C was built before the {config.combine_format!r} combine format "
                                   f"existed: rebuild ep_comm")
            self._layout_base = torch.zeros(_LAYOUT_MAX_CHUNKS * (config.num_experts + self.world),
                                            dtype=torch.int32, device=dev)
            # Wave dispatch <-> w1 GEMM sync words (csrc/waves.h; zero once, never reset).
            self._wave_area = torch.zeros(_WAVE_AREA_FIXED_WORDS + config.num_local_experts, dtype=torch.int64,
                                          device=dev)
            self._error_host, error_dev = c.nvlink_host_mapped_alloc(self.device, 64)
            L = self.layout
            self._ctx = c.NvlinkContext(self.device, {
                "rank": self.rank, "world": self.world, "hidden": config.hidden, "num_experts": config.num_experts,
                "num_local": config.num_local_experts, "topk": k, "max_tokens": t_max,
                "alignment": config.expert_alignment, **self.blocks,
                "disp_fmt": _DISPATCH_FORMAT_CODE[config.dispatch_format],
                "comb_fmt": _COMBINE_FORMAT_CODE[config.combine_format], "sign_mask": config.rht_sign_mask,
                "buffer_tag": self.buffer_tag,
                "max_recv_rows": config.max_recv_rows, "disp_row_bytes": L.disp_row_bytes,
                "disp_data_bytes": L.disp_data_bytes, "disp_scale_off": L.disp_scale_off,
                "disp_scale_bytes": L.disp_scale_bytes, "disp_meta_off": L.disp_meta_off,
                "comb_row_bytes": L.comb_row_bytes, "comb_scale_off": L.comb_scale_off,
                "off_disp_ready": L.off_disp_ready, "off_disp_consumed": L.off_disp_consumed,
                "off_comb_ready": L.off_comb_ready, "off_comb_consumed": L.off_comb_consumed,
                "off_counts": L.off_counts, "count_stride": L.count_stride, "off_staging": L.off_staging,
                "off_combine": L.off_combine, "off_wave_index": L.off_wave_index, "off_disp_counts": L.off_disp_counts,
                "off_row_flags": L.off_row_flags, "off_abort": L.off_abort,
                "off_comb_desc": L.off_comb_desc,
                "direct_self_min_tokens": _env_count("EP_COMM_DIRECT_SELF_MIN_TOKENS", _DIRECT_SELF_MIN_TOKENS),
                "timeout_ns": int(config.timeout_s * 1e9),
                "peer_bases": self._peer_bases.data_ptr(), "local_base": self.region.local_base,
                "state": self._state.data_ptr(), "scratch_pos": self._scratch_pos.data_ptr(),
                "scratch_slot": self._scratch_slot.data_ptr(), "expert_count": self._expert_count.data_ptr(),
                "rank_count": self._rank_count.data_ptr(), "layout_base": self._layout_base.data_ptr(),
                "error_word": error_dev,
            })
            # What a wave dispatch's GEMM needs besides the sync area (addresses and the timeout: fixed per Buffer).
            self._wave_sync_words = self._ctx.wave_sync()
        except Exception as error:  # noqa: BLE001 (re-raised below, after every rank has learned of it)
            failure = error
        # Every rank learns whether every other one finished its setup: a rank that failed would otherwise leave the
        # others in the barrier below until the process group's timeout, and the region (collective) would leak.
        why = self.region._agree(None if failure is None else f"{type(failure).__name__}: {failure}")
        if why is not None:
            if self._error_host is not None:
                c.nvlink_host_mapped_free(self._error_host)
                self._error_host = None
            self.region.free()
            if failure is not None:
                raise failure
            raise RuntimeError(f"the nvlink backend could not be set up on every rank ({why})")
        # Every region is zeroed (counters at 0) before any rank may write into a peer's.
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)

    # ------------------------------------------------------------------------------------------------------
    def _block_counts(self, group, config: BufferConfig) -> dict:
        """Grid of each kernel, identical on every rank (the counters count blocks of the signalling kernel).

        NVLink-facing sends (BF16/MXFP8 dispatch) use num_sms blocks; the local, HBM- or compute-heavy phases
        (dispatch receive/expansion, combine reduction+send, combine receive, and the NVFP4 dispatch send,
        whose 4/6 quantization dominates) use num_local_sms blocks, 0 = the smallest SM count of the ranks."""
        local = config.num_local_sms
        if local == 0:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            votes = [None] * self.world
            dist.all_gather_object(votes, int(sms), group=group)
            local = min(votes)
        send = local if config.dispatch_format == "nvfp4" else config.num_sms
        return {"disp_send_blocks": int(send), "disp_recv_blocks": int(local), "comb_send_blocks": int(local),
                "comb_recv_blocks": int(local)}

    @staticmethod
    def is_available(group, identities: Optional[list] = None) -> Tuple[bool, str]:
        """(True, "") when this rank can run the nvlink backend, else (False, why). Local checks (no collective):
        the built kernels, a GPU of compute capability >= 9.0 whose kernel image loads, the world size; with
        `identities` (every rank's (host, GPU UUID, device index), gathered by Buffer) also its GPU's links to the
        GPUs of the other ranks of its node (_peer_link_problem)."""
        if not _ext.cuda_extension_available():
            return False, f"ep_comm._C is unavailable: {_ext.cuda_extension_error()}"
        c = _ext._C
        if not hasattr(c, "NvlinkContext"):
            return False, "ep_comm._C was built without the nvlink kernels"
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        try:
            world = dist.get_world_size(group)
        except Exception as error:
            return False, f"no usable process group ({error})"
        if world > c.nvlink_max_world:
            return False, f"world size {world} exceeds {c.nvlink_max_world}"
        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            return False, f"needs compute capability >= 9.0 (sm_90a build), found {major}.{minor}"
        # A GPU the build has no kernel image for (a Blackwell GPU with the default "90a"), or a driver older than the
        # runtime _C links: refused here, so that "auto" falls back, instead of failing in the kernels' setup.
        problem = formats._kernel_image_problem(torch.device("cuda", torch.cuda.current_device()))
        if problem:
            return False, problem
        if identities is not None:
            why = _peer_link_problem(identities, dist.get_rank(group), _shared_gpu_allowed())
            if why is not None:
                return False, why
        if _shared_gpu_allowed():
            return True, ""  # testing mode: ranks of this node share GPUs, over CUDA IPC (see _shared_gpu_allowed)
        if not nvshmem_may_map_peers() and world > torch.cuda.device_count():
            return False, (f"peers are mapped with CUDA IPC (nvshmem4py is not installed, or EP_COMM_PEER_MEMORY=ipc), "
                           f"which needs every rank on this node ({world} ranks, {torch.cuda.device_count()} GPUs "
                           f"visible)")
        return True, ""

    @staticmethod
    def size_hint(config: BufferConfig) -> BufferSizes:
        _check_nvlink_limits(config)  # a hint for a configuration this backend refuses would mislead
        L = _RegionLayout.of(config)
        w, t_max, k = config.world_size, config.max_tokens_per_rank, config.num_topk
        dispatch = w * t_max * L.disp_row_bytes
        combine = t_max * k * L.comb_row_bytes
        payload = L.disp_data_bytes + L.disp_scale_bytes + (4 if config.dispatch_format == "nvfp4" else 0)
        # Local scratch as __init__ allocates it: top-k positions and slots, expert and rank counts, the layout
        # bases of every chunk (csrc/nvlink.h kLayoutMaxChunks), the state words, the wave sync area (csrc/waves.h
        # kWaveRowsDone words plus one per local expert).
        keys = config.num_experts + w
        local = (2 * t_max * k * 4 + 4 * keys + 4 * _LAYOUT_MAX_CHUNKS * keys + 64
                 + 8 * (_WAVE_AREA_FIXED_WORDS + config.num_local_experts))
        # The handle: recv tables, send_idx + send_w, the dispatch epoch, its copy of the row weights.
        handle = 4 * (w + 2 * w * t_max + w * t_max * k) + 8 * t_max * k + 8 + 4 * config.max_recv_rows
        return BufferSizes(dispatch_recv_bytes=dispatch, combine_recv_bytes=combine,
                           layout_bytes=L.off_staging + local + handle,
                           expert_layout_bytes=config.max_recv_rows * (payload + 16),
                           total_symmetric_bytes=L.total_bytes)

    # ------------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel of this Buffer recorded a timeout or a fault (a dispatch row past the result, a combine the
        peers made on another handle or mode: reads host-mapped memory, no sync), or if this rank gave up (give_up).
        Every call checks first, so a Buffer that gave up refuses them all."""
        if self._destroyed or self._error_host is None:
            return
        if self._gave_up is not None:
            raise RuntimeError(f"ep_comm nvlink: rank {self.rank} gave up after an earlier call raised on this rank "
                               f"({self._gave_up}); its peers were told to stop waiting and the ranks' calls are out "
                               f"of step: this Buffer is unusable, make a new one on every rank")
        message = self._recorded_fault()
        if message is not None:
            self._fault_reported = True
            raise RuntimeError(message)

    def _recorded_fault(self) -> Optional[str]:
        """What the host-mapped error word holds (bit 63 set: a timeout or a fault the kernels recorded), as the error
        check() raises; None while it is clear."""
        word = ctypes.c_uint64.from_address(self._error_host).value
        return self._fault_message(word) if word >> 63 else None

    def _warn_unreported_fault(self) -> None:
        """After destroy's synchronize: a fault or timeout the kernels recorded that no check() raised (e.g. a
        mismatched last combine, found on the device after the call returned) is warned about, not lost."""
        if self._fault_reported or self._error_host is None:
            return
        message = self._recorded_fault()
        if message is not None:
            self._fault_reported = True
            warnings.warn(f"ep_comm.Buffer destroyed with an error no call reported: {message}", RuntimeWarning,
                          stacklevel=3)

    def _fault_message(self, word: int) -> str:
        """What the error word (bit 63 set: stage << 48 | peer << 32 | call) says, as the error check() raises."""
        stage = (word >> 48) & 0xFF
        peer = (word >> 32) & 0xFFFF
        call = word & 0xFFFFFFFF
        if stage == _STAGE_PEER_GAVE_UP:
            return (f"ep_comm nvlink: rank {self.rank} stopped waiting because rank {peer} gave up: a call there "
                    f"raised (see the error raised on rank {peer}: e.g. inputs it rejected, or an exception that left "
                    f"its `with Buffer` block), so it will not send that call's rows. Results of the calls in flight "
                    f"and later ones are invalid and this Buffer is unusable")
        if stage == _STAGE_ROW_PAST_CAPACITY:  # a fault, not a timeout
            what = "the exchanged counts" if peer == _ERROR_NO_PEER else f"a row from rank {peer}"
            return (f"ep_comm nvlink: rank {self.rank}'s dispatch (call {call}) placed {what} outside its result "
                    f"(max_recv_rows {self.config.max_recv_rows}) or its staging slots; those rows were not written. "
                    f"Either the ranks' calls went out of step (after a timeout on a peer) or a token named one expert "
                    f"in two top-k slots with check_inputs off. Results of that call and later ones are invalid and "
                    f"this Buffer is unusable")
        if stage == _STAGE_COMBINE_MISMATCH:  # a fault, not a timeout
            return (f"ep_comm nvlink: rank {self.rank}'s combine (call {call}) got rows from rank {peer} that belong "
                    f"to another dispatch's handle (of this Buffer or another) or to the other local_reduce mode than "
                    f"this rank's combine: every rank must pass the handle of the same dispatch and the same "
                    f"local_reduce (the reference backend raises on this before combining; a MoELayer with "
                    f"combine_rows on some ranks only, e.g. an ep_comm._C without the combine-row kernel on one rank, "
                    f"also mixes the modes). That combine's output is wrong; results of later calls are invalid and "
                    f"this Buffer is unusable")
        where = (_STAGES[stage].format(what="layout" if peer == _ERROR_NO_PEER else f"rows of local expert {peer}")
                 if stage == 5 else
                 f"{_STAGES.get(stage, f'stage {stage}')} on peer rank {peer}")
        return (f"ep_comm nvlink: rank {self.rank} timed out after {self.config.timeout_s:g} s in "
                f"{where} (call {call}); results of that call "
                f"and later ones are invalid and this Buffer is unusable (did every rank make the same calls? A rank whose "
                f"call raised before launching, e.g. on an argument it rejected, leaves its peers waiting like this; "
                f"rejected expert ids are reported as such instead)")

    def _after_call(self) -> None:
        # (Not inside a CUDA-graph capture: synchronizing a capturing stream would invalidate the capture; the replays
        # are checked by the next eager call or buf.check().)
        if self._sync_check and not formats._is_capturing():
            torch.cuda.current_stream(self.torch_device).synchronize()  # the Buffer's GPU, whichever is current
            self.check()

    def _arena_recipe(self, num_tokens: int, rows_only: bool = False) -> _ArenaRecipe:
        """The arena recipe for num_tokens tokens (cached: the C++ table is fixed per token count). rows_only: the
        table of a dispatch without expansion (no payload sections; a row_index section)."""
        recipe = self._arena_recipes.get((num_tokens, rows_only))
        if recipe is not None:
            return recipe
        offs, nbytes, total = self._ctx.dispatch_arena_layout(num_tokens, rows_only)
        if total % 4 or any(o % 16 for o in offs):
            raise RuntimeError("unexpected nvlink dispatch arena layout")
        cfg = self.config
        rows, h = cfg.max_recv_rows, cfg.hidden
        if rows_only:  # the payload stays in staging (_staging_payload)
            data, scales, amax = None, None, None
        elif cfg.dispatch_format == "nvfp4":
            data = (torch.uint8, offs[2], (rows, h // 2))
            scales = (torch.float8_e4m3fn, offs[3], (rows, h // 16))
            amax = offs[4] // 4
        elif cfg.dispatch_format == "mxfp8":
            data = (torch.float8_e4m3fn, offs[2], (rows, h))
            scales = (torch.float8_e8m0fnu, offs[3], (rows, h // 32))
            amax = None
        else:
            data = (torch.bfloat16, offs[2] // 2, (rows, h))
            scales, amax = None, None
        local = cfg.num_local_experts
        int_views = ((offs[5] // 4, local), (offs[6] // 4, local + 1), (offs[7] // 4, rows), (offs[8] // 4, rows),
                     (offs[9] // 4, rows))
        recipe = _ArenaRecipe(words=total // 4, sections=tuple(zip(offs, nbytes)), data=data, scales=scales,
                              amax=amax, int_views=int_views, topk_weight=offs[10] // 4,
                              row_index=offs[15] // 4 if rows_only else None)
        self._arena_recipes[(num_tokens, rows_only)] = recipe
        return recipe

    def _staging_payload(self):
        """This rank's staging rows as the dispatch format's container, [W * T_max] rows (source rank major), viewed
        in place in the symmetric region: the payload of a dispatch without expansion. Built once per Buffer."""
        if self._staging is not None:
            return self._staging
        cfg, L = self.config, self.layout
        n = self.world * cfg.max_tokens_per_rank
        region = self.region.local_bytes()  # uint8 [region bytes] on this GPU
        stride, base = L.disp_row_bytes, L.off_staging

        def section(dtype, offset, width):
            size = dtype.itemsize
            if (base + offset) % size or stride % size:
                raise RuntimeError("unexpected nvlink staging layout")
            return region.view(dtype).as_strided((n, width), (stride // size, 1), (base + offset) // size)
        h = cfg.hidden
        if cfg.dispatch_format == "nvfp4":  # the row amax is the first word of each staging row's metadata
            payload = formats.NVFP4Tensor(data=section(torch.uint8, 0, h // 2),
                                          scales=section(torch.float8_e4m3fn, L.disp_scale_off, h // 16),
                                          amax=section(torch.float32, L.disp_meta_off, 1)[:, 0],
                                          e4m3_max=formats.NVFP4_ACTIVATION_E4M3_MAX)
        elif cfg.dispatch_format == "mxfp8":
            payload = formats.MXFP8Tensor(data=section(torch.float8_e4m3fn, 0, h),
                                          scales=section(torch.float8_e8m0fnu, L.disp_scale_off, h // 32))
        else:
            payload = section(torch.bfloat16, 0, h)
        self._staging = payload
        return payload

    @_on_buffer_device
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 expand: bool = True) -> DispatchResult:
        # expand=False: the receive writes row_index instead of copying rows, which stay in staging
        entry = self._ctx.dispatch_arena if expand else self._ctx.dispatch_arena_rows

        def launch(x, topk_idx, topk_weights, num_tokens, arena_ptr, stream):
            entry(x.data_ptr(), topk_idx.data_ptr(), topk_idx.dtype == torch.int64, topk_weights.data_ptr(), num_tokens,
                  arena_ptr, stream)
        return self._dispatch(x, topk_idx, topk_weights, launch, rows_only=not expand)

    @_on_buffer_device
    def dispatch_waves(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       wave_blocks: int, precision: str = "exact") -> WaveDispatch:
        """dispatch() whose receive, on wave_blocks blocks, also writes the GEMM operand rows expert by expert and
        counts them in the wave area (see Buffer.dispatch_waves). precision: the rows' form, grouped_gemm.PRECISIONS
        ("fp8_inexact": E4M3 values [R, H], H % 128 == 0, as expand_nvfp4_rows(precision="fp8_inexact"))."""
        from ..grouped_gemm import ExpandedRows, check_precision
        if self.config.dispatch_format != "nvfp4":
            raise ValueError(f"waves need the NVFP4 dispatch format, this buffer dispatches "
                             f"{self.config.dispatch_format!r}")
        fp8 = check_precision(precision)
        rows, h = self.config.max_recv_rows, self.config.hidden
        if fp8 and h % 128:  # the FP8 mode's K granularity (the GEMM's E4M3 steps), also what the receive assumes
            raise ValueError(f"precision='fp8_inexact' needs hidden % 128 == 0, got hidden={h}")
        if fp8 and not hasattr(_ext._C, "fp8_operand_forms"):
            raise RuntimeError("dispatch_waves(precision='fp8_inexact') needs an ep_comm._C built with the FP8 wave "
                               "receive (this one predates it): rebuild the extension")
        blocks = int(wave_blocks)
        if blocks < 1 or blocks > self.blocks["disp_recv_blocks"]:
            raise ValueError(f"wave_blocks must be in [1, {self.blocks['disp_recv_blocks']}] (the receive's block "
                             f"count), got {wave_blocks}")
        values = torch.empty(rows, h, dtype=torch.float8_e4m3fn if fp8 else torch.float16, device=x.device)
        row_factor = torch.empty(rows, dtype=torch.float32, device=x.device)

        def launch(x, topk_idx, topk_weights, num_tokens, arena_ptr, stream):
            self._ctx.dispatch_arena_waves(x.data_ptr(), topk_idx.data_ptr(), topk_idx.dtype == torch.int64,
                                           topk_weights.data_ptr(), num_tokens, arena_ptr, values.data_ptr(),
                                           row_factor.data_ptr(), self._wave_area.data_ptr(), blocks, stream,
                                           **({"fp8": True} if fp8 else {}))  # a _C built before it runs the rest
        result = self._dispatch(x, topk_idx, topk_weights, launch)
        ticket = _WaveTicket(self, _ext.current_raw_stream(self.device))
        self._wave_ticket = ticket
        epoch, abort, error_word, timeout_ns = self._wave_sync_words
        wave = WaveSync(area=self._wave_area, epoch=epoch, abort=abort, error_word=error_word, timeout_ns=timeout_ns,
                        claim=ticket.claim)
        return WaveDispatch(result=result, rows=ExpandedRows(values=values, row_factor=row_factor, precision=precision),
                            wave=wave)

    def _dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, launch,
                  rows_only: bool = False) -> DispatchResult:
        self._check_alive()
        self.check()
        self._check_rows_closed("dispatch")
        cfg = self.config
        num_tokens = x.shape[0]
        if num_tokens > cfg.max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed max_tokens_per_rank={cfg.max_tokens_per_rank}")
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
        x = _ext.aligned_contiguous(x)
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.contiguous().float()
        # One allocation per call: every output is a view of a fresh arena (_result_in_arena); the C++ side derives the
        # same addresses from the arena base.
        recipe = self._arena_recipe(num_tokens, rows_only)
        arena = torch.empty(recipe.words, dtype=torch.int32, device=x.device)
        stream = _ext.current_raw_stream(self.device)
        self._launch_call("dispatch", launch, x, topk_idx, topk_weights, num_tokens, arena.data_ptr(), stream)
        self._staging_generation += 1  # every dispatch rewrites the staging rows an expand=False result points into
        self._after_call()
        return self._result_in_arena(arena, recipe, num_tokens, stream)

    def _staging_still_valid(self, generation: int) -> bool:
        """Whether the staging rows of dispatch `generation` (a dispatch(expand=False) result's x) are still there:
        no later dispatch, no destroy()."""
        return not self._destroyed and self._staging_generation == generation

    def _result_in_arena(self, arena: torch.Tensor, recipe: _ArenaRecipe, num_tokens: int,
                         stream: int) -> DispatchResult:
        """The DispatchResult whose tensors are the sections of `arena` (int32 [recipe.words]) that the recipe names:
        one as_strided view per output, because host time per eager call is what small calls pay and each tensor
        object costs ~1 µs (bench/profile_host.py). Without expansion (recipe.row_index) the payload is the staging
        rows, and row_index says where each expert-major row is."""
        cfg = self.config
        rows = cfg.max_recv_rows
        as_f32 = arena.view(torch.float32)
        row_index = None
        if recipe.row_index is not None:
            payload = self._staging_payload()
            row_index = arena.as_strided((rows,), (1,), recipe.row_index)
        else:
            dtype, offset, shape = recipe.data
            payload = arena.view(dtype).as_strided(shape, (shape[1], 1), offset)
            if recipe.scales is not None:
                dtype, offset, shape = recipe.scales
                scales = arena.view(dtype).as_strided(shape, (shape[1], 1), offset)
                if cfg.dispatch_format == "nvfp4":
                    payload = formats.NVFP4Tensor(data=payload, scales=scales,
                                                  amax=as_f32.as_strided((rows,), (1,), recipe.amax),
                                                  e4m3_max=formats.NVFP4_ACTIVATION_E4M3_MAX)
                else:
                    payload = formats.MXFP8Tensor(data=payload, scales=scales)
        (num_per_expert, expert_offsets, src_rank, src_token, topk_slot) = [
            arena.as_strided((n,), (1,), offset) for offset, n in recipe.int_views]
        topk_weight = as_f32.as_strided((rows,), (1,), recipe.topk_weight)
        handle = NVLinkHandle(arena=arena, sections=recipe.sections, num_tokens=num_tokens, num_rows=rows,
                              num_topk=cfg.num_topk, owner=self._ctx, routing=self._routing,
                              group_ranks=self._group_global_ranks, stream=stream)
        staging_valid = None
        if row_index is not None and not formats._is_capturing():
            # (A captured result is refilled by each replay, which this count does not see: not checked.)
            staging_valid = functools.partial(self._staging_still_valid, self._staging_generation)
        return DispatchResult(x=payload, num_tokens_per_expert=num_per_expert, expert_offsets=expert_offsets,
                              src_rank=src_rank, src_token=src_token, topk_slot=topk_slot, topk_weight=topk_weight,
                              handle=handle, num_rows=rows, row_index=row_index, staging_valid=staging_valid)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in this Buffer's symmetric region (the staging rows a dispatch without expansion
        returns): memory the caching allocator does not own, so Buffer marks it for no stream."""
        base = self.region.local_base
        return base <= tensor.data_ptr() < base + self.layout.total_bytes

    def check_device(self, name: str, tensor: torch.Tensor) -> None:
        """The kernels run on the Buffer's GPU and read `tensor` there (a CPU or other-GPU tensor would be read through
        a wrong address)."""
        if tensor.device != self.torch_device:
            raise ValueError(f"the nvlink backend needs {name} on this Buffer's GPU ({self.torch_device}), got "
                             f"{tensor.device}")

    def rows_read_by_combine(self, handle: "NVLinkHandle") -> torch.Tensor:
        """int64 [n] on the GPU: the rows of the dispatch result a combine with this handle reads (Buffer's
        check_finite): recv_rows of the staging rows each source filled (j < recv_count[s]), -1 (not here) left out.
        Reads the handle's tables, so it waits for the dispatch (stream order on the current stream)."""
        world, max_tokens, topk = self.config.world_size, self.config.max_tokens_per_rank, self.config.num_topk
        rows = handle.recv_rows[:world * max_tokens * topk].view(world, max_tokens, topk).long()
        filled = torch.arange(max_tokens, device=rows.device)[None, :] < handle.recv_count[:world, None]
        rows = rows[filled[:, :, None].expand_as(rows) & (rows >= 0)]
        return torch.unique(rows)

    def check_handle(self, handle) -> None:
        """TypeError unless `handle` comes from an nvlink dispatch; ValueError if it comes from another Buffer whose
        routing sizes differ (world size, max_tokens_per_rank, num_topk, capacity, experts per rank: combine indexes
        the handle's tables with this Buffer's sizes and finds a row's rank from its expert), whose arena places the
        tables elsewhere (another dispatch format), whose group numbers its ranks otherwise (the tables name peers by
        group rank), or whose arena is on another GPU. A handle of another Buffer with the same sizes, format and group
        ranks is fine (e.g. dispatch on one Buffer, combine on another)."""
        if not isinstance(handle, NVLinkHandle):
            raise TypeError(f"combine needs the handle of an nvlink dispatch, got {type(handle).__name__}")
        if handle.owner is self._ctx:
            return
        if handle.arena.device != self.torch_device:
            raise ValueError(f"combine got the handle of a dispatch on {handle.arena.device}; this Buffer runs on "
                             f"{self.torch_device}")
        # (The sections combine reads -- 0, 1, 11..14, 16 and 17 -- sit at the same offsets in both kinds of arena.)
        if (handle.routing != self._routing or _combine_sections(handle.sections)
                != _combine_sections(self._arena_recipe(handle.num_tokens).sections)):
            raise ValueError("combine got the handle of another Buffer's dispatch whose sizes or format differ from "
                             "this Buffer's (world size, max_tokens_per_rank, num_topk, row capacity, experts per "
                             "rank, dispatch format): pass the handle to the Buffer that dispatched it")
        check_handle_group(handle.group_ranks, self._group_global_ranks)

    @functools.cached_property
    def _group_global_ranks(self) -> Tuple[int, ...]:
        """This Buffer's group's global ranks in group-rank order (NVLinkHandle.group_ranks)."""
        return group_global_ranks(self.group)

    @functools.cached_property
    def _routing(self) -> Tuple[int, ...]:
        """What a handle from another Buffer must share with this one (NVLinkHandle.routing), fixed per Buffer."""
        cfg = self.config
        return (cfg.world_size, cfg.max_tokens_per_rank, cfg.num_topk, cfg.max_recv_rows, cfg.num_local_experts)

    @_on_buffer_device
    def combine(self, expert_out: torch.Tensor, handle: NVLinkHandle, local_reduce: bool = True) -> torch.Tensor:
        self._check_alive()
        self.check()
        self._check_rows_closed("combine")
        cfg = self.config
        if expert_out.dtype != torch.bfloat16 or expert_out.dim() != 2 or expert_out.shape[1] != cfg.hidden \
                or expert_out.shape[0] < handle.num_rows:
            raise ValueError(f"expert_out must be bfloat16 [{handle.num_rows}, {cfg.hidden}], got "
                             f"{expert_out.dtype} {tuple(expert_out.shape)}")
        expert_out = _ext.aligned_contiguous(expert_out)
        out = torch.empty(handle.num_tokens, cfg.hidden, dtype=torch.bfloat16, device=expert_out.device)
        if handle.owner is self._ctx:  # this context's arena table describes the handle's arena
            self._launch_call("combine", self._ctx.combine_arena, expert_out.data_ptr(), handle.arena_ptr,
                              handle.num_tokens, bool(local_reduce), out.data_ptr(),
                              _ext.current_raw_stream(self.device))
            self._after_call()
            return out
        self._launch_call("combine", self._ctx.combine, expert_out.data_ptr(), handle.row_weight.data_ptr(),
                          bool(local_reduce), handle.recv_count.data_ptr(), handle.recv_tok.data_ptr(),
                          handle.recv_ord.data_ptr(), handle.recv_rows.data_ptr(), handle.send_idx.data_ptr(),
                          handle.send_w.data_ptr(), NVLinkHandle.dispatch_epoch.address(handle), handle.num_tokens,
                          out.data_ptr(), _ext.current_raw_stream(self.device))
        self._after_call()
        return out

    def _launch_call(self, what: str, launch, *args) -> None:
        """One call's kernels, launched by one C++ entry point (two or three launches). A launch that fails (a
        RuntimeError) may follow one of the same call that went out, leaving this rank's device call counts one apart:
        its next call would wait for a receive that never ran and time out naming this rank itself. So the Buffer gives
        up as for a call that raises before launching (the peers are told to stop waiting; every later call here
        raises), also at world 1. Argument errors (ValueError) come before any launch and leave it usable."""
        try:
            launch(*args)
        except RuntimeError as error:
            reason = f"{what}: a kernel launch failed ({error})"
            try:
                self.give_up(reason)  # (returns at world 1: nobody to tell)
            except Exception:  # noqa: BLE001 (a sticky CUDA error can fail the notice too: the launch error is raised)
                pass
            if self._gave_up is None:
                self._gave_up = reason
            raise

    def _check_rows_closed(self, what: str) -> None:
        if self._rows_handle is not None:
            raise RuntimeError(f"{what}: a combine begun with begin_combine_rows has not been finished "
                               f"(finish_combine_rows) on this Buffer; the peers wait for it until their timeout")

    @_on_buffer_device
    def begin_combine_rows(self, result: DispatchResult) -> CombineRowsTarget:
        """Wait (on the stream) until every source rank has read the previous combine from its area; return where
        a GEMM epilogue stores this combine's local_reduce=False rows (see Buffer.begin_combine_rows)."""
        self._check_alive()
        self.check()
        self._check_rows_closed("begin_combine_rows")
        handle = result.handle
        if not isinstance(handle, NVLinkHandle) or handle.owner is not self._ctx:
            # Its src_rank / src_token / topk_slot would address another buffer's rows (or past the peer table).
            raise ValueError("begin_combine_rows needs a DispatchResult of this Buffer's own dispatch")
        cfg, L = self.config, self.layout
        _, abort, _, _ = self._wave_sync_words  # (epoch, abort, error_word, timeout_ns)
        stream = _ext.current_raw_stream(self.device)
        self._ctx.combine_rows_begin(NVLinkHandle.dispatch_epoch.address(handle), stream)
        self._rows_handle = handle
        self._after_call()
        return CombineRowsTarget(bases=self._peer_bases, area_offset=L.off_combine, src_rank=result.src_rank,
                                 src_token=result.src_token, topk_slot=result.topk_slot, num_topk=cfg.num_topk,
                                 max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden, row_bytes=L.comb_row_bytes,
                                 scale_offset=L.comb_scale_off, sign_mask=cfg.rht_sign_mask, abort_flag=abort,
                                 claim=_RowsTicket(self, handle, stream).claim)

    @_on_buffer_device
    def finish_combine_rows(self, handle: NVLinkHandle) -> torch.Tensor:
        """Publish the rows the GEMM stored since begin_combine_rows, then receive: bf16 [T, H]."""
        self._check_alive()
        self.check()
        if not isinstance(handle, NVLinkHandle):
            raise TypeError(f"finish_combine_rows needs the handle of an nvlink dispatch, got {type(handle).__name__}")
        if self._rows_handle is None:
            raise RuntimeError("finish_combine_rows without begin_combine_rows: the rows could have overwritten a "
                               "combine the peers were still reading")
        if handle is not self._rows_handle:
            raise ValueError("finish_combine_rows needs the handle of the DispatchResult given to begin_combine_rows")
        out = torch.empty(handle.num_tokens, self.config.hidden, dtype=torch.bfloat16, device=handle.arena.device)
        self._ctx.combine_rows_finish(NVLinkHandle.send_idx.address(handle), NVLinkHandle.send_w.address(handle),
                                      NVLinkHandle.dispatch_epoch.address(handle), handle.num_tokens, out.data_ptr(),
                                      _ext.current_raw_stream(self.device))
        # Closed only once the receive is launched: a begin whose finish raised (allocation, launch) stays open, so it
        # can be finished again instead of leaving the combine kernels' call counts one apart.
        self._rows_handle = None
        self._after_call()
        return out

    # ------------------------------------------------------------------------------------------------------
    @_on_buffer_device
    def give_up(self, reason: str) -> None:
        """This rank's call raised before launching (`reason`): tell every peer, whose kernels for that call may
        already wait on this rank, to stop waiting now (csrc/nvlink_give_up.cu) instead of at their timeout; they
        raise at their next check, naming this rank. The ranks' calls are out of step from here on, so this Buffer
        refuses every later call too (check()). Nothing to do with one rank (the Buffer stays usable). Blocks until the notice
        is out (on its own stream, after the work enqueued on this device, this rank's calls included, on any stream),
        so that it is delivered even if the process exits on the error."""
        if self.world == 1 or self._destroyed or self._gave_up is not None:
            return
        self._gave_up = reason
        # After this rank's calls already enqueued, on any stream (a comm_stream call may still run): they are matched
        # on every rank and complete (or time out on the device), instead of being aborted on the peers by an early
        # notice. This blocks anyway; the id check has just waited for the current stream.
        torch.cuda.synchronize(self.torch_device)
        stream = torch.cuda.Stream(self.torch_device)
        self._ctx.give_up(stream.cuda_stream)
        stream.synchronize()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this nvlink backend was destroyed")
        # Any other call between a wave dispatch and its w1 GEMM makes that dispatch's WaveSync stale (a later
        # dispatch moves the epoch and the sync area on; see _WaveTicket).
        self._wave_ticket = None

    @_on_buffer_device
    def destroy(self) -> None:
        """Collective: waits for this device's work, then frees the symmetric region on every rank."""
        if self._destroyed:
            return
        torch.cuda.synchronize(self.device)
        self._warn_unreported_fault()
        dist.barrier(group=self.group)  # no peer kernel still writes into our region
        self.region.free()
        # Only now: a destroy that raised above (a sticky CUDA error, a lost peer) can be retried instead of leaving the
        # region allocated behind a Buffer that claims to be destroyed.
        self._destroyed = True
        c = _ext._C
        if self._error_host is not None and c is not None:
            c.nvlink_host_mapped_free(self._error_host)
            self._error_host = None
        self._ctx = None
        self._staging = None
        self._peer_bases = self._state = self._scratch_pos = self._scratch_slot = None
        self._expert_count = self._rank_count = self._layout_base = self._wave_area = None
