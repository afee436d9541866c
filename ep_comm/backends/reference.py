"""The reference backend: dispatch/combine with `torch.distributed.all_to_all_single`.

It is the executable spec (DESIGN.md §2-3) and the oracle of the GPU tests; it runs on gloo (CPU tensors)
and NCCL (CUDA tensors), and is the engine beyond one NVLink domain. Quantization goes through
`ep_comm.formats` (the CUDA kernels for CUDA tensors when available, bit-identical to the torch
reference; `format_impl="reference"` forces plain torch). It synchronizes with the host (split sizes are
host lists), so it is not CUDA-graph capturable — that is the nvlink backend's job.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _ext, formats
from .buffer_tag import DISPATCH_COUNT_BITS, agree_buffer_tag
from .transport import check_handle_group, describe, device_backends, group_global_ranks
from ..types import BufferConfig, BufferSizes, DispatchResult, combine_bytes_per_token, dispatch_bytes_per_token


# ----------------------------------------------------------------------------------------------------------
# Wire packing: every format travels as uint8 rows (fp8/fp4 dtypes are not supported by every collective)
# ----------------------------------------------------------------------------------------------------------
def _mxfp8_wire_rows(x: torch.Tensor, impl: str) -> torch.Tensor:
    """bf16 / fp32 rows [N, H] -> MXFP8 (nearest) wire rows uint8 [N, H + H/32]: E4M3 codes | UE8M0 scales."""
    m = formats.mxfp8_quantize(x, rounding="nearest", impl=impl)
    return torch.cat([m.data.view(torch.uint8), m.scales.view(torch.uint8)], dim=1)


def _mxfp8_from_wire(rows: torch.Tensor, hidden: int) -> formats.MXFP8Tensor:
    """uint8 wire rows [N, H + H/32] (_mxfp8_wire_rows) -> MXFP8Tensor."""
    return formats.MXFP8Tensor(data=rows[:, :hidden].contiguous().view(torch.float8_e4m3fn),
                               scales=rows[:, hidden:].contiguous().view(torch.float8_e8m0fnu))


def pack_dispatch_payload(x: torch.Tensor, fmt: str, impl: str) -> torch.Tensor:
    """bf16 tokens [T, H] -> uint8 wire rows [T, dispatch_bytes_per_token]: NVFP4 = codes | scales | amax."""
    if fmt == "nvfp4":
        q = formats.nvfp4_quantize(x, four_over_six=True, impl=impl)
        parts = [q.data, q.scales.view(torch.uint8), q.amax.reshape(-1, 1).view(torch.uint8)]
    elif fmt == "mxfp8":
        return _mxfp8_wire_rows(x, impl)
    else:
        # (An empty tensor counts as contiguous whatever its strides, and view() refuses a stride-0 last dimension --
        # e.g. the gradient of a sum over zero tokens, expand()ed: give it fresh storage.)
        rows = x.contiguous() if x.numel() else x.new_empty(x.shape)
        parts = [rows.view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_dispatch_payload(rows: torch.Tensor, fmt: str, hidden: int):
    """uint8 wire rows [R, P] -> NVFP4Tensor / MXFP8Tensor / bf16 [R, H]."""
    if fmt == "nvfp4":
        data_end, scale_end = hidden // 2, hidden // 2 + hidden // 16
        # The amax bytes as float32 need a 4-byte aligned storage offset: a copy, not contiguous(). With 0 or 1 rows
        # the slice already counts as contiguous and kept its offset 9H/16 (not a multiple of 4 for H = 32, 96, 160,
        # ...), which view() refused.
        amax_bytes = rows[:, scale_end:scale_end + 4].clone(memory_format=torch.contiguous_format)
        return formats.NVFP4Tensor(
            data=rows[:, :data_end].contiguous(),
            scales=rows[:, data_end:scale_end].contiguous().view(torch.float8_e4m3fn),
            amax=amax_bytes.view(torch.float32).reshape(-1),
            e4m3_max=formats.NVFP4_ACTIVATION_E4M3_MAX)
    if fmt == "mxfp8":
        return _mxfp8_from_wire(rows, hidden)
    return rows.contiguous().view(torch.bfloat16)


def pack_combine_rows(values: torch.Tensor, fmt: str, sign_mask: int, impl: str) -> torch.Tensor:
    """fp32 rows [N, H] -> uint8 wire rows: S2F6 after RHT or MXFP8 (nearest), [N, H + H/32] (codes | UE8M0 scales),
    or bf16, [N, 2H]."""
    if fmt == "s2f6":
        s = formats.s2f6_quantize(values, hadamard=True, sign_mask=sign_mask, impl=impl)
        return torch.cat([s.data.view(torch.uint8), s.scales.view(torch.uint8)], dim=1)
    if fmt == "mxfp8":
        return _mxfp8_wire_rows(values, impl)
    return values.to(torch.bfloat16).view(torch.uint8)


def accumulate_combine_rows(rows: torch.Tensor, fmt: str, hidden: int, row_index: torch.Tensor, weights,
                            sign_mask: int, impl: str) -> torch.Tensor:
    """Receive side: out[t] = bf16(invRHT(sum_j w[t, j] * deq(rows[row_index[t, j]]))) in ascending j (no inverse
    RHT for MXFP8 and bf16)."""
    if fmt == "s2f6":
        s = formats.S2F6Tensor(data=rows[:, :hidden].contiguous().view(torch.int8),
                               scales=rows[:, hidden:].contiguous().view(torch.float8_e8m0fnu),
                               hadamard=True, sign_mask=sign_mask)
        return formats.s2f6_dequantize_accumulate(s, row_index, weights, out_dtype=torch.bfloat16, impl=impl)
    if fmt == "mxfp8":
        values = formats.mxfp8_dequantize(_mxfp8_from_wire(rows, hidden), dtype=torch.float32, impl=impl)
    else:
        values = rows.contiguous().view(torch.bfloat16).float()
    return formats._accumulate_rows(values, row_index, weights, sign_mask=None).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Handle
def _routing_sizes(config: BufferConfig) -> tuple:
    """What a handle's rows and counts depend on: Buffers equal in these can combine each other's handles."""
    return (config.world_size, config.num_experts, config.num_topk, config.hidden, config.expert_alignment,
            config.max_tokens_per_rank)


# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class ReferenceHandle:
    """What combine needs to route rows back (all on the tokens' device).

    send_counts / recv_counts: host lists [W], rows this rank sent to / received from each rank in dispatch.
    send_rows: int64 [sum(send_counts)], the local token index of each sent row (grouped by destination).
    recv_src_rank / recv_src_token: int64 [N], origin of each received token row.
    recv_topk_weight: float32 [N, K]; layout_row: int64 [N, K], the expert-major row of slot k of received
        row r, or -1 when that slot is masked or lives on another rank.
    topk_idx / topk_weights: this rank's own routing [T, K] (for the local_reduce=False path).
    num_tokens: T; num_rows: rows of the expert-major layout. config: the dispatching Buffer's configuration.
    dispatch_id: which dispatch of which Buffer made it (ReferenceBackend.next_dispatch_id): the Buffer's tag, the
        same on every rank, times 2^40 plus the Buffer's dispatch count (dispatches are collective, and the ranks agree
        on the id before each one, so every rank counts alike). combine compares it across the ranks, so that handles
        of two different dispatches raise, even with equal row counts or from two same-size Buffers with equal call
        counts.
    """

    send_counts: List[int]
    recv_counts: List[int]
    send_rows: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    recv_topk_weight: torch.Tensor
    layout_row: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int
    num_rows: int
    config: Optional[BufferConfig] = None  # of the Buffer that dispatched (combine refuses another configuration's)
    group_ranks: Tuple[int, ...] = ()  # its group's global ranks in group-rank order (combine refuses another order)
    dispatch_id: int = -1
    stream: int = 0  # the raw CUDA stream the dispatch ran on (0 on the CPU): see NVLinkHandle.stream


class ReferenceBackend:
    """Dispatch/combine over `all_to_all_single` on any process group (gloo or NCCL)."""

    name = "reference"

    def __init__(self, group, config: BufferConfig, format_impl: str = "auto"):
        # ReferenceHandle.dispatch_id: the Buffer's tag (collective: agreed at creation) and its dispatch count.
        self._tag_base = agree_buffer_tag(group) << DISPATCH_COUNT_BITS
        self._dispatch_count = 0
        self.group = group
        self._group_ranks = group_global_ranks(group)  # (ReferenceHandle.group_ranks: check_handle_group)
        self.config = config
        self.rank = dist.get_rank(group)
        self.format_impl = format_impl
        # Collectives on CPU tensors over gloo wait at most timeout_s (then a RuntimeError names rank and stage);
        # NCCL ones keep the process group's own timeout (their host call returns before the transfer ends).
        backends = device_backends(group)
        self._transport = describe(group)
        self._cpu_gloo = backends.get("cpu") == "gloo"
        self._cuda_nccl = backends.get("cuda") == "nccl"
        if format_impl == "cuda" and not self._cuda_nccl:
            # (every rank takes the same branch: the arguments were compared across ranks, and the group is shared)
            raise ValueError("format_impl='cuda' needs CUDA tensors, i.e. an NCCL group; this group is "
                             f"{self._transport!r} (CPU tensors): use format_impl='auto' or 'reference'")
        if format_impl == "cuda":
            # The kernels must run on every rank, checked now: else each call would fail after its first collective,
            # and a rank without them would leave the others waiting in the next one.
            problem = formats._cuda_kernels_problem(torch.device("cuda", torch.cuda.current_device()))
            problems = [None] * dist.get_world_size(group)
            dist.all_gather_object(problems, problem, group=group)
            failing = [(rank, why) for rank, why in enumerate(problems) if why]
            if failing:
                raise RuntimeError(f"format_impl='cuda': the CUDA format kernels cannot run on rank {failing[0][0]} "
                                   f"({failing[0][1]}); use format_impl='auto' or 'reference'")

    @staticmethod
    def is_available(group):
        return True, ""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Every result of this backend is a fresh allocation: nothing lies in Buffer-owned memory."""
        return False

    def check_device(self, name: str, tensor: torch.Tensor) -> None:
        """ValueError unless `tensor` can go through this group's collectives: CPU tensors over gloo, tensors on the
        current CUDA device over NCCL (another device would fail on this rank only, leaving the others waiting).
        Groups of other transports are not checked."""
        allowed = []
        if self._cpu_gloo:
            allowed.append(torch.device("cpu"))
        if self._cuda_nccl and torch.cuda.is_available():
            allowed.append(torch.device("cuda", torch.cuda.current_device()))
        if allowed and tensor.device not in allowed:
            raise ValueError(f"the reference backend over {self._transport} needs {name} on "
                             f"{' or '.join(str(d) for d in allowed)}, got {tensor.device}")

    @staticmethod
    def size_hint(config: BufferConfig) -> BufferSizes:
        """The reference backend allocates per call; it reports what the same call moves, for comparison."""
        dispatch = config.world_size * config.max_tokens_per_rank * dispatch_bytes_per_token(
            config.dispatch_format, config.hidden)
        # A local_reduce combine receives one row per (token, rank the token went to: at most min(W, K)), a
        # local_reduce=False combine one per (token, expert): at most K rows per token either way, as the nvlink hint.
        combine = config.num_topk * config.max_tokens_per_rank * combine_bytes_per_token(
            config.combine_format, config.hidden)
        layout_rows = config.max_recv_rows
        expert_layout = layout_rows * (dispatch_bytes_per_token(config.dispatch_format, config.hidden) + 16)
        return BufferSizes(dispatch_recv_bytes=dispatch, combine_recv_bytes=combine, layout_bytes=0,
                           expert_layout_bytes=expert_layout, total_symmetric_bytes=0)

    def destroy(self) -> None:
        pass

    # ------------------------------------------------------------------------------------------------------
    def _collective(self, stage: str, op, *args, **kwargs) -> None:
        """Runs the torch.distributed collective `op` on this backend's group. Over gloo it waits at most timeout_s:
        a peer that does not make the same call raises here, naming this rank and the stage, instead of waiting for
        the process group's timeout (30 minutes by default)."""
        tensor = next(a for a in args if isinstance(a, torch.Tensor))
        if not (self._cpu_gloo and tensor.device.type == "cpu"):
            op(*args, group=self.group, **kwargs)
            return
        work = op(*args, group=self.group, async_op=True, **kwargs)
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.config.timeout_s))
        except RuntimeError as error:
            waited = time.monotonic() - start
            if waited >= self.config.timeout_s:
                why = (f"waited more than timeout_s={self.config.timeout_s} s in {stage}: a peer did not make the same "
                       f"call (or is slower than that)")
            elif "timed out" in str(error).lower():  # the process group's own timeout, shorter than timeout_s
                why = (f"waited {waited:.1f} s in {stage}, the process group's own timeout (below timeout_s="
                       f"{self.config.timeout_s} s): a peer did not make the same call (or is slower than that)")
            else:  # the transport failed first, e.g. a peer process exited
                why = f"lost a peer after {waited:.1f} s in {stage} (a peer failed or exited)"
            raise RuntimeError(f"ep_comm reference backend: rank {self.rank} {why}; the process group may be "
                               f"unusable now ({error})") from error

    def _all_to_all(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int], stage: str) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        self._collective(stage, dist.all_to_all_single, recv, send.contiguous(), output_split_sizes=recv_counts,
                         input_split_sizes=send_counts)
        return recv

    def _exchange_counts(self, send_counts: List[int], device) -> List[int]:
        world = self.config.world_size
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty(world, dtype=torch.int64, device=device)
        self._collective("dispatch (token counts)", dist.all_to_all_single, recv, send)
        return [int(v) for v in recv.tolist()]

    def next_dispatch_id(self) -> int:
        """The ReferenceHandle.dispatch_id of this Buffer's next dispatch."""
        return self._tag_base + self._dispatch_count

    def call_id(self, what: str) -> int:
        """What the ranks of a `what` call ("dispatch", "combine") must agree on in raise_together: a dispatch, the
        id of the dispatch it is about to make (so that ranks calling two same-size Buffers' dispatches in different
        orders, whose exchanges would pair one Buffer's rows with the other's, raise instead); other calls, the
        Buffer's tag."""
        return self.next_dispatch_id() if what == "dispatch" else self._tag_base

    def raise_together(self, error: Optional[Exception], others_message: str, call_id: int = 0,
                       device_type: Optional[str] = None, what: str = "") -> None:
        """Collective: every rank learns which ranks failed a check, which call each makes (`what`, e.g. "dispatch"
        or "combine", and `call_id`) and on which device type its tensors are (`device_type`: "cpu", "cuda", or None
        when unknown; one small all_reduce), and all of them raise -- the failing ranks their own `error`, the others
        ValueError(others_message.format(ranks=[...])), and when the calls, the call ids or the device types differ
        every rank a ValueError naming them -- instead of the others waiting in the next exchange until the process
        group's timeout (or gloo aborting on mismatched split sizes), two different calls exchanging each other's rows,
        or, on a group with both gloo and NCCL, one rank's CPU tensors going over gloo while its peers' CUDA tensors
        wait over NCCL. (`what` is compared besides the id: a Buffer's first dispatch has the id that its combines
        have, the Buffer's tag, so a combine on one rank against that dispatch on another passed the agreement and
        then waited out the timeout in two different exchanges.)"""
        # On a device the group serves: the CPU where gloo is there, else the current GPU (an NCCL-only group).
        device = torch.device("cpu") if self._cpu_gloo or not self._cuda_nccl else torch.device(
            "cuda", torch.cuda.current_device())
        kinds = (None, "cpu", "cuda", "other")  # device type codes (0: unknown, compared with nothing)
        # [rank] = (failed, call id, device type code, call kind: a checksum of `what`, the same on every rank)
        table = torch.zeros(self.config.world_size, 4, dtype=torch.int64, device=device)
        table[self.rank, 0] = int(error is not None)
        table[self.rank, 1] = call_id
        table[self.rank, 2] = kinds.index(device_type if device_type in kinds else "other")
        table[self.rank, 3] = zlib.crc32(what.encode())
        self._collective("the input check's agreement", dist.all_reduce, table)
        if error is not None:
            raise error
        rows = table.tolist()
        ranks = [r for r, (bad, _, _, _) in enumerate(rows) if bad]
        if ranks:
            raise ValueError(others_message.format(ranks=ranks))
        if any(row[3] != rows[0][3] for row in rows):
            names = {zlib.crc32(name.encode()): name for name in ("dispatch", "combine", "MoELayer forward", what)}
            calls = ", ".join(f"rank {r}: {names.get(row[3], 'another call')}" for r, row in enumerate(rows))
            raise ValueError(f"the ranks made different calls on this Buffer ({calls}): every rank must call the same "
                             f"Buffers' dispatch and combine in the same order; this call is abandoned on every rank")
        if len({kind for _, _, kind, _ in rows if kind != 0}) > 1:
            types = ", ".join(f"rank {r}: {kinds[kind]}" for r, (_, _, kind, _) in enumerate(rows))
            raise ValueError(f"the ranks passed this call's tensors on different device types ({types}): every rank "
                             f"must use the same (over a group with both gloo and NCCL, CPU tensors go over gloo and "
                             f"CUDA tensors over NCCL, and the two never meet); this call is abandoned on every rank")
        if any(call != rows[0][1] for _, call, _, _ in rows):
            calls = ", ".join(f"rank {r}: Buffer tag {call >> DISPATCH_COUNT_BITS}, dispatch "
                              f"{call & ((1 << DISPATCH_COUNT_BITS) - 1)}" for r, (_, call, _, _) in enumerate(rows))
            raise ValueError(f"the ranks made this call on different Buffers or out of step ({calls}): every rank must "
                             "call the same Buffers in the same order; this call is abandoned on every rank")

    def _agree_on_combine(self, send_counts: List[int], expected_counts: List[int], local_reduce: bool,
                          dispatch_id: int, device) -> None:
        """Before the combine's all_to_all: the ranks share, in one all_gather, how many rows each sends to each peer,
        in which mode, how many each expects, and which dispatch's handle each combines; all ranks raise together
        when any pair disagrees (a different local_reduce, or a handle from another dispatch) -- a receiving rank
        that sees a mismatch with the details, the others naming those ranks."""
        world = self.config.world_size
        mine = torch.tensor([[send_counts[d], int(local_reduce), expected_counts[d], dispatch_id]
                             for d in range(world)], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        self._collective("combine (row counts)", dist.all_gather, gathered, mine)
        # [source s][peer d] = (rows s sends d, s's mode, rows s expects from d, the dispatch of s's handle)
        table = torch.stack(gathered).tolist()
        # (s, d): what s sends d disagrees with what d expects from s (row count, mode or dispatch).
        mismatched = [(s, d) for s in range(world) for d in range(world)
                      if table[s][d][0] != table[d][s][2] or table[s][d][1] != table[d][s][1]
                      or table[s][d][3] != table[d][s][3]]
        receivers_seeing_mismatch = sorted({d for _, d in mismatched})
        foreign = " from the handle of another dispatch or Buffer"
        problems = [f"rank {s} sends {table[s][self.rank][0]} rows with local_reduce={bool(table[s][self.rank][1])}"
                    f"{'' if table[s][self.rank][3] == dispatch_id else foreign}, "
                    f"this rank expects {expected_counts[s]} with local_reduce={local_reduce}"
                    for s, d in mismatched if d == self.rank]
        if problems:
            raise ValueError("combine arguments or handles differ between ranks: " + "; ".join(problems))
        if receivers_seeing_mismatch:
            raise ValueError(f"combine arguments or handles differ between ranks (rank(s) {receivers_seeing_mismatch} "
                             f"saw the mismatch; their errors say how)")

    @formats._keeps_subnormals
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 expand: bool = True) -> DispatchResult:
        """expand=False: the same result plus row_index (arange over the rows in use: x is already expert-major),
        the meaning Buffer.dispatch gives it."""
        cfg = self.config
        device = x.device
        world, num_local = cfg.world_size, cfg.num_local_experts
        num_tokens, num_topk = topk_idx.shape
        # Drawn first: a dispatch that raises on one rank after its collectives (an allocation failing) still counts
        # there, so the ranks' counts -- compared by combine -- stay in step if the caller goes on.
        dispatch_id = self.next_dispatch_id()
        self._dispatch_count += 1
        # Ids outside [0, E) are masked slots, as on the nvlink backend (Buffer rejects them when it checks inputs).
        topk_idx = topk_idx.to(torch.int64)
        topk_idx = torch.where((topk_idx >= 0) & (topk_idx < cfg.num_experts), topk_idx, torch.full_like(topk_idx, -1))
        # A copy even when already float32: the handle keeps these weights for combine(local_reduce=False), which must
        # use the dispatch's values even if the caller reuses its weights buffer in between (as the nvlink backend,
        # whose layout kernel copies them).
        topk_weights = topk_weights.to(torch.float32, copy=True)

        # Which ranks each token goes to: once per destination rank, however many of its experts it chose.
        slot_rank = torch.where(topk_idx >= 0, topk_idx // num_local, torch.full_like(topk_idx, -1))
        goes_to = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=device)
        goes_to.scatter_(1, torch.where(slot_rank >= 0, slot_rank, torch.full_like(slot_rank, world)), True)
        goes_to = goes_to[:, :world]
        send_rows = torch.cat([torch.nonzero(goes_to[:, d]).reshape(-1) for d in range(world)]) if world else None
        send_counts = [int(v) for v in goes_to.sum(dim=0).tolist()]
        recv_counts = self._exchange_counts(send_counts, device)

        payload = pack_dispatch_payload(x, cfg.dispatch_format, self.format_impl)
        # Metadata per sent row: token index, the K expert ids, the K weights (fp32 bits as int64).
        weight_bits = topk_weights.contiguous().view(torch.int32).to(torch.int64)
        token_index = torch.arange(num_tokens, dtype=torch.int64, device=device)[:, None]
        metadata = torch.cat([token_index, topk_idx, weight_bits], dim=1)
        recv_payload = self._all_to_all(payload[send_rows], send_counts, recv_counts, "dispatch (rows)")
        recv_meta = self._all_to_all(metadata[send_rows], send_counts, recv_counts, "dispatch (row metadata)")

        num_recv = recv_payload.shape[0]
        recv_src_rank = torch.repeat_interleave(torch.arange(world, device=device),
                                                torch.tensor(recv_counts, device=device), output_size=num_recv)
        recv_src_token = recv_meta[:, 0]
        recv_topk = recv_meta[:, 1:1 + num_topk]
        recv_weight = recv_meta[:, 1 + num_topk:].to(torch.int32).view(torch.float32)

        # Expert-major layout. Received rows are ordered by source rank, then source token (each source
        # sends in token order), so a stable sort by local expert gives the canonical order in each segment.
        first_expert = self.rank * num_local
        is_local = (recv_topk >= first_expert) & (recv_topk < first_expert + num_local)
        entry_row, entry_slot = torch.nonzero(is_local, as_tuple=True)
        entry_expert = recv_topk[entry_row, entry_slot] - first_expert
        order = torch.sort(entry_expert, stable=True).indices
        entry_row, entry_slot, entry_expert = entry_row[order], entry_slot[order], entry_expert[order]
        num_tokens_per_expert = torch.bincount(entry_expert, minlength=num_local)
        align = cfg.expert_alignment
        segment_sizes = (num_tokens_per_expert + align - 1) // align * align
        expert_offsets = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
        expert_offsets[1:] = torch.cumsum(segment_sizes, dim=0)
        num_rows = int(expert_offsets[-1])
        segment_start = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
        segment_start[1:] = torch.cumsum(num_tokens_per_expert, dim=0)
        rank_in_segment = torch.arange(entry_row.numel(), device=device) - segment_start[entry_expert]
        position = expert_offsets[entry_expert] + rank_in_segment

        rows = torch.zeros(num_rows, payload.shape[1], dtype=torch.uint8, device=device)
        rows[position] = recv_payload[entry_row]
        src_rank = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        src_token = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        topk_slot = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        topk_weight = torch.zeros(num_rows, dtype=torch.float32, device=device)
        src_rank[position] = recv_src_rank[entry_row].to(torch.int32)
        src_token[position] = recv_src_token[entry_row].to(torch.int32)
        topk_slot[position] = entry_slot.to(torch.int32)
        topk_weight[position] = recv_weight[entry_row, entry_slot]
        layout_row = torch.full((num_recv, num_topk), -1, dtype=torch.int64, device=device)
        layout_row[entry_row, entry_slot] = position

        handle = ReferenceHandle(send_counts=send_counts, recv_counts=recv_counts, send_rows=send_rows,
                                 recv_src_rank=recv_src_rank, recv_src_token=recv_src_token,
                                 recv_topk_weight=recv_weight, layout_row=layout_row, topk_idx=topk_idx,
                                 topk_weights=topk_weights, num_tokens=num_tokens, num_rows=num_rows, config=cfg,
                                 group_ranks=self._group_ranks, dispatch_id=dispatch_id,
                                 stream=_ext.current_raw_stream(device) if device.type == "cuda" else 0)
        row_index = None
        if not expand:  # padding rows (src_rank -1) hold no received row
            row_index = torch.where(src_rank >= 0, torch.arange(num_rows, dtype=torch.int32, device=device),
                                    torch.full((num_rows,), -1, dtype=torch.int32, device=device))
        return DispatchResult(
            x=unpack_dispatch_payload(rows, cfg.dispatch_format, cfg.hidden),
            num_tokens_per_expert=num_tokens_per_expert.to(torch.int32),
            expert_offsets=expert_offsets.to(torch.int32),
            src_rank=src_rank, src_token=src_token, topk_slot=topk_slot, topk_weight=topk_weight,
            handle=handle, num_rows=num_rows, row_index=row_index)

    def check_handle(self, handle) -> None:
        """TypeError unless `handle` comes from a reference-backend dispatch; ValueError if that dispatch ran on a Buffer
        with another configuration (its rows and counts would not match this Buffer's exchange)."""
        if not isinstance(handle, ReferenceHandle):
            raise TypeError(f"combine needs the handle of a reference-backend dispatch, got {type(handle).__name__}")
        if handle.config is not None and _routing_sizes(handle.config) != _routing_sizes(self.config):
            raise ValueError("combine got the handle of another Buffer's dispatch whose sizes differ from this "
                             "Buffer's (world size, experts, top-k, hidden, alignment or max_tokens_per_rank): pass "
                             "the handle to the Buffer that dispatched it")
        check_handle_group(handle.group_ranks, self._group_ranks)

    @staticmethod
    def rows_read_by_combine(handle: ReferenceHandle) -> torch.Tensor:
        """int64 [n] on the tokens' device: the expert-major rows a combine with this handle reads (Buffer's
        check_finite; padding rows are not among them)."""
        rows = handle.layout_row.reshape(-1)
        return torch.unique(rows[rows >= 0])

    @formats._keeps_subnormals  # its own FP32 sums too follow NUMERICS.md on a CPU thread that flushes
    def combine(self, expert_out: torch.Tensor, handle: ReferenceHandle, local_reduce: bool = True) -> torch.Tensor:
        cfg = self.config
        device = expert_out.device
        world, hidden, fmt = cfg.world_size, cfg.hidden, cfg.combine_format
        num_topk = handle.layout_row.shape[1]
        num_tokens = handle.num_tokens
        out_rows = expert_out.float()
        if out_rows.shape[0] == 0:
            out_rows = out_rows.new_zeros(1, hidden)  # keeps the gathers below valid when nothing arrived

        if local_reduce:
            # Expert rank: one fp32 row per received (token, source) pair, slots in ascending order.
            acc = torch.zeros(handle.layout_row.shape[0], hidden, dtype=torch.float32, device=device)
            for slot in range(num_topk):
                row = handle.layout_row[:, slot]
                valid = row >= 0
                term = out_rows[row.clamp(min=0)] * handle.recv_topk_weight[:, slot:slot + 1]
                acc = torch.where(valid[:, None], acc + term, acc)
            self._agree_on_combine(handle.recv_counts, handle.send_counts, local_reduce, handle.dispatch_id, device)
            back = self._all_to_all(pack_combine_rows(acc, fmt, cfg.rht_sign_mask, self.format_impl),
                                    handle.recv_counts, handle.send_counts, "combine (rows)")
            # Source rank: row (token t, destination d) arrives at offset(d) + position of t in send_rows[d].
            row_index = torch.full((num_tokens, world), -1, dtype=torch.int64, device=device)
            start = 0
            for d in range(world):
                tokens = handle.send_rows[start:start + handle.send_counts[d]]
                row_index[tokens, d] = torch.arange(start, start + tokens.numel(), device=device)
                start += handle.send_counts[d]
            return accumulate_combine_rows(back, fmt, hidden, row_index, None, cfg.rht_sign_mask, self.format_impl)

        # local_reduce=False: one row per (token, expert), unweighted; the source applies its own weights.
        entry_row, entry_slot = torch.nonzero(handle.layout_row >= 0, as_tuple=True)  # ordered by (row, slot)
        values = out_rows[handle.layout_row[entry_row, entry_slot]] if entry_row.numel() else out_rows[:0]
        counts_back = [int(v) for v in torch.bincount(handle.recv_src_rank[entry_row], minlength=world).tolist()]
        slot_rank = torch.where(handle.topk_idx >= 0, handle.topk_idx // cfg.num_local_experts,
                                torch.full_like(handle.topk_idx, -1))
        counts_expected = [int((slot_rank == d).sum()) for d in range(world)]
        self._agree_on_combine(counts_back, counts_expected, local_reduce, handle.dispatch_id, device)
        back = self._all_to_all(pack_combine_rows(values, fmt, cfg.rht_sign_mask, self.format_impl),
                                counts_back, counts_expected, "combine (rows)")
        # Rows from rank d arrive ordered by token, then slot: exactly the (t, k) with slot_rank == d in order.
        row_index = torch.full((num_tokens, num_topk), -1, dtype=torch.int64, device=device)
        start = 0
        for d in range(world):
            tok, slot = torch.nonzero(slot_rank == d, as_tuple=True)
            row_index[tok, slot] = torch.arange(start, start + tok.numel(), device=device)
            start += tok.numel()
        return accumulate_combine_rows(back, fmt, hidden, row_index, handle.topk_weights, cfg.rht_sign_mask,
                                       self.format_impl)
