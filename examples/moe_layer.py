"""An expert-parallel MoE layer in a few lines: `ep_comm.moe.MoELayer` (router -> NVFP4 dispatch -> experts -> S2F6
combine). On Hopper GPUs the experts run on the fused NVFP4 grouped GEMM; elsewhere on FP32 torch matmuls.

    python examples/moe_layer.py [--tokens 256 --hidden 1024 --intermediate 512 --experts 16 --topk 4]

Runs on every visible GPU (NCCL; 2 or more GPUs) or on 2 CPU ranks over gloo. Each rank quantizes its own experts'
master weights once (`moe.pack_weights`), runs the layer and prints:
* its distance to the unquantized layer (FP32 master weights and activations, the same routing): the price of NVFP4
  activations and weights and the S2F6 combine, ~22% relative L2 on these random weights;
* on GPUs, its distance to the same layer with the reference experts (identical quantization points: only FP32
  summation order differs; on CPU the layer already uses the reference experts, so that check is skipped). Where the
  layer's w2 epilogue writes the combine rows itself (nvlink backend, the default there), that check uses the same
  layer with combine_rows=False, and the distance between the two combine forms (one S2F6 rounding per expert row vs
  per rank-local sum) is printed too.
"""
import torch
import torch.nn.functional as F

import ep_comm
from ep_comm import moe
from ep_comm.launch import run_ranks
from example_args import parse_moe_args


def unquantized_layer(x, w1, w2, router, topk):
    """The same MoE forward in FP32 with the master weights (all experts are known on every rank here): float [T, H]."""
    xf = x.float()
    top_logits, topk_idx = (xf @ router.float().t()).topk(topk, dim=-1)
    topk_weights = torch.softmax(top_logits, dim=-1)
    out = torch.zeros_like(xf)
    for k in range(topk):
        for expert in topk_idx[:, k].unique().tolist():
            rows = topk_idx[:, k] == expert
            gate, up = (xf[rows] @ w1[expert].float().t()).chunk(2, dim=-1)
            out[rows] += topk_weights[rows, k:k + 1] * ((F.silu(gate) * up) @ w2[expert].float().t())
    return out


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)  # the same master weights and router on every rank
    w1 = torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=gen) / args.hidden ** 0.5
    w2 = torch.randn(args.experts, args.hidden, args.intermediate, generator=gen) / args.intermediate ** 0.5
    router = torch.randn(args.experts, args.hidden, generator=gen)
    local = slice(rank * args.experts // world, (rank + 1) * args.experts // world)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1 + rank))
    x = x.to(torch.bfloat16).to(device)

    with ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                        max_tokens_per_rank=args.tokens, expert_alignment=16) as buf:
        weights = moe.pack_weights(w1[local].to(device), w2[local].to(device))  # NVFP4, once
        layer = moe.MoELayer(buf, router.to(device), weights)                 # expert_impl="auto"
        y = layer(x)                                                          # bf16 [tokens, hidden]
        # The check: the reference experts combine with local_reduce=True; where the fused layer stores one combine
        # row per (token, expert) from its w2 epilogue instead (layer.combine_rows), compare the fused layer in the
        # local_reduce form, and report how far the two combine forms are apart.
        same_combine = moe.MoELayer(buf, router.to(device), weights, combine_rows=False)(x) \
            if layer.combine_rows else y
        reference = moe.MoELayer(buf, router.to(device), weights, expert_impl="reference")(x) \
            if layer.expert_impl != "reference" else None
    exact = unquantized_layer(x, w1.to(device), w2.to(device), router.to(device), args.topk)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return {"rank": rank, "backend": buf.backend, "experts": layer.expert_impl, "combine_rows": layer.combine_rows,
            "waves": layer.waves, "vs_unquantized": rel(y, exact),
            "vs_reference_experts": rel(same_combine, reference) if reference is not None else None,
            "combine_forms_apart": rel(y, same_combine)}


def main(argv=None):
    args, world = parse_moe_args(argv, description=__doc__, hidden=1024, intermediate=512)
    for result in run_ranks(worker, world, args, backend="nccl" if args.gpu else "gloo"):
        print(f"rank {result['rank']}: backend {result['backend']}, experts {result['experts']}"
              + (" (waves: w1 behind the dispatch receive)" if result["waves"] else "") + ": relative L2 "
              f"difference to the unquantized layer {result['vs_unquantized']:.3f}"
              + (f", to the reference experts {result['vs_reference_experts']:.2e}"
                 if result["vs_reference_experts"] is not None else "")
              + (f"; combine rows from the w2 epilogue, {result['combine_forms_apart']:.2e} from the local_reduce "
                 f"combine" if result["combine_rows"] else ""))


if __name__ == "__main__":
    main()
