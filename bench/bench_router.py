"""Router top-k cost and accuracy: the layer's FP32 logits (`MoELayer.route`) against tensor-core forms of the same
product, on one GPU.

    python bench/bench_router.py --tokens 128,4096 --experts 128,256 --out router.json

x is bf16 [T, H] (exact in every form below), the router weight fp32 [E, H]. Forms:
  fp32   : x.float() @ W.t() with TF32 off (what MoELayer.route does today)
  bf16x3 : W split exactly into three bf16 parts (hi = bf16(W), mid = bf16(W - hi), lo = bf16(W - hi - mid)), one
           bf16 GEMM of x against [hi; mid; lo] with fp32 output (torch.mm(..., out_dtype=torch.float32)), then
           (hi part + mid part) + lo part. Every product of a bf16 x and a bf16 part is exact in fp32; only the
           accumulation order and the tensor core's fp32 adds differ from the fp32 form.
  tf32x3 : the same with three TF32 parts and x.float(), TF32 on.
For each: median microseconds of logits + topk + softmax (CUDA events), the largest |logit - fp64 logit|, and how
many tokens' top-k expert sets differ from the fp64 logits' top-k (near-ties; the fp32 form has some too).
Timing only; nothing here is asserted.
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

from bench_formats import time_ms  # noqa: E402  same directory: one timing method for the benchmarks
from ep_comm.bench import run_metadata, strict_json  # noqa: E402
from ep_comm.grouped_gemm import exact_fp32_matmuls  # noqa: E402
from ep_comm.training import split_fp32_in_bf16  # noqa: E402


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """[3E, H] bf16: hi, mid, lo with hi + mid + lo == w exactly (fp32 w away from the subnormal range)."""
    return split_fp32_in_bf16(w).movedim(-1, 0).reshape(3 * w.shape[0], w.shape[1])


def round_tf32(w: torch.Tensor) -> torch.Tensor:
    """w rounded to 10 explicit mantissa bits (nearest, ties away: what matters is that the parts are tf32 values)."""
    bits = w.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def split_tf32(w: torch.Tensor) -> torch.Tensor:
    hi = round_tf32(w)
    rest = w - hi
    mid = round_tf32(rest)
    lo = rest - mid  # at most 24 - 2 * 11 < 11 significant bits left: a tf32 value
    return torch.cat([hi, mid, lo])


def time_us(fn, iters: int) -> float:
    """Median of `iters` single calls between CUDA events (µs), after 3 warm-up calls."""
    return time_ms(fn, 1, iters, warmup=3) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--experts", default="128,256")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for num_experts in (int(e) for e in args.experts.split(",")):
        w = torch.randn(num_experts, args.hidden, device="cuda") / args.hidden ** 0.5
        w_bf16x3 = split_bf16(w)
        w_tf32x3 = split_tf32(w)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, device="cuda").to(torch.bfloat16)
            exact = x.double() @ w.double().t()
            exact_sets = exact.topk(args.topk, dim=-1).indices.sort(dim=-1).values
            e = num_experts

            def fp32():
                with exact_fp32_matmuls():
                    return x.float() @ w.t()

            def bf16x3():
                parts = torch.mm(x, w_bf16x3.t(), out_dtype=torch.float32)
                return (parts[:, :e] + parts[:, e:2 * e]) + parts[:, 2 * e:]

            def tf32x3():
                with exact_fp32_matmuls():
                    torch.backends.cuda.matmul.allow_tf32 = True  # restored by the context on exit
                    parts = x.float() @ w_tf32x3.t()
                return (parts[:, :e] + parts[:, e:2 * e]) + parts[:, 2 * e:]

            for name, logits_fn in (("fp32", fp32), ("bf16x3", bf16x3), ("tf32x3", tf32x3)):
                try:
                    logits = logits_fn()
                except Exception as exc:  # noqa: BLE001 - a form torch does not offer here is reported, not fatal
                    rows.append({"form": name, "tokens": tokens, "experts": e, "error": repr(exc)[:200]})
                    print(f"{name:7s} T={tokens:5d} E={e:4d}: not available ({exc!r:.120})")
                    continue

                def route():
                    top_logits, idx = logits_fn().topk(args.topk, dim=-1)
                    return idx, torch.softmax(top_logits, dim=-1)

                us = time_us(route, args.iters)
                logits_us = time_us(logits_fn, args.iters)
                sets = logits.topk(args.topk, dim=-1).indices.sort(dim=-1).values
                differ = int((sets != exact_sets).any(dim=-1).sum())
                err = float((logits.double() - exact).abs().max())
                again = bool(torch.equal(logits_fn(), logits))
                rows.append({"form": name, "tokens": tokens, "experts": e, "route_us": us, "logits_us": logits_us,
                             "max_abs_err_vs_fp64": err, "tokens_topk_differ_vs_fp64": differ,
                             "deterministic": again})
                print(f"{name:7s} T={tokens:5d} E={e:4d}: route {us:8.1f} us (logits {logits_us:8.1f}), max |err| "
                      f"{err:.3e}, top-{args.topk} sets differing from fp64: {differ}, repeatable {again}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(strict_json({"meta": run_metadata(" ".join(["python3", "bench/bench_router.py"] + (argv or sys.argv[1:]))),
                                   "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
