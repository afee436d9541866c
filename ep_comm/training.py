"""Autograd for dispatch and combine: the backward passes of DESIGN.md §3, built from Buffer calls.

    grads = ep_comm.training.GradBuffers.create(buf)                  # collective, once
    routed = ep_comm.training.dispatch(buf, grads, x, topk_idx, topk_weights)
    expert_out = my_experts(routed.x, routed.result.expert_offsets)   # bf16 [R, H], any torch autograd code
    y = ep_comm.training.combine(expert_out, routed)                  # bf16 [T, H]
    loss(y).backward()    # gradients reach x, topk_weights and the experts' parameters

Experts: any torch autograd code on `routed.x`, or `ExpertMLP` / `expert_mlp` (ep_comm/training_experts.py): trainable
SwiGLU experts on the dispatched NVFP4 tokens themselves, with an MXFP8 + stochastic-rounding backward.

Forward: `Buffer.dispatch` and `Buffer.combine` in the Buffer's wire formats (NVFP4 / MXFP8 / BF16 out, S2F6 / MXFP8
/ BF16 back), the received tokens dequantized to dense rows for the experts. Backward treats the quantizers as the
identity (straight-through, as Transformer Engine treats its FP8 / FP4 casts), so the gradients are those of
y[t] = sum_k w[t, k] * E_k(xq[t]) with xq the dequantized dispatch payload:

* combine's backward is a dispatch of the output gradient g [T, H] on `GradBuffers.rows` (BF16, or MXFP8 with
  nearest rounding: grad_format), with unit weights and the forward's routing, so its rows line up with the forward's
  expert-major rows. Then d expert_out[r] = w_r * g_r (w_r the row's routing weight) and d w[t, k] = <g[t],
  expert_out[r]>, summed in FP32 on the expert rank.
* The routing-weight gradients go back to their source ranks through `GradBuffers.weights`, a BF16 Buffer of
  32 * ceil(3K / 32) columns: each row carries its FP32 dot split into three BF16 parts (hi + mid + lo, exact) in the
  columns 3k .. 3k + 2 of its top-k slot k, so a unit-weight BF16 combine sums nothing (one row per column) and the
  source rank rebuilds the FP32 value exactly.
* dispatch's backward is a BF16 (or MXFP8: input_grad_format) combine of the gradient rows on `GradBuffers.rows` with
  the unit weights of the gradient dispatch: d x[t] = sum over t's rows of their gradient (the combine's order and
  roundings: each expert rank's partial sum in FP32, rounded to BF16 -- or quantized to MXFP8 -- on the wire, then the
  ranks' sum in FP32, rounded to BF16).

Rows that are alignment padding or past the rows in use are zero in `routed.x` and get zero gradients, so experts
that run on whole segments (or on all R rows) see no garbage in either direction.

Cost: backward moves g at BF16 (or MXFP8) width out and the input gradient at BF16 (or MXFP8) width back, plus a small
dispatch and combine of 32 * ceil(3K / 32) BF16 columns for the routing weights; none of it is fused into a GEMM.

Streams: `dispatch` and `combine` take a comm_stream, as the Buffer's calls do, so that the forward's communication
overlaps work the caller enqueues meanwhile (a shared expert, say). The dispatch's results are waited for where they
are read (RoutedTokens.result and .x; ExpertMLP after quantizing its weights); the combine's output must be waited
for by the caller (its done_event). The backward passes run on the stream autograd gives them: the one that was
current when `dispatch` / `combine` were called. What runs beside a comm_stream call must not be another collective
(another Buffer's calls, another layer's backward, an NCCL all-reduce): the ranks could start the two in different
orders and wait on each other. CUDA graphs (nvlink backend): forward and backward make no host synchronization, so a
whole step (dispatch, experts, combine, loss.backward()) can be captured in one graph and replayed, torch's recipe
(warm-up steps on a side stream, the leaves' .grad set to None before the capture; tests/test_training.py
graph_worker). The reference backend refuses capture. The backward calls are collective like the forward's:
every rank must call backward through the same layers (wherever the combine's output reaches the loss, both backward
passes run on every rank and make all their calls, whatever the rank's own tensors require; see the Functions). A rank
that skips one gets its peers' timeouts, as a missing forward call does. This holds for a plain `loss.backward()`:
`torch.autograd.grad(...)` and `backward(inputs=...)` run only the nodes on the way to the tensors they name, which
may leave out one of these backward passes on some ranks and not others (they then time out). Not twice
differentiable.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import _ext, formats
from ._compile import eager_only
from .buffer import Buffer
from .types import DispatchResult

GRAD_FORMATS = ("bf16", "mxfp8")


def weights_hidden(num_topk: int) -> int:
    """Columns of GradBuffers.weights: three BF16 parts per top-k slot, rounded up to the 32-column granularity of
    every Buffer. num_topk: a positive int."""
    num_topk = formats._as_int(num_topk, "num_topk")
    if num_topk <= 0:
        raise ValueError(f"num_topk must be positive, got {num_topk}")
    return 32 * -(-3 * num_topk // 32)


def _routing_sizes(config) -> tuple:
    return (config.world_size, config.num_experts, config.num_topk, config.max_tokens_per_rank,
            config.expert_alignment)


@dataclass(frozen=True)
class GradBuffers:
    """The two Buffers backward uses (made by `create`, or by hand with the same routing sizes as the forward Buffer).

    rows: hidden H, dispatch_format "bf16" or "mxfp8" (the output gradient's wire format), combine_format "bf16" or
        "mxfp8" (the input gradient's).
    weights: hidden weights_hidden(num_topk), both formats "bf16" (the routing-weight gradients).
    """

    rows: Buffer
    weights: Buffer

    @staticmethod
    @eager_only
    def create(buffer: Buffer, grad_format: str = "bf16", backend: Optional[str] = None,
               input_grad_format: str = "bf16") -> "GradBuffers":
        """Collective (every rank of buffer.group): the backward Buffers for `buffer`'s routing sizes.

        grad_format: the output gradient's dispatch format, "bf16" (default, exact) or "mxfp8" (E4M3 + UE8M0 per 32,
            nearest rounding: half the bytes, ~2^-4 relative error per element).
        backend: None = buffer.backend ("reference" or "nvlink").
        input_grad_format: the combine format of the input gradient's rows (dispatch's backward), "bf16" (default)
            or "mxfp8" (nearest, as above; each expert rank's sum of a token's gradient rows is quantized once)."""
        if not isinstance(buffer, Buffer):
            raise TypeError(f"GradBuffers.create takes the forward's ep_comm.Buffer, got {type(buffer).__name__}")
        if grad_format not in GRAD_FORMATS:
            raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {grad_format!r}")
        if input_grad_format not in GRAD_FORMATS:
            raise ValueError(f"input_grad_format must be one of {GRAD_FORMATS}, got {input_grad_format!r}")
        cfg = buffer.config
        common = dict(num_experts=cfg.num_experts, num_topk=cfg.num_topk, max_tokens_per_rank=cfg.max_tokens_per_rank,
                      expert_alignment=cfg.expert_alignment, num_sms=cfg.num_sms, num_local_sms=cfg.num_local_sms,
                      timeout_s=cfg.timeout_s, backend=buffer.backend if backend is None else backend,
                      check_inputs=False)
        # An nvlink Buffer binds to the GPU current at its creation: the forward Buffer's, whichever is current now
        # (the reference backend has no GPU of its own: an index-less device leaves the current one).
        with _ext.cuda_device(getattr(buffer._backend, "torch_device", torch.device("cuda"))):
            rows = Buffer(buffer.group, hidden=cfg.hidden, dispatch_format=grad_format, combine_format=input_grad_format,
                          **common)
            try:
                weights = Buffer(buffer.group, hidden=weights_hidden(cfg.num_topk), dispatch_format="bf16",
                                 combine_format="bf16", **common)
            except BaseException:
                rows.destroy()
                raise
        return GradBuffers(rows=rows, weights=weights)

    def check_for(self, buffer: Buffer) -> None:
        """ValueError unless these Buffers can carry `buffer`'s backward (same group, routing sizes and hidden; the
        formats above)."""
        for name, grad in (("rows", self.rows), ("weights", self.weights)):
            if not isinstance(grad, Buffer):
                raise TypeError(f"GradBuffers.{name} must be an ep_comm.Buffer, got {type(grad).__name__}")
            if grad.rank != buffer.rank:  # (what can be seen of the group: the sizes are compared below)
                raise ValueError(f"GradBuffers.{name} is rank {grad.rank} of its group, the forward Buffer rank "
                                 f"{buffer.rank}: they must run on the same process group")
            if _routing_sizes(grad.config) != _routing_sizes(buffer.config):
                raise ValueError(f"GradBuffers.{name} has other routing sizes (world size, experts, top-k, "
                                 f"max_tokens_per_rank, alignment) than the forward Buffer: "
                                 f"{_routing_sizes(grad.config)} vs {_routing_sizes(buffer.config)}")
            if grad.backend != buffer.backend:  # (their results differ in row count: nvlink returns its capacity)
                raise ValueError(f"GradBuffers.{name} uses the {grad.backend} backend, the forward Buffer "
                                 f"{buffer.backend}: they must use the same")
            allowed = GRAD_FORMATS if name == "rows" else ("bf16",)
            if grad.config.combine_format not in allowed:
                raise ValueError(f"GradBuffers.{name} must combine in {' or '.join(allowed)}, has "
                                 f"{grad.config.combine_format!r}")
        if self.rows.config.hidden != buffer.config.hidden:
            raise ValueError(f"GradBuffers.rows must have the forward Buffer's hidden ({buffer.config.hidden}), has "
                             f"{self.rows.config.hidden}")
        if self.rows.config.dispatch_format not in GRAD_FORMATS:
            raise ValueError(f"GradBuffers.rows must dispatch in one of {GRAD_FORMATS}, has "
                             f"{self.rows.config.dispatch_format!r}")
        want = weights_hidden(buffer.config.num_topk)
        if self.weights.config.hidden != want or self.weights.config.dispatch_format != "bf16":
            raise ValueError(f"GradBuffers.weights must be a bf16 / bf16 Buffer of hidden {want}, has hidden "
                             f"{self.weights.config.hidden} and dispatch format "
                             f"{self.weights.config.dispatch_format!r}")

    def destroy(self) -> None:
        """Collective, as Buffer.destroy: frees both Buffers (also on leaving a `with` block)."""
        self.rows.destroy()
        self.weights.destroy()

    def __enter__(self) -> "GradBuffers":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.destroy()


class _Link:
    """What a dispatch and the backward passes of its combines share: the forward's routing and result, and the
    handle of the unit-weight gradient dispatch (set by combine's backward, reused by dispatch's backward)."""

    def __init__(self, buffer: Buffer, grads: GradBuffers, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        self.buffer = buffer
        self.grads = grads
        self.topk_idx = topk_idx
        self.unit_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        self.topk_weights = topk_weights
        self.result: Optional[DispatchResult] = None
        self.unit_handle = None

    def dispatch_gradient(self, grad_y: torch.Tensor) -> torch.Tensor:
        """The output gradient to the expert ranks (GradBuffers.rows): bf16 [R, H] rows (BF16: the payload itself;
        MXFP8: E4M3 * 2^k, exact in BF16 but below 2^-126). Rows not in use are not masked: combine_backward_rows
        ignores them."""
        sent = self.grads.rows.dispatch(grad_y.to(torch.bfloat16).contiguous(), self.topk_idx, self.unit_weights,
                                        check_inputs=False)
        self.unit_handle = sent.handle
        return formats.dequantize(sent.x, torch.bfloat16)

    def unit_weight_handle(self):
        """A handle of GradBuffers.rows whose combine sums a token's rows with weight 1: the gradient dispatch's, or,
        when no combine's backward made one (routed.x used without combine), a dispatch of zero rows made here."""
        if self.unit_handle is None:
            zeros = torch.zeros(self.topk_idx.shape[0], self.buffer.config.hidden, dtype=torch.bfloat16,
                                device=self.topk_idx.device)
            self.unit_handle = self.grads.rows.dispatch(zeros, self.topk_idx, self.unit_weights,
                                                        check_inputs=False).handle
        return self.unit_handle


def _mask_rows(t: torch.Tensor, rows_in_use: torch.Tensor) -> torch.Tensor:
    """t [R, ...] with zeros in the rows not in use (rows_in_use bool [R]); float8 tensors through their bytes."""
    shape = (-1,) + (1,) * (t.dim() - 1)
    if t.element_size() == 1:
        return torch.where(rows_in_use.view(shape), t.view(torch.uint8), 0).view(t.dtype)
    return torch.where(rows_in_use.view(shape), t, 0)  # (a Python zero: no 0-dim tensor to fill on the device)


def _dense_rows(payload, dtype: torch.dtype, rows_in_use: torch.Tensor) -> torch.Tensor:
    """formats.dequantize, zero on the rows not in use (padding rows are zero already; the nvlink capacity rows past the
    rows in use are not written by the dispatch and may hold anything, NaN included). The mask goes where it is
    cheapest: NVFP4's scales and amax (a zero scale and amax make every value of the row 0, whatever its codes: E2M1
    codes are finite), MXFP8's codes and scales (both: a left-over scale byte 0xFF is E8M0's NaN, which makes even a
    zero code NaN; a zero byte is 2^-127, finite), BF16's rows."""
    if isinstance(payload, formats.NVFP4Tensor):
        return formats.dequantize(dataclasses.replace(payload, scales=_mask_rows(payload.scales, rows_in_use),
                                                      amax=_mask_rows(payload.amax, rows_in_use)), dtype)
    if isinstance(payload, formats.MXFP8Tensor):
        return formats.dequantize(dataclasses.replace(payload, data=_mask_rows(payload.data, rows_in_use),
                                                      scales=_mask_rows(payload.scales, rows_in_use)), dtype)
    return formats.dequantize(_mask_rows(payload, rows_in_use), dtype)


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class BackwardRows:
    """What `combine_backward_rows` returns, for the R rows of a dispatch layout of hidden H.

    grad_expert_out: bf16 [R, H], bf16(w * g) on the rows in use, zero on the others.
    dots: fp32 [R], <g, expert_out> on the rows in use (a fixed FP32 sum order, csrc/training_rows.h), zero on the
        others.
    weight_rows: bf16 [R, weight_columns] or None (no topk_slot given): the rows GradBuffers.weights combines back to
        the source ranks, each row's dot as three bf16 parts (split_fp32_in_bf16) in the columns 3 s .. 3 s + 2 of its
        top-k slot s, zeros elsewhere and on the rows not in use.
    """

    grad_expert_out: torch.Tensor
    dots: torch.Tensor
    weight_rows: Optional[torch.Tensor]


_CHUNK = 256  # columns per chunk in the kernel's sum order: 32 lanes x 8 contiguous columns (one 16-byte load each)


def _weight_rows_reference(dots: torch.Tensor, in_use: torch.Tensor, topk_slot: torch.Tensor,
                           weight_columns: int) -> torch.Tensor:
    """bf16 [R, weight_columns]: the three parts of each dot in row r's columns 3 topk_slot[r] + 0, 1, 2 (rows in use;
    a slot past the columns writes what fits, as the kernel does -- the public functions refuse that on CPU tensors,
    see combine_backward_rows), zeros elsewhere."""
    parts = split_fp32_in_bf16(dots)  # bf16 [R, 3]
    first = torch.where(in_use, 3 * topk_slot.long(), torch.full((), -3, dtype=torch.long, device=dots.device))
    part_of_column = torch.arange(weight_columns, device=dots.device) - first[:, None]  # [R, W]
    rows = torch.zeros(dots.shape[0], weight_columns, dtype=torch.bfloat16, device=dots.device)
    for part in range(3):
        rows = torch.where(part_of_column == part, parts[:, part:part + 1], rows)
    return rows


def _check_backward_rows_args(g, expert_out, row_weight, src_rank, topk_slot, weight_columns) -> None:
    """combine_backward_rows's (and its reference's) arguments; ValueError naming the first wrong one."""
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"combine_backward_rows: g must be a bf16 [R, H] tensor, got {type(g).__name__}")
    num_rows = g.shape[0] if g.dim() == 2 else -1
    checks = [("g", g, torch.bfloat16, tuple(g.shape)), ("expert_out", expert_out, torch.bfloat16, tuple(g.shape)),
              ("row_weight", row_weight, torch.float32, (num_rows,)), ("src_rank", src_rank, torch.int32, (num_rows,))]
    if topk_slot is not None:
        checks.append(("topk_slot", topk_slot, torch.int32, (num_rows,)))
    for name, tensor, dtype, shape in checks:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape \
                or tensor.device != g.device:
            raise ValueError(f"combine_backward_rows: {name} must be {dtype} {list(shape)} on {g.device} (g bf16 "
                             f"[R, H]), got {type(tensor).__name__} {getattr(tensor, 'dtype', '')} "
                             f"{list(getattr(tensor, 'shape', []))} on {getattr(tensor, 'device', '')}")
    if g.dim() != 2 or g.shape[1] % 32:
        raise ValueError(f"combine_backward_rows: g must be [R, H] with H % 32 == 0, got {list(g.shape)}")
    if topk_slot is not None and (isinstance(weight_columns, bool) or not isinstance(weight_columns, int)
                                  or weight_columns <= 0 or weight_columns % 32):
        raise ValueError(f"combine_backward_rows: weight_columns must be a positive multiple of 32 with topk_slot, "
                         f"got {weight_columns!r}")
    if topk_slot is None and weight_columns:
        raise ValueError(f"combine_backward_rows: weight_columns={weight_columns!r} asks for weight rows, which need "
                         "topk_slot")
    if topk_slot is not None and not topk_slot.is_cuda:  # (CPU tensors only: on CUDA this would be a host sync)
        slots = topk_slot[src_rank >= 0]
        if slots.numel() and (int(slots.min()) < 0 or 3 * int(slots.max()) + 3 > weight_columns):
            raise ValueError(f"combine_backward_rows: topk_slot of the rows in use must be in [0, "
                             f"{weight_columns // 3}) for weight_columns={weight_columns} (3 columns per slot), got "
                             f"[{int(slots.min())}, {int(slots.max())}]")


@formats._keeps_subnormals  # (its FP32 sums and products follow NUMERICS.md on a CPU thread that flushes them)
def combine_backward_rows_reference(g: torch.Tensor, expert_out: torch.Tensor, row_weight: torch.Tensor,
                                    src_rank: torch.Tensor, topk_slot: Optional[torch.Tensor] = None,
                                    weight_columns: int = 0) -> BackwardRows:
    """`combine_backward_rows` in torch (csrc/training_rows.h, the same bits, its FP32 sum order included): the
    tests' oracle and the path without ep_comm._C. The same arguments, checked the same way. Rows with src_rank < 0
    give zeros whatever they hold."""
    _check_backward_rows_args(g, expert_out, row_weight, src_rank, topk_slot, weight_columns)
    num_rows, hidden = g.shape
    in_use = src_rank >= 0
    zero = torch.zeros((), dtype=torch.float32, device=g.device)  # (FP32 whatever torch's default dtype)
    g_rows = torch.where(in_use[:, None], g.float(), zero)
    weight = torch.where(in_use, row_weight.float(), zero)
    grad = (g_rows * weight[:, None]).to(torch.bfloat16)
    products = g_rows * torch.where(in_use[:, None], expert_out.float(), zero)
    padded = -(-hidden // _CHUNK) * _CHUNK  # (zero products past H change no sum: the sums start at +0)
    products = torch.nn.functional.pad(products, (0, padded - hidden)).view(num_rows, padded // _CHUNK, 32, 8)
    lanes = torch.zeros(num_rows, 32, dtype=torch.float32, device=g.device)
    for chunk in range(padded // _CHUNK):  # lane l: its 8 columns of chunk 0, then of chunk 1, ...
        for column in range(8):
            lanes = lanes + products[:, chunk, :, column]
    for d in (16, 8, 4, 2, 1):  # the warp's shuffle-down tree
        lanes = torch.cat([lanes[:, :d] + lanes[:, d:2 * d], lanes[:, d:]], dim=1)
    dots = lanes[:, 0].contiguous()
    weight_rows = None if topk_slot is None else _weight_rows_reference(dots, in_use, topk_slot, weight_columns)
    return BackwardRows(grad_expert_out=grad, dots=dots, weight_rows=weight_rows)


@eager_only
def combine_backward_rows(g: torch.Tensor, expert_out: torch.Tensor, row_weight: torch.Tensor,
                          src_rank: torch.Tensor, topk_slot: Optional[torch.Tensor] = None,
                          weight_columns: int = 0) -> BackwardRows:
    """Combine's backward on the expert rank in one pass (csrc/training_rows.h on CUDA tensors where ep_comm._C's
    kernels can run, else its torch form, with a warning once for CUDA tensors; the same bits either way).

    g, expert_out: bf16 [R, H] (H % 32 == 0): the output gradient dispatched to the expert rank, and the expert
        outputs; row_weight fp32 [R] and src_rank int32 [R]: the DispatchResult's topk_weight and src_rank (rows with
        src_rank < 0 are not in use). topk_slot int32 [R] (the DispatchResult's) and weight_columns (a multiple of
        32, at least 3 x num_topk: weights_hidden) ask for BackwardRows.weight_rows too. A row in use whose slot's
        three columns fall outside weight_columns is refused for CPU tensors; for CUDA tensors that check would
        read topk_slot on the host (a sync, and no CUDA graph), so there the caller guarantees it (the kernel
        writes only the columns that fit) -- ep_comm.training's backward passes weights_hidden(num_topk).
    Returns BackwardRows (grad_expert_out = bf16(w * g), the FP32 dots <g, expert_out>, weight_rows)."""
    if not (isinstance(g, torch.Tensor) and g.is_cuda and formats._use_cuda("auto", g)):
        # (formats._use_cuda: no _C, or a GPU it has no kernel image for, warns once and takes the torch form. The
        # torch form checks its arguments itself: checking them here too would run its CPU slot check twice.)
        return combine_backward_rows_reference(g, expert_out, row_weight, src_rank, topk_slot, weight_columns)
    _check_backward_rows_args(g, expert_out, row_weight, src_rank, topk_slot, weight_columns)
    g, expert_out = _ext.aligned_contiguous(g, 16), _ext.aligned_contiguous(expert_out, 16)
    row_weight, src_rank = row_weight.contiguous(), src_rank.contiguous()
    num_rows, hidden = g.shape
    grad = torch.empty_like(g)
    dots = torch.empty(num_rows, dtype=torch.float32, device=g.device)
    weight_rows = None
    if topk_slot is not None:
        topk_slot = topk_slot.contiguous()
        weight_rows = torch.empty(num_rows, weight_columns, dtype=torch.bfloat16, device=g.device)
    with _ext.cuda_device(g.device):
        _ext.require_cuda_extension("the training kernels").combine_backward_rows(
            g.data_ptr(), expert_out.data_ptr(), row_weight.data_ptr(), src_rank.data_ptr(), num_rows, hidden,
            grad.data_ptr(), dots.data_ptr(), 0 if topk_slot is None else topk_slot.data_ptr(),
            weight_columns if topk_slot is not None else 0, 0 if weight_rows is None else weight_rows.data_ptr(),
            _ext.current_raw_stream(g.device))
    return BackwardRows(grad_expert_out=grad, dots=dots, weight_rows=weight_rows)


def _truncate_to_bf16(values: torch.Tensor) -> torch.Tensor:
    """fp32 values with their low 16 bits cleared, as bf16: exact (the same sign, exponent and top 7 mantissa bits)."""
    return (values.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@formats._keeps_subnormals
def split_fp32_in_bf16(values: torch.Tensor) -> torch.Tensor:
    """fp32 [...] -> bf16 [..., 3] with (hi + mid) + lo == values exactly in fp32, for every finite value of magnitude
    2^-110 or more (below, lo may lose bits under BF16's subnormal spacing 2^-133). hi is `values` truncated to BF16
    (exact, never overflows), the remainder has at most 16 significant bits, mid is it truncated, and what is left
    (at most 8 bits) is lo. Non-finite values travel in hi alone. values: float32 (other dtypes are refused: float64
    would lose bits before the split, and narrower ones need no split)."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
        raise TypeError(f"split_fp32_in_bf16 takes a float32 tensor, got "
                        f"{getattr(values, 'dtype', type(values).__name__)}")
    values = values.contiguous()
    hi = _truncate_to_bf16(values)
    rest = values - hi.float()
    mid = _truncate_to_bf16(rest)
    lo = (rest - mid.float()).to(torch.bfloat16)
    finite = torch.isfinite(values)
    zero = torch.zeros((), dtype=torch.bfloat16, device=values.device)
    hi = torch.where(finite, hi, values.to(torch.bfloat16))  # (Inf stays Inf; NaN stays NaN whatever its payload)
    return torch.stack((hi, torch.where(finite, mid, zero), torch.where(finite, lo, zero)), dim=-1)


@formats._keeps_subnormals
def join_bf16_parts(parts: torch.Tensor) -> torch.Tensor:
    """The inverse of split_fp32_in_bf16: bf16 [..., 3] -> fp32 [...], (hi + mid) + lo."""
    if not isinstance(parts, torch.Tensor) or parts.dtype != torch.bfloat16:
        raise TypeError(f"join_bf16_parts takes a bf16 tensor (split_fp32_in_bf16's parts), got "
                        f"{getattr(parts, 'dtype', type(parts).__name__)}")
    if parts.dim() == 0 or parts.shape[-1] != 3:
        raise ValueError(f"join_bf16_parts takes bf16 [..., 3] (split_fp32_in_bf16's parts), got {list(parts.shape)}")
    parts = parts.float()
    return (parts[..., 0] + parts[..., 1]) + parts[..., 2]


# Collective backward: every rank must make the same Buffer calls in backward, whatever its own data. Autograd runs a
# node only where something that requires grad lies behind it, and a rank's x, routing weights or expert outputs may
# not (a rank whose experts got no rows returns zeros). So dispatch also takes an `anchor`, a leaf that always
# requires grad, and passes a `token` (which therefore requires grad too) to combine: wherever y reaches the loss,
# combine's backward and then dispatch's backward run on every rank, and each makes all its calls (the routing-weight
# exchange included, whether or not this rank's weights want a gradient).
class _DispatchFunction(torch.autograd.Function):
    """x [T, H] -> (carrier [R, H], token): Buffer.dispatch; backward: a unit-weight combine (BF16 or MXFP8) of the
    rows' gradients on GradBuffers.rows. The carrier is a zero tensor of no memory (an expanded 0-dim zero): it only
    carries the gradient of the dispatched rows back here. _DenseRowsFunction makes the dense rows from it when asked for
    (RoutedTokens.x); expert code that reads the payload itself (ExpertMLP) takes the carrier, and the dequantize pass
    over the capacity rows never runs."""

    @staticmethod
    def forward(ctx, x, anchor, link: _Link, dtype: torch.dtype, check_inputs, comm_stream, done_event):
        result = link.buffer.dispatch(x.detach(), link.topk_idx, link.topk_weights.detach(), check_inputs=check_inputs,
                                      comm_stream=comm_stream, done_event=done_event)
        link.result = result
        ctx.link = link
        ctx.set_materialize_grads(False)
        token = torch.zeros((), device=x.device)
        carrier = torch.zeros((), dtype=dtype, device=x.device).expand(result.num_rows, link.buffer.config.hidden)
        return carrier, token

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows, grad_token):
        link = ctx.link
        if grad_rows is None:  # (the rows do not reach the loss on this rank; the combine is collective all the same)
            grad_rows = torch.zeros(link.result.num_rows, link.buffer.config.hidden, dtype=torch.bfloat16,
                                    device=link.topk_idx.device)
        # (No mask: the combine reads the rows in use only, not padding or capacity rows.)
        grad_x = link.grads.rows.combine(grad_rows.to(torch.bfloat16).contiguous(), link.unit_weight_handle())
        link.unit_handle = None  # (its arena holds the gradient rows: free it with this backward)
        return grad_x, None, None, None, None, None, None


class _DenseRowsFunction(torch.autograd.Function):
    """carrier [R, H] -> the dense rows: the dispatch payload dequantized (in the carrier's dtype), zero on the rows
    not in use; straight through in backward (the gradient goes to the carrier, and from it to dispatch's backward)."""

    @staticmethod
    def forward(ctx, carrier, link: _Link):
        return _dense_rows(link.result.x, carrier.dtype, link.result.src_rank >= 0)  # (src_rank -1: not in use)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        return grad_rows, None


class _CombineFunction(torch.autograd.Function):
    """(expert_out [R, H], topk_weights [T, K], token) -> y [T, H]: Buffer.combine; backward: the output gradient
    dispatched on GradBuffers.rows, the routing-weight gradients through GradBuffers.weights."""

    @staticmethod
    def forward(ctx, expert_out, topk_weights, token, link: _Link, comm_stream, done_event):
        # (topk_weights is an input only so that autograd delivers its gradient here: the combine applies the
        # handle's copy of the weights the dispatch was given, which `combine` passes as this very tensor.)
        y = link.buffer.combine(expert_out.detach(), link.result.handle, comm_stream=comm_stream,
                                done_event=done_event)
        ctx.save_for_backward(expert_out.detach())
        ctx.link = link
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        link = ctx.link
        (expert_out,) = ctx.saved_tensors
        g_rows = link.dispatch_gradient(grad_y)  # bf16 [R, H]
        # d expert_out = f(w * g), zero on rows not in use (capacity rows: whatever the dispatch left there, NaN
        # included, never reaches the experts' backward), and the routing-weight dots as the rows that carry them
        # back, in one pass.
        rows = combine_backward_rows(g_rows, expert_out, link.result.topk_weight, link.result.src_rank,
                                     link.result.topk_slot, link.grads.weights.config.hidden)
        grad_weights = _routing_weight_gradient(link, rows.weight_rows)  # (collective: on every rank)
        token_grad = torch.zeros((), device=grad_y.device)
        return (rows.grad_expert_out if ctx.needs_input_grad[0] else None,
                grad_weights if ctx.needs_input_grad[1] else None, token_grad, None, None, None)


def _routing_weight_gradient(link: _Link, weight_rows: torch.Tensor) -> torch.Tensor:
    """d w[t, k] = dots[r] for the row r of (t, k) (<g[t], expert_out[r]>, computed on the expert rank), carried back
    exactly as three BF16 parts per slot through GradBuffers.weights: weight_rows bf16 [R, weights_hidden(K)]
    (BackwardRows.weight_rows), combined with unit weights, so each column of a token's result is one row's part.
    Returns fp32 [T, K] (0 on masked slots)."""
    num_tokens, num_topk = link.topk_idx.shape
    # The combine needs a handle of GradBuffers.weights with the forward's routing and unit weights: a dispatch of
    # zero rows, T x width bf16, the smallest that makes one.
    placeholder = torch.zeros(num_tokens, link.grads.weights.config.hidden, dtype=torch.bfloat16,
                              device=link.topk_idx.device)
    handle = link.grads.weights.dispatch(placeholder, link.topk_idx, link.unit_weights, check_inputs=False).handle
    back = link.grads.weights.combine(weight_rows, handle)  # bf16 [T, width]
    return join_bf16_parts(back[:, :3 * num_topk].reshape(num_tokens, num_topk, 3)).to(link.topk_weights.dtype)


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class RoutedTokens:
    """What `dispatch` returns.

    result: the Buffer's DispatchResult (payload in the wire format, counts, offsets, per-row metadata, handle): e.g.
        result.x (NVFP4) for a weight gradient from the saved quantized activations (formats.nvfp4_to_mxfp8_transposed).
        After a dispatch on a comm_stream, reading `result` makes the current stream wait for the dispatch (`wait`).
    x: dense [R, H] rows in the expert-major layout (dtype as asked, bfloat16 by default): the dequantized dispatch
        payload, zero on padding and on the rows past expert_offsets[-1]; differentiable with respect to the x given
        to `dispatch` (straight-through the quantizer). Made on first access (one dequantize pass over the R rows,
        R x H values of memory), with autograd on even under torch.no_grad(), then kept. Waits for the dispatch as
        `result` does.
    topk_weights: the routing weights given to `dispatch`; `combine` returns their gradient through them.
    carrier: [R, H] zeros of x's dtype that take no memory (an expanded 0-dim tensor), differentiable like x: for
        expert code that computes from `result.x` itself (ExpertMLP does) and returns the gradient of the dispatched
        rows through this instead, so that x is never made. (No data: reading it needs no wait.)
    done_event: the torch.cuda.Event recorded on the comm_stream after the dispatch, or None (no comm_stream).
    """

    topk_weights: torch.Tensor
    carrier: torch.Tensor = dataclasses.field(repr=False, compare=False)
    link: Any = dataclasses.field(repr=False, compare=False)  # the state the backward passes share (_Link)
    token: Any = dataclasses.field(repr=False, compare=False)  # dispatch's output that combine takes
    done_event: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)
    # (The CUDA-graph capture the comm_stream dispatch was made in, 0 outside one: _ext.capture_id.)
    capture: int = dataclasses.field(default=0, repr=False, compare=False)

    @eager_only
    def wait(self) -> None:
        """Make the current stream (of the tokens' device) wait for the dispatch: a no-op unless it ran on a
        comm_stream. Work enqueued on the current stream before this overlaps the dispatch; work after it sees its
        results. No host synchronization; capturable. CUDA refuses waits across a capture's boundary, so the wait is
        made only from the capture the dispatch was made in (or, for an eager dispatch, outside any capture): a
        captured dispatch read after the graph's replay on the replay's stream is ordered by the replay itself; reads
        of an eager dispatch inside a capture, or of a captured one on another stream, are the caller's to order."""
        if self.done_event is None:
            return
        device = self.carrier.device
        capture = _ext.capture_id(_ext.current_raw_stream(device))
        if capture == self.capture:
            torch.cuda.current_stream(device).wait_event(self.done_event)
        elif capture != 0:
            # (A read after the graph's replay, outside any capture, is ordered by the replay; one inside another
            # capture is not, and no wait can be made from there.)
            _ext.warn_once("ep_comm.training: a comm_stream dispatch's result was read inside a CUDA-graph capture "
                           "other than the dispatch's own (or inside one, of an eager dispatch): no wait is made "
                           "there, so order the read after the dispatch yourself (e.g. make the dispatch inside the "
                           "same capture)")

    @property
    def result(self) -> DispatchResult:
        self.wait()
        return self.link.result

    @functools.cached_property
    def x(self) -> torch.Tensor:
        self.wait()
        with torch.enable_grad():  # (a first access under no_grad must not cut the rows off from dispatch's backward)
            return _DenseRowsFunction.apply(self.carrier, self.link)


@eager_only
def dispatch(buffer: Buffer, grads: GradBuffers, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             *, dtype: torch.dtype = torch.bfloat16, check_inputs: Optional[bool] = None,
             comm_stream: Optional[torch.cuda.Stream] = None) -> RoutedTokens:
    """`Buffer.dispatch` with autograd: x bfloat16 [T, H] (may require grad), topk_idx int [T, K] (-1 masked),
    topk_weights float32 [T, K] (may require grad; its gradient comes from `combine`'s backward). dtype: the dense rows'
    dtype (bfloat16, float16 or float32). check_inputs: as Buffer.dispatch. Collective, like Buffer.dispatch; so is its
    backward (a BF16 or MXFP8 combine on grads.rows).

    comm_stream: run the dispatch on this CUDA stream (as Buffer.dispatch does: after the work enqueued so far on the
    current stream), so that what the caller enqueues next on the current stream overlaps it. The returned
    RoutedTokens makes the current stream wait for it where its results are read (`result`, `x`; ExpertMLP waits
    after quantizing its weights), so code on the stream current at the read, in the capture the dispatch was made in
    (or outside any, for an eager one), never sees them early; `routed.wait()` does it explicitly and
    `routed.done_event` is the event. (`combine` is ordered after it by the Buffer itself.) x and topk_weights are
    read on comm_stream after this returns: do not write them in place until the dispatch is done (wait for it on the
    stream that writes them). The backward pass runs on the current stream of this call, not on comm_stream."""
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer must be an ep_comm.Buffer, got {type(buffer).__name__}")
    if not isinstance(grads, GradBuffers):
        raise TypeError(f"grads must be ep_comm.training.GradBuffers, got {type(grads).__name__}")
    grads.check_for(buffer)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    for name, value in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    # (The forward's routing is kept for backward: a copy, so that an in-place edit after the call cannot misroute it.)
    link = _Link(buffer, grads, topk_idx.clone(), topk_weights)
    # (The anchor on the tokens' device, so that backward needs no CPU step. The token is kept by RoutedTokens, not by
    # the link: its grad_fn holds the link, which would make a reference cycle.)
    anchor = torch.zeros((), device=topk_idx.device, requires_grad=True)
    # (A wrong comm_stream is refused by Buffer.dispatch, on every rank alike, before its collective; the event is
    # made only for a real stream.)
    done_event = torch.cuda.Event() if isinstance(comm_stream, torch.cuda.Stream) else None
    carrier, token = _DispatchFunction.apply(x, anchor, link, dtype, check_inputs, comm_stream, done_event)
    capture = _ext.capture_id(comm_stream.cuda_stream) if done_event is not None else 0
    return RoutedTokens(topk_weights=topk_weights, carrier=carrier, link=link, token=token, done_event=done_event,
                        capture=capture)


@eager_only
def combine(expert_out: torch.Tensor, routed: RoutedTokens, *, comm_stream: Optional[torch.cuda.Stream] = None,
            done_event: Optional[torch.cuda.Event] = None) -> torch.Tensor:
    """`Buffer.combine` with autograd: expert_out [R, H] (bfloat16; row i the expert output for routed.x[i]) ->
    bfloat16 [T, H], the routing-weighted sum (the weights given to `dispatch`). Gradients flow to expert_out and to
    routed.topk_weights. Collective, like Buffer.combine; so is its backward (a dispatch on grads.rows and a small
    dispatch + combine on grads.weights).

    comm_stream, done_event: as for Buffer.combine: the combine runs on comm_stream after the work enqueued so far on
    the current stream, and done_event is recorded after it. The output is then not ready on the current stream: wait
    for it there (`torch.cuda.current_stream().wait_event(done_event)`, or without an event
    `torch.cuda.current_stream().wait_stream(comm_stream)`) before anything reads it, the loss included. expert_out
    is read on comm_stream after this returns: do not write it in place before then. The backward pass runs on the
    current stream of this call."""
    if not isinstance(routed, RoutedTokens):
        raise TypeError(f"routed must be what ep_comm.training.dispatch returned, got {type(routed).__name__}")
    if not isinstance(expert_out, torch.Tensor):
        raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
    link = routed.link
    return _CombineFunction.apply(expert_out, routed.topk_weights, routed.token, link, comm_stream, done_event)


# The trainable experts (ep_comm/training_experts.py), here with the rest of the training API. (Imported last: that
# module builds on RoutedTokens.)
from .training_experts import ExpertMLP, expert_mlp, quantize_expert_weights  # noqa: E402,F401
# Gradient clipping by the global norm across EP ranks and meshes (ep_comm/training_clip.py).
from .training_clip import clip_grad_norm_, grad_norm  # noqa: E402,F401
