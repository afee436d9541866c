"""The command line of the MoE examples: sizes and rank count, checked before any rank starts (a bad value would
otherwise surface as one traceback per rank, from inside the Buffer)."""
import argparse
import math

import torch

from ep_comm.bench import check_routing_flags


def parse_moe_args(argv=None, *, description=None, hidden, intermediate, tokens=256, experts=16, topk=4, parents=(),
                   intermediate_multiple=16, check=None):
    """(args, world): the parsed sizes (args.gpu: 2+ GPUs visible, one rank each; else 2 CPU ranks over gloo).
    parents: argparse parsers (add_help=False) of an example's own flags, parsed and listed by --help with these.
    intermediate_multiple: what I must be a multiple of (16: NVFP4 blocks; 32 for the MXFP8 backward of ExpertMLP).
    check: check(parser, args) for an example's own flags (parser.error to refuse), before any rank starts. args goes
    to the ranks, so it holds plain values only (a parser does not pickle)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=list(parents))
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=hidden, help="H, a multiple of 32")
    parser.add_argument("--intermediate", type=int, default=intermediate,
                        help=f"I, a multiple of {intermediate_multiple}")
    parser.add_argument("--experts", type=int, default=experts, help="global experts, a multiple of the rank count")
    parser.add_argument("--topk", type=int, default=topk)
    args = parser.parse_args(argv)
    args.gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    world = torch.cuda.device_count() if args.gpu else 2
    check_routing_flags(parser, args, ("tokens", "hidden", "intermediate", "experts", "topk"), world=world,
                        world_what="ranks (one per visible GPU)" if args.gpu else "ranks (CPU ranks)")
    if args.hidden % 32:
        parser.error(f"--hidden must be a multiple of 32, got {args.hidden}")
    if args.intermediate % intermediate_multiple:
        parser.error(f"--intermediate must be a multiple of {intermediate_multiple}, got {args.intermediate}")
    if check is not None:
        check(parser, args)
    return args, world


def training_flags() -> argparse.ArgumentParser:
    """The training examples' common flags, as a parent parser: --steps, --lr, --expert-parallel."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, default=30, help="SGD steps (at least 1)")
    own.add_argument("--lr", type=float, default=5.0, help="SGD learning rate (finite, positive)")
    own.add_argument("--expert-parallel", type=int, default=0,
                     help="ranks per expert-parallel group (a divisor of the rank count; default: all ranks)")
    return own


def stop_if_diverged(step: int, loss: float, parameters, lr: float, device) -> None:
    """Every rank stops together, with the reason, once a loss or a weight is no longer finite on any rank (a --lr too
    large for these sizes): the next forward would route by NaN logits, which dispatch refuses. One all_reduce; each
    rank checks its own shards of DTensor parameters. step: 0-based."""
    finite = torch.stack([torch.tensor(math.isfinite(loss), device=device)] +
                         [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
                          for p in parameters]).all().float().reshape(1)
    torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    if finite.item() == 0:
        raise RuntimeError(f"the training diverged at step {step + 1} (a loss or weight is not finite on some rank): "
                           f"lower --lr (now {lr})")


def check_training_flags(parser, args) -> None:
    """training_flags' values, refused with parser.error (args.gpu: parse_moe_args' choice of ranks)."""
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if not 0 < args.lr < math.inf:
        parser.error(f"--lr must be a finite positive number, got {args.lr}")
    world = torch.cuda.device_count() if args.gpu else 2  # (parse_moe_args' rank count)
    if not 0 <= args.expert_parallel <= world or args.expert_parallel and world % args.expert_parallel:
        parser.error(f"--expert-parallel must divide the rank count ({world}), got {args.expert_parallel}")
