"""The trainable experts' weight-gradient GEMM (`training_experts._weight_gradient`; csrc/grouped_wgrad.cu on sm_90):
out[e] = a[:, segment e] @ b[:, segment e]^T over each expert's token segment of the contraction axis.

Integer-valued operands make every product and every partial sum exact in FP32, so the kernel must equal the float64
reference exactly whatever its summation order: any misplaced row, column, swizzle chunk or segment shows. Random
operands check the FP32 accumulation against a bound. Segments cover the cases the dispatch layout can give and some
it cannot (boundaries that are not multiples of 8, ends past the columns, decreasing ends): empty experts, an expert
whose segment is cut inside a 16-byte chunk, NaN in the columns no segment covers, more work items than CTAs.
"""
import pytest
import torch

from ep_comm import _ext
from ep_comm import training_experts as te


def _reference(a: torch.Tensor, b: torch.Tensor, ends: list) -> torch.Tensor:
    """float64 [E, M, N] from bf16 a [M, Rp], b [N, Rp]: the segments clamped as the kernel documents."""
    k_total = a.shape[1]
    out = torch.zeros(len(ends), a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    begin = 0
    for e, end in enumerate(ends):
        lo = min(max(begin, 0), k_total)
        hi = min(max(end, lo), k_total)
        if hi > lo:
            out[e] = a[:, lo:hi].double() @ b[:, lo:hi].double().t()
        begin = end
    return out


def _covered(ends: list, k_total: int) -> torch.Tensor:
    """bool [k_total]: the columns some segment covers."""
    covered = torch.zeros(k_total, dtype=torch.bool)
    begin = 0
    for end in ends:
        lo = min(max(begin, 0), k_total)
        covered[lo:min(max(end, lo), k_total)] = True
        begin = end
    return covered


def _operands(m: int, n: int, k_total: int, ends: list, integers: bool, seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    if integers:
        a = torch.randint(-8, 9, (m, k_total), generator=gen).float()
        b = torch.randint(-8, 9, (n, k_total), generator=gen).float()
    else:
        a = torch.randn(m, k_total, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
        b = torch.randn(n, k_total, generator=gen)
    uncovered = ~_covered(ends, k_total)
    a[:, uncovered] = float("nan")  # read by no segment: must not reach the output
    b[:, uncovered] = float("inf")
    return a.to(torch.bfloat16).to(device), b.to(torch.bfloat16).to(device)


# (M, N, columns, segment ends): tile edges (M % 128, N % 256), boundaries inside 16-byte chunks, empty experts,
# ends past the columns and decreasing, 300 work items (more than the CTAs of one launch) over mostly empty experts,
# more experts than the kernel keeps in shared memory, many full work items per CTA.
_CASES = [
    (128, 256, 64, [64]),
    (392, 520, 1000, [0, 96, 96, 640, 992]),
    (136, 264, 1000, [13, 13, 250, 251, 999]),
    (384, 512, 200, [50, 5000]),  # (3 m tiles: a cluster whose second CTA has no rows)
    (128, 256, 256, [200, 100, 256]),
    (1024, 1024, 2048, [512, 1024, 1536, 2048, 2048, 2048]),
    (128, 256, 4096, [0] * 150 + [32 * i for i in range(1, 151)]),
    (128, 256, 1600, [0] * 1000 + [16 * i for i in range(1, 101)]),  # (more experts than the kernel caches: 1024)
    (2048, 2048, 2048, [256 * i for i in range(1, 9)]),  # 512 cluster items: ~8 per cluster, the ring across them
]


def _kernel_available() -> torch.device:
    from ep_comm import grouped_gemm
    device = torch.device("cuda")
    why = grouped_gemm.gemm_kernels_unavailable(device)
    assert not why, why
    assert hasattr(_ext._C, "grouped_wgrad_bf16"), "ep_comm._C has no grouped_wgrad_bf16: nothing would be tested"
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_wgrad_kernel_exact_on_integers(case):
    device = _kernel_available()
    m, n, k_total, ends = _CASES[case]
    a, b = _operands(m, n, k_total, ends, True, case, device)
    group_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    got = te._weight_gradient(a, b, group_ends, torch.float32)
    want = _reference(a, b, ends).float()
    # (values, not bits: a one-column segment's -0 products sum to +0 from the zeroed accumulators, to -0 in torch)
    assert torch.isfinite(got).all() and torch.equal(got, want), \
        f"case {case}: {(got != want).sum().item()} values differ, first at {(got != want).nonzero()[:3].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 1, 2, 5, 6, 8])
def test_wgrad_kernel_accumulates_on_integers(case):
    """accumulate_into: the kernel adds its accumulators into an FP32 buffer (TMA reduce-add) -- integer values, so
    the buffer must equal its old values plus the float64 reference exactly, whatever the master dtype asked for (the
    kernel serves BF16 masters too when it accumulates); nothing past the tensor's edges is touched."""
    device = _kernel_available()
    m, n, k_total, ends = _CASES[case]
    a, b = _operands(m, n, k_total, ends, True, 100 + case, device)
    group_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    before = torch.randint(-4096, 4097, (len(ends) + 1, m, n), generator=torch.Generator().manual_seed(case)).float()
    want = before.to(device)
    want[:len(ends)] += _reference(a, b, ends).float()
    for dtype in (torch.float32, torch.bfloat16):
        buffer = before.to(device)
        assert te._weight_gradient(a, b, group_ends, dtype, accumulate_into=buffer[:len(ends)]) is None
        # (values, not bits: an all -0 product sum adds +0)
        assert torch.equal(buffer, want), f"case {case} {dtype}: {(buffer != want).sum().item()} values differ"
    buffer = before.to(device)[:len(ends)].contiguous()
    empty = torch.zeros(m, 0, dtype=torch.bfloat16, device=device)
    te._weight_gradient(empty, torch.zeros(n, 0, dtype=torch.bfloat16, device=device), group_ends, torch.float32,
                        accumulate_into=buffer)
    assert torch.equal(buffer, before[:len(ends)].to(device)), "no columns: nothing to add"


@pytest.mark.gpu
def test_wgrad_kernel_within_fp32_accumulation_bound(monkeypatch):
    """Random operands: |kernel - float64| <= K 2^-22 (|a| @ |b|^T) per element (FP32 accumulation of exact products,
    with 4x margin over one rounding per add); torch's BF16 path differs from it by its one BF16 rounding only."""
    device = _kernel_available()
    m, n, k_total, ends = 1024, 2304, 3072, [704, 704, 1408, 2904]  # (torch._grouped_mm: 16-byte segments)
    a, b = _operands(m, n, k_total, ends, False, 7, device)
    group_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    got = te._weight_gradient(a, b, group_ends, torch.float32)
    want = _reference(a, b, ends)
    a_abs = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=device)).abs()
    b_abs = torch.where(torch.isfinite(b), b, torch.zeros((), dtype=b.dtype, device=device)).abs()
    bound = _reference(a_abs, b_abs, ends) * (k_total * 2.0 ** -22)
    assert torch.isfinite(got).all()
    excess = ((got.double() - want).abs() - bound).max().item()
    assert excess <= 0, f"error above the FP32 accumulation bound by {excess}"
    monkeypatch.setenv("EP_COMM_WGRAD_GEMM", "torch")
    torch_path = te._weight_gradient(a, b, group_ends, torch.float32)
    assert torch_path.dtype == torch.float32
    assert ((torch_path.double() - got.double()).abs() <= got.double().abs() * 2.0 ** -8 + bound).all()


@pytest.mark.gpu
def test_wgrad_kernel_refuses_bad_arguments():
    device = _kernel_available()
    a = torch.zeros(128, 64, dtype=torch.bfloat16, device=device)
    ends = torch.tensor([64], dtype=torch.int32, device=device)
    out = torch.empty(1, 128, 128, device=device)
    stream = _ext.current_raw_stream(device)
    good = dict(a=a.data_ptr(), lda=64, b=a.data_ptr(), ldb=64, group_ends=ends.data_ptr(), num_experts=1, m_rows=128,
                n_rows=128, k_total=64, out=out.data_ptr(), accumulate=False, stream=stream)
    _ext._C.grouped_wgrad_bf16(**good)
    torch.cuda.synchronize()
    for bad in (dict(lda=60), dict(m_rows=100), dict(k_total=72), dict(a=a.data_ptr() + 2), dict(out=0)):
        with pytest.raises(ValueError, match="grouped_wgrad_bf16"):
            _ext._C.grouped_wgrad_bf16(**{**good, **bad})


@pytest.mark.cpu
def test_weight_gradient_segments_on_cpu():
    """The path without the kernel (CPU here): torch._grouped_mm's BF16 result in the master dtype, segment by
    segment the float64 reference within one BF16 rounding."""
    m, n, k_total, ends = 64, 48, 160, [0, 32, 32, 128]
    a, b = _operands(m, n, k_total, ends, False, 3, "cpu")
    got = te._weight_gradient(a, b, torch.tensor(ends, dtype=torch.int32), torch.float32)
    want = _reference(a, b, ends)
    assert got.dtype == torch.float32 and got.shape == (len(ends), m, n)
    assert not got[0].any() and not got[2].any()
    a_abs, b_abs = torch.nan_to_num(a.float(), nan=0.0).abs(), torch.nan_to_num(b.float(), posinf=0.0).abs()
    bound = _reference(a_abs, b_abs, ends) * (k_total * 2.0 ** -22) + want.abs() * 2.0 ** -8
    assert ((got.double() - want).abs() <= bound).all()
    assert te._weight_gradient(a, b, torch.tensor(ends, dtype=torch.int32), torch.bfloat16).dtype == torch.bfloat16
    # accumulate_into: the same gradient added into an FP32 buffer in place, one addition per element.
    for dtype in (torch.float32, torch.bfloat16):
        buffer = torch.randn(len(ends), m, n)
        want_sum = buffer + te._weight_gradient(a, b, torch.tensor(ends, dtype=torch.int32), dtype).float()
        assert te._weight_gradient(a, b, torch.tensor(ends, dtype=torch.int32), dtype, accumulate_into=buffer) is None
        assert torch.equal(buffer, want_sum)
    with pytest.raises(ValueError, match="accumulate_into must be a contiguous float32"):
        te._weight_gradient(a, b, torch.tensor(ends, dtype=torch.int32), torch.float32,
                            accumulate_into=torch.zeros(len(ends), n, m))
