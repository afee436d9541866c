"""Host (CPU) cost of one eager dispatch / combine call on the nvlink backend, and where the Python time goes.

    python bench/profile_host.py [--nproc 1] [--tokens 128,4096] [--calls 300] [--moe-experts 32] [--out host.json]

Each rank makes `calls` back-to-back calls without synchronizing and divides the wall time by the count. When the
GPU work of a call is shorter than its host work (small calls), that is the host cost per call: what an eager
training or serving loop pays on the CPU, and what the GPU idles for when nothing else is queued. Then one round of
calls under cProfile (rank 0) lists the functions with the most own time. Shapes: H = 7168, top-8 of 256 experts,
NVFP4 dispatch, S2F6 combine (check_inputs=False, as MoELayer calls it). Timings of the kernels are in
bench_dispatch_combine.py (CUDA graphs); this says what the Python path costs around them. With --moe-experts, also
the default MoELayer's eager forward at the first token count (fewer experts than the model: same host path).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ep_comm.launch import run_ranks  # noqa: E402


def _per_call_us(fn, calls: int) -> tuple:
    """(host µs per call, GPU µs per call) over `calls` back-to-back calls. A GPU figure above the host figure means
    the loop was GPU-bound. Equal figures do not say which side waited: the GPU span also covers the time it idled
    waiting for the host."""
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6, begin.elapsed_time(end) * 1e3 / calls


def _profile_table(fn, calls: int, top: int) -> str:
    """fn() `calls` times under cProfile: the `top` functions by own time, as µs and calls per fn() call (own time,
    then cumulative). Profiling slows the Python parts several-fold; read the ranking and the proportions. Time a
    C++ method of a pybind class spends is counted as its Python caller's own time (it is not a C-function event)."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"{'own us':>8} {'cum us':>8} {'calls':>6}  function (per call of the profiled loop body)"]
    for (filename, line, name), (_, ncalls, own, cumulative, _) in rows:
        where = f"{os.path.relpath(filename) if filename.startswith('/') else filename}:{line}({name})"
        lines.append(f"{own / calls * 1e6:>8.1f} {cumulative / calls * 1e6:>8.1f} {ncalls / calls:>6.1f}  {where}")
    return "\n".join(lines)


def _worker(rank, world, args):
    import ep_comm
    from ep_comm import _ext

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16)
        idx = torch.rand(tokens, args.experts, device=device, generator=gen).topk(args.topk, dim=1).indices
        w = torch.rand(tokens, args.topk, device=device, generator=gen)
        with ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                            max_tokens_per_rank=tokens, dispatch_format="nvfp4", combine_format="s2f6",
                            expert_alignment=16) as buf:
            result = buf.dispatch(x, idx, w, check_inputs=False)
            expert_out = torch.randn(result.num_rows, args.hidden, device=device, generator=gen).to(torch.bfloat16)
            row = {"tokens": tokens, "world": world, "backend": buf.backend}
            row["dispatch_host_us"] = _per_call_us(lambda: buf.dispatch(x, idx, w, check_inputs=False), args.calls)
            row["combine_host_us"] = _per_call_us(lambda: buf.combine(expert_out, result.handle), args.calls)
            row["begin_finish_rows_host_us"] = _per_call_us(
                lambda: (buf.begin_combine_rows(result), buf.finish_combine_rows(result.handle)), args.calls)

            def pair():
                res = buf.dispatch(x, idx, w, check_inputs=False)
                buf.combine(expert_out, res.handle)
            row["dispatch_combine_host_us"] = _per_call_us(pair, args.calls)
            # The C++ launches alone (one pybind call each, into the last dispatch's arena): dispatch = 3 kernels,
            # combine = 2, with the stream handle computed once outside the loop.
            ctx, handle = buf._backend._ctx, result.handle
            arena = getattr(handle, "arena_ptr", handle.arena)  # trees before 2026-12-01: `arena` was the address
            stream = _ext.current_raw_stream(device)
            is64 = idx.dtype == torch.int64
            row["cpp_dispatch_host_us"] = _per_call_us(lambda: ctx.dispatch_arena(
                x.data_ptr(), idx.data_ptr(), is64, w.data_ptr(), tokens, arena, stream), args.calls)
            out = torch.empty(tokens, args.hidden, dtype=torch.bfloat16, device=device)
            row["cpp_combine_host_us"] = _per_call_us(lambda: ctx.combine_arena(
                expert_out.data_ptr(), arena, tokens, True, out.data_ptr(), stream), args.calls)
            # Scale: the stream lookup every call makes (the library's raw accessor, and torch's public call it
            # replaced), and one small torch kernel launch.
            row["raw_stream_host_us"] = _per_call_us(lambda: _ext.current_raw_stream(device), args.calls)
            row["current_stream_host_us"] = _per_call_us(lambda: torch.cuda.current_stream().cuda_stream, args.calls)
            small = torch.zeros(16, device=device)
            row["torch_add_host_us"] = _per_call_us(lambda: small.add_(1.0), args.calls)
            if rank == 0:
                row["profile_tottime"] = _profile_table(pair, args.calls, args.top)
            rows.append(row)
    if args.moe_experts:
        rows.append(_moe_row(rank, world, args, device, gen))
    return rows


def _moe_row(rank, world, args, device, gen):
    """Host / GPU µs per eager MoELayer forward (the default layer: waves, combine rows) at the first token count,
    with moe_experts experts (fewer than the model's, to keep the weights small: the host path is the same), and the
    functions with the most own time under cProfile."""
    import ep_comm
    from ep_comm import moe

    tokens, h, inter, experts = args.tokens[0], args.hidden, 2048, args.moe_experts
    local = experts // world
    w1 = (torch.randn(local, 2 * inter, h, device=device, generator=gen) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(local, h, inter, device=device, generator=gen) / inter ** 0.5).to(torch.bfloat16)
    router = torch.randn(experts, h, device=device, generator=torch.Generator(device=device).manual_seed(7))
    packed = moe.pack_weights(w1, w2)
    del w1, w2
    x = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
    with ep_comm.Buffer(None, hidden=h, num_experts=experts, num_topk=args.topk, max_tokens_per_rank=tokens,
                        dispatch_format="nvfp4", combine_format="s2f6", expert_alignment=16) as buf:
        layer = moe.MoELayer(buf, router, packed)
        row = {"tokens": tokens, "world": world, "backend": buf.backend, "moe_experts": experts,
               "waves": layer.waves, "combine_rows": layer.combine_rows}
        with torch.no_grad():
            row["moe_forward_host_us"] = _per_call_us(lambda: layer(x), max(args.calls // 10, 10))
            if rank == 0:
                row["profile_tottime"] = _profile_table(lambda: layer(x), max(args.calls // 3, 10), args.top)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25, help="functions listed from the profile")
    parser.add_argument("--moe-experts", type=int, default=0,
                        help="also time an eager MoELayer forward with this many experts (0: not)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    results = run_ranks(_worker, args.nproc, args, backend="nccl", timeout_s=400)
    for row in results[0]:
        timed = {k[:-len("_host_us")]: v for k, v in row.items() if k.endswith("_host_us")}
        print(f"{row['tokens']} tokens, world {row['world']}, {row['backend']}: host / GPU us per call: "
              + ", ".join(f"{name} {host:.1f} / {gpu:.1f}" for name, (host, gpu) in timed.items()))
    for row in results[0]:
        what = ("MoELayer forwards" if "moe_experts" in row else "dispatch + combine pairs")
        print(f"--- cProfile, {row['tokens']} tokens, {what} (rank 0) ---")
        print(row["profile_tottime"])
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
