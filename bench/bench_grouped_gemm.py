"""NVFP4 grouped GEMM (ep_comm.grouped_gemm) on DeepSeek-V3 expert shapes vs torch._grouped_mm in BF16.

Shapes (defaults): E = 128 local experts, H = 7168, I = 2048:
  w1: [E, 2I = 4096, H = 7168] with the SwiGLU fused (output [R, I]);  w2: [E, H = 7168, I = 2048].
R = E * rows-per-expert tokens (--rows, default 128 and 16: uniform; "256r": routed, each expert's count drawn
around 256 with the spread of random top-k routing, sd = sqrt(256)), each expert's segment contiguous. Routed cases
also time ours without the small-remainder launch (tail_tile = 0, token tile "128/no-tail").
The NVFP4 weights are random codes and scales built directly on the GPU (one amax per expert) and packed with
`pack_gemm_weights`; the activations are random NVFP4 rows expanded with `expand_nvfp4_rows`, outside the timed
region: "ours" is the GEMM kernels on pre-expanded operands. The MoE layer also runs that expansion before w1 (not
with waves, whose receive writes the operand rows) and requantizes w2's input to NVFP4 4/6 (into w2's operand rows):
the row `mlp` times that whole sequence (moe.fused_expert_mlp, from NVFP4 rows in the dispatch layout to BF16 out)
against the BF16 baseline's w1 + silu*mul + w2, and prints the passes between the GEMMs timed alone.

Rows "ours_fp8" (skipped with --no-fp8): the opt-in inexact FP8 mode (grouped_gemm module docstring) on the same
weights, its FP8 operand rows expanded outside the timed region like the exact ones (the `mlp` row of that mode
includes its expansions), with the relative L2 of its fp32 output against the exact kernel's; for w2 also with the
combine-row epilogue (token tile "combine-rows").

Timing: CUDA events around a batch of --iters back-to-back calls after warm-up, median over --reps batches;
each call streams all E experts' weights (2.1 GB NVFP4 for w1, far more than L2). "ours" calls
`grouped_gemm_nvfp4` with a preallocated output (BF16 by default; the kernel writes only the valid rows).
Baseline: torch._grouped_mm(x_bf16 [R, K], w_bf16 [E, K, N], offs=int32 cumulative row ends) -> BF16, tried
with the weights stored [E, N, K] (viewed transposed, as nn.Linear keeps them) and [E, K, N] contiguous; the
faster layout that works is the baseline (its SwiGLU is not included; a separate silu*mul time is reported).
Ceilings measured in the same run: dense BF16 torch.mm 8192^3 (TFLOP/s) and an HBM copy_ of 1 GiB
(GB/s, read + write).
Columns: ms per call, TFLOP/s (2 R N K), weight GB/s (bytes of the weights as the kernel reads them: packed
values + scales -- each scale once, so exactly the NVFP4 size -- or BF16), % of the mm ceiling, % of the copy ceiling (weight GB/s / copy
GB/s), speedup of ours over BF16.

    python bench/bench_grouped_gemm.py [--rows 128,16] [--experts 128] [--token-tiles auto,16,128] [--check]
                                       [--out results.json]

Exit code 1 when a --check fails or a measurement of ours failed (its rows are missing; the JSON's "checks" say
which); a baseline layout that torch cannot run is only a note.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from typing import Optional

import torch
import torch.nn.functional as TF

from ep_comm import _ext
from ep_comm import formats as F
from ep_comm import grouped_gemm as G
from ep_comm.bench import run_metadata  # what every benchmark JSON records about its run

from bench_formats import copy_bandwidth_gbps, time_ms  # same directory: one timing helper for the benchmarks


# ----------------------------------------------------------------------------------------------------------
# Timing and ceilings
# ----------------------------------------------------------------------------------------------------------
def mm_ceiling_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(size, size, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: torch.mm(a, b, out=c), 10, 5, warmup=3)
    return 2 * size ** 3 / (ms * 1e-3) / 1e12


def copy_ceiling_gbps(mib: int = 1024) -> float:
    return copy_bandwidth_gbps(mib)


def free_memory():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------
def random_nvfp4_weights(experts: int, n: int, k: int, seed: int) -> F.NVFP4Tensor:
    """Random NVFP4 weights [E, N, K] on the GPU: uniform codes, scale bytes in [0x30, 0x48), per-expert amax."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x30, 0x48, (experts, n, k // 16), generator=g, dtype=torch.uint8, device="cuda")
    amax = (torch.rand(experts, 1, generator=g, device="cuda") + 0.5).expand(experts, n).contiguous()
    return F.NVFP4Tensor(data=data, scales=scales.view(torch.float8_e4m3fn), amax=amax, e4m3_max=448.0)


def random_nvfp4_rows(rows: int, k: int, seed: int) -> F.NVFP4Tensor:
    """Random NVFP4 activation rows [rows, k] (the dispatch layout's format: E4M3 range 256, per-row amax)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return F.NVFP4Tensor(
        data=torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8, device="cuda"),
        scales=torch.randint(0x30, 0x48, (rows, k // 16), generator=g, dtype=torch.uint8,
                             device="cuda").view(torch.float8_e4m3fn),
        amax=torch.rand(rows, generator=g, device="cuda") * 10 + 0.1, e4m3_max=256.0)


def random_expanded_rows(rows: int, k: int, seed: int) -> G.ExpandedRows:
    return G.expand_nvfp4_rows(random_nvfp4_rows(rows, k, seed))


class Gemm:
    """One grouped GEMM of the benchmark: packed NVFP4 weights + their logical shape."""

    def __init__(self, name: str, experts: int, n: int, k: int, swiglu: bool, seed: int):
        self.name, self.experts, self.n, self.k, self.swiglu = name, experts, n, k, swiglu
        w = random_nvfp4_weights(experts, n, k, seed)
        self.packed = G.pack_gemm_weights(w, swiglu=swiglu)
        del w
        free_memory()
        self.weight_bytes = self.packed.values.numel() * 4 + self.packed.scales.numel()  # as the kernel reads them
        self.nvfp4_bytes = experts * n * k // 2 + experts * n * k // 16  # codes + one scale byte per 16 (no copies)

    def flops(self, rows: int) -> float:
        return 2.0 * rows * self.n * self.k


# ----------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------
def check_experts(gemm: Gemm, x: G.ExpandedRows, offsets, counts, offsets_t, counts_t, experts, tiles) -> list:
    """Full-problem CUDA runs (fp32 out, each token tile) vs the FP32 reference of single experts."""
    refs = {}
    for e in experts:
        rows = slice(offsets[e], offsets[e] + counts[e])
        sub_x = G.ExpandedRows(x.values[rows], x.row_factor[rows])
        sub_off = torch.tensor([0, counts[e]], dtype=torch.int32, device="cuda")
        sub_cnt = torch.tensor([counts[e]], dtype=torch.int32, device="cuda")
        refs[e] = G.grouped_gemm_nvfp4(sub_x, sub_off, sub_cnt, gemm.packed.experts(e, e + 1),
                                       out_dtype=torch.float32, impl="reference")
    results = []
    for tile in tiles:
        out = G.grouped_gemm_nvfp4(x, offsets_t, counts_t, gemm.packed, out_dtype=torch.float32,
                                   token_tile=tile or None, impl="cuda")
        for e in experts:
            got, ref = out[offsets[e]:offsets[e] + counts[e]], refs[e]
            rel = (torch.linalg.norm((got - ref).double()) / torch.linalg.norm(ref.double())).item()
            ok = rel < 1e-5 and not bool(torch.isnan(got).any())
            results.append({"gemm": gemm.name, "expert": e, "rows": counts[e], "token_tile": tile or "auto",
                            "relative_error": rel, "ok": ok})
            print(f"  check {gemm.name} expert {e} ({counts[e]} rows), token tile {tile or 'auto'}: relative error "
                  f"{rel:.2e} {'ok' if ok else 'FAILED'}")
        del out
    return results


def ran(checks: list, what: str, error: Exception) -> None:
    """Record a measurement of ours that failed: printed, kept in the JSON's checks, and the exit code is 1 (the
    run goes on, since the other figures are still useful, but it is not a complete result)."""
    message = f"{type(error).__name__}: {error}"
    print(f"  NOTE: {what} failed: {message}")
    checks.append({"check": f"{what} ran", "ok": False, "error": message[:500]})


def time_ours(gemm: Gemm, x, offsets_t, counts_t, out_dtype, token_tile, iters, reps, checks: list,
              tail_tile: Optional[int] = None) -> Optional[float]:
    out = torch.zeros(x.num_rows, gemm.packed.out_features, dtype=out_dtype, device="cuda")
    try:
        return time_ms(lambda: G.grouped_gemm_nvfp4(x, offsets_t, counts_t, gemm.packed, out_dtype=out_dtype,
                                                    token_tile=token_tile, impl="cuda", out=out,
                                                    tail_tile=tail_tile), iters, reps)
    except Exception as error:  # report and keep going: the baseline numbers are still useful
        ran(checks, f"ours on {gemm.name} (token tile {token_tile or 'auto'}, "
            f"tail tile {'default' if tail_tile is None else tail_tile})", error)
        return None


def time_fp8(gemm: Gemm, q: F.NVFP4Tensor, x_exact, offsets_t, counts_t, out_dtype, token_tile, iters, reps,
             checks: list):
    """The inexact FP8 mode (expand_nvfp4_rows(precision="fp8_inexact"), outside the timed region like the exact
    rows): (ms, relative L2 of its fp32 output against the exact kernel's over every row), or (None, None)."""
    try:
        x8 = G.expand_nvfp4_rows(q, precision="fp8_inexact")
        exact = G.grouped_gemm_nvfp4(x_exact, offsets_t, counts_t, gemm.packed, out_dtype=torch.float32,
                                     token_tile=token_tile, impl="cuda")
        fp8 = G.grouped_gemm_nvfp4(x8, offsets_t, counts_t, gemm.packed, out_dtype=torch.float32,
                                   token_tile=token_tile, impl="cuda")
        error = (torch.linalg.norm(fp8.double() - exact.double()) / torch.linalg.norm(exact.double())).item()
        del exact, fp8
        free_memory()
        out = torch.zeros(x8.num_rows, gemm.packed.out_features, dtype=out_dtype, device="cuda")
        ms = time_ms(lambda: G.grouped_gemm_nvfp4(x8, offsets_t, counts_t, gemm.packed, out_dtype=out_dtype,
                                                  token_tile=token_tile, impl="cuda", out=out), iters, reps)
        return ms, error
    except Exception as error:  # report and keep going
        ran(checks, f"ours (FP8 mode) on {gemm.name}", error)
        return None, None


def time_combine_rows(gemm: Gemm, x, offsets_t, counts_t, token_tile, iters, reps, checks: list) -> Optional[float]:
    """w2 with the combine-row epilogue (RHT + S2F6 rows, as MoELayer(combine_rows=True) stores them), here into a
    local area (row r -> token r // 8, slot r % 8): the epilogue's cost next to the bf16 one, without NVLink."""
    from ep_comm.types import CombineRowsTarget, s2f6_combine_row_layout
    if not G.has_combine_rows_kernel():
        return None
    rows, hidden, topk = x.num_rows, gemm.packed.out_features, 8
    scale_offset, row_bytes = s2f6_combine_row_layout(hidden)
    area = torch.empty((rows + topk) * row_bytes, dtype=torch.uint8, device="cuda")
    index = torch.arange(rows, dtype=torch.int32, device="cuda")
    target = CombineRowsTarget(bases=torch.tensor([area.data_ptr()], dtype=torch.int64, device="cuda"),
                               area_offset=0, src_rank=torch.zeros_like(index), src_token=index // topk,
                               topk_slot=index % topk, num_topk=topk, max_tokens=(rows + topk) // topk, hidden=hidden,
                               row_bytes=row_bytes, scale_offset=scale_offset, sign_mask=0x6A09E667)
    try:
        return time_ms(lambda: G.grouped_gemm_nvfp4_combine_rows(x, offsets_t, counts_t, gemm.packed, target,
                                                                 token_tile=token_tile), iters, reps)
    except Exception as error:
        ran(checks, f"the combine-row epilogue on {gemm.name}", error)
        return None


def time_requantization(gemm: Gemm, x, offsets_t, counts_t, args, rows_per_expert, ceilings, checks) -> list:
    """w1 (FP32 SwiGLU out) + the w2 input's NVFP4 4/6 requantization, with the per-token amax taken by the
    quantizer's own pass ("amax pass") or by w1's epilogue (row_amax, "amax fused"); the two NVFP4 results must be
    bitwise equal (checked here)."""
    from ep_comm import _cuda_formats
    rows = x.num_rows
    token_tile = args.token_tile_list[0] or None
    hidden = torch.empty(rows, gemm.n // 2, dtype=torch.float32, device="cuda")
    row_amax = torch.empty(rows, dtype=torch.float32, device="cuda")

    def w1(amax=None):
        G.grouped_gemm_nvfp4(x, offsets_t, counts_t, gemm.packed, out_dtype=torch.float32, out=hidden,
                             token_tile=token_tile, row_amax=amax)

    def separate():
        w1()
        return _cuda_formats.nvfp4_quantize(hidden, True, None)

    def fused():
        row_amax.zero_()
        w1(row_amax)
        return _cuda_formats.nvfp4_quantize(hidden, True, row_amax)

    try:
        a, b = separate(), fused()
    except Exception as error:
        print(f"  NOTE: the fused SwiGLU amax failed: {type(error).__name__}: {error}")
        checks.append({"gemm": "w1+quant", "rows_per_expert": rows_per_expert, "check": "fused amax ran",
                       "ok": False, "error": f"{type(error).__name__}: {error}"})
        return []
    same = all(torch.equal(p.view(torch.uint8), q.view(torch.uint8))
               for p, q in ((a.data, b.data), (a.scales, b.scales), (a.amax, b.amax)))
    checks.append({"gemm": "w1+quant", "rows_per_expert": rows_per_expert, "check": "fused amax bitwise equal",
                   "ok": same})
    print(f"  check: w1 + requantization, amax fused vs amax pass: {'bitwise equal' if same else 'DIFFERENT'}")
    out = []
    for label, fn in (("amax pass", separate), ("amax fused", fused)):
        ms = time_ms(fn, args.iters, args.reps)
        out.append(row_for("w1+q", rows_per_expert, "ours", ms, gemm.flops(rows), gemm.weight_bytes, ceilings,
                           None, token_tile=label, note="w1 + NVFP4 4/6 requantization of its output"))
    quant_ms = time_ms(lambda: _cuda_formats.nvfp4_quantize(hidden, True, None), args.iters, args.reps)
    quant_in_ms = time_ms(lambda: _cuda_formats.nvfp4_quantize(hidden, True, row_amax), args.iters, args.reps)
    print(f"  requantization alone: {quant_ms:.3f} ms with its amax pass, {quant_in_ms:.3f} ms given the amax")
    return out


def time_expert_mlp(gemms, rows: int, offsets_t, counts_t, args, checks: list):
    """(ms, parts) of the experts' whole forward as MoELayer runs it (moe.fused_expert_mlp) from NVFP4 rows in the
    dispatch layout: expansion, w1 with SwiGLU, NVFP4 4/6 requantization into w2's operand rows, w2 (BF16 out);
    parts: ms of the passes between the GEMMs, each timed alone (the expansion of the tokens, the requantization
    into operand rows, and the earlier form of the latter: quantize, then expand). (None, {}) if it failed."""
    from ep_comm import _cuda_formats, moe
    w1, w2 = gemms
    tokens = random_nvfp4_rows(rows, w1.k, seed=rows + 3)
    hidden = None
    token_tile = args.token_tile_list[0] or None
    limit = offsets_t[-1:]
    try:
        ms = time_ms(lambda: moe.fused_expert_mlp(tokens, offsets_t, counts_t, w1.packed, w2.packed,
                                                  token_tile=token_tile), args.iters, args.reps)
        hidden = torch.randn(rows, w2.k, device="cuda") * 3.0
        parts = {}
        if args.fp8:  # the whole MLP in the inexact FP8 mode (its expansions included)
            parts["mlp_fp8"] = time_ms(lambda: moe.fused_expert_mlp(tokens, offsets_t, counts_t, w1.packed, w2.packed,
                                                                    token_tile=token_tile, precision="fp8_inexact"),
                                       args.iters, args.reps)
            parts["expand_tokens_fp8"] = time_ms(lambda: G.expand_nvfp4_rows(tokens, num_rows_limit=limit,
                                                                             precision="fp8_inexact"),
                                                 args.iters, args.reps)
        parts.update({
            "expand_tokens": time_ms(lambda: G.expand_nvfp4_rows(tokens, num_rows_limit=limit), args.iters,
                                     args.reps),
            "requantize_to_operand": time_ms(lambda: G.quantize_expanded_rows(hidden, impl="cuda",
                                                                             num_rows_limit=limit),
                                             args.iters, args.reps),
            "quantize_then_expand": time_ms(lambda: G.expand_nvfp4_rows(
                _cuda_formats.nvfp4_quantize(hidden, True, None, num_rows_limit=limit), num_rows_limit=limit),
                args.iters, args.reps),
        })
        print("  mlp parts (ms): " + ", ".join(f"{name} {value:.3f}" for name, value in parts.items()))
        return ms, parts
    except Exception as error:
        ran(checks, "the whole expert MLP", error)
        return None, {}
    finally:
        tokens = hidden = None  # (not `del`: the lambdas above name them)
        free_memory()


def time_baseline(gemm: Gemm, x_bf16: torch.Tensor, offsets: list, iters: int, reps: int, notes: list):
    """(ms, layout) of torch._grouped_mm in BF16 for the same shapes, or (None, None) with a note."""
    if not hasattr(torch, "_grouped_mm"):
        notes.append("torch._grouped_mm is not in this torch build")
        return None, None
    e, n, k = gemm.experts, gemm.n, gemm.k
    offs = torch.tensor(offsets[1:], device="cuda", dtype=torch.int32)  # cumulative row ends
    best = (None, None)
    for layout in ("[E, N, K] viewed as [E, K, N]", "[E, K, N] contiguous"):
        w = None
        try:
            if layout.startswith("[E, N, K]"):
                w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(-2, -1)
            else:
                w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * 0.02
            out = torch._grouped_mm(x_bf16, w, offs=offs, out_dtype=torch.bfloat16)
            if tuple(out.shape) != (x_bf16.shape[0], n):
                raise RuntimeError(f"unexpected output shape {tuple(out.shape)}")
            del out
            ms = time_ms(lambda: torch._grouped_mm(x_bf16, w, offs=offs, out_dtype=torch.bfloat16), iters, reps)
            if best[0] is None or ms < best[0]:
                best = (ms, layout)
            print(f"  baseline {gemm.name} weights {layout}: {ms:.3f} ms")
        except Exception as error:
            message = f"torch._grouped_mm with weights {layout} failed on {gemm.name}: {type(error).__name__}: " \
                      f"{str(error).splitlines()[0] if str(error) else ''}"
            print(f"  NOTE: {message}")
            notes.append(message)
        finally:
            w = None
            free_memory()
    return best


def expert_counts(spec: str, experts: int) -> list:
    """Rows per expert for a --rows entry: "128" uniform, "256r" routed (mean 256, sd 16, fixed seed)."""
    mean = int(spec.rstrip("r"))
    if not spec.endswith("r"):
        return [mean] * experts
    g = torch.Generator().manual_seed(5)
    counts = (mean + mean ** 0.5 * torch.randn(experts, generator=g)).round().clamp(min=0)
    return [int(c) for c in counts.tolist()]


def run_case(spec: str, gemms, args, ceilings, notes: list, checks: list) -> list:
    experts, hidden, inter = args.experts, args.hidden, args.inter
    counts = expert_counts(spec, experts)
    rows = sum(counts)
    rows_per_expert = spec  # the label of this case in the table and the JSON
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    counts_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
    lib = _ext._C
    auto_tile = lib.grouped_gemm_auto_token_tile(rows, experts) if hasattr(lib, "grouped_gemm_auto_token_tile") \
        else None
    print(f"\n== {spec} rows per expert: R = {rows} (min {min(counts)}, max {max(counts)}, "
          f"{sum(c % 128 != 0 and c % 128 <= 32 for c in counts)} experts with a remainder of 1..32 past a multiple "
          f"of 128); auto token tile {auto_tile}")
    nvfp4_rows = {"w1": random_nvfp4_rows(rows, hidden, seed=rows + 1),
                  "w2": random_nvfp4_rows(rows, inter, seed=rows + 2)}
    inputs = {name: G.expand_nvfp4_rows(q) for name, q in nvfp4_rows.items()}
    out_dtype = torch.float32 if args.out_dtype == "fp32" else torch.bfloat16
    results = []
    totals = {"ours": 0.0, "torch_bf16": 0.0, "no_tail": 0.0, "fp8": 0.0 if args.fp8 else None}
    for gemm in gemms:
        x = inputs[gemm.name]
        if args.check:
            checks.extend(check_experts(gemm, x, offsets, counts, offsets_t, counts_t, sorted({0, experts - 1}),
                                        args.token_tile_list))
        ours_by_tile = {t: time_ours(gemm, x, offsets_t, counts_t, out_dtype, t or None, args.iters, args.reps,
                                     checks=checks)
                        for t in args.token_tile_list}
        ours = ours_by_tile[args.token_tile_list[0]]
        no_tail = (time_ours(gemm, x, offsets_t, counts_t, out_dtype, 128, args.iters, args.reps, tail_tile=0,
                             checks=checks)
                   if spec.endswith("r") else None)
        base, layout, swiglu_ms = None, None, None
        if not args.no_baseline:
            x_bf16 = (x.values.float() * x.row_factor[:, None]).to(torch.bfloat16)
            base, layout = time_baseline(gemm, x_bf16, offsets, args.iters, args.reps, notes)
            del x_bf16
            if gemm.swiglu:
                y = torch.randn(rows, gemm.n, device="cuda", dtype=torch.bfloat16)
                swiglu_ms = time_ms(lambda: TF.silu(y[:, :gemm.n // 2]) * y[:, gemm.n // 2:], args.iters, args.reps)
                del y
            free_memory()
        for impl, ms, weight_bytes in (("ours", ours, gemm.weight_bytes),
                                       ("torch_bf16", base, gemm.experts * gemm.n * gemm.k * 2)):
            if ms is None:
                totals[impl] = None
                continue
            if totals[impl] is not None:
                totals[impl] += ms + (swiglu_ms or 0.0) * (impl == "torch_bf16")
            results.append(row_for(gemm.name, rows_per_expert, impl, ms, gemm.flops(rows), weight_bytes, ceilings,
                                   base if impl == "ours" else None,
                                   layout=layout if impl == "torch_bf16" else None,
                                   swiglu_ms=swiglu_ms if impl == "torch_bf16" else None,
                                   token_tile=(tile_label(args.token_tile_list[0], auto_tile)
                                               if impl == "ours" else None)))
        for t in args.token_tile_list[1:]:
            if ours_by_tile[t] is not None:
                results.append(row_for(gemm.name, rows_per_expert, "ours", ours_by_tile[t], gemm.flops(rows),
                                       gemm.weight_bytes, ceilings, base, token_tile=tile_label(t, auto_tile)))
        totals["no_tail"] = totals["no_tail"] + no_tail if no_tail is not None and totals["no_tail"] is not None \
            else None
        if no_tail is not None:
            results.append(row_for(gemm.name, rows_per_expert, "ours", no_tail, gemm.flops(rows), gemm.weight_bytes,
                                   ceilings, base, token_tile="128/no-tail"))
        if args.fp8:
            fp8_ms, fp8_error = time_fp8(gemm, nvfp4_rows[gemm.name], x, offsets_t, counts_t, out_dtype,
                                         args.token_tile_list[0] or None, args.iters, args.reps, checks)
            totals["fp8"] = totals["fp8"] + fp8_ms if fp8_ms is not None and totals["fp8"] is not None else None
            if fp8_ms is not None:
                results.append(row_for(gemm.name, rows_per_expert, "ours_fp8", fp8_ms, gemm.flops(rows),
                                       gemm.weight_bytes, ceilings, base,
                                       token_tile=tile_label(args.token_tile_list[0], auto_tile),
                                       note=f"inexact FP8 mode; relative L2 against the exact kernel {fp8_error:.3e}"))
                results[-1]["relative_l2_vs_exact"] = fp8_error
        if gemm.swiglu:
            results.extend(time_requantization(gemm, x, offsets_t, counts_t, args, rows_per_expert, ceilings, checks))
        if not gemm.swiglu:
            rows_ms = time_combine_rows(gemm, x, offsets_t, counts_t, args.token_tile_list[0] or None, args.iters,
                                        args.reps, checks=checks)
            if rows_ms is not None:
                results.append(row_for(gemm.name, rows_per_expert, "ours", rows_ms, gemm.flops(rows),
                                       gemm.weight_bytes, ceilings, base, token_tile="combine-rows",
                                       note="RHT + S2F6 combine-row epilogue into a local area"))
            if args.fp8 and G.has_combine_rows_kernel() and hasattr(_ext._C, "fp8_operand_forms"):
                x8 = G.expand_nvfp4_rows(nvfp4_rows[gemm.name], precision="fp8_inexact")
                rows_ms = time_combine_rows(gemm, x8, offsets_t, counts_t, args.token_tile_list[0] or None,
                                            args.iters, args.reps, checks=checks)
                del x8
                if rows_ms is not None:
                    results.append(row_for(gemm.name, rows_per_expert, "ours_fp8", rows_ms, gemm.flops(rows),
                                           gemm.weight_bytes, ceilings, base, token_tile="combine-rows",
                                           note="inexact FP8 mode, combine-row epilogue into a local area"))
    flops = sum(g.flops(rows) for g in gemms)
    bytes_ours = sum(g.weight_bytes for g in gemms)
    bytes_bf16 = sum(g.experts * g.n * g.k * 2 for g in gemms)
    if totals["ours"] is not None:
        results.append(row_for("w1+w2", rows_per_expert, "ours", totals["ours"], flops, bytes_ours, ceilings,
                               totals["torch_bf16"], token_tile=tile_label(args.token_tile_list[0], auto_tile)))
    if totals["no_tail"]:
        results.append(row_for("w1+w2", rows_per_expert, "ours", totals["no_tail"], flops, bytes_ours, ceilings,
                               totals["torch_bf16"], token_tile="128/no-tail"))
    if totals["fp8"]:
        results.append(row_for("w1+w2", rows_per_expert, "ours_fp8", totals["fp8"], flops, bytes_ours, ceilings,
                               totals["torch_bf16"], token_tile=tile_label(args.token_tile_list[0], auto_tile),
                               note="inexact FP8 mode (opt-in)"))
    if totals["torch_bf16"]:
        results.append(row_for("w1+w2", rows_per_expert, "torch_bf16", totals["torch_bf16"], flops, bytes_bf16,
                               ceilings, None, note="includes silu*mul for w1"))
    if [g.name for g in gemms] == ["w1", "w2"]:
        mlp_ms, parts = time_expert_mlp(gemms, rows, offsets_t, counts_t, args, checks=checks)
        if mlp_ms is not None:
            results.append(row_for("mlp", rows_per_expert, "ours", mlp_ms, flops, bytes_ours, ceilings,
                                   totals["torch_bf16"], token_tile=tile_label(args.token_tile_list[0], auto_tile),
                                   note="moe.fused_expert_mlp: expansion + w1 + NVFP4 4/6 requantization into w2's "
                                        "operand rows + w2, against torch BF16 w1 + silu*mul + w2"))
            results[-1]["parts_ms"] = parts
            if "mlp_fp8" in parts:
                results.append(row_for("mlp", rows_per_expert, "ours_fp8", parts["mlp_fp8"], flops, bytes_ours,
                                       ceilings, totals["torch_bf16"],
                                       token_tile=tile_label(args.token_tile_list[0], auto_tile),
                                       note="moe.fused_expert_mlp(precision='fp8_inexact'), its expansions included"))
    del inputs, nvfp4_rows
    free_memory()
    return results


def row_for(gemm: str, rows_per_expert: str, impl: str, ms: float, flops: float, weight_bytes: int, ceilings,
            baseline_ms: Optional[float], layout: Optional[str] = None, swiglu_ms: Optional[float] = None,
            note: Optional[str] = None, token_tile: Optional[str] = None) -> dict:
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = weight_bytes / (ms * 1e-3) / 1e9
    row = {"gemm": gemm, "rows_per_expert": rows_per_expert, "impl": impl, "ms": ms, "tflops": tflops,
           "weight_bytes": weight_bytes, "weight_gbps": gbps,
           "fraction_of_mm_ceiling": tflops / ceilings["mm_tflops"],
           "fraction_of_copy_ceiling": gbps / ceilings["copy_gbps"],
           "speedup_vs_torch_bf16": (baseline_ms / ms) if baseline_ms else None, "token_tile": token_tile}
    if layout:
        row["baseline_weight_layout"] = layout
    if swiglu_ms is not None:
        row["separate_swiglu_ms"] = swiglu_ms
    if note:
        row["note"] = note
    return row


def tile_label(tile: int, auto_tile) -> str:
    return f"auto({auto_tile})" if not tile else str(tile)


def print_table(rows: list) -> None:
    header = (f"{'gemm':6s} {'rows/e':>6s} {'impl':10s} {'tile':>11s} {'ms':>8s} {'TFLOP/s':>8s} {'weight GB/s':>11s} "
              f"{'% mm':>6s} {'% copy':>7s} {'speedup':>8s}")
    print("\n" + header)
    print("-" * len(header))
    for r in rows:
        speedup = f"{r['speedup_vs_torch_bf16']:7.2f}x" if r["speedup_vs_torch_bf16"] else f"{'-':>8s}"
        print(f"{r['gemm']:6s} {r['rows_per_expert']:>6s} {r['impl']:10s} {r['token_tile'] or '-':>11s} "
              f"{r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['weight_gbps']:11.0f} {100 * r['fraction_of_mm_ceiling']:5.1f}% "
              f"{100 * r['fraction_of_copy_ceiling']:6.1f}% {speedup}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate size I (w1 has 2I rows)")
    parser.add_argument("--rows", default="128,16",
                        help="comma list of rows per expert: N uniform, Nr routed (counts spread around N)")
    parser.add_argument("--token-tiles", default="auto",
                        help="comma list of token tiles for ours (auto,16,32,64,128); the first one counts in "
                             "w1+w2 and the speedups, the others are extra rows")
    parser.add_argument("--out-dtype", default="bf16", choices=("bf16", "fp32"),
                        help="our kernels' output dtype (default bf16); the torch baseline and the mlp row always write "
                             "bf16, so fp32 makes the ratios compare different output sizes")
    parser.add_argument("--iters", type=int, default=5, help="calls per timed batch")
    parser.add_argument("--reps", type=int, default=7, help="timed batches (the median is reported)")
    parser.add_argument("--check", action="store_true", help="check experts 0 and E-1 against the reference first")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch._grouped_mm")
    parser.add_argument("--no-fp8", dest="fp8", action="store_false",
                        help="skip the rows of the opt-in inexact FP8 mode (impl ours_fp8)")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    rows_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    try:
        args.token_tile_list = [0 if t.strip() == "auto" else int(t) for t in args.token_tiles.split(",") if t.strip()]
    except ValueError:
        parser.error("--token-tiles must be a comma list of auto, 16, 32, 64, 128")
    if not args.token_tile_list or any(t not in (0,) + G.TOKEN_TILES for t in args.token_tile_list):
        parser.error("--token-tiles must be a comma list of auto, 16, 32, 64, 128")
    # pack_gemm_weights takes N and K multiples of 64: w1 is [E, 2I, H], w2 [E, H, I], so H and I both.
    if args.hidden < 64 or args.hidden % 64 or args.inter < 64 or args.inter % 64 or not rows_list or not all(
            r.rstrip("r").isdigit() and int(r.rstrip("r")) > 0 for r in rows_list):
        parser.error("--hidden and --inter must be positive multiples of 64, --rows positive (N or Nr)")
    if args.experts < 1 or args.iters < 1 or args.reps < 1:
        parser.error("--experts, --iters and --reps must be at least 1")
    if not torch.cuda.is_available():
        print("bench_grouped_gemm: no CUDA device", file=sys.stderr)
        return 1
    lib = _ext.require_cuda_extension("bench_grouped_gemm")
    if not hasattr(lib, "grouped_gemm_nvfp4"):
        print("bench_grouped_gemm: this ep_comm._C has no grouped_gemm_nvfp4 (rebuild)", file=sys.stderr)
        return 1

    ceilings = {"mm_tflops": mm_ceiling_tflops(), "copy_gbps": copy_ceiling_gbps()}
    free_memory()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"ceilings: BF16 torch.mm 8192^3 {ceilings['mm_tflops']:.0f} TFLOP/s; HBM copy_ (read+write) "
          f"{ceilings['copy_gbps']:.0f} GB/s")
    gemms = [Gemm("w1", args.experts, 2 * args.inter, args.hidden, swiglu=True, seed=1),
             Gemm("w2", args.experts, args.hidden, args.inter, swiglu=False, seed=2)]
    for g in gemms:
        print(f"{g.name}: [{g.experts}, {g.n}, {g.k}] swiglu={g.swiglu}  packed weights {g.weight_bytes / 1e9:.2f} "
              f"GB (NVFP4 codes + scales once: {g.nvfp4_bytes / 1e9:.2f} GB; BF16 "
              f"{g.experts * g.n * g.k * 2 / 1e9:.2f} GB)")
    notes, checks, results = [], [], []
    for rows_per_expert in rows_list:
        try:
            results.extend(run_case(rows_per_expert, gemms, args, ceilings, notes, checks))
        except torch.cuda.OutOfMemoryError as error:
            notes.append(f"out of memory at {rows_per_expert} rows per expert")
            traceback.print_exc()
            ran(checks, f"the case of {rows_per_expert} rows per expert", error)  # its rows are missing
            free_memory()
    print_table(results)
    for note in notes:
        print(f"note: {note}")
    failed = [c for c in checks if not c["ok"]]
    if args.check:
        print(f"check: {len(checks) - len(failed)}/{len(checks)} passed ((expert, token tile) runs within 1e-5 "
              f"relative error; fused SwiGLU amax bitwise equal to the amax pass; measurements that ran)")
    for c in failed:
        print(f"FAILED: {json.dumps(c)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_metadata(), "device": torch.cuda.get_device_name(), "args": vars(args),
                       "ceilings": ceilings, "results": results, "checks": checks, "notes": notes}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
