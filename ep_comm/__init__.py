"""ep_comm: quantized expert-parallel dispatch/combine for MoE layers.

Dispatch sends tokens to their experts' ranks in NVFP4 (E2M1 + E4M3 scale per 16 + FP32 per-token scale,
4/6 block scaling; 3.55x fewer bytes than BF16); combine brings expert outputs back in RHT-32 + S2F6
(8.25 bits per value) and accumulates in FP32 on the receive side. See README.md and docs/NUMERICS.md.

    import ep_comm
    buf = ep_comm.Buffer(group, hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096)
    res = buf.dispatch(x, topk_idx, topk_weights)
    y = buf.combine(expert_out, res.handle)
"""
from . import formats
from ._ext import cuda_extension_available, cuda_extension_error
from .buffer import Buffer, InvalidRoutingError, NonFiniteInputError
from .formats import MXFP8Tensor, NVFP4Tensor, S2F6Tensor
from . import moe  # (after .buffer and .formats, which it imports)
from . import training
from .types import (BufferConfig, BufferSizes, CombineRowsTarget, DispatchResult, WaveDispatch, WaveSync,
                    combine_bytes_per_token, dispatch_bytes_per_token)

__version__ = "0.1.0"

__all__ = [
    "Buffer", "InvalidRoutingError", "NonFiniteInputError", "BufferConfig", "BufferSizes", "CombineRowsTarget",
    "DispatchResult", "WaveDispatch", "WaveSync",
    "NVFP4Tensor", "MXFP8Tensor", "S2F6Tensor",
    "formats", "moe", "training", "cuda_extension_available", "cuda_extension_error", "dispatch_bytes_per_token",
    "combine_bytes_per_token",
]
