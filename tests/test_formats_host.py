"""CPU emulation of the CUDA format kernels (csrc/quant_math.cuh run on host memory) vs the torch reference.

The kernels' bit manipulation is the same code as the `host_*` entry points of `ep_comm._C`, so this tier
proves it bit for bit without a GPU. Skips only when `ep_comm._C` cannot be imported (the reason says why).
"""
import math
import os

import pytest
import torch

import ep_comm
from ep_comm import formats as F

pytestmark = pytest.mark.cpu

if not ep_comm.cuda_extension_available():
    pytest.skip(f"ep_comm._C unavailable: {ep_comm.cuda_extension_error()}", allow_module_level=True)

from ep_comm import _cuda_formats as C  # noqa: E402  (needs the extension)
from format_cases import (  # noqa: E402
    adversarial_four_over_six_blocks, four_over_six_amax_cases, as_bytes, e4m3_tie_points, edge_rows,
    random_bit_floats, make_rows, special_floats, assert_same_bytes,
    sr_fast_path_limit_blocks, assert_same_floats, assert_same_mx, assert_same_nvfp4)

HIDDEN_SIZES = (2048, 4096, 7168)
SIGN_MASKS = (F.DEFAULT_SIGN_MASK, 0, 0xFFFFFFFF, 0xD7E8)


# ----------------------------------------------------------------------------------------------------------
# Element primitives
# ----------------------------------------------------------------------------------------------------------
def test_element_encoders_match_reference():
    x = torch.cat([random_bit_floats(1 << 20, 1), special_floats(), e4m3_tie_points(),
                   torch.linspace(-8, 8, 20001)])
    assert_same_bytes(C.host_e2m1_encode(x), F.e2m1_encode(x), "e2m1")
    assert_same_bytes(C.host_e4m3_encode(x), F.e4m3_encode(x), "e4m3")
    a = x.abs()
    assert_same_bytes(C.host_ue8m0_mxfp8_scale(a), F.ue8m0_mxfp8_scale(a), "ue8m0 mxfp8")
    finite_or_inf = a[~torch.isnan(a)]
    assert_same_bytes(C.host_ue8m0_s2f6_scale(finite_or_inf), F.ue8m0_s2f6_scale(finite_or_inf), "ue8m0 s2f6")
    not_nan = x[~torch.isnan(x)]
    assert torch.equal(C.host_bf16_round(not_nan), not_nan.to(torch.bfloat16).view(torch.int16)), "bf16 RNE"


def test_rbits_and_stochastic_e4m3_match_reference():
    g = torch.Generator().manual_seed(3)
    index = torch.cat([torch.arange(0, 4096), torch.randint(0, 2**40, (4096,), generator=g),
                       torch.tensor([2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1]),
                       torch.tensor([-1, -2, -3, -2**32, -2**63]),  # as unsigned 64-bit values, in both
                       -torch.randint(1, 2**62, (512,), generator=g)])
    for seed in (0, 1, 12345, 2**32 + 7, 2**63 + 5):
        assert torch.equal(C.host_rbits(seed, index), F.rbits(seed, index)), f"rbits seed {seed}"
    x = torch.cat([random_bit_floats(1 << 18, 4), special_floats(), e4m3_tie_points(),
                   torch.randn(1 << 16, generator=torch.Generator().manual_seed(55)) * 100])
    random_bits = F.rbits(99, torch.arange(x.numel()))
    assert_same_bytes(C.host_sr_e4m3(x, random_bits), F._e4m3_stochastic(x, random_bits), "SR e4m3")


@pytest.mark.parametrize("check", ["e2m1_magnitude", "markstein_1536", "markstein_2688", "sr_e4m3", "s2f6_fast",
                                   "div_six", "outer_scales", "no_contraction"])
def test_fast_forms_match_their_definitions(check):
    """The division-free / conversion-free forms the kernels use, over fp32 bit patterns (EP_COMM_EXHAUSTIVE=1:
    all of them -- the non-negative 2^31, or all 2^32 for s2f6_fast -- a few minutes each; default: every
    251st / 1021st pattern, a few seconds; s2f6_fast adds zeros, infinities, NaNs, the extremes and every value
    whose RHT-scaled form is subnormal, ~40 s). "no_contraction" is a probe, not a fast form: the host emulation was
    compiled without FMA contraction (f(a * a) - f(a * a) is 0 for every a in [1, 2))."""
    stride = 1 if os.environ.get("EP_COMM_EXHAUSTIVE") == "1" else (1021 if check == "sr_e4m3" else 251)
    assert ep_comm._ext._C.host_exhaustive_check(check, stride) == 0


# ----------------------------------------------------------------------------------------------------------
# Test vectors (FORMATS-RESEARCH.md §14) through the emulated kernels
# ----------------------------------------------------------------------------------------------------------
def test_nvfp4_vectors():
    x = torch.tensor([[-54, 5.4, 0, 1, -1, 2.2, 3.3, 12, -13.5, 27, 40, -0.9, 0.5, 7.7, -20, 0.01]])
    q = C.host_nvfp4_quantize(x, four_over_six=False, amax=torch.tensor(2688.0))
    assert as_bytes(q.scales).tolist() == [[0x51]]
    assert as_bytes(q.data).tolist() == [[0x1F, 0x00, 0x08, 0x31, 0x5B, 0x86, 0x20, 0x0C]]
    x2 = torch.tensor([[0.3125, -1.7, 0.05, 2.9, -0.61, 0, 1.1, -3.3, 0.22, 0.9, -0.15, 1.45, -2.2, 0.7, 0.33,
                        -0.04]])
    q = C.host_nvfp4_quantize(x2, four_over_six=False, amax=torch.tensor(10.0))
    assert as_bytes(q.scales).tolist() == [[0x71]]
    assert as_bytes(q.data).tolist() == [[0xD1, 0x70, 0x0A, 0xF4, 0x31, 0x59, 0x3E, 0x81]]
    bf16 = C.host_nvfp4_dequantize(q).to(torch.bfloat16).view(torch.int16)[0, :8].to(torch.int32) & 0xFFFF
    assert bf16.tolist() == [0x3E89, 0xBFCE, 0x0000, 0x404E, 0xBF09, 0x0000, 0x3F89, 0xC04E]


@pytest.mark.parametrize("block, scale, packed", [
    ([10, 9, 8.5, 7.5, 5, -2.5, 1.25, 0, -10, 3, 2, -1, 0.6, 6.2, -4.4, 0.3], 0x3D,
     [0x77, 0x67, 0xB5, 0x02, 0x4F, 0x92, 0x61, 0x0D]),
    ([10, 8, 7.6, -8.4, 5, 2.5, -7.5, 9, 1, 0, -5, 7.5, 2, 0.5, -9.5, 4], 0x42,
     [0x56, 0xD5, 0x24, 0x6D, 0x01, 0x5C, 0x02, 0x3E]),
    ([10, 2.9, 1.6, 0.9, 0.45, -0.2, 3.1, -1.4, 0, 5.2, -0.7, 1.1, 0.35, -2.6, 0.8, 0.05], 0x3D,
     [0x47, 0x12, 0x81, 0xA4, 0x50, 0x19, 0xB0, 0x01]),
])
def test_four_over_six_vectors(block, scale, packed):
    q = C.host_nvfp4_quantize(torch.tensor([block]), four_over_six=True, amax=torch.tensor(1536.0))
    assert as_bytes(q.scales).tolist() == [[scale]]
    assert as_bytes(q.data).tolist() == [packed]


@pytest.mark.parametrize("c, nv_scale", [(500.0, 0x80), (300.0, 0x7F), (0.0035, 0x6F)])
def test_mxfp8_vectors(c, nv_scale):
    v = torch.tensor([[(i - 15.5) / 15.5 * c for i in range(32)]], dtype=torch.float64).float()
    m = C.host_mxfp8_quantize(v)
    assert as_bytes(m.scales).tolist() == [[nv_scale]]
    assert_same_mx(m, F.mxfp8_quantize(v), "mxfp8 vector")


def test_rht_vectors():
    x = torch.arange(32, dtype=torch.float32)[None]
    y = C.host_rht(x, 0)
    expected = torch.zeros(32)
    expected[[0, 1, 2, 4, 8, 16]] = torch.tensor([496.0, -16, -32, -64, -128, -256]) * F._f32(1 / math.sqrt(32), "cpu")
    assert torch.equal(y[0], expected)


# ----------------------------------------------------------------------------------------------------------
# Whole tensors: random data, every kernel, vs the reference
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_quantize_matches_reference(hidden, four_over_six):
    for kind, num_rows in (("gauss", 7), ("outliers", 5), ("wide", 3), ("tiny", 2), ("huge", 2), ("bits", 3)):
        x = make_rows(kind, num_rows, hidden, seed=hidden + num_rows)
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
        actual = C.host_nvfp4_quantize(x, four_over_six)
        assert_same_nvfp4(actual, expected, f"nvfp4 {kind}")
        assert_same_floats(C.host_nvfp4_dequantize(actual), F.nvfp4_dequantize(expected, impl="reference"),
                           f"nvfp4 dequantize {kind}")


def _reference_four_over_six_errors(x: torch.Tensor, amax: torch.Tensor, e4m3_max: float):
    """err_6 / err_4 per block, written with the reference's own helpers (docs/NUMERICS.md, 4/6)."""
    xb = x.float().reshape(x.shape[0], -1, 16)
    s_enc, s_dec = F._nvfp4_outer_scales(amax, e4m3_max)
    base = (F._nan_to_zero_abs(xb).amax(dim=-1) / F._f32(6.0, "cpu")) * s_enc[:, None]
    cap = F._f32(448.0, "cpu")
    errors = []
    for scale in (F.e4m3_encode(torch.minimum(base, cap)), F.e4m3_encode(torch.minimum(base * F._f32(1.5, "cpu"), cap))):
        codes = F._nvfp4_encode_with_scale(xb, scale, s_dec)
        decoded = ((F.e2m1_decode(codes) * F.e4m3_decode(scale)[..., None]) * amax[:, None, None]) / F._f32(
            6.0 * e4m3_max, "cpu")
        diff = decoded - xb
        errors.append(F._tree_sum_last(diff * diff))
    return errors


@pytest.mark.parametrize("e4m3_max", [256.0, 448.0])
def test_four_over_six_errors_bitwise(e4m3_max):
    """The selection arithmetic itself (the quantized output rarely shows a 1-ulp slip in an error)."""
    x = torch.cat([make_rows("gauss", 8, 2048, seed=21), make_rows("wide", 8, 2048, seed=22), make_rows("tiny", 2, 2048, seed=23),
                   make_rows("huge", 2, 2048, seed=24), edge_rows(2048)])
    row_amax = F._nan_to_zero_abs(x).amax(dim=-1)
    row_amax = torch.cat([row_amax[:-4], torch.tensor([1e-30, 1e-38, 3e38, 0.0])])  # slow-division and zero cases
    actual6, actual4 = C.host_nvfp4_four_over_six_errors(x, row_amax, e4m3_max)
    expected6, expected4 = _reference_four_over_six_errors(x, row_amax, e4m3_max)
    assert_same_floats(actual6, expected6, "err_6")
    assert_same_floats(actual4, expected4, "err_4")


@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_given_amax_matches_reference(four_over_six):
    x = make_rows("outliers", 9, 2048, seed=11)
    per_row = x.abs().amax(dim=-1) * torch.linspace(0.5, 2.0, 9)  # stale / over-estimated amaxes included
    for amax in (per_row, torch.tensor(3.0), torch.tensor(0.0), torch.tensor(math.inf), torch.tensor(1e-30)):
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, amax=amax, impl="reference")
        actual = C.host_nvfp4_quantize(x, four_over_six, amax=amax)
        assert_same_nvfp4(actual, expected, f"nvfp4 amax={amax.flatten()[:1].tolist()}")
    expected = F.nvfp4_quantize(x, four_over_six=four_over_six, scale_granularity="tensor", impl="reference")
    actual = C.host_nvfp4_quantize(x, four_over_six, amax=expected.amax)
    assert_same_nvfp4(actual, expected, "nvfp4 tensor amax")


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_mxfp8_quantize_matches_reference(hidden):
    for kind in ("gauss", "outliers", "wide", "tiny", "huge"):
        x = make_rows(kind, 5, hidden, seed=hidden + 1)
        for rounding, seed in (("nearest", 0), ("stochastic", 0), ("stochastic", 2**40 + 3)):
            expected = F.mxfp8_quantize(x, rounding=rounding, seed=seed, impl="reference")
            actual = C.host_mxfp8_quantize(x, rounding, seed)
            assert_same_mx(actual, expected, f"mxfp8 {kind} {rounding}")
        assert_same_floats(C.host_mxfp8_dequantize(actual), F.mxfp8_dequantize(expected, impl="reference"),
                           f"mxfp8 dequantize {kind}")


def test_mxfp8_dequantize_of_no_rows_matches_reference():
    """The [K, 0] MXFP8 of a requantization of 0 rows: an empty [K, 0] fp32 from the host emulation, as from the
    reference."""
    m = C.host_nvfp4_to_mxfp8_transposed(F.nvfp4_quantize(torch.randn(0, 48), impl="reference"), "stochastic", 5)
    assert tuple(m.data.shape) == (48, 0)
    assert_same_floats(C.host_mxfp8_dequantize(m), F.mxfp8_dequantize(m, impl="reference"), "mxfp8 [K, 0]")


@pytest.mark.parametrize("num_rows, hidden", [(32, 48), (96, 2048), (64, 7168)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_to_mxfp8_transposed_matches_reference(num_rows, hidden, rounding):
    q = F.nvfp4_quantize(make_rows("outliers", num_rows, hidden, seed=num_rows), impl="reference")
    expected = F.nvfp4_to_mxfp8_transposed(q, rounding=rounding, seed=5, impl="reference")
    assert_same_mx(C.host_nvfp4_to_mxfp8_transposed(q, rounding, 5), expected, "nvfp4->mxfp8^T")


@pytest.mark.parametrize("sign_mask", SIGN_MASKS)
def test_rht_matches_reference(sign_mask):
    x = torch.cat([make_rows("gauss", 4, 4096, seed=2), make_rows("wide", 2, 4096, seed=3)])
    assert_same_floats(C.host_rht(x, sign_mask), F.rht(x, sign_mask), "rht")
    assert_same_floats(C.host_rht(x, sign_mask, inverse=True), F.inverse_rht(x, sign_mask), "inverse rht")


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("hadamard", [True, False])
def test_s2f6_quantize_matches_reference(hidden, hadamard):
    for kind in ("gauss", "outliers", "wide", "tiny", "huge"):
        x = make_rows(kind, 5, hidden, seed=hidden + 2)
        expected = F.s2f6_quantize(x, hadamard=hadamard, impl="reference")
        actual = C.host_s2f6_quantize(x, hadamard)
        assert_same_mx(actual, expected, f"s2f6 {kind}")
        assert_same_floats(C.host_s2f6_dequantize(actual), F.s2f6_dequantize(expected, impl="reference"),
                           f"s2f6 dequantize {kind}")


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("num_terms", [1, 3, 8])
@pytest.mark.parametrize("weighted", [True, False])
def test_s2f6_dequantize_accumulate_matches_reference(hadamard, num_terms, weighted):
    g = torch.Generator().manual_seed(num_terms)
    s = F.s2f6_quantize(make_rows("outliers", 40, 2048, seed=9), hadamard=hadamard, sign_mask=0x1234ABCD,
                        impl="reference")
    index = torch.randint(-1, 40, (23, num_terms), generator=g)
    index[0] = -1  # a row with nothing to add
    weights = torch.rand(23, num_terms, generator=g) if weighted else None
    for out_dtype in (torch.bfloat16, torch.float32):
        expected = F.s2f6_dequantize_accumulate(s, index, weights, out_dtype=out_dtype, impl="reference")
        actual = C.host_s2f6_dequantize_accumulate(s, index, weights, out_dtype=out_dtype)
        assert_same_floats(actual, expected, f"accumulate {out_dtype}")


# ----------------------------------------------------------------------------------------------------------
# Edge rows: zero, subnormal, outlier, NaN (both signs), +-Inf, huge, -0
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [64, 2048])
def test_edge_rows_match_reference(hidden):
    x = edge_rows(hidden)
    for four_over_six in (True, False):
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
        actual = C.host_nvfp4_quantize(x, four_over_six)
        assert_same_nvfp4(actual, expected, f"nvfp4 edge 4/6={four_over_six}")
        assert_same_floats(C.host_nvfp4_dequantize(actual), F.nvfp4_dequantize(expected, impl="reference"),
                           "nvfp4 dequantize edge")
    for rounding in ("nearest", "stochastic"):
        expected = F.mxfp8_quantize(x, rounding=rounding, seed=1, impl="reference")
        assert_same_mx(C.host_mxfp8_quantize(x, rounding, 1), expected, f"mxfp8 edge {rounding}")
        assert_same_floats(C.host_mxfp8_dequantize(expected), F.mxfp8_dequantize(expected, impl="reference"),
                           "mxfp8 dequantize edge")
    for hadamard in (True, False):
        expected = F.s2f6_quantize(x, hadamard=hadamard, impl="reference")
        assert_same_mx(C.host_s2f6_quantize(x, hadamard), expected, f"s2f6 edge hadamard={hadamard}")
        assert_same_floats(C.host_s2f6_dequantize(expected), F.s2f6_dequantize(expected, impl="reference"),
                           "s2f6 dequantize edge")
    q = F.nvfp4_quantize(x[:, :hidden], impl="reference")
    padded = F.NVFP4Tensor(torch.cat([q.data] * 3)[:32], torch.cat([q.scales] * 3)[:32],
                           torch.cat([q.amax] * 3)[:32], q.e4m3_max)
    assert_same_mx(C.host_nvfp4_to_mxfp8_transposed(padded, "stochastic", 3),
                   F.nvfp4_to_mxfp8_transposed(padded, seed=3, impl="reference"), "transposed edge")


def test_mxfp8_stochastic_fast_path_limits_match_reference():
    x = sr_fast_path_limit_blocks()
    for seed in (0, 1, 2**40 + 3, 12345):
        expected = F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="reference")
        assert_same_mx(C.host_mxfp8_quantize(x, "stochastic", seed), expected, f"mxfp8 SR limits seed {seed}")
    scales = F.mxfp8_quantize(x).scales.view(torch.uint8)[:, 0].tolist()
    assert scales[:2] == [156, 157], scales  # the rows really sit on both sides of the fast form's limit


def test_bf16_and_fp16_inputs_match_reference():
    x = make_rows("outliers", 6, 2048, seed=4)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert_same_nvfp4(C.host_nvfp4_quantize(xd), F.nvfp4_quantize(xd, impl="reference"), f"nvfp4 {dtype}")
        assert_same_mx(C.host_mxfp8_quantize(xd, "stochastic", 8),
                       F.mxfp8_quantize(xd, rounding="stochastic", seed=8, impl="reference"), f"mxfp8 {dtype}")
        assert_same_mx(C.host_s2f6_quantize(xd), F.s2f6_quantize(xd, impl="reference"), f"s2f6 {dtype}")


# ----------------------------------------------------------------------------------------------------------
# 4/6 selection: the fast path (approximate errors with a proven bound, exact fallback) against the NUMERICS
# formula on adversarial blocks
# ----------------------------------------------------------------------------------------------------------
def test_four_over_six_fast_path_matches_formula():
    g = torch.Generator().manual_seed(46)
    x = adversarial_four_over_six_blocks(g)
    ties = near = 0
    for amax in four_over_six_amax_cases(x, g):
        expected = F.nvfp4_quantize(x, four_over_six=True, amax=amax, impl="reference")
        actual = C.host_nvfp4_quantize(x, True, amax=amax)
        assert_same_nvfp4(actual, expected, "4/6 adversarial")
        err6, err4 = C.host_nvfp4_four_over_six_errors(x, amax, 256.0)
        finite = torch.isfinite(err6) & torch.isfinite(err4) & (err6 > 0)
        ties += int(((err4 == err6) & finite).sum())
        near += int((((err4 - err6).abs() < 1e-3 * err6) & (err4 != err6) & finite).sum())
    # The data must exercise the exact fallback: exact ties and near-ties that no bound can decide.
    assert ties > 100 and near > 10, (ties, near)


def test_four_over_six_exact_tie_test_proves_equal_errors():
    """The fast 4/6 path's exact-tie step (qm::nvfp4_four_six_block16_fast, step (3)): wherever it decides a block as
    a tie, the exact formula's two errors are the same bits (so map-6 is its choice too), on adversarial blocks, edge
    rows and random special bits; it finds ties where they are common (outlier channels) and none in Gaussian rows,
    where the candidates decode differently; and the quantizer's codes there are the reference's."""
    g = torch.Generator().manual_seed(61)
    x = adversarial_four_over_six_blocks(g)
    inputs = [(x, amax) for amax in four_over_six_amax_cases(x, g)]
    for kind, hidden in (("outlier_columns", 7168), ("outliers", 2048), ("bits", 2048), ("gauss", 2048)):
        rows = make_rows(kind, 16, hidden, seed=62)
        inputs.append((rows, rows.abs().nan_to_num(nan=0.0).amax(dim=1)))
    edges = edge_rows(2048)
    inputs.append((edges, edges.abs().nan_to_num(nan=0.0).amax(dim=1)))
    claimed = {}
    for i, (rows, amax) in enumerate(inputs):
        tie = C.host_nvfp4_four_six_exact_ties(rows, amax)
        err6, err4 = C.host_nvfp4_four_over_six_errors(rows, amax, 256.0)
        same_bits = err6.view(torch.int32) == err4.view(torch.int32)
        assert same_bits[tie].all(), f"input {i}: a claimed tie whose errors differ"
        claimed[i] = int(tie.sum())
    num_adversarial = len(inputs) - 5
    assert sum(claimed[i] for i in range(num_adversarial)) > 50, claimed
    outlier_columns, gauss = num_adversarial, num_adversarial + 3
    assert claimed[outlier_columns] > 16 and claimed[gauss] == 0, claimed
    rows, amax = inputs[outlier_columns]
    assert_same_nvfp4(C.host_nvfp4_quantize(rows, True, amax=amax),
                      F.nvfp4_quantize(rows, four_over_six=True, amax=amax, impl="reference"), "4/6 outlier columns")


def test_four_over_six_fast_path_exhaustive_small_blocks():
    """Every block of 16 values drawn from a small alphabet pattern: 4 distinct magnitudes in {0, .., 7} / 2
    placed by a fixed pattern, times powers of two, with the block's own amax and 3 larger ones."""
    mags = torch.arange(8, dtype=torch.float32) / 2
    combos = torch.cartesian_prod(mags, mags, mags, mags)                      # 4096 4-tuples
    pattern = torch.tensor([0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3, 3, 2, 1, 0])
    x = combos[:, pattern]
    x = torch.cat([x * s for s in (1.0, 2.0**-20, 2.0**20)])
    own = x.abs().amax(dim=-1)
    for amax in (own, own * 1.5, own * 7.3, own * 300.0):
        expected = F.nvfp4_quantize(x, four_over_six=True, amax=amax, impl="reference")
        assert_same_nvfp4(C.host_nvfp4_quantize(x, True, amax=amax), expected, "4/6 small alphabet")


@pytest.mark.parametrize("four_over_six", [True, False], ids=["4/6", "plain"])
def test_nvfp4_fast_path_decides_typical_blocks(four_over_six):
    """Speed guard: the fast paths must handle nearly every block of ordinary activations (the general forms cost
    ~1.5-3x more; a change that made them fall back everywhere would still pass every bitwise test)."""
    g = torch.Generator().manual_seed(47)
    gauss = torch.randn(64, 7168, generator=g).to(torch.bfloat16).float()
    heavy = (torch.randn(64, 7168, generator=g) * torch.exp(torch.randn(64, 7168, generator=g))).to(torch.bfloat16)
    for name, x in (("gauss", gauss), ("heavy-tailed", heavy.float())):
        amax = x.abs().amax(dim=1)
        decided = C.host_nvfp4_fast_decided(x, amax, four_over_six, 256.0)
        fraction = decided.float().mean().item()
        assert fraction > 0.995, f"{name}: the fast path decided only {fraction:.4%} of the blocks"
    if four_over_six:  # outlier channels: ~1% of the blocks are exact ties, which the fast path decides too
        x = make_rows("outlier_columns", 64, 7168, seed=48).to(torch.bfloat16).float()
        amax = x.abs().amax(dim=1)
        assert C.host_nvfp4_four_six_exact_ties(x, amax).float().mean() > 0.003, "the data holds no exact ties"
        fraction = C.host_nvfp4_fast_decided(x, amax, True, 256.0).float().mean().item()
        assert fraction > 0.998, f"outlier channels: the fast path decided only {fraction:.4%} of the blocks"
    # And it must not take the blocks it cannot: NaN / Inf elements and zero-scale blocks go to the general form.
    special = torch.zeros(3, 16)
    special[0, 3] = float("nan")
    special[1, 7] = float("inf")
    special[2, 0] = 1e-30  # with an outer amax of 1: the block's scale rounds to zero
    decided = C.host_nvfp4_fast_decided(special, torch.tensor([1.0, 1.0, 1.0]), four_over_six, 256.0)
    assert not decided.any(), decided


def test_host_emulation_refuses_what_its_loops_would_overrun():
    """The host entry points read every pointer on the host and loop over whole blocks: a non-CPU tensor anywhere,
    a K that is not whole blocks, a transposed input whose rows are not whole blocks of 32, or index / weight / random
    arrays shorter than the loops read are refused before the call (they used to crash or run past the buffers)."""
    x = make_rows("outliers", 64, 64, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        C.host_s2f6_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        C.host_nvfp4_quantize(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="multiple of 32 rows"):
        C.host_nvfp4_to_mxfp8_transposed(C.host_nvfp4_quantize(x[:48]))
    with pytest.raises(ValueError, match="CPU tensors"):
        C.host_nvfp4_quantize(x.to("meta"))
    with pytest.raises(ValueError, match="CPU tensors; amax"):
        C.host_nvfp4_quantize(x, amax=torch.ones((), device="meta"))
    # The oracle checks rounding and seed as the public functions do: no misspelt rounding taken as nearest, no
    # negative or 65-bit seed taken modulo 2^64.
    q32 = C.host_nvfp4_quantize(x[:32])
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            C.host_mxfp8_quantize(x, "stochastic", seed)
        with pytest.raises(ValueError, match="seed"):
            C.host_nvfp4_to_mxfp8_transposed(q32, "stochastic", seed)
        with pytest.raises(ValueError, match="seed"):
            C.host_rbits(seed, torch.arange(4))
    with pytest.raises(ValueError, match="rounding"):
        C.host_mxfp8_quantize(x, "Stochastic", 1)
    with pytest.raises(ValueError, match="rounding"):
        C.host_nvfp4_to_mxfp8_transposed(q32, "sr", 1)
    s = C.host_s2f6_quantize(x)
    index = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="shape of row_index"):
        C.host_s2f6_dequantize_accumulate(s, index, torch.ones(3, 1))
    with pytest.raises(ValueError, match="one word per element"):
        C.host_sr_e4m3(torch.ones(8), torch.zeros(7, dtype=torch.int64))
    # and what they accept still matches the reference
    assert_same_floats(C.host_s2f6_dequantize_accumulate(s, index, torch.ones(3, 2)),
                       F.s2f6_dequantize_accumulate(F.s2f6_quantize(x, impl="reference"), index, torch.ones(3, 2),
                                                    impl="reference"), "accumulate")


def test_emulation_keeps_subnormals_when_the_thread_flushes_them():
    """The device never flushes subnormals; the emulation runs on the caller's thread, whose mode a program may set to
    flush (torch.set_flush_denormal(True): FTZ / DAZ). Each entry point keeps IEEE subnormals and restores the mode:
    an S2F6 code 64 at scale byte 0 (2^-127 * 64 / 64) still decodes to the subnormal 2^-127, and plain NVFP4 of
    subnormal inputs keeps its codes, as without flushing."""
    s = F.S2F6Tensor(data=torch.full((1, 32), 64, dtype=torch.int8),
                     scales=torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu), hadamard=False,
                     sign_mask=0x6A09E667)
    x, amax = torch.full((1, 16), 1e-39), torch.tensor([1e-39])  # made before flushing (conversions flush too)
    want_s2f6 = C.host_s2f6_dequantize(s)
    want_nvfp4 = C.host_nvfp4_quantize(x, four_over_six=False, amax=amax)
    assert want_s2f6.view(torch.int32)[0, 0].item() == 0x00400000  # 2^-127, subnormal
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals: nothing to keep")
    try:
        got_s2f6 = C.host_s2f6_dequantize(s)
        got_nvfp4 = C.host_nvfp4_quantize(x, four_over_six=False, amax=amax)
        assert (x * 1.0)[0, 0].item() == 0.0  # the thread flushes (torch's own arithmetic), the emulation does not
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got_s2f6.view(torch.int32), want_s2f6.view(torch.int32))
    assert torch.equal(got_nvfp4.data, want_nvfp4.data) and torch.equal(got_nvfp4.scales.view(torch.uint8),
                                                                          want_nvfp4.scales.view(torch.uint8))


def test_transposed_requantization_refuses_other_e4m3_bounds():
    """The device binding of the transposed requantization takes M = 256 or 448 only (its kernel's decode factor
    f(final_b * 64) is exact for those); checked before any pointer is used, so it runs without a GPU."""
    lib = ep_comm._ext._C
    for bound in (255.0, 300.0, 447.0, 1.0):
        with pytest.raises(ValueError, match="e4m3_max must be 256 or 448"):
            lib.nvfp4_to_mxfp8_transposed(0, 0, 0, 32, 16, bound, True, 0, 0, 0, 0)


def test_host_nvfp4_entry_points_refuse_a_null_amax():
    """The raw host bindings that read one amax per row refuse a null amax with a ValueError (the device launcher's
    null amax means "block values only"; a caller copying that convention here used to crash the process)."""
    data = torch.zeros(1, 8, dtype=torch.uint8)
    scales = torch.zeros(1, 1, dtype=torch.uint8)
    x = torch.zeros(1, 16)
    out = torch.empty(1, 16)
    lib = ep_comm._ext._C
    with pytest.raises(ValueError, match="amax is required"):
        lib.host_nvfp4_dequantize(data.data_ptr(), scales.data_ptr(), 0, 1, 16, 256.0, out.data_ptr())
    with pytest.raises(ValueError, match="amax is required"):
        lib.host_nvfp4_four_over_six_errors(x.data_ptr(), 1, 16, 0, 256.0, out.data_ptr(), out.data_ptr())
    decided = torch.empty(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="amax is required"):
        lib.host_nvfp4_fast_decided(x.data_ptr(), 1, 16, 0, 256.0, True, decided.data_ptr())
