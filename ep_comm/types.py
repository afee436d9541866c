"""Configuration and result types shared by every backend.

Everything here is a frozen dataclass: configs are fixed at `Buffer` creation (static capacity is what
makes the fast path CUDA-graph capturable), results are named instead of long tuples.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._compile import eager_only

DISPATCH_FORMATS = ("nvfp4", "mxfp8", "bf16")
COMBINE_FORMATS = ("s2f6", "mxfp8", "bf16")
BACKENDS = ("auto", "reference", "nvlink")


MAX_BLOCKS = 4096  # BufferConfig.num_sms / num_local_sms bound (an H200 has 132 SMs)


def type_name(value) -> str:
    """A value's type for messages: builtins by name, others qualified (numpy.bool, not a second "bool")."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def as_int(value):
    """Integers of other types (numpy integers: numbers.Integral) as int; everything else -- bools, tensors, floats
    -- unchanged, for BufferConfig.validate to refuse with its own message."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


@dataclass(frozen=True)
class BufferConfig:
    """Static bounds and formats of one expert-parallel group (identical on every rank). Building one does not check
    it (Buffer builds it and checks it on every rank together); `validate()` raises TypeError / ValueError naming the
    first field that is wrong, and the derived sizes below refuse an unchecked config whose world_size is below 1.

    hidden: H, a multiple of 32 (NVFP4 blocks are 16 wide, S2F6/RHT and MXFP8 blocks 32).
    num_experts: global expert count E, divisible by the world size W; expert e lives on rank e // (E / W).
    num_topk: K, top-k slots per token (a slot holding -1 is masked and contributes nothing).
    max_tokens_per_rank: T_max, the most tokens any rank passes to one dispatch call.
    expert_alignment: each expert's segment of the received layout starts at a multiple of this (>= 1);
        padding rows are zero and carry src_rank = src_token = -1, weight 0.
    dispatch_format / combine_format: wire formats ("nvfp4" | "mxfp8" | "bf16", "s2f6" | "mxfp8" | "bf16"). The MXFP8
        combine (E4M3 + UE8M0 per 32, nearest rounding, no rotation) is the same 8.25 bits per value as S2F6, with
        ~3x its error on Gaussian rows (2.7% against 0.8% relative L2: 3 mantissa bits instead of S2F6's fixed point
        after the RHT) but floating point within each block: DESIGN.md names it for backward's gradient rows.
    rht_sign_mask: 32-bit sign vector of the combine RHT (bit i set -> sign -1 on element i of each chunk).
    num_sms: blocks (one per SM) of the fast backend's BF16 and MXFP8 dispatch sends (default 24; 1 .. 4096).
    num_local_sms: blocks of the fast backend's HBM-heavy local phases (dispatch receive/expansion, combine
        reduction and receive; also the NVFP4 dispatch send, whose 4/6 quantization is local compute);
        0 (default) = every SM of the device (the minimum over the ranks, so all ranks agree).
    timeout_s: how long a wait on a peer may last (default 100 s). It bounds the skew between the ranks' calls as
        well as transfers: a rank that pauses longer than this between two calls (a checkpoint or an evaluation on
        one rank only) makes its peers time out. On nvlink the call whose wait timed out returns invalid results and
        the next call (or `Buffer.check()`) raises, naming rank and stage; the Buffer is unusable after that.
    """

    hidden: int
    num_experts: int
    num_topk: int
    max_tokens_per_rank: int
    world_size: int
    dispatch_format: str = "nvfp4"
    combine_format: str = "s2f6"
    expert_alignment: int = 1
    rht_sign_mask: int = 0x6A09E667
    num_sms: int = 24
    num_local_sms: int = 0
    timeout_s: float = 100.0

    _INTEGERS = ("hidden", "num_experts", "num_topk", "max_tokens_per_rank", "world_size", "expert_alignment",
                 "rht_sign_mask", "num_sms", "num_local_sms")

    def __post_init__(self):
        # numpy integers (a config read from an array, say) become ints here, for every maker of a config; what is
        # not an integer stays for validate() to refuse.
        for name in self._INTEGERS:
            object.__setattr__(self, name, as_int(getattr(self, name)))
        # timeout_s likewise: any real number (numpy's float32 / int64 too) as a float; a bool or a non-number stays
        # for validate() to refuse.
        # (numpy's bool_ is no numbers.Real)
        if isinstance(self.timeout_s, numbers.Real) and not isinstance(self.timeout_s, bool) \
                and type(self.timeout_s) is not float:
            object.__setattr__(self, "timeout_s", float(self.timeout_s))

    @property
    def num_local_experts(self) -> int:
        """E / W, the experts each rank hosts."""
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {self.world_size!r} (BufferConfig.validate() checks every "
                            "field)")
        if self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r} (BufferConfig.validate() "
                             "checks every field)")
        return self.num_experts // self.world_size

    @property
    def max_recv_rows(self) -> int:
        """Upper bound on rows of the expert-major receive layout (padding included)."""
        per_src = self.max_tokens_per_rank * min(self.num_topk, self.num_local_experts)
        return self.world_size * per_src + self.num_local_experts * (self.expert_alignment - 1)

    def validate(self) -> None:
        """TypeError / ValueError naming the first field out of its documented range (the kernels' 32-bit limits
        included); None when the config is usable."""
        integers = self._INTEGERS
        for name in integers:  # a float or bool here would pass the range checks and fail (or misalign) later
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type_name(value)} {value!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds (int or float), got {type_name(self.timeout_s)} "
                            f"{self.timeout_s!r}")
        if not math.isfinite(self.timeout_s) or not 1e-3 <= self.timeout_s <= 1e9:
            # (The kernels count it in 64-bit nanoseconds and the gloo waits take a timedelta: both overflow far
            # beyond 1e9 s; below 1 ms every wait that is not already satisfied would time out.)
            raise ValueError(f"timeout_s must be a number of seconds in [0.001, 1e9], got {self.timeout_s!r}")
        too_big = [name for name in integers if name != "rht_sign_mask" and getattr(self, name) >= 2**31]
        if too_big:  # the kernels and the int32 result tensors (offsets, source tokens) index with 32-bit ints
            raise ValueError(f"{', '.join(too_big)} must be below 2**31")
        if self.hidden <= 0 or self.hidden % 32 != 0:
            raise ValueError(f"hidden must be a positive multiple of 32 (NVFP4 blocks are 16, S2F6/RHT blocks 32); "
                             f"got {self.hidden}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.num_experts <= 0 or self.num_experts % self.world_size != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be a positive multiple of the world size "
                             f"({self.world_size})")
        if not 1 <= self.num_topk <= self.num_experts:
            raise ValueError(f"num_topk must be in [1, num_experts]; got {self.num_topk}")
        if self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {self.max_tokens_per_rank}")
        if self.dispatch_format not in DISPATCH_FORMATS:
            raise ValueError(f"dispatch_format must be one of {DISPATCH_FORMATS}, got {self.dispatch_format!r}")
        if self.combine_format not in COMBINE_FORMATS:
            raise ValueError(f"combine_format must be one of {COMBINE_FORMATS}, got {self.combine_format!r}")
        if self.expert_alignment < 1:
            raise ValueError(f"expert_alignment must be >= 1, got {self.expert_alignment}")
        if not 0 <= self.rht_sign_mask < 2**32:
            raise ValueError("rht_sign_mask must be a 32-bit unsigned integer")
        # Upper bound: blocks of one kernel (a few per SM at most are useful); the kernels' warp counts are 32-bit.
        if not 1 <= self.num_sms <= MAX_BLOCKS:
            raise ValueError(f"num_sms must be in [1, {MAX_BLOCKS}], got {self.num_sms}")
        if not 0 <= self.num_local_sms <= MAX_BLOCKS:
            raise ValueError(f"num_local_sms must be in [0, {MAX_BLOCKS}] (0 = all SMs), got {self.num_local_sms}")
        if self.max_recv_rows >= 2**31:
            raise ValueError(f"the receive layout would hold {self.max_recv_rows} rows (world_size * "
                             f"max_tokens_per_rank * min(num_topk, local experts) plus alignment padding); it must "
                             f"stay below 2**31")

    def replace(self, **changes) -> "BufferConfig":
        """A copy with `changes` applied (dataclasses.replace; not validated, as the constructor)."""
        return dataclasses.replace(self, **changes)


def _check_row_width(fmt: str, hidden: int, block: int) -> int:
    """`hidden` as an int (numpy integers too); it must be a positive int and a multiple of the format's block width
    (a row of any other width has no byte count: its last block would be partial)."""
    if isinstance(hidden, bool) or not isinstance(hidden, numbers.Integral) or hidden <= 0 or hidden % block:
        raise ValueError(f"hidden must be a positive int multiple of {block} for {fmt!r}, got {hidden!r}")
    return int(hidden)


def dispatch_bytes_per_token(fmt: str, hidden: int) -> int:
    """Wire bytes of one token sent to one destination rank (payload only). fmt: "nvfp4" (hidden a multiple of 16),
    "mxfp8" (of 32) or "bf16"; ValueError otherwise."""
    if fmt == "nvfp4":
        hidden = _check_row_width(fmt, hidden, 16)
        return hidden // 2 + hidden // 16 + 4      # E2M1 codes + E4M3 scale per 16 + FP32 per-token amax
    if fmt == "mxfp8":
        hidden = _check_row_width(fmt, hidden, 32)
        return hidden + hidden // 32               # E4M3 codes + UE8M0 scale per 32
    if fmt == "bf16":
        hidden = _check_row_width(fmt, hidden, 1)
        return 2 * hidden
    raise ValueError(f"unknown dispatch format {fmt!r}")


def combine_bytes_per_token(fmt: str, hidden: int) -> int:
    """Wire bytes of one combined row sent back to its source rank. fmt: "s2f6" or "mxfp8" (hidden a multiple of 32)
    or "bf16"; ValueError otherwise."""
    if fmt in ("s2f6", "mxfp8"):
        hidden = _check_row_width(fmt, hidden, 32)
        return hidden + hidden // 32               # int8 / E4M3 codes + UE8M0 scale per 32
    if fmt == "bf16":
        hidden = _check_row_width(fmt, hidden, 1)
        return 2 * hidden
    raise ValueError(f"unknown combine format {fmt!r}")


def s2f6_combine_row_layout(hidden: int) -> tuple:
    """(scale_offset, row_bytes) of one S2F6 (or MXFP8) combine row in the nvlink combine area: `hidden` int8 (E4M3)
    codes, then the hidden / 32 UE8M0 scales, each part padded to 16 bytes (16-byte stores)."""
    scale_offset = (hidden + 15) // 16 * 16
    return scale_offset, scale_offset + (hidden // 32 + 15) // 16 * 16


@dataclass(frozen=True)
class BufferSizes:
    """Bytes a fast backend needs for a given `BufferConfig` (from `Buffer.get_buffer_size_hint`).

    dispatch_recv_bytes: symmetric receive area for dispatch payload + metadata (per rank).
    combine_recv_bytes: symmetric receive area for combine rows (per rank).
    layout_bytes: nvlink: the symmetric counts, flags and offsets before the staging area, plus local scratch and the
        per-call handle arrays; reference: 0.
    expert_layout_bytes: local (non-symmetric) expert-major output tensors of ONE dispatch call. Every nvlink dispatch
        allocates its full capacity (max_recv_rows rows), whatever the call's token count; a result kept alive
        keeps its allocation. dispatch_waves also allocates the GEMM's operand rows (2 * hidden bytes per row in fp16,
        hidden bytes in the FP8 mode's E4M3; max_recv_rows rows), not counted here.
    total_symmetric_bytes: what each rank allocates in symmetric memory: the two receive areas, the counts and
        flags, the NVFP4 wave index (4 * world * local experts * max_tokens_per_rank bytes) and rounding, so more
        than dispatch_recv_bytes + combine_recv_bytes (expert_layout_bytes and the local part of layout_bytes are
        not symmetric memory, so the sum of all four fields can exceed it).
    """

    dispatch_recv_bytes: int
    combine_recv_bytes: int
    layout_bytes: int
    expert_layout_bytes: int
    total_symmetric_bytes: int


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class DispatchResult:
    """What `Buffer.dispatch` returns on the expert rank.

    x: received tokens in expert-major layout, R rows (all rows of local expert 0, then 1, ...; each
       segment starts at a multiple of `expert_alignment`; padding rows are zero). Type by format:
       NVFP4Tensor (data uint8 [R, H/2], scales float8_e4m3fn [R, H/16], amax float32 [R]),
       MXFP8Tensor (data float8_e4m3fn [R, H], scales float8_e8m0fnu [R, H/32]), or bf16 tensor [R, H].
    num_tokens_per_expert: int32 [E_local] on the device, rows per local expert (padding excluded).
    expert_offsets: int32 [E_local + 1]; segment j is rows [expert_offsets[j], expert_offsets[j] +
       num_tokens_per_expert[j]); expert_offsets[E_local] = R_valid, the rows in use (padding included).
    src_rank, src_token: int32 [R]: where each row came from (-1 on padding and unused rows).
    topk_slot: int32 [R]: which top-k slot of the source token chose this expert (-1 on padding).
    topk_weight: float32 [R]: that slot's routing weight (0 on padding). The handle keeps its own copy for combine:
        editing this tensor does not change what combine computes.
    handle: opaque object `combine` needs (backend-specific).
    num_rows: R, the row count of the returned tensors. The reference backend returns exactly the rows in
       use; the nvlink backend returns its fixed capacity (rows past expert_offsets[-1] are unused).
    row_index: None, except for `Buffer.dispatch(..., expand=False)`: then `x` holds the received rows in another
       order (nvlink: the Buffer's staging rows, [W * max_tokens_per_rank] rows in source-rank order, valid until
       this Buffer's next dispatch or its destroy(); reference: the expert-major rows themselves) and row_index int32 [R] names, for
       each expert-major row i, the row of x that holds it (-1 on padding and unused rows). `expert_major_x()`
       gathers them.
    staging_valid: None, or (nvlink, expand=False, outside a CUDA-graph capture) a callable saying whether x's
       staging rows are still this dispatch's (no later dispatch, no destroy()): `expert_major_x()` raises once they
       are not. Reads of `x` itself, and results of a captured dispatch (refilled by each replay), are not checked;
       nor is the replay of a graph holding a dispatch of this Buffer: it reuses the staging too, but the count behind
       this check only sees dispatches called from Python (an eager result read after such a replay holds the
       replay's rows, without an error).

    Rows inside one expert segment are in canonical order: by source rank, then source token index.
    """

    x: Any
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    topk_slot: torch.Tensor
    topk_weight: torch.Tensor
    handle: Any
    num_rows: int
    row_index: Optional[torch.Tensor] = None
    staging_valid: Optional[Callable[[], bool]] = dataclasses.field(default=None, repr=False, compare=False)

    @eager_only
    def expert_major_x(self):
        """x in the expert-major layout, [R_valid] rows (expert_offsets[-1]; padding rows zero): x itself for an
        expanded dispatch (its first R_valid rows), else x's rows gathered by row_index (a device->host read of
        R_valid; not for CUDA-graph capture). `combine` takes expert outputs of num_rows rows (on nvlink the
        capacity, more than R_valid): pad an output computed from these rows to num_rows."""
        if self.staging_valid is not None and not self.staging_valid():
            raise RuntimeError("this dispatch(expand=False) result's rows are gone: they live in the Buffer's staging "
                               "area, which the Buffer's next dispatch (or destroy()) reuses; gather them before")
        valid = int(self.expert_offsets[-1])
        if self.row_index is None:
            return _map_payload(self.x, lambda t: t[:valid])
        index = self.row_index[:valid].long()
        absent, present_rows = index < 0, index.clamp(min=0)
        return _map_payload(self.x, lambda t: t[present_rows].masked_fill(absent.view(-1, *[1] * (t.dim() - 1)), 0))


def _map_payload(x, fn):
    """fn applied to each tensor of a payload: the tensor itself, or every tensor field of a format container (other
    fields kept). float8 tensors go through as their bytes (indexing and masked_fill lack float8 kernels)."""
    def apply(t):
        return fn(t.view(torch.uint8)).view(t.dtype) if t.element_size() == 1 else fn(t)
    if isinstance(x, torch.Tensor):
        return apply(x)
    return dataclasses.replace(x, **{f.name: apply(getattr(x, f.name)) for f in dataclasses.fields(x)
                                     if isinstance(getattr(x, f.name), torch.Tensor)})


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class CombineRowsTarget:
    """Where a grouped GEMM's combine-row epilogue stores expert outputs (`Buffer.begin_combine_rows`).

    Each valid row r of the dispatch layout is stored as one RHT-32 + S2F6 combine row (the local_reduce=False
    form of DESIGN.md §3) at address bases[src_rank[r]] + area_offset + (src_token[r] * num_topk + topk_slot[r])
    * row_bytes: `hidden` code bytes (int8), then the UE8M0 scale of 32-chunk c at byte scale_offset + c. For
    another rank that address is an NVLink peer address, so the epilogue writes straight into the source rank.

    bases: int64 [W] on the device, each rank's symmetric region as this GPU addresses it; each 16-byte aligned (the
        epilogue stores 16 bytes at a time; the host cannot check device values without a sync, and a misaligned
        base is a CUDA fault that ends the process's context). area_offset and row_bytes: multiples of 16 (checked).
    src_rank, src_token, topk_slot: int32 [R], the DispatchResult's (rows past expert_offsets[-1] unused). A row
        whose (src_rank, src_token, topk_slot) lies outside [0, W) x [0, max_tokens) x [0, num_topk) -- the -1s of
        padding rows, when counts include a segment's padding -- is not stored.
    max_tokens: tokens per rank's combine area (its rows: max_tokens * num_topk; the Buffer's max_tokens_per_rank).
    sign_mask: the RHT sign vector (BufferConfig.rht_sign_mask).
    abort_flag: device address of the Buffer's uint32 abort flag, or 0 for none. Once the flag is set (a wait timed
        out, a fault, or a peer gave up) the epilogue stores nothing, so that the peers time out too instead of
        reading rows they did not wait for.
    claim: called by grouped_gemm_nvfp4_combine_rows before each launch; raises unless the target's
        begin_combine_rows is still open (not finished, not followed by another begin, the Buffer not destroyed) and
        the launch is on the begin's stream. None (a target made by hand): no such check.
    """

    bases: torch.Tensor
    area_offset: int
    src_rank: torch.Tensor
    src_token: torch.Tensor
    topk_slot: torch.Tensor
    num_topk: int
    max_tokens: int
    hidden: int
    row_bytes: int
    scale_offset: int
    sign_mask: int
    abort_flag: int = 0
    claim: Any = None


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class WaveSync:
    """The device-side hand-over from a wave dispatch's receive to the w1 grouped GEMM (csrc/waves.h).

    Made by `Buffer.dispatch_waves`; pass it to `grouped_gemm.grouped_gemm_nvfp4(..., wave=...)` as the very next
    kernel on the same stream (that launch runs behind the receive, on the SMs the receive leaves free, and starts
    each expert's tiles once the expert's rows are in).
    area: int64 [2 + E_local] on the device: layout-ready word, work counter, rows received per local expert
        (tagged with the call; never reset, so no memset per call).
    epoch, abort, error_word: device addresses of the Buffer's dispatch call counter, abort flag and host-mapped
        error word (a GEMM that waits longer than timeout_ns for its rows records it there; the Buffer's next call
        raises, naming the stage).
    claim: called by the GEMM launcher just before the launch; raises if this WaveSync is stale (already used,
        another call on the Buffer since its dispatch, another stream, a destroyed Buffer). None: no such check.
    """

    area: torch.Tensor
    epoch: int
    abort: int
    error_word: int
    timeout_ns: int
    claim: Any = None


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class WaveDispatch:
    """What `Buffer.dispatch_waves` returns.

    result: the DispatchResult, the same as `Buffer.dispatch` gives (NVFP4 tokens, layout, handle).
    rows: `grouped_gemm.ExpandedRows` of result.x (values fp16 [R, H], row_factor fp32 [R]; with
        precision="fp8_inexact" values float8_e4m3fn [R, H] and rows.precision "fp8_inexact"), written by the
        receive: bitwise `grouped_gemm.expand_nvfp4_rows(result.x, precision=rows.precision)` on every row below
        expert_offsets[-1] that belongs to an expert (padding rows and rows past the prefix are unwritten; the GEMM
        never reads them).
    wave: the WaveSync for the w1 GEMM launched next.
    """

    result: DispatchResult
    rows: Any
    wave: WaveSync
