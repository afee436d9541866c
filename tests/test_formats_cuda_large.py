"""CUDA format kernels at the sizes where 32-bit index arithmetic would overflow, and at the edges of their launch
shapes: element counts past 2^31 (a signed 32-bit element index) with byte offsets past 2^32, the stochastic-rounding
counter past 2^32 and 2^33 (docs/NUMERICS.md: it is the 64-bit flat index, and past 2^33 its pair's high word changes
the block's pair key), gather sources past 2^32 bytes, grids past 65535 CTAs with the shortest rows. Bitwise against the
torch reference, on slices where the full reference would take minutes on the CPU: the rows around each boundary.

Marker `gpu`. Each test asks for what it allocates (up to 14 GiB of device memory) and skips with the reason where the
device has less free.
"""
import gc

import pytest
import torch

from ep_comm import formats as F
from format_cases import assert_same_bytes, assert_same_floats, assert_same_mx, assert_same_nvfp4, make_rows

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
GIB = 2**30
SEED = 2**35 + 17  # a seed with a high word


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _need(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * GIB:
        pytest.skip(f"needs {gib} GiB of free device memory, {free / GIB:.1f} GiB free")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _boundary_rows(num_rows: int, hidden: int, boundaries, width: int = 16):
    """Sorted row indices: the first and last `width` rows and `width` on each side of the row holding each flat
    element index in `boundaries`."""
    rows = set(range(width)) | set(range(num_rows - width, num_rows))
    for b in boundaries:
        r = b // hidden
        rows |= set(range(max(0, r - width), min(num_rows, r + width)))
    return torch.tensor(sorted(rows))


def _mx_blocks_reference(v: torch.Tensor, index0: torch.Tensor, rounding: str, seed: int):
    """MXFP8 of fp32 blocks v [n, 32] whose first elements have flat indices index0 [n] (int64): the reference with the
    SR counter of each block starting at index0 instead of the block's place in v. Returns (codes uint8 [n, 32], scale
    bytes uint8 [n])."""
    m = F._mxfp8_quantize_reference(v, rounding, seed, index=index0[:, None] + torch.arange(32, dtype=torch.int64))
    return m.data.view(torch.uint8), m.scales.view(torch.uint8).reshape(-1)


def _mx_rows_reference(x_rows: torch.Tensor, rows: torch.Tensor, hidden: int, rounding: str, seed: int):
    """MXFP8Tensor of x_rows [n, K] (CPU), rows `rows` of a larger [R, K] input (SR counter row * K + column)."""
    n = x_rows.shape[0]
    index0 = (rows[:, None] * hidden + torch.arange(0, hidden, 32)).reshape(-1)
    codes, scale = _mx_blocks_reference(x_rows.float().reshape(-1, 32), index0, rounding, seed)
    return F.MXFP8Tensor(codes.reshape(n, hidden).view(torch.float8_e4m3fn),
                         scale.reshape(n, hidden // 32).view(torch.float8_e8m0fnu))


def _transposed_reference_blocks(q_rows: F.NVFP4Tensor, row_blocks: torch.Tensor, num_rows: int, seed: int):
    """The transposed requantization (stochastic) of the 32-row blocks starting at rows `row_blocks` of an NVFP4 input
    [num_rows, K]; q_rows holds exactly those rows, block after block. Returns (codes uint8 [K, nb * 32], scale bytes
    uint8 [K, nb]): output rows k, the columns of those blocks."""
    nb = row_blocks.numel()
    dense = F.nvfp4_dequantize(q_rows, impl="reference")  # [nb * 32, K]
    hidden = dense.shape[1]
    v = dense.reshape(nb, 32, hidden).permute(2, 0, 1).reshape(hidden * nb, 32)  # block (k, j): column k of block j
    index0 = (torch.arange(hidden, dtype=torch.int64)[:, None] * num_rows + row_blocks[None, :]).reshape(-1)
    codes, scale = _mx_blocks_reference(v, index0, "stochastic", seed)
    return codes.reshape(hidden, nb * 32), scale.reshape(hidden, nb)


def test_offset_references_match_the_reference():
    """The helpers above (a counter offset the reference has no argument for) against the reference itself where their
    offsets are the reference's own: x [R, K] whole, and every row block of a small transposed input."""
    x = make_rows("wide", 8, 128, seed=1)
    for rounding in ("nearest", "stochastic"):
        assert_same_mx(_mx_rows_reference(x[3:], torch.arange(3, 8), 128, rounding, SEED),
                       _slice_mx(F.mxfp8_quantize(x, rounding=rounding, seed=SEED, impl="reference"), 3),
                       f"offset MX reference {rounding}")
    q = F.nvfp4_quantize(make_rows("outliers", 96, 48, seed=2), impl="reference")
    blocks = torch.tensor([0, 64])
    rows = (blocks[:, None] + torch.arange(32)).reshape(-1)
    codes, scale = _transposed_reference_blocks(_nvfp4_rows(q, rows), blocks, 96, SEED)
    full = F.nvfp4_to_mxfp8_transposed(q, seed=SEED, impl="reference")
    assert_same_bytes(codes, full.data.view(torch.uint8)[:, rows], "transposed block reference codes")
    assert_same_bytes(scale, full.scales.view(torch.uint8)[:, blocks // 32], "transposed block reference scales")


def _cpu_mx(m):
    return type(m)(m.data.cpu(), m.scales.cpu())


def _slice_mx(m, first_row: int):
    return F.MXFP8Tensor(m.data[first_row:], m.scales[first_row:])


def _gather_bytes(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] on the CPU for a tensor of 1-byte elements, gathered as bytes (float8 indexing is not supported
    everywhere)."""
    return t.view(torch.uint8)[index.to(t.device)].cpu().view(t.dtype)


def _nvfp4_rows(q: F.NVFP4Tensor, rows: torch.Tensor) -> F.NVFP4Tensor:
    """Rows `rows` of q (any device) as a CPU NVFP4Tensor."""
    return F.NVFP4Tensor(_gather_bytes(q.data, rows), _gather_bytes(q.scales, rows),
                         q.amax[rows.to(q.amax.device)].cpu(), q.e4m3_max)


def _mx_rows(m, rows: torch.Tensor):
    """Rows `rows` of an MXFP8Tensor or S2F6Tensor (any device) on the CPU."""
    if isinstance(m, F.S2F6Tensor):
        return F.S2F6Tensor(_gather_bytes(m.data, rows), _gather_bytes(m.scales, rows), m.hadamard, m.sign_mask)
    return F.MXFP8Tensor(_gather_bytes(m.data, rows), _gather_bytes(m.scales, rows))


# ----------------------------------------------------------------------------------------------------------
# Counters past 2^32 and 2^33
# ----------------------------------------------------------------------------------------------------------
def test_mxfp8_sr_counter_past_2_33():
    """mxfp8_quantize (SR) of R * K > 2^33 elements: element (r, c) draws rbits(seed, r * K + c) with the 64-bit index
    (a 32-bit one would give row 2^32 / K the bits of row 0; a pair key without the pair's high word, row 2^33 / K those
    of row 0 again). One row broadcast to all (stride 0: no input memory), so rows differ only by their counters and
    all of them have the same scales. The output takes 8.25 GiB."""
    hidden = 4096
    num_rows = 2**33 // hidden + 64
    _need(10)
    row = (make_rows("outliers", 1, hidden, seed=3) * 4).to(torch.bfloat16)
    x = row.to(DEVICE).expand(num_rows, hidden)
    m = F.mxfp8_quantize(x, rounding="stochastic", seed=SEED, impl="cuda")
    assert m.data.shape == (num_rows, hidden)
    scales = m.scales.view(torch.uint8)
    assert bool((scales == scales[:1]).all()), "rows with the same values got different scales"
    rows = _boundary_rows(num_rows, hidden, (2**31, 2**32, 2**33), width=4)
    expected = _mx_rows_reference(row.expand(rows.numel(), hidden), rows, hidden, "stochastic", SEED)
    assert_same_mx(_mx_rows(m, rows), expected, "SR counter past 2^33")


@pytest.mark.parametrize("extra_rows", [96, 128])  # 96: a partial last row tile, scale byte stores; 128: scale words
def test_nvfp4_to_mxfp8_transposed_counter_past_2_33(extra_rows):
    """The transposed requantization of R x K with R * K > 2^33: the output's flat index k * R + r passes 2^32 (in
    output row 2^32 / R) and 2^33 (in the last one), so the kernel takes its per-block pair key path (below 2^33 in all
    it uses one key). Random codes, scales and amaxes (4 GiB in, 8 GiB out); checked for every output row on 32-row
    blocks at the start, at each crossing and at the end. The seed given as a device tensor (the kernel derives that
    path's keys itself) gives the same output, whole."""
    hidden = 2048
    num_rows = 2**33 // hidden + extra_rows
    _need(22)
    g = _generator(5)
    data = torch.randint(0, 256, (num_rows, hidden // 2), dtype=torch.uint8, device=DEVICE, generator=g)
    scales = torch.randint(0x20, 0x70, (num_rows, hidden // 16), dtype=torch.uint8, device=DEVICE, generator=g)
    amax = torch.rand(num_rows, device=DEVICE, generator=g) * 100.0 + 0.5
    q = F.NVFP4Tensor(data, scales.view(torch.float8_e4m3fn), amax, F.NVFP4_ACTIVATION_E4M3_MAX)
    m = F.nvfp4_to_mxfp8_transposed(q, rounding="stochastic", seed=SEED, impl="cuda")
    assert m.data.shape == (hidden, num_rows)
    blocks = {0, 32, 64, 96, 128, num_rows - 128, num_rows - 96, num_rows - 64, num_rows - 32}
    for boundary in (2**32, 2**33):
        k = boundary // num_rows  # the output row holding the crossing
        r = (boundary - k * num_rows) // 32 * 32
        blocks |= {b for b in (r - 64, r - 32, r, r + 32, r + 64) if 0 <= b <= num_rows - 32}
    blocks = torch.tensor(sorted(blocks))
    rows = (blocks[:, None] + torch.arange(32)).reshape(-1)
    codes, scale = _transposed_reference_blocks(_nvfp4_rows(q, rows), blocks, num_rows, SEED)
    assert_same_bytes(m.data.view(torch.uint8)[:, rows.to(DEVICE)].cpu(), codes, "transposed codes past 2^33")
    assert_same_bytes(m.scales.view(torch.uint8)[:, (blocks // 32).to(DEVICE)].cpu(), scale,
                      "transposed scales past 2^33")
    seed_tensor = torch.tensor(SEED, dtype=torch.int64, device=DEVICE)  # (SEED < 2^63: its int64 bits are itself)
    again = F.nvfp4_to_mxfp8_transposed(q, rounding="stochastic", seed=seed_tensor, impl="cuda")
    assert torch.equal(again.data.view(torch.uint8), m.data.view(torch.uint8)), "seed tensor: other codes past 2^33"
    assert torch.equal(again.scales.view(torch.uint8), m.scales.view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------
# More than 2^31 elements (byte offsets past 2^32)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4_46", "nvfp4_plain", "mxfp8_sr", "s2f6"])
def test_quantize_and_dequantize_past_2_31_elements(fmt):
    """Quantize a random bf16 [R, K] of R * K > 2^31 elements (4 GiB: input byte offsets past 2^32), then dequantize it
    to bf16 (output element index past 2^31, byte offsets past 2^32); the rows around 2^30, 2^31 and the ends against
    the reference of those rows."""
    hidden = 2048
    num_rows = 2**31 // hidden + 64
    _need(11)
    x = torch.randn(num_rows, hidden, dtype=torch.bfloat16, device=DEVICE, generator=_generator(7))
    rows = _boundary_rows(num_rows, hidden, (2**30, 2**31))
    index = rows.to(DEVICE)
    x_rows = x[index].cpu()
    if fmt.startswith("nvfp4"):
        four_over_six = fmt == "nvfp4_46"
        q = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="cuda")
        del x
        expected = F.nvfp4_quantize(x_rows, four_over_six=four_over_six, impl="reference")
        assert_same_nvfp4(_nvfp4_rows(q, rows), expected, f"{fmt} past 2^31 elements")
        out = F.nvfp4_dequantize(q, dtype=torch.bfloat16, impl="cuda")
        reference_out = F.nvfp4_dequantize(expected, dtype=torch.bfloat16, impl="reference")
    elif fmt == "mxfp8_sr":
        m = F.mxfp8_quantize(x, rounding="stochastic", seed=SEED, impl="cuda")
        del x
        expected = _mx_rows_reference(x_rows, rows, hidden, "stochastic", SEED)
        assert_same_mx(_mx_rows(m, rows), expected, "mxfp8 past 2^31 elements")
        out = F.mxfp8_dequantize(m, dtype=torch.bfloat16, impl="cuda")
        reference_out = F.mxfp8_dequantize(expected, dtype=torch.bfloat16, impl="reference")
    else:
        s = F.s2f6_quantize(x, impl="cuda")
        del x
        expected = F.s2f6_quantize(x_rows, impl="reference")
        assert_same_mx(_mx_rows(s, rows), expected, "s2f6 past 2^31 elements")
        out = F.s2f6_dequantize(s, dtype=torch.bfloat16, impl="cuda")
        reference_out = F.s2f6_dequantize(expected, dtype=torch.bfloat16, impl="reference")
    assert out.shape == (num_rows, hidden)
    assert_same_floats(out[index].cpu(), reference_out, f"{fmt} dequantize past 2^31 elements")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_s2f6_accumulate_sources_past_2_32_bytes(index_dtype):
    """dequantize_accumulate gathering from an S2F6 tensor of N * K > 2^32 code bytes (random codes and scales, 4 GiB):
    every output row's first term reads one of the last 1024 source rows (code offset src * K past 2^32), the others
    anywhere or nowhere (-1); 70000 output rows (280000 warp units over the persistent grid)."""
    hidden = 2048
    num_src = 2**32 // hidden + 32
    num_out, num_terms = 70000, 4
    _need(6)
    g = _generator(11)
    data = torch.randint(-128, 128, (num_src, hidden), dtype=torch.int8, device=DEVICE, generator=g)
    scales = torch.randint(100, 140, (num_src, hidden // 32), dtype=torch.uint8, device=DEVICE, generator=g)
    s = F.S2F6Tensor(data, scales.view(torch.float8_e8m0fnu), hadamard=True)
    index = torch.randint(-1, num_src, (num_out, num_terms), device=DEVICE, generator=g)
    index[:, 0] = torch.randint(num_src - 1024, num_src, (num_out,), device=DEVICE, generator=g)
    weights = torch.rand(num_out, num_terms, device=DEVICE, generator=g)
    out = F.s2f6_dequantize_accumulate(s, index.to(index_dtype), weights, impl="cuda")
    assert out.shape == (num_out, hidden)
    check = torch.cat([torch.arange(64), torch.arange(num_out // 2 - 32, num_out // 2 + 32),
                       torch.arange(num_out - 64, num_out)])
    check_index = index[check.to(DEVICE)].cpu()
    used = torch.unique(check_index[check_index >= 0])  # sorted
    sub = F.S2F6Tensor(data[used.to(DEVICE)].cpu(), scales[used.to(DEVICE)].cpu().view(torch.float8_e8m0fnu),
                       hadamard=True)
    local = torch.where(check_index >= 0, torch.searchsorted(used, check_index.clamp(min=0)), -1)
    expected = F.s2f6_dequantize_accumulate(sub, local, weights[check.to(DEVICE)].cpu(), impl="reference")
    assert_same_floats(out[check.to(DEVICE)].cpu(), expected, f"accumulate from sources past 2^32 bytes {index_dtype}")


# ----------------------------------------------------------------------------------------------------------
# Many rows of the shortest lengths
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("four_over_six", [True, False])
def test_nvfp4_many_shortest_rows_with_row_limit(four_over_six):
    """2^19 + 5 rows of K = 16 (one block per row, 8 rows per CTA: 65537 CTAs, past a y grid's limit; one thread per
    block in dequantize, the row division by 1) with a device row limit: rows below it bitwise the reference's, the rest
    untouched."""
    from ep_comm import _ext
    lib = _ext.require_cuda_extension("test")
    num_rows, hidden = 2**19 + 5, 16
    limit_rows = num_rows - 3
    m = F.NVFP4_ACTIVATION_E4M3_MAX if four_over_six else F.NVFP4_WEIGHT_E4M3_MAX
    x = make_rows("outliers", num_rows, hidden, seed=13).to(torch.bfloat16)
    expected = F.nvfp4_quantize(x, four_over_six=four_over_six, impl="reference")
    xd = x.to(DEVICE)
    limit = torch.tensor([limit_rows], dtype=torch.int32, device=DEVICE)
    data = torch.full((num_rows, hidden // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((num_rows, hidden // 16), 0xCD, dtype=torch.uint8, device=DEVICE)
    amax = torch.full((num_rows,), -1.0, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream
    lib.nvfp4_quantize(xd.data_ptr(), lib.ELEM_BFLOAT16, hidden, num_rows, hidden, 0, m, four_over_six,
                       data.data_ptr(), hidden // 2, scales.data_ptr(), hidden // 16, amax.data_ptr(), 0, stream,
                       limit.data_ptr())
    got = F.NVFP4Tensor(data.cpu(), scales.cpu().view(torch.float8_e4m3fn), amax.cpu(), m)
    below = slice(0, limit_rows)
    assert_same_nvfp4(F.NVFP4Tensor(got.data[below], got.scales[below], got.amax[below], m),
                      F.NVFP4Tensor(expected.data[below], expected.scales[below], expected.amax[below], m),
                      "nvfp4 short rows below the limit")
    assert (got.data[limit_rows:] == 0xAB).all() and (got.scales.view(torch.uint8)[limit_rows:] == 0xCD).all()
    assert (got.amax[limit_rows:] == -1.0).all(), "rows past the limit written"
    out = torch.full((num_rows, hidden), -7.0, device=DEVICE)
    lib.nvfp4_dequantize(data.data_ptr(), scales.data_ptr(), amax.data_ptr(), num_rows, hidden, m, out.data_ptr(),
                         lib.ELEM_FLOAT32, stream, limit.data_ptr())
    out = out.cpu()
    assert_same_floats(out[below], F.nvfp4_dequantize(expected, impl="reference")[below], "nvfp4 short rows dequantize")
    assert (out[limit_rows:] == -7.0).all(), "dequantize wrote rows past the limit"


def test_many_shortest_rows_mxfp8_s2f6_and_transposed():
    """K = 32 (MXFP8, S2F6: one block, a one-segment row: the row division by 1) over 2^19 + 3 rows (65537 S2F6 CTAs),
    and K = 16 (the transposed requantization: one column block) over 2^17 rows; whole outputs bitwise."""
    num_rows, hidden = 2**19 + 3, 32
    x = make_rows("wide", num_rows, hidden, seed=17)
    xd = x.to(DEVICE)
    for rounding in ("nearest", "stochastic"):
        assert_same_mx(_cpu_mx(F.mxfp8_quantize(xd, rounding=rounding, seed=SEED, impl="cuda")),
                       F.mxfp8_quantize(x, rounding=rounding, seed=SEED, impl="reference"), f"mxfp8 K=32 {rounding}")
    s = F.s2f6_quantize(xd, impl="cuda")
    expected = F.s2f6_quantize(x, impl="reference")
    assert_same_mx(F.S2F6Tensor(s.data.cpu(), s.scales.cpu(), s.hadamard, s.sign_mask), expected, "s2f6 K=32")
    assert_same_floats(F.s2f6_dequantize(s, impl="cuda").cpu(), F.s2f6_dequantize(expected, impl="reference"),
                       "s2f6 dequantize K=32")
    g = torch.Generator().manual_seed(19)
    index = torch.randint(-1, num_rows, (num_rows + 2, 2), generator=g)
    weights = torch.rand(num_rows + 2, 2, generator=g)
    assert_same_floats(F.s2f6_dequantize_accumulate(s, index.to(DEVICE), weights.to(DEVICE), impl="cuda").cpu(),
                       F.s2f6_dequantize_accumulate(expected, index, weights, impl="reference"),
                       "s2f6 accumulate K=32")
    q = F.nvfp4_quantize(make_rows("outliers", 2**17, 16, seed=23), impl="reference")
    q_cuda = F.NVFP4Tensor(q.data.to(DEVICE), q.scales.to(DEVICE), q.amax.to(DEVICE), q.e4m3_max)
    assert_same_mx(_cpu_mx(F.nvfp4_to_mxfp8_transposed(q_cuda, seed=SEED, impl="cuda")),
                   F.nvfp4_to_mxfp8_transposed(q, seed=SEED, impl="reference"), "transposed K=16")

