"""NVFP4 grouped GEMM for the MoE experts: packed weights, FP16-expanded activations, reference and CUDA paths.

The grouped GEMM multiplies the rows of each expert's segment of a dispatched activation matrix by that
expert's NVFP4 weight (y = x W_e^T), optionally with the SwiGLU of w1 fused into the epilogue.

Weights are packed once, offline (`pack_gemm_weights`), into the layout the kernel's A operand reads
(csrc/grouped_gemm.cu; the weight rows are the GEMM's M side):

* tile mt = packed rows [64 mt, 64 mt + 64), k-block kb = columns [64 kb, 64 kb + 64);
* inside a tile, thread t (warp w = t // 32, lane l = t % 32) owns rows r0 = 16 w + l // 4 and r1 = r0 + 8;
  k-step s in 0..3 covers columns 16 s .. 16 s + 15 of the k-block (one NVFP4 scale group);
* in k-step s the thread holds 4 pairs (the mma.m16n8k16 / wgmma A fragment), c = 16 s + 2 (l % 4):
  pair 0 = (r0, c..c+1), pair 1 = (r1, c..c+1), pair 2 = (r0, c+8..c+9), pair 3 = (r1, c+8..c+9);
* `values[e, mt, kb, t, s]` is one 32-bit word (stored as int32 bits): for pair j the low element's E2M1
  magnitude (code & 7) sits at bits m_j..m_j+2 and its sign at bit s_j, the high element's at the same bits + 16,
  with (m_j, s_j) = (9, 15), (6, 12), (3, 14), (0, 13) for j = 0..3 (`PAIR_MAGNITUDE_BIT`, `PAIR_SIGN_BIT`).
  Decoding pair j as an fp16x2, in 32-bit arithmetic: `((word & F_j) * M_j) & 0x8E008E00` is (low, high) * 2^-14
  exactly, with F = (0x8E008E00, 0x11C011C0, 0x40384038, 0x20072007) and M = (1, 8, 66, 516): the magnitude moves
  to bits 9-11 and the sign to bit 15; for pairs 2 and 3 the multiplier 2^a + 2^b moves the two by different
  distances in one integer multiply, and its other copies and carries stay outside the mask;
* `scales[e, mt, kb, r, s]` = code of the E4M3 block scale of tile row r (0..63) in k-step s (each scale
  stored once: 1/16 byte per weight), where the code of x (finite, >= 0) is `(fp16_bits(x * 2^7) >> 7) & 0xFF`;
  the kernel copies a tile's 256 scale bytes per k-block into shared memory, each thread reads the 4-byte
  words of its rows r0 and r1 and rebuilds fp16 x * 2^7 as `code << 7` (exact): k-steps 0 and 2 as the two
  halves of `(word << 7) & 0x7F807F80`, k-steps 1 and 3 as those of `(word >> 1) & 0x7F807F80`.

So the kernel accumulates acc = sum_k x * (e2m1 * scale * 2^-7) in FP32 (the products are exact in fp16)
and writes y = acc * 2^7 * factor[e] * row_factor[row], factor[e] = amax_e * fp32(1 / (6 * M)), M the weights'
e4m3_max (448 as `moe.pack_weights` makes them; 256 is taken too).

Rows are packed in an order that suits the epilogue (`row_perm`; a thread's accumulators are tile rows r0 = 16 w +
lane / 4 and r1 = r0 + 8):
* with swiglu=True the w1 rows (gate rows 0..I-1, then up rows I..2I-1) are permuted so that each 16-row group
  holds 8 gate rows and the 8 matching up rows (packed row p = 16 q + g takes gate row 8 q + g for g < 8 and up row
  I + 8 q + g - 8 otherwise): every thread holds gate row i in r0 and up row i in r1 and the epilogue writes
  silu(g_i) * u_i to output column i;
* otherwise in column pairs (packed row 16 q + g takes row 16 q + 2 g for g < 8 and row 16 q + 2 (g - 8) + 1
  otherwise): every thread holds two adjacent output columns and stores each token's pair with one 2-wide store.

Activations are expanded once per GEMM input (`expand_nvfp4_rows`): FP16 block values e2m1 * e4m3 (exact)
plus one FP32 outer factor per row, applied in the epilogue.

Inexact FP8 mode (opt-in: `expand_nvfp4_rows(q, precision="fp8_inexact")`, whose rows say so in
`ExpandedRows.precision`; the GEMM checks it against the values' dtype float8_e4m3fn). Hopper's E4M3 wgmma runs at
twice the fp16 rate, but e2m1 * e4m3 products (up to 6 significant bits) do not fit E4M3 (4): the kernel rounds each weight value e2m1 * scale * 2^-3 to E4M3 (RNE) in
registers, and the activations are stored as E4M3 of e2m1 * scale * 2^-3 (RNE; row_factor carries the 2^3). Within
each 16-column group the activation columns are stored in the order `FP8_COLUMN_ORDER` (stored column o holds column
FP8_COLUMN_ORDER[o]), the order in which the fp16 weight fragments feed wgmma's 32-wide E4M3 steps: the same packed
weights serve both modes. The extra error (the two roundings, plus the tensor core's FP8 accumulation) is measured in
bench/bench_grouped_gemm.py and documented in docs/GEMM.md; `_grouped_gemm_reference` with FP8 rows computes the
rounded operands' product in FP32.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext
from ._compile import eager_only
from .formats import (NVFP4_ACTIVATION_E4M3_MAX, NVFP4_BLOCK, NVFP4_WEIGHT_E4M3_MAX, NVFP4Tensor, _as_int,
                      _check_amax_values, _check_float_input, _check_nvfp4, _cuda_kernels_problem, _f32,
                      _keeps_subnormals, _nan_to_zero_abs, _pack_e2m1_codes, _reference_fallback, _unpack_e2m1_codes,
                      _use_cuda, e2m1_decode, e4m3_decode, e4m3_encode)
from .types import CombineRowsTarget

__all__ = [
    "GemmWeights", "ExpandedRows", "pack_gemm_weights", "unpack_gemm_weights", "dequantize_gemm_weights",
    "expand_nvfp4_rows", "grouped_gemm_nvfp4", "grouped_gemm_nvfp4_combine_rows", "has_combine_rows_kernel",
    "gemm_kernels_unavailable", "swiglu_row_permutation", "column_pair_row_permutation", "TILE_ROWS", "TILE_K",
    "TOKEN_TILES", "PRECISIONS", "FP8_COLUMN_ORDER", "fp8_rows_in_column_order",
]

TILE_ROWS = 64          # weight rows per tile (the kernel's M tile)
TILE_K = 64             # columns per k-block
THREADS_PER_TILE = 128  # one warpgroup
K_STEPS = 4             # 16-column k-steps per k-block (one NVFP4 scale group each)
TOKEN_TILES = (16, 32, 64, 128)
PRECISIONS = ("exact", "fp8_inexact")


def check_precision(precision, name: str = "precision") -> bool:
    """Refuses a value that is not one of PRECISIONS (ValueError naming them); True for the inexact FP8 mode. The one
    check behind every function and class that takes a precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision == "fp8_inexact"


# FP8 mode: stored column o of a 16-column group holds column FP8_COLUMN_ORDER[o] (module docstring): wgmma reads the
# 4 bytes of A register a0 as columns 4t .. 4t + 3 of its 32-wide step, and the fp16 fragment they come from holds
# columns 2t, 2t + 1, 2t + 8, 2t + 9 of the 16-column k-step (t = lane % 4).
def _fp8_column_order(device) -> torch.Tensor:
    """FP8_COLUMN_ORDER on `device`, computed there (no host-to-device copy, so a CUDA-graph capture can hold it)."""
    o = torch.arange(16, dtype=torch.int64, device=device)
    return 2 * (o // 4) + o % 2 + 8 * ((o % 4) // 2)


FP8_COLUMN_ORDER = tuple(_fp8_column_order("cpu").tolist())
_FP8_ACTIVATION_SCALE = 0.125  # e2m1 * e4m3 <= 6 * 448: times 2^-3 it stays below E4M3's 448
_FP8_WEIGHT_SCALE = 0.125      # the same for the weights (the kernel: the fp16 decode's 2^-7, times 16)
_OUT_TYPES = {torch.float32: 0, torch.bfloat16: 1}
_SCALE_SHIFT = 7        # scale code << 7 = fp16 bits of scale * 2^7
# Packed pair j of a k-step word (module docstring): bit of the low element's magnitude (3 bits) and sign
# (the high element's are 16 higher).
PAIR_MAGNITUDE_BIT = (9, 6, 3, 0)
PAIR_SIGN_BIT = (15, 12, 14, 13)


# ----------------------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class GemmWeights:
    """NVFP4 expert weights [E, N, K] packed for `grouped_gemm_nvfp4` (see the module docstring for the layout).

    values: int32 [E, N/64, K/64, 128, 4], one 32-bit word of 8 E2M1 codes per (thread, k-step).
    scales: uint8 [E, N/64, K/64, 64, 4], scale codes (fp16 bits of scale * 2^7) >> 7 per (tile row, k-step).
    factor: float32 [E], the per-expert outer decode scale amax_e * fp32(1 / (6 * e4m3_max)).
    amax: float32 [E], the per-expert amax (kept so `dequantize_gemm_weights` reproduces
        `formats.nvfp4_dequantize` bit for bit: it computes (scale * amax) * fp32(1 / (6 * e4m3_max))).
    row_perm: int64 [N], packed row p holds original row row_perm[p] (`swiglu_row_permutation` with swiglu, else
        `column_pair_row_permutation`: the row order the kernel's epilogue assumes).
    n, k: the logical GEMM sizes (output features, input features); swiglu: whether w1's SwiGLU is fused
        (then the GEMM writes N/2 columns); e4m3_max: the NVFP4 bound M of the weights (448).
    row_order: the packed row order, "swiglu" or "column_pairs" (what `pack_gemm_weights` writes). GemmWeights
        without SwiGLU packed by ep_comm before 2026-12-02 (plain row order) unpickle with "plain" and are refused by
        the GEMMs: repack them from the NVFP4 weights (`MoELayer` packs at construction); with SwiGLU the order has not
        changed, so "plain" is taken there. It is a label: the kernels trust that row_perm is the order it names
        (comparing the tensors would cost a device sync per call).
    """

    values: torch.Tensor
    scales: torch.Tensor
    factor: torch.Tensor
    amax: torch.Tensor
    row_perm: torch.Tensor
    n: int
    k: int
    swiglu: bool
    e4m3_max: float = 448.0
    row_order: str = "plain"

    @property
    def num_experts(self) -> int:
        """E, the experts packed."""
        return self.values.shape[0]

    @property
    def out_features(self) -> int:
        """Columns of the GEMM output: n, or n / 2 with the fused SwiGLU."""
        return self.n // 2 if self.swiglu else self.n

    @property
    def device(self) -> torch.device:
        """Where the packed weights are."""
        return self.values.device

    def nbytes(self) -> int:
        """Bytes the kernel streams for the weights (values + scales + factor)."""
        return (self.values.numel() * self.values.element_size() + self.scales.numel()
                + self.factor.numel() * self.factor.element_size())

    def experts(self, start: int, stop: int) -> "GemmWeights":
        """The experts [start, stop) as their own GemmWeights (views, no copy); at least one (the kernel takes no empty
        expert list)."""
        start, stop = _as_int(start, "start"), _as_int(stop, "stop")
        if not 0 <= start < stop <= self.num_experts:
            raise ValueError(f"expert range [{start}, {stop}) is empty or outside [0, {self.num_experts})")
        return GemmWeights(values=self.values[start:stop], scales=self.scales[start:stop],
                           factor=self.factor[start:stop], amax=self.amax[start:stop], row_perm=self.row_perm,
                           n=self.n, k=self.k, swiglu=self.swiglu, e4m3_max=self.e4m3_max, row_order=self.row_order)



# Saved with torch.save (packing is an offline step), GemmWeights loads with torch.load's default weights-only
# unpickling (after import ep_comm), as the format containers and moe.PackedExpertWeights do.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([GemmWeights])


@dataclass(frozen=True, eq=False)  # (identity comparison: field-wise == of tensors is ambiguous and raised)
class ExpandedRows:
    """NVFP4 rows expanded for the grouped GEMM.

    values: float16 [R, K], e2m1 * e4m3 block scale (exact in fp16; no outer scale); or, in the inexact FP8 mode,
        float8_e4m3fn [R, K]: E4M3 of e2m1 * e4m3 * 2^-3 (RNE), columns permuted inside each 16-column group
        (`FP8_COLUMN_ORDER`).
    row_factor: float32 [R], the outer decode scale amax / (6 * e4m3_max) of each row (formats' fp32
        arithmetic: amax * fp32(1 / (6 * e4m3_max))); times 8 in the FP8 mode.
    The dequantized row is values * row_factor (a few fp32 ulp from `formats.nvfp4_dequantize`, which multiplies in
    another order: two roundings against three, up to 3 ulp seen; FP8: after undoing the column order, and with the
    E4M3 rounding).
    precision: "exact" or "fp8_inexact", which of the two forms values and row_factor are (the GEMM checks it against
        the values' dtype: E4M3 values made some other way, in natural column order or without the factor 8, would
        give wrong results, so they must come from expand_nvfp4_rows, quantize_expanded_rows or
        Buffer.dispatch_waves, which write this form).
    """

    values: torch.Tensor
    row_factor: torch.Tensor
    precision: str = "exact"  # "fp8_inexact": the FP8 operand rows above (column order and row_factor * 8 included)

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]


# ----------------------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------------------
def swiglu_row_permutation(n: int, device=None) -> torch.Tensor:
    """int64 [n]: packed row p = 16 q + g takes gate row 8 q + g (g < 8) or up row n/2 + 8 q + g - 8."""
    n = _as_int(n, "n")
    if n % 64 != 0 or n <= 0:
        raise ValueError(f"swiglu needs N = 2I with I % 32 == 0, got N = {n}")
    p = torch.arange(n, dtype=torch.int64, device=device)
    q, g = p // 16, p % 16
    return torch.where(g < 8, 8 * q + g, n // 2 + 8 * q + (g - 8))


def column_pair_row_permutation(n: int, device=None) -> torch.Tensor:
    """int64 [n]: packed row p = 16 q + g takes row 16 q + 2 g (g < 8) or 16 q + 2 (g - 8) + 1 (the row order of
    weights without SwiGLU: a thread's tile rows r0 and r0 + 8 are then adjacent output columns)."""
    n = _as_int(n, "n")
    if n % 16 != 0 or n <= 0:
        raise ValueError(f"the column-pair row order needs N % 16 == 0, got N = {n}")
    p = torch.arange(n, dtype=torch.int64, device=device)
    q, g = p // 16, p % 16
    return 16 * q + torch.where(g < 8, 2 * g, 2 * (g - 8) + 1)


def _fragment_index(device):
    """Tile-local (row, column of the low element) for each (thread t, k-step s, pair j): int64 [128, 4, 4] x2."""
    t = torch.arange(THREADS_PER_TILE, dtype=torch.int64, device=device)
    w, lane = t // 32, t % 32
    r0 = 16 * w + lane // 4
    j = torch.arange(4, dtype=torch.int64, device=device)
    s = torch.arange(K_STEPS, dtype=torch.int64, device=device)
    rows = (r0[:, None] + 8 * (j % 2)[None, :])[:, None, :].expand(THREADS_PER_TILE, K_STEPS, 4)
    cols = (16 * s[None, :, None] + 2 * (lane % 4)[:, None, None] + 8 * (j // 2)[None, None, :])
    return rows, cols.expand(THREADS_PER_TILE, K_STEPS, 4)


_SHIFT_J = (0, 1, 2, 3)


def _to_int32_bits(word: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the same 32 bits as int32."""
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _e4m3_scale_codes(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 scales (finite, >= 0) -> uint8 codes (fp16_bits(x * 2^7) >> 7) & 0xFF (exact)."""
    half = (e4m3_decode(scales.view(torch.uint8)) * 128.0).to(torch.float16)
    bits = half.view(torch.int16).to(torch.int32) & 0xFFFF
    return ((bits >> _SCALE_SHIFT) & 0xFF).to(torch.uint8)


def _scale_codes_to_e4m3_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 scale codes -> fp32 scale values (code << 7 as fp16, times 2^-7; exact)."""
    bits = codes.to(torch.int32) << _SCALE_SHIFT
    bits = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return bits.view(torch.float16).float() * (2.0 ** -7)


# ----------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------
def _one_amax_per_expert(amax: torch.Tensor) -> bool:
    """Whether amax [E, N] is equal along N, bit for bit (torch.equal takes -0.0 == +0.0): the packed form keeps one
    amax per expert, so a mix of +0 and -0 along N would come back (unpack_gemm_weights, dequantize_gemm_weights) with
    row 0's sign everywhere. (A device->host read.)"""
    bits = amax.float().contiguous().view(torch.int32)
    return torch.equal(bits, bits[:, :1].expand_as(bits))


# The largest expert amax whose NVFP4 weights decode finite: the decode computes f(s_b * amax) first, and the block that
# holds the amax has s_b up to 448 (docs/NUMERICS.md, known limits: above FLT_MAX / s_b a whole finite row decodes to
# +-Inf or NaN; the reference path's outputs then are NaN, and so are the trainable experts' decoded weights).
MAX_WEIGHT_AMAX = torch.finfo(torch.float32).max / NVFP4_WEIGHT_E4M3_MAX


def check_weight_amax(amax: torch.Tensor, name: str) -> None:
    """ValueError when some expert amax is NaN or above MAX_WEIGHT_AMAX (a device->host read: offline / construction
    only)."""
    largest = float(amax.float().max()) if amax.numel() else 0.0  # (NaN when any is: torch's max propagates it)
    if largest != largest:
        raise ValueError(f"{name} has an expert whose amax is NaN")
    if largest > MAX_WEIGHT_AMAX:
        raise ValueError(f"{name} has an expert whose largest |weight| is {largest:.3e}, above {MAX_WEIGHT_AMAX:.3e}: "
                         f"its NVFP4 weights would decode to Inf / NaN (docs/NUMERICS.md, known limits); scale the "
                         f"master weights down")


def _check_weight_values(w: NVFP4Tensor, name: str = "weight") -> None:
    """Refuses NVFP4 weights whose values no expert path can use: E4M3 scale bytes 0x7F..0xFF (NaN or negative
    scales) and an amax that is NaN, Inf, negative or so large that the weights decode to Inf (MAX_WEIGHT_AMAX).
    pack_gemm_weights and MoELayer (on either expert path) both call it, so the reference path does not take weights
    that the fused path refuses. Reads the values (a device->host sync: an offline or construction-time check)."""
    if bool((w.scales.view(torch.uint8) >= 0x7F).any()):
        raise ValueError(f"{name} scales must be finite and non-negative (E4M3 bytes 0x00..0x7E); "
                         "found negative or NaN scales")
    amax = w.amax.float()
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"{name} amax must be finite and non-negative")
    check_weight_amax(amax, name)


@_keeps_subnormals
def pack_gemm_weights(w: NVFP4Tensor, swiglu: bool) -> GemmWeights:
    """Pack NVFP4 expert weights w (logical [E, N, K], one amax per expert) for `grouped_gemm_nvfp4`.

    w.data uint8 [E, N, K/2], w.scales float8_e4m3fn [E, N, K/16] (finite, >= 0), w.amax float32 [E, N]
    equal along N (finite, >= 0), as `moe.pack_weights` makes them. N % 64 == 0 and K % 64 == 0.
    swiglu: w is w1 with the gate rows first and the up rows last (N = 2I); the rows are interleaved so the
    kernel's epilogue can fuse silu(gate) * up.
    Runs on w's device, one expert at a time (int64 temporaries of ~8 bytes per weight of one expert); it
    checks the values, so it synchronizes with the device (an offline step).
    """
    _check_nvfp4(w)
    if w.data.dim() != 3:
        raise ValueError(f"pack_gemm_weights expects [E, N, K] weights, got data of shape {tuple(w.data.shape)}")
    experts, n, half_k = w.data.shape
    k = 2 * half_k
    if experts == 0:
        raise ValueError("pack_gemm_weights needs at least one expert")
    if n % TILE_ROWS != 0 or n == 0 or k % TILE_K != 0 or k == 0:
        raise ValueError(f"N ({n}) and K ({k}) must be positive multiples of 64")
    if w.scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"scales must be float8_e4m3fn, got {w.scales.dtype}")
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    _check_weight_values(w)
    scale_bytes = w.scales.view(torch.uint8)
    amax = w.amax.float()
    if not _one_amax_per_expert(amax):
        raise ValueError("pack_gemm_weights needs one amax per expert (w.amax equal along N, bit for bit, as "
                         "moe.pack_weights makes it)")
    device = w.data.device
    row_perm = swiglu_row_permutation(n, device) if swiglu else column_pair_row_permutation(n, device)
    amax_e = amax[:, 0].contiguous()
    factor = amax_e * _f32(1.0 / (6.0 * w.e4m3_max), device)

    tiles_m, tiles_k = n // TILE_ROWS, k // TILE_K
    frag_rows, frag_cols = _fragment_index(device)
    low_mag_shift = torch.tensor(PAIR_MAGNITUDE_BIT, dtype=torch.int64, device=device)
    low_sign_shift = torch.tensor(PAIR_SIGN_BIT, dtype=torch.int64, device=device)
    high_mag_shift, high_sign_shift = low_mag_shift + 16, low_sign_shift + 16
    values = torch.empty(experts, tiles_m, tiles_k, THREADS_PER_TILE, K_STEPS, dtype=torch.int32, device=device)
    scales = torch.empty(experts, tiles_m, tiles_k, TILE_ROWS, K_STEPS, dtype=torch.uint8, device=device)
    for e in range(experts):
        codes = _unpack_e2m1_codes(w.data[e].index_select(0, row_perm))                  # [N, K]
        tiles = codes.reshape(tiles_m, TILE_ROWS, tiles_k, TILE_K).permute(0, 2, 1, 3)   # [mt, kb, 64, 64]
        low = tiles[:, :, frag_rows, frag_cols]                                        # [mt, kb, 128, 4, 4]
        high = tiles[:, :, frag_rows, frag_cols + 1]
        word = (((low & 7) << low_mag_shift) | ((low >> 3) << low_sign_shift)
                | ((high & 7) << high_mag_shift) | ((high >> 3) << high_sign_shift)).sum(dim=-1)
        values[e] = _to_int32_bits(word)
        del codes, tiles, low, high, word
        sc = _e4m3_scale_codes(scale_bytes[e].index_select(0, row_perm))               # [N, K/16]
        scales[e] = sc.reshape(tiles_m, TILE_ROWS, tiles_k, K_STEPS).permute(0, 2, 1, 3)  # [mt, kb, 64, 4]
    return GemmWeights(values=values, scales=scales, factor=factor, amax=amax_e, row_perm=row_perm, n=n, k=k,
                       swiglu=swiglu, e4m3_max=float(w.e4m3_max), row_order=_row_order(swiglu))


def _row_order(swiglu: bool) -> str:
    return "swiglu" if swiglu else "column_pairs"


def _check_kernel_row_order(w: GemmWeights) -> None:
    """The kernels' epilogues assume pack_gemm_weights' row order (the Python helpers follow row_perm, whatever it is:
    unpack_gemm_weights also takes older GemmWeights, to repack them). SwiGLU weights kept their order: an older
    object ("plain", the field's default) is taken."""
    allowed = ("swiglu", "plain") if w.swiglu else ("column_pairs",)
    if w.row_order not in allowed:
        raise ValueError(f"GemmWeights with row order {w.row_order!r} (swiglu={w.swiglu}): this version's kernel "
                         f"needs {_row_order(w.swiglu)!r}; repack them with pack_gemm_weights from the NVFP4 weights "
                         "(weights without SwiGLU packed before 2026-12-02 have the plain order)")


def _check_gemm_weights(w) -> None:
    if not isinstance(w, GemmWeights):
        raise TypeError(f"expected GemmWeights (from pack_gemm_weights), got {type(w).__name__}")
    experts = w.values.shape[0] if w.values.dim() == 5 else -1
    expected_values = (experts, w.n // TILE_ROWS, w.k // TILE_K, THREADS_PER_TILE, K_STEPS)
    expected_scales = expected_values[:-2] + (TILE_ROWS, K_STEPS)
    if (w.values.dtype != torch.int32 or tuple(w.values.shape) != expected_values or w.scales.dtype != torch.uint8
            or tuple(w.scales.shape) != expected_scales or w.factor.dtype != torch.float32
            or tuple(w.factor.shape) != (experts,) or tuple(w.amax.shape) != (experts,)
            or tuple(w.row_perm.shape) != (w.n,) or w.n % TILE_ROWS or w.k % TILE_K):
        raise ValueError("inconsistent GemmWeights: values int32 [E, N/64, K/64, 128, 4], scales uint8 "
                         "[E, N/64, K/64, 64, 4], factor float32 [E], amax [E], row_perm [N] expected; got values "
                         f"{w.values.dtype}{tuple(w.values.shape)}, scales {w.scales.dtype}{tuple(w.scales.shape)}, "
                         f"factor {w.factor.dtype}{tuple(w.factor.shape)}, amax {tuple(w.amax.shape)}, "
                         f"row_perm {tuple(w.row_perm.shape)}, n={w.n}, k={w.k}")
    if w.e4m3_max not in (NVFP4_WEIGHT_E4M3_MAX, NVFP4_ACTIVATION_E4M3_MAX):  # (its decode factor 1 / (6 e4m3_max))
        raise ValueError(f"inconsistent GemmWeights: e4m3_max must be {NVFP4_WEIGHT_E4M3_MAX:g} or "
                         f"{NVFP4_ACTIVATION_E4M3_MAX:g}, got {w.e4m3_max!r}")


def _check_row_perm(w: GemmWeights) -> None:
    """The unpacking helpers scatter rows by row_perm: anything but a permutation of [0, N) would leave rows of their
    output uninitialised (a host read: these helpers are not on a hot path)."""
    perm = w.row_perm
    if perm.dtype != torch.int64 or not torch.equal(perm.sort().values, torch.arange(w.n, device=perm.device)):
        raise ValueError(f"inconsistent GemmWeights: row_perm must be an int64 permutation of [0, {w.n})")


def _expert_codes_and_scales(w: GemmWeights, e: int):
    """Expert e's E2M1 codes int64 [N, K] and E4M3 block scales fp32 [N, K/16], both in the packed row order."""
    device = w.values.device
    tiles_m, tiles_k = w.n // TILE_ROWS, w.k // TILE_K
    word = w.values[e].to(torch.int64) & 0xFFFFFFFF                                    # [mt, kb, 128, 4]
    mag = torch.tensor(PAIR_MAGNITUDE_BIT, dtype=torch.int64, device=device)
    sign = torch.tensor(PAIR_SIGN_BIT, dtype=torch.int64, device=device)
    word = word[..., None]                                                             # [mt, kb, 128, 4, 1]
    low = ((word >> mag) & 7) | (((word >> sign) & 1) << 3)                            # [mt, kb, 128, 4, 4]
    high = ((word >> (mag + 16)) & 7) | (((word >> (sign + 16)) & 1) << 3)
    frag_rows, frag_cols = _fragment_index(device)
    tiles = torch.empty(tiles_m, tiles_k, TILE_ROWS, TILE_K, dtype=torch.int64, device=device)
    tiles[:, :, frag_rows, frag_cols] = low
    tiles[:, :, frag_rows, frag_cols + 1] = high
    codes = tiles.permute(0, 2, 1, 3).reshape(w.n, w.k)
    sc = w.scales[e]                                                                   # [mt, kb, 64, 4]
    scale = _scale_codes_to_e4m3_float(sc.permute(0, 2, 1, 3).reshape(w.n, w.k // 16))
    return codes, scale


def _dequantize_expert(w: GemmWeights, e: int) -> torch.Tensor:
    """fp32 [N, K] of expert e in the original row order, with formats.nvfp4_dequantize's arithmetic."""
    codes, scale = _expert_codes_and_scales(w, e)
    final = (scale * w.amax[e].float()) * _f32(1.0 / (6.0 * w.e4m3_max), w.values.device)
    packed = (e2m1_decode(codes).reshape(w.n, w.k // 16, 16) * final[..., None]).reshape(w.n, w.k)
    return _in_original_row_order(w, packed)


def _in_original_row_order(w: GemmWeights, packed: torch.Tensor) -> torch.Tensor:
    """[N, K] rows in the packed order (w.row_perm) -> the original row order."""
    out = torch.empty_like(packed)
    out[w.row_perm] = packed
    return out


def _fp8_expert_weights(w: GemmWeights, e: int) -> torch.Tensor:
    """fp32 [N, K] of expert e in the original row order as the FP8 kernel multiplies it: E4M3 (RNE) of
    e2m1 * scale * 2^-3, times 2^3 * factor[e] (the epilogue's weight factor)."""
    codes, scale = _expert_codes_and_scales(w, e)
    rounded = (e2m1_decode(codes).reshape(w.n, w.k // 16, 16) * (scale * _FP8_WEIGHT_SCALE)[..., None]
               ).to(torch.float8_e4m3fn)
    return _in_original_row_order(w, rounded.float().reshape(w.n, w.k) * (w.factor[e] * (1.0 / _FP8_WEIGHT_SCALE)))


@_keeps_subnormals
def unpack_gemm_weights(w: GemmWeights) -> NVFP4Tensor:
    """The NVFP4 weights [E, N, K] that `pack_gemm_weights` packed into w, bit for bit: codes, E4M3 scale bytes, the
    per-expert amax broadcast along N, e4m3_max. What a layer that keeps only the packed form hands back for saving
    (`moe.MoELayer.weights`). One expert at a time, on w's device."""
    _check_gemm_weights(w)
    _check_row_perm(w)
    experts, device = w.num_experts, w.values.device
    data = torch.empty(experts, w.n, w.k // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(experts, w.n, w.k // 16, dtype=torch.uint8, device=device)
    for e in range(experts):
        codes, scale = _expert_codes_and_scales(w, e)
        data[e, w.row_perm] = _pack_e2m1_codes(codes)
        scales[e, w.row_perm] = e4m3_encode(scale)  # exact: the values are E4M3 bytes 0x00..0x7E decoded
    amax = w.amax.float()[:, None].expand(experts, w.n).contiguous()
    return NVFP4Tensor(data=data, scales=scales.view(torch.float8_e4m3fn), amax=amax, e4m3_max=w.e4m3_max)


@_keeps_subnormals
def dequantize_gemm_weights(w: GemmWeights) -> torch.Tensor:
    """Unpack GemmWeights to fp32 [E, N, K] in the original row order.

    Bitwise equal to `formats.nvfp4_dequantize` of the NVFP4Tensor they were packed from (same fp32 ops:
    e2m1 * ((scale * amax) * fp32(1 / (6 * e4m3_max)))).
    """
    _check_gemm_weights(w)
    _check_row_perm(w)
    out = torch.empty(w.num_experts, w.n, w.k, dtype=torch.float32, device=w.values.device)
    for e in range(w.num_experts):
        out[e] = _dequantize_expert(w, e)
    return out


# ----------------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------------
def _has_grouped_gemm_kernel() -> bool:
    return _ext.cuda_extension_available() and hasattr(_ext._C, "grouped_gemm_nvfp4")


def has_combine_rows_kernel() -> bool:
    """Whether ep_comm._C has the combine-row epilogue (grouped_gemm_nvfp4_combine_rows; a build with the CUDA core)."""
    return _ext.cuda_extension_available() and hasattr(_ext._C, "grouped_gemm_nvfp4_combine_rows")


_STALE_BUILD = "this ep_comm._C was built without the grouped GEMM (stale build): rebuild the extension"
_hopper_devices = {}  # device index -> whether it is sm_90 (asked once per device: the GEMM's hot path calls this)


def gemm_kernels_unavailable(device) -> str:
    """Why the grouped GEMM kernels (`grouped_gemm_nvfp4`, `grouped_gemm_nvfp4_combine_rows`; sm_90a code only)
    cannot run on `device` (a torch.device, or a string or index as torch.device takes it), or "" when they can."""
    if not isinstance(device, torch.device):
        device = torch.device(device)  # ("cuda:0", "cpu", 0; torch's own error for anything else)
    if device.type != "cuda":
        return f"{device} is not a CUDA device (the grouped GEMM kernels run on sm_90 GPUs)"
    problem = _cuda_kernels_problem(device)  # no extension, no image for this GPU, or a driver older than the runtime
    if problem:
        return problem
    if not _has_grouped_gemm_kernel():
        return _STALE_BUILD
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper_devices:
        _hopper_devices[index] = torch.cuda.get_device_capability(index) == (9, 0)
    if not _hopper_devices[index]:
        major, minor = torch.cuda.get_device_capability(index)
        return (f"the NVFP4 grouped GEMM kernels are sm_90a (Hopper) code and {torch.cuda.get_device_name(index)} is "
                f"sm_{major}{minor}")
    return ""


def _use_gemm_kernels(impl: str, t: torch.Tensor, what: str, hopper_only: bool = False) -> bool:
    """formats' impl rule, plus: a `_C` built before the grouped GEMM existed (stale build) cannot run these kernels
    (nor nvfp4_dequantize's block-scale-only mode), and (hopper_only: the GEMM itself) another GPU than sm_90 cannot
    run the GEMM: impl="cuda" raises, "auto" warns once and uses the reference."""
    if not _use_cuda(impl, t):
        return False
    why = gemm_kernels_unavailable(t.device) if hopper_only else ("" if _has_grouped_gemm_kernel() else _STALE_BUILD)
    if not why:
        return True
    if impl == "cuda":
        raise RuntimeError(f"{what}(impl='cuda'): {why}")
    return _reference_fallback(f"ep_comm.grouped_gemm.{what}", "uses the torch reference", why)


# The FP32 precision flags are process-wide, autocast is per thread. Threads that overlap in exact_fp32_matmuls share one
# switch: the first one in saves the caller's settings, the last one out restores them (each thread saving and restoring
# on its own would leave "ieee" behind whenever two overlap: the second saves what the first set and restores it last).
_exact_fp32_lock = threading.Lock()
_exact_fp32_users = 0
_exact_fp32_saved: list = []


def _set_exact_fp32_flags() -> list:
    """Sets FP32 matmuls to IEEE FP32 (no TF32 on CUDA, no reduced precision in oneDNN's CPU matmuls); returns what
    restores the caller's settings, as functions to call in reverse order."""
    matmul = torch.backends.cuda.matmul
    saved = []
    if hasattr(matmul, "fp32_precision"):
        cpu_matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
        for backend in (matmul, cpu_matmul):
            if backend is not None and hasattr(backend, "fp32_precision"):
                saved.append(functools.partial(setattr, backend, "fp32_precision", backend.fp32_precision))
                backend.fp32_precision = "ieee"
    else:  # torch before the per-backend API (< 2.9): the process-wide precision, which also sets allow_tf32
        # (Saving allow_tf32 instead turned a caller's "medium" into "high": allow_tf32 = True writes "high".)
        saved.append(functools.partial(torch.set_float32_matmul_precision, torch.get_float32_matmul_precision()))
        torch.set_float32_matmul_precision("highest")
    return saved


@contextlib.contextmanager
def exact_fp32_matmuls():
    """FP32 matmuls as FP32 inside (the torch references are FP32 oracles, and the router's logits decide routing):
    autocast off (CUDA and CPU, this thread), no TF32 on CUDA, no reduced precision in oneDNN's CPU matmuls; the
    caller's settings restored after. Through torch's newer per-backend `fp32_precision` where it exists -- also when
    the process set the legacy `allow_tf32` or `torch.set_float32_matmul_precision` -- so that torch's own getters keep
    working afterwards (writing the legacy setter after the new API raises in them); the legacy setter on older torch.
    The precision flags are process-wide: while any thread is inside, every thread's FP32 matmuls are IEEE, and the
    settings are restored when the last thread leaves (threads that overlap share one save)."""
    global _exact_fp32_users, _exact_fp32_saved
    entered = False
    try:  # the count is taken inside the try, so that an exception right after it (Ctrl-C) still gives it back
        with _exact_fp32_lock:
            if _exact_fp32_users == 0:
                _exact_fp32_saved = _set_exact_fp32_flags()
            _exact_fp32_users += 1
            entered = True
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            yield
    finally:
        if entered:
            with _exact_fp32_lock:
                _exact_fp32_users -= 1
                if _exact_fp32_users == 0:
                    for restore in reversed(_exact_fp32_saved):
                        restore()
                    _exact_fp32_saved = []


def _check_num_rows_limit(num_rows_limit: Optional[torch.Tensor], device: torch.device) -> None:
    if num_rows_limit is not None and (not isinstance(num_rows_limit, torch.Tensor) or num_rows_limit.dtype != torch.int32
                                       or num_rows_limit.numel() != 1 or num_rows_limit.device != device):
        raise ValueError(f"num_rows_limit must be an int32 tensor of one element on {device}")


def _expand_fp8_inexact(q: NVFP4Tensor, data: torch.Tensor, scales: torch.Tensor, row_factor: torch.Tensor,
                        k: int, impl: str, num_rows_limit: Optional[torch.Tensor]) -> ExpandedRows:
    """The FP8 operand rows (module docstring): E4M3 of e2m1 * scale * 2^-3 in FP8_COLUMN_ORDER, row_factor * 8.
    The CUDA kernel (nvfp4_expand_fp8) and the torch ops give the same bits."""
    num_rows = data.shape[0]
    row_factor = (row_factor * (1.0 / _FP8_ACTIVATION_SCALE)).contiguous()
    use_kernel = _use_gemm_kernels(impl, q.data, "expand_nvfp4_rows")
    if use_kernel and not hasattr(_ext._C, "nvfp4_expand_fp8"):  # a _C built before the FP8 mode
        if impl == "cuda":
            raise RuntimeError(f"expand_nvfp4_rows(impl='cuda', precision='fp8_inexact'): {_STALE_BUILD}")
        use_kernel = _reference_fallback("ep_comm.grouped_gemm.expand_nvfp4_rows (FP8)", "uses the torch reference",
                                         _STALE_BUILD)
    if use_kernel:
        data, scales = _ext.aligned_contiguous(data, 8), scales.contiguous()
        values = torch.empty(num_rows, k, dtype=torch.float8_e4m3fn, device=q.data.device)
        if num_rows:
            with _ext.cuda_device(q.data.device):
                limit = 0 if num_rows_limit is None else num_rows_limit.data_ptr()
                _ext._C.nvfp4_expand_fp8(data.data_ptr(), scales.data_ptr(), num_rows, k, values.data_ptr(),
                                         _ext.current_raw_stream(q.data.device), limit)
        return ExpandedRows(values=values, row_factor=row_factor, precision="fp8_inexact")
    codes = _unpack_e2m1_codes(data).reshape(num_rows, k // 16, 16)
    block = e2m1_decode(codes) * (e4m3_decode(scales) * _FP8_ACTIVATION_SCALE)[..., None]  # exact in fp32
    values = block[..., _fp8_column_order(data.device)].to(torch.float8_e4m3fn).reshape(num_rows, k)
    return ExpandedRows(values=values, row_factor=row_factor, precision="fp8_inexact")


def fp8_rows_in_column_order(values: torch.Tensor) -> torch.Tensor:
    """float32 [R, K] of FP8 operand values ([R, K] float8_e4m3fn, `FP8_COLUMN_ORDER`) in the natural column order."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn or values.dim() != 2 or \
            values.shape[1] % 16:
        raise TypeError(f"fp8_rows_in_column_order takes the FP8 mode's float8_e4m3fn [R, K] rows (K % 16 == 0), got "
                        f"{getattr(values, 'dtype', type(values).__name__)} {tuple(getattr(values, 'shape', ()))}")
    rows, k = values.shape
    out = torch.empty(rows, k // 16, 16, dtype=torch.float32, device=values.device)
    out[..., _fp8_column_order(values.device)] = values.float().reshape(rows, k // 16, 16)
    return out.reshape(rows, k)


@_keeps_subnormals
def expand_nvfp4_rows(q: NVFP4Tensor, impl: str = "auto", num_rows_limit: Optional[torch.Tensor] = None,
                      precision: str = "exact") -> ExpandedRows:
    """NVFP4 rows q (logical [..., K], flattened to R rows) -> ExpandedRows (values fp16 [R, K], row_factor fp32 [R]).

    impl: "auto" (CUDA kernel for CUDA tensors when ep_comm._C has it, else the torch reference),
    "reference" or "cuda". Both give the same bits. The CUDA path never synchronizes with the host.
    num_rows_limit: optional int32 tensor of one element on q's device (e.g. `expert_offsets[-1:]` of a dispatch
    result): rows at or past it are not expanded on the CUDA path (their values are left unwritten), so a
    capacity-sized dispatch result costs only its rows in use. The reference path expands every row.
    precision: "exact" (default) or "fp8_inexact": the operand rows of the GEMM's inexact FP8 mode (module
    docstring), values float8_e4m3fn [R, K], row_factor * 8 (CUDA kernel or torch ops, the same bits; impl and
    num_rows_limit as above). Opt-in: the E4M3 rounding loses precision (docs/GEMM.md).
    """
    check_precision(precision)
    _check_nvfp4(q)
    k = q.data.shape[-1] * 2
    if q.scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"scales must be float8_e4m3fn, got {q.scales.dtype}")
    if q.amax.device != q.data.device or q.scales.device != q.data.device:
        raise ValueError("the data, scales and amax of q must be on one device")
    data = q.data.reshape(-1, k // 2)
    scales = q.scales.view(torch.uint8).reshape(-1, k // 16)
    amax = q.amax.reshape(-1).float()
    num_rows = data.shape[0]
    # torch.full, not a tensor built from a Python number: the latter is a host-to-device copy, which synchronizes
    # (and breaks CUDA graph capture). Same fp32 value (rounded once).
    row_factor = amax * torch.full((), 1.0 / (6.0 * q.e4m3_max), dtype=torch.float32, device=q.data.device)
    _check_num_rows_limit(num_rows_limit, q.data.device)  # on every path (the reference ignores its value)
    if precision == "fp8_inexact":
        return _expand_fp8_inexact(q, data, scales, row_factor, k, impl, num_rows_limit)
    if _use_gemm_kernels(impl, q.data, "expand_nvfp4_rows"):
        lib = _ext._C
        data, scales = _ext.aligned_contiguous(data, 8), scales.contiguous()  # codes are read in 8-byte vectors
        values = torch.empty(num_rows, k, dtype=torch.float16, device=q.data.device)
        if num_rows:
            with _ext.cuda_device(q.data.device):
                limit = 0 if num_rows_limit is None else num_rows_limit.data_ptr()
                lib.nvfp4_dequantize(data.data_ptr(), scales.data_ptr(), 0, num_rows, k, float(q.e4m3_max),
                                     values.data_ptr(), 2, _ext.current_raw_stream(q.data.device), limit)
        return ExpandedRows(values=values, row_factor=row_factor.contiguous())
    codes = _unpack_e2m1_codes(data).reshape(num_rows, k // 16, 16)
    block = e2m1_decode(codes) * e4m3_decode(scales)[..., None]
    return ExpandedRows(values=block.reshape(num_rows, k).to(torch.float16), row_factor=row_factor.contiguous())


@_keeps_subnormals
def quantize_expanded_rows(x: torch.Tensor, amax: Optional[torch.Tensor] = None, impl: str = "auto",
                           num_rows_limit: Optional[torch.Tensor] = None, check_amax: bool = True,
                           precision: str = "exact") -> ExpandedRows:
    """NVFP4 4/6 quantization of x [R, K] (fp32 / bf16 / fp16, K % 16 == 0) straight into the GEMM operand form.

    Bitwise `expand_nvfp4_rows(formats.nvfp4_quantize(x, four_over_six=True, amax=amax), precision=precision)`:
    values fp16 [R, K] (e2m1 * e4m3 block scale), row_factor fp32 [R] (amax * fp32(1 / (6 * 256))); with precision
    "fp8_inexact" the FP8 mode's E4M3 rows (float8_e4m3fn [R, K], K % 16 == 0) and row_factor * 8. On CUDA one kernel
    writes both (the packed codes are never stored): the w2 input of the fused experts (moe.fused_expert_hidden).
    amax: optional fp32 [R] outer amax (default: each row's max |x|, NaN ignored). num_rows_limit: as
    `expand_nvfp4_rows` (CUDA path: rows at or past it are left unwritten). check_amax: outside a CUDA-graph
    capture, refuse a NaN, negative or -0.0 amax on every path, as formats.nvfp4_quantize does (a device->host read);
    MoELayer passes False for the amax its own w1 epilogue computed, so that its forward has no host sync.
    """
    _check_float_input(x, "x", NVFP4_BLOCK)
    if x.dim() != 2:
        raise ValueError(f"x must be [R, K], got {tuple(x.shape)}")
    if amax is not None and (not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32):
        raise TypeError(f"amax must be a float32 tensor, got {getattr(amax, 'dtype', type(amax).__name__)}")
    if amax is not None and (amax.shape != x.shape[:1] or amax.device != x.device):
        raise ValueError(f"amax must be [{x.shape[0]}] on {x.device}, got {tuple(amax.shape)} on {amax.device}")
    fp8 = check_precision(precision)
    _check_num_rows_limit(num_rows_limit, x.device)
    if not isinstance(check_amax, bool):  # (None would skip the check silently)
        raise TypeError(f"check_amax must be a bool, got {check_amax!r}")
    if check_amax and amax is not None:
        _check_amax_values(amax)
    if _use_gemm_kernels(impl, x, "quantize_expanded_rows"):
        from . import _cuda_formats
        if fp8 and not hasattr(_ext._C, "fp8_operand_forms"):
            raise RuntimeError(f"quantize_expanded_rows(precision='fp8_inexact'): {_STALE_BUILD}")
        values, row_factor = _cuda_formats.nvfp4_quantize_block_values(x, amax, num_rows_limit, fp8=fp8)
        return ExpandedRows(values=values, row_factor=row_factor, precision=precision)
    from . import formats
    return expand_nvfp4_rows(formats.nvfp4_quantize(x, four_over_six=True, amax=amax, impl="reference",
                                                    check_amax=check_amax), impl="reference", precision=precision)


# ----------------------------------------------------------------------------------------------------------
# The grouped GEMM
# ----------------------------------------------------------------------------------------------------------
def _check_segments(expert_offsets, num_tokens_per_expert, experts: int) -> None:
    """The dispatch layout's segment tensors as the GEMMs read them: contiguous int32 expert_offsets [E + 1] and
    num_tokens_per_expert [E] (read on the device: no host sync)."""
    for name, t, length in (("expert_offsets", expert_offsets, experts + 1),
                            ("num_tokens_per_expert", num_tokens_per_expert, experts)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a 1-D int32 tensor, got {got}")
        if tuple(t.shape) != (length,):
            raise ValueError(f"{name} must have shape [{length}] for {experts} experts, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _check_gemm_inputs(x, expert_offsets, num_tokens_per_expert, weights, out_dtype, token_tile, tail_tile, out):
    if not isinstance(x, ExpandedRows):
        raise TypeError(f"x must be ExpandedRows (from expand_nvfp4_rows), got {type(x).__name__}")
    _check_gemm_weights(weights)
    _check_kernel_row_order(weights)  # on both impls, so that the reference takes what the kernel takes
    values, row_factor = x.values, x.row_factor
    if not isinstance(values, torch.Tensor) or values.dtype not in (torch.float16, torch.float8_e4m3fn) \
            or values.dim() != 2:
        raise TypeError(f"x.values must be a float16 (or, FP8 mode, float8_e4m3fn) [R, K] tensor, got "
                        f"{getattr(values, 'dtype', type(values))} {tuple(getattr(values, 'shape', ()))}")
    wanted = torch.float8_e4m3fn if x.precision == "fp8_inexact" else torch.float16
    if x.precision not in PRECISIONS or values.dtype != wanted:
        raise ValueError(f"x.precision {x.precision!r} does not match x.values' dtype {values.dtype}: make the rows "
                         "with expand_nvfp4_rows (precision='fp8_inexact' for the FP8 mode's E4M3 rows)")
    if not values.is_contiguous():
        raise ValueError("x.values must be contiguous")
    if values.data_ptr() % 16 != 0:
        raise ValueError("x.values must start 16-byte aligned")
    rows = values.shape[0]
    if values.shape[1] != weights.k:
        raise ValueError(f"x has K = {values.shape[1]} but the weights have K = {weights.k}")
    if (not isinstance(row_factor, torch.Tensor) or row_factor.dtype != torch.float32
            or tuple(row_factor.shape) != (rows,) or not row_factor.is_contiguous()):
        raise ValueError(f"x.row_factor must be a contiguous float32 [{rows}] tensor, got "
                         f"{getattr(row_factor, 'dtype', None)} {tuple(getattr(row_factor, 'shape', ()))}")
    _check_segments(expert_offsets, num_tokens_per_expert, weights.num_experts)
    if out_dtype not in _OUT_TYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if token_tile is not None and (isinstance(token_tile, bool) or token_tile not in TOKEN_TILES):
        raise ValueError(f"token_tile must be None (auto) or one of {TOKEN_TILES}, got {token_tile!r}")
    if tail_tile is not None and (isinstance(tail_tile, bool) or tail_tile not in (0,) + TOKEN_TILES[:3] or (
            tail_tile and token_tile is not None and tail_tile >= token_tile)):
        raise ValueError(f"tail_tile must be None (auto), 0 (off) or 16/32/64 below token_tile, got {tail_tile!r}")
    device = values.device
    tensors = {"x.row_factor": row_factor, "expert_offsets": expert_offsets,
               "num_tokens_per_expert": num_tokens_per_expert, "weights.values": weights.values,
               "weights.scales": weights.scales, "weights.factor": weights.factor}
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but x.values is on {device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (
                rows, weights.out_features) or out.device != device:
            raise ValueError(f"out must be a {out_dtype} [{rows}, {weights.out_features}] tensor on {device}, got "
                             f"{getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))} "
                             f"{getattr(out, 'device', None)}")
        if out.stride(-1) != 1 or out.stride(0) < weights.out_features:
            raise ValueError("out must have unit stride along its columns and non-overlapping rows")
        if out.stride(0) % 2 or out.data_ptr() % (2 * out.element_size()):
            raise ValueError("out rows must start at even columns and out must be aligned to two elements "
                             "(the kernel stores column pairs)")
    return rows


def _check_cuda_weights(weights: GemmWeights) -> None:
    """What the CUDA kernel needs of the packed weights beyond their shapes: contiguous, cp.async-aligned."""
    for name, t in (("weights.values", weights.values), ("weights.scales", weights.scales),
                    ("weights.factor", weights.factor)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the CUDA kernel")
        if name != "weights.factor" and t.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned for the CUDA kernel (cp.async)")


def _check_fp8_kernel(weights: GemmWeights, what: str, needs_new_forms: bool) -> None:
    """The FP8 mode's CUDA preconditions: K % 128 and a _C that has the mode (and, for the combine-row epilogue or a
    wave, the forms added after it)."""
    if weights.k % 128:
        raise ValueError(f"the FP8 kernel needs K % 128 == 0, got K = {weights.k}")
    marker = "fp8_operand_forms" if needs_new_forms else "grouped_gemm_fp8"
    if not hasattr(_ext._C, marker):
        raise RuntimeError(f"{what} (FP8 mode): {_STALE_BUILD}")


def _kernel_row_stride(x: ExpandedRows, rows: int) -> int:
    """x's row stride as the kernels take it: in 2-byte units (FP8 rows: K bytes are K / 2 units); a one-row tensor
    may report any stride (torch calls it contiguous whatever it is), so its row length is passed instead."""
    stride = x.values.stride(0) if rows > 1 else x.values.shape[1]
    return stride // (2 if x.precision == "fp8_inexact" else 1)


@_keeps_subnormals
def grouped_gemm_nvfp4(x: ExpandedRows, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                       weights: GemmWeights, out_dtype: torch.dtype = torch.bfloat16,
                       token_tile: Optional[int] = None, impl: str = "auto",
                       out: Optional[torch.Tensor] = None, tail_tile: Optional[int] = None,
                       row_amax: Optional[torch.Tensor] = None, wave=None) -> torch.Tensor:
    """Per-expert y = x W_e^T on NVFP4 weights; returns out_dtype [R, N] ([R, N/2] with the fused SwiGLU).

    x: ExpandedRows (values fp16 [R, K], row_factor fp32 [R]), expert-major: expert e owns rows
        [expert_offsets[e], expert_offsets[e] + num_tokens_per_expert[e]). Rows from
        `expand_nvfp4_rows(..., precision="fp8_inexact")` (E4M3 values, x.precision "fp8_inexact"; also
        `quantize_expanded_rows(..., precision="fp8_inexact")` and `Buffer.dispatch_waves(..., precision=
        "fp8_inexact")`) select the opt-in inexact FP8 mode (module docstring): K % 128 == 0 on the CUDA path; its
        reference multiplies the E4M3-rounded operands in FP32.
    expert_offsets: int32 [E + 1] on x's device (segment starts, non-decreasing; expert_offsets[E] = rows in
        use). The CUDA path cannot check them on the host: with overlapping segments, rows two experts
        share get either expert's result (whichever write lands last) and some rows may be left unwritten (the grid
        is sized for disjoint segments); it never reads or writes outside x and out. The reference path raises.
    num_tokens_per_expert: int32 [E] on x's device (rows per expert, padding excluded).
    weights: GemmWeights from `pack_gemm_weights` (E experts, [N, K] each).
    out_dtype: torch.bfloat16 or torch.float32. token_tile: None (the kernel picks) or 16/32/64/128 rows of
        x per CTA (the GEMM's N side).
    tail_tile: small remainders. An expert whose count % token_tile is 1 .. tail_tile gets those rows from a
        second launch with token tile tail_tile instead of a mostly empty full tile (with random routing at
        ~256 rows per expert, about half the experts have such a remainder). None: the kernel's choice (32 for
        token tile 128, else off); 0: off; 16/32/64 (below the token tile; with token_tile=None a value at or
        above the tile the kernel picks turns the split off for that call). Results are the same either
        way (each output element is one row times one weight row, summed in the same k order).
    out: optional preallocated output (out_dtype [R, out_features], unit column stride, an even row stride, starting
        at an even element: the kernel stores column pairs); rows outside every expert's segment are left as they
        are. By default a zero-filled tensor is allocated, so those rows read 0.
    With weights.swiglu, column i is silu(g_i) * u_i, computed in fp32 from the fp32 results of gate row i
    and up row i, then rounded once.
    row_amax: optional float32 [R] (contiguous, on x's device; SwiGLU weights only): each valid expert row r gets
        row_amax[r] = max(row_amax[r], max_i |y[r, i]|) over the values as stored, NaN ignored -- the per-row amax
        that `formats.nvfp4_quantize` computes, taken in the GEMM's epilogue (one atomic max per token and warp of
        8 columns) so the requantization of the w2 input can skip its own amax pass. Zero-fill it first; other
        rows are left as they are. Measured slower than the quantizer's pass on H200 (docs/GEMM.md §4(e)).
    impl: "auto" (the CUDA kernel for CUDA tensors when available), "reference" (torch FP32: dequantize the
        weights exactly as formats.nvfp4_dequantize, x_f32 = values * row_factor, y = x_f32 @ W_e^T; syncs
        with the host) or "cuda". The CUDA path never synchronizes with the host; it cannot validate the offsets and
        counts on the host, so the kernel clamps each count to its segment and to R instead (the reference raises
        on inconsistent ones).
    wave: the `types.WaveSync` of a `Buffer.dispatch_waves` whose rows, offsets and counts these are (CUDA path
        only). This launch runs behind the dispatch's receive (programmatic dependent launch), on the SMs the
        receive leaves free, starting each expert's tiles once the receive has written that expert's rows; same
        results as without. It must be the next kernel on the stream after that dispatch (pass a preallocated
        `out`, or none: with `wave` the default output is torch.empty, not zero-filled, so that no fill kernel sits
        in between). A kernel in between loses the overlap, and worse: this launch may then start before that
        kernel ends and write `out` while that kernel still reads memory the allocator gave to both, so nothing
        may be launched in between. Refused (RuntimeError) if the WaveSync was used before, if the Buffer was called
        since, or on another stream; other launches in between (torch ops, another Buffer's calls) cannot be seen.
    """
    rows = _check_gemm_inputs(x, expert_offsets, num_tokens_per_expert, weights, out_dtype, token_tile, tail_tile,
                              out)
    device = x.values.device
    use_cuda = _use_gemm_kernels(impl, x.values, "grouped_gemm_nvfp4", hopper_only=True)
    fp8 = x.precision == "fp8_inexact"
    if fp8 and use_cuda:
        _check_fp8_kernel(weights, "grouped_gemm_nvfp4", wave is not None)
    row_stride = _kernel_row_stride(x, rows)
    if wave is not None:
        from .types import WaveSync
        if not isinstance(wave, WaveSync):
            raise TypeError(f"wave must be the WaveSync of Buffer.dispatch_waves, got {type(wave).__name__}")
        if wave.area.device != device:
            raise ValueError(f"wave belongs to {wave.area.device} but x is on {device}")
        if not use_cuda:
            raise ValueError("wave needs the CUDA grouped GEMM (impl 'auto' or 'cuda' on an sm_90 GPU)")
        area = wave.area
        if (area.dtype != torch.int64 or not area.is_contiguous()
                or area.numel() != _ext._C.wave_area_fixed_words + weights.num_experts):
            raise ValueError(f"wave.area must be a contiguous int64 tensor of {_ext._C.wave_area_fixed_words} + "
                             f"{weights.num_experts} words (one per local expert of these weights), got "
                             f"{area.dtype} {tuple(area.shape)}")
    if row_amax is not None:
        if not weights.swiglu:
            raise ValueError("row_amax needs SwiGLU weights (it is the w2 input's per-token amax)")
        if (not isinstance(row_amax, torch.Tensor) or row_amax.dtype != torch.float32
                or tuple(row_amax.shape) != (rows,) or not row_amax.is_contiguous() or row_amax.device != device):
            raise ValueError(f"row_amax must be a contiguous float32 [{rows}] tensor on {device}, got "
                             f"{getattr(row_amax, 'dtype', type(row_amax).__name__)} "
                             f"{tuple(getattr(row_amax, 'shape', ()))} on {getattr(row_amax, 'device', None)}")
    if out is None:  # (with a wave: no fill kernel between the dispatch's receive and this launch)
        out = (torch.empty if wave is not None else torch.zeros)(rows, weights.out_features, dtype=out_dtype,
                                                                  device=device)
    if use_cuda:
        _check_cuda_weights(weights)
        if wave is not None and wave.claim is not None:
            wave.claim()
        if rows == 0:
            return out
        with _ext.cuda_device(device):
            _ext._C.grouped_gemm_nvfp4(
                x.values.data_ptr(), row_stride, x.row_factor.data_ptr(),
                weights.values.data_ptr(),
                weights.scales.data_ptr(), weights.factor.data_ptr(), expert_offsets.data_ptr(),
                num_tokens_per_expert.data_ptr(), weights.num_experts, weights.n, weights.k, rows, out.data_ptr(),
                _OUT_TYPES[out_dtype], out.stride(0), bool(weights.swiglu), int(token_tile or 0),
                -1 if tail_tile is None else int(tail_tile), 0 if row_amax is None else row_amax.data_ptr(),
                0 if wave is None else wave.area.data_ptr(), 0 if wave is None else wave.epoch,
                0 if wave is None else wave.abort, 0 if wave is None else wave.error_word,
                0 if wave is None else wave.timeout_ns, _ext.current_raw_stream(device),
                **({"fp8": True} if fp8 else {}))  # (keyword: a _C built before the FP8 mode still runs the rest)
        return out
    return _grouped_gemm_reference(x, expert_offsets, num_tokens_per_expert, weights, out, row_amax)


@eager_only
def grouped_gemm_nvfp4_combine_rows(x: ExpandedRows, expert_offsets: torch.Tensor,
                                    num_tokens_per_expert: torch.Tensor, weights: GemmWeights,
                                    target: CombineRowsTarget, token_tile: Optional[int] = None, tail_tile: Optional[int] = None) -> None:
    """The grouped GEMM with the combine-row epilogue (CUDA, sm_90a): nothing is returned; every valid row goes
    to `target` (a `CombineRowsTarget` from `Buffer.begin_combine_rows`) as one RHT-32 + S2F6 combine row.

    x, expert_offsets, num_tokens_per_expert, weights, token_tile, tail_tile: as `grouped_gemm_nvfp4` (weights
    without SwiGLU, out_features = target.hidden; FP8 operand rows select the inexact FP8 mode). Row r's output,
    rounded to bf16 exactly as `grouped_gemm_nvfp4(..., out_dtype=torch.bfloat16)` returns it, is rotated (RHT-32 with target.sign_mask),
    quantized to S2F6 and stored at target.bases[src_rank[r]] + target.area_offset + (src_token[r] * num_topk +
    topk_slot[r]) * row_bytes (bases 16-byte aligned: `CombineRowsTarget`) -- into the source rank's combine area
    over NVLink; a row whose triple names no row of the areas (padding rows' -1s, when num_tokens_per_expert counts
    padding in) is not stored. The CTA's output tile goes through shared memory, since a 32-column RHT chunk spans
    two warps of the accumulator layout.
    No host synchronisation; the caller orders it between begin_combine_rows and finish_combine_rows.
    """
    if not has_combine_rows_kernel():
        raise RuntimeError("grouped_gemm_nvfp4_combine_rows needs an ep_comm._C built with the combine-row epilogue "
                           "(CUDA, sm_90a); rebuild the extension")
    if not isinstance(target, CombineRowsTarget):
        raise TypeError(f"target must be the CombineRowsTarget of Buffer.begin_combine_rows, got "
                        f"{type(target).__name__}")
    rows = _check_gemm_inputs(x, expert_offsets, num_tokens_per_expert, weights, torch.bfloat16, token_tile,
                              tail_tile, None)
    if x.values.device.type != "cuda":
        raise ValueError("grouped_gemm_nvfp4_combine_rows runs on CUDA tensors only")
    why = gemm_kernels_unavailable(x.values.device)
    if why:
        raise RuntimeError(f"grouped_gemm_nvfp4_combine_rows: {why}")
    fp8 = x.precision == "fp8_inexact"
    if fp8:
        _check_fp8_kernel(weights, "grouped_gemm_nvfp4_combine_rows", True)
    if target.num_topk < 1:
        raise ValueError(f"target.num_topk must be >= 1, got {target.num_topk}")
    if target.max_tokens < 1:
        raise ValueError(f"target.max_tokens must be >= 1, got {target.max_tokens}")
    if weights.swiglu:
        raise ValueError("the combine-row epilogue is for w2 (weights without SwiGLU)")
    if weights.out_features != target.hidden:
        raise ValueError(f"the weights give {weights.out_features} columns but the combine rows hold {target.hidden}")
    device = x.values.device
    for name in ("src_rank", "src_token", "topk_slot"):
        t = getattr(target, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < rows \
                or not t.is_contiguous() or t.device != device:
            raise ValueError(f"target.{name} must be a contiguous int32 [>= {rows}] tensor on {device}, got "
                             f"{getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    if (target.row_bytes % 16 or target.area_offset % 16 or target.area_offset < 0 or target.scale_offset < target.hidden
            or target.scale_offset + target.hidden // 32 > target.row_bytes):
        raise ValueError(f"target rows must be 16-byte aligned (area_offset {target.area_offset}, row_bytes "
                         f"{target.row_bytes}) with the codes before the scales (scale_offset {target.scale_offset}, "
                         f"hidden {target.hidden})")
    bases = target.bases
    if bases.dtype != torch.int64 or bases.dim() != 1 or bases.shape[0] < 1 or bases.device != device \
            or not bases.is_contiguous():
        raise ValueError(f"target.bases must be a contiguous int64 [W >= 1] tensor on {device}")
    _check_cuda_weights(weights)
    if target.claim is not None:  # its begin_combine_rows still open, on this stream (Buffer targets)
        target.claim()
    if rows == 0:
        return
    with _ext.cuda_device(device):
        _ext._C.grouped_gemm_nvfp4_combine_rows(
            x.values.data_ptr(), _kernel_row_stride(x, rows), x.row_factor.data_ptr(), weights.values.data_ptr(),
            weights.scales.data_ptr(), weights.factor.data_ptr(), expert_offsets.data_ptr(),
            num_tokens_per_expert.data_ptr(), weights.num_experts, weights.n, weights.k, rows, int(token_tile or 0),
            -1 if tail_tile is None else int(tail_tile), bases.data_ptr(), int(target.area_offset),
            target.src_rank.data_ptr(), target.src_token.data_ptr(), target.topk_slot.data_ptr(),
            int(target.num_topk), bases.shape[0], int(target.max_tokens), int(target.row_bytes),
            int(target.scale_offset), int(target.sign_mask),
            int(target.abort_flag), _ext.current_raw_stream(device), **({"fp8": True} if fp8 else {}))


def _grouped_gemm_reference(x: ExpandedRows, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                            weights: GemmWeights, out: torch.Tensor,
                            row_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    rows = x.values.shape[0]
    offsets = expert_offsets.tolist()
    counts = num_tokens_per_expert.tolist()
    if offsets[0] < 0 or offsets[-1] > rows:
        raise ValueError(f"expert_offsets must lie in [0, {rows}], got {offsets[0]} .. {offsets[-1]}")
    for e, count in enumerate(counts):
        if count < 0 or offsets[e + 1] < offsets[e] or offsets[e] + count > offsets[e + 1]:
            raise ValueError(f"expert {e}: {count} rows at offset {offsets[e]} do not fit before the next "
                             f"segment at {offsets[e + 1]} (offsets must be non-decreasing, counts >= 0)")
    fp8 = x.precision == "fp8_inexact"
    with exact_fp32_matmuls():  # a true FP32 reference on CUDA tensors too
        for e, count in enumerate(counts):
            if count == 0:
                continue
            segment = slice(offsets[e], offsets[e] + count)
            if fp8:  # the rounded operands (module docstring), their product in FP32
                x_f32 = fp8_rows_in_column_order(x.values[segment]) * x.row_factor[segment, None]
                y = x_f32 @ _fp8_expert_weights(weights, e).t()
            else:
                x_f32 = x.values[segment].float() * x.row_factor[segment, None]
                y = x_f32 @ _dequantize_expert(weights, e).t()
            if weights.swiglu:
                half = weights.n // 2
                y = F.silu(y[:, :half]) * y[:, half:]
            out[segment] = y.to(out.dtype)
            if row_amax is not None:  # of the values as stored, NaN as 0 (formats' row amax)
                row_amax[segment] = torch.maximum(row_amax[segment], _nan_to_zero_abs(out[segment].float()).amax(dim=1))
    return out
