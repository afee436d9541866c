"""The trainable experts' step with an int seed and with a seed tensor (the graph-safe form ExpertMLP uses on GPUs):
GPU time by CUDA events, and the profiler's kernels per step -- their count, their summed time (busy), the span from
the first kernel's start to the last one's end, and the largest gaps between kernels -- in alternating rounds.

    python bench/profile_seed_forms.py [--tokens 4096] [--rounds 3] [--out seed_forms.json]

One rank, every expert local (a real NVFP4 dispatch on the nvlink backend, H = 7168, I = 2048, top-8 of 32 experts,
FP32 masters): the shapes of bench/bench_training_experts.py. Each round times three back-to-back steps of each form.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ep_comm  # noqa: E402
from ep_comm import training  # noqa: E402
from ep_comm.bench import write_report  # noqa: E402
from ep_comm.launch import run_ranks  # noqa: E402
from ep_comm.training_experts import _ExpertMLPFunction  # noqa: E402


def _kernels_per_step(fn, steps: int):
    """(busy ms, span ms, kernel count, the 4 largest gaps) per step over `steps` back-to-back calls, from the
    profiler's CUDA events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy = sum(end - start for start, end, _ in kernels) / 1e3 / steps
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 / steps
    gaps = sorted(((kernels[i + 1][0] - kernels[i][1]) / 1e3, kernels[i][2][:60], kernels[i + 1][2][:60])
                  for i in range(len(kernels) - 1))[-4:]
    return busy, span, len(kernels) // steps, gaps


def _worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, inter, experts, topk = args.tokens, 7168, 2048, 32, 8
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(device)
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=1).to(device)
    rows_out = []
    with ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                        expert_alignment=32, backend="nvlink") as buf:
        result = buf.dispatch(x, topk_idx, weights)
        mlp = training.ExpertMLP(experts, hidden, inter, device=device)
        rows = torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
        grad = torch.randn(result.num_rows, hidden, dtype=torch.bfloat16, device=device)
        seed = torch.zeros((), dtype=torch.int64, device=device)

        def int_seed():
            rows.grad = mlp.w1.grad = mlp.w2.grad = None
            _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, 1).backward(grad)

        def seed_tensor():
            rows.grad = mlp.w1.grad = mlp.w2.grad = None
            seed.add_(1)
            _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, seed).backward(grad)

        for rnd in range(args.rounds):
            for name, fn in (("int_seed", int_seed), ("seed_tensor", seed_tensor)):
                for _ in range(3):  # (warm-up)
                    fn()
                torch.cuda.synchronize()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    fn()
                stop.record()
                stop.synchronize()
                busy, span, count, gaps = _kernels_per_step(fn, 3)
                rows_out.append({"round": rnd, "form": name, "events_ms": start.elapsed_time(stop) / 3,
                                 "kernels_busy_ms": busy, "kernels_span_ms": span, "kernels_per_step": count,
                                 "largest_gaps": [{"ms": g, "after": a, "before": b} for g, a, b in gaps]})
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    (rows,) = run_ranks(_worker, 1, args, backend="nccl", timeout_s=600)
    for row in rows:
        print(f"round {row['round']} {row['form']:12s} events {row['events_ms']:.3f} ms per step; kernels: "
              f"{row['kernels_per_step']} per step, busy {row['kernels_busy_ms']:.3f} ms, span "
              f"{row['kernels_span_ms']:.3f} ms; largest gap {row['largest_gaps'][-1]['ms']:.3f} ms")
    if args.out:
        write_report(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
