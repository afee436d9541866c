"""Per-kernel time of nvlink dispatch/combine (torch profiler / CUPTI), to see where the time goes.

    python bench/profile_nvlink.py --nproc 2 [--tokens 128,4096] [--formats nvfp4/s2f6,bf16/bf16] [--timeline]

Each rank runs a few warm-up calls, then profiles `--iters` dispatch+combine pairs and prints (rank 0) the
average device time per kernel and call. Also writes the rows as JSON with --out.
--timeline instead captures `--iters` dispatch+combine pairs in one CUDA graph (as bench_dispatch_combine.py times
them), profiles one replay and prints each rank's kernels of the last pair: start and end in microseconds from that
rank's layout kernel. The two processes' timestamps do not share a clock (on 2xH200 they were 60 us to 0.6 s apart,
2026-12-01), so the ranks are not lined up against each other. With programmatic dependent launch a kernel starts
while its predecessor runs and waits inside: its "start" is its launch, not the start of its work.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ep_comm.launch import run_ranks  # noqa: E402


def _worker(rank, world, args):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import ep_comm
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for pair in args.formats.split(","):
            dfmt, cfmt = pair.split("/")
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16).cuda()
            idx = torch.rand(tokens, args.experts, generator=gen).topk(args.topk, dim=1).indices.cuda()
            w = torch.rand(tokens, args.topk, generator=gen).cuda()
            with ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                                max_tokens_per_rank=tokens, dispatch_format=dfmt, combine_format=cfmt,
                                backend="nvlink", check_inputs=False, num_sms=args.num_sms,
                                num_local_sms=args.num_local_sms) as buf:
                res = buf.dispatch(x, idx, w)
                out = torch.randn(res.num_rows, args.hidden, device="cuda").to(torch.bfloat16)
                for _ in range(3):
                    res = buf.dispatch(x, idx, w)
                    buf.combine(out, res.handle)
                torch.cuda.synchronize()
                dist.barrier()
                if args.timeline:
                    prof = _profile_graph_replay(buf, x, idx, w, out, args.iters)
                    dist.barrier()
                    rows += _timeline_rows(rank, tokens, pair, prof)
                    continue
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.iters):
                        res = buf.dispatch(x, idx, w)
                        buf.combine(out, res.handle)
                    torch.cuda.synchronize()
                dist.barrier()
            for event in prof.key_averages():
                if event.device_type.name != "CUDA" or event.count == 0:
                    continue
                total_us = getattr(event, "self_device_time_total", None)
                if total_us is None:
                    total_us = event.self_cuda_time_total
                rows.append({"rank": rank, "tokens": tokens, "formats": pair, "kernel": event.key[:60],
                             "calls": event.count, "us_per_iter": total_us / args.iters})
    return rows


def _profile_graph_replay(buf, x, idx, w, out, pairs):
    """One replay of a CUDA graph of `pairs` dispatch+combine pairs, under the profiler (after a warm-up replay)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as bench_dispatch_combine._graph_time_us does
        res = buf.dispatch(x, idx, w)
        buf.combine(out, res.handle)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(pairs):
            res = buf.dispatch(x, idx, w)
            buf.combine(out, res.handle)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    del graph
    return prof


def _timeline_rows(rank, tokens, pair, prof):
    """The kernels of the last dispatch+combine pair of the replay (from its last layout kernel on), absolute times."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "nccl" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    layouts = [i for i, e in enumerate(kernels) if "layout_kernel" in e.name]
    last = kernels[layouts[-1]:] if layouts else kernels
    return [{"rank": rank, "tokens": tokens, "formats": pair, "kernel": e.name.replace("(anonymous namespace)::", "").split("(")[0][-60:],
             "start_us": e.time_range.start, "end_us": e.time_range.end} for e in last]


def _print_timeline(rows):
    for key in sorted({(r["tokens"], r["formats"]) for r in rows}):
        mine = [r for r in rows if (r["tokens"], r["formats"]) == key]
        print(f"timeline: {key[0]} tokens, {key[1]} (us from each rank's own layout kernel; start, end, duration)")
        for rank in sorted({r["rank"] for r in mine}):
            ranks = sorted((r for r in mine if r["rank"] == rank), key=lambda r: r["start_us"])
            t0 = ranks[0]["start_us"]
            for r in ranks:
                print(f"  rank {rank} {r['start_us'] - t0:>8.1f} {r['end_us'] - t0:>8.1f} "
                      f"{r['end_us'] - r['start_us']:>7.1f}  {r['kernel']}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--formats", default="nvfp4/s2f6,bf16/bf16")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--num-local-sms", type=int, default=0, help="blocks of the local phases (0 = all SMs)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--timeline", action="store_true", help="both ranks' kernels of the last call in a graph replay")
    args = parser.parse_args()
    rows = [r for rank_rows in run_ranks(_worker, args.nproc, args, backend="nccl", timeout_s=400) for r in rank_rows]
    if args.timeline:
        _print_timeline(rows)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(rows, handle, indent=1)
        return
    for r in sorted((r for r in rows if r["rank"] == 0), key=lambda r: (r["tokens"], r["formats"], -r["us_per_iter"])):
        print(f"{r['tokens']:>6} {r['formats']:<11} {r['us_per_iter']:>9.1f} us/iter  x{r['calls']:<4} {r['kernel']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
