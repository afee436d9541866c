"""One grouped-GEMM launch to profile with Nsight Compute (the benchmark's shapes, nothing timed here).

    ncu --kernel-name regex:grouped_gemm --launch-skip 1 --launch-count 1 --set full \\
        python bench/profile_gemm.py --gemm w1 --rows 16

Builds the benchmark's random NVFP4 weights (E = 128 experts, w1 [E, 2I, H] with SwiGLU or w2 [E, H, I]) and
`--rows` uniform rows per expert, then calls `grouped_gemm_nvfp4` twice without the remainder launch (the first
launch is the warm-up to skip).
"""
from __future__ import annotations

import argparse

import torch

from bench_grouped_gemm import Gemm, random_expanded_rows  # same directory: the benchmark's inputs
from ep_comm import grouped_gemm as G


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", choices=("w1", "w2"), default="w1")
    p.add_argument("--rows", type=int, default=16, help="rows per expert (uniform)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--token-tile", type=int, default=0, help="0 = the kernel's choice")
    args = p.parse_args()
    hidden, inter = 7168, 2048
    gemm = (Gemm("w1", args.experts, 2 * inter, hidden, swiglu=True, seed=1) if args.gemm == "w1"
            else Gemm("w2", args.experts, hidden, inter, swiglu=False, seed=2))
    rows = args.experts * args.rows
    x = random_expanded_rows(rows, gemm.k, seed=rows + 1)
    offsets = torch.arange(args.experts + 1, dtype=torch.int32, device="cuda") * args.rows
    counts = torch.full((args.experts,), args.rows, dtype=torch.int32, device="cuda")
    for _ in range(2):
        # tail_tile=0: one launch per call (uniform rows have no remainder), so --launch-skip 1 is the second call.
        G.grouped_gemm_nvfp4(x, offsets, counts, gemm.packed, token_tile=args.token_tile or None, impl="cuda",
                             tail_tile=0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
