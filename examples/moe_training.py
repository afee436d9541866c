"""Training an expert-parallel MoE layer with ep_comm.training: router -> dispatch (NVFP4) -> experts -> combine (S2F6),
and back through both (BF16 gradients on the wire, or MXFP8 with --grad-format mxfp8).

Runs on every visible GPU (NCCL) when there are at least 2, else on 2 CPU ranks over gloo:

    python examples/moe_training.py [--tokens 128 --hidden 256 --intermediate 128 --experts 8 --topk 2 --steps 30]
                                    [--expert-mlp ep_comm|torch] [--expert-parallel N] [--grad-format bf16|mxfp8]

A student layer (its own router and SwiGLU experts, E / W per rank) learns to reproduce a fixed random teacher layer
of the same shape, by plain SGD on the mean squared error. The experts' weights, the router and the tokens' inputs all
get their gradients through the library: the routing weights' through combine's backward, the experts' through the
dispatched rows. Each rank prints its loss at the first and the last step.

Data x expert parallelism: --expert-parallel N (default: every rank) splits the ranks into expert-parallel groups of N
consecutive ranks, each group a Buffer over its own process group holding all E experts (E / N per rank), each rank
with its own tokens. The router is replicated on every rank and the experts on the ranks of the same position in each
group, so their gradients are averaged over the ranks that hold them, as a data-parallel trainer does, and every
replica takes the same SGD steps (checked at the end).

--expert-mlp ep_comm (default): the experts are `training.expert_mlp` (the functional form of `training.ExpertMLP`) on
the layer's own parameters -- NVFP4 weights and tokens in the forward, MXFP8 with stochastic rounding in the backward
(the Buffer then needs expert_alignment 32). --expert-mlp torch: your own
experts in plain torch on the dense rows `routed.x` (FP32 here), to show how any expert code plugs in.
"""

import torch
import torch.nn.functional as F

import ep_comm
from ep_comm import training
from ep_comm.launch import run_ranks
from example_args import check_training_flags, parse_moe_args, stop_if_diverged, training_flags


class ExpertParallelMoE(torch.nn.Module):
    """Router [E, H] (replicated) and this rank's E / W SwiGLU experts: w1 [E/W, 2I, H] (gate rows, then up rows), w2
    [E/W, H, I], FP32 parameters. forward(x bf16 [T, H]) -> bf16 [T, H]. expert_mlp "ep_comm": the experts run as
    training.expert_mlp (ExpertMLP's functional form: NVFP4 / MXFP8), with these parameters as its masters; "torch":
    FP32 matmuls on routed.x."""

    def __init__(self, buffer, grads, rank, world, num_experts, hidden, intermediate, topk, seed, expert_mlp="ep_comm"):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        router = torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5
        w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate ** 0.5
        local = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
        self.router = torch.nn.Parameter(router)
        self.w1 = torch.nn.Parameter(w1[local].clone())
        self.w2 = torch.nn.Parameter(w2[local].clone())
        self.buffer, self.grads, self.topk, self.expert_mlp = buffer, grads, topk, expert_mlp
        self.calls = 0

    def forward(self, x):
        scores = torch.softmax(x.float() @ self.router.t(), dim=-1)
        topk_weights, topk_idx = scores.topk(self.topk, dim=-1)  # the weights stay in the graph: the router trains
        if self.expert_mlp == "ep_comm":
            routed = training.dispatch(self.buffer, self.grads, x, topk_idx, topk_weights)
            self.calls += 1  # (a fresh seed for the backward's stochastic rounding at every step)
            out = training.expert_mlp(routed, self.w1, self.w2, seed=self.calls)
            return training.combine(out, routed)
        routed = training.dispatch(self.buffer, self.grads, x, topk_idx, topk_weights, dtype=torch.float32)
        offsets = routed.result.expert_offsets.tolist()  # (a host read: fine for an example; see docs/TRAINING.md)
        counts = routed.result.num_tokens_per_expert.tolist()
        out = torch.zeros_like(routed.x)
        for j, count in enumerate(counts):
            rows = torch.arange(offsets[j], offsets[j] + count, device=x.device)
            gate, up = (routed.x[rows] @ self.w1[j].t()).chunk(2, dim=-1)
            out = out.index_add(0, rows, (F.silu(gate) * up) @ self.w2[j].t())
        return training.combine(out.to(torch.bfloat16), routed)


def parallel_groups(world, expert_parallel):
    """(the EP group of this rank, its rank and size there, the group of the ranks holding the same experts): EP groups
    of `expert_parallel` consecutive ranks; the expert-data-parallel group of rank r is every rank at r's position
    in its EP group. Every rank makes every group (torch.distributed.new_group is collective)."""
    if expert_parallel == world:
        return None, torch.distributed.get_rank(), world, None
    rank = torch.distributed.get_rank()
    ep_groups = [torch.distributed.new_group(list(range(g * expert_parallel, (g + 1) * expert_parallel)))
                 for g in range(world // expert_parallel)]
    replica_groups = [torch.distributed.new_group(list(range(p, world, expert_parallel)))
                      for p in range(expert_parallel)]
    return ep_groups[rank // expert_parallel], rank % expert_parallel, expert_parallel, \
        replica_groups[rank % expert_parallel]


def average_gradients(model, world, replica_group):
    """The gradient of the mean of the ranks' losses: the router's summed over all ranks; the experts' already sum
    their EP group's tokens (they arrive through dispatch / combine), so they are summed over their replicas only.
    Both are divided by the rank count. Without this, each rank's router would follow its own tokens only and the
    replicated parameters would drift apart. (Until 2026-12-06 the experts' sums were divided by the replica count
    instead: their gradients were the EP group size times the mean loss's.)"""
    torch.distributed.all_reduce(model.router.grad)
    model.router.grad /= world
    for weight in (model.w1, model.w2):
        if replica_group is not None:
            torch.distributed.all_reduce(weight.grad, group=replica_group)
        weight.grad /= world


def check_replicas_agree(model, replica_group):
    """Every replica of a parameter holds the same bits: the router on all ranks, each expert on its replicas."""
    checks = [(model.router, None)] + ([(model.w1, replica_group), (model.w2, replica_group)] if replica_group else [])
    for tensor, group in checks:
        first = tensor.detach().clone()
        source = 0 if group is None else torch.distributed.get_global_rank(group, 0)
        torch.distributed.broadcast(first, src=source, group=group)
        same = torch.tensor([float(torch.equal(first, tensor.detach()))], device=tensor.device)
        torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN, group=group)  # (every rank raises)
        if same.item() == 0:
            raise RuntimeError("the replicas of a parameter differ after training (gradients not averaged alike)")


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    gen = torch.Generator().manual_seed(100 + rank)  # this rank's tokens
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
    sizes = dict(hidden=args.hidden, num_experts=args.experts, num_topk=args.topk, max_tokens_per_rank=args.tokens,
                 expert_alignment=32)  # (ExpertMLP's weight gradients: MXFP8 blocks of 32 rows of one expert)
    ep_group, ep_rank, ep_size, replica_group = parallel_groups(world, args.expert_parallel or world)
    losses = []
    # The backward's wire format both ways: the output gradient's dispatch and the input gradient's combine.
    with ep_comm.Buffer(ep_group, **sizes) as buf, \
            training.GradBuffers.create(buf, args.grad_format, input_grad_format=args.grad_format) as grads:
        layer_sizes = (ep_rank, ep_size, args.experts, args.hidden, args.intermediate, args.topk)
        teacher = ExpertParallelMoE(buf, grads, *layer_sizes, seed=1, expert_mlp=args.expert_mlp).to(device)
        student = ExpertParallelMoE(buf, grads, *layer_sizes, seed=2, expert_mlp=args.expert_mlp).to(device)
        with torch.no_grad():
            target = teacher(x).float()
        optimizer = torch.optim.SGD(student.parameters(), lr=args.lr)
        for step in range(args.steps):
            optimizer.zero_grad()
            loss = F.mse_loss(student(x).float(), target)
            loss.backward()
            average_gradients(student, world, replica_group)
            optimizer.step()
            losses.append(loss.item())
            stop_if_diverged(step, losses[-1], student.parameters(), args.lr, device)
        check_replicas_agree(student, replica_group)
    return losses


def main():
    own = training_flags()
    own.add_argument("--expert-mlp", default="ep_comm", choices=("ep_comm", "torch"),
                     help="the experts: training.ExpertMLP (I a multiple of 32) or plain FP32 torch experts")
    own.add_argument("--grad-format", default="bf16", choices=training.GRAD_FORMATS,
                     help="the gradients' wire format in backward, both ways (mxfp8: E4M3 + UE8M0 per 32)")
    expert_mlp = own.parse_known_args()[0].expert_mlp

    def check(parser, args):
        check_training_flags(parser, args)

    args, world = parse_moe_args(None, description=__doc__, hidden=256, intermediate=128, tokens=128, experts=8,
                                 topk=2, parents=[own], intermediate_multiple=32 if expert_mlp == "ep_comm" else 16,
                                 check=check)
    for rank, losses in enumerate(run_ranks(worker, world, args, backend="nccl" if args.gpu else "gloo")):
        print(f"rank {rank}: loss {losses[0]:.5f} at step 1, {losses[-1]:.5f} at step {len(losses)}")


if __name__ == "__main__":
    main()
