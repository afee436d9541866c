"""Inputs and a single-process oracle of dispatch/combine semantics (DESIGN.md §2-3).

Every rank can regenerate every rank's inputs from (case seed, rank), so each process computes what it
must receive and what combine must return with plain per-token loops — an implementation independent
of the backends' vectorized routing and collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ep_comm import formats


# The dispatch's quantization as DESIGN.md §1/§3 states it, built from ep_comm.formats directly (not from the
# reference backend's packer, which is under test): NVFP4 with 4/6 and a per-token FP32 amax, MXFP8 round to
# nearest, BF16 as is. Wire row = the payload's bytes in the order data | scales | amax.
def _quantized_token(x_row: torch.Tensor, fmt: str):
    if fmt == "nvfp4":
        return formats.nvfp4_quantize(x_row, four_over_six=True, impl="reference")
    if fmt == "mxfp8":
        return formats.mxfp8_quantize(x_row, rounding="nearest", impl="reference")
    return x_row


def payload_bytes(x, fmt: str) -> torch.Tensor:
    """The rows of a dispatch payload (NVFP4Tensor, MXFP8Tensor or bf16 tensor) as bytes [rows, data | scales | amax]:
    what the tests compare bitwise."""
    if fmt == "nvfp4":
        return torch.cat([x.data, x.scales.view(torch.uint8), x.amax.reshape(-1, 1).view(torch.uint8)], dim=1)
    if fmt == "mxfp8":
        return torch.cat([x.data.view(torch.uint8), x.scales.view(torch.uint8)], dim=1)
    return x.contiguous().view(torch.uint8)


def _wire_row(x_row: torch.Tensor, fmt: str) -> torch.Tensor:
    return payload_bytes(_quantized_token(x_row, fmt), fmt)[0]


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    num_experts: int
    num_topk: int
    tokens: tuple          # tokens per rank
    routing: str           # uniform | masked | skewed | all_to_one | identity
    dispatch_format: str = "nvfp4"
    combine_format: str = "s2f6"
    expert_alignment: int = 1
    seed: int = 0
    unit_weights: bool = False
    edge: bool = False     # special token values in rows 1..6 (make_inputs)

    @property
    def max_tokens(self) -> int:
        return max(max(self.tokens), 1)


def make_inputs(case: Case, rank: int, world: int, device="cpu"):
    """x bf16 [T, H] (Gaussian with a few outliers), topk_idx int64 [T, K], topk_weights float32 [T, K].
    case.edge: rows 1..6 (row 0 may be masked entirely) are all +0, all -0, bf16 subnormals, tiny values with one
    outlier, a row with scattered +-Inf and NaN, and values near the bf16 maximum (Inf after NVFP4's decode or the toy
    expert)."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + rank)
    num_tokens, experts, k = case.tokens[rank], case.num_experts, case.num_topk
    x = torch.randn(num_tokens, case.hidden, generator=gen)
    if num_tokens:
        outliers = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=gen)
        x.view(-1)[outliers] *= 20.0
    if case.edge and num_tokens >= 7:
        h = case.hidden
        x[1] = 0.0
        x[2] = -0.0
        x[3] = torch.randn(h, generator=gen).sign() * 3e-39 * torch.rand(h, generator=gen)
        x[4] = torch.randn(h, generator=gen) * 1e-3
        x[4, h // 3] = 1e4
        x[5, torch.arange(3) * (h // 3) + 1] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        x[6] = torch.randn(h, generator=gen).sign() * 3.3e38
    x = x.to(torch.bfloat16)
    if case.routing == "skewed":
        probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        scores = torch.rand(num_tokens, experts, generator=gen, dtype=torch.float64) * probs
    elif case.routing == "all_to_one":
        scores = torch.rand(num_tokens, experts, generator=gen, dtype=torch.float64)
        scores[:, experts // world:] = -1.0  # only rank 0's experts
    else:
        scores = torch.rand(num_tokens, experts, generator=gen, dtype=torch.float64)
    topk_idx = scores.topk(k, dim=1).indices.to(torch.int64)
    if case.routing == "masked" and num_tokens:
        masked = torch.rand(num_tokens, k, generator=gen) < 0.3
        masked[0] = True  # one token with every slot masked
        topk_idx = torch.where(masked, torch.full_like(topk_idx, -1), topk_idx)
    if case.unit_weights:
        weights = torch.ones(num_tokens, k)
    elif case.routing == "cancel":
        # Large weights that cancel between slots 0 and 2 make the FP32 summation order visible in the
        # result, so a backend that sums in another order fails bitwise comparison.
        pattern = torch.tensor([1.0e7, 1.0, -1.0e7, 3.0])[:k]
        weights = pattern.repeat(num_tokens, 1) * (1.0 + torch.rand(num_tokens, 1, generator=gen).round())
    else:
        weights = torch.rand(num_tokens, k, generator=gen) + 0.05
    return x.to(device), topk_idx.to(device), weights.to(device)


def expert_function(dequantized_rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The toy expert every test uses: out = bf16(dequantized input * (1 + (e % 7) / 8))."""
    scale = 1.0 + (experts.to(torch.float32) % 7) / 8.0
    return (dequantized_rows.float() * scale[:, None]).to(torch.bfloat16)


def case_expert_function(case, dequantized_rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Cancel cases use identical experts (out = input), so slot outputs cancel exactly."""
    if case.routing == "cancel":
        return dequantized_rows.float().to(torch.bfloat16)
    return expert_function(dequantized_rows, experts)


def nvfp4_expert_mlp(tokens: formats.NVFP4Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert at the layer's quantization points, written out here rather than taken from
    moe.expert_mlp_reference (the layer's own CPU path, so a test against it could not fail): the NVFP4 tokens
    dequantized, FP32 x @ w1^T (w1 [2I, H]: gate rows, then up rows), silu(gate) * up quantized to NVFP4 with 4/6 and
    a per-token amax by the formats reference, dequantized, FP32 @ w2^T (w2 [H, I]), bf16. FP32 matmuls without TF32
    or autocast (exact_fp32_matmuls: the caller's settings restored, whichever TF32 API the process used)."""
    from ep_comm.grouped_gemm import exact_fp32_matmuls
    with exact_fp32_matmuls():
        x = formats.nvfp4_dequantize(tokens, dtype=torch.float32, impl="reference")
        gate, up = (x @ w1.float().t()).chunk(2, dim=-1)
        swiglu = torch.nn.functional.silu(gate) * up
        swiglu = formats.nvfp4_dequantize(formats.nvfp4_quantize(swiglu, four_over_six=True, impl="reference"),
                                          dtype=torch.float32, impl="reference")
        return (swiglu @ w2.float().t()).to(torch.bfloat16)


def dequantize_payload(x, fmt: str) -> torch.Tensor:
    """The payload dense in fp32 on the reference path (fmt: the dispatch format it must be, checked)."""
    expected = {"nvfp4": formats.NVFP4Tensor, "mxfp8": formats.MXFP8Tensor}.get(fmt, torch.Tensor)
    assert isinstance(x, expected), (fmt, type(x).__name__)
    return formats.dequantize(x, impl="reference")


@dataclass
class ExpectedDispatch:
    entries: List[List[tuple]]   # per local expert: [(src_rank, src_token, slot, weight)] in canonical order
    payload_rows: dict           # (src_rank, src_token) -> uint8 wire row


def expected_dispatch(case: Case, rank: int, world: int, inputs) -> ExpectedDispatch:
    num_local = case.num_experts // world
    entries = [[] for _ in range(num_local)]
    payload_rows = {}
    for src in range(world):
        x, topk_idx, weights = inputs[src]
        for token in range(x.shape[0]):
            for slot in range(case.num_topk):
                expert = int(topk_idx[token, slot])
                if expert >= 0 and expert // num_local == rank:
                    entries[expert - rank * num_local].append((src, token, slot, float(weights[token, slot])))
                    if (src, token) not in payload_rows:
                        payload_rows[(src, token)] = _wire_row(x[token:token + 1], case.dispatch_format)
    for segment in entries:
        segment.sort(key=lambda e: (e[0], e[1]))
    return ExpectedDispatch(entries=entries, payload_rows=payload_rows)


def expected_combine(case: Case, rank: int, world: int, inputs, local_reduce: bool, expert_fn=None) -> torch.Tensor:
    """bf16 [T, H] that combine must return on `rank`, computed token by token.

    expert_fn(payload, expert) -> bf16 [1, H] replaces the toy expert (payload: the token's received row in the
    dispatch format, e.g. an NVFP4Tensor of one row)."""
    num_local = case.num_experts // world
    x, topk_idx, weights = inputs[rank]
    out = torch.zeros(x.shape[0], case.hidden, dtype=torch.bfloat16)
    s2f6 = case.combine_format == "s2f6"

    def wire(row_fp32):  # what the receiver decodes from one row sent back (rotated domain for S2F6)
        if s2f6:
            q = formats.s2f6_quantize(row_fp32[None], hadamard=True, impl="reference")
            return formats._s2f6_decode_rotated(q)[0]
        if case.combine_format == "mxfp8":
            m = formats.mxfp8_quantize(row_fp32[None], rounding="nearest", impl="reference")
            return formats.mxfp8_dequantize(m, dtype=torch.float32, impl="reference")[0]
        return row_fp32.to(torch.bfloat16).float()

    for token in range(x.shape[0]):
        payload = _quantized_token(x[token:token + 1], case.dispatch_format)
        dq = dequantize_payload(payload, case.dispatch_format)
        expert_out = {}
        for slot in range(case.num_topk):
            expert = int(topk_idx[token, slot])
            if expert >= 0:
                row = expert_fn(payload, expert) if expert_fn else case_expert_function(case, dq, torch.tensor([expert]))
                expert_out[slot] = row[0].float()
        acc = torch.zeros(case.hidden)
        if local_reduce:
            for dst in range(world):
                slots = [s for s in sorted(expert_out) if int(topk_idx[token, s]) // num_local == dst]
                if not slots:
                    continue
                partial = torch.zeros(case.hidden)
                for slot in slots:
                    partial = partial + weights[token, slot] * expert_out[slot]
                acc = acc + wire(partial)
        else:
            for slot in sorted(expert_out):
                acc = acc + weights[token, slot] * wire(expert_out[slot])
        if s2f6:
            acc = formats.inverse_rht(acc[None])[0]
        out[token] = acc.to(torch.bfloat16)
    return out


def run_expert(result, case: Case, rank: int, world: int) -> torch.Tensor:
    """Apply the toy expert to a DispatchResult (rows past the valid prefix and padding give zeros)."""
    num_local = case.num_experts // world
    rows = result.num_rows
    offsets = result.expert_offsets.to(torch.int64).cpu()
    expert_of_row = torch.full((rows,), -1, dtype=torch.int64)
    for j in range(num_local):
        expert_of_row[offsets[j]:offsets[j + 1]] = rank * num_local + j
    dq = dequantize_payload(result.x, case.dispatch_format).cpu()
    out = case_expert_function(case, dq, expert_of_row.clamp(min=0))
    valid = (result.src_rank.cpu() >= 0)
    out[~valid] = 0
    return out
