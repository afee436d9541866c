"""Kernel timeline of one MoE layer forward (torch profiler / CUPTI), to see which kernels leave the GEMMs waiting.

    python bench/profile_moe.py --nproc 2 [--tokens 4096] [--waves 1] [--out timeline.json]

Each rank builds the bench_moe.py layer (DeepSeek-V3 shapes, random weights), runs three warm-up forwards, then
profiles one and prints (rank 0) its kernels in start order: start and end relative to its first kernel, duration,
the gap since the previous kernel on the same stream ended (negative: the kernel started early, as a programmatic
dependent launch), and the stream.
Nothing is timed for the benchmark tables here (bench_moe.py does that); this says where a forward's time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from ep_comm.launch import run_ranks  # noqa: E402


def _worker(rank, world, args):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import ep_comm
    from ep_comm import moe

    from bench_moe import random_layer_weights  # same directory: the benchmark's layer

    device = torch.device("cuda", torch.cuda.current_device())
    h, experts, topk = args.hidden, args.experts, args.topk
    w1, w2, router, packed, gen = random_layer_weights(rank, world, args)
    del w1, w2
    x = torch.randn(args.tokens, h, device=device, generator=gen).to(torch.bfloat16)
    with ep_comm.Buffer(None, hidden=h, num_experts=experts, num_topk=topk, max_tokens_per_rank=args.tokens,
                        dispatch_format="nvfp4", combine_format="s2f6", expert_alignment=16) as buf:
        layer = moe.MoELayer(buf, router, packed, expert_impl="fused", waves=bool(args.waves))
        for _ in range(3):
            layer(x)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            dist.barrier()
            layer(x)
            torch.cuda.synchronize()
        dist.barrier()
    # The profiled forward's kernels: those that start after the barrier's NCCL kernel (the barrier's own small
    # kernels before it are left out too).
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    barrier_end = max((e.time_range.end for e in events if "nccl" in e.name.lower()), default=float("-inf"))
    last = [e for e in events if e.time_range.start >= barrier_end and "nccl" not in e.name.lower()]
    t0 = last[0].time_range.start if last else 0
    stream_end = {}
    rows = []
    for e in last:
        stream = getattr(e, "device_resource_id", None)
        start, end = e.time_range.start - t0, e.time_range.end - t0
        gap = start - stream_end[stream] if stream in stream_end else 0.0
        stream_end[stream] = end
        rows.append({"rank": rank, "kernel": e.name[:90], "start_us": start, "end_us": end,
                     "duration_us": end - start, "gap_us": gap, "stream": stream})
    return {"rank": rank, "waves": layer.waves, "token_tile": layer.token_tile, "kernels": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--waves", type=int, default=1, help="1: MoELayer(waves=True) (the default layer), 0: without")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = run_ranks(_worker, args.nproc, args, backend="nccl", timeout_s=400)
    for result in results:
        if result["rank"] != 0:
            continue
        print(f"rank 0, {args.tokens} tokens, waves {result['waves']}, token tile {result['token_tile']}")
        print(f"{'start':>9} {'end':>9} {'dur':>8} {'gap':>8} {'stream':>6}  kernel (us)")
        for r in result["kernels"]:
            print(f"{r['start_us']:>9.1f} {r['end_us']:>9.1f} {r['duration_us']:>8.1f} {r['gap_us']:>8.1f} "
                  f"{str(r['stream']):>6}  {r['kernel']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
