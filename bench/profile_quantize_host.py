"""Where an eager NVFP4 4/6 quantize call's host time goes, layer by layer (one GPU; timings, not a test).

    python bench/profile_quantize_host.py [--calls 2000]

Per shape, host µs per call (bench/profile_host.py's timer, back-to-back calls) of:
  empty3   the three output allocations alone (torch.empty x 3)
  launch   the compiled launch alone (ep_comm._C.nvfp4_quantize with the outputs allocated outside the loop)
  internal ep_comm._cuda_formats.nvfp4_quantize (allocations, launch, the NVFP4Tensor)
  public   ep_comm.formats.nvfp4_quantize (its argument checks, then internal)
  mxfp8, s2f6  the public ep_comm.formats.mxfp8_quantize / s2f6_quantize of the same x, for comparison
  add      one small torch kernel launch, the scale of the machine's host
  public_inference  the public call inside torch.inference_mode()
then a cProfile table of the public call at the first shape. At the first three sizes the GPU work is a few µs, so
the loop is host-bound and the host figure is the call's cost; the last two launch more CTAs than one wave, the 4/6
quantizer's L2-prefetch branch (its host-side occupancy query: `device_run.sh steps quantize_host_env_ab` times
them with the prefetch on and off), where the GPU span exceeds the host figure. The calls are timed in chunks of
--chunk with a synchronize between chunks (not timed): about 1000 launches fill the launch queue, after which the host
waits for the GPU, so one loop of 2000 calls of a GPU-bound shape would time about half the GPU's time instead of
the host's cost (the eighty-first session's first run of this form did).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import _per_call_us, _profile_table  # noqa: E402


def _chunked_per_call_us(fn, calls: int, chunk: int) -> tuple:
    """_per_call_us over `calls` calls in chunks of at most `chunk`, synchronized between chunks (not timed), so the
    launch queue never fills and the host figure stays the host's cost on GPU-bound shapes too: (host µs per call,
    GPU µs per call), each the chunks' total over `calls`."""
    host_total = gpu_total = 0.0
    done = 0
    while done < calls:
        n = min(chunk, calls - done)
        host, gpu = _per_call_us(fn, n)  # synchronizes before its timed loop
        host_total += host * n
        gpu_total += gpu * n
        done += n
    return host_total / calls, gpu_total / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=250, help="calls per timed chunk (below the ~1000-launch queue)")
    args = parser.parse_args()
    if args.calls < 1 or args.chunk < 1:
        parser.error("--calls and --chunk must be at least 1")
    from ep_comm import _cuda_formats, _ext, formats

    lib = _ext.require_cuda_extension("this profile")
    device = torch.device("cuda", torch.cuda.current_device())
    stream = _ext.current_raw_stream(device)
    for dtype, rows, hidden in ((torch.bfloat16, 16, 7168), (torch.bfloat16, 128, 7168), (torch.float32, 128, 2048),
                                (torch.float32, 16384, 2048), (torch.bfloat16, 2048, 7168)):
        x = torch.randn(rows, hidden, device=device).to(dtype)
        data = torch.empty(rows, hidden // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(rows, hidden // 16, dtype=torch.uint8, device=device)
        amax_out = torch.empty(rows, dtype=torch.float32, device=device)
        x_type = {torch.float32: 0, torch.bfloat16: 1}[dtype]

        def empty3():
            torch.empty(rows, hidden // 2, dtype=torch.uint8, device=device)
            torch.empty(rows, hidden // 16, dtype=torch.uint8, device=device)
            torch.empty(rows, dtype=torch.float32, device=device)

        def launch():
            lib.nvfp4_quantize(x.data_ptr(), x_type, hidden, rows, hidden, 0, 256.0, True, data.data_ptr(), hidden // 2,
                               scales.data_ptr(), hidden // 16, amax_out.data_ptr(), 0, stream, 0, 0, hidden, 0)

        cases = {"empty3": empty3, "launch": launch,
                 "internal": lambda: _cuda_formats.nvfp4_quantize(x, True, None),
                 "public": lambda: formats.nvfp4_quantize(x),
                 "mxfp8": lambda: formats.mxfp8_quantize(x),
                 "s2f6": lambda: formats.s2f6_quantize(x),
                 "add": lambda: data.add_(1)}
        for fn in cases.values():  # warm-up
            fn()
        figures = {name: _chunked_per_call_us(fn, args.calls, args.chunk) for name, fn in cases.items()}
        with torch.inference_mode():  # serving code's grad mode: the public call without its no_grad context
            figures["public_inference"] = _chunked_per_call_us(cases["public"], args.calls, args.chunk)
        print(f"{str(dtype):15s} [{rows}, {hidden}]: " +
              ", ".join(f"{name} {host:.1f}" for name, (host, _) in figures.items()) +
              f" host us per call (public: GPU span {figures['public'][1]:.1f})")
    x = torch.randn(16, 7168, device=device).to(torch.bfloat16)
    print("cProfile of formats.nvfp4_quantize, bf16 [16, 7168]:")
    print(_profile_table(lambda: formats.nvfp4_quantize(x), 500, 15))


if __name__ == "__main__":
    main()
