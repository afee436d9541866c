"""A minimal expert-parallel MoE forward with ep_comm: router -> dispatch (NVFP4) -> experts -> combine (S2F6).

Runs on every visible GPU (NCCL) when there are at least 2, else on 2 CPU ranks over gloo:

    python examples/moe_forward.py [--tokens 256 --hidden 512 --intermediate 256 --experts 16 --topk 4]

Each rank owns E / W experts (a SwiGLU MLP in FP32 here); received NVFP4 tokens are dequantized for the
expert matmuls (a fused NVFP4 grouped GEMM would consume them directly). The output is compared with the
same layer computed without communication or quantization on the rank's own tokens.
"""
import torch
import torch.nn.functional as F

import ep_comm
from ep_comm.launch import run_ranks
from example_args import parse_moe_args


def make_layer(num_experts, hidden, intermediate, seed=0):
    """The router [E, H] and the experts' w1 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]: one layer, so
    the same on every rank (one seed)."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=gen)
    w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate ** 0.5
    return router, w1, w2


def expert_mlp(x, w1, w2):
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    router, w1, w2 = make_layer(args.experts, args.hidden, args.intermediate)
    num_local = args.experts // world
    local = range(rank * num_local, (rank + 1) * num_local)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own tokens
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
    scores = torch.softmax(x.float() @ router.to(device).t(), dim=-1)
    topk_weights, topk_idx = scores.topk(args.topk, dim=-1)

    with ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                        max_tokens_per_rank=args.tokens) as buf:
        result = buf.dispatch(x, topk_idx, topk_weights)
        tokens = ep_comm.formats.nvfp4_dequantize(result.x, dtype=torch.float32)
        out = torch.zeros(result.num_rows, args.hidden, device=device)
        offsets = result.expert_offsets.tolist()
        counts = result.num_tokens_per_expert.tolist()
        for j, expert in enumerate(local):
            rows = slice(offsets[j], offsets[j] + counts[j])
            out[rows] = expert_mlp(tokens[rows], w1[expert].to(device), w2[expert].to(device))
        y = buf.combine(out.to(torch.bfloat16), result.handle)

    # Same layer without communication or quantization, on this rank's tokens.
    want = torch.zeros(args.tokens, args.hidden, device=device)
    for slot in range(args.topk):
        for expert in range(args.experts):
            chosen = topk_idx[:, slot] == expert
            if chosen.any():
                want[chosen] += topk_weights[chosen, slot, None] * expert_mlp(
                    x[chosen].float(), w1[expert].to(device), w2[expert].to(device))
    error = ((y.float() - want).norm() / want.norm()).item()
    return error


def main():
    args, world = parse_moe_args(hidden=512, intermediate=256)
    errors = run_ranks(worker, world, args, backend="nccl" if args.gpu else "gloo")
    for rank, error in enumerate(errors):
        print(f"rank {rank}: MoE output relative L2 error vs unquantized single-rank computation: {error:.4f}")


if __name__ == "__main__":
    main()
