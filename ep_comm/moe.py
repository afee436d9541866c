"""An expert-parallel MoE layer built on `ep_comm.Buffer`: router top-k -> dispatch -> experts -> combine.

`MoELayer` = router top-k -> `Buffer.dispatch` (NVFP4 tokens) -> expert SwiGLU MLP -> combine (S2F6; on the nvlink
backend with the fused experts, w2's epilogue writes the combine rows itself, see below).
Quantization points (the same for both expert paths): weights are NVFP4 without 4/6 with one FP32 amax per
expert (`pack_weights`), the w1 input is the dispatched NVFP4 token, and the w2 input is requantized to NVFP4 with
4/6 and a per-token amax.

Two expert paths:
  * "fused": the NVFP4 grouped GEMM of `ep_comm.grouped_gemm` (csrc/grouped_gemm.cu, sm_90a): w1 with SwiGLU in
    its epilogue, the NVFP4 requantization kernel, w2 -- reading the dispatch layout's device-side counts, no host
    synchronisation. Differs from the reference only by FP32 summation order (and rounding of exp in SiLU).
  * "reference": FP32 torch matmuls on dequantized operands, one expert at a time (host sync for the counts). It
    is the correctness oracle of the fused path and runs anywhere (CPU ranks included).
With the fused experts on the nvlink backend (S2F6 combine), the w2 GEMM's epilogue applies RHT + S2F6 and stores each
(token, expert) row straight into the source rank's combine area (`combine_rows`; no bf16 expert output, no separate
encode-and-send pass). With waves=True the dispatch receive and w1 overlap: the receive hands w1 each expert's rows
as they land (csrc/waves.h).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext, formats
from ._compile import eager_only
from .formats import _is_capturing
from .buffer import Buffer
from .grouped_gemm import (TOKEN_TILES, GemmWeights, _check_kernel_row_order, _check_segments, _one_amax_per_expert,
                           _check_weight_values, check_precision, check_weight_amax, exact_fp32_matmuls,
                           gemm_kernels_unavailable, has_combine_rows_kernel)


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class PackedExpertWeights:
    """NVFP4 expert weights of this rank (plain NVFP4, M = 448, one FP32 amax per expert, broadcast to rows).

    w1: NVFP4Tensor of the gate and up projections, logical shape [E_local, 2 * I, H] (gate rows first).
    w2: NVFP4Tensor of the down projection, logical shape [E_local, H, I].
    """

    w1: formats.NVFP4Tensor
    w2: formats.NVFP4Tensor

    @property
    def num_local_experts(self) -> int:
        """E_local, the experts of w1 (and w2)."""
        return self.w1.data.shape[0]


# Saved with torch.save, PackedExpertWeights loads with torch.load's default weights-only unpickling (after import ep_comm).
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([PackedExpertWeights])


def _check_packed_weights(weights: PackedExpertWeights) -> None:
    """What PackedExpertWeights promises, checked once at layer construction (device->host reads) on both expert paths,
    so that weights the fused path would refuse are not taken by the reference path (or the reverse): NVFP4Tensors,
    plain NVFP4 (e4m3_max 448, no 4/6), finite non-negative scales and amax (grouped_gemm._check_weight_values: a NaN
    amax or scale would otherwise give wrong, finite outputs on the reference path) and one amax per expert (equal
    along the rows, bit for bit)."""
    for name in ("w1", "w2"):
        w = getattr(weights, name)
        if not isinstance(w, formats.NVFP4Tensor):
            raise TypeError(f"weights.{name} must be an NVFP4Tensor (moe.pack_weights), got {type(w).__name__}")
        formats._check_nvfp4(w)
        if w.data.dim() != 3:
            raise ValueError(f"weights.{name} must be [E_local, N, K] NVFP4 weights, got data of shape "
                             f"{tuple(w.data.shape)}")
        if w.e4m3_max != formats.NVFP4_WEIGHT_E4M3_MAX:
            raise ValueError(f"weights.{name} must be plain NVFP4 (e4m3_max {formats.NVFP4_WEIGHT_E4M3_MAX}, no 4/6), "
                             f"got e4m3_max {w.e4m3_max}: build the weights with moe.pack_weights")
        _check_weight_values(w, f"weights.{name}")  # (the amax bound included: grouped_gemm.MAX_WEIGHT_AMAX)
        if not _one_amax_per_expert(w.amax):
            raise ValueError(f"weights.{name} must have one amax per expert (amax equal along the rows, bit for bit): "
                             "build the weights with moe.pack_weights")
    # Across the pair: w1 stacks gate and up rows (an even N), and both live on one device (the fused path packs each
    # where it is; a w2 elsewhere would fail inside the first forward, after the dispatch's collective).
    if weights.w1.data.shape[1] % 2:
        raise ValueError(f"weights.w1 must stack gate and up rows (an even N), got N = {weights.w1.data.shape[1]}")
    if weights.w2.data.device != weights.w1.data.device:
        raise ValueError(f"weights.w1 is on {weights.w1.data.device} but weights.w2 on {weights.w2.data.device}")


def _per_expert_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w[e]| as FP32 [E, 1] (broadcast over the rows of each expert): one reduction, no full-size temporaries (the
    max of bf16 / fp16 values is exact in their own dtype). Also the trainable experts' per-step amax
    (training_experts.quantize_expert_weights), so both quantize the same weights to the same bits."""
    return torch.linalg.vector_norm(w.detach(), ord=math.inf, dim=(1, 2)).float()[:, None]


@formats._keeps_subnormals  # (the per-expert amax too: on a flushing thread an all-subnormal expert's was 0)
def pack_weights(w1: torch.Tensor, w2: torch.Tensor) -> PackedExpertWeights:
    """Quantize master weights once, offline: w1 [E_local, 2I, H] (the I gate rows first, then the I up rows:
    `torch.cat([gate, up], dim=1)`; the layer computes silu(gate) * up) and w2 [E_local, H, I] (bf16, fp16 or fp32,
    finite; H and I multiples of 16) to NVFP4 along their input axis with one FP32 amax per expert (no 4/6, as for
    weights). The result can be saved with torch.save and loaded with torch.load (weights-only unpickling) after import
    ep_comm."""
    for name, w in (("w1", w1), ("w2", w2)):  # checked here so that errors name w1 / w2, not the quantizer's "x"
        if not isinstance(w, torch.Tensor) or w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name} must be a bfloat16, float16 or float32 tensor, got "
                            f"{getattr(w, 'dtype', type(w).__name__)}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    if w1.device != w2.device:
        raise ValueError(f"w1 is on {w1.device} and w2 on {w2.device}: give both on the layer's device")
    experts, two_i, hidden = w1.shape
    if two_i % 2:
        raise ValueError(f"w1 must be [E, 2I, H] (gate and up rows): its middle dimension {two_i} is odd")
    if w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w2 must be [E, H, I] = [{experts}, {hidden}, {two_i // 2}] for w1 {tuple(w1.shape)}, "
                         f"got {tuple(w2.shape)}")
    if w1.numel() == 0:
        raise ValueError(f"w1 and w2 must not be empty, got w1 {tuple(w1.shape)}")
    if hidden % 16 or (two_i // 2) % 16:
        raise ValueError(f"H and I must be multiples of 16 (NVFP4 blocks along w1's and w2's input axis); got "
                         f"w1 {tuple(w1.shape)} (H = {hidden}), w2 {tuple(w2.shape)} (I = {two_i // 2})")
    # Offline, so the device->host check is affordable: one Inf would make its expert's amax Inf and every weight of
    # that expert non-finite, one NaN would be encoded as a finite code (docs/NUMERICS.md), both silently.
    for name, w in (("w1", w1), ("w2", w2)):
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{name} holds NaN or Inf values; master weights must be finite")
    # Packing is not differentiable: with nn.Parameter masters, autograd would otherwise record the amax (and the
    # reference path's dequantized copies would require grad, which dispatch and combine refuse).
    with torch.no_grad():
        amax1, amax2 = _per_expert_amax(w1), _per_expert_amax(w2)
        check_weight_amax(amax1, "w1")  # (finite but too large: its NVFP4 weights would decode to Inf)
        check_weight_amax(amax2, "w2")
        return PackedExpertWeights(w1=formats.nvfp4_quantize(w1, four_over_six=False, amax=amax1),
                                   w2=formats.nvfp4_quantize(w2, four_over_six=False, amax=amax2))


@formats._keeps_subnormals
def expert_mlp_reference(tokens: formats.NVFP4Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on NVFP4 tokens [n, H] with dequantized FP32 weights w1 [2I, H], w2 [H, I]: bf16 [n, H].

    SwiGLU in FP32, then the w2 input is quantized to NVFP4 with 4/6 and a per-token amax (the fused kernel's
    quantization point), dequantized, multiplied by w2 in FP32 and rounded to bf16. An oracle, without autograd
    (the NVFP4 rounding between w1 and w2 has no gradient): weights that require grad are refused under grad mode.
    """
    for name, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
            raise TypeError(f"{name} must be the FP32 dequantized weights of one expert "
                            f"(formats.nvfp4_dequantize(weights.{name}, dtype=torch.float32)[e]), got "
                            f"{getattr(w, 'dtype', type(w).__name__)}")
        if w.requires_grad and torch.is_grad_enabled():  # (w2 would get a gradient and w1 none, silently)
            raise RuntimeError(f"expert_mlp_reference has no autograd ({name} requires grad): the NVFP4 rounding of "
                               f"the w2 input cuts the graph between w1 and w2. Run it under torch.no_grad(), or train "
                               f"with ep_comm.training.ExpertMLP")
    hidden = tokens.shape[-1] if isinstance(tokens, formats.NVFP4Tensor) else -1
    if w1.dim() != 2 or w2.dim() != 2 or w1.shape[0] % 2 or tuple(w1.shape) != (w1.shape[0], hidden) or \
            tuple(w2.shape) != (hidden, w1.shape[0] // 2) or (w1.shape[0] // 2) % 16:
        raise ValueError(f"expert_mlp_reference needs NVFP4 tokens [n, H], w1 [2I, H] and w2 [H, I] with I % 16 == 0; "
                         f"got tokens of width {hidden}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    with exact_fp32_matmuls():  # the FP32 oracle on CUDA tensors too (as grouped_gemm's reference)
        x = formats.nvfp4_dequantize(tokens, dtype=torch.float32)
        gate, up = (x @ w1.t()).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        hidden = formats.nvfp4_dequantize(formats.nvfp4_quantize(hidden, four_over_six=True), dtype=torch.float32)
        return (hidden @ w2.t()).to(torch.bfloat16)


def _fused_experts_supported(device: torch.device, hidden: int, intermediate: int) -> tuple:
    """(True, "") when the fused grouped GEMM can run on `device` (the expert weights') for these sizes, else
    (False, why)."""
    if device.type != "cuda":
        return False, f"the expert weights are on {device}, not on a CUDA device"
    why = gemm_kernels_unavailable(device)
    if why:
        return False, why
    if hidden % 64 or intermediate % 64:
        return False, f"the fused grouped GEMM needs H and I multiples of 64 (H = {hidden}, I = {intermediate})"
    return True, ""


_FUSED_NEEDS = ("fused experts need CUDA tensors on an sm_90 GPU (use expert_mlp_reference / "
                "MoELayer(expert_impl='reference'))")


def _check_fused_inputs(tokens, expert_offsets, num_tokens_per_expert, w1, w2=None, *, with_w2: bool = False) -> None:
    """fused_expert_*: refused up front off the CUDA kernels, rather than failing inside with a message about impl
    (the torch fallbacks of the pieces would sync with the host and differ in bits from expert_mlp_reference); w1 must
    carry the SwiGLU epilogue and w2 not (else a w2-shaped or un-gated result, silently); the segment tensors are
    checked before the expansion, whose own limit argument would otherwise name them. with_w2: w2 is checked too
    (fused_expert_mlp; fused_expert_hidden has none)."""
    for name, weights, swiglu in (("w1", w1, True), ("w2", w2, False))[:2 if with_w2 else 1]:
        if not isinstance(weights, GemmWeights):
            raise TypeError(f"{name} must be GemmWeights from pack_gemm_weights(weights.{name}, swiglu={swiglu}), got "
                            f"{type(weights).__name__}")
        if weights.swiglu is not swiglu:
            raise ValueError(f"{name} must be packed with pack_gemm_weights(..., swiglu={swiglu})")
        _check_kernel_row_order(weights)  # before w1 runs, rather than at w2's launch
    if not isinstance(tokens, formats.NVFP4Tensor):  # (a plain tensor's width would be misread as codes)
        raise TypeError(f"the fused experts take NVFP4 tokens (an NVFP4Tensor: a dispatch's result.x in nvfp4), got "
                        f"{type(tokens).__name__}")
    _check_segments(expert_offsets, num_tokens_per_expert, w1.num_experts)
    if w2 is not None and (w2.num_experts != w1.num_experts or w2.k != w1.out_features):
        raise ValueError(f"w2 must be packed for the same {w1.num_experts} experts with K = w1's output features "
                         f"({w1.out_features}); got {w2.num_experts} experts with K = {w2.k}")
    tokens_k = getattr(getattr(tokens, "data", None), "shape", (0, 0))[-1] * 2  # NVFP4: two codes per byte
    if tokens_k != w1.k:
        raise ValueError(f"the tokens have {tokens_k} features but w1 was packed for K = {w1.k}")
    weights = [w for w in (w1, w2) if w is not None]
    tensors = [t for t in (getattr(tokens, "data", None), *(getattr(w, "values", None) for w in weights),
                           expert_offsets, num_tokens_per_expert) if isinstance(t, torch.Tensor)]
    if len({t.device for t in tensors}) != 1 or not all(t.is_cuda for t in tensors):
        raise ValueError(f"{_FUSED_NEEDS} (tokens, expert_offsets, num_tokens_per_expert and the weights on one GPU); "
                         f"got tensors on {', '.join(sorted({str(t.device) for t in tensors}))}")
    why = gemm_kernels_unavailable(tensors[0].device) if tensors else ""
    if why:
        raise RuntimeError(f"{_FUSED_NEEDS}: {why}")


# Per-SM rates on H200 that size a wave receive (default_wave_sms), measured in this repository (bench/RESULTS.md,
# tenth session): the wave receive moves ~24 GB/s of memory traffic per SM (8 receive SMs at 4096 tokens per rank
# kept w1 waiting: ~734 MB in ~3.8 ms), and the w1 grouped GEMM runs at ~610-640 TFLOP/s over 132 SMs.
_SM_RECEIVE_BYTES_PER_S = 24e9
_SM_W1_FLOPS = 620e12 / 132
# The inexact FP8 mode's w1 (bench/RESULTS.md, fortieth and forty-first sessions: 790-802 TFLOP/s at 128 rows per
# expert, 675-696 at routed ~256).
_SM_W1_FLOPS_FP8 = 740e12 / 132


def default_wave_sms(hidden: int, intermediate: int, num_sms: int, precision: str = "exact") -> int:
    """The SMs a wave dispatch receive gets by default: enough to write rows twice as fast as the w1 GEMM consumes
    them on the other SMs, from the bytes and FLOPs per row.

    A received row costs the receive ~3.1 H bytes of memory traffic (it reads the NVFP4 row, H/2 + H/16 bytes,
    and writes it back plus its fp16 GEMM operand, 2H bytes, and two words); w1 costs 2 * H * 2I FLOPs per row.
    With per-SM rates r_receive and r_gemm (measured on H200), n receive SMs keep pace with num_sms - n GEMM SMs
    when n / (num_sms - n) >= (bytes / r_receive) / (flops / r_gemm); twice that n, clamped to [4, num_sms / 2]
    (4 when num_sms / 2 < 4).
    DeepSeek-V3 shapes (H = 7168, I = 2048) on 132 SMs: 19. precision "fp8_inexact" (the GEMM's FP8 mode): its
    operand row is H bytes instead of 2H (~2.1 H of traffic per row) and its w1 is faster (the FP8 rate above): 16
    at those shapes. (The receive's per-SM byte rate is the exact form's; the FP8 form was not measured on 2 GPUs.)
    """
    fp8 = check_precision(precision)
    for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"default_wave_sms: {name} must be a positive int, got {value!r}")
    receive_s = ((2.125 if fp8 else 3.125) * hidden + 28) / _SM_RECEIVE_BYTES_PER_S
    gemm_s = 4.0 * hidden * intermediate / (_SM_W1_FLOPS_FP8 if fp8 else _SM_W1_FLOPS)
    ratio = receive_s / gemm_s
    sms = math.ceil(2.0 * num_sms * ratio / (1.0 + ratio))
    return max(4, min(sms, num_sms // 2))


@eager_only
def fused_expert_hidden(tokens: formats.NVFP4Tensor, expert_offsets: torch.Tensor,
                        num_tokens_per_expert: torch.Tensor, w1, token_tile=None, amax_in_w1: bool = False):
    """The w2 input of the fused experts: `grouped_gemm.ExpandedRows` [R, I] (fp16 NVFP4 block values + row factor).

    w1 with SwiGLU in its epilogue (FP32 [R, I]), then NVFP4 4/6 with a per-token amax, expanded for the w2 GEMM.
    The amax spans the whole intermediate row, which no single GEMM CTA sees: by default the quantizer's own amax
    pass computes it; with amax_in_w1, w1's epilogue max-es each CTA's part into a per-row amax with atomics and
    the quantizer takes it as given. Both give bitwise the same NVFP4 rows (tests/test_grouped_gemm.py); the fused
    form measured slower on H200 (the atomics cost w1 more than the quantizer's amax pass costs: bench/RESULTS.md,
    ninth session), so it is opt-in. Other arguments as `fused_expert_mlp`.
    """
    _check_fused_inputs(tokens, expert_offsets, num_tokens_per_expert, w1)
    return _fused_expert_hidden(tokens, expert_offsets, num_tokens_per_expert, w1, token_tile, amax_in_w1)


def _fused_expert_hidden(tokens, expert_offsets, num_tokens_per_expert, w1, token_tile, amax_in_w1=False,
                         precision: str = "exact"):
    """fused_expert_hidden without the input check (MoELayer checked its device when it chose the fused path);
    precision "fp8_inexact": the FP8 mode's operand rows for both GEMM inputs (the w2 input quantized to NVFP4 4/6,
    the exact path's quantization point, and written as FP8 rows by the quantizer itself)."""
    from . import grouped_gemm as gemm
    x = gemm.expand_nvfp4_rows(tokens, num_rows_limit=expert_offsets[-1:], precision=precision)
    return _expert_hidden_from_rows(x, expert_offsets, num_tokens_per_expert, w1, token_tile, amax_in_w1)


def _expert_hidden_from_rows(x, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1, token_tile,
                             amax_in_w1: bool = False, wave=None):
    """fused_expert_hidden from tokens already expanded for the GEMM (x: grouped_gemm.ExpandedRows, whose precision
    the w2 input rows take too). With `wave` (a wave dispatch's WaveSync), w1 must be the next kernel on the stream:
    nothing is launched before it."""
    from . import grouped_gemm as gemm
    rows_in_use = expert_offsets[-1:]
    if wave is not None and amax_in_w1:
        raise ValueError("amax_in_w1 needs a zero-filled row amax before w1, which a wave w1 cannot wait for")
    hidden = torch.empty(x.num_rows, w1.out_features, dtype=torch.float32, device=x.values.device)
    row_amax = torch.zeros(x.num_rows, dtype=torch.float32, device=x.values.device) if amax_in_w1 else None
    gemm.grouped_gemm_nvfp4(x, expert_offsets, num_tokens_per_expert, w1, out_dtype=torch.float32, out=hidden,
                            token_tile=token_tile, row_amax=row_amax, wave=wave)  # silu(gate) * up
    # NVFP4 4/6 with a per-token amax, written as w2's operand rows in one kernel (bitwise formats.nvfp4_quantize's
    # CUDA kernel followed by expand_nvfp4_rows, in x's precision); rows past rows_in_use skipped.
    return gemm.quantize_expanded_rows(hidden, amax=row_amax, impl="cuda", num_rows_limit=rows_in_use,
                                       check_amax=False, precision=x.precision)


@eager_only
def fused_expert_mlp(tokens: formats.NVFP4Tensor, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                     w1, w2, token_tile=None, precision: str = "exact") -> torch.Tensor:
    """The experts of one rank on the NVFP4 grouped GEMM (sm_90a): bf16 [R, H] in the dispatch layout.

    tokens: NVFP4Tensor [R, H] in the expert-major layout (e.g. `DispatchResult.x`); expert_offsets int32 [E + 1]
    and num_tokens_per_expert int32 [E] on the device; w1, w2: `grouped_gemm.GemmWeights` from
    `pack_gemm_weights(weights.w1, swiglu=True)` / `pack_gemm_weights(weights.w2, swiglu=False)`.
    Same quantization points as `expert_mlp_reference`: SwiGLU in FP32, then NVFP4 4/6 with a per-token amax for the
    w2 input (`fused_expert_hidden`).
    Everything stays on the device (no host sync; CUDA-graph capturable). Rows at or past expert_offsets[-1] (the
    nvlink backend returns its fixed capacity) are skipped by every kernel and rows outside expert segments are
    never read, so intermediates are uninitialised and only the rows of valid experts are defined in the result
    (what `Buffer.combine` reads). CUDA tensors on an sm_90 GPU only (else an error naming the reference path).
    precision: "exact" (default) or "fp8_inexact", the grouped GEMM's opt-in FP8 mode (grouped_gemm module
    docstring; H and I multiples of 128): both GEMMs on E4M3-rounded operands, the w2 input still quantized to
    NVFP4 4/6 first (and written as FP8 rows by the quantizer). Its extra error is measured in
    bench/bench_grouped_gemm.py.
    """
    _check_fused_inputs(tokens, expert_offsets, num_tokens_per_expert, w1, w2, with_w2=True)
    if check_precision(precision):
        if w1.k % 128 or w2.k % 128:
            raise ValueError(f"the FP8 mode needs H and I multiples of 128, got H = {w1.k}, I = {w2.k}")
    hidden = _fused_expert_hidden(tokens, expert_offsets, num_tokens_per_expert, w1, token_tile, precision=precision)
    return _expert_output(hidden, expert_offsets, num_tokens_per_expert, w2, token_tile)


def _expert_output(hidden, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor, w2, token_tile
                   ) -> torch.Tensor:
    """w2 on the w2 input rows (grouped_gemm.ExpandedRows [R, I]): bf16 [R, H], only the rows of valid experts
    written (torch.empty: no fill pass)."""
    from . import grouped_gemm as gemm
    out = torch.empty(hidden.num_rows, w2.out_features, dtype=torch.bfloat16, device=hidden.values.device)
    return gemm.grouped_gemm_nvfp4(hidden, expert_offsets, num_tokens_per_expert, w2, out_dtype=torch.bfloat16,
                                   out=out, token_tile=token_tile)


def _require_expanded(result, what: str) -> None:
    """The experts read the expert-major rows of an expanding dispatch; a row-index result holds them elsewhere."""
    if getattr(result, "row_index", None) is not None:
        raise ValueError(f"MoELayer.{what} needs an expanding dispatch: this result came from dispatch(expand=False) "
                         "(rows in staging order, result.row_index); dispatch with expand=True")


def _require_nvfp4_rows(result, what: str) -> None:
    """The experts read NVFP4 rows (data, scales, amax); another format's result would fail inside them."""
    x = getattr(result, "x", None)
    if not isinstance(x, formats.NVFP4Tensor):
        kind = type(x).__name__ if not isinstance(x, torch.Tensor) else f"a {x.dtype} tensor"
        raise ValueError(f"MoELayer.{what} needs the result of an NVFP4 dispatch (a Buffer with dispatch_format="
                         f"'nvfp4', such as this layer's); got rows of {kind}")


_NOT_COPYABLE = ("MoELayer holds a communication Buffer (a process group, and device memory the other ranks write "
                 "into), which cannot be pickled or copied: save layer.state_dict() (the router) and layer.weights "
                 "(PackedExpertWeights), and build a new layer from them on every rank")


class MoELayer(torch.nn.Module):
    """Router top-k -> dispatch -> expert SwiGLU MLPs of this rank -> combine.

    Args:
        buffer: an `ep_comm.Buffer` with dispatch_format="nvfp4" (its hidden, num_experts, num_topk and
            max_tokens_per_rank bound the layer).
        router_weight: [num_experts, H], any floating dtype (kept as an fp32 copy), identical on every rank.
        weights: this rank's `PackedExpertWeights` (experts rank * E_local ... (rank + 1) * E_local - 1).
        expert_impl: "fused" (NVFP4 grouped GEMM, sm_90 GPUs), "reference" (FP32 torch matmuls), or "auto":
            fused when the layer's device supports it, else reference -- `self.expert_impl` says which was chosen
            and a warning names the reason once when a CUDA layer falls back.
        token_tile: the fused GEMM's token tile (16/32/64/128 rows per CTA); None picks it from the expected
            rows per local expert with every rank at max_tokens_per_rank (`self.token_tile` says which; None on
            the reference path, where it is unused; refused with expert_impl="reference").
        combine_rows: how expert outputs get back. True: w2's epilogue stores each (token, expert) row as RHT + S2F6
            straight into the source rank's combine area (`Buffer.begin_combine_rows`): no bf16 expert output and
            no separate encode-and-send pass; the source sums the rows in top-k slot order (local_reduce=False
            semantics: one S2F6 rounding per expert row instead of per rank-local sum; more NVLink bytes when a
            token has several experts on one rank). False: w2 writes bf16 expert rows and
            `Buffer.combine` (local_reduce=True) reduces each token's local experts on the expert rank and sends one
            row per (token, rank). None (default): True when it can run (fused experts, nvlink backend, S2F6
            combine) -- measured 3% faster at 4096 tokens per rank on 2xH200 and on par at 128 (bench/RESULTS.md);
            `self.combine_rows` says which.
        waves: overlap the dispatch receive with w1 (`Buffer.dispatch_waves`, csrc/waves.h): the receive runs on
            wave_sms SMs and writes the GEMM's operand rows expert by expert, and w1 runs behind it on the other
            SMs, starting each expert as soon as its rows are in (no separate expansion pass). Same results
            bitwise. Needs the fused experts and the nvlink backend. None (default): on where it can run --
            measured on 2xH200 (bench/RESULTS.md, tenth session) 1.8-4.5% faster at 128 tokens per rank and within
            -0.8..-0.2% (noise) at 4096, with the classic grouped GEMM. Behind the warp-specialized GEMM (the default
            since 2026-12-05) the waves measured 0.1-2.5% slower at 4096 tokens and on par at 128 at world 1 (one
            H200 and one H100, where they have nothing to hide); on 2 GPUs that pairing is not yet measured.
            `self.waves` says which.
        wave_sms: SMs of the wave receive; None: `default_wave_sms` (from the bytes and FLOPs per row), clamped to
            the Buffer's receive block count (`self.wave_sms`; None without waves; refused with waves=False).
        expert_precision: "exact" (default) or "fp8_inexact": the fused grouped GEMM's opt-in FP8 mode
            (`fused_expert_mlp(precision=...)`, docs/GEMM.md: E4M3-rounded operands, faster from ~64 rows per
            expert, slower at 16). It needs the fused experts and H, I multiples of 128; waves and combine rows work
            with it as with the exact mode (the wave receive and the w2 input's quantizer then write FP8 operand rows,
            and w2's combine-row epilogue runs on them).
    forward(x): x bf16 [T, H] -> bf16 [T, H] ([..., H] -> [..., H] too: the leading dimensions are the tokens); the
        routing weights are the softmax over the top-k logits.
    Module state: the router is a buffer (`router_weight`, in state_dict; a module-wide dtype cast casts it). The
    expert weights are packed for the device they were given on and are not module state: `state_dict()` does not
    hold them (save `layer.weights`, a PackedExpertWeights), and moving the layer to another device (`.cuda()`,
    `.to(device)`) raises instead of leaving them behind -- build the layer on its device.
    Memory: the fused path keeps only the GEMM-packed copy of the expert weights (the same 4.5 bits per weight), not
    the PackedExpertWeights it was built from -- drop your own reference to those after building the layer, or the
    weights are held twice; `layer.weights` then unpacks them, bit for bit, on each access. The reference path keeps
    the given weights and FP32 copies of them.
    """

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPYABLE)

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPYABLE)

    def _apply(self, fn, recurse=True):
        # `fn` is what .to() / .cuda() / .half() apply to every tensor: see where it would put one of ours.
        here = self._device
        there = fn(torch.empty(0, device=here)).device
        if there != here:
            raise RuntimeError(f"MoELayer cannot move from {here} to {there}: its expert weights are packed for {here} "
                               "(and its Buffer's kernels run there). Build the layer on the target device")
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The constructor's check on the router, for load_state_dict too (a host read of the incoming tensor at load
        # time): a corrupt checkpoint would otherwise make every output near zero, silently (see __init__).
        router = state_dict.get(prefix + "router_weight")
        if (isinstance(router, torch.Tensor) and router.device.type != "meta" and router.is_floating_point()
                and not bool(torch.isfinite(router.to(torch.float32)).all())):  # (as the layer keeps it: FP32)
            error_msgs.append(f"{prefix}router_weight holds NaN or Inf values: not loaded (a NaN logit sends every "
                              "token to one expert with NaN weights, which the S2F6 combine turns into near-zero "
                              "outputs)")
            return
        before = self._buffers["router_weight"]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        after = self._buffers["router_weight"]
        if after is not before:
            # load_state_dict(assign=True) installed the caller's tensor itself (any device or dtype, its storage
            # shared with the caller): the layer keeps its own copy on its device, as the constructor does.
            if after.device.type == "meta":
                self._buffers["router_weight"] = before
                error_msgs.append(f"{prefix}router_weight is a meta tensor: not loaded (it holds no values)")
            else:
                self._buffers["router_weight"] = after.detach().to(device=self._device, dtype=before.dtype,
                                                                   copy=True)

    def __init__(self, buffer: Buffer, router_weight: torch.Tensor, weights: PackedExpertWeights,
                 expert_impl: str = "auto", token_tile=None, combine_rows: Optional[bool] = None,
                 waves: Optional[bool] = None, wave_sms: Optional[int] = None, expert_precision: str = "exact"):
        super().__init__()
        cfg = buffer.config
        if cfg.dispatch_format != "nvfp4":
            raise ValueError(f"MoELayer consumes NVFP4 tokens; the buffer dispatches {cfg.dispatch_format!r}")
        if not isinstance(router_weight, torch.Tensor) or not router_weight.is_floating_point():
            raise TypeError(f"router_weight must be a floating-point tensor, got "
                            f"{getattr(router_weight, 'dtype', type(router_weight).__name__)}")
        if tuple(router_weight.shape) != (cfg.num_experts, cfg.hidden):
            raise ValueError(f"router_weight must be [{cfg.num_experts}, {cfg.hidden}], got "
                             f"{tuple(router_weight.shape)}")
        if not isinstance(weights, PackedExpertWeights):
            raise TypeError(f"weights must be moe.pack_weights(w1, w2) (PackedExpertWeights), got "
                            f"{type(weights).__name__}")
        _check_packed_weights(weights)
        if weights.num_local_experts != cfg.num_local_experts or weights.w1.shape[-1] != cfg.hidden:
            raise ValueError(f"weights hold {weights.num_local_experts} experts of hidden {weights.w1.shape[-1]}; "
                             f"the buffer needs {cfg.num_local_experts} of hidden {cfg.hidden}")
        w2_shape = (cfg.num_local_experts, cfg.hidden, weights.w1.shape[1] // 2)
        if tuple(weights.w2.shape) != w2_shape:
            raise ValueError(f"weights.w2 must be [E_local, H, I] = {list(w2_shape)} for w1 "
                             f"{list(weights.w1.shape)}, got {list(weights.w2.shape)}")
        if expert_impl not in ("auto", "fused", "reference"):
            raise ValueError(f"expert_impl must be 'auto', 'fused' or 'reference', got {expert_impl!r}")
        if router_weight.device != weights.w1.data.device:  # the layer lives where its packed experts are
            raise ValueError(f"router_weight is on {router_weight.device} but the expert weights are on "
                             f"{weights.w1.data.device}: give both on the layer's device")
        # The layer's tokens live where its weights are, and the Buffer must be able to take them from there (a
        # gloo Buffer with CUDA weights, an nvlink Buffer with CPU ones, would fail in every forward instead).
        buffer._backend.check_device("the expert weights (the layer's device)", weights.w1.data)
        for name, value in (("combine_rows", combine_rows), ("waves", waves)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be None or a bool, got {value!r}")
        # Once, at construction (a device->host read): a NaN logit would send every token to one expert with NaN
        # weights, which the S2F6 combine turns into near-zero outputs, silently.
        # (Of the FP32 copy the layer keeps: a float64 value past FP32's range would become Inf there.)
        if not bool(torch.isfinite(router_weight.detach().to(torch.float32)).all()):
            raise ValueError("router_weight holds NaN or Inf values (as FP32, the layer's copy)")
        self.buffer = buffer
        # The layer's own FP32 copy, outside autograd: not the caller's tensor (or Parameter), whatever its dtype.
        self.register_buffer("router_weight", router_weight.detach().to(torch.float32, copy=True))
        self._weights = weights  # dropped below once packed (fused path): `weights` unpacks the packed copy
        self._device = weights.w1.data.device
        # Values are checked whichever path the layer picks; a knob that an explicit choice makes void is refused
        # (with "auto" choices it is kept for the case it applies: self.token_tile / self.wave_sms say).
        if token_tile is not None and (isinstance(token_tile, bool) or token_tile not in TOKEN_TILES):
            raise ValueError(f"token_tile must be None or one of {', '.join(map(str, TOKEN_TILES))}, got {token_tile!r}")
        if wave_sms is not None and (isinstance(wave_sms, bool) or not isinstance(wave_sms, int) or wave_sms < 1):
            raise ValueError(f"wave_sms must be None or a positive int, got {wave_sms!r}")
        if token_tile is not None and expert_impl == "reference":
            raise ValueError("token_tile is a setting of the fused grouped GEMM; expert_impl='reference' has none")
        if wave_sms is not None and waves is not None and not waves:
            raise ValueError("wave_sms sizes the wave receive; waves=False has none")
        device = weights.w1.data.device
        supported, why = _fused_experts_supported(device, cfg.hidden, weights.w2.shape[-1])
        if expert_impl == "fused" and not supported:
            raise RuntimeError(f"expert_impl='fused' is unavailable: {why}")
        if expert_impl == "auto":
            expert_impl = "fused" if supported else "reference"
            if not supported and device.type == "cuda":
                _ext.warn_once(f"MoELayer: using the reference expert path (FP32 torch matmuls): {why}")
        self.expert_impl = expert_impl
        fp8 = check_precision(expert_precision, "expert_precision")
        if fp8:
            inter = weights.w2.shape[-1]
            if expert_impl != "fused" or cfg.hidden % 128 or inter % 128:
                raise ValueError(f"expert_precision='fp8_inexact' is a mode of the fused grouped GEMM with H and I "
                                 f"multiples of 128; this layer has expert_impl={expert_impl!r}, H = {cfg.hidden}, "
                                 f"I = {inter}")
        self._expert_precision = expert_precision
        # The FP8 forms of the combine-row epilogue and of the wave receive need a _C built with them (a stale one
        # runs the FP8 mode without them, as before they existed).
        fp8_forms = not fp8 or hasattr(_ext._C, "fp8_operand_forms")
        rows_possible = (expert_impl == "fused" and buffer.combine_rows_supported
                         and has_combine_rows_kernel() and fp8_forms)
        if combine_rows and not rows_possible:
            raise ValueError(f"combine_rows=True needs the fused experts (with the combine-row kernel in ep_comm._C), "
                             f"the nvlink backend and S2F6 combine; this layer has expert_impl={expert_impl!r}, "
                             f"backend={buffer.backend!r}, combine_format={cfg.combine_format!r}")
        self.combine_rows = rows_possible if combine_rows is None else bool(combine_rows)
        waves_possible = expert_impl == "fused" and buffer.backend == "nvlink" and fp8_forms
        if waves and not waves_possible:
            raise ValueError(f"waves=True needs the fused experts and the nvlink backend; this layer has "
                             f"expert_impl={expert_impl!r}, backend={buffer.backend!r}")
        self.waves = waves_possible if waves is None else bool(waves)
        self.wave_sms = None
        if self.waves:
            if wave_sms is None:
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                wave_sms = default_wave_sms(cfg.hidden, weights.w2.shape[-1], sms, expert_precision)
            self.wave_sms = min(wave_sms, buffer.max_wave_sms)
        if expert_impl == "fused":
            from . import grouped_gemm  # imported here: the CPU-only package does not need it at import time
            # Token tile: the kernel's own rule (grouped_gemm_auto_token_tile), applied to the expected rows per
            # local expert with every rank at max_tokens_per_rank rather than to the capacity-sized row count,
            # which overestimates them.
            if token_tile is None:
                expected = math.ceil(cfg.max_tokens_per_rank * cfg.num_topk * cfg.world_size / cfg.num_experts)
                experts = cfg.num_local_experts
                token_tile = _ext._C.grouped_gemm_auto_token_tile(expected * experts, experts)
            self.token_tile = token_tile
            self._w1_packed = grouped_gemm.pack_gemm_weights(weights.w1, swiglu=True)
            self._w2_packed = grouped_gemm.pack_gemm_weights(weights.w2, swiglu=False)
            self._weights = None  # one copy of the weights in the layer, not two
        else:
            self.token_tile = None  # no grouped GEMM on the reference path
            # Dequantized once: the reference expert path multiplies FP32 copies of the NVFP4 weights.
            with torch.no_grad():
                self._w1 = formats.nvfp4_dequantize(weights.w1, dtype=torch.float32)
                self._w2 = formats.nvfp4_dequantize(weights.w2, dtype=torch.float32)

    @property
    def weights(self) -> PackedExpertWeights:
        """This rank's NVFP4 expert weights, as given to the layer (what to save with the router's state_dict). The
        fused path keeps only their GEMM-packed form, so each access unpacks it (bit for bit the weights given; a
        pass over them and a new copy in memory); the reference path returns the weights it was given."""
        if self._weights is not None:
            return self._weights
        from . import grouped_gemm
        return PackedExpertWeights(w1=grouped_gemm.unpack_gemm_weights(self._w1_packed),
                                   w2=grouped_gemm.unpack_gemm_weights(self._w2_packed))

    def _check_input(self, x) -> None:
        """x as dispatch takes it, on the layer's device (and the router still there: load_state_dict(assign=True)
        can put it elsewhere)."""
        self.buffer._check_tokens(x)
        device = self._device
        if x.device != device or self.router_weight.device != device:
            raise ValueError(f"x is on {x.device} and router_weight on {self.router_weight.device}; the layer's "
                             f"experts are on {device}")

    def _check_router_input(self, x) -> None:
        """route's x: a floating-point [T, H] tensor on the layer's device (forward has checked more already, on
        every rank together; a caller of route may not have)."""
        self.buffer._check_tokens(x, also_accepted=(torch.float16, torch.float32))
        if x.device != self.router_weight.device:
            raise ValueError(f"x is on {x.device} and router_weight on {self.router_weight.device}")

    @formats._keeps_subnormals  # (the logits and the softmax: tiny routing weights stay as a GPU computes them)
    def route(self, x: torch.Tensor):
        """The router on x: [T, H] on the layer's device, bfloat16 as `forward` passes it (float16 / float32 are
        accepted too: the logits are FP32 either way). Returns topk_idx int64 [T, K] and topk_weights float32 [T, K]
        (softmax over the K largest logits).

        The logits are an FP32 matmul whatever the caller's autocast region or TF32 setting (exact_fp32_matmuls):
        bf16 or TF32 logits would pick other experts at near-ties, and the ranks' routing would depend on it."""
        self._check_router_input(x)
        # .float(): a module-wide cast (model.to(torch.bfloat16)) also casts this buffer.
        with exact_fp32_matmuls():
            # (A contiguous copy: BLAS may sum in another order for another layout of the same values, and a near-tie
            # would then route the same token differently.)
            logits = x.float().contiguous() @ self.router_weight.float().t()
            top_logits, topk_idx = logits.topk(self.buffer.config.num_topk, dim=-1)
            return topk_idx, torch.softmax(top_logits.float(), dim=-1)

    @eager_only
    def experts(self, result) -> torch.Tensor:
        """Expert MLPs on a `DispatchResult`: bf16 [R, H] in the dispatch layout. Only the rows of valid experts are
        defined (what `Buffer.combine` reads): the reference path zeroes the others, the fused path leaves them
        uninitialised. Needs the expert-major rows of an expanding dispatch (not `dispatch(..., expand=False)`)."""
        _require_expanded(result, "experts")
        _require_nvfp4_rows(result, "experts")
        cfg = self.buffer.config
        counts = getattr(result, "num_tokens_per_expert", None)
        num_counts = counts.numel() if isinstance(counts, torch.Tensor) else None
        width = getattr(getattr(result, "x", None), "shape", (0,))[-1]
        if num_counts != cfg.num_local_experts or width != cfg.hidden:
            # (the reference path would zero the rows of experts past its own, silently)
            raise ValueError(f"experts() takes a dispatch result of this layer's Buffer ({cfg.num_local_experts} local "
                             f"experts, hidden {cfg.hidden}); got {num_counts} expert counts and hidden {width}")
        if self.expert_impl == "fused":
            return self._experts_fused(result)
        return self._experts_reference(result)

    @property
    def expert_precision(self) -> str:
        """"exact" or "fp8_inexact", fixed at construction (waves and combine rows were chosen for it)."""
        return self._expert_precision

    def _hidden(self, result):
        """The w2 input rows of this layer's precision (grouped_gemm.ExpandedRows [R, I])."""
        return _fused_expert_hidden(result.x, result.expert_offsets, result.num_tokens_per_expert, self._w1_packed,
                                    self.token_tile, precision=self._expert_precision)

    def _experts_fused(self, result) -> torch.Tensor:
        return _expert_output(self._hidden(result), result.expert_offsets, result.num_tokens_per_expert,
                              self._w2_packed, self.token_tile)

    def _experts_reference(self, result) -> torch.Tensor:
        if _is_capturing():  # its per-expert loop reads the counts on the host, which a capture forbids
            raise RuntimeError("MoELayer with the reference experts (expert_impl='reference', or 'auto' where the fused "
                               "grouped GEMM is unavailable) cannot be captured in a CUDA graph: it reads the expert "
                               "counts on the host")
        out = torch.zeros(result.num_rows, self.buffer.config.hidden, dtype=torch.bfloat16,
                          device=result.x.data.device)
        offsets = result.expert_offsets.tolist()
        counts = result.num_tokens_per_expert.tolist()
        for j in range(self.buffer.config.num_local_experts):
            rows = slice(offsets[j], offsets[j] + counts[j])
            if counts[j]:
                tokens = formats.NVFP4Tensor(data=result.x.data[rows], scales=result.x.scales[rows],
                                             amax=result.x.amax[rows], e4m3_max=result.x.e4m3_max)
                out[rows] = expert_mlp_reference(tokens, self._w1[j], self._w2[j])
        return out

    @eager_only
    def experts_and_combine_rows(self, result) -> torch.Tensor:
        """combine_rows=True: the fused experts with w2 storing its rows into the combine areas, then the receive:
        bf16 [T, H], bitwise `Buffer.combine(self.experts(result), result.handle, local_reduce=False)`."""
        _require_expanded(result, "experts_and_combine_rows")
        _require_nvfp4_rows(result, "experts_and_combine_rows")
        if not self.combine_rows:
            raise ValueError("experts_and_combine_rows needs a layer with combine_rows=True (fused experts, nvlink "
                             "backend, S2F6 combine); use buffer.combine(layer.experts(result), result.handle)")
        return self._w2_and_combine(result, self._hidden(result))

    def _w2_and_combine(self, result, hidden) -> torch.Tensor:
        """w2 on the requantized hidden rows (grouped_gemm.ExpandedRows), then the combine: bf16 [T, H]."""
        from . import grouped_gemm
        if self.combine_rows:
            # Begun just before w2: its wait for the sources to have read the previous combine comes after w1, when
            # it is normally long over.
            target = self.buffer.begin_combine_rows(result)
            grouped_gemm.grouped_gemm_nvfp4_combine_rows(hidden, result.expert_offsets, result.num_tokens_per_expert,
                                                         self._w2_packed, target, token_tile=self.token_tile)
            return self.buffer.finish_combine_rows(result.handle)
        out = _expert_output(hidden, result.expert_offsets, result.num_tokens_per_expert, self._w2_packed,
                             self.token_tile)
        return self.buffer.combine(out, result.handle)

    @eager_only
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: bfloat16 [T, hidden] on this rank's device (T <= the Buffer's max_tokens_per_rank; T may differ per rank,
        0 included), or [..., hidden] (say [batch, sequence, hidden]), whose leading dimensions are the tokens: their
        product is T. Returns bfloat16 of x's shape: route (FP32 logits, top-k, softmax) -> dispatch -> expert MLP ->
        combine, as the class docstring describes. Collective: every rank of the Buffer's group calls it."""
        if isinstance(x, torch.Tensor) and x.dim() > 2 and x.shape[-1] == self.buffer.config.hidden:
            # (reshape: a view of a contiguous x; the result is made contiguous [T, hidden], so view gives x's shape.
            # Any other x goes on as it is, for the check to name its own shape.)
            return self._forward_tokens(x.reshape(-1, x.shape[-1])).view(x.shape)
        return self._forward_tokens(x)

    def _forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """forward on x [T, hidden] (or whatever the caller passed that is not [..., hidden]: checked here)."""
        # Checked before routing (the router's matmul would fail first, on this rank only); on the reference backend the
        # ranks agree on the outcome, so a bad x on one rank raises on every rank.
        self.buffer._validate_together(lambda: self._check_input(x), "MoELayer forward", x)
        topk_idx, topk_weights = self.route(x)
        # torch.topk over the logits gives K distinct ids in [0, E): valid by construction, so the dispatch skips
        # the id check and its device->host copy (which made the host wait for the GPU once per layer).
        if self.waves:
            waved = self.buffer.dispatch_waves(x, topk_idx, topk_weights, self.wave_sms, check_inputs=False,
                                               precision=self._expert_precision)
            result = waved.result
            # w1 right behind the receive (nothing may be launched in between: see Buffer.dispatch_waves).
            hidden = _expert_hidden_from_rows(waved.rows, result.expert_offsets, result.num_tokens_per_expert,
                                              self._w1_packed, self.token_tile, wave=waved.wave)
            return self._w2_and_combine(result, hidden)
        result = self.buffer.dispatch(x, topk_idx, topk_weights, check_inputs=False)
        if self.combine_rows:
            return self.experts_and_combine_rows(result)
        return self.buffer.combine(self.experts(result), result.handle)
