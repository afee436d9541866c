"""Training an expert-parallel MoE layer under FSDP2 (`torch.distributed.fsdp.fully_shard`), laid out as TorchTitan
lays out expert parallelism: a 2-D device mesh ("dp", "ep"), a Buffer over each "ep" group, the experts
(`training.ExpertMLP(..., ep_mesh=mesh["ep"])`: DTensors of all E experts, E / ep on each EP rank) sharded over "dp",
and the rest of the layer (the router) over every rank. The DTensors are what lets torch.distributed.checkpoint save
and load every EP rank's experts (docs/TRAINING.md).

Runs on every visible GPU (NCCL) when there are at least 2, else on 2 CPU ranks over gloo:

    python examples/moe_fsdp2.py [--tokens 128 --hidden 256 --intermediate 128 --experts 8 --topk 2 --steps 30]
                                 [--expert-parallel N] [--micro-batches M] [--bf16] [--max-grad-norm C]

A student layer learns to reproduce a fixed random teacher layer of the same shape (plain SGD on the mean squared
error; each rank its own tokens). --expert-parallel N: EP groups of N ranks (default: every rank), so each expert
lives on world / N ranks and FSDP2 shards it over them. --micro-batches M: gradient accumulation, the experts kept
gathered through the step (`is_first_microbatch` True at the first micro-batch quantizes their weights once for the
step). --bf16: `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, BF16 weights in the forward and
backward (ExpertMLP takes BF16 masters), FP32 gradients reduced into the FP32 shards. --max-grad-norm C: gradient
clipping by the whole layer's norm with `training.clip_grad_norm_` (torch.nn.utils.clip_grad_norm_ raises here: the
experts' and the router's DTensors live on different meshes). Each rank prints its loss at the first and the last
step (and, with clipping, the gradient norm at both).

What matters for expert parallelism: the experts of the EP ranks are different parameters, so nothing may average
them over "ep" -- FSDP2 here only ever sees the experts through the "dp" mesh -- and an expert's gradient already
sums its EP group's tokens, so its sum over "dp" is divided by the world size, as the router's is (below). (With DDP
instead: leave the experts to DDP's ignore list, `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`,
and sum their gradients over the "dp" group yourself, divided by the world size; with `ep_mesh` the experts' DTensor
weights need an optimizer parameter group of their own, apart from the plain tensors; docs/TRAINING.md.)
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ep_comm
from ep_comm import training
from ep_comm.launch import run_ranks
from example_args import check_training_flags, parse_moe_args, stop_if_diverged, training_flags


class TrainingLog(NamedTuple):
    """What a rank's worker returns: its loss at each step, and the gradient norm before clipping at each step (empty
    without --max-grad-norm)."""
    losses: list
    grad_norms: list


class MoEBlock(torch.nn.Module):
    """Router [E, H] and the experts as an ExpertMLP on the EP mesh (w1 [E, 2I, H], w2 [E, H, I], DTensors sharded
    along the experts: E / ep on this rank). forward(x bf16 [T, H], is_first_microbatch=None) -> bf16 [T, H]."""

    def __init__(self, buffer, grads, ep_mesh, num_experts, hidden, intermediate, topk, seed, device):
        super().__init__()
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, device=device)
        with torch.no_grad():  # the same router on every rank
            self.router.weight.copy_(torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(seed))
                                     / hidden ** 0.5)
        # one seed on every rank: ExpertMLP mixes in the rank's place in ep_mesh, so the ranks of the same EP position
        # (the replicas FSDP2 shards over "dp") start with the same experts
        self.experts = training.ExpertMLP(num_experts // ep_mesh.size(), hidden, intermediate, device=device,
                                          seed=1000 * seed, ep_mesh=ep_mesh)
        self.buffer, self.grads, self.topk = buffer, grads, topk

    def forward(self, x, is_first_microbatch=None):
        scores = torch.softmax(x.float() @ self.router.weight.float().t(), dim=-1)  # (.float(): BF16 params too)
        topk_weights, topk_idx = scores.topk(self.topk, dim=-1)
        routed = training.dispatch(self.buffer, self.grads, x, topk_idx, topk_weights)
        return training.combine(self.experts(routed, is_first_microbatch=is_first_microbatch), routed)


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    ep_size = args.expert_parallel or world
    mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
    ep_group = mesh["ep"].get_group()
    sizes = dict(hidden=args.hidden, num_experts=args.experts, num_topk=args.topk, max_tokens_per_rank=args.tokens,
                 expert_alignment=32)  # (ExpertMLP's weight gradients: MXFP8 blocks of 32 rows of one expert)
    micro_tokens = args.tokens // args.micro_batches
    gen = torch.Generator().manual_seed(100 + rank)  # this rank's tokens
    x = torch.randn(args.micro_batches, micro_tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
    losses, grad_norms = [], []
    with ep_comm.Buffer(ep_group, **sizes) as buf, training.GradBuffers.create(buf) as grads:
        layer = (buf, grads, mesh["ep"], args.experts, args.hidden, args.intermediate, args.topk)
        teacher = MoEBlock(*layer, seed=1, device=device)
        with torch.no_grad():
            targets = [teacher(x[m]).float() for m in range(args.micro_batches)]
        student = MoEBlock(*layer, seed=2, device=device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
            else MixedPrecisionPolicy()
        accumulate = args.micro_batches > 1
        fully_shard(student.experts, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=not accumulate)
        fully_shard(student, mesh=mesh._flatten("dp_ep"), mp_policy=policy)
        # The gradient of the mean of the ranks' losses: FSDP2 averages the router's over every rank, but an expert's
        # gradient already sums its whole EP group's tokens (dispatch and combine bring them to it), so its sum over
        # "dp" is divided by the world size, not by "dp"'s (as TorchTitan does): FSDP2's divide factor where NCCL
        # reduces (PreMulSum), else one division before the step (gloo has no PreMulSum).
        divide_after = torch.distributed.get_backend() != "nccl"
        if not divide_after:
            student.experts.set_gradient_divide_factor(world)
        optimizer = torch.optim.SGD(student.parameters(), lr=args.lr)
        for step in range(args.steps):
            step_loss = 0.0
            for m in range(args.micro_batches):
                last = m == args.micro_batches - 1
                if accumulate:  # reduce the gradients and reshard the experts at the step's last micro-batch only
                    student.set_requires_gradient_sync(last)
                    student.experts.set_reshard_after_backward(last)
                out = student(x[m], is_first_microbatch=(m == 0) if accumulate else None)
                loss = F.mse_loss(out.float(), targets[m]) / args.micro_batches
                loss.backward()
                step_loss += loss.item()
            if divide_after:
                for weight in student.experts.parameters():
                    weight.grad /= ep_size  # (FSDP2 divided by "dp"'s size: / ep more is / world)
            if args.max_grad_norm > 0:
                # The whole layer's norm, the same on every rank: the ep_mesh experts' DTensors cover the EP group, so
                # no expert_parameters (they would be needed for per-rank experts: docs/TRAINING.md).
                grad_norms.append(training.clip_grad_norm_(student.parameters(), args.max_grad_norm).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step_loss)
            stop_if_diverged(step, step_loss, student.parameters(), args.lr, device)
    return TrainingLog(losses, grad_norms)


def main():
    own = training_flags()
    own.add_argument("--micro-batches", type=int, default=1,
                     help="micro-batches per step (gradient accumulation; divides --tokens)")
    own.add_argument("--bf16", action="store_true", help="BF16 parameters in forward and backward (FSDP2 policy)")
    own.add_argument("--max-grad-norm", type=float, default=0.0,
                     help="clip the gradients to this global norm (training.clip_grad_norm_); 0: no clipping")

    def check(parser, args):
        check_training_flags(parser, args)
        if args.micro_batches < 1 or args.tokens % args.micro_batches:
            parser.error(f"--micro-batches must be a positive divisor of --tokens, got {args.micro_batches}")
        if not 0 <= args.max_grad_norm < math.inf:
            parser.error(f"--max-grad-norm must be a finite number >= 0, got {args.max_grad_norm}")

    args, world = parse_moe_args(None, description=__doc__, hidden=256, intermediate=128, tokens=128, experts=8,
                                 topk=2, parents=[own], intermediate_multiple=32, check=check)
    for rank, log in enumerate(run_ranks(worker, world, args, backend="nccl" if args.gpu else "gloo")):
        norms = (f" (gradient norm {log.grad_norms[0]:.4f} at step 1 and {log.grad_norms[-1]:.4f} at the last, "
                 f"clipped where above {args.max_grad_norm})") if log.grad_norms else ""
        print(f"rank {rank}: loss {log.losses[0]:.5f} at step 1, {log.losses[-1]:.5f} at step {len(log.losses)}"
              f"{norms}")


if __name__ == "__main__":
    main()
