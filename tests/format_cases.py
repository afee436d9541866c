"""Shared inputs and bitwise comparisons for the format tests (CPU emulation and CUDA kernels)."""
import math

import torch

from ep_comm import formats as F


def require_format_kernels(device) -> None:
    """Raise unless the CUDA format kernels run on `device`. A GPU test that calls an impl="auto" entry point and
    compares it with the torch reference must call this first: where the kernels cannot run (no ep_comm._C, no kernel
    image for the GPU) impl="auto" takes that same reference with only a warning, and the test would compare the
    reference with itself."""
    F._use_cuda("cuda", torch.empty(1, device=device))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def tensor_fields(container) -> dict:
    """A format container's tensor fields by name (NVFP4: data, scales, amax; MXFP8 and S2F6: data, scales)."""
    return {name: value for name, value in vars(container).items() if isinstance(value, torch.Tensor)}


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str):
    a, e = as_bytes(actual), as_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if not torch.equal(a, e):
        bad = (a != e).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {(a != e).sum().item()} bytes differ, first at {bad}")


def assert_same_floats(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Bitwise equality of float tensors, treating any NaN as equal to any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    int_type = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    a = torch.where(nan_a, torch.zeros_like(actual), actual).view(int_type)
    e = torch.where(nan_e, torch.zeros_like(expected), expected).view(int_type)
    if not torch.equal(a, e):
        idx = (a != e).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {(a != e).sum().item()} values differ, first at {idx}: "
                             f"{[actual[tuple(i)].item() for i in idx]} vs {[expected[tuple(i)].item() for i in idx]}")


def assert_same_nvfp4(actual: F.NVFP4Tensor, expected: F.NVFP4Tensor, what: str):
    assert_same_bytes(actual.data, expected.data, f"{what} data")
    assert_same_bytes(actual.scales, expected.scales, f"{what} scales")
    assert_same_floats(actual.amax, expected.amax, f"{what} amax")
    assert actual.e4m3_max == expected.e4m3_max


def assert_same_mx(actual, expected, what: str):
    assert_same_bytes(actual.data, expected.data, f"{what} data")
    assert_same_bytes(actual.scales, expected.scales, f"{what} scales")


def float_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of 32-bit patterns given as int64 (unsigned 0 .. 2^32 - 1 or signed -2^31 .. 2^31 - 1)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def random_bit_floats(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64)
    return float_from_bits(bits)


def special_floats() -> torch.Tensor:
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38,
              -3.4028235e38, 448.0, 464.0, 465.0, 480.0, 6.0, 5.0, 2.5, 0.25, 0.75, 1.75, 3.5, 1.25]
    special = torch.tensor(values, dtype=torch.float32)
    signalling_nan = float_from_bits(torch.tensor([0x7F800001, 0xFF800001, 0x7FBFFFFF]))
    return torch.cat([special, signalling_nan])


def e4m3_tie_points() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours (RNE ties) and the fp32 values just around them."""
    grid = F.e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8)).double()  # 0 .. 448, NaN excluded
    mids = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, mids, torch.tensor([464.0, 465.0])]).float()
    up = torch.nextafter(points, torch.tensor(math.inf))
    down = torch.nextafter(points, torch.tensor(-math.inf))
    all_points = torch.cat([points, up, down])
    return torch.cat([all_points, -all_points])


def make_rows(kind: str, num_rows: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g)
    if kind == "gauss":
        return x
    if kind == "outliers":
        mask = torch.rand(num_rows, hidden, generator=g) < 0.002
        return torch.where(mask, x * 300.0, x)
    if kind == "outlier_columns":  # every 97th channel 30x (LLM activations' massive channels): exact 4/6 ties
        x[:, ::97] *= 30.0
        return x
    if kind == "wide":  # magnitudes spread over many binades, per element
        return x * torch.exp2(torch.randint(-40, 40, (num_rows, hidden), generator=g).float())
    if kind == "tiny":
        return x * 1e-36
    if kind == "huge":
        return x * 1e36
    if kind == "bits":
        # Each row in its own binade (2^-60 .. 2^60), its 16-blocks up to 2^-20 below it; 1% of the elements replaced by
        # raw special bit patterns: NaN payloads of either sign and fp32 subnormals everywhere, +-0, and +-Inf in every
        # fourth row only (an Inf makes the row amax Inf, which sends its whole row to the general form).
        row_scale = torch.exp2(torch.randint(-60, 61, (num_rows, 1, 1), generator=g).float())
        block_scale = torch.exp2(-torch.randint(0, 21, (num_rows, hidden // 16, 1), generator=g).float())
        x = (x.reshape(num_rows, -1, 16) * row_scale * block_scale).reshape(num_rows, hidden)
        kind_of = torch.randint(0, 4, (num_rows, hidden), generator=g)
        payload = torch.randint(1, 2**23, (num_rows, hidden), generator=g, dtype=torch.int64)
        negative = torch.randint(0, 2, (num_rows, hidden), generator=g, dtype=torch.int64)
        bits = torch.where(kind_of == 0, 0x7F800000 | payload,                    # NaN, any payload
               torch.where(kind_of == 1, payload,                                  # subnormal
               torch.where(kind_of == 2, 0, 0x7F800000)))                          # zero, Inf
        inf_allowed = (torch.arange(num_rows) % 4 == 0)[:, None]
        bits = torch.where((kind_of == 3) & ~inf_allowed, payload, bits)        # no Inf: another subnormal
        special = float_from_bits(bits | (negative << 31))
        return torch.where(torch.rand(num_rows, hidden, generator=g) < 0.01, special, x)
    raise ValueError(kind)


def edge_rows(hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(12, hidden, generator=g)
    rows = [
        torch.zeros(hidden),
        -torch.zeros(hidden),
        base[0] * 1e-40,                       # fp32 subnormals
        base[1] * 1e-30,
        torch.where(torch.arange(hidden) == 5, torch.tensor(1e4), base[2]),  # one outlier
        torch.where(torch.arange(hidden) % 97 == 3, torch.tensor(math.nan), base[3]),
        torch.where(torch.arange(hidden) % 89 == 1, torch.tensor(math.inf), base[4]),
        torch.where(torch.arange(hidden) % 83 == 2, torch.tensor(-math.inf), base[5]),
        torch.full((hidden,), math.nan),
        base[6] * 3e38,
        torch.where(torch.arange(hidden) < 16, torch.tensor(0.0), base[7]),  # a zero block in a normal row
        torch.where(torch.arange(hidden) % 2 == 0, -0.0, base[8] * 1e-3),
        torch.where(torch.arange(hidden) % 61 == 0, -torch.tensor(math.nan), base[9]),  # negative NaN
    ]
    return torch.stack(rows)


def adversarial_four_over_six_blocks(g: torch.Generator) -> torch.Tensor:
    """[N, 16] blocks: random, ties between the two candidates, E4M3 scale boundaries, all-equal, outliers,
    subnormal-range, coarse (bf16 / small-integer) values."""
    blocks = []
    n = 4096
    blocks.append(torch.randn(n, 16, generator=g))
    blocks.append(torch.randn(n, 16, generator=g).to(torch.bfloat16).float())
    blocks.append(torch.randint(-6, 7, (n, 16), generator=g).float())               # many exact ties
    blocks.append(torch.randint(-12, 13, (n, 16), generator=g).float() * 0.25)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.75, 2.25, 4.5, 9])            # both candidates' grids
    blocks.append(grid[torch.randint(0, len(grid), (n, 16), generator=g)] * torch.where(
        torch.rand(n, 16, generator=g) < 0.5, -1.0, 1.0))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.375, 1.125, 1.875, 2.625, 3.75, 5.25, 6.0])
    blocks.append(mids[torch.randint(0, len(mids), (n, 16), generator=g)])        # rounding ties
    equal = torch.exp2(torch.empty(n, 1).uniform_(-30, 30, generator=g)) * torch.rand(n, 1, generator=g)
    blocks.append(equal.expand(n, 16).clone())                                    # all-equal
    outlier = torch.randn(n, 16, generator=g) * 1e-3
    outlier[:, 0] = 1.0
    blocks.append(outlier[:, torch.randperm(16, generator=g)])
    lone = torch.zeros(n, 16)
    lone[:, 5] = torch.exp2(torch.empty(n).uniform_(-20, 20, generator=g))
    blocks.append(lone)
    blocks.append(torch.randn(n, 16, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 16), generator=g).float()))
    blocks.append(torch.zeros(64, 16))
    blocks.append(torch.randn(n, 16, generator=g) * 1e-40)                          # fp32 subnormals
    return torch.cat(blocks)


def four_over_six_amax_cases(x: torch.Tensor, g: torch.Generator):
    """Per-block outer amax (finite float32; a non-finite case becomes 0): the block's own, larger (small /
    subnormal E4M3 block scales, scale-boundary ratios), and stale smaller ones."""
    own = x.abs().amax(dim=-1)
    n = x.shape[0]
    tie_ratios = e4m3_tie_points()
    tie_ratios = tie_ratios[(tie_ratios > 0) & (tie_ratios < 460)]
    # base = f(a_b / 6) * f(1536 / amax) lands at or next to an E4M3 rounding boundary (for s6 or s4).
    pick = tie_ratios[torch.randint(0, len(tie_ratios), (n,), generator=g)]
    for_s4 = torch.rand(n, generator=g) < 0.5
    boundary = own * 256.0 / torch.where(for_s4, pick / 1.5, pick)
    cases = [
        own,
        own * torch.exp2(torch.empty(n).uniform_(0, 20, generator=g)),
        own * torch.exp2(torch.empty(n).uniform_(8, 12, generator=g)),   # E4M3-subnormal block scales
        boundary,
        own * torch.empty(n).uniform_(0.05, 1.0, generator=g),           # stale (smaller) amax: saturation
    ]
    return [torch.where(torch.isfinite(a), a, torch.zeros_like(a)).float() for a in cases]


def sr_fast_path_limit_blocks() -> torch.Tensor:
    """MXFP8 blocks at the limits of the kernels' fast SR form (sr_e4m3_fast / sr_fast_block_ok, qm_mxfp8_sr.cuh),
    one per row of 32: scale byte 156 (the last fast one) and 157, the one finite amax whose block needs the clamp
    (0x1.c00002p-119), fp32-subnormal inputs, values that scale into the E4M3 subnormal range or below 2^-126,
    zeros of both signs, and Inf / NaN blocks (general form)."""
    g = torch.Generator().manual_seed(61)
    rows = []
    for amax in (448.0 * 2**29, 448.0 * 2**29 * 1.5, float.fromhex("0x1.c00002p-119"), 2.0**-130, 1.0, 448.0,
                 3.0e38):
        row = (torch.rand(32, generator=g) * 2 - 1) * amax
        row[0] = amax
        row[1:8] = row[1:8] * torch.tensor([1e-3, 1e-5, 1e-7, 1e-30, 1e-40, 0.0, -0.0])
        rows.append(row)
    rows.append(torch.tensor([1.0, 1e-45, -1e-45, 2.0**-133, 2.0**-140] + [0.0, -0.0] * 13 + [2.0**-7]))
    rows.append(torch.tensor([0.0, -0.0] * 16))
    rows.append(torch.tensor([math.inf] + [1.0] * 30 + [1e-20]))
    rows.append(torch.tensor([math.nan] + [1.0] * 30 + [1e-20]))
    return torch.stack(rows).float()
