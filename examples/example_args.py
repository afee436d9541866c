"""The command line of the MoE examples: sizes and rank count, checked before any rank starts (a bad value would
otherwise surface as one traceback per rank, from inside the Buffer)."""
import argparse

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
