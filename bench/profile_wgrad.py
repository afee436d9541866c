"""Launches the trainable experts' weight-gradient GEMM (csrc/grouped_wgrad.cu) twice at the backward's w2 shape
(M = H = 7168, N = I = 2048, 32 experts of ~1040 tokens each, K-major bf16 operands; --m / --n for others, e.g. w1's
4096 x 7168) for Nsight Compute (bench/device_run.sh profile_wgrad reports the second launch), and prints its time per
launch (CUDA events)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ep_comm.training_experts import _weight_gradient  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=7168)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens-per-expert", type=int, default=1040)
    args = parser.parse_args()
    m, n, experts, per_expert = args.m, args.n, args.experts, args.tokens_per_expert
    k_total = experts * per_expert
    a = torch.randn(m, k_total, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k_total, device="cuda").to(torch.bfloat16)
    ends = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
    for _ in range(2):
        _weight_gradient(a, b, ends, torch.float32)
    if os.environ.get("PROFILE_WGRAD_TIME", "1") == "1":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            _weight_gradient(a, b, ends, torch.float32)
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop) / 10
        print(f"wgrad {m}x{n}, {experts} experts x {per_expert} tokens: {ms:.3f} ms, "
              f"{2.0 * m * n * k_total / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
