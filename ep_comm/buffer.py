"""`ep_comm.Buffer`: the user-facing dispatch/combine object of one expert-parallel process group."""
from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ._compile import eager_only
from ._ext import capture_id, current_raw_stream, gpu_uuid, warn_once
from .formats import IMPLS as FORMAT_IMPLS
from .formats import _check_dense, _is_capturing
from .types import BACKENDS, BufferConfig, BufferSizes, CombineRowsTarget, DispatchResult, WaveDispatch
from .types import type_name as _type_name
from .backends.transport import device_backends

# Compared across ranks when a Buffer is made (_check_same_arguments_everywhere); README "Environment".
_COMPARED_ENVIRONMENT = ("EP_COMM_PEER_MEMORY", "EP_COMM_ALLOW_SHARED_GPU", "EP_COMM_SYNC_CHECK")


class _RankDataFault(ValueError):
    """A fault of this rank's data (not of the program's arguments), typically on one rank only: the subclasses below.
    On nvlink, whose ranks do not agree on each call on the host, the rank that finds one tells its peers to stop
    waiting for it (Buffer._validate_together)."""


class InvalidRoutingError(_RankDataFault):
    """Raised by a checked dispatch (check_inputs): topk_idx holds an id outside [-1, E) or one expert twice in a
    token, or a selected slot's routing weight is not finite. A fault of this rank's data (its router), unlike a bad
    argument usually found on this rank alone (see Buffer._validate_together); on nvlink it also stops the Buffer on
    every rank. A ValueError, so `except ValueError` catches it too."""


class NonFiniteInputError(_RankDataFault):
    """Raised by a Buffer made with check_finite=True: dispatch's x, or a row of combine's expert_out that the combine
    reads, holds NaN or Inf (which the quantized wire formats do not propagate faithfully: README, "NaN / Inf
    inputs"). A fault of this rank's data, like InvalidRoutingError: on nvlink it also stops the Buffer on every rank,
    so that no peer waits for a call this rank abandoned. A ValueError."""


def _check_finite_rows(name: str, rows: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
    """Raise NonFiniteInputError if rows [N, H] hold NaN or Inf, naming the first such row (row_ids[i]: its index in
    the caller's tensor; default i) and value. One reduction on the device and one device->host copy."""
    if rows.numel() == 0:
        return
    finite_rows = rows.isfinite().all(dim=1)
    if bool(finite_rows.all()):
        return
    i = int(torch.nonzero(~finite_rows)[0])
    row = rows[i]
    column = int(torch.nonzero(~row.isfinite())[0])
    index = i if row_ids is None else int(row_ids[i])
    raise NonFiniteInputError(f"{name} row {index} holds {float(row[column])} at column {column} (check_finite=True: "
                              f"NaN / Inf are refused instead of being quantized)")


def _check_expert_ids(topk_idx: torch.Tensor, num_experts: int, topk_weights: Optional[torch.Tensor] = None) -> None:
    """Raise ValueError if an id of topk_idx [T, K] is outside [-1, num_experts), a token names one expert in two
    slots, or (with topk_weights, float32 [T, K]) the weight of a selected slot (id >= 0) is NaN or infinite: combine
    would spread NaN over the token's output, or, summed in S2F6, lose the token's experts on that rank without a
    NaN. The conditions are reduced on the device and read back with one device->host copy (the only host
    synchronization of a checked dispatch); the details for the message are computed only on the error path."""
    out_of_range = ((topk_idx < -1) | (topk_idx >= num_experts)).any()
    # Duplicates: equal neighbours after sorting each row, masked slots (-1) excepted (K = 1: none).
    ordered = torch.sort(topk_idx, dim=1).values
    duplicate_tokens = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
    flags = [out_of_range, duplicate_tokens.any()]
    if topk_weights is not None:  # the weights of selected slots (a masked slot's weight is never used)
        finite = torch.where(topk_idx >= 0, topk_weights, 0.0).isfinite()
        flags.append(~finite.all())
    bad_range, bad_duplicate, *bad_weight = torch.stack(flags).tolist()  # the one device->host copy
    if bad_range:
        low, high = int(topk_idx.min()), int(topk_idx.max())
        raise InvalidRoutingError(f"topk_idx values must be in [-1, {num_experts}); got range [{low}, {high}]")
    if bad_duplicate:
        token = int(torch.nonzero(duplicate_tokens)[0])
        raise InvalidRoutingError(f"token {token} selects the same expert in two top-k slots: "
                                  f"{topk_idx[token].tolist()}")
    if any(bad_weight):
        token, slot = (int(i) for i in torch.nonzero(~finite)[0])
        raise InvalidRoutingError(f"token {token} has the routing weight {float(topk_weights[token, slot])} in "
                                  f"top-k slot {slot} (expert {int(topk_idx[token, slot])}): weights of selected "
                                  "slots must be finite")


def _tensors_in(obj) -> list:
    """Every tensor of a result: a tensor, or the fields of (nested) dataclasses, lists and tuples."""
    found = []
    _collect_tensors(obj, found)
    return found


# The field names of each dataclass type met by _collect_tensors (() for other types): a comm_stream call walks its
# inputs and outputs, ~40 objects, and dataclasses.fields / is_dataclass per object cost ~0.1 ms of host time per call.
_FIELD_NAMES: dict = {}
_LEAF_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _field_names(kind: type) -> tuple:
    """The field names of dataclass type `kind`, () for any other type (a dataclass type itself, as opposed to an
    instance, is of type `type`: no fields, no tensors)."""
    try:
        return _FIELD_NAMES[kind]
    except (KeyError, TypeError) as missing:  # (TypeError: a type that cannot be a key, a metaclass without __hash__)
        names = tuple(field.name for field in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else ()
        if isinstance(missing, KeyError):
            _FIELD_NAMES[kind] = names
        return names


def _collect_tensors(obj, found: list) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        return
    names = _field_names(type(obj))
    if names:  # (a dataclass before a list or tuple: a dataclass that subclasses one is walked by its fields)
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif not isinstance(value, _LEAF_TYPES):
                _collect_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_tensors(item, found)


def _stream_of_raw(raw_stream: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream object of a raw cudaStream_t. Handle 0 (torch's default stream) must not go through
    torch.cuda.ExternalStream: torch reads a null stream_ptr as "no stream given" and hands out a fresh stream from its
    pool, on which an event records nothing (found on the GPU, twenty-seventh session: a call on another stream after
    a call on the default stream was not ordered after it)."""
    if raw_stream == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(raw_stream, device=device)


def _gpu_identity() -> tuple:
    """(host, GPU UUID, device index) of this process's current GPU, or (host, None, None) without one: what the nvlink
    backend's peer check compares between ranks (NVLinkBackend.is_available). Never raises: it runs before a
    collective that every rank must reach."""
    host = socket.gethostname()
    try:
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            return host, gpu_uuid(index), index
    except Exception:  # noqa: BLE001 (a broken CUDA setup: is_available reports it on this rank)
        pass
    return host, None, None


class Buffer:
    """Dispatch tokens to experts and combine expert outputs across the ranks of `group`.

    Args:
        group: torch.distributed process group (None = the default group). gloo for CPU tensors, NCCL for
            CUDA tensors.
        hidden: H, a multiple of 32. num_experts: E (divisible by the world size). num_topk: K.
        max_tokens_per_rank: the most tokens any rank passes to one dispatch (static capacity).
        dispatch_format: "nvfp4" (default; E2M1 + E4M3 per 16 + FP32 per token, 4/6), "mxfp8" or "bf16".
        combine_format: "s2f6" (default; RHT-32 + S2F6 + UE8M0 per 32), "mxfp8" (E4M3 + UE8M0 per 32, nearest, no
            rotation: the same bytes as S2F6, ~3x its error on Gaussian rows) or "bf16".
        backend: "auto" (nvlink when ep_comm._C is built, every GPU is sm_90 or newer, no two ranks share a GPU,
            every two ranks of a node use GPUs that reach each other with peer access and native peer atomics
            (NVLink; a PCIe-only link is refused: the kernels' flags need the atomics; a peer GPU this process cannot
            see is left to the peer-memory setup), and either nvshmem4py imports on every rank -- a region NVSHMEM
            cannot map then raises from Buffer() -- or all ranks run on one node (CUDA IPC); else reference,
            with a warning that says why; on a gloo (CPU) group reference, without a warning: there are no GPUs to
            connect), "reference" or "nvlink" (which raises with the same reason instead of falling back).
        expert_alignment: expert segments start at multiples of this (default 1; e.g. 128 for GEMM tiles).
        num_sms: blocks (SMs) of the nvlink BF16 and MXFP8 dispatch sends (the NVLink-bound kernels; default 24).
        num_local_sms: blocks of every other nvlink kernel -- the NVFP4 quantize-and-send, whose 4/6 quantization
            dominates, the receive/expansion, the combine reduction-and-send and the combine receive (0 = all SMs of
            the device).
        rht_sign_mask: the 32 random signs of the combine's Hadamard transform (bit j set: sign of element j is -1;
            default 0x6A09E667, docs/NUMERICS.md "RHT-32"); every rank must use the same.
        timeout_s (default 100 s): a peer wait longer than this raises, naming rank and stage (nvlink: the kernels'
            flag waits -- the call in flight returns invalid results and the next call or check() raises; reference
            over gloo: each collective of a call, those at construction keeping the process group's timeout;
            reference over NCCL: the process group's own timeout applies instead). It bounds the ranks' skew too: a
            rank pausing longer than this between calls makes its peers time out.
        check_inputs: a bool: validate the expert ids (range, duplicates) and that the routing weights of selected
            slots are finite (needs a device->host copy; skipped automatically during CUDA graph capture). On the
            reference backend the ranks agree on the outcome of every call's argument checks (one small all_reduce
            per call, whatever check_inputs is), so inputs rejected on one rank -- dispatch or combine -- raise on
            every rank. On nvlink (no host collective per call) a rank whose ids or weights are rejected tells its
            peers through their device-side abort word: their kernels stop waiting for it and record its name, and
            the host raises at the next call or check() after that (a peer that had not launched the call yet
            gets invalid results from it and raises at the one after); the Buffer is then unusable on every rank.
            Without checks, ids outside [0, num_experts) are masked slots on both backends; a token naming one
            expert in two slots is undefined (the reference backend counts the expert twice; nvlink may leave rows
            unwritten, which check() and the next call report), and non-finite weights reach the combine as they
            are.
        format_impl: "auto" | "reference" | "cuda", quantization path of the reference backend.
        check_finite: a bool (default False): refuse NaN / Inf in dispatch's x and in the rows of combine's expert_out
            that the combine reads (`ep_comm.NonFiniteInputError`, a ValueError, naming the row), instead of
            quantizing them (the quantized formats do not propagate them faithfully: README "NaN / Inf inputs").
            A debugging aid: a device->host copy per call (skipped during CUDA graph capture). Rejected on one rank,
            it stops the call on every rank as check_inputs does. Not covered: rows a GEMM epilogue writes itself
            (`begin_combine_rows`, MoELayer's combine rows), which never exist as an expert_out tensor.

    combine weights each expert row with the routing weight given to dispatch (DispatchResult.topk_weight, of which the
    handle keeps its own copy: editing the result's topk_weight does not change the combine): it takes no weights of
    its own.

    Every rank must construct the Buffer with the same arguments, and with the same EP_COMM_PEER_MEMORY,
    EP_COMM_ALLOW_SHARED_GPU and EP_COMM_SYNC_CHECK environment (compared across ranks before they are validated: a
    mismatch or an invalid value raises ValueError / TypeError on every rank).
    dispatch and combine have no autograd of their own (ep_comm.training wraps them for training): with gradients
    enabled, inputs that require grad are refused with an error rather than silently cut out of backward.
    """

    @eager_only
    def __init__(self, group=None, *, hidden: int, num_experts: int, num_topk: int, max_tokens_per_rank: int,
                 dispatch_format: str = "nvfp4", combine_format: str = "s2f6", backend: str = "auto",
                 expert_alignment: int = 1, num_sms: int = 24, num_local_sms: int = 0, rht_sign_mask: int = 0x6A09E667,
                 timeout_s: float = 100.0, check_inputs: bool = True, format_impl: str = "auto",
                 check_finite: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("ep_comm.Buffer needs torch.distributed to be initialized (init_process_group)")
        # (torch's own error names no argument; new_group's answer on a non-member is a sentinel, refused below)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and not isinstance(group,
                                                                                                  dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, or None for the default group; got "
                            f"{_type_name(group)} (of a DeviceMesh: mesh.get_group(), or mesh['ep'].get_group())")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:  # (torch answers -1 for a process outside the group)
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group given "
                             f"to ep_comm.Buffer")
        self.config = BufferConfig(hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                                   max_tokens_per_rank=max_tokens_per_rank,
                                   world_size=dist.get_world_size(self.group), dispatch_format=dispatch_format,
                                   combine_format=combine_format, expert_alignment=expert_alignment,
                                   rht_sign_mask=rht_sign_mask, num_sms=num_sms, num_local_sms=num_local_sms,
                                   timeout_s=timeout_s)
        self.check_inputs = check_inputs
        self.check_finite = check_finite
        # Compared across ranks before anything is validated, so that a bad or mismatched argument on one rank
        # raises on every rank instead of leaving the others waiting in a collective.
        self._check_same_arguments_everywhere(backend, format_impl)
        self.config.validate()
        if not isinstance(check_inputs, bool):
            raise TypeError(f"check_inputs must be a bool, got {_type_name(check_inputs)}")
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {_type_name(check_finite)}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if format_impl not in FORMAT_IMPLS:
            raise ValueError(f"format_impl must be one of {FORMAT_IMPLS}, got {format_impl!r}")
        if backend != "reference":
            # Here, not in the nvlink availability check: there a malformed value would only make "auto" fall back
            # to the reference backend with a warning. (Equal on every rank by now: every rank raises.)
            from .backends.nvlink import check_environment
            check_environment()
        self._backend = self._make_backend(backend, format_impl)
        self._destroyed = False
        # The previous CUDA call: (raw stream handles to wait for, the event after it (comm_stream calls) or None, the
        # id of the CUDA-graph capture it was made in, 0 outside one: _ext.capture_id). The Buffer's calls share device
        # state: the next call waits for it wherever it runs (_order_after_last_call).
        self._last_call = None

    # ------------------------------------------------------------------------------------------------------
    def _check_same_arguments_everywhere(self, backend: str, format_impl: str) -> None:
        # check_inputs too: a Buffer setting that differs between ranks is almost surely a mistake (the reference
        # backend's per-call agreement runs either way, so it would not hang).
        # And the environment variables the nvlink backend reads before or between its collectives (peer memory
        # kind, shared-GPU mode, sync checks): set differently, or malformed on one rank, they would misalign the
        # ranks' collectives at creation instead of raising everywhere.
        mine = dict(dataclasses.asdict(self.config), backend=backend, format_impl=format_impl,
                    # (a bool as is, anything else by its type name: comparable and picklable on every rank, and
                    # refused below on every rank alike)
                    **{name: value if isinstance(value, bool) else _type_name(value)
                       for name, value in (("check_inputs", self.check_inputs), ("check_finite", self.check_finite))},
                    **{name: os.environ.get(name) for name in _COMPARED_ENVIRONMENT})
        if backend != "reference":  # the kernels' switches may differ between ranks; malformed on one, all raise
            from .backends.nvlink import kernel_switch_problem
            mine["malformed nvlink kernel switch"] = kernel_switch_problem()
        gathered = [None] * self.config.world_size
        try:
            dist.all_gather_object(gathered, mine, group=self.group)
        except RuntimeError as error:  # (gloo's or NCCL's own message names neither ep_comm nor the likely cause)
            raise RuntimeError(f"ep_comm.Buffer(): the ranks' comparison of the constructor arguments failed on rank "
                               f"{self.rank} (a collective over the process group, within its timeout): every rank must "
                               f"create the same Buffers in the same order, and a peer may still be in an earlier call "
                               f"or have failed. The process group may be unusable now. ({error})") from error
        def same(a, b) -> bool:
            # Types too: 64 and 64.0 (or True and 1) are equal but one of them fails validate() on its rank only,
            # which would leave the other ranks in the next collective. NaN counts as equal to NaN here: the same NaN
            # argument everywhere is refused by validate() instead.
            return type(a) is type(b) and (a == b or (a != a and b != b))

        for other_rank, other in enumerate(gathered):
            diff = {name: (value, other.get(name)) for name, value in mine.items() if not same(value, other.get(name))}
            if diff:
                raise ValueError(f"ep_comm.Buffer arguments differ between rank {self.rank} and rank {other_rank}: "
                                 + ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diff.items()))

    def _make_backend(self, backend: str, format_impl: str):
        from .backends.reference import ReferenceBackend
        if backend == "reference":
            return ReferenceBackend(self.group, self.config, format_impl=format_impl)
        if backend == "auto" and device_backends(self.group).get("cuda") != "nccl":
            # A CPU (gloo) group has no GPUs to connect: the reference backend is the only engine there.
            return ReferenceBackend(self.group, self.config, format_impl=format_impl)
        have_nvshmem = False
        # Every rank's GPU, for the nvlink backend's peer check (a collective: before anything that may raise).
        identities = [None] * self.config.world_size
        dist.all_gather_object(identities, _gpu_identity(), group=self.group)
        try:
            from .backends.nvlink import NVLinkBackend, _check_nvlink_limits, nvshmem_may_map_peers
            have_nvshmem = nvshmem_may_map_peers()  # (first: an availability check that raises must not hide it)
            available, reason = NVLinkBackend.is_available(self.group, identities)
            if available:
                try:  # a configuration the reference backend takes but these kernels do not (e.g. num_topk > 32)
                    _check_nvlink_limits(self.config)
                except ValueError as error:
                    available, reason = False, str(error)
        except ImportError as error:
            available, reason = False, f"the nvlink backend could not be imported ({error})"
        except Exception as error:  # noqa: BLE001 (CUDA init, a peer-access query: this rank still votes)
            available, reason = False, f"the nvlink backend's availability check raised ({error!r})"
        # Every rank must agree, or one would wait for the others on a different transport. The hosts too (from the
        # identities): a rank without NVSHMEM (no nvshmem4py, or EP_COMM_PEER_MEMORY=ipc) maps its peers with CUDA
        # IPC, which cannot reach another node (is_available only sees its own node's GPUs), and "auto" must then pick
        # the reference backend instead of failing in setup. A rank's own failure reason is kept (it comes first).
        votes = [None] * self.config.world_size
        dist.all_gather_object(votes, (available, reason, have_nvshmem), group=self.group)
        hosts = sorted({host for host, _, _ in identities})
        ipc_ranks = [r for r, (_, _, nvshmem) in enumerate(votes) if not nvshmem]
        if len(hosts) > 1 and ipc_ranks:
            why = (f"the ranks run on {len(hosts)} hosts ({', '.join(hosts[:4])}) and ranks {ipc_ranks[:8]} would map "
                   f"their peers with CUDA IPC (nvshmem4py not installed, or EP_COMM_PEER_MEMORY=ipc), which needs "
                   f"every rank on one node")
            votes = [(ok, why_not, nvshmem) if not ok else (False, why, nvshmem) for ok, why_not, nvshmem in votes]
        if not all(ok for ok, _, _ in votes):
            reason = next(f"rank {r}: {why}" for r, (ok, why, _) in enumerate(votes) if not ok)
            if backend == "nvlink":
                raise RuntimeError(f"backend='nvlink' is unavailable: {reason}")
            warn_once(f"ep_comm: using the reference backend (torch.distributed all_to_all) because the nvlink "
                       f"backend is unavailable: {reason}")
            return ReferenceBackend(self.group, self.config, format_impl=format_impl)
        return NVLinkBackend(self.group, self.config)

    @property
    def backend(self) -> str:
        """The backend in use: "reference" or "nvlink"."""
        return self._backend.name

    @staticmethod
    def get_buffer_size_hint(*, hidden: int, num_experts: int, num_topk: int, max_tokens_per_rank: int,
                             world_size: int, dispatch_format: str = "nvfp4", combine_format: str = "s2f6",
                             expert_alignment: int = 1, backend: str = "nvlink") -> BufferSizes:
        """Bytes a backend needs for these bounds, before any Buffer exists (no process group needed).

        Arguments as `Buffer` (world_size: the ranks of the group), and backend: "nvlink" (default: the symmetric
        areas, layout and expert-major outputs) or "reference" (only the expert-major outputs; no symmetric memory).
        Returns `types.BufferSizes` (dispatch_recv_bytes, combine_recv_bytes, layout_bytes, expert_layout_bytes,
        total_symmetric_bytes; see its docstring)."""
        config = BufferConfig(hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                              max_tokens_per_rank=max_tokens_per_rank, world_size=world_size,
                              dispatch_format=dispatch_format, combine_format=combine_format,
                              expert_alignment=expert_alignment)
        config.validate()
        if backend not in ("reference", "nvlink"):
            raise ValueError(f"backend must be 'reference' or 'nvlink' for a size hint, got {backend!r}")
        if backend == "reference":
            from .backends.reference import ReferenceBackend
            return ReferenceBackend.size_hint(config)
        from .backends.nvlink import NVLinkBackend
        return NVLinkBackend.size_hint(config)

    # ------------------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ep_comm.Buffer was destroyed")

    @staticmethod
    def _refuse_autograd(what: str, *tensors) -> None:
        """dispatch / combine have no autograd here (ep_comm.training has it): a result without grad_fn would silently
        cut the MoE branch out of backward (the layer would train as if it were not there)."""
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            raise RuntimeError(f"Buffer.{what} has no autograd: gradients would not flow through it. For training, "
                               "use ep_comm.training.dispatch / combine (their backward passes run on "
                               "ep_comm.training.GradBuffers); for inference, run the forward under torch.no_grad() "
                               "or torch.inference_mode()")

    def _check_tokens(self, x, also_accepted: tuple = ()) -> None:
        """x must be a bfloat16 [num_tokens, hidden] tensor (dispatch's input; MoELayer checks it before routing), or
        of a dtype in also_accepted (MoELayer.route's FP32 logits take float16 / float32 too)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        _check_dense("x", x)
        if x.dtype != torch.bfloat16 and x.dtype not in also_accepted:
            names = " / ".join(str(dtype).replace("torch.", "") for dtype in also_accepted)
            others = f" (or {names})" if also_accepted else ""
            raise TypeError(f"x must be bfloat16{others}, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.config.hidden:
            raise ValueError(f"x must be [num_tokens, {self.config.hidden}], got {tuple(x.shape)}")

    def _validate_dispatch(self, x, topk_idx, topk_weights, check_ids: bool) -> None:
        cfg = self.config
        for name, tensor in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        self._check_tokens(x)
        _check_dense("topk_idx", topk_idx)
        _check_dense("topk_weights", topk_weights)
        num_tokens = x.shape[0]
        if num_tokens > cfg.max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed max_tokens_per_rank={cfg.max_tokens_per_rank}; "
                             "create the Buffer with a larger bound")
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
        if tuple(topk_idx.shape) != (num_tokens, cfg.num_topk):
            raise ValueError(f"topk_idx must be [{num_tokens}, {cfg.num_topk}], got {tuple(topk_idx.shape)}")
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
        if tuple(topk_weights.shape) != (num_tokens, cfg.num_topk):
            raise ValueError(f"topk_weights must be [{num_tokens}, {cfg.num_topk}], got {tuple(topk_weights.shape)}")
        if topk_idx.device != x.device or topk_weights.device != x.device:
            raise ValueError(f"x, topk_idx and topk_weights must be on one device; got {x.device}, "
                             f"{topk_idx.device}, {topk_weights.device}")
        self._backend.check_device("x", x)  # where the backend's kernels or collectives can read it
        if check_ids and num_tokens and not _is_capturing():
            _check_expert_ids(topk_idx, cfg.num_experts, topk_weights)
        if self.check_finite and not _is_capturing():
            _check_finite_rows("x", x)

    def _check_stream_args(self, device: torch.device, comm_stream, done_event) -> None:
        if comm_stream is not None:
            if not isinstance(comm_stream, torch.cuda.Stream):
                raise TypeError(f"comm_stream must be a torch.cuda.Stream, got {type(comm_stream).__name__}")
            if device.type != "cuda":
                raise ValueError("comm_stream needs CUDA tensors (this call's tensors are on the CPU)")
            if comm_stream.device != device:
                raise ValueError(f"comm_stream is on {comm_stream.device}, the tensors on {device}")
        if done_event is not None and not isinstance(done_event, torch.cuda.Event):
            raise TypeError(f"done_event must be a torch.cuda.Event, got {type(done_event).__name__}")
        if done_event is not None and device.type != "cuda":
            raise ValueError("done_event needs CUDA tensors (this call's tensors are on the CPU)")

    def _order_after_last_call(self, device: torch.device, raw_stream: int, capture: int, stream=None) -> None:
        """Make the stream this call's kernels go to (raw_stream; `stream`, its torch.cuda.Stream, when the caller has
        it) wait for the Buffer's previous call when that ran on another stream: the calls of one Buffer share its
        device state and must run one after the other, whatever streams they use (two micro-batches on two current
        streams, or a call after a comm_stream call). Streams are compared as raw handles, so the common case (the
        same current stream again) builds no Stream object and records no event: the wait is on everything enqueued
        on that stream so far. self._last_call = (raw streams, event, capture id): with an event (a comm_stream call),
        that event is waited on; without, an event is recorded now on each listed stream other than this call's, so
        the wait also covers what was enqueued there after the call (reads of a dispatch(expand=False) result, which
        lives in the Buffer's staging area until the next dispatch reuses it). Nothing is waited on across a
        CUDA-graph capture boundary (capture forbids it), nor lazily between two captured calls: inside a capture only
        a comm_stream call's own event orders the next call, and the caller orders calls made on two capturing streams
        (README). `capture` (and the entry's last field) is the capture id (_ext.capture_id: 0 outside a capture), so
        that a call inside one capture never waits on an event recorded inside another (CUDA refuses that: a capture
        ending with a comm_stream call, then another capture whose first call runs on another stream)."""
        if self._last_call is None:
            return
        last_streams, event, last_capture = self._last_call
        if last_capture != capture:
            return
        waiter = None
        if event is not None:
            if last_streams[0] != raw_stream:
                waiter = torch.cuda.current_stream(device) if stream is None else stream
                waiter.wait_event(event)
            return
        if capture:
            return
        for last_raw in last_streams:
            if last_raw == raw_stream:
                continue
            if waiter is None:
                waiter = torch.cuda.current_stream(device) if stream is None else stream
            recorded = torch.cuda.Event()
            recorded.record(_stream_of_raw(last_raw, device))
            waiter.wait_event(recorded)

    def _run_on_stream(self, device: torch.device, comm_stream, done_event, inputs, run, result_in_buffer=False,
                       handle=None):
        """run() on comm_stream (None: the current stream), after everything enqueued so far on the current stream and
        after this Buffer's previous call; then done_event is recorded where run() enqueued its work. The caching
        allocator is told about the streams that share tensors: inputs are marked in use on comm_stream, and the
        outputs (allocated on comm_stream) in use on the caller's stream, so that neither is reused while the other
        stream may still touch it (record_stream also works inside a CUDA-graph capture). Output tensors in the
        Buffer's own memory (the staging rows of a dispatch without expansion) are not the allocator's and are not
        marked (some allocator backends refuse foreign memory). device: where the call's tensors are (CPU: no
        streams). result_in_buffer: the result reads the Buffer's memory until its next dispatch (expand=False), so
        after a comm_stream call the next call waits for the work enqueued later on comm_stream and on the caller's
        stream too (recorded when that call is made), where the result is read. handle: the dispatch handle a combine
        reads; made on another stream than this call's (handle.stream: dispatch and combine on two current streams),
        its tensors are marked in use on this call's stream, so that dropping the dispatch result on the dispatch's
        stream does not hand their memory out there while the combine may still read it. self._last_call: see
        _order_after_last_call."""
        if comm_stream is None:
            if device.type != "cuda":  # CPU tensors (reference backend over gloo): no stream; the last CUDA call's
                return run()           # entry stays, so a later CUDA call is still ordered after it
            # Raw handle, not torch.cuda.current_stream (7 us per call: _ext.current_raw_stream).
            raw_stream = current_raw_stream(device)
            capture = capture_id(raw_stream)
            self._order_after_last_call(device, raw_stream, capture)
            out = run()
            if handle is not None and getattr(handle, "stream", raw_stream) != raw_stream:
                current = torch.cuda.current_stream(device)
                for tensor in _tensors_in(handle):
                    if tensor.is_cuda:
                        tensor.record_stream(current)
            if done_event is not None:  # on the stream of the call's device (the current device may be another)
                done_event.record(torch.cuda.current_stream(device))
            self._last_call = ((raw_stream,), None, capture)
            return out
        caller = torch.cuda.current_stream(device)  # device: comm_stream's (_check_stream_args)
        comm_stream.wait_stream(caller)  # inside a capture this also brings comm_stream into it
        capture = capture_id(comm_stream.cuda_stream)
        self._order_after_last_call(device, comm_stream.cuda_stream, capture, comm_stream)
        for tensor in _tensors_in(inputs):
            if tensor.is_cuda:
                tensor.record_stream(comm_stream)
        lazy = result_in_buffer and not capture
        with torch.cuda.stream(comm_stream):
            out = run()
            # The Buffer's own event orders its next call (or, for a result in the Buffer's memory outside a capture,
            # events recorded when that call is made); the caller's done_event is theirs to record again.
            finished = None
            if not lazy:
                finished = torch.cuda.Event()
                finished.record(comm_stream)
            if done_event is not None:
                done_event.record(comm_stream)
        if lazy:
            self._last_call = (tuple(dict.fromkeys((comm_stream.cuda_stream, caller.cuda_stream))), None, 0)
        else:
            self._last_call = ((comm_stream.cuda_stream,), finished, capture)
        for tensor in _tensors_in(out):
            if tensor.is_cuda and not (result_in_buffer and self._backend.holds(tensor)):
                tensor.record_stream(caller)
        return out

    @eager_only
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 check_inputs: Optional[bool] = None, *, comm_stream: Optional[torch.cuda.Stream] = None,
                 done_event: Optional[torch.cuda.Event] = None, expand: bool = True) -> DispatchResult:
        """Send each token (once per destination rank) to the ranks of its top-k experts.

        Args:
            x: bfloat16 [T, H], T <= max_tokens_per_rank (T may be 0 and may differ between ranks).
            topk_idx: int32/int64 [T, K], global expert ids, -1 = masked slot.
            topk_weights: float32 [T, K], routing weights (used by combine; those of selected slots must be finite,
                checked with the ids).
            check_inputs: validate the expert ids (range, duplicates) and that the weights of selected slots are
                finite, for this call (None or a bool) -- a device->host copy, so
                the host waits for the GPU; None = the Buffer's setting. Callers whose ids are valid by
                construction (e.g. torch.topk over the expert logits, as MoELayer) pass False. On the reference
                backend a rank whose inputs are rejected makes every rank raise. On nvlink, a rank whose ids or
                weights are rejected tells its peers to stop waiting for it (they raise, naming it, at their first call
                or check() after one of their kernels has seen the notice -- a peer that had not launched this call
                yet gets invalid results from it first; the Buffer is unusable on every rank from then on); after
                other arguments rejected on one rank only, its peers' kernels give up after timeout_s and their
                next call raises the timeout.
            comm_stream: run the dispatch on this CUDA stream instead of the current one (None, the default): it
                starts after the work enqueued so far on the current stream, and the current stream does not wait
                for it -- wait with `torch.cuda.current_stream().wait_event(done_event)` (or `.wait_stream(
                comm_stream)`) before using the result there. Inputs and outputs are marked in use on both streams
                for the caching allocator (not an nvlink `expand=False` result's x: the Buffer's own memory); the
                inputs are read on comm_stream after this returns, so do not write them in place before done_event
                (as with any asynchronous copy). The Buffer's next call, on any stream, starts after this one (its
                calls share device state). Inside a
                CUDA-graph capture, join comm_stream back into the capturing stream (wait on done_event) before the
                capture ends. Validation and the input check's host copy happen on the current stream, as without
                comm_stream.
            done_event: a torch.cuda.Event recorded after the dispatch's last kernel (on comm_stream when given).
            expand: True (default): x comes back in the expert-major layout. False: the received rows are not
                copied into that layout; the result's `row_index` names, for each expert-major row, the row of
                `result.x` that holds it (`DispatchResult.expert_major_x()` gathers). On nvlink `result.x` is then
                this Buffer's staging area itself, valid until the Buffer's next dispatch is enqueued or the
                Buffer is destroyed (work that reads it must be ordered before that dispatch on the stream), and the
                dispatch skips the expansion's HBM writes. With comm_stream (outside graph capture), the Buffer's
                next call, on any stream, also waits for the work enqueued on comm_stream and on this call's current
                stream until that next call is made, so reads of `result.x` enqueued on either (after done_event)
                before the Buffer's next call come before the staging is reused; reads enqueued after another call of
                the Buffer (e.g. a combine) or on other streams are the caller's to order before the next dispatch.
        Returns:
            DispatchResult (see ep_comm.types): received tokens in the expert-major layout in the dispatch
            format (or, with expand=False, as above), num_tokens_per_expert / expert_offsets (int32, device),
            per-row src_rank, src_token, topk_slot, topk_weight, and the handle for `combine`.
        """
        self._check_dispatch_call(x, topk_idx, topk_weights, check_inputs, comm_stream, done_event, expand)
        return self._run_on_stream(x.device, comm_stream, done_event, (x, topk_idx, topk_weights),
                                   lambda: self._backend.dispatch(x, topk_idx, topk_weights, expand=expand),
                                   result_in_buffer=not expand)

    def _check_dispatch_call(self, x, topk_idx, topk_weights, check_inputs: Optional[bool], comm_stream=None,
                             done_event=None, expand: bool = True) -> None:
        """What every dispatch checks before its kernels: a live Buffer, no autograd, valid inputs, arguments and
        streams -- all inside the ranks' agreement (_validate_together), so that a bad argument on one rank raises
        on every rank instead of misaligning their collectives (a Buffer destroyed on one rank only included)."""

        def validate():
            if not isinstance(expand, bool):
                raise TypeError(f"expand must be a bool, got {_type_name(expand)}")
            if check_inputs is not None and not isinstance(check_inputs, bool):
                raise TypeError(f"check_inputs must be None or a bool, got {_type_name(check_inputs)}")
            check = self.check_inputs if check_inputs is None else check_inputs
            self._refuse_autograd("dispatch", x, topk_weights)
            self._validate_dispatch(x, topk_idx, topk_weights, check)
            self._check_stream_args(x.device, comm_stream, done_event)
        self._validate_together(validate, "dispatch", x)

    def _validate_together(self, check, what: str, tensor=None) -> None:
        """Runs this Buffer's liveness check, then `check`. On the reference backend (which refuses CUDA-graph capture
        here, before anything is enqueued: it is not capturable) the ranks then agree on the outcome (one small
        all_reduce, whatever check_inputs is, so that ranks calling with different settings still meet): inputs
        rejected on one rank raise on every rank instead of leaving the others in the next collective until the
        process group's timeout. The nvlink backend does not meet its peers on the host (no collective per call), so
        a rank cannot know whether its peers rejected the same call. Invalid expert ids are data, typically bad on one
        rank only, whose peers' kernels already wait for it: that rank tells its peers to stop waiting
        (NVLinkBackend.give_up; they raise at their next check, naming it) and the Buffer refuses later calls on every
        rank. A bad argument (type, shape, device, handle) is a program's error, usually the same on every rank,
        which then all raise and go on; on one rank only, its peers wait until their timeout, whose message names
        this cause. The liveness check is part of the agreement: a Buffer destroyed on one rank only makes its
        reference-backend peers raise at once. So is `tensor`'s device type (the call's main input: x, expert_out):
        over a group with both gloo and NCCL, one rank's CPU tensors would go over gloo while its peers' CUDA
        tensors wait over NCCL."""
        def validate():
            self._check_alive()
            check()
        if self.backend == "nvlink":  # (inside a capture the ids are not checked, so nothing below gives up there)
            try:
                validate()
            except _RankDataFault as rejected:
                try:
                    self._backend.give_up(f"{what}: {rejected}")
                except Exception as notice_failed:  # noqa: BLE001 (the caller gets the rejection; the failure is warned)
                    warnings.warn(f"ep_comm: telling the peers to stop waiting failed ({notice_failed!r}); they will "
                                  f"wait until their timeout", RuntimeWarning, stacklevel=3)
                raise
            return
        if _is_capturing():  # (the reference backend; a program error, the same on every rank: each raises)
            self._check_alive()  # (a destroyed Buffer says so first)
            raise RuntimeError(f"{what} on the reference backend cannot be captured in a CUDA graph: it sizes its "
                               f"results on the host and exchanges them with host collectives. Use the nvlink "
                               f"backend (Buffer(..., backend='nvlink')) for graphs")
        if self.backend != "reference" or (self._destroyed and not dist.is_initialized()):
            validate()  # (a destroyed Buffer whose process group is gone too: no peer left to tell)
            return
        error = None
        try:
            validate()
        except Exception as rejected:  # noqa: BLE001 (whatever the check raised, the peers must hear of it)
            error = rejected
        device = getattr(tensor, "device", None)  # `tensor`: the call's main input (x, expert_out), if any
        try:
            self._backend.raise_together(error, what + " inputs were rejected on rank(s) {ranks} (see the error raised "
                                                      "there); this rank's call is abandoned so that no rank waits",
                                         self._backend.call_id(what), getattr(device, "type", None), what)
        except RuntimeError as failed:
            if self._destroyed and failed is not error:  # (the agreement itself failed: its timeout, say)
                raise RuntimeError(f"this ep_comm.Buffer was destroyed, and its peers did not join this {what}'s "
                                   f"agreement (a call after destroy() made on this rank only?): {failed}") from failed
            raise

    @eager_only
    def dispatch_waves(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       wave_sms: int, check_inputs: Optional[bool] = None, precision: str = "exact") -> WaveDispatch:
        """`dispatch` for a w1 grouped GEMM that overlaps its receive (nvlink backend, NVFP4 dispatch).

        The receive runs on `wave_sms` blocks of 512 threads (one per SM) instead of the Buffer's receive block count
        and writes, besides the DispatchResult, the GEMM's operand rows (`grouped_gemm.ExpandedRows`, bitwise
        expand_nvfp4_rows of result.x) in expert-major row order, counting each local expert's rows on the device as
        they land. Launch
        `grouped_gemm.grouped_gemm_nvfp4(wave_dispatch.rows, ..., wave=wave_dispatch.wave)` as the next kernel on
        the same stream: it starts behind the receive on the other SMs and multiplies each expert as soon as its
        rows are in (csrc/waves.h; `moe.MoELayer(waves=True)` does both). Nothing may be launched on the stream in
        between: that kernel would become the GEMM's predecessor, the overlap would be lost, and the GEMM could start
        before it ends and overwrite memory it still reads (see grouped_gemm_nvfp4's `wave`). The GEMM is refused if
        this Buffer is called first (the WaveSync is good for that one launch); other launches cannot be detected.
        Arguments as `dispatch`; wave_sms in [1, `max_wave_sms`] (the receive's block count, num_local_sms).
        precision: the form of the operand rows, one of `grouped_gemm.PRECISIONS`:
            "exact" (default): rows.values float16 [R, H], e2m1 * e4m3 block values (exact), rows.row_factor float32
                [R] = amax * fp32(1 / (6 * 256)); bitwise `expand_nvfp4_rows(result.x)`.
            "fp8_inexact": the operand rows of the GEMM's opt-in inexact FP8 mode (grouped_gemm module docstring; needs
                H % 128 == 0): rows.values float8_e4m3fn [R, H], E4M3 (RNE) of e2m1 * e4m3 * 2^-3, columns permuted
                inside each 16-column group (`grouped_gemm.FP8_COLUMN_ORDER`), rows.row_factor float32 [R] the exact
                factor times 8; bitwise `expand_nvfp4_rows(result.x, precision="fp8_inexact")`. rows.precision says
                which. result (payload, layout, handle) is the same in both.
            Either way the rows are written for the rows of the experts (expert_offsets[e] .. + num_tokens_per_expert
            [e]); alignment padding and rows past expert_offsets[-1] are left unwritten.
        Returns: `types.WaveDispatch(result, rows, wave)`.
        """
        self._check_alive()
        # The precision first (an argument like any other, refused the same way on every backend and rank).
        from .grouped_gemm import PRECISIONS, check_precision
        if not isinstance(precision, str):
            raise TypeError(f"precision must be a str, one of {PRECISIONS}, got {_type_name(precision)}")
        if check_precision(precision) and self.config.hidden % 128:
            raise ValueError(f"precision='fp8_inexact' needs hidden % 128 == 0 (the FP8 mode's K granularity), this "
                             f"Buffer has hidden={self.config.hidden}")
        if self.backend != "nvlink":
            raise NotImplementedError("dispatch_waves needs the nvlink backend (a receive kernel running beside the "
                                      "GEMM); use dispatch")
        if isinstance(wave_sms, bool) or not isinstance(wave_sms, int):
            raise TypeError(f"wave_sms must be an int, got {type(wave_sms).__name__}")
        if not 1 <= wave_sms <= self.max_wave_sms:
            raise ValueError(f"wave_sms must be in [1, {self.max_wave_sms}] (Buffer.max_wave_sms: the receive's block "
                             f"count), got {wave_sms}")
        self._check_dispatch_call(x, topk_idx, topk_weights, check_inputs)
        return self._run_on_stream(x.device, None, None, (),
                                   lambda: self._backend.dispatch_waves(x, topk_idx, topk_weights, wave_sms,
                                                                        precision=precision))

    @property
    def max_wave_sms(self) -> int:
        """The largest wave_sms `dispatch_waves` takes: the receive kernel's block count (nvlink backend)."""
        if self.backend != "nvlink":
            raise NotImplementedError("waves need the nvlink backend")
        return self._backend.blocks["disp_recv_blocks"]

    @eager_only
    def combine(self, expert_out: torch.Tensor, handle, local_reduce: bool = True, *,
                comm_stream: Optional[torch.cuda.Stream] = None,
                done_event: Optional[torch.cuda.Event] = None) -> torch.Tensor:
        """Bring expert outputs back to their tokens and sum them with the routing weights.

        Args:
            expert_out: bfloat16 [R, H], row i is the expert output for row i of the DispatchResult.
            handle: `DispatchResult.handle` of the matching dispatch.
            local_reduce: True (default) sums a token's local experts on the expert rank and sends one row
                per (token, rank); False sends one row per (token, expert) (what a fused GEMM epilogue
                writes) and the source rank applies the weights.
            Every rank passes the handle of the same dispatch call and the same local_reduce. A mismatch raises on
            every rank: at once on the reference backend; on nvlink (found on the device) at a later call or
            `check()` once the combine has run, the Buffer then unusable (one rank passing another Buffer's handle
            while the others pass this one's is a mismatch too; every rank passing the same same-size Buffer's handle
            is fine if that Buffer's group holds the same processes in the same rank order: else ValueError).
            comm_stream, done_event: as for `dispatch` (the combine then runs on comm_stream after the work enqueued
                so far on the current stream; wait on done_event before using the result on the current stream).
        Returns:
            bfloat16 [T, H]: sum over the token's unmasked slots of weight * expert output (S2F6 mode:
            through RHT + S2F6 on the wire, summed in FP32, inverse RHT once; MXFP8 mode: MXFP8 on the wire, summed
            in FP32; BF16 mode: BF16 on the wire).
        """

        def validate():
            if not isinstance(local_reduce, bool):  # checked here: every rank raises together (a None would not)
                raise TypeError(f"local_reduce must be a bool, got {_type_name(local_reduce)}")
            self._validate_combine(expert_out, handle)
            self._check_stream_args(expert_out.device, comm_stream, done_event)
        self._validate_together(validate, "combine", expert_out)
        return self._run_on_stream(expert_out.device, comm_stream, done_event, (expert_out, handle),
                                   lambda: self._backend.combine(expert_out, handle, local_reduce=local_reduce),
                                   handle=handle)

    def _validate_combine(self, expert_out, handle) -> None:
        if not isinstance(expert_out, torch.Tensor):
            raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
        _check_dense("expert_out", expert_out)
        self._backend.check_device("expert_out", expert_out)
        self._refuse_autograd("combine", expert_out)
        if expert_out.dtype != torch.bfloat16:
            raise TypeError(f"expert_out must be bfloat16, got {expert_out.dtype}")
        if isinstance(handle, DispatchResult):
            raise TypeError("combine takes the dispatch's handle: pass result.handle, not the DispatchResult")
        if not hasattr(handle, "num_rows"):
            raise TypeError(f"handle must be the .handle of this Buffer's dispatch result, got {type(handle).__name__}")
        self._backend.check_handle(handle)
        num_rows = handle.num_rows
        if expert_out.dim() != 2 or tuple(expert_out.shape) != (num_rows, self.config.hidden):
            raise ValueError(f"expert_out must be [{num_rows}, {self.config.hidden}] (the rows of the dispatch "
                             f"result), got {tuple(expert_out.shape)}")
        if self.check_finite and not _is_capturing():  # only the rows combine reads: padding rows may hold anything
            rows = self._backend.rows_read_by_combine(handle)
            _check_finite_rows("expert_out", expert_out.index_select(0, rows), rows)

    @eager_only
    def begin_combine_rows(self, result: DispatchResult) -> CombineRowsTarget:
        """Start a combine whose rows a GEMM epilogue writes itself (nvlink backend, combine_format "s2f6").

        Enqueues, on the current stream, a wait until every source rank has read the previous combine out of its
        receive area, and returns the `CombineRowsTarget` that tells the epilogue where each expert row goes
        (`grouped_gemm.grouped_gemm_nvfp4_combine_rows`; `moe.MoELayer` does all three steps by default here).
        Then call `finish_combine_rows(result.handle)` on the same stream, before any other dispatch or combine of
        this Buffer (enforced: RuntimeError otherwise). The result is bitwise `combine(expert_out, result.handle,
        local_reduce=False)` for the bf16 expert_out the GEMM would have written, without that tensor and without
        the encode-and-send pass: the epilogue stores each (token, expert) row as RHT + S2F6 straight into the
        source rank's area over NVLink (the send kernel only waits before the GEMM; the receive publishes). That is
        one S2F6 rounding per expert row (local_reduce=False numerics) and up to top-k / (ranks per token) times
        the NVLink bytes of the local_reduce combine.
        """
        self._check_alive()
        if not isinstance(result, DispatchResult):
            raise TypeError(f"begin_combine_rows needs the DispatchResult of a dispatch, got {type(result).__name__}")
        self._require_combine_rows()
        return self._run_on_stream(self._backend.torch_device, None, None, (),
                                   lambda: self._backend.begin_combine_rows(result), handle=result.handle)

    @property
    def combine_rows_supported(self) -> bool:
        """Whether this Buffer can take combine rows written by a GEMM epilogue (`begin_combine_rows`): the nvlink
        backend (peer addresses) and S2F6 combine."""
        return self.backend == "nvlink" and self.config.combine_format == "s2f6"

    def _require_combine_rows(self) -> None:
        if self.backend != "nvlink":
            raise NotImplementedError("combine rows written by a GEMM epilogue need the nvlink backend (peer "
                                      "addresses); use combine(expert_out, handle, local_reduce=False)")
        if self.config.combine_format != "s2f6":
            raise ValueError(f"the combine-row epilogue writes S2F6 rows; this buffer combines in "
                             f"{self.config.combine_format!r}")

    @eager_only
    def finish_combine_rows(self, handle) -> torch.Tensor:
        """Publish the rows stored since `begin_combine_rows` and receive them: bfloat16 [T, H], the weighted sum
        over the token's unmasked top-k slots in slot order (local_reduce=False semantics), inverse RHT once."""
        self._check_alive()
        if self.backend != "nvlink":
            raise NotImplementedError("finish_combine_rows needs the nvlink backend")
        return self._run_on_stream(self._backend.torch_device, None, None, (),
                                   lambda: self._backend.finish_combine_rows(handle), handle=handle)

    @eager_only
    def check(self) -> None:
        """Raise if a kernel of this Buffer recorded a timeout (nvlink backend: a peer that never arrived, or a wave
        GEMM whose rows never came), naming rank and stage, or a dispatch row that fell outside the result (not
        written: calls out of step after a timeout, or one expert in two top-k slots with check_inputs off), or a
        combine whose peers combined another dispatch's handle or the other local_reduce mode, or that
        this rank or a peer gave up after rejecting its expert ids (nvlink, more than one rank). Reads host-mapped
        memory: no synchronization, so it sees what finished so far. Every dispatch / combine call checks first; this
        is for after the last one."""
        self._check_alive()
        backend_check = getattr(self._backend, "check", None)
        if backend_check is not None:
            backend_check()

    @eager_only
    def destroy(self) -> None:
        """Free every buffer (symmetric memory included). Collective: every rank must call it. On the nvlink backend
        it waits in a barrier of the Buffer's group until every rank has called it (no peer may still write into this
        rank's memory), bounded only by the process group's timeout: a rank that never destroys its Buffer holds the
        others there. On the reference backend it makes no collective of its own (it frees nothing shared); a call on
        a Buffer destroyed everywhere raises at once on every rank that makes it together, and one made on one rank
        only raises after timeout_s, saying the Buffer was destroyed."""
        if not self._destroyed:
            self._backend.destroy()
            self._destroyed = True

    def __enter__(self) -> "Buffer":
        return self

    def __del__(self):
        # destroy() is collective (the nvlink backend's symmetric region is freed by every rank together), so it cannot
        # run here, where a collection happens at a different moment on each rank. A Buffer whose backend holds memory
        # outside torch's allocator says so instead of leaking silently (a ResourceWarning, as Python does for an
        # unclosed file: shown by pytest and under -W default).
        backend = getattr(self, "_backend", None)
        if backend is None or getattr(self, "_destroyed", True) or not getattr(backend, "holds_unmanaged_memory", False):
            return
        try:  # at interpreter shutdown the warnings machinery may already be gone
            warnings.warn(f"ep_comm.Buffer (rank {self.rank}, {backend.name} backend) was garbage-collected without "
                          f"destroy(): its device memory stays allocated until the process exits. Call destroy() on "
                          f"every rank, or use `with ep_comm.Buffer(...) as buf:`", ResourceWarning, stacklevel=2)
        except Exception:
            pass

    def __exit__(self, exc_type, exc, traceback) -> None:
        """destroy() on leaving the block. Left by an exception, the nvlink backend first tells its peers to stop
        waiting for this rank (their kernels of a call this rank will not make give up now, and they raise at their
        next check naming it, instead of at their timeout), and a failing destroy() does not replace the exception:
        it is warned about and the memory stays allocated until the process exits."""
        if exc_type is None:
            self.destroy()
            return
        give_up = getattr(self._backend, "give_up", None)
        try:
            if give_up is not None and not self._destroyed:
                give_up(f"an exception left the `with Buffer` block: {exc!r}")
        except Exception as failure:  # noqa: BLE001 (the block's own exception propagates; destroy() still runs)
            warnings.warn(f"ep_comm.Buffer: telling the peers to stop waiting after an exception in the `with` block "
                          f"failed ({failure!r}); they wait until their timeout", RuntimeWarning, stacklevel=2)
        try:
            self.destroy()
        except Exception as failure:  # noqa: BLE001 (the block's own exception propagates)
            warnings.warn(f"ep_comm.Buffer: destroy() after an exception in the `with` block failed ({failure!r}); "
                          f"the Buffer's memory stays allocated", RuntimeWarning, stacklevel=2)
