"""Each quantization kernel of bench_formats launched twice (warm-up + a second launch); nothing timed here.

    ncu --kernel-name regex:"quantize|accumulate|transposed" --section SpeedOfLight ... \\
        python bench/profile_formats.py --mib 64 [--only nvfp4_quantize]

Without --launch-skip, ncu profiles both launches of each kernel (bench/device_run.sh profile_formats does so).

Uses bench_formats.build_cases, so the profiled inputs are the benchmark's (bf16 rows of H = 7168 by default).
"""
from __future__ import annotations

import argparse

import torch

from bench_formats import build_cases, rows_of  # same directory: the benchmark's inputs
from ep_comm import _ext


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--only", default="", help="substring of the kernel names to run (default: all)")
    p.add_argument("--print-elements", action="store_true",
                   help="print the elements of the input (for ncu_sass_summary.py --elements) and launch nothing")
    args = p.parse_args()
    if args.print_elements:
        print(rows_of(args.mib, args.hidden) * args.hidden)
        return
    lib = _ext.require_cuda_extension("profile_formats")
    for case in build_cases(lib, args.mib, args.hidden, with_reference=False):
        if args.only in case.name:
            for _ in range(2):
                case.kernel()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
