"""Trainable SwiGLU experts on the dispatched NVFP4 tokens: MoELayer's expert MLP with autograd, its backward in
MXFP8 with stochastic rounding (DESIGN.md §3 "Backward": saved NVFP4 activations reused, not re-sent).

    buf = ep_comm.Buffer(..., dispatch_format="nvfp4", expert_alignment=32)
    grads = training.GradBuffers.create(buf)
    experts = training.ExpertMLP(buf.config.num_local_experts, hidden, intermediate, device=device, ep_rank=buf.rank)
    routed = training.dispatch(buf, grads, x, topk_idx, topk_weights)
    y = training.combine(experts(routed), routed)
    loss(y).backward()            # gradients reach experts.w1 / experts.w2, x and the routing weights

Forward, MoELayer's quantization points: the master weights (FP32 or BF16 parameters) are quantized to NVFP4 on every
call (no 4/6, one FP32 amax per expert: what `moe.pack_weights` makes, bit for bit); w1 reads the dispatched NVFP4
tokens themselves (`routed.result.x`); SwiGLU in FP32; the w2 input is requantized to NVFP4 with 4/6 and a per-token
amax; w2. Only the rows in use get outputs: padding rows and the rows past expert_offsets[-1] are zero.

Backward, for each local expert e, with g the output gradient [R, H] and straight-through weight quantizers:

    dgrad:  d_hidden = Q(g) W2_e             d_x = Q(d_gate_up) W1_e
    wgrad:  dW2_e = Q_T(g)^T Q_T(h)          dW1_e = Q_T(d_gate_up)^T Q_T(x)

Q is MXFP8 (E4M3, UE8M0 scale per 32) along the contraction axis (H, 2I), Q_T MXFP8 along the tokens (32 rows of
one expert per block: hence expert_alignment % 32 == 0), all with stochastic rounding, a fresh seed per call and
tensor. W are the forward's NVFP4 weights; h (the w2 input) and x (the dispatched tokens) are the forward's saved
NVFP4 operands, dequantized, transposed and requantized (`formats.nvfp4_to_mxfp8_transposed`). SwiGLU's backward
runs in FP32 from the saved pre-activations (w1's BF16 GEMM output and its FP32 row factor: 4 I + 4 bytes per
row), its output rounded to BF16 before the two MXFP8 roundings.

Compute: Hopper has no FP4 or block-scaled MMA. Every GEMM here multiplies operands that are exact in BF16 (E2M1 x
E4M3 block values, MXFP8 values) with `torch._grouped_mm` (BF16 tensor cores, FP32 accumulation, BF16 output) over
the dispatch layout's segments (device-side offsets: no host sync), and applies the FP32 outer factors (per token,
per expert) to the output rows. The numerics are those of NVFP4 / MXFP8 GEMMs with FP32 accumulation and BF16
outputs; the speed that of BF16 grouped GEMMs. The exception: with FP32 master weights on an sm_90 GPU the two weight
gradients come from csrc/grouped_wgrad.cu (BF16 operands, groups along the tokens, FP32 out), whose FP32 accumulators
are the gradients -- not rounded to BF16 and widened, as torch._grouped_mm's BF16 output is everywhere else
(`EP_COMM_WGRAD_GEMM=torch` selects that path on sm_90 too). With accumulate_into_main_grad (FP32 main gradients of a
trainer that accumulates micro-batches, Megatron-style) the same kernel adds its accumulators into w.main_grad by TMA
reduce-add stores, for FP32 and BF16 masters alike. (The fused NVFP4 kernels of `ep_comm.grouped_gemm` serve
inference: they take weights packed once, offline, which training would repack at every step.) Between the GEMMs, the
kernels of csrc/training_experts.cu: both MXFP8 roundings of a tensor from one read, SwiGLU forward and backward, row
scaling with the mask, the BF16 weight gradients widened to FP32, each bit for bit its torch form run on CUDA. The same
code runs on CPU ranks (torch's CPU _grouped_mm and the kernels' torch forms; CPU's exp may round silu / sigmoid
differently in the last bit) and on GPUs, where the quantizers are the CUDA kernels of `ep_comm.formats` (bitwise the
reference quantizers). No host synchronization in a step on CUDA. MXFP8 values below 2^-133 (a block
whose largest magnitude is below ~2^-118) are not exact in BF16; nothing else is rounded on the way into a GEMM.

Measured on one H200 (bench/RESULTS.md, fifty-third session; bench/bench_training_experts.py): 1.05x (FP32 masters:
20.8 against 21.8 ms per forward + backward; 0.99-1.05x against the baselines of the last two sessions, which move by
a few percent between runs; 23.2 ms with torch's weight-gradient GEMMs in the same run; 20.0 ms with
keep_weight_values) and 0.90x (BF16 masters) the speed of BF16 experts in torch autograd over the same segments, on
masters of the same dtype (0.94-0.97x with FP32 masters in the fifty-fourth session's runs, whose baseline was faster).
A micro-batch after the first of a step (ExpertMLP's is_first_microbatch=False, the weights' quantization reused):
18.9-19.1 ms, 17.0-17.1 with kept values, against 21.3-21.6 quantizing every call (fifty-fourth session, FP32
masters, alternating rounds).

CUDA graphs: the stochastic roundings' seeds may live on the device (a one-element int64 seed tensor, read by the
kernels when they run), and ExpertMLP counts its calls there, so its forward + backward can be captured in a graph
whose replays draw fresh rounding noise (tests/test_training_experts.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext, formats
from ._compile import eager_only
from .buffer import _tensors_in
from .training import RoutedTokens

# The six stochastic roundings of one backward, one per quantized tensor.
_SEED_TAGS = {"g_rows": 1, "g_tokens": 2, "h_tokens": 3, "d_gate_up_rows": 4, "d_gate_up_tokens": 5, "x_tokens": 6}
_MASK64 = 2**64 - 1


def _mix64(value: int) -> int:
    """One splitmix64 step with `value` as its state (the golden-ratio increment, then the finalizer): a bijection of
    64-bit ints whose outputs for nearby inputs look unrelated."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def grad_seed(call_seed: int, tensor: str) -> int:
    """The seed of one stochastic rounding of a backward: _mix64(call_seed ^ _mix64(tag)), tags as above (distinct for
    every call seed and tensor, all 64 bits of the call seed kept). tensor: one of _SEED_TAGS's names."""
    if tensor not in _SEED_TAGS:
        raise ValueError(f"tensor must be one of {sorted(_SEED_TAGS)}, got {tensor!r}")
    return _mix64(call_seed ^ _mix64(_SEED_TAGS[tensor]))


def _as_int64(value: int) -> int:
    """A 64-bit unsigned value as the int64 holding its bits (two's complement)."""
    return value - 2**64 if value >= 2**63 else value


def _mix_seeds(source: torch.Tensor, xor_values, increment: bool = False) -> torch.Tensor:
    """int64 [len(xor_values)] on source's device: _mix64(s ^ v) for each v (as int64 bits), s the 64 bits of the
    one-element int64 tensor `source`, first incremented by one in place if `increment` (a call counter). On CUDA one
    thread of csrc/training_experts.cu does it when the stream gets there (so a CUDA graph derives the seeds from the
    values at replay); elsewhere the host reads source (the same bits)."""
    lib = _row_kernels(source, "mix_seeds")
    out = torch.empty(len(xor_values), dtype=torch.int64, device=source.device)
    if lib is None:
        if increment:
            source.add_(1)
        value = formats._seed_value(source)
        out.copy_(torch.tensor([_as_int64(_mix64(value ^ v)) for v in xor_values], dtype=torch.int64))
        return out
    with _ext.cuda_device(source.device):
        lib.mix_seeds(source.data_ptr(), increment, list(xor_values), out.data_ptr(),
                      _ext.current_raw_stream(source.device))
    return out


def _backward_seeds(call_seed: formats.SeedArg) -> dict:
    """The seeds of the backward's six roundings, {tensor name: grad_seed(call_seed, name)}: ints for an int call
    seed; for a seed tensor (one int64 element), one-element int64 tensors on its device, derived there now (so the
    forward reads the call seed: the caller may overwrite it before the backward runs)."""
    if not isinstance(call_seed, torch.Tensor):
        return {name: grad_seed(call_seed, name) for name in _SEED_TAGS}
    seeds = _mix_seeds(call_seed.reshape(1), [_mix64(tag) for tag in _SEED_TAGS.values()])
    return {name: seeds[i:i + 1] for i, name in enumerate(_SEED_TAGS)}


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm in BF16 (FP32 accumulation, BF16 result). a [R, K] x b [E, K, N] -> [R, N] (groups of rows;
    rows past group_ends[-1] undefined); a [M, R] x b [R, N] -> [E, M, N] (groups along the contraction)."""
    if not hasattr(torch, "_grouped_mm"):  # (setup.py asks for 2.9; a torch installed around pip may be older)
        raise RuntimeError(f"ExpertMLP / training.expert_mlp need torch >= 2.9 (torch._grouped_mm, on CPU and CUDA); "
                           f"this is torch {torch.__version__}")
    return torch._grouped_mm(a, b, offs=group_ends)


@eager_only
def quantize_expert_weights(w: torch.Tensor) -> formats.NVFP4Tensor:
    """Master weights [E, N, K] (float32 / bfloat16 as ExpertMLP keeps them; float16 as pack_weights takes it; K a
    multiple of 16) -> NVFP4 along K without 4/6 and with one FP32 amax per expert: `moe.pack_weights`'s
    quantization (the same amax helper, the same quantizer). No autograd (straight-through: see the module doc). It
    does not read the amax on the host (check_amax=False), so a step never syncs; non-finite masters are therefore not
    refused here, and the outputs they give are not meaningful."""
    from . import moe
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"w must be a float32, bfloat16 or float16 tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K] (one matrix per expert), got {tuple(w.shape)}")
    with torch.no_grad():
        w = w.detach()
        return formats.nvfp4_quantize(w, four_over_six=False, amax=moe._per_expert_amax(w), check_amax=False)


def _block_values(q: formats.NVFP4Tensor):
    """NVFP4 [..., K] -> (values bf16 [N, K]: E2M1 x E4M3, exact; factor fp32 [N]: the outer decode scale
    amax * fp32(1 / (6 * e4m3_max)), as the grouped GEMM's ExpandedRows), rows flattened."""
    k = q.data.shape[-1] * 2
    if formats._use_cuda("auto", q.data):
        from . import _cuda_formats  # (bf16 straight from the dequantize kernel's block-value form)
        values = _cuda_formats.nvfp4_dequantize(q, torch.bfloat16, block_values=True).reshape(-1, k)
        factor = q.amax.reshape(-1).float() * torch.full((), 1.0 / (6.0 * q.e4m3_max), dtype=torch.float32,
                                                         device=q.amax.device)
        return values, factor
    from . import grouped_gemm
    rows = grouped_gemm.expand_nvfp4_rows(q, impl="reference")  # (fp16 block values: exact in bf16 too)
    return rows.values.to(torch.bfloat16), rows.row_factor


def _masked_nvfp4(q: formats.NVFP4Tensor, rows_in_use: torch.Tensor, num_rows: int) -> formats.NVFP4Tensor:
    """q's rows with zero scales and amax outside rows_in_use (so every value there is 0, whatever the codes or the
    garbage scales of nvlink's capacity rows), padded with zero rows to num_rows."""
    from .training import _mask_rows
    pad = num_rows - q.data.shape[0]

    def padded(t: torch.Tensor) -> torch.Tensor:
        if not pad:
            return t
        return torch.cat([t, torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)])
    return dataclasses.replace(q, data=padded(q.data), scales=padded(_mask_rows(q.scales, rows_in_use)),
                               amax=padded(_mask_rows(q.amax, rows_in_use)))


def _row_kernels(t: torch.Tensor, kernel: str):
    """ep_comm._C when it has the row kernel `kernel` of csrc/training_experts.cu and can run it on CUDA tensor t, else
    None: CPU tensors take the torch forms below; so does a CUDA tensor without it (an ep_comm._C built before it, or a
    GPU the kernels cannot run on), with a warning once -- slower, and the same bits (the kernels are bitwise their
    torch forms run on CUDA)."""
    if not t.is_cuda:
        return None
    if formats._use_cuda("auto", t) and hasattr(_ext._C, kernel):
        return _ext._C
    _ext.warn_once(f"ep_comm.training.ExpertMLP: the row kernel {kernel} of csrc/training_experts.cu is not in this "
                   "build of ep_comm._C (or cannot run here): using its torch form (the same bits, more passes)")
    return None


def _mxfp8_values(x: torch.Tensor, seed: formats.SeedArg) -> torch.Tensor:
    """x [M, K] -> bf16 [M, K]: MXFP8 along K with stochastic rounding, dequantized (exact in BF16)."""
    q = formats.mxfp8_quantize(x, rounding="stochastic", seed=seed)
    return formats.mxfp8_dequantize(q, dtype=torch.bfloat16)


def _mxfp8_token_values(x: torch.Tensor, num_rows: int, seed: formats.SeedArg) -> torch.Tensor:
    """x [R, K] -> bf16 [K, num_rows]: transposed, zero-padded to num_rows (a multiple of 32), MXFP8 along the tokens
    with stochastic rounding, dequantized."""
    if num_rows == 0:  # (no token block at all: mxfp8_quantize refuses a zero-length last axis)
        return torch.zeros(x.shape[1], 0, dtype=torch.bfloat16, device=x.device)
    xt = torch.empty(x.shape[1], num_rows, dtype=x.dtype, device=x.device)
    xt[:, :x.shape[0]] = x.t()
    xt[:, x.shape[0]:] = 0
    return _mxfp8_values(xt, seed)


def _mxfp8_round_trips(x: torch.Tensor, src_rank: torch.Tensor, padded_rows: int,
                       seed_rows: Optional[formats.SeedArg], seed_tokens: Optional[formats.SeedArg]):
    """The backward's two MXFP8 roundings of one bf16 tensor x [R, K] (rows with src_rank < 0 taken as 0): (rows bf16
    [R, K] along K, tokens bf16 [K, padded_rows] along the tokens, transposed and zero-padded), each with stochastic
    rounding and dequantized; a None seed skips that output (a seed: an int, or a one-element int64 tensor on x's
    device, read when the kernel runs). One read of x on CUDA (csrc/training_experts.cu); elsewhere `_mxfp8_values` /
    `_mxfp8_token_values` of the masked x (the same bits on CPU and GPU)."""
    lib = _row_kernels(x, "mxfp8_round_trips")
    if lib is None:
        masked = x.masked_fill(~(src_rank >= 0)[:, None], 0.0)
        return (None if seed_rows is None else _mxfp8_values(masked, seed_rows),
                None if seed_tokens is None else _mxfp8_token_values(masked, padded_rows, seed_tokens))
    # (16-byte vector loads of x: a contiguous gradient can still start at any element, e.g. one of a torch.cat)
    x, src_rank = _ext.aligned_contiguous(x, 16), src_rank.contiguous()
    num_rows, hidden = x.shape
    rows = None if seed_rows is None else torch.empty_like(x)
    tokens = None if seed_tokens is None else torch.empty(hidden, padded_rows, dtype=x.dtype, device=x.device)
    from ._cuda_formats import _seed_args  # (a seed by value, or a seed tensor's address; None: not used)
    rows_seed, rows_seed_at = _seed_args(0 if seed_rows is None else seed_rows)
    tokens_seed, tokens_seed_at = _seed_args(0 if seed_tokens is None else seed_tokens)
    with _ext.cuda_device(x.device):
        lib.mxfp8_round_trips(x.data_ptr(), src_rank.data_ptr(), num_rows, hidden, padded_rows, rows_seed,
                              tokens_seed, 0 if rows is None else rows.data_ptr(),
                              0 if tokens is None else tokens.data_ptr(), _ext.current_raw_stream(x.device),
                              rows_seed_at, tokens_seed_at)
    return rows, tokens


def _swiglu_rows(gate_up: torch.Tensor, factor: torch.Tensor, src_rank: torch.Tensor, padded_rows: int
                 ) -> torch.Tensor:
    """silu(gate) * up with gate, up = w1's bf16 output [R, 2I] times its fp32 row factor [R]: fp32 [padded_rows, I],
    zero on rows not in use and past R (csrc/training_experts.cu on CUDA, bitwise torch's CUDA silu; on CPU torch's
    CPU silu, whose exp may round the last bit differently)."""
    num_rows, two_i = gate_up.shape
    lib = _row_kernels(gate_up, "swiglu_rows")
    out = torch.zeros(padded_rows, two_i // 2, dtype=torch.float32, device=gate_up.device) if lib is None else \
        torch.empty(padded_rows, two_i // 2, dtype=torch.float32, device=gate_up.device)
    if lib is None:
        gate, up = torch.mul(gate_up, factor[:, None]).chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=out[:num_rows])
        out[:num_rows].masked_fill_(~(src_rank >= 0)[:, None], 0.0)
        return out
    gate_up, factor, src_rank = gate_up.contiguous(), factor.contiguous(), src_rank.contiguous()
    with _ext.cuda_device(gate_up.device):
        lib.swiglu_rows(gate_up.data_ptr(), factor.data_ptr(), src_rank.data_ptr(), num_rows, two_i // 2,
                        padded_rows, out.data_ptr(), _ext.current_raw_stream(gate_up.device))
    return out


def _swiglu_backward_rows(d_hidden: torch.Tensor, d_factor: torch.Tensor, gate_up: torch.Tensor,
                          factor: torch.Tensor, src_rank: torch.Tensor) -> torch.Tensor:
    """SwiGLU's backward: d [gate, up] bf16 [R, 2I] from d_hidden bf16 [R, I] times d_factor fp32 [R] and the
    forward's gate_up bf16 [R, 2I] times factor fp32 [R], in FP32; zero on rows not in use (csrc/training_experts.cu
    on CUDA, bitwise `_swiglu_backward` on CUDA; on CPU torch's sigmoid may round the last bit differently)."""
    lib = _row_kernels(d_hidden, "swiglu_backward_rows")
    if lib is None:
        d_gate_up = _swiglu_backward(torch.mul(d_hidden, d_factor[:, None]), torch.mul(gate_up, factor[:, None]))
        return d_gate_up.to(torch.bfloat16).masked_fill_(~(src_rank >= 0)[:, None], 0.0)
    tensors = [t.contiguous() for t in (d_hidden, d_factor, gate_up, factor, src_rank)]
    num_rows, two_i = gate_up.shape
    out = torch.empty(num_rows, two_i, dtype=torch.bfloat16, device=gate_up.device)
    with _ext.cuda_device(gate_up.device):
        lib.swiglu_backward_rows(*(t.data_ptr() for t in tensors), num_rows, two_i // 2, out.data_ptr(),
                                 _ext.current_raw_stream(gate_up.device))
    return out


def _to_master_dtype(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight gradient from torch._grouped_mm (bf16) in the master weights' dtype, float32 or bfloat16 (exact)."""
    widen = dtype == torch.float32 and grad.is_contiguous() and grad.numel() % 8 == 0
    lib = _row_kernels(grad, "widen_bf16") if widen else None
    if lib is None:
        return grad.to(dtype)
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    with _ext.cuda_device(grad.device):
        lib.widen_bf16(grad.data_ptr(), out.data_ptr(), grad.numel(), _ext.current_raw_stream(grad.device))
    return out


def _wgrad_kernel_usable(a_tokens: torch.Tensor) -> bool:
    """csrc/grouped_wgrad.cu runs here: an sm_90 GPU with the kernels built, not turned off by EP_COMM_WGRAD_GEMM=torch."""
    if not a_tokens.is_cuda or os.environ.get("EP_COMM_WGRAD_GEMM", "ep_comm") == "torch":
        return False
    from . import grouped_gemm
    return not grouped_gemm.gemm_kernels_unavailable(a_tokens.device) and hasattr(_ext._C, "grouped_wgrad_bf16")


def _fp32_buffer_problem(t: torch.Tensor, shape: tuple, device: torch.device) -> str:
    """'' if t is a contiguous float32 tensor of `shape` on `device` (what the wgrad kernel adds into through a raw
    pointer: a main_grad), else what it is instead."""
    if t.dtype == torch.float32 and tuple(t.shape) == tuple(shape) and t.device == device and t.is_contiguous():
        return ""
    return f"got {t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"


def _weight_gradient(a_tokens: torch.Tensor, b_tokens: torch.Tensor, group_ends: torch.Tensor,
                     dtype: torch.dtype, accumulate_into: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """A weight gradient from the backward's token-axis operands: a_tokens bf16 [M, Rp] and b_tokens bf16 [N, Rp]
    (tokens along the last axis, Rp >= group_ends[-1]) -> [E, M, N] in the master dtype, out[e] = a[:, seg_e] @
    b[:, seg_e]^T over expert e's tokens. FP32 masters on an sm_90 GPU: csrc/grouped_wgrad.cu, whose FP32
    accumulators are the gradient; otherwise (BF16 masters, CPU, other GPUs, or EP_COMM_WGRAD_GEMM=torch)
    torch._grouped_mm's BF16 output in the master dtype (rounded to BF16 once on the way).

    accumulate_into: an FP32 [E, M, N] contiguous tensor (a main_grad) to add the gradient into, in place, instead of
    returning it (returns None): on an sm_90 GPU the kernel adds its FP32 accumulators (whatever the master dtype),
    else the gradient above, widened to FP32, is added -- the same bits as `accumulate_into += gradient`."""
    if a_tokens.shape[1] != b_tokens.shape[1]:
        raise ValueError(f"the operands' token axes differ: {tuple(a_tokens.shape)}, {tuple(b_tokens.shape)}")
    want = (group_ends.numel(), a_tokens.shape[0], b_tokens.shape[0])
    problem = "" if accumulate_into is None else _fp32_buffer_problem(accumulate_into, want, a_tokens.device)
    if problem:
        raise ValueError(f"accumulate_into must be a contiguous float32 {list(want)} tensor on {a_tokens.device}; "
                         f"{problem}")
    kernel = _wgrad_kernel_usable(a_tokens) and (dtype == torch.float32 or accumulate_into is not None)
    if kernel:
        a_tokens, b_tokens = _ext.aligned_contiguous(a_tokens, 16), _ext.aligned_contiguous(b_tokens, 16)
        group_ends = group_ends.contiguous()
        (m, k_total), n, experts = a_tokens.shape, b_tokens.shape[0], group_ends.numel()
        # The kernel's TMA stores need a 16-byte aligned output. A main_grad sliced out of a flat buffer at another
        # offset gets the gradient in a fresh buffer, then one FP32 add: the bits of the kernel's own reduce-add.
        add_in_kernel = accumulate_into is not None and accumulate_into.data_ptr() % 16 == 0
        out = accumulate_into if add_in_kernel else torch.empty(experts, m, n, dtype=torch.float32,
                                                                device=a_tokens.device)
        with _ext.cuda_device(a_tokens.device):
            _ext._C.grouped_wgrad_bf16(a_tokens.data_ptr(), k_total, b_tokens.data_ptr(), b_tokens.shape[1],
                                       group_ends.data_ptr(), experts, m, n, k_total, out.data_ptr(),
                                       add_in_kernel, _ext.current_raw_stream(a_tokens.device))
        if accumulate_into is None:
            return out
        if not add_in_kernel:
            accumulate_into.add_(out)
        return None
    grad = _to_master_dtype(_grouped_mm(a_tokens, b_tokens.t(), group_ends), dtype)
    if accumulate_into is None:
        return grad
    accumulate_into.add_(grad)  # (a bf16 gradient: exact in FP32, so one rounding, in the addition)
    return None


def _scale_rows_(x: torch.Tensor, factor: torch.Tensor, src_rank: torch.Tensor) -> torch.Tensor:
    """In place on a GEMM's bf16 rows x [R, K]: each row times its fp32 factor (the product in FP32, rounded once),
    zero on rows not in use (the grouped GEMM leaves rows past its groups unwritten: anything, NaN included)."""
    lib = _row_kernels(x, "scale_rows")
    if lib is None or not x.is_contiguous():
        return x.mul_(factor[:, None]).masked_fill_(~(src_rank >= 0)[:, None], 0.0)
    factor, src_rank = factor.contiguous(), src_rank.contiguous()
    with _ext.cuda_device(x.device):
        lib.scale_rows(x.data_ptr(), factor.data_ptr(), src_rank.data_ptr(), x.shape[0], x.shape[1],
                       _ext.current_raw_stream(x.device))
    return x


def _swiglu_backward(d_hidden: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """d (silu(gate) * up) -> d [gate, up], FP32 (gate_up: the forward's pre-activations)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = d_hidden * up * (sig * (1.0 + gate * (1.0 - sig)))
    return torch.cat([d_gate, d_hidden * silu], dim=-1)


@dataclass
class _Saved:
    """What the forward keeps for backward (its tensors through ctx.save_for_backward: _save_for_backward).
    src_rank, group_ends and (when R is a multiple of 32 and no row needs a mask copy) tokens' data are views of the
    DispatchResult's own tensors (an expanding dispatch's allocation, alive while referenced; nothing reuses it); the
    rest is made in the forward."""

    tokens: formats.NVFP4Tensor      # the dispatched NVFP4 tokens, masked and padded to padded_rows
    hidden: formats.NVFP4Tensor      # the w2 input, NVFP4 4/6 [padded_rows, I]
    gate_up_bf16: torch.Tensor       # bf16 [R, 2I], w1's GEMM output (before the outer factors; garbage outside
    w1_row_factor: torch.Tensor      # fp32 [R], its outer factor per row                       the rows in use)
    w1: formats.NVFP4Tensor
    w2: formats.NVFP4Tensor
    group_ends: torch.Tensor         # int32 [E], expert_offsets[1:]
    expert_of_row: torch.Tensor      # int64 [R]
    src_rank: torch.Tensor           # int32 [R]: a row is in use iff src_rank >= 0
    padded_rows: int
    seeds: dict                      # the backward's rounding seeds by tensor name (_backward_seeds)
    w1_values: Optional[torch.Tensor] = None  # keep_weight_values: the forward's bf16 block values of w1 / w2 (else
    w2_values: Optional[torch.Tensor] = None  # the backward decodes them again from w1 / w2)


# _Saved's tensor fields (NVFP4Tensors included) that go to the backward through ctx.save_for_backward, so that
# torch.utils.checkpoint (non-reentrant) can free them after the forward and recompute them (ctx attributes stay
# alive). Not all of them, and nothing else:
# * a field that shares memory with the DispatchResult (src_rank, group_ends, the tokens when no row needed a mask
#   copy) stays a ctx attribute: the result is alive anyway (the combine's backward needs it), and a saved tensor's
#   version check would make the backward fail after any in-place edit of the result -- on nvlink every field is a
#   view of one arena, and editing topk_weight in place is allowed;
# * the seeds: a recomputation (ExpertMLP's forward bumps its call count) would change the backward's rounding;
# * the kept weight values (keep_weight_values): the backward frees each after its one use, which a saved tensor
#   (alive until the backward returns) would not allow.
_SAVED_TENSOR_FIELDS = ("tokens", "hidden", "gate_up_bf16", "w1_row_factor", "w1", "w2", "group_ends", "expert_of_row",
                        "src_rank")


def _storages(value) -> set:
    """The data pointers of the storages of value's tensors (a tensor, or a dataclass of tensors and NVFP4Tensors;
    buffer._tensors_in walks it, with its cached field names)."""
    pointers = {tensor.untyped_storage().data_ptr() for tensor in _tensors_in(value)}
    pointers.discard(0)  # (empty storages share no memory)
    return pointers


def _save_for_backward(ctx, saved: Optional[_Saved], result_storages: set, device) -> None:
    """ctx.save_for_backward of saved's tensors (an NVFP4Tensor as its three) but those in result_storages, and on ctx
    the rest of saved with the places of those tensors (_saved_for_backward rebuilds it). A forward without rows saves
    an empty placeholder: every rank's backward then unpacks a saved tensor at the same point, which is where
    non-reentrant checkpointing starts the recomputation (with its dispatch, a collective)."""
    if saved is None:
        ctx.save_for_backward(torch.empty(0, device=device))
        ctx.saved = None
        return
    tensors, places = [], {}
    for name in _SAVED_TENSOR_FIELDS:
        value = getattr(saved, name)
        if value is None or _storages(value) & result_storages:
            continue
        if isinstance(value, formats.NVFP4Tensor):
            places[name] = (len(tensors), value.e4m3_max)
            tensors += [value.data, value.scales, value.amax]
        else:
            places[name] = len(tensors)
            tensors.append(value)
    ctx.save_for_backward(*tensors)
    ctx.saved = (dataclasses.replace(saved, **{name: None for name in places}), places)


def _saved_for_backward(ctx) -> Optional[_Saved]:
    """The _Saved that _save_for_backward put on ctx (None: the forward had no rows). Unpacks the saved tensors first
    in every case (see _save_for_backward)."""
    tensors = ctx.saved_tensors
    if ctx.saved is None:
        return None
    rest, places = ctx.saved
    fields = {}
    for name, place in places.items():
        if isinstance(place, tuple):
            first, e4m3_max = place
            fields[name] = formats.NVFP4Tensor(tensors[first], tensors[first + 1], tensors[first + 2], e4m3_max)
        else:
            fields[name] = tensors[place]
    return dataclasses.replace(rest, **fields)


@dataclass
class _WeightCache:
    """The weights' quantization, reused by the micro-batches of one step (ExpertMLP's is_first_microbatch): the NVFP4
    weights, and (keep_values) their BF16 block values once a forward has decoded them. masters: weak references to
    the parameters it was made from; versions: their _weight_state when quantized (an in-place update through the
    parameter -- a torch optimizer's step -- moves the version counter; .to() moves the storage); optimizer_steps:
    the process's count of torch optimizer steps when quantized (_optimizer_steps)."""

    masters: tuple
    versions: tuple
    optimizer_steps: int
    w1: formats.NVFP4Tensor
    w2: formats.NVFP4Tensor
    keep_values: bool
    w1_values: Optional[torch.Tensor] = None
    w2_values: Optional[torch.Tensor] = None


# The live ExpertMLP modules of this process: training.clip_grad_norm_ refuses the weights of those without ep_mesh
# (this rank's own experts) where they are not named as expert parameters, which would clip each EP rank by its own
# norm. Weak: a module is not kept alive by it.
_EXPERT_MLPS: "weakref.WeakSet" = weakref.WeakSet()

_OPTIMIZER_STEPS = [0]  # torch optimizer steps taken in this process since the hook below was registered
_OPTIMIZER_STEP_HOOK = []


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _optimizer_steps() -> int:
    """The number of torch optimizer steps (any torch.optim.Optimizer of this process, fused and foreach ones
    included) since the first call, counted by a global step post-hook registered then. The kept weights of
    is_first_microbatch=True are refused after any step: an update is not always seen by the version counters (a
    foreach optimizer step on DTensor weights -- the default on CUDA -- moves neither the DTensor's nor its local
    tensor's; fused kernels neither)."""
    if not _OPTIMIZER_STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _OPTIMIZER_STEP_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))
    return _OPTIMIZER_STEPS[0]


def _is_dtensor(w) -> bool:
    """Whether w is a torch DTensor (ExpertMLP(ep_mesh=...)'s parameters; FSDP2's). Without
    torch.distributed.tensor imported nothing can be one: plain tensors cost no import."""
    import sys
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(w, module.DTensor)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's own experts of a weight: a DTensor's local tensor (differentiable: the gradient reaches the
    DTensor), else w itself."""
    return w.to_local() if _is_dtensor(w) else w


def _weight_state(w: torch.Tensor) -> tuple:
    # (a DTensor parameter: its own version counter, which in-place updates through it move -- torch's optimizers
    # included --, and its local tensor's storage)
    return (w._version, _local(w).data_ptr(), w.dtype, tuple(w.shape), w.device)


def _cache_serves(cache: _WeightCache, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether cache was made from these parameters, unchanged since as far as their version counters and storage tell
    (writes that bypass the counter -- through .data, into a buffer the parameters view -- are not seen)."""
    return (cache.masters[0]() is w1 and cache.masters[1]() is w2
            and cache.versions == (_weight_state(w1), _weight_state(w2))
            and cache.optimizer_steps == _optimizer_steps())


def _expert_factor(w: formats.NVFP4Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """The per-expert outer decode scale of NVFP4 weights [E, N, K] (one amax per expert), per row: fp32 [R]."""
    per_expert = w.amax[:, 0].float() * torch.full((), 1.0 / (6.0 * w.e4m3_max), dtype=torch.float32,
                                                   device=w.amax.device)
    return per_expert[expert_of_row]


def _weight_values(w: formats.NVFP4Tensor) -> torch.Tensor:
    values, _ = _block_values(w)
    return values.view(w.data.shape[0], w.data.shape[1], -1)


def _flag_added_to_main_grad(weights) -> None:
    """Sets `grad_added_to_main_grad` on the weights that have that attribute (trainers that keep FP32 main gradients,
    Megatron's convention, read it to know the gradient went to main_grad rather than .grad)."""
    for w in weights:
        if hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True


def _check_main_grads(w1: torch.Tensor, w2: torch.Tensor) -> None:
    for name, w in (("w1", w1), ("w2", w2)):
        main_grad = getattr(w, "main_grad", None)
        if not isinstance(main_grad, torch.Tensor):
            raise ValueError(f"accumulate_into_main_grad=True: {name} has no main_grad tensor (an FP32 buffer of its "
                             f"shape that the weight gradients are added into)")
        problem = _fp32_buffer_problem(main_grad, w.shape, w.device)
        if problem:
            raise ValueError(f"accumulate_into_main_grad=True: {name}.main_grad must be a contiguous float32 tensor "
                             f"of {name}'s shape {tuple(w.shape)} on {w.device}; {problem}")


_NO_GRADS = (None,) * 6  # (the Function's inputs after rows, w1, w2: result, seed, two flags, the weight cache, wait)


class _ExpertMLPFunction(torch.autograd.Function):
    """(rows [R, H], w1 [E, 2I, H], w2 [E, H, I]) -> bf16 [R, H]; rows (RoutedTokens.carrier) only carries the
    gradient back to dispatch: the values come from the NVFP4 payload (result.x)."""

    # Both passes keep subnormals on a CPU thread that flushes them (NUMERICS.md: the torch forms give the kernels'
    # bits, and the GPU never flushes).
    @staticmethod
    @formats._keeps_subnormals
    def forward(ctx, rows, w1, w2, result, seed: formats.SeedArg, keep_weight_values: bool = False,
                accumulate_into_main_grad: bool = False, weight_cache: Optional[_WeightCache] = None,
                wait_for_tokens=None):
        # weight_cache: the NVFP4 weights (and block values) of an earlier micro-batch, used instead of quantizing
        # (and decoding) w1 / w2 again; the block values this forward decodes are stored there if it keeps them.
        # wait_for_tokens: RoutedTokens.wait of a dispatch on a comm_stream, called before the first device read of
        # result (after the weights are quantized, which needs none of it and so overlaps the dispatch).
        num_rows = result.num_rows
        # (the parameters themselves: the backward adds into their main_grad, read then, and flags them)
        ctx.main_grad_of = (w1, w2) if accumulate_into_main_grad else None
        ctx.rows_dtype, ctx.w1_dtype, ctx.w2_dtype = rows.dtype, w1.dtype, w2.dtype
        ctx.w1_shape_device, ctx.w2_shape_device = (w1.shape, w1.device), (w2.shape, w2.device)
        ctx.freed = False
        if num_rows == 0:  # (no rows on this rank: nothing to multiply; zero weight gradients)
            _save_for_backward(ctx, None, set(), rows.device)
            return torch.zeros(0, w1.shape[2], dtype=torch.bfloat16, device=rows.device)
        padded_rows = -(-num_rows // formats.MX_BLOCK) * formats.MX_BLOCK
        if weight_cache is None:
            w1q, w2q = quantize_expert_weights(w1), quantize_expert_weights(w2)
        else:
            w1q, w2q = weight_cache.w1, weight_cache.w2
        if wait_for_tokens is not None:
            wait_for_tokens()
        src_rank = result.src_rank
        rows_in_use = src_rank >= 0
        group_ends = result.expert_offsets[1:].contiguous()
        experts = w1.shape[0]
        positions = torch.arange(num_rows, dtype=torch.int32, device=rows_in_use.device)
        expert_of_row = torch.searchsorted(group_ends, positions, right=True).clamp_(max=experts - 1)
        tokens = _masked_nvfp4(result.x, rows_in_use, padded_rows)

        def values_of(name: str, q: formats.NVFP4Tensor) -> torch.Tensor:
            if weight_cache is None:
                return _weight_values(q)
            cached = getattr(weight_cache, name)
            if cached is None:
                cached = _weight_values(q)
                if weight_cache.keep_values:
                    setattr(weight_cache, name, cached)
            return cached

        # w1: gate and up (BF16 GEMM output times the token's and the expert's outer factors, in FP32), SwiGLU in
        # FP32, then the w2 input: NVFP4 4/6 with a per-token amax (zero rows up to the padded count).
        x_values, x_factor = _block_values(tokens)
        w1_row_factor = x_factor[:num_rows] * _expert_factor(w1q, expert_of_row)
        w1_values = values_of("w1_values", w1q)
        gate_up_bf16 = _grouped_mm(x_values[:num_rows], w1_values.transpose(1, 2), group_ends)
        kept_w1_values = w1_values if keep_weight_values else None
        del x_values, w1_values  # (else held through w2's GEMM)
        hidden = formats.nvfp4_quantize(_swiglu_rows(gate_up_bf16, w1_row_factor, src_rank, padded_rows),
                                        four_over_six=True)
        h_values, h_factor = _block_values(hidden)
        w2_values = values_of("w2_values", w2q)
        out = _grouped_mm(h_values[:num_rows], w2_values.transpose(1, 2), group_ends)
        kept_w2_values = w2_values if keep_weight_values else None
        del w2_values
        _scale_rows_(out, h_factor[:num_rows] * _expert_factor(w2q, expert_of_row), src_rank)

        _save_for_backward(ctx, _Saved(tokens=tokens, hidden=hidden, gate_up_bf16=gate_up_bf16,
                                       w1_row_factor=w1_row_factor, w1=w1q, w2=w2q, group_ends=group_ends,
                                       expert_of_row=expert_of_row, src_rank=src_rank, padded_rows=padded_rows,
                                       seeds=_backward_seeds(seed), w1_values=kept_w1_values,
                                       w2_values=kept_w2_values), _storages(result), rows.device)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @formats._keeps_subnormals
    def backward(ctx, grad_out):
        if ctx.freed:
            raise RuntimeError("backward through training.expert_mlp a second time: its saved operands were freed by "
                               "the first backward (retain_graph is not supported here)")
        s: Optional[_Saved] = _saved_for_backward(ctx)
        ctx.saved, ctx.freed = None, True  # (freed with this backward; autograd frees the saved tensors)
        main_grad_of, ctx.main_grad_of = ctx.main_grad_of, None
        if main_grad_of is not None:
            _check_main_grads(*main_grad_of)  # (again: the trainer may have replaced them since the forward)
            # (the weights whose gradient this backward adds into main_grad)
            _flag_added_to_main_grad([w for w, wanted in zip(main_grad_of, ctx.needs_input_grad[1:3]) if wanted])
        if s is None:  # (no rows: zero weight gradients, or nothing to add)
            w1, w2 = ctx.w1_shape_device, ctx.w2_shape_device
            if main_grad_of is not None:
                return (grad_out.new_zeros(0, w1[0][2], dtype=ctx.rows_dtype), None, None) + _NO_GRADS
            return (grad_out.new_zeros(0, w1[0][2], dtype=ctx.rows_dtype),
                    torch.zeros(w1[0], dtype=ctx.w1_dtype, device=w1[1]),
                    torch.zeros(w2[0], dtype=ctx.w2_dtype, device=w2[1])) + _NO_GRADS
        src, rows_p = s.src_rank, s.padded_rows

        def seed_of(tensor: str) -> formats.SeedArg:
            return s.seeds[tensor]
        want_rows, want_w1, want_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # w2: dgrad (MXFP8 along H) and wgrad (MXFP8 along the tokens), both roundings of g from one read.
        g_rows, g_tokens = _mxfp8_round_trips(grad_out.to(torch.bfloat16), src, rows_p,
                                              seed_of("g_rows") if want_rows or want_w1 else None,
                                              seed_of("g_tokens") if want_w2 else None)
        d_hidden = None
        if want_rows or want_w1:
            w2_values = s.w2_values if s.w2_values is not None else _weight_values(s.w2)
            s.w2_values = None  # (freed after its one use)
            d_hidden = _grouped_mm(g_rows, w2_values, s.group_ends)  # (bf16; W2's expert factor below)
            del w2_values
        del g_rows
        grad_w2 = None
        if want_w2:
            h_tokens = formats.mxfp8_dequantize(formats.nvfp4_to_mxfp8_transposed(
                s.hidden, rounding="stochastic", seed=seed_of("h_tokens")), dtype=torch.bfloat16)    # [I, Rp]
            grad_w2 = _weight_gradient(g_tokens, h_tokens, s.group_ends, ctx.w2_dtype,  # [E, H, I]
                                       main_grad_of[1].main_grad if main_grad_of is not None else None)
            del g_tokens, h_tokens
        if d_hidden is None:
            return (None, None, grad_w2) + _NO_GRADS
        # SwiGLU's backward in FP32 from the forward's pre-activations, rounded to BF16 (the source of both MXFP8
        # roundings of w1's backward), then w1's dgrad (MXFP8 along 2I) and wgrad (MXFP8 along the tokens).
        d_gate_up = _swiglu_backward_rows(d_hidden, _expert_factor(s.w2, s.expert_of_row), s.gate_up_bf16,
                                          s.w1_row_factor, src)
        del d_hidden
        d_rows, d_tokens = _mxfp8_round_trips(d_gate_up, src, rows_p,
                                              seed_of("d_gate_up_rows") if want_rows else None,
                                              seed_of("d_gate_up_tokens") if want_w1 else None)
        del d_gate_up
        grad_rows = None
        if want_rows:
            w1_values = s.w1_values if s.w1_values is not None else _weight_values(s.w1)
            s.w1_values = None
            d_x = _grouped_mm(d_rows, w1_values, s.group_ends)
            del w1_values
            grad_rows = _scale_rows_(d_x, _expert_factor(s.w1, s.expert_of_row), src).to(ctx.rows_dtype)
        grad_w1 = None
        if want_w1:
            x_tokens = formats.mxfp8_dequantize(formats.nvfp4_to_mxfp8_transposed(
                s.tokens, rounding="stochastic", seed=seed_of("x_tokens")), dtype=torch.bfloat16)    # [H, Rp]
            grad_w1 = _weight_gradient(d_tokens, x_tokens, s.group_ends, ctx.w1_dtype,  # [E, 2I, H]
                                       main_grad_of[0].main_grad if main_grad_of is not None else None)
        return (grad_rows, grad_w1, grad_w2) + _NO_GRADS


def _check_routed(routed, w1: torch.Tensor, w2: torch.Tensor) -> None:
    if not isinstance(routed, RoutedTokens):
        raise TypeError(f"routed must be what ep_comm.training.dispatch returned, got {type(routed).__name__}")
    # (host-side metadata only, so no wait for a dispatch on a comm_stream: _ExpertMLPFunction waits before its first
    # device read of the result)
    result = routed.link.result
    if not isinstance(result.x, formats.NVFP4Tensor):
        raise ValueError("the trainable experts read the NVFP4 tokens of the dispatch: make the Buffer with "
                         f"dispatch_format='nvfp4' (this one dispatched {type(result.x).__name__})")
    if getattr(result, "row_index", None) is not None:
        raise ValueError("the trainable experts need the expert-major rows of an expanding dispatch")
    cfg = routed.link.buffer.config
    if cfg.expert_alignment % formats.MX_BLOCK:
        raise ValueError(f"the trainable experts' weight gradients quantize 32 rows of one expert per MXFP8 block: "
                         f"make the Buffer with expert_alignment a multiple of 32 (it has {cfg.expert_alignment})")
    experts, two_i, hidden = w1.shape
    if experts != cfg.num_local_experts or hidden != cfg.hidden:
        raise ValueError(f"w1 is [{experts}, {two_i}, {hidden}]; the Buffer has {cfg.num_local_experts} local experts "
                         f"of hidden {cfg.hidden}")
    if w1.device != result.src_rank.device or w2.device != w1.device:
        raise ValueError(f"the weights (w1 on {w1.device}, w2 on {w2.device}) must be on the tokens' device "
                         f"({result.src_rank.device})")


@eager_only
def expert_mlp(routed: RoutedTokens, w1: torch.Tensor, w2: torch.Tensor, seed: formats.SeedArg,
               keep_weight_values: bool = False, accumulate_into_main_grad: bool = False) -> torch.Tensor:
    """The SwiGLU experts of this rank on a `training.dispatch` result, with autograd: bf16 [R, H] in the dispatch
    layout (zero outside the rows in use), ready for `training.combine`.

    w1: [E_local, 2I, H] (gate rows, then up rows), w2: [E_local, H, I]; float32 or bfloat16 master weights
    (parameters); H and I multiples of 32. No host synchronization on CUDA tensors (so non-finite masters are not
    refused: see quantize_expert_weights). seed: the backward's stochastic rounding, an int in [0, 2^64), or a
    one-element int64 tensor on the weights' device holding its 64 bits (two's complement), read on the device when
    the forward runs -- the form for CUDA graphs: a replay uses the value the tensor holds then, where an int would be
    the capture's for ever. Give each call its own (ExpertMLP hashes its seed with a call counter kept on the device):
    a repeated seed repeats the rounding noise. The gradient of the dispatched rows is returned to the dispatch
    through routed.carrier (and so reaches x; routed.x, the dense rows, is never made here), those of w1 and w2 in
    their dtypes. See the module docstring for the numerics.

    keep_weight_values: keep the forward's BF16 block values of the NVFP4 weights (2 bytes per weight, as autocast keeps
    its BF16 weight copies) until the backward, which then does not decode them again from the NVFP4 weights (0.56
    bytes per weight); the same bits either way. Off by default (memory before speed).

    accumulate_into_main_grad: the backward adds the weight gradients into `w1.main_grad` / `w2.main_grad` (float32,
    the weights' shapes, contiguous: the FP32 gradient buffers of trainers that accumulate micro-batches there,
    Megatron-style) instead of returning them: w1.grad / w2.grad are not written, the weights' gradient hooks do not
    run, and `grad_added_to_main_grad` is set to True on weights that have that attribute. On an sm_90 GPU the
    weight-gradient GEMM adds its FP32 accumulators into main_grad as it stores them (no gradient tensor, no separate
    addition pass), for float32 and bfloat16 masters alike; elsewhere the gradient is computed as without it and added.
    Either way each element of main_grad gets exactly one FP32 addition per backward."""
    _check_expert_inputs(routed, w1, w2, keep_weight_values, accumulate_into_main_grad)
    return _expert_mlp(routed, w1, w2, seed, keep_weight_values, accumulate_into_main_grad, None)


def _check_flags(keep_weight_values, accumulate_into_main_grad) -> None:
    """expert_mlp's and ExpertMLP's two switches must be bools (a 1 or a tensor would be taken as true silently)."""
    for name, flag in (("keep_weight_values", keep_weight_values),
                       ("accumulate_into_main_grad", accumulate_into_main_grad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def _check_expert_inputs(routed: RoutedTokens, w1: torch.Tensor, w2: torch.Tensor, keep_weight_values: bool,
                         accumulate_into_main_grad: bool) -> None:
    """Everything _expert_mlp takes but the seed: checked before ExpertMLP draws a call seed, so that a refused call
    draws none."""
    for name, w in (("w1", w1), ("w2", w2)):  # (first: _check_routed reads their shapes and devices)
        # (float16 masters are refused: the bf16 weight gradients would overflow their range, silently)
        if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be a float32 or bfloat16 tensor, got "
                            f"{getattr(w, 'dtype', type(w).__name__)}")
        if w.dim() != 3:
            raise ValueError(f"w1 must be [E, 2I, H] and w2 [E, H, I]; {name} is {tuple(w.shape)}")
    _check_routed(routed, w1, w2)
    _check_flags(keep_weight_values, accumulate_into_main_grad)
    experts, two_i, hidden = w1.shape
    if two_i % 2 or tuple(w2.shape) != (experts, hidden, two_i // 2):
        raise ValueError(f"w1 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    if (two_i // 2) % formats.MX_BLOCK:
        raise ValueError(f"I must be a multiple of 32 (MXFP8 blocks of the backward), got {two_i // 2}")
    if accumulate_into_main_grad:
        _check_main_grads(w1, w2)


def _expert_mlp(routed: RoutedTokens, w1: torch.Tensor, w2: torch.Tensor, seed: formats.SeedArg,
                keep_weight_values: bool, accumulate_into_main_grad: bool,
                weight_cache: Optional[_WeightCache]) -> torch.Tensor:
    """expert_mlp on inputs its callers have checked (_check_expert_inputs), the seed apart."""
    seed = formats._check_seed_arg(seed, w1.device)
    # (routed.carrier, not routed.x: the values come from result.x, so the dense rows are never made)
    return _ExpertMLPFunction.apply(routed.carrier, w1, w2, routed.link.result, seed, keep_weight_values,
                                    accumulate_into_main_grad, weight_cache, routed.wait)


def _check_ep_mesh(ep_mesh, buffer) -> None:
    """ExpertMLP(ep_mesh=...)'s mesh must be the Buffer's group, rank for rank (global ranks in the same order): its
    shards are the experts the Buffer routes to each rank."""
    import torch.distributed as dist
    mesh_ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    buffer_ranks = dist.get_process_group_ranks(buffer.group)
    if mesh_ranks != buffer_ranks:
        raise ValueError(f"ExpertMLP's ep_mesh is over the ranks {mesh_ranks}, the Buffer's group over {buffer_ranks}: "
                         "the local experts would not be the ones routed here (make the Buffer over "
                         "ep_mesh.get_group())")


class ExpertMLP(torch.nn.Module):
    """This rank's SwiGLU experts as trainable parameters: w1 [E_local, 2I, H] (gate rows, then up rows) and w2
    [E_local, H, I] (float32 masters by default; float32 or bfloat16), initialised N(0, 1 / fan_in).

    forward(routed) -> bf16 [R, H]: `expert_mlp` with a new seed per call, a hash of (seed, the call count). The count
    (`call_count`, an int64 buffer on the weights' device) is incremented and hashed on the device by the forward
    itself, so a CUDA graph that captured the forward and backward draws fresh rounding noise at every replay; it is
    saved in state_dict (extra state), so a resumed run does not replay the first steps' noise. Give each layer its
    own seed, and the same seed on every rank with this rank's place in the EP group as ep_rank (`Buffer.rank`), which
    is mixed into it: the EP ranks then draw different experts (ranks that pass the same seed without ep_rank or
    ep_mesh draw the same ones: right for replicas of one EP rank, not for the EP ranks of a layer).
    keep_weight_values, accumulate_into_main_grad: as for `expert_mlp` (the latter needs w1.main_grad / w2.main_grad
    set by the trainer before the forward; checked there and again in the backward).
    pack() -> moe.PackedExpertWeights: the same NVFP4 weights, bit for bit, for the inference MoELayer.

    forward(routed, is_first_microbatch=None), as Transformer Engine's modules take it, for gradient accumulation
    over micro-batches (the weights do not change between the micro-batches of one step): True quantizes the weights
    and keeps their NVFP4 form (0.56 bytes per weight; with keep_weight_values also their BF16 block values, 2 bytes
    per weight, once a forward with rows has decoded them) for the calls that follow with False, which reuse it
    instead of quantizing (and decoding) again -- the same bits. None (the default) quantizes at every call and drops
    what was kept; so does release_weight_cache() (what was kept stays held until then, optimizer step included).
    Pass True at the first micro-batch of every step: that is the contract. A call with False raises if nothing was
    kept, if w1 / w2 were replaced or moved (.to() drops what was kept), if their version counters moved (an in-place
    update through the parameter), or if any torch optimizer of this process took a step since (counted by a global
    step hook: fused and foreach steps, which do not always move the counters -- not on DTensor weights --, included);
    writes that neither moves -- through `.data`, into a flat buffer the parameters view (distributed optimizers that
    are not torch optimizers), an optimizer step replayed from a CUDA graph, FSDP2's gathering into the same memory --
    are not seen, and a False call after them would use the previous step's weights.

    reset_parameters() initialises the weights as the constructor does (from the seed) and zeroes call_count: the
    deferred initialisation after construction on the meta device and `to_empty()`.

    ep_mesh (a 1-D torch DeviceMesh over the Buffer's EP group, in its rank order; optional): w1 and w2 become DTensors
    of the whole layer's experts, [E, 2I, H] and [E, H, I] (E = num_local_experts x the mesh size), sharded along the
    experts over the mesh -- this rank holding its own E_local, as without it. That is what distributed checkpoints
    (torch.distributed.checkpoint) need to tell the EP ranks' experts apart: plain per-rank parameters all carry the
    same names and shapes, so a checkpoint keeps one EP rank's experts under them and gives them to every rank. It is
    also what FSDP2 composes with (fully_shard over the "dp" mesh of the same 2-D mesh; docs/TRAINING.md). Give every
    rank the same seed: the rank's position in ep_mesh is mixed into it, as ep_rank's is (so the extra state is the
    same on every rank, as a checkpoint that keeps one copy of it needs; ep_rank is not given with ep_mesh). Not with
    accumulate_into_main_grad. reset_parameters() needs the weights as the constructor made them (not after
    fully_shard: initialise first, or load a checkpoint), and so does pack() (after fully_shard: between the FSDP2
    module's unshard() and reshard())."""

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int, *, dtype: torch.dtype = torch.float32,
                 device=None, seed: int = 0, keep_weight_values: bool = False,
                 accumulate_into_main_grad: bool = False, ep_mesh=None, ep_rank: Optional[int] = None):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float32 or torch.bfloat16 (the master weights), got {dtype}")
        # (here, not at the first forward: that one is refused only after the collective dispatch has run)
        num_local_experts = formats._as_int(num_local_experts, "num_local_experts")
        if num_local_experts <= 0:
            raise ValueError(f"num_local_experts must be positive, got {num_local_experts}")
        for name, value, why in (("hidden", hidden, "a Buffer's rows"),
                                 ("intermediate", intermediate, "the backward's MXFP8 blocks")):
            value = formats._as_int(value, name)
            if value <= 0 or value % formats.MX_BLOCK:
                raise ValueError(f"{name} must be a positive multiple of {formats.MX_BLOCK} ({why}), got {value}")
        hidden, intermediate = int(hidden), int(intermediate)
        _check_flags(keep_weight_values, accumulate_into_main_grad)
        self.seed = formats._check_seed(seed)
        if ep_rank is not None:
            ep_rank = formats._as_int(ep_rank, "ep_rank")
            if ep_rank < 0:
                raise ValueError(f"ep_rank must be this rank's place in the EP group (>= 0), got {ep_rank}")
            if ep_mesh is not None:
                raise ValueError("give ExpertMLP ep_rank or ep_mesh, not both (the rank's place in ep_mesh is its "
                                 "ep_rank)")
        self.ep_rank = ep_rank
        self.ep_mesh = ep_mesh
        w1 = torch.empty(num_local_experts, 2 * intermediate, hidden, device=device, dtype=dtype)
        w2 = torch.empty(num_local_experts, hidden, intermediate, device=device, dtype=dtype)
        if ep_mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Shard
            if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
                raise TypeError(f"ep_mesh must be a 1-D torch DeviceMesh (the EP group), got {ep_mesh!r}")
            if accumulate_into_main_grad:
                raise ValueError("ExpertMLP(ep_mesh=...) does not take accumulate_into_main_grad=True (its main_grad "
                                 "buffers would be the DTensors' local shards: not supported)")
            # (the local experts are this rank's block of the layer's, in mesh rank order: what the Buffer routes)
            w1, w2 = (DTensor.from_local(w, ep_mesh, [Shard(0)], run_check=False) for w in (w1, w2))
        self.w1 = torch.nn.Parameter(w1)
        self.w2 = torch.nn.Parameter(w2)
        self.register_buffer("call_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        _EXPERT_MLPS.add(self)  # (training.clip_grad_norm_ asks which parameters are per-rank experts)
        self.keep_weight_values = keep_weight_values
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self._weight_cache: Optional[_WeightCache] = None  # (is_first_microbatch: see forward)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """w1, w2 ~ N(0, 1 / fan_in) from the seed (drawn in FP32 on the CPU), call_count 0, the kept weights
        dropped."""
        gen = torch.Generator().manual_seed(self._rank_seed())
        w1, w2 = self._local_weights()
        experts, two_i, hidden = w1.shape
        with torch.no_grad():  # (drawn in FP32 on the CPU, rounded to the masters' dtype: as the weights always were)
            w1.copy_(torch.randn(experts, two_i, hidden, generator=gen, dtype=torch.float32) / math.sqrt(hidden))
            w2.copy_(torch.randn(experts, hidden, two_i // 2, generator=gen, dtype=torch.float32)
                     / math.sqrt(two_i // 2))
            self.call_count.zero_()
        self._weight_cache = None

    def _rank_seed(self) -> int:
        """The seed this rank draws from: the seed mixed with the rank's place in the EP group (ep_rank, or its place in
        ep_mesh), or the seed alone without either."""
        mesh = getattr(self, "ep_mesh", None)
        ep_rank = mesh.get_local_rank() if mesh is not None else getattr(self, "ep_rank", None)
        return self.seed if ep_rank is None else _mix64(_mix64(self.seed) ^ ep_rank)

    def _local_weights(self):
        """(w1, w2) of this rank's experts: the parameters, or with ep_mesh their local tensors (differentiable).
        Refuses DTensors placed otherwise than the constructor placed them (sharded further, e.g. by fully_shard)
        where the caller needs the whole local experts outside a forward (reset_parameters, pack)."""
        if not _is_dtensor(self.w1) and not _is_dtensor(self.w2):
            return self.w1, self.w2
        from torch.distributed.tensor import Shard
        for w in (self.w1, self.w2):
            if (self.ep_mesh is None or not _is_dtensor(w) or w.device_mesh != self.ep_mesh
                    or tuple(w.placements) != (Shard(0),)):
                raise RuntimeError("ExpertMLP: the weights are DTensors placed as "
                                   f"{tuple(getattr(w, 'placements', ()))} over {getattr(w, 'device_mesh', None)}, "
                                   "not as the constructor placed them (sharded, e.g. by fully_shard outside its "
                                   "forward): "
                                   "initialise before sharding or load a checkpoint; pack() between the FSDP2 module's "
                                   "unshard() and reshard()")
        return self.w1.to_local(), self.w2.to_local()

    def _apply(self, fn, *args, **kwargs):
        # (.to(), .cuda(), .float(), to_empty(): the kept weights are stale after a move, and their weak references to
        # the parameters would stop torch from swapping DTensor parameters (ep_mesh), which it does by swap_tensors)
        self._weight_cache = None
        return super()._apply(fn, *args, **kwargs)

    def release_weight_cache(self) -> None:
        """Drops the weights kept by is_first_microbatch=True (their memory returns to the allocator)."""
        self._weight_cache = None

    def __setstate__(self, state) -> None:
        # (a module pickled before the call count moved to the device: its count was the int attribute `calls`)
        calls = state.pop("calls", None)
        super().__setstate__(state)
        if "call_count" not in self._buffers:
            self.register_buffer("call_count", torch.tensor(calls or 0, dtype=torch.int64, device=self.w1.device),
                                 persistent=False)
        self.__dict__.setdefault("_weight_cache", None)
        self.__dict__.setdefault("ep_mesh", None)
        _EXPERT_MLPS.add(self)  # (a copy or an unpickled module too: clip_grad_norm_'s check)

    @property
    def calls(self) -> int:
        """Forward calls so far (read from the device: a sync)."""
        return int(self.call_count.item())

    @eager_only
    def forward(self, routed: RoutedTokens, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """bf16 [R, H] expert outputs in routed's dispatch layout (`expert_mlp`; see the class docstring for the seed
        and is_first_microbatch)."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be None or a bool, got {type(is_first_microbatch).__name__}")
        # This rank's experts: with ep_mesh (or FSDP2's gathered DTensors of it) the local tensors, differentiable.
        w1, w2 = _local(self.w1), _local(self.w2)
        # (before the weights are quantized for the cache and before a call seed is drawn: a refused call draws none;
        # the mesh first, whose mismatch would also show as a count of local experts unlike the Buffer's)
        if self.ep_mesh is not None and isinstance(routed, RoutedTokens):
            _check_ep_mesh(self.ep_mesh, routed.link.buffer)
        _check_expert_inputs(routed, w1, w2, self.keep_weight_values, self.accumulate_into_main_grad)
        # (the size of the EP group these experts are split over: clip_grad_norm_ refuses them unnamed above one)
        self._ep_group_size = routed.link.buffer.config.world_size
        if is_first_microbatch is None:
            self._weight_cache = None
        elif is_first_microbatch:
            self._weight_cache = None  # (the previous step's, freed before quantizing again)
            self._weight_cache = _WeightCache(
                masters=(weakref.ref(self.w1), weakref.ref(self.w2)),
                versions=(_weight_state(self.w1), _weight_state(self.w2)), optimizer_steps=_optimizer_steps(),
                w1=quantize_expert_weights(w1),
                w2=quantize_expert_weights(w2), keep_values=self.keep_weight_values)
        else:
            cache = getattr(self, "_weight_cache", None)
            if cache is None:
                raise RuntimeError("ExpertMLP(..., is_first_microbatch=False): no weights were kept -- call with "
                                   "is_first_microbatch=True first (each step's first micro-batch)")
            if not _cache_serves(cache, self.w1, self.w2):
                raise RuntimeError("ExpertMLP(..., is_first_microbatch=False): w1 or w2 changed since the call with "
                                   "is_first_microbatch=True (updated in place, or a torch optimizer of this process "
                                   "took a step, replaced, moved, or gathered again into new memory, as FSDP2 does "
                                   "when it reshards the experts between micro-batches: keep them gathered through "
                                   "the step with fully_shard(..., reshard_after_forward=False) and "
                                   "set_reshard_after_backward(is_last_microbatch)): call with "
                                   "is_first_microbatch=True to quantize them again")
        if self.call_count.device != w1.device:  # (weights moved without the module's .to)
            self.call_count = self.call_count.to(w1.device)
        # the call seed _mix64(_mix64(seed) ^ calls), calls counted first (on the device, in the stream's order); with
        # ep_rank or ep_mesh the rank's seed (_rank_seed) stands for seed
        call_seed = _mix_seeds(self.call_count, [_mix64(self._rank_seed())], increment=True)
        return _expert_mlp(routed, w1, w2, call_seed, self.keep_weight_values, self.accumulate_into_main_grad,
                           self._weight_cache)

    def get_extra_state(self):
        """{"seed", "calls"} for state_dict (reads the call count: a sync)."""
        # (A module on the meta device has no count yet: 0, what reset_parameters() gives it.)
        return {"seed": self.seed, "calls": 0 if self.call_count.is_meta else self.calls}

    def set_extra_state(self, state) -> None:
        """Restores get_extra_state's seed and call count (load_state_dict)."""
        self.seed = formats._check_seed(state["seed"])
        calls = int(state["calls"])
        if self.call_count.is_meta or self.call_count.device != _local(self.w1).device:
            # (load_state_dict(..., assign=True) into a module built on the meta device: the weights are real now;
            # fill_ on the meta count would keep nothing)
            self.call_count = torch.tensor(calls, dtype=torch.int64, device=_local(self.w1).device)
        else:
            self.call_count.fill_(calls)

    def __getstate__(self):
        # The weights kept by is_first_microbatch=True are not pickled (nor deep-copied): they hold weak references to
        # this module's parameters, which a copy does not share; the copy's next call needs True again.
        state = dict(super().__getstate__())
        state["_weight_cache"] = None
        return state

    def pack(self):
        """moe.PackedExpertWeights of the current weights (moe.pack_weights: the bits the training forward uses)."""
        from . import moe
        w1, w2 = self._local_weights()
        return moe.pack_weights(w1.detach(), w2.detach())
