"""The grouped GEMM's opt-in inexact FP8 mode (ep_comm.grouped_gemm, precision "fp8_inexact").

CPU tier: the activation column order against the fp16 A fragments' columns (`_fragment_index`, the packing's own
oracle), the FP8 operand rows against E4M3 rounding of the exact block values, the FP8 reference against the exact
reference (the mode's extra error, bounded), and the refusals. GPU tier (marker `gpu`): the kernel against the FP8
reference (the same rounded operands, so only the accumulation differs) for every token tile, both direct epilogue
forms, SwiGLU, uneven and empty experts and the small-remainder launch; the combine-row epilogue bitwise the bf16 one
followed by the S2F6 quantizer; and rows outside every segment left unwritten.
"""
from __future__ import annotations

import pytest
import torch

from ep_comm import formats as F
from ep_comm import grouped_gemm as G
from test_grouped_gemm import random_activations, random_weights, segments, valid_mask

FP8 = "fp8_inexact"


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double())).item()


@pytest.mark.cpu
def test_fp8_column_order_is_the_fragment_order():
    """wgmma's 32-wide E4M3 step reads A register a0 (a2) of lane l as columns 4t .. 4t + 3 (16 + 4t ..) of the step,
    t = l % 4; the kernel fills a0 / a1 from fp16 k-step 2q's pairs 0 and 2 / 1 and 3, a2 / a3 from k-step 2q + 1's.
    The activation column stored at each of those positions must be the weight column the byte came from."""
    frag_rows, frag_cols = G._fragment_index("cpu")  # [thread, k-step, pair]: tile row and low column
    order = G.FP8_COLUMN_ORDER
    for thread in range(G.THREADS_PER_TILE):
        t = thread % 4
        for q in range(2):
            for register in range(4):
                k_step = 2 * q + register // 2
                pairs = (0, 2) if register % 2 == 0 else (1, 3)
                rows = {int(frag_rows[thread, k_step, j]) for j in pairs}
                assert len(rows) == 1, "one register holds one weight row"
                weight_columns = [int(frag_cols[thread, k_step, j]) + h for j in pairs for h in (0, 1)]
                for byte, column in enumerate(weight_columns):
                    logical = 32 * q + 16 * (register // 2) + 4 * t + byte  # what wgmma multiplies it with
                    group, o = divmod(logical, 16)
                    assert 16 * group + order[o] == column, (thread, q, register, byte)
    assert sorted(order) == list(range(16))


@pytest.mark.cpu
@pytest.mark.parametrize("four_over_six", [True, False])
def test_fp8_rows_are_the_rounded_block_values(four_over_six):
    """values = E4M3(RNE) of e2m1 * scale * 2^-3 in FP8_COLUMN_ORDER, row_factor = 8x the exact one; undoing the
    order gives back every block value to within E4M3's rounding (relative 2^-4) and exactly where it fits."""
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)) * 5
    x[3] = 0.0
    q = F.nvfp4_quantize(x, four_over_six=four_over_six)
    exact = G.expand_nvfp4_rows(q, impl="reference")
    fp8 = G.expand_nvfp4_rows(q, impl="reference", precision=FP8)
    assert fp8.values.dtype == torch.float8_e4m3fn and fp8.precision == FP8 and exact.precision == "exact"
    assert torch.equal(fp8.row_factor, exact.row_factor * 8.0)
    block = exact.values.float() * 0.125
    natural = G.fp8_rows_in_column_order(fp8.values)
    assert torch.equal(natural, block.to(torch.float8_e4m3fn).float())
    assert bool(((natural - block).abs() <= block.abs() * 2.0 ** -4).all())
    raw = fp8.values.float().reshape(37, 16, 16)
    assert torch.equal(raw[..., 2], natural.reshape(37, 16, 16)[..., 8])  # stored column 2 holds column 8
    assert torch.equal(fp8.values[3].float(), torch.zeros(256))


@pytest.mark.cpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_reference_stays_close_to_the_exact_one(swiglu):
    """The mode's extra error: the FP8 reference (both operands rounded to E4M3) against the exact reference, on
    random codes with the block scales of real weights (E4M3 bytes 0x60..0x7E, where moe.pack_weights puts most
    blocks) and 4/6-quantized activations: relative L2 below 6% (measured 3.1% without and 4.8% with the SwiGLU, whose
    product of two GEMM outputs adds their errors; the E4M3 rounding of one element costs 0.9% on average, at most
    2^-5 in the normal range; bench/bench_grouped_gemm.py reports it at full size)."""
    experts, n, k = 3, 128, 256
    counts = [5, 0, 40]
    offsets, rows = segments(counts, 16)
    w = random_weights(experts, n, k, seed=21, scale_low=0x60, scale_high=0x7F)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    q = random_activations(rows, k, seed=22)
    off = torch.tensor(offsets, dtype=torch.int32)
    cnt = torch.tensor(counts, dtype=torch.int32)
    mask = valid_mask(offsets, counts, rows)
    exact = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q), off, cnt, packed, out_dtype=torch.float32,
                                 impl="reference")
    fp8 = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q, precision=FP8), off, cnt, packed, out_dtype=torch.float32,
                               impl="reference")
    assert torch.all(fp8[~mask] == 0)
    error = _relative_l2(fp8[mask], exact[mask])
    assert 0 < error < 0.06, error


@pytest.mark.cpu
def test_fp8_mode_costs_little_against_the_unquantized_mlp():
    """What the mode costs where it matters: an expert MLP with Gaussian master weights (moe.pack_weights) and
    tokens, both modes against the unquantized FP32 MLP. NVFP4 itself is ~22% off (relative L2); the FP8 mode adds
    about 1% of that (22.3% -> 22.6% at H = 1024, I = 512), although it is ~10% off the exact mode: its roundings
    mostly move values within the NVFP4 error. Bound: at most 5% more error than the exact mode."""
    import torch.nn.functional as TF
    from ep_comm import moe
    torch.manual_seed(0)
    experts, hidden, inter, per = 2, 512, 256, 32
    w1 = torch.randn(experts, 2 * inter, hidden) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter) / inter ** 0.5
    x = torch.randn(experts * per, hidden)
    packed = moe.pack_weights(w1, w2)
    p1, p2 = G.pack_gemm_weights(packed.w1, swiglu=True), G.pack_gemm_weights(packed.w2, swiglu=False)
    off = torch.tensor([0, per, 2 * per], dtype=torch.int32)
    cnt = torch.tensor([per, per], dtype=torch.int32)
    tokens = F.nvfp4_quantize(x, four_over_six=True)
    rows = [x[e * per:(e + 1) * per] for e in range(experts)]
    want = torch.cat([(TF.silu(r @ w1[e, :inter].T) * (r @ w1[e, inter:].T)) @ w2[e].T for e, r in enumerate(rows)])

    def mlp(precision):
        h = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(tokens, precision=precision), off, cnt, p1,
                                 out_dtype=torch.float32, impl="reference")
        q = F.nvfp4_quantize(h, four_over_six=True, impl="reference")
        return G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q, precision=precision), off, cnt, p2,
                                    out_dtype=torch.float32, impl="reference")
    exact_error, fp8_error = _relative_l2(mlp("exact"), want), _relative_l2(mlp(FP8), want)
    assert 0.1 < exact_error < 0.4, exact_error  # (the NVFP4 error this bound is relative to)
    assert fp8_error < 1.05 * exact_error, (fp8_error, exact_error)


@pytest.mark.cpu
def test_fp8_refusals():
    """Bad precision names and impls are refused before anything runs."""
    w = random_weights(2, 64, 128, seed=5)
    packed = G.pack_gemm_weights(w, swiglu=False)
    q = random_activations(8, 128, seed=6)
    x = G.expand_nvfp4_rows(q, precision=FP8)
    off = torch.tensor([0, 4, 8], dtype=torch.int32)
    cnt = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="precision"):
        G.expand_nvfp4_rows(q, precision="fp8")
    with pytest.raises(ValueError, match="impl"):
        G.expand_nvfp4_rows(q, precision=FP8, impl="fast")
    G.grouped_gemm_nvfp4(x, off, cnt, packed, impl="reference")  # the control


# ----------------------------------------------------------------------------------------------------------
# The kernel (GPU)
# ----------------------------------------------------------------------------------------------------------
FP8_SHAPES = [(4, 128, 128), (3, 192, 256), (5, 256, 512), (2, 1024, 7168), (70, 128, 128)]  # 70: three scan passes
FP8_COUNTS = [0, 1, 17, 130, 64, 255, 3, 128, 31, 40]


def _fp8_case(shape, swiglu: bool, align: int, seed: int):
    experts, n, k = shape
    counts = [3, 200] if k == 7168 else [FP8_COUNTS[(seed + 3 * e) % len(FP8_COUNTS)] for e in range(experts)]
    offsets, rows = segments(counts, align)
    w = random_weights(experts, n, k, seed=seed, device="cuda", scale_low=0x60, scale_high=0x7F)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=seed + 1, device="cuda"), precision=FP8)
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    ref = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="reference")
    return x, off, cnt, packed, ref, valid_mask(offsets, counts, rows).cuda()


# The kernel multiplies the same E4M3 operands as the reference; what differs is the summation: wgmma's order, and
# its FP8 accumulation, which on Hopper keeps fewer bits than FP32 between the k32 steps. Measured on H200
# (bench/RESULTS.md, fortieth session): relative L2 up to 1.7e-3 at K = 7168 and 2.4e-3 with the SwiGLU there (the
# exact kernel stays below 1e-5). A layout error (a wrong column order, fragment or scale) gives an error of order 1.
FP8_KERNEL_TOLERANCE = 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile", [None, 16, 32, 64, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_kernel_vs_fp8_reference(shape, swiglu, out_dtype, token_tile):
    x, off, cnt, packed, ref, mask = _fp8_case(shape, swiglu, 16, seed=shape[1] + shape[2])
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    assert not torch.isnan(out).any()
    assert torch.all(out[~mask] == 0), "rows outside every expert were written"
    error = _relative_l2(out[mask].float(), ref[mask])
    bound = FP8_KERNEL_TOLERANCE + (2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0)
    print(f"fp8 kernel {shape} swiglu={swiglu} {out_dtype} tile={token_tile}: relative L2 {error:.2e}")
    assert error < bound, f"relative L2 {error:.3e} against the FP8 reference"
    # Row by row too: a few wrong elements (one 64-column tile of one token: 10-50% of that row's norm at these widths)
    # hardly move the whole output's L2, but they do move their row's. (An emulation of a reduced-precision tensor-core
    # accumulation put the worst row at 1.05-1.2x the whole output's error: 3x leaves margin.)
    got, want = out[mask].float(), ref[mask]
    norms = torch.linalg.norm(want.double(), dim=1)
    zero = norms == 0
    assert bool((got[zero] == 0).all()), "rows whose reference is zero are not zero"
    per_row = torch.linalg.norm(got[~zero].double() - want[~zero].double(), dim=1) / norms[~zero]
    assert per_row.numel() == 0 or per_row.max().item() < 3 * bound, \
        f"worst rows' relative L2 {per_row.topk(min(3, per_row.numel())).values.tolist()}"
    again = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    assert torch.equal(out.view(torch.uint8), again.view(torch.uint8)), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_leaves_other_rows_untouched(out_dtype):
    """A preallocated output filled with a sentinel: rows outside every expert's segment keep it, rows inside are the
    zero-filled call's."""
    x, off, cnt, packed, ref, mask = _fp8_case((5, 256, 512), True, 16, seed=55)
    sentinel = torch.full((x.num_rows, packed.out_features), 7.0, dtype=out_dtype, device="cuda")
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, impl="cuda", out=sentinel)
    plain = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, impl="cuda")
    assert bool((out[~mask] == 7.0).all())
    assert torch.equal(out[mask].view(torch.uint8), plain[mask].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile, tail_tile", [(None, None), (16, None), (32, None), (64, None), (128, None),
                                                   (128, 0), (128, 16), (64, 32)])
@pytest.mark.parametrize("shape", [(5, 256, 512), (2, 1024, 7168)])
def test_fp8_kernel_combine_row_epilogue_matches_bf16_output_then_s2f6(shape, token_tile, tail_tile):
    """The FP8 mode's combine-row epilogue (MoELayer's w2 with combine rows) against its bf16 epilogue followed by
    the S2F6 quantizer: the same tiles and k order, so every valid row's codes and scales bitwise, at its (rank,
    token, slot) row of the target; every other byte untouched."""
    from test_grouped_gemm import check_combine_rows_match_bf16_then_s2f6
    x, off, cnt, packed, _, mask = _fp8_case(shape, False, 16, seed=shape[2] + 5)
    check_combine_rows_match_bf16_then_s2f6(x, off, cnt, packed, mask, token_tile, tail_tile, seed=shape[1] + 9)


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile", [None, 16, 128])
def test_fp8_kernel_combine_row_epilogue_special_rows(token_tile):
    """The FP8 mode's combine-row epilogue on NaN, zero, +-Inf, overflowing and subnormal rows (row factors of
    test_grouped_gemm.SPECIAL_ROW_FACTORS): bitwise its bf16 epilogue followed by the S2F6 quantizer."""
    from test_grouped_gemm import (assert_special_rows_reached, check_combine_rows_match_bf16_then_s2f6,
                                   with_special_row_factors)
    x, off, cnt, packed, _, mask = _fp8_case((5, 256, 512), False, 16, seed=517)
    special, rows = with_special_row_factors(x, mask)
    assert_special_rows_reached(special, off, cnt, packed, rows, token_tile)
    check_combine_rows_match_bf16_then_s2f6(special, off, cnt, packed, mask, token_tile, None, seed=33)


@pytest.mark.gpu
def test_fp8_kernel_swiglu_row_amax():
    """w1's fused per-row amax (row_amax, moe's amax_in_w1) in the FP8 mode: the max |h| of what the rows stored, as
    in the exact mode; rows outside every segment keep their 0."""
    x, off, cnt, packed, _, mask = _fp8_case((3, 192, 256), True, 16, seed=61)
    row_amax = torch.zeros(x.num_rows, dtype=torch.float32, device="cuda")
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="cuda", row_amax=row_amax)
    want = out.abs().nan_to_num(0.0).amax(-1)
    assert int((want[mask] > 0).sum()) > mask.sum() // 2  # (random_activations holds some all-zero rows)
    assert torch.equal(row_amax[mask], want[mask]) and bool((row_amax[~mask] == 0).all())


@pytest.mark.gpu
def test_fp8_combine_rows_need_k_multiple_of_128():
    """The FP8 kernels take whole 128-wide stages: K = 192 rows in the FP8 form are refused by the combine-row entry
    point as by the plain one, before anything runs."""
    from test_grouped_gemm import _local_combine_target
    w = random_weights(2, 64, 192, seed=13, device="cuda")
    packed = G.pack_gemm_weights(w, swiglu=False)
    x = G.expand_nvfp4_rows(random_activations(8, 192, seed=14, device="cuda"), precision=FP8)
    off = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
    cnt = torch.tensor([4, 4], dtype=torch.int32, device="cuda")
    target, _, _, _ = _local_combine_target(torch.ones(8, dtype=torch.bool, device="cuda"), num_ranks=1, topk=1,
                                            hidden=64, seed=1)
    with pytest.raises(ValueError, match="K % 128"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target)
    with pytest.raises(ValueError, match="K % 128"):
        G.grouped_gemm_nvfp4(x, off, cnt, packed, impl="cuda")


@pytest.mark.cpu
def test_fp8_rows_must_say_what_they_are():
    """E4M3 values made some other way (natural column order, no factor 8) would give wrong results: ExpandedRows
    carries its precision, and the GEMM refuses values whose dtype does not match it."""
    w = random_weights(2, 64, 128, seed=7)
    packed = G.pack_gemm_weights(w, swiglu=False)
    q = random_activations(8, 128, seed=8)
    exact, fp8 = G.expand_nvfp4_rows(q), G.expand_nvfp4_rows(q, precision=FP8)
    off = torch.tensor([0, 4, 8], dtype=torch.int32)
    cnt = torch.tensor([4, 4], dtype=torch.int32)
    for bad in (G.ExpandedRows(exact.values.to(torch.float8_e4m3fn), exact.row_factor),
                G.ExpandedRows(exact.values, exact.row_factor, precision=FP8),
                G.ExpandedRows(fp8.values, fp8.row_factor, precision="fp8")):
        with pytest.raises(ValueError, match="does not match"):
            G.grouped_gemm_nvfp4(bad, off, cnt, packed, impl="reference")
    G.grouped_gemm_nvfp4(fp8, off, cnt, packed, impl="reference")  # the control


@pytest.mark.gpu
@pytest.mark.parametrize("tail_tile", [16, 32, 64])
@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_kernel_small_remainders_in_a_second_launch(swiglu, tail_tile):
    """Token tile 128 with the remainders in a second launch: bitwise the single launch (same k order per element)."""
    x, off, cnt, packed, ref, mask = _fp8_case((5, 256, 512), swiglu, 16, seed=77)
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, token_tile=128, tail_tile=tail_tile,
                               impl="cuda")
    single = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, token_tile=128, tail_tile=0,
                                  impl="cuda")
    assert torch.equal(out.view(torch.int32), single.view(torch.int32))
    assert _relative_l2(out[mask], ref[mask]) < FP8_KERNEL_TOLERANCE


@pytest.mark.gpu
def test_fp8_kernel_error_against_the_exact_kernel():
    """The mode's cost at DeepSeek-V3's w1 shape on one expert: FP8 against the exact kernel (fp32 out), on the block
    scales of real weights. The same bound as the CPU tier's reference comparison."""
    experts, n, k = 1, 1024, 7168
    w = random_weights(experts, n, k, seed=91, device="cuda", scale_low=0x60, scale_high=0x7F)
    packed = G.pack_gemm_weights(w, swiglu=True)
    q = random_activations(128, k, seed=92, device="cuda")
    off = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    cnt = torch.tensor([128], dtype=torch.int32, device="cuda")
    exact = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q), off, cnt, packed, out_dtype=torch.float32, impl="cuda")
    fp8 = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q, precision=FP8), off, cnt, packed, out_dtype=torch.float32,
                               impl="cuda")
    error = _relative_l2(fp8, exact)
    print(f"fp8 vs exact kernel, w1 shape, 128 rows: relative L2 {error:.3e}")
    assert 0 < error < 0.06, error


@pytest.mark.gpu
@pytest.mark.parametrize("k", [128, 2048, 7168, 112])
def test_fp8_expansion_kernel_is_the_reference(k):
    """nvfp4_expand_fp8 (CUDA) gives the reference's bits, on random rows and the format edge rows (zeros, tiny,
    outliers; NVFP4 codes cannot hold NaN); with a device row limit it leaves the rows past it unwritten."""
    from format_cases import edge_rows
    x = torch.cat([torch.randn(61, k, generator=torch.Generator().manual_seed(k)) * 3, edge_rows(k)]).cuda()
    q = F.nvfp4_quantize(torch.nan_to_num(x, nan=0.0, posinf=1e4, neginf=-1e4), four_over_six=True)
    ref = G.expand_nvfp4_rows(q, impl="reference", precision=FP8)
    got = G.expand_nvfp4_rows(q, impl="cuda", precision=FP8)
    assert torch.equal(got.values.view(torch.uint8), ref.values.view(torch.uint8))
    assert torch.equal(got.row_factor, ref.row_factor)
    limit = torch.tensor([20], dtype=torch.int32, device="cuda")
    part = G.expand_nvfp4_rows(q, impl="cuda", precision=FP8, num_rows_limit=limit)
    assert torch.equal(part.values[:20].view(torch.uint8), ref.values[:20].view(torch.uint8))
    # The kernel itself on a poisoned output: rows at or past the limit keep the poison.
    from ep_comm import _ext
    rows = q.data.shape[0]
    poisoned = torch.full((rows, k), 0x5A, dtype=torch.uint8, device="cuda")
    _ext._C.nvfp4_expand_fp8(q.data.data_ptr(), q.scales.view(torch.uint8).data_ptr(), rows, k,
                             poisoned.data_ptr(), _ext.current_raw_stream(poisoned.device), limit.data_ptr())
    assert torch.equal(poisoned[:20], ref.values[:20].view(torch.uint8))
    assert bool((poisoned[20:] == 0x5A).all()), "a row at or past the limit was written"


@pytest.mark.gpu
def test_fp8_fused_expert_mlp():
    """moe.fused_expert_mlp(precision="fp8_inexact") against the same steps on the reference paths (FP8 rows, w1,
    NVFP4 4/6 of its rows, FP8 rows, w2): close (the kernel's accumulation can move some NVFP4 roundings of the w2
    input), and against the exact fused MLP within the mode's error (measured 9.2%)."""
    from ep_comm import moe
    experts, hidden, inter = 3, 256, 128
    counts = [40, 0, 70]
    offsets, rows = segments(counts, 16)
    w1 = G.pack_gemm_weights(random_weights(experts, 2 * inter, hidden, seed=31, device="cuda", scale_low=0x60,
                                            scale_high=0x7F), swiglu=True)
    w2 = G.pack_gemm_weights(random_weights(experts, hidden, inter, seed=32, device="cuda", scale_low=0x60,
                                            scale_high=0x7F), swiglu=False)
    tokens = random_activations(rows, hidden, seed=33, device="cuda")
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    mask = valid_mask(offsets, counts, rows).cuda()
    got = moe.fused_expert_mlp(tokens, off, cnt, w1, w2, precision=FP8)
    h = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(tokens, impl="reference", precision=FP8), off, cnt, w1,
                             out_dtype=torch.float32, impl="reference")
    q = F.nvfp4_quantize(h, four_over_six=True, impl="reference")
    ref = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q, impl="reference", precision=FP8), off, cnt, w2,
                               impl="reference")
    error = _relative_l2(got[mask].float(), ref[mask].float())
    print(f"fp8 fused MLP against the reference steps: relative L2 {error:.3e}")
    assert error < 5e-2, error  # measured 1.2e-2; the bound and why: tests/test_moe.py check_moe_fp8_result
    exact = moe.fused_expert_mlp(tokens, off, cnt, w1, w2)
    assert _relative_l2(got[mask].float(), exact[mask].float()) < 0.15  # measured 9.2% (see the CPU tier's MLP test)
    with pytest.raises(ValueError, match="precision"):
        moe.fused_expert_mlp(tokens, off, cnt, w1, w2, precision="fp8")


# ----------------------------------------------------------------------------------------------------------
# The quantizer's FP8 operand form (the fused w2-input requantization of the FP8 mode)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_fp8_quantize_expanded_rows_reference():
    """quantize_expanded_rows(precision="fp8_inexact") is the FP8 operand form of nvfp4_quantize(x) bit for bit (with
    and without a given amax): E4M3 (RNE) of each block value times 2^-3, stored in FP8_COLUMN_ORDER, and 8x the
    exact row factor -- built here from the format's definition, not by expand_nvfp4_rows (on CPU the path under
    test). A bad precision name is refused."""
    from test_grouped_gemm import _expanded_by_hand, hidden_rows_with_edges
    x = hidden_rows_with_edges(20, 64, seed=4)
    amax = x.abs().nan_to_num(0.0).amax(-1) * 1.5
    for given in (None, amax):
        got = G.quantize_expanded_rows(x, amax=given, precision=FP8)
        values, factor = _expanded_by_hand(F.nvfp4_quantize(x, four_over_six=True, amax=given, impl="reference"))
        assert got.precision == FP8 and got.values.dtype == torch.float8_e4m3fn
        want = (values * 0.125).float().to(torch.float8_e4m3fn)  # (block values are exact in FP32; one rounding)
        stored_at = 16 * torch.arange(x.shape[1] // 16)[:, None] + torch.tensor(G.FP8_COLUMN_ORDER)  # [groups, 16]
        assert torch.equal(got.values.view(torch.uint8), want.view(torch.uint8)[:, stored_at.flatten()])
        assert torch.equal(got.row_factor, factor * 8.0)
    with pytest.raises(ValueError, match="precision"):
        G.quantize_expanded_rows(x, precision="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [128, 2048, 7168, 112])
def test_fp8_quantize_expanded_rows_cuda_bitwise(dtype, k):
    """The 4/6 quantizer writing the FP8 mode's w2 operand rows directly (one kernel): bitwise the CUDA quantizer +
    the CUDA FP8 expansion and the torch reference, on fresh random rows with the edge rows, with and without a given
    amax; with a device row limit the rows past it keep their poison."""
    from ep_comm import _cuda_formats
    from test_grouped_gemm import hidden_rows_with_edges
    x = hidden_rows_with_edges(301, k, seed=k + 11, device="cuda", dtype=dtype)
    amax = x.float().abs().nan_to_num(0.0, posinf=float("inf")).amax(-1)
    amax[20] = amax[20] * 0.5  # a given amax below the row max: saturated values, the same in every path
    for given in (None, amax):
        got = G.quantize_expanded_rows(x, amax=given, impl="cuda", precision=FP8)
        two_kernels = G.expand_nvfp4_rows(_cuda_formats.nvfp4_quantize(x, four_over_six=True, amax=given),
                                          impl="cuda", precision=FP8)
        reference = G.quantize_expanded_rows(x, amax=given, impl="reference", precision=FP8)
        for want in (two_kernels, reference):
            assert got.precision == want.precision == FP8
            assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
            assert torch.equal(got.row_factor.view(torch.int32), want.row_factor.view(torch.int32))
    limit = torch.tensor([123], dtype=torch.int32, device="cuda")
    values = torch.full((301, k), 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    factor = torch.full((301,), 7.0, device="cuda")
    _cuda_formats._launch_nvfp4_quantize(x, True, None, limit, block_values=values, row_factor=factor,
                                         block_values_fp8=True)
    whole = G.quantize_expanded_rows(x, impl="cuda", precision=FP8)
    assert torch.equal(values[:123].view(torch.uint8), whole.values[:123].view(torch.uint8))
    assert torch.equal(factor[:123], whole.row_factor[:123])
    assert bool((values[123:].view(torch.uint8) == 0x5A).all()) and bool((factor[123:] == 7.0).all())
