"""Bandwidth of the quantization kernels vs a same-run device-to-device copy, and speedup over the torch reference.

Each kernel runs on a large input (>= 64 MiB; 256 MiB of bf16 by default) with preallocated outputs, launched
through `ep_comm._C` directly so the numbers are kernel time, not Python overhead. Timing: CUDA events around a
batch of launches after warm-up, median over batches. "GB/s" counts bytes read + written once (the minimum
traffic); "% copy" compares it with torch `copy_` of a 512 MiB tensor (read + write) measured in the same run.
The reference column times the torch implementation in ep_comm.formats (impl="reference") on the same GPU.

    python bench/bench_formats.py [--mib 256] [--hidden 7168] [--out results.json] [--no-reference] [--only NAME]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Optional

import torch

from ep_comm import _ext
from ep_comm import formats as F
from ep_comm.bench import run_metadata  # what every benchmark JSON records about its run


def time_ms(fn: Callable[[], object], iters: int, batches: int, warmup: int = 2) -> float:
    """Median over `batches` of the mean time of `iters` back-to-back calls (ms), measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(batches):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / iters)
    return statistics.median(samples)


def copy_bandwidth_gbps(mib: int = 512) -> float:
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=10, batches=5)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


class Case:
    def __init__(self, name: str, shape: str, bytes_moved: int, kernel: Callable[[], object],
                 reference: Optional[Callable[[], object]]):
        self.name, self.shape, self.bytes_moved = name, shape, bytes_moved
        self.kernel, self.reference = kernel, reference


def rows_of(mib: int, hidden: int) -> int:
    """The rows of the benchmark's input: bf16 rows of `mib` MiB, a multiple of 32 (at least 32)."""
    return max(32, ((mib << 20) // (2 * hidden)) // 32 * 32)


def build_cases(lib, mib: int, hidden: int, with_reference: bool) -> list[Case]:
    stream = torch.cuda.current_stream().cuda_stream
    bf16, u8, f32 = torch.bfloat16, torch.uint8, torch.float32
    rows = rows_of(mib, hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=bf16)
    elements = rows * hidden
    ref = (lambda fn: fn) if with_reference else (lambda fn: None)
    cases = []

    # NVFP4 quantize, 4/6 and plain, with the per-row amax computed in the kernel; then two more 4/6 forms the library
    # runs: the row amax given (what nvfp4_quantize(x, amax=...) does, e.g. with the amax w1's epilogue fuses in the MoE
    # layer: no in-kernel row reduction and no row barrier), and fp32 rows.
    q_data = torch.empty(rows, hidden // 2, dtype=u8, device="cuda")
    q_scales = torch.empty(rows, hidden // 16, dtype=u8, device="cuda")
    q_amax = torch.empty(rows, dtype=f32, device="cuda")
    nvfp4_bytes = elements // 2 + elements // 16 + 4 * rows
    x32 = x.float()
    given_amax = x32.abs().amax(dim=1)

    def nvfp4_case(name, src, elem_type, four_over_six=True, amax=None):
        amax_bytes = 0 if amax is None else 4 * rows
        e4m3_max = 256.0 if four_over_six else 448.0

        def quantize():
            lib.nvfp4_quantize(src.data_ptr(), elem_type, hidden, rows, hidden, 0 if amax is None else amax.data_ptr(),
                               e4m3_max, four_over_six, q_data.data_ptr(), hidden // 2, q_scales.data_ptr(),
                               hidden // 16, q_amax.data_ptr(), 0, stream)
        return Case(name, f"{'fp32' if src.dtype == f32 else 'bf16'} [{rows}, {hidden}]",
                    src.element_size() * elements + amax_bytes + nvfp4_bytes, quantize,
                    ref(lambda: F.nvfp4_quantize(src, four_over_six=four_over_six, amax=amax, impl="reference")))

    cases.append(nvfp4_case("nvfp4_quantize 4/6", x, lib.ELEM_BFLOAT16))
    cases.append(nvfp4_case("nvfp4_quantize plain", x, lib.ELEM_BFLOAT16, four_over_six=False))
    cases.append(nvfp4_case("nvfp4_quantize 4/6, amax given", x, lib.ELEM_BFLOAT16, amax=given_amax))
    cases.append(nvfp4_case("nvfp4_quantize 4/6, fp32 in", x32, lib.ELEM_FLOAT32))
    # Rows with outlier channels (every 97th column 30x, as LLM activations' massive channels): a block holding one
    # dominant outlier often decodes the same under both 4/6 candidates, an exact tie of the two errors, which the
    # fast path's error bound cannot decide (bench/near_tie_rates.py: ~3 such blocks per row at hidden 7168).
    x_outliers = x.clone()
    x_outliers[:, ::97] *= 30.0
    cases.append(nvfp4_case("nvfp4_quantize 4/6, outlier columns", x_outliers, lib.ELEM_BFLOAT16))
    q = F.nvfp4_quantize(x, impl="cuda")
    out_bf16 = torch.empty(rows, hidden, dtype=bf16, device="cuda")
    cases.append(Case("nvfp4_dequantize", f"-> bf16 [{rows}, {hidden}]", nvfp4_bytes + 2 * elements,
                      lambda: lib.nvfp4_dequantize(q.data.data_ptr(), q.scales.data_ptr(), q.amax.data_ptr(), rows,
                                                   hidden, 256.0, out_bf16.data_ptr(), lib.ELEM_BFLOAT16, stream),
                      ref(lambda: F.nvfp4_dequantize(q, dtype=bf16, impl="reference"))))

    # MXFP8 quantize nearest / stochastic, dequantize, and the transposed requantization.
    m_data = torch.empty(rows, hidden, dtype=u8, device="cuda")
    m_scales = torch.empty(rows, hidden // 32, dtype=u8, device="cuda")
    mx_bytes = elements + elements // 32
    for stochastic in (False, True):
        def mx_quantize(sr=stochastic):
            lib.mxfp8_quantize(x.data_ptr(), lib.ELEM_BFLOAT16, hidden, rows, hidden, sr, 1234, m_data.data_ptr(),
                               hidden, m_scales.data_ptr(), hidden // 32, stream)
        rounding = "stochastic" if stochastic else "nearest"
        cases.append(Case(f"mxfp8_quantize {rounding}", f"bf16 [{rows}, {hidden}]", 2 * elements + mx_bytes,
                          mx_quantize,
                          ref(lambda r=rounding: F.mxfp8_quantize(x, rounding=r, seed=1234, impl="reference"))))
    m = F.mxfp8_quantize(x, impl="cuda")
    cases.append(Case("mxfp8_dequantize", f"-> bf16 [{rows}, {hidden}]", mx_bytes + 2 * elements,
                      lambda: lib.mxfp8_dequantize(m.data.data_ptr(), m.scales.data_ptr(), rows, hidden,
                                                   out_bf16.data_ptr(), lib.ELEM_BFLOAT16, stream),
                      ref(lambda: F.mxfp8_dequantize(m, dtype=bf16, impl="reference"))))
    t_data = torch.empty(hidden, rows, dtype=u8, device="cuda")
    t_scales = torch.empty(hidden, rows // 32, dtype=u8, device="cuda")
    cases.append(Case("nvfp4_to_mxfp8_transposed SR", f"[{rows}, {hidden}] -> [{hidden}, {rows}]",
                      nvfp4_bytes + mx_bytes,
                      lambda: lib.nvfp4_to_mxfp8_transposed(q.data.data_ptr(), q.scales.data_ptr(), q.amax.data_ptr(),
                                                            rows, hidden, 256.0, True, 99, t_data.data_ptr(),
                                                            t_scales.data_ptr(), stream),
                      ref(lambda: F.nvfp4_to_mxfp8_transposed(q, seed=99, impl="reference"))))

    # RHT + S2F6 quantize (with / without RHT), dequantize.
    s_data = torch.empty(rows, hidden, dtype=torch.int8, device="cuda")
    s_scales = torch.empty(rows, hidden // 32, dtype=u8, device="cuda")
    for hadamard in (True, False):
        def s2f6_quantize(h=hadamard):
            lib.s2f6_quantize(x.data_ptr(), lib.ELEM_BFLOAT16, hidden, rows, hidden, h, F.DEFAULT_SIGN_MASK,
                              s_data.data_ptr(), hidden, s_scales.data_ptr(), hidden // 32, stream)
        cases.append(Case(f"s2f6_quantize {'rht' if hadamard else 'no-rht'}", f"bf16 [{rows}, {hidden}]",
                          2 * elements + mx_bytes, s2f6_quantize,
                          ref(lambda h=hadamard: F.s2f6_quantize(x, hadamard=h, impl="reference"))))
    s = F.s2f6_quantize(x, impl="cuda")
    cases.append(Case("s2f6_dequantize rht", f"-> bf16 [{rows}, {hidden}]", mx_bytes + 2 * elements,
                      lambda: lib.s2f6_dequantize(s.data.data_ptr(), s.scales.data_ptr(), rows, hidden, True,
                                                  F.DEFAULT_SIGN_MASK, out_bf16.data_ptr(), lib.ELEM_BFLOAT16, stream),
                      ref(lambda: F.s2f6_dequantize(s, dtype=bf16, impl="reference"))))

    # Dequantize-accumulate, 8 distinct source rows per output (the combine receive side).
    num_terms = 8
    num_out = rows // num_terms
    index = torch.randperm(num_out * num_terms, device="cuda").reshape(num_out, num_terms)
    weights = torch.rand(num_out, num_terms, device="cuda")
    acc_out = torch.empty(num_out, hidden, dtype=bf16, device="cuda")
    acc_bytes = num_out * num_terms * (hidden + hidden // 32 + 12) + 2 * num_out * hidden
    cases.append(Case("s2f6_dequantize_accumulate x8 rht", f"[{num_out}x{num_terms}, {hidden}] -> bf16",
                      acc_bytes,
                      lambda: lib.s2f6_dequantize_accumulate(s.data.data_ptr(), s.scales.data_ptr(), rows, hidden,
                                                             index.data_ptr(), True, weights.data_ptr(), num_out,
                                                             num_terms, True, F.DEFAULT_SIGN_MASK,
                                                             acc_out.data_ptr(), lib.ELEM_BFLOAT16, stream),
                      ref(lambda: F.s2f6_dequantize_accumulate(s, index, weights, impl="reference"))))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="bf16 input size per kernel in MiB (>= 64)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=10, help="launches per timed batch")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--only", default="", help="run only the kernels whose name contains this substring")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    # The flags first: a bad one is a usage error wherever it runs, not "no CUDA device" or a traceback.
    if args.mib < 64 or args.hidden < 32 or args.hidden % 32:
        parser.error("--mib must be >= 64 and --hidden a positive multiple of 32")
    if args.iters < 1 or args.batches < 1:
        parser.error("--iters and --batches must be at least 1")
    if not torch.cuda.is_available():
        print("bench_formats: no CUDA device", file=sys.stderr)
        return 1
    lib = _ext.require_cuda_extension("bench_formats")

    copy_gbps = copy_bandwidth_gbps()
    cases = build_cases(lib, args.mib, args.hidden, not args.no_reference)
    if not any(args.only in c.name for c in cases):  # an empty table with exit code 0 would look like a result
        parser.error(f"--only {args.only!r} matches none of: {', '.join(c.name for c in cases)}")
    results = []
    header = f"{'kernel':36s} {'shape':34s} {'MiB':>8s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s} {'ref us':>10s} {'speedup':>8s}"
    print(f"device: {torch.cuda.get_device_name()}   copy_ (read+write): {copy_gbps:.0f} GB/s")
    print(header)
    print("-" * len(header))
    for case in (c for c in cases if args.only in c.name):
        ms = time_ms(case.kernel, args.iters, args.batches)
        gbps = case.bytes_moved / (ms * 1e-3) / 1e9
        ref_ms = time_ms(case.reference, iters=1, batches=1, warmup=1) if case.reference else None
        row = {"kernel": case.name, "shape": case.shape, "bytes": case.bytes_moved, "time_us": ms * 1e3,
               "gbps": gbps, "fraction_of_copy": gbps / copy_gbps,
               "reference_time_us": None if ref_ms is None else ref_ms * 1e3,
               "speedup_vs_reference": None if ref_ms is None else ref_ms / ms}
        results.append(row)
        ref_text = f"{ref_ms * 1e3:10.0f} {ref_ms / ms:7.1f}x" if ref_ms else f"{'-':>10s} {'-':>8s}"
        print(f"{case.name:36s} {case.shape:34s} {case.bytes_moved / 2**20:8.1f} {ms * 1e3:9.1f} {gbps:8.0f} "
              f"{100 * gbps / copy_gbps:6.1f}% {ref_text}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_metadata(), "device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                       "hidden": args.hidden, "mib": args.mib, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
