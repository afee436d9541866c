"""An expert-parallel MoE layer built on `ep_comm.Buffer` — the reference (torch) expert path.

`MoELayer` = router top-k -> `Buffer.dispatch` (NVFP4 tokens) -> expert SwiGLU MLP -> `Buffer.combine` (S2F6).
The experts here run as FP32 torch matmuls on dequantized NVFP4 operands, with the quantization points the fused
NVFP4 grouped GEMM will use (DESIGN.md, issue 6): weights are NVFP4 without 4/6 with one FP32 amax per expert
(`pack_weights`), the w1 input is the dispatched NVFP4 token, and the w2 input is requantized to NVFP4 with 4/6 and
a per-token amax. It is the correctness oracle for that GEMM and a working, unfused MoE layer today; it is not the
fast path (no fused grouped GEMM, no wave overlap yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import formats
from .buffer import Buffer


@dataclass(frozen=True)
class PackedExpertWeights:
    """NVFP4 expert weights of this rank (plain NVFP4, M = 448, one FP32 amax per expert, broadcast to rows).

    w1: NVFP4Tensor of the gate and up projections, logical shape [E_local, 2 * I, H] (gate rows first).
    w2: NVFP4Tensor of the down projection, logical shape [E_local, H, I].
    """

    w1: formats.NVFP4Tensor
    w2: formats.NVFP4Tensor

    @property
    def num_local_experts(self) -> int:
        return self.w1.data.shape[0]


def _per_expert_amax(w: torch.Tensor) -> torch.Tensor:
    finite_abs = torch.where(torch.isnan(w), torch.zeros_like(w), w.abs())
    return finite_abs.amax(dim=(1, 2))[:, None]  # [E, 1], broadcast over the rows of each expert


def pack_weights(w1: torch.Tensor, w2: torch.Tensor) -> PackedExpertWeights:
    """Quantize master weights once, offline: w1 [E_local, 2I, H] and w2 [E_local, H, I] (bf16 or fp32; H and I
    multiples of 16) to NVFP4 along their input axis with one FP32 amax per expert (no 4/6, as for weights)."""
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    experts, two_i, hidden = w1.shape
    if two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w2 must be [E, H, I] = [{experts}, {hidden}, {two_i // 2}] for w1 {tuple(w1.shape)}, "
                         f"got {tuple(w2.shape)}")
    return PackedExpertWeights(
        w1=formats.nvfp4_quantize(w1, four_over_six=False, amax=_per_expert_amax(w1.float())),
        w2=formats.nvfp4_quantize(w2, four_over_six=False, amax=_per_expert_amax(w2.float())))


def expert_mlp_reference(tokens: formats.NVFP4Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on NVFP4 tokens [n, H] with dequantized FP32 weights w1 [2I, H], w2 [H, I]: bf16 [n, H].

    SwiGLU in FP32, then the w2 input is quantized to NVFP4 with 4/6 and a per-token amax (the fused kernel's
    quantization point), dequantized, multiplied by w2 in FP32 and rounded to bf16.
    """
    x = formats.nvfp4_dequantize(tokens, dtype=torch.float32)
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    hidden = formats.nvfp4_dequantize(formats.nvfp4_quantize(hidden, four_over_six=True), dtype=torch.float32)
    return (hidden @ w2.t()).to(torch.bfloat16)


class MoELayer(torch.nn.Module):
    """Router top-k -> dispatch -> expert SwiGLU MLPs of this rank -> combine.

    Args:
        buffer: an `ep_comm.Buffer` with dispatch_format="nvfp4" (its hidden, num_experts, num_topk and
            max_tokens_per_rank bound the layer).
        router_weight: [num_experts, H] (fp32), identical on every rank.
        weights: this rank's `PackedExpertWeights` (experts rank * E_local ... (rank + 1) * E_local - 1).
    forward(x): x bf16 [T, H] -> bf16 [T, H]; the routing weights are the softmax over the top-k logits.
    """

    def __init__(self, buffer: Buffer, router_weight: torch.Tensor, weights: PackedExpertWeights):
        super().__init__()
        cfg = buffer.config
        if cfg.dispatch_format != "nvfp4":
            raise ValueError(f"MoELayer consumes NVFP4 tokens; the buffer dispatches {cfg.dispatch_format!r}")
        if tuple(router_weight.shape) != (cfg.num_experts, cfg.hidden):
            raise ValueError(f"router_weight must be [{cfg.num_experts}, {cfg.hidden}], got "
                             f"{tuple(router_weight.shape)}")
        if weights.num_local_experts != cfg.num_local_experts or weights.w1.shape[-1] != cfg.hidden:
            raise ValueError(f"weights hold {weights.num_local_experts} experts of hidden {weights.w1.shape[-1]}; "
                             f"the buffer needs {cfg.num_local_experts} of hidden {cfg.hidden}")
        self.buffer = buffer
        self.register_buffer("router_weight", router_weight.float())
        self.weights = weights
        # Dequantized once: the reference expert path multiplies FP32 copies of the NVFP4 weights.
        self._w1 = formats.nvfp4_dequantize(weights.w1, dtype=torch.float32)
        self._w2 = formats.nvfp4_dequantize(weights.w2, dtype=torch.float32)

    def route(self, x: torch.Tensor):
        """topk_idx int64 [T, K] and topk_weights float32 [T, K] (softmax over the K largest logits)."""
        logits = x.float() @ self.router_weight.t()
        top_logits, topk_idx = logits.topk(self.buffer.config.num_topk, dim=-1)
        return topk_idx, torch.softmax(top_logits, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weights = self.route(x)
        result = self.buffer.dispatch(x, topk_idx, topk_weights)
        out = torch.zeros(result.num_rows, self.buffer.config.hidden, dtype=torch.bfloat16, device=x.device)
        offsets = result.expert_offsets.tolist()
        counts = result.num_tokens_per_expert.tolist()
        for j in range(self.buffer.config.num_local_experts):
            rows = slice(offsets[j], offsets[j] + counts[j])
            if counts[j]:
                tokens = formats.NVFP4Tensor(data=result.x.data[rows], scales=result.x.scales[rows],
                                             amax=result.x.amax[rows], e4m3_max=result.x.e4m3_max)
                out[rows] = expert_mlp_reference(tokens, self._w1[j], self._w2[j])
        return self.buffer.combine(out, result.handle)
