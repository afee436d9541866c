"""CUDA format kernels vs the torch reference (run on CPU copies): bitwise equality for every kernel.

Marker `gpu`: skipped (with the reason) without a CUDA device or without `ep_comm._C` (tests/conftest.py).
"""
import math

import pytest
import torch

from ep_comm import formats as F
from format_cases import (adversarial_four_over_six_blocks, four_over_six_amax_cases, edge_rows, make_rows,
                          sr_fast_path_limit_blocks, assert_same_floats, assert_same_mx, assert_same_nvfp4,
                          tensor_fields)

pytestmark = pytest.mark.gpu

HIDDEN_SIZES = (2048, 4096, 7168)
ROW_COUNTS = (1, 7, 333)
DEVICE = "cuda"


def _cpu_nvfp4(q: F.NVFP4Tensor) -> F.NVFP4Tensor:
    return F.NVFP4Tensor(q.data.cpu(), q.scales.cpu(), q.amax.cpu(), q.e4m3_max)


def _cpu_mx(m):
    return type(m)(m.data.cpu(), m.scales.cpu())


def _cpu_s2f6(s: F.S2F6Tensor) -> F.S2F6Tensor:
    return F.S2F6Tensor(s.data.cpu(), s.scales.cpu(), s.hadamard, s.sign_mask)


def _input(kind: str, num_rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return make_rows(kind, num_rows, hidden, seed).to(dtype)


def _assert_nvfp4_kernel_matches(x: torch.Tensor, four_over_six: bool, amax, what: str) -> None:
    """The CUDA quantizer's codes of CPU rows x equal the reference's; amax: None (computed per row) or CPU rows."""
    kwargs = {} if amax is None else {"amax": amax}
    expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference", **kwargs)
    kwargs = {} if amax is None else {"amax": amax.to(DEVICE)}
    actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=four_over_six, impl="cuda", **kwargs)
    assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"{what} amax given={amax is not None}")


# ----------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_quantize(hidden, num_rows, dtype, four_over_six):
    x = _input("outliers", num_rows, hidden, dtype, seed=hidden + num_rows)
    expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
    actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=four_over_six, impl="cuda")
    assert_same_nvfp4(_cpu_nvfp4(actual), expected, "nvfp4")
    for out_dtype in (torch.float32, torch.bfloat16):
        assert_same_floats(F.nvfp4_dequantize(actual, dtype=out_dtype, impl="cuda").cpu(),
                           F.nvfp4_dequantize(expected, dtype=out_dtype, impl="reference"), f"dequantize {out_dtype}")


@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_amax_modes_and_long_rows(four_over_six):
    x = _input("wide", 9, 2048, torch.float32, seed=3)
    per_row = x.abs().amax(dim=-1) * torch.linspace(0.5, 2.0, 9)
    for amax in (per_row, torch.tensor(3.0), torch.tensor(0.0), torch.tensor(math.inf), torch.tensor(1e-30)):
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, amax=amax, impl="reference")
        actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=four_over_six, amax=amax.to(DEVICE), impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, "nvfp4 given amax")
    expected = F.nvfp4_quantize(x, four_over_six=four_over_six, scale_granularity="tensor", impl="reference")
    actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=four_over_six, scale_granularity="tensor", impl="cuda")
    assert_same_nvfp4(_cpu_nvfp4(actual), expected, "nvfp4 tensor amax")
    # Rows longer than one register-resident round (bf16 > 32768, fp32 > 16384 elements): two-pass path.
    for dtype, hidden in ((torch.bfloat16, 40960), (torch.float32, 20480), (torch.float16, 35840)):
        x = _input("outliers", 3, hidden, dtype, seed=hidden)
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
        actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=four_over_six, impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"nvfp4 long rows {dtype}")


def test_four_over_six_adversarial_blocks():
    """The kernel's fast 4/6 selection (approximate errors with a proven bound, exact fallback out of line)
    against the reference on blocks made to hit its edges: candidate ties and near-ties, E4M3 scale boundaries,
    zero / subnormal / saturated block scales, all-equal blocks, stale amax; one block per row with the given
    amax, then whole rows (H = 7168) whose amax the kernel computes, in fp32 and bf16 (packed amax)."""
    g = torch.Generator().manual_seed(46)
    x = adversarial_four_over_six_blocks(g)
    for amax in four_over_six_amax_cases(x, g):
        expected = F.nvfp4_quantize(x, four_over_six=True, amax=amax, impl="reference")
        actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=True, amax=amax.to(DEVICE), impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, "4/6 adversarial, given amax")
    rows = x[: (x.shape[0] * 16 // 7168) * 7168 // 16].reshape(-1, 7168)
    for dtype in (torch.float32, torch.bfloat16):
        xr = rows.to(dtype)
        expected = F.nvfp4_quantize(xr, four_over_six=True, impl="reference")
        actual = F.nvfp4_quantize(xr.to(DEVICE), four_over_six=True, impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"4/6 adversarial rows {dtype}")


@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_random_bit_rows(four_over_six):
    """Blocks in every binade with raw fp32 bit patterns sprinkled in (NaN payloads of either sign, infinities,
    subnormals, huge values): the fast paths' limits and their NaN tests, in fp32 and bf16 (sign bytes from the raw
    pairs), with the row amax computed and given (stale: half and twice the true one)."""
    x = make_rows("bits", 24, 2048, seed=61)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        true_amax = xd.float().nan_to_num(nan=0.0).abs().amax(dim=-1)
        for amax in (None, true_amax * 0.5, true_amax * 2.0):
            kwargs = {} if amax is None else {"amax": amax}
            expected = F.nvfp4_quantize(xd, four_over_six=four_over_six, impl="reference", **kwargs)
            cuda_kwargs = {} if amax is None else {"amax": amax.to(DEVICE)}
            actual = F.nvfp4_quantize(xd.to(DEVICE), four_over_six=four_over_six, impl="cuda", **cuda_kwargs)
            assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"nvfp4 random bits {dtype} amax={amax is not None}")


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_four_over_six_exact_ties(hidden, dtype):
    """Rows with outlier channels (every 97th 30x), where many blocks decode the same under both 4/6 candidates: the
    kernel's exact-tie step (qm::nvfp4_four_six_block16_fast, step (3): no exact formula) against the reference, row
    amax computed and given; the host probe confirms that the data holds such ties."""
    from ep_comm import _cuda_formats as C  # the host probe (ep_comm._C: present wherever this tier runs)

    x = _input("outlier_columns", 37, hidden, dtype, seed=hidden)
    amax = x.float().abs().amax(dim=1)
    assert int(C.host_nvfp4_four_six_exact_ties(x.float(), amax).sum()) > 37
    for given in (None, amax):
        _assert_nvfp4_kernel_matches(x, True, given, "4/6 exact ties")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nvfp4_quantize_rows_past_one_wave(dtype):
    """More rows (1201 of 7168) than one wave of the 4/6 kernel's CTAs holds on an H100 / H200 (132 SMs: 528 bf16
    rows, 396 fp32), so that its CTAs prefetch into L2 the rows of the next wave (EP_COMM_NVFP4_PREFETCH, on by
    default): a prefetch is a hint, and the codes must be the reference's whatever it does."""
    x = _input("outliers", 1201, 7168, dtype, seed=1201)
    expected = F.nvfp4_quantize(x, four_over_six=True, impl="reference")
    actual = F.nvfp4_quantize(x.to(DEVICE), four_over_six=True, impl="cuda")
    assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"nvfp4 4/6 past one wave {dtype}")


@pytest.mark.parametrize("hidden", [16, 48, 1552, 2064, 4112, 8720])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_quantize_uneven_widths(hidden, dtype, four_over_six):
    """Row widths (1, 3, 97, 129, 257 and 545 blocks of 16) that leave some of the quantizer's threads with fewer
    blocks than others or none, and at 545 blocks with two blocks per thread a second round only partly filled; 33
    rows, an odd count (a CTA's last row missing where a CTA holds several); row amax computed and given."""
    x = _input("outliers", 33, hidden, dtype, seed=hidden)
    per_row = x.float().abs().amax(dim=-1) * 1.5
    for amax in (None, per_row):
        _assert_nvfp4_kernel_matches(x, four_over_six, amax, f"nvfp4 width {hidden}")


def test_nvfp4_quantize_fp16_inputs():
    """fp16 rows (random, outliers, and the edge rows: zeros, tiny, huge -> Inf, NaN) through the quantize kernel."""
    rows = torch.cat([make_rows("outliers", 5, 2048, seed=16), make_rows("gauss", 3, 2048, seed=17),
                      edge_rows(2048)]).to(torch.float16)
    for four_over_six in (True, False):
        expected = F.nvfp4_quantize(rows, four_over_six=four_over_six, impl="reference")
        actual = F.nvfp4_quantize(rows.to(DEVICE), four_over_six=four_over_six, impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"nvfp4 fp16 4/6={four_over_six}")


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("amax_form", ["computed", "given"])
@pytest.mark.parametrize("four_over_six", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_nvfp4_strided_rows_and_destination_rows(dtype, four_over_six, amax_form, hidden):
    """The launcher's strided input and the dispatch-style destination map (rows scattered into a buffer with its
    own row pitches), in every input type, 4/6 and plain NVFP4, with the per-row amax computed by the kernel or
    given (amax_in: below the row max on some rows, 0 on one), at H = 2048 and 7168: bitwise the reference at each
    row's destination; a skipped row (-1), the padding past each row and every other row stay untouched."""
    from ep_comm import _ext
    lib = _ext.require_cuda_extension("test")
    num_rows = 37
    wide = _input("outliers", num_rows, hidden + 64, dtype, seed=8 + hidden).to(DEVICE)
    x = wide[:, :hidden]  # row stride hidden + 64 elements (16-byte aligned)
    given = None
    if amax_form == "given":
        given = x.float().abs().amax(dim=-1).cpu() * torch.linspace(0.5, 2.0, num_rows)
        given[5] = 0.0  # the whole row decodes to 0
    expected = F.nvfp4_quantize(x.cpu(), four_over_six=four_over_six, amax=given, impl="reference")
    amax_in = None if given is None else given.to(DEVICE)
    assert_same_nvfp4(_cpu_nvfp4(F.nvfp4_quantize(x, four_over_six=four_over_six, amax=amax_in, impl="cuda")),
                      expected, "nvfp4 strided input")

    dst_rows = torch.randperm(2 * num_rows, generator=torch.Generator().manual_seed(129))[:num_rows].to(DEVICE)
    dst_rows[3] = -1  # skipped row
    row_bytes, scale_pitch = hidden // 2 + 32, hidden // 16 + 16
    data = torch.full((2 * num_rows, row_bytes), 0xAB, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((2 * num_rows, scale_pitch), 0xCD, dtype=torch.uint8, device=DEVICE)
    amax = torch.full((2 * num_rows,), -1.0, device=DEVICE)
    elem_type = {torch.bfloat16: lib.ELEM_BFLOAT16, torch.float32: lib.ELEM_FLOAT32, torch.float16: lib.ELEM_FLOAT16}
    lib.nvfp4_quantize(x.data_ptr(), elem_type[dtype], x.stride(0), num_rows, hidden,
                       0 if amax_in is None else amax_in.data_ptr(), 256.0 if four_over_six else 448.0, four_over_six,
                       data.data_ptr(), row_bytes, scales.data_ptr(), scale_pitch, amax.data_ptr(),
                       dst_rows.data_ptr(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    sent = (dst_rows >= 0).cpu()
    dst = dst_rows[dst_rows >= 0]
    assert torch.equal(data[dst, :hidden // 2].cpu(), expected.data[sent]), "codes"
    assert torch.equal(scales[dst, :hidden // 16].cpu(), expected.scales[sent].view(torch.uint8)), "scales"
    assert torch.equal(amax[dst].cpu().view(torch.int32), expected.amax[sent].view(torch.int32)), "amax"
    assert (data[dst, hidden // 2:] == 0xAB).all() and (scales[dst, hidden // 16:] == 0xCD).all(), "wrote past row"
    untouched = torch.ones(2 * num_rows, dtype=torch.bool)
    untouched[dst.cpu()] = False
    untouched = untouched.to(DEVICE)
    assert (data[untouched] == 0xAB).all() and (scales[untouched] == 0xCD).all() and (amax[untouched] == -1.0).all()


def test_nvfp4_destination_rows_refusals():
    """What the raw quantize entry point refuses for a caller-given destination, each with an error that says why, and
    nothing written: code rows (or their pitch) not 8-byte aligned, input rows not 16-byte aligned, no scales, and
    the GEMM operand form (block values) with plain NVFP4 (4/6 only)."""
    from ep_comm import _ext
    lib = _ext.require_cuda_extension("test")
    hidden, num_rows = 2048, 5
    wide = _input("outliers", num_rows, hidden + 64, torch.bfloat16, seed=9).to(DEVICE)
    data = torch.full((num_rows, hidden // 2 + 32), 0xAB, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((num_rows, hidden // 16), 0xCD, dtype=torch.uint8, device=DEVICE)
    values = torch.full((num_rows, hidden), 7.0, dtype=torch.float16, device=DEVICE)
    row_factor = torch.full((num_rows,), -1.0, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream

    def call(x_ptr=wide.data_ptr(), x_stride=wide.stride(0), four_over_six=True, data_ptr=data.data_ptr(),
             data_stride=hidden // 2 + 32, scales_ptr=scales.data_ptr(), **operand):
        lib.nvfp4_quantize(x_ptr, lib.ELEM_BFLOAT16, x_stride, num_rows, hidden, 0, 256.0 if four_over_six else 448.0,
                           four_over_six, data_ptr, data_stride, scales_ptr, hidden // 16, 0, 0, stream, **operand)

    with pytest.raises(ValueError, match="data rows must start 8-byte aligned"):
        call(data_stride=hidden // 2 + 4)
    with pytest.raises(ValueError, match="data rows must start 8-byte aligned"):
        call(data_ptr=data.data_ptr() + 4)
    with pytest.raises(ValueError, match="dense rows must start 16-byte aligned"):
        call(x_stride=hidden + 4)  # 8 bytes past a 16-byte multiple
    with pytest.raises(ValueError, match="dense rows must start 16-byte aligned"):
        call(x_ptr=wide.data_ptr() + 8)
    with pytest.raises(ValueError, match="data and scales are required"):
        call(scales_ptr=0)
    operand = dict(block_values=values.data_ptr(), block_values_row_stride=hidden, row_factor=row_factor.data_ptr())
    with pytest.raises(ValueError, match="nvfp4_quantize: invalid arguments"):
        call(four_over_six=False, data_ptr=0, scales_ptr=0, **operand)
    torch.cuda.synchronize()
    assert (data == 0xAB).all() and (scales == 0xCD).all(), "a refused call wrote codes"
    assert (values == 7.0).all() and (row_factor == -1.0).all(), "a refused call wrote block values"
    call(data_ptr=0, scales_ptr=0, **operand)  # the control: the same operand form with 4/6 is taken, and writes
    torch.cuda.synchronize()
    assert not (values == 7.0).all() and bool((row_factor > 0).all())


# ----------------------------------------------------------------------------------------------------------
# MXFP8 and the transposed requantization
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp8_quantize(hidden, num_rows, dtype, rounding):
    x = _input("wide", num_rows, hidden, dtype, seed=hidden * 3 + num_rows)
    expected = F.mxfp8_quantize(x, rounding=rounding, seed=2**33 + 9, impl="reference")
    actual = F.mxfp8_quantize(x.to(DEVICE), rounding=rounding, seed=2**33 + 9, impl="cuda")
    assert_same_mx(_cpu_mx(actual), expected, "mxfp8")
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same_floats(F.mxfp8_dequantize(actual, dtype=out_dtype, impl="cuda").cpu(),
                           F.mxfp8_dequantize(expected, dtype=out_dtype, impl="reference"), f"dequantize {out_dtype}")


def test_stochastic_rounding_seeds_and_unbiasedness():
    x = _input("gauss", 64, 2048, torch.float32, seed=5).to(DEVICE)
    first = F.mxfp8_quantize(x, rounding="stochastic", seed=11, impl="cuda")
    again = F.mxfp8_quantize(x, rounding="stochastic", seed=11, impl="cuda")
    other = F.mxfp8_quantize(x, rounding="stochastic", seed=12, impl="cuda")
    assert torch.equal(first.data.view(torch.uint8), again.data.view(torch.uint8)), "same seed, different bits"
    assert not torch.equal(first.data.view(torch.uint8), other.data.view(torch.uint8)), "seed ignored"
    # Unbiased: the mean over seeds converges to x; nearest rounding keeps its error whatever the seed.
    num_seeds = 256
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(num_seeds):
        total += F.mxfp8_dequantize(F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="cuda")).double()
    mean = total / num_seeds
    nearest = F.mxfp8_dequantize(F.mxfp8_quantize(x, impl="cuda")).double()
    sr_error = (mean - x.double()).abs().mean().item()
    rn_error = (nearest - x.double()).abs().mean().item()
    assert sr_error < 0.15 * rn_error, f"SR mean error {sr_error} vs nearest {rn_error}"
    signed = (mean - x.double()).mean().item() / rn_error
    assert abs(signed) < 0.02, f"SR is biased: mean signed error {signed} of the nearest-rounding error"


def test_stochastic_rounding_high_seeds_and_transposed_unbiasedness():
    """Seeds whose top bit is set (and 2^32 - 1, whose high word is 0), given as ints, bitwise against the reference
    for both stochastic kernels (test_seed_tensors_are_read_when_the_kernels_run compares the kernels only with
    themselves at such seeds, which a shared mishandling of the top bit would pass). Then the transposed
    requantizer's own random-bit path (a launch-wide pair key for indices below 2^33) unbiased across seeds, as
    test_stochastic_rounding_seeds_and_unbiasedness checks mxfp8_quantize's."""
    x = _input("gauss", 64, 2048, torch.float32, seed=8)
    q = F.nvfp4_quantize(_input("outliers", 96, 2048, torch.float32, seed=9), impl="reference")
    q_cuda = F.NVFP4Tensor(q.data.to(DEVICE), q.scales.to(DEVICE), q.amax.to(DEVICE), q.e4m3_max)
    for seed in (2**63 + 5, 2**64 - 1, 2**32 - 1):
        assert_same_mx(_cpu_mx(F.mxfp8_quantize(x.to(DEVICE), rounding="stochastic", seed=seed, impl="cuda")),
                       F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="reference"), f"mxfp8, seed {seed}")
        assert_same_mx(_cpu_mx(F.nvfp4_to_mxfp8_transposed(q_cuda, seed=seed, impl="cuda")),
                       F.nvfp4_to_mxfp8_transposed(q, seed=seed, impl="reference"), f"nvfp4 -> mxfp8^T, seed {seed}")
    exact = F.nvfp4_dequantize(q, dtype=torch.float32, impl="reference").t().double()  # [K, R]: what is rounded
    num_seeds = 256
    total = torch.zeros_like(exact)
    for seed in range(num_seeds):
        m = F.nvfp4_to_mxfp8_transposed(q_cuda, seed=seed, impl="cuda")
        total += F.mxfp8_dequantize(m, dtype=torch.float32, impl="cuda").cpu().double()
    mean = total / num_seeds
    nearest = F.mxfp8_dequantize(F.nvfp4_to_mxfp8_transposed(q_cuda, rounding="nearest", impl="cuda"),
                                 dtype=torch.float32, impl="cuda").cpu().double()
    sr_error = (mean - exact).abs().mean().item()
    rn_error = (nearest - exact).abs().mean().item()
    assert rn_error > 0 and sr_error < 0.15 * rn_error, f"SR mean error {sr_error} vs nearest {rn_error}"
    signed = (mean - exact).mean().item() / rn_error
    assert abs(signed) < 0.02, f"transposed SR is biased: mean signed error {signed} of the nearest-rounding error"


def test_seed_tensors_are_read_when_the_kernels_run():
    """A one-element int64 seed tensor on the GPU gives the bits of its int seed (two's complement from 2^63), and a
    CUDA graph that captured the stochastic quantizers with it rounds with the value the tensor holds at each replay
    (an int seed would be the capture's for ever). Seed tensors of another dtype, or on another device than the
    input, are refused."""
    x = _input("gauss", 64, 2048, torch.bfloat16, seed=6).to(DEVICE)
    q = F.nvfp4_quantize(_input("outliers", 96, 2048, torch.float32, seed=7).to(DEVICE), impl="cuda")
    seed = torch.zeros((), dtype=torch.int64, device=DEVICE)

    def calls(s):
        return (F.mxfp8_quantize(x, rounding="stochastic", seed=s, impl="cuda"),
                F.nvfp4_to_mxfp8_transposed(q, seed=s, impl="cuda"))

    def bits(value: int) -> int:
        return value - 2**64 if value >= 2**63 else value

    def check(got, value):
        for a, b, name in zip(got, calls(value), ("mxfp8", "nvfp4 -> mxfp8^T")):
            assert_same_mx(_cpu_mx(a), _cpu_mx(b), f"{name}, seed {value}")

    for value in (3, 2**63 + 5, 2**64 - 1):
        seed.fill_(bits(value))
        check(calls(seed), value)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls(seed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = calls(seed)
    for value in (11, 2**63 + 1):
        seed.fill_(bits(value))
        graph.replay()
        check(static, value)
    with pytest.raises(TypeError, match="one int64 element"):
        F.mxfp8_quantize(x, rounding="stochastic", seed=seed.int(), impl="cuda")
    with pytest.raises(ValueError, match="seed tensor is on"):
        F.mxfp8_quantize(x.cpu(), rounding="stochastic", seed=seed, impl="reference")


def test_stochastic_rounding_fast_path_limits():
    """Blocks on both sides of the kernels' fast SR form, bitwise against the reference."""
    x = sr_fast_path_limit_blocks()
    for seed in (0, 1, 2**40 + 3, 12345):
        expected = F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="reference")
        actual = F.mxfp8_quantize(x.to(DEVICE), rounding="stochastic", seed=seed, impl="cuda")
        assert_same_mx(_cpu_mx(actual), expected, f"mxfp8 SR limits seed {seed}")


@pytest.mark.parametrize("dtype, fraction", [(torch.float32, 12345 / 65536), (torch.bfloat16, 5 / 16)])
def test_stochastic_rounding_draws_uniform_and_independent(dtype, fraction):
    """The kernel's 16-bit draws, seen through its rounding decisions: a value at `fraction` of its E4M3 step
    (96 + 8 * fraction with the scale pinned to 1) rounds up with probability `fraction` (fp32: all 16 bits of a
    draw matter; bf16: only its top 4), independently of its neighbours (the two halves of one fmix32 word, and
    neighbours from two words) and of the seed."""
    rows, hidden = 512, 2048
    x = torch.full((rows, hidden), 96.0 + 8.0 * fraction).to(dtype)
    x[:, ::32] = 448.0  # every block's amax: scale 1
    xd = x.to(DEVICE)
    ups = []
    for seed in (0, 1, 2**40 + 3):
        m = F.mxfp8_quantize(xd, rounding="stochastic", seed=seed, impl="cuda")
        y = F.mxfp8_dequantize(m).cpu().reshape(rows, hidden // 32, 32)[:, :, 1:]  # drop the 448s
        assert set(y.unique().tolist()) <= {96.0, 104.0}
        up = (y == 104.0).double()
        n = up.numel()
        assert abs(up.mean().item() - fraction) < 6 * math.sqrt(fraction * (1 - fraction) / n), seed
        z = (up - fraction) / math.sqrt(fraction * (1 - fraction))
        # Block positions 1..31: (2m, 2m + 1) share a pair word, (2m + 1, 2m + 2) come from two words.
        same_word = (z[:, :, 1:30:2] * z[:, :, 2:31:2]).mean().item()
        two_words = (z[:, :, 0:30:2] * z[:, :, 1:31:2]).mean().item()
        for corr in (same_word, two_words):
            assert abs(corr) < 6 / math.sqrt(n / 2), (seed, same_word, two_words)
        ups.append(z)
    assert abs((ups[0] * ups[1]).mean().item()) < 6 / math.sqrt(ups[0].numel()), "seeds 0 and 1 correlate"


# (32, 48): K % 64 != 0, a half-empty column tile; (64, 96): the last column tile half full; (32, 16): one block;
# (96, 2048): a partial row tile; (1024, 7168): 896 tiles, more than the resident CTAs of an H200 (6 x 132), so CTAs
# take a second tile from registers loaded during the first.
@pytest.mark.parametrize("num_rows, hidden", [(32, 48), (96, 2048), (288, 7168), (128, 64), (64, 96), (32, 16),
                                              (1024, 7168)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_to_mxfp8_transposed(num_rows, hidden, rounding):
    q = F.nvfp4_quantize(_input("outliers", num_rows, hidden, torch.float32, seed=num_rows), impl="reference")
    expected = F.nvfp4_to_mxfp8_transposed(q, rounding=rounding, seed=77, impl="reference")
    q_cuda = F.NVFP4Tensor(q.data.to(DEVICE), q.scales.to(DEVICE), q.amax.to(DEVICE), q.e4m3_max)
    actual = F.nvfp4_to_mxfp8_transposed(q_cuda, rounding=rounding, seed=77, impl="cuda")
    assert_same_mx(_cpu_mx(actual), expected, "nvfp4 -> mxfp8^T")


def test_nvfp4_to_mxfp8_transposed_of_no_rows():
    """0 rows (an expert without tokens in backward): [K, 0] from the kernel path too, as from the reference, and it
    dequantizes to an empty [K, 0] on the CUDA path too."""
    q = F.nvfp4_quantize(torch.randn(0, 64, device=DEVICE), impl="cuda")
    m = F.nvfp4_to_mxfp8_transposed(q, seed=3, impl="cuda")
    assert tuple(m.data.shape) == (64, 0) and tuple(m.scales.shape) == (64, 0) and m.data.is_cuda
    for dtype in (torch.float32, torch.bfloat16):
        out = F.mxfp8_dequantize(m, dtype, impl="cuda")
        assert tuple(out.shape) == (64, 0) and out.dtype == dtype and out.is_cuda


def test_nvfp4_to_mxfp8_transposed_unaligned_scales():
    """The kernel stores a row tile's 4 scale bytes of an output row as one word only where that word is aligned; an
    out_scales address that is not a multiple of 4 takes the byte stores (the Python wrapper always allocates aligned
    outputs, so the raw binding is called here)."""
    from ep_comm import _ext
    lib = _ext.require_cuda_extension("test")
    num_rows, hidden = 256, 128  # R % 128 == 0 and full tiles: the word stores unless the address forbids them
    q = F.nvfp4_quantize(_input("outliers", num_rows, hidden, torch.float32, seed=5), impl="reference")
    expected = F.nvfp4_to_mxfp8_transposed(q, rounding="stochastic", seed=31, impl="reference")
    data, scales, amax = (t.to(DEVICE).contiguous() for t in (q.data, q.scales.view(torch.uint8), q.amax.float()))
    out_data = torch.empty(hidden, num_rows, dtype=torch.uint8, device=DEVICE)
    scale_buffer = torch.full((hidden * num_rows // 32 + 16,), 0xAB, dtype=torch.uint8, device=DEVICE)
    for offset in (1, 2, 3):
        scale_buffer.fill_(0xAB)
        lib.nvfp4_to_mxfp8_transposed(data.data_ptr(), scales.data_ptr(), amax.data_ptr(), num_rows, hidden,
                                      float(q.e4m3_max), True, 31, out_data.data_ptr(),
                                      scale_buffer.data_ptr() + offset, torch.cuda.current_stream().cuda_stream)
        got = scale_buffer.cpu()
        n = hidden * num_rows // 32
        assert torch.equal(got[offset:offset + n], expected.scales.view(torch.uint8).reshape(-1)), offset
        assert (got[:offset] == 0xAB).all() and (got[offset + n:] == 0xAB).all(), f"bytes outside, offset {offset}"
        assert torch.equal(out_data.cpu(), expected.data.view(torch.uint8)), offset


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("e4m3_max", [256.0, 448.0])
def test_nvfp4_to_mxfp8_transposed_extreme_row_amax(rounding, e4m3_max):
    """Rows whose decode factor final_b = f(f(s * amax) * f(1/(6M))) reaches its largest finite values (amax =
    FLT_MAX / s for s near 448; final_b <= f(FLT_MAX / 6M) ~ 2^117), or overflows (amax up to FLT_MAX, where
    f(s * amax) is Inf), beside Inf, tiny and subnormal amax, with scale bytes drawn from 0x00..0x7E and random
    codes: bitwise the reference (a decode that rescales final_b, e.g. by 2^6, must stay exact there)."""
    g = torch.Generator().manual_seed(11)
    num_rows, hidden = 128, 64
    fmax = torch.finfo(torch.float32).max
    data = torch.randint(0, 256, (num_rows, hidden // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (num_rows, hidden // 16), generator=g, dtype=torch.uint8)
    scales[:48] = torch.randint(0x78, 0x7F, (48, hidden // 16), generator=g, dtype=torch.uint8)  # s in [256, 448]
    amax = torch.cat([torch.full((16,), fmax), torch.full((16,), fmax / 448), torch.full((16,), fmax / 300),
                      torch.exp2(torch.empty(48).uniform_(100, 128, generator=g)).clamp(max=fmax),
                      torch.full((8,), math.inf), torch.full((8,), 1e-40),
                      torch.exp2(torch.empty(16).uniform_(-140, -100, generator=g))]).float()
    q = F.NVFP4Tensor(data, scales.view(torch.float8_e4m3fn), amax, e4m3_max)
    expected = F.nvfp4_to_mxfp8_transposed(q, rounding=rounding, seed=5, impl="reference")
    q_cuda = F.NVFP4Tensor(data.to(DEVICE), q.scales.to(DEVICE), amax.to(DEVICE), e4m3_max)
    actual = F.nvfp4_to_mxfp8_transposed(q_cuda, rounding=rounding, seed=5, impl="cuda")
    assert_same_mx(_cpu_mx(actual), expected, f"extreme amax, M = {e4m3_max}, {rounding}")


def _misaligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A contiguous copy of t on the GPU whose data starts `offset_bytes` past an aligned allocation (a view into a
    flat byte buffer, as a caller slicing a packed buffer gets): contiguous() keeps such a view as it is."""
    flat = t.contiguous().view(torch.uint8).reshape(-1)
    buffer = torch.zeros(flat.numel() + 64, dtype=torch.uint8, device=DEVICE)
    buffer[offset_bytes:offset_bytes + flat.numel()] = flat.to(DEVICE)
    view = buffer[offset_bytes:offset_bytes + flat.numel()].view(t.dtype).view(t.shape)
    assert view.data_ptr() % 16 == offset_bytes % 16 and view.is_contiguous()
    return view


def test_misaligned_views_are_copied_not_faulted():
    """Inputs whose data pointer is not aligned to the kernels' 16- / 8-byte vector loads (a quantize of bf16 x at +2
    bytes, or a dequantize of codes at +3, used to fault and lose the CUDA context): each wrapper copies them, and the
    result is bitwise the reference's."""
    x = _input("outliers", 33, 2048, torch.float32, seed=9)
    for dtype, offset in ((torch.bfloat16, 2), (torch.bfloat16, 6), (torch.float32, 4)):
        xd = _misaligned(x.to(dtype), offset)
        assert_same_nvfp4(_cpu_nvfp4(F.nvfp4_quantize(xd, impl="cuda")), F.nvfp4_quantize(x.to(dtype),
                          impl="reference"), f"nvfp4 x at +{offset}")
        assert_same_mx(_cpu_mx(F.mxfp8_quantize(xd, impl="cuda")), F.mxfp8_quantize(x.to(dtype), impl="reference"),
                       f"mxfp8 x at +{offset}")
        assert_same_mx(_cpu_s2f6(F.s2f6_quantize(xd, impl="cuda")), F.s2f6_quantize(x.to(dtype), impl="reference"),
                       f"s2f6 x at +{offset}")
    q = F.nvfp4_quantize(x[:32], impl="reference")
    m = F.mxfp8_quantize(x, impl="reference")
    s = F.s2f6_quantize(x, impl="reference")
    index = torch.tensor([[0, 5, -1], [32, 1, 2]])
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(3))
    for offset in (3, 4, 8):
        qd = F.NVFP4Tensor(_misaligned(q.data, offset), q.scales.to(DEVICE), q.amax.to(DEVICE), q.e4m3_max)
        assert_same_floats(F.nvfp4_dequantize(qd, impl="cuda").cpu(), F.nvfp4_dequantize(q, impl="reference"),
                           f"nvfp4 dequantize codes at +{offset}")
        assert_same_mx(_cpu_mx(F.nvfp4_to_mxfp8_transposed(qd, seed=4, impl="cuda")),
                       F.nvfp4_to_mxfp8_transposed(q, seed=4, impl="reference"), f"transposed codes at +{offset}")
        md = type(m)(_misaligned(m.data, offset), m.scales.to(DEVICE))
        assert_same_floats(F.mxfp8_dequantize(md, impl="cuda").cpu(), F.mxfp8_dequantize(m, impl="reference"),
                           f"mxfp8 dequantize codes at +{offset}")
        sd = F.S2F6Tensor(_misaligned(s.data, offset), s.scales.to(DEVICE), s.hadamard, s.sign_mask)
        assert_same_floats(F.s2f6_dequantize(sd, impl="cuda").cpu(), F.s2f6_dequantize(s, impl="reference"),
                           f"s2f6 dequantize codes at +{offset}")
        assert_same_floats(F.s2f6_dequantize_accumulate(sd, index.to(DEVICE), weights.to(DEVICE), impl="cuda").cpu(),
                           F.s2f6_dequantize_accumulate(s, index, weights, impl="reference"),
                           f"s2f6 accumulate codes at +{offset}")


# ----------------------------------------------------------------------------------------------------------
# RHT + S2F6
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hadamard", [True, False])
def test_s2f6_quantize(hidden, num_rows, dtype, hadamard):
    """Quantize and dequantize, bitwise the reference; with RHT under the default signs and two others (the forward
    and the inverse transform both read the mask)."""
    x = _input("outliers", num_rows, hidden, dtype, seed=hidden + 2 * num_rows)
    for sign_mask in ((0x6A09E667, 0x5A5A0F0F, 0xFFFFFFFF) if hadamard else (0x5,)):
        expected = F.s2f6_quantize(x, hadamard=hadamard, sign_mask=sign_mask, impl="reference")
        actual = F.s2f6_quantize(x.to(DEVICE), hadamard=hadamard, sign_mask=sign_mask, impl="cuda")
        assert_same_mx(_cpu_s2f6(actual), expected, f"s2f6, signs {sign_mask:#x}")
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert_same_floats(F.s2f6_dequantize(actual, dtype=out_dtype, impl="cuda").cpu(),
                               F.s2f6_dequantize(expected, dtype=out_dtype, impl="reference"),
                               f"dequantize {out_dtype}, signs {sign_mask:#x}")


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_terms", [1, 3, 8])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_s2f6_dequantize_accumulate(hidden, num_terms, weighted, hadamard, index_dtype):
    g = torch.Generator().manual_seed(num_terms * 7 + hidden)
    num_src, num_out = 301, 97
    s = F.s2f6_quantize(_input("outliers", num_src, hidden, torch.float32, seed=num_terms), hadamard=hadamard,
                        impl="reference")
    index = torch.randint(-1, num_src, (num_out, num_terms), generator=g).to(index_dtype)
    index[0] = -1
    weights = torch.rand(num_out, num_terms, generator=g) if weighted else None
    s_cuda = F.S2F6Tensor(s.data.to(DEVICE), s.scales.to(DEVICE), s.hadamard, s.sign_mask)
    for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
        expected = F.s2f6_dequantize_accumulate(s, index, weights, out_dtype=out_dtype, impl="reference")
        actual = F.s2f6_dequantize_accumulate(s_cuda, index.to(DEVICE), None if weights is None else weights.to(DEVICE),
                                              out_dtype=out_dtype, impl="cuda")
        assert_same_floats(actual.cpu(), expected, f"accumulate {out_dtype}")


@pytest.mark.parametrize("hidden", [32, 96, 640, 800, 1920, 2080])
@pytest.mark.parametrize("num_terms", [33, 70])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_s2f6_partial_segments_and_many_terms(hidden, num_terms, index_dtype):
    """The warp-per-512-element kernels: a row's last segment partly filled (hidden % 512 != 0; 640 and 1920 with
    hidden % 128 == 0, the accumulation's scale-word copies), and many chunks of terms per output row, with
    skipped indices inside and across chunks; int64 and int32 indices (each its own term loader)."""
    g = torch.Generator().manual_seed(hidden + num_terms)
    num_src, num_out = 130, 45
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _input("outliers", num_src, hidden, dtype, seed=hidden)
        for hadamard in (False, True):  # the last (fp32, RHT) pair feeds the accumulation below
            expected = F.s2f6_quantize(x, hadamard=hadamard, impl="reference")
            actual = F.s2f6_quantize(x.to(DEVICE), hadamard=hadamard, impl="cuda")
            assert_same_mx(_cpu_s2f6(actual), expected, f"s2f6 {dtype} hidden {hidden}")
    index = torch.randint(-1, num_src, (num_out, num_terms), generator=g)
    index[1, 30:36] = -1  # skipped terms on both sides of the first pass boundary
    index[2] = -1         # an output row with no terms at all
    index = index.to(index_dtype)
    weights = torch.rand(num_out, num_terms, generator=g)
    for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
        got = F.s2f6_dequantize_accumulate(actual, index.to(DEVICE), weights.to(DEVICE), out_dtype=out_dtype,
                                           impl="cuda")
        want = F.s2f6_dequantize_accumulate(expected, index, weights, out_dtype=out_dtype, impl="reference")
        assert_same_floats(got.cpu(), want, f"accumulate hidden {hidden} terms {num_terms} {out_dtype}")


def test_s2f6_accumulate_unaligned_scales_pointer():
    """hidden % 128 == 0 but scales 1 byte off 4-byte alignment: the accumulation loads scale bytes one by one."""
    g = torch.Generator().manual_seed(11)
    num_src, num_out, hidden, num_terms = 40, 23, 1920, 19
    s = F.s2f6_quantize(_input("outliers", num_src, hidden, torch.float32, seed=5), impl="reference")
    index = torch.randint(-1, num_src, (num_out, num_terms), generator=g)
    weights = torch.rand(num_out, num_terms, generator=g)
    raw = s.scales.view(torch.uint8).reshape(-1)
    buffer = torch.empty(raw.numel() + 1, dtype=torch.uint8, device=DEVICE)
    buffer[1:] = raw.to(DEVICE)
    scales = buffer[1:].view(s.scales.dtype).view(s.scales.shape)
    assert scales.data_ptr() % 4 == 1
    s_cuda = F.S2F6Tensor(s.data.to(DEVICE), scales, s.hadamard, s.sign_mask)
    got = F.s2f6_dequantize_accumulate(s_cuda, index.to(DEVICE), weights.to(DEVICE), out_dtype=torch.float32,
                                       impl="cuda")
    want = F.s2f6_dequantize_accumulate(s, index, weights, out_dtype=torch.float32, impl="reference")
    assert_same_floats(got.cpu(), want, "accumulate unaligned scales")


# ----------------------------------------------------------------------------------------------------------
# Edge rows and empty inputs, every kernel
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)  # threads per row and rows per CTA follow the row length: each size
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_rows(dtype, hidden):
    x = edge_rows(hidden).to(dtype)
    xd = x.to(DEVICE)
    for four_over_six in (True, False):
        expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
        actual = F.nvfp4_quantize(xd, four_over_six=four_over_six, impl="cuda")
        assert_same_nvfp4(_cpu_nvfp4(actual), expected, f"nvfp4 edge 4/6={four_over_six}")
        for out in (torch.float32, torch.bfloat16, torch.float16):  # fp16: its own overflow to Inf and subnormal range
            assert_same_floats(F.nvfp4_dequantize(actual, dtype=out, impl="cuda").cpu(),
                               F.nvfp4_dequantize(expected, dtype=out), f"nvfp4 deq {out}")
    for rounding in ("nearest", "stochastic"):
        expected = F.mxfp8_quantize(x, rounding=rounding, seed=4, impl="reference")
        actual = F.mxfp8_quantize(xd, rounding=rounding, seed=4, impl="cuda")
        assert_same_mx(_cpu_mx(actual), expected, f"mxfp8 edge {rounding}")
        for out in (torch.float32, torch.bfloat16, torch.float16):
            assert_same_floats(F.mxfp8_dequantize(actual, dtype=out, impl="cuda").cpu(),
                               F.mxfp8_dequantize(expected, dtype=out), f"mx deq {out}")
    for hadamard in (True, False):
        expected = F.s2f6_quantize(x, hadamard=hadamard, impl="reference")
        actual = F.s2f6_quantize(xd, hadamard=hadamard, impl="cuda")
        assert_same_mx(_cpu_s2f6(actual), expected, f"s2f6 edge hadamard={hadamard}")
        for out in (torch.float32, torch.bfloat16, torch.float16):
            assert_same_floats(F.s2f6_dequantize(actual, dtype=out, impl="cuda").cpu(),
                               F.s2f6_dequantize(expected, dtype=out), f"s2f6 deq {out}")
        index = torch.arange(x.shape[0])[:, None].repeat(1, 2)
        index[:, 1] = -1
        assert_same_floats(
            F.s2f6_dequantize_accumulate(actual, index.to(DEVICE), impl="cuda").cpu(),
            F.s2f6_dequantize_accumulate(expected, index, impl="reference"), "accumulate edge")
    q = F.nvfp4_quantize(x.float(), impl="reference")
    rows = torch.arange(32) % x.shape[0]
    q32 = F.NVFP4Tensor(q.data[rows], q.scales[rows], q.amax[rows], q.e4m3_max)
    q32_cuda = F.NVFP4Tensor(q32.data.to(DEVICE), q32.scales.to(DEVICE), q32.amax.to(DEVICE), q32.e4m3_max)
    assert_same_mx(_cpu_mx(F.nvfp4_to_mxfp8_transposed(q32_cuda, seed=9, impl="cuda")),
                   F.nvfp4_to_mxfp8_transposed(q32, seed=9, impl="reference"), "transposed edge")


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("hadamard, sign_mask", [(True, F.DEFAULT_SIGN_MASK), (True, 0x5A5A0F0F), (False, 0)])
def test_s2f6_accumulate_edge_rows_many_terms(hidden, hadamard, sign_mask):
    """Several terms per output row mixing the edge rows (+-0, subnormals, outliers, scattered and all NaN, +-Inf, near
    FLT_MAX) with normal rows, under weights that are 0, -0, negative, subnormal, huge (products and sums overflow to
    +-Inf, Inf + -Inf = NaN), NaN and Inf, in 1..8 terms with skipped slots between: bitwise the reference for fp32
    and bf16 out, with the default and another RHT sign vector (the kernel's FWHT signs) and without the RHT. S2F6
    holds no NaN (a NaN input encodes as code 127), so NaN reaches the sums through NaN weights, 0 x Inf and
    Inf - Inf; the +-Inf rows decode to +-Inf. Output row 8 is 0 and -0 times the +-Inf rows (a kernel that skipped
    zero weights would give 0 there, not NaN)."""
    g = torch.Generator().manual_seed(hidden + sign_mask % 1000)
    edges = edge_rows(hidden)
    rows = torch.cat([edges, torch.randn(20, hidden, generator=g) * 3.0, edges[9:10] * -1.0])  # -3e38 row too
    s = F.s2f6_quantize(rows, hadamard=hadamard, sign_mask=sign_mask, impl="reference")
    s_cuda = F.S2F6Tensor(s.data.to(DEVICE), s.scales.to(DEVICE), s.hadamard, s.sign_mask)
    assert_same_mx(_cpu_s2f6(F.s2f6_quantize(rows.to(DEVICE), hadamard=hadamard, sign_mask=sign_mask, impl="cuda")),
                   s, "s2f6 of the edge rows")
    num_src, num_terms, num_out = rows.shape[0], 8, 96
    index = torch.randint(0, num_src, (num_out, num_terms), generator=g)
    index[::2, 0] = torch.arange(0, num_out, 2) % edges.shape[0]  # every edge row leads some output row
    index[torch.rand(num_out, num_terms, generator=g) < 0.2] = -1
    index[5, 1:] = -1                     # one term
    index[6] = 9                          # the near-FLT_MAX row 8 times: the sum overflows
    index[7, :2] = torch.tensor([9, num_src - 1])  # +3e38 then -3e38 (times weights)
    special = torch.tensor([0.0, -0.0, -1.5, 1e-40, 3e38, -3e38, math.nan, math.inf, -math.inf, 1.0])
    weights = torch.rand(num_out, num_terms, generator=g) * 2.0 - 0.5
    pick = torch.rand(num_out, num_terms, generator=g) < 0.08
    weights[pick] = special[torch.randint(0, special.numel(), (int(pick.sum()),), generator=g)]
    weights[6] = 3e38
    index[8, :3] = torch.tensor([6, 7, 10])  # +Inf row, -Inf row, a normal row
    weights[8, :3] = torch.tensor([0.0, -0.0, 1.0])
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for w in (weights, None):
            want = F.s2f6_dequantize_accumulate(s, index, w, out_dtype=out_dtype, impl="reference")
            got = F.s2f6_dequantize_accumulate(s_cuda, index.to(DEVICE), None if w is None else w.to(DEVICE),
                                               out_dtype=out_dtype, impl="cuda")
            assert_same_floats(got.cpu(), want, f"accumulate edge terms {out_dtype} weighted={w is not None}")
    # the cases above are really there: non-finite and overflowing sums in the reference's output
    want = F.s2f6_dequantize_accumulate(s, index, weights, out_dtype=torch.float32, impl="reference")
    assert bool(want.isnan().any()) and bool(want.isinf().any()) and bool((want == 0).any())


def test_empty_inputs():
    x = torch.empty(0, 2048, device=DEVICE, dtype=torch.bfloat16)
    assert F.nvfp4_quantize(x, impl="cuda").data.shape == (0, 1024)
    assert F.mxfp8_quantize(x, impl="cuda").data.shape == (0, 2048)
    assert F.s2f6_quantize(x, impl="cuda").data.shape == (0, 2048)
    s = F.s2f6_quantize(torch.randn(4, 64, device=DEVICE), impl="cuda")
    out = F.s2f6_dequantize_accumulate(s, torch.empty(0, 3, dtype=torch.int64, device=DEVICE), impl="cuda")
    assert out.shape == (0, 64)
    out = F.s2f6_dequantize_accumulate(s, torch.full((2, 0), -1, dtype=torch.int64, device=DEVICE), impl="cuda")
    assert torch.equal(out.cpu(), F.s2f6_dequantize_accumulate(_cpu_s2f6(s), torch.full((2, 0), -1), impl="reference"))


@pytest.mark.parametrize("lead_shape", [(), (3,), (2, 3), (2, 0), (1, 2, 5)])
def test_quantizers_keep_leading_dims_dtypes_and_layout(lead_shape):
    """The CUDA quantizers allocate their outputs in the final shapes and dtypes (no reshape afterwards): every field
    as the reference's -- shape, dtype, bits -- and contiguous, for 1-D, 3-D, 4-D and empty inputs."""
    x = torch.randn(*lead_shape, 64, generator=torch.Generator().manual_seed(len(lead_shape))).to(torch.bfloat16)
    pairs = [(F.nvfp4_quantize(x.to(DEVICE), impl="cuda"), F.nvfp4_quantize(x, impl="reference"), "nvfp4"),
             (F.mxfp8_quantize(x.to(DEVICE), rounding="stochastic", seed=5, impl="cuda"),
              F.mxfp8_quantize(x, rounding="stochastic", seed=5, impl="reference"), "mxfp8"),
             (F.s2f6_quantize(x.to(DEVICE), impl="cuda"), F.s2f6_quantize(x, impl="reference"), "s2f6")]
    for actual, expected, what in pairs:
        expected_fields = tensor_fields(expected)
        for name, a in tensor_fields(actual).items():
            e = expected_fields[name]
            assert a.dtype == e.dtype and a.shape == e.shape, f"{what}.{name}: {a.dtype}{tuple(a.shape)} vs " \
                                                                f"{e.dtype}{tuple(e.shape)}"
            assert a.is_contiguous() and a.device.type == "cuda", f"{what}.{name}"
        if what == "nvfp4":
            assert_same_nvfp4(_cpu_nvfp4(actual), expected, what)
        else:
            assert_same_mx(_cpu_mx(actual) if what == "mxfp8" else _cpu_s2f6(actual), expected, what)


def test_quantizers_take_one_strided_row():
    """One row whose row stride is not 16-byte aligned (a row sliced out of a wider tensor, a transposed column): the
    glue hands it to the kernel with the stride K (tests/test_formats.py checks the arguments on the CPU); here the
    codes against the reference."""
    gen = torch.Generator().manual_seed(11)
    for x in (torch.randn(3, 100, generator=gen).to(torch.bfloat16)[1:2, :64], torch.randn(64, 1, generator=gen).T):
        # the same layout on the GPU: a strided view of a copy of the (contiguous) base tensor
        x_cuda = x._base.to(DEVICE).as_strided(x.shape, x.stride(), x.storage_offset())
        assert x_cuda.stride() == x.stride() and torch.equal(x_cuda.cpu(), x)
        assert_same_nvfp4(_cpu_nvfp4(F.nvfp4_quantize(x_cuda, impl="cuda")), F.nvfp4_quantize(x, impl="reference"),
                          "nvfp4 one row")
        assert_same_mx(_cpu_mx(F.mxfp8_quantize(x_cuda, impl="cuda")), F.mxfp8_quantize(x, impl="reference"),
                       "mxfp8 one row")
        assert_same_mx(_cpu_s2f6(F.s2f6_quantize(x_cuda, impl="cuda")), F.s2f6_quantize(x, impl="reference"),
                       "s2f6 one row")


def test_out_of_range_index_is_rejected_and_the_kernel_skips_it():
    """The API rejects indices outside [-1, N); the kernel itself (memory safety) skips them like -1."""
    from ep_comm import _cuda_formats
    s = F.s2f6_quantize(torch.randn(8, 256, device=DEVICE), impl="cuda")
    index = torch.tensor([[0, 8, 3], [100, -1, 2**40]], device=DEVICE)
    clean = torch.tensor([[0, -1, 3], [-1, -1, -1]], device=DEVICE)
    with pytest.raises(ValueError, match="row_index values"):
        F.s2f6_dequantize_accumulate(s, index, impl="cuda")
    assert torch.equal(_cuda_formats.s2f6_dequantize_accumulate(s, index, None, torch.bfloat16),
                       F.s2f6_dequantize_accumulate(s, clean, impl="cuda"))


def test_kernels_follow_the_current_stream():
    """The input is written on the side stream behind a long sleep, then quantized there: a kernel launched on any
    other stream reads it before the copy (zeros). (Without the sleep and the copy this passed whatever stream the
    kernels took: the .cpu() below synchronizes the default stream too.)"""
    x = torch.randn(512, 4096, generator=torch.Generator().manual_seed(506)).to(DEVICE, torch.bfloat16)
    stream = torch.cuda.Stream()
    staged = torch.zeros_like(x)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the copy below lands long after a kernel on another stream ran
        staged.copy_(x)
        q = F.nvfp4_quantize(staged, impl="cuda")
        s = F.s2f6_quantize(staged, impl="cuda")
    stream.synchronize()
    assert_same_nvfp4(_cpu_nvfp4(q), F.nvfp4_quantize(x.cpu(), impl="reference"), "nvfp4 on a side stream")
    assert_same_mx(_cpu_s2f6(s), F.s2f6_quantize(x.cpu(), impl="reference"), "s2f6 on a side stream")
