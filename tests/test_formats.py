"""The torch reference formats: FORMATS-RESEARCH.md §14 test vectors, error bounds, SR, edge cases, bad input."""
import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from ep_comm import formats as F
from format_cases import tensor_fields

pytestmark = pytest.mark.cpu


def _hex_bytes(t):
    return [int(v) for v in t.reshape(-1).view(torch.uint8)]


def test_e2m1_vectors():
    inputs = [0.25, float.fromhex("0x1.000002p-2"), 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 7.0, -0.1, -0.25,
              -2.5, -5.0, -6.5, math.inf, -math.inf, math.nan, -0.0]
    expected = [0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7, 0x8, 0x8, 0xC, 0xE, 0xF, 0x7, 0xF, 0x7, 0x8]
    assert F.e2m1_encode(torch.tensor(inputs)).tolist() == expected
    # Packing: (1.0, -3.0) -> 0xD2 (lower index in the low nibble).
    q = F.nvfp4_quantize(torch.tensor([[1.0, -3.0, 6.0] + [0.0] * 13]), four_over_six=False, amax=torch.tensor(2688.0))
    assert int(q.data[0, 0]) == 0xD2


def test_e4m3_vectors():
    inputs = [448, 464, 465, 480, 1e6, math.inf, -math.inf, math.nan, 96, 9, 17, 19, 1.0, 2**-6, 2**-9, 2**-10,
              1.5 * 2**-10, 0.1, -0.3, 250, -0.0]
    expected = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x6C, 0x51, 0x58, 0x5A, 0x38, 0x08, 0x01, 0x00,
                0x01, 0x1D, 0xAA, 0x78, 0x80]
    assert F.e4m3_encode(torch.tensor(inputs)).tolist() == expected


def test_ue8m0_mxfp8_scale_vectors():
    inputs = [448, 449, 500, 392, 784, 1.0, 448 * 2**-20, 0.0, math.inf, math.nan]
    expected = [0x7F, 0x80, 0x80, 0x7F, 0x80, 0x77, 0x6B, 0x00, 0xFE, 0xFF]
    assert F.ue8m0_mxfp8_scale(torch.tensor(inputs)).tolist() == expected
    assert F.ue8m0_decode(torch.tensor([0x00, 0x7F, 0x80, 0xFE], dtype=torch.uint8)).tolist() == [
        2.0**-127, 1.0, 2.0, 2.0**127]
    assert math.isnan(F.ue8m0_decode(torch.tensor([0xFF], dtype=torch.uint8)).item())
    # The scale helpers take what the element encoders take (float64 would be rounded twice; a list was an
    # AttributeError), and their documented NaN / sign rules hold.
    for helper in (F.ue8m0_mxfp8_scale, F.ue8m0_s2f6_scale):
        for bad in (torch.tensor([1.0], dtype=torch.float64), [1.0], torch.tensor([1])):
            with pytest.raises(TypeError, match=helper.__name__):
                helper(bad)
    assert F.ue8m0_mxfp8_scale(torch.tensor([-448.0, math.nan])).tolist() == [0x7F, 0xFF]
    # sr_key checks its seed as rbits does (2**64 + 5 was masked to 5 silently, -1 read as 2**64 - 1).
    for bad, error in ((-1, ValueError), (2**64 + 5, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="seed must be an int"):
            F.sr_key(bad)
    assert F.ue8m0_s2f6_scale(torch.tensor([-1.0, 1.0, math.nan, math.inf])).tolist() == [0x7F, 0x7F, 0xFE, 0xFE]


def test_nvfp4_block_examples():
    x = torch.tensor([[-54, 5.4, 0, 1, -1, 2.2, 3.3, 12, -13.5, 27, 40, -0.9, 0.5, 7.7, -20, 0.01]])
    q = F.nvfp4_quantize(x, four_over_six=False, amax=torch.tensor(2688.0))
    assert _hex_bytes(q.scales) == [0x51]
    assert _hex_bytes(q.data) == [0x1F, 0x00, 0x08, 0x31, 0x5B, 0x86, 0x20, 0x0C]
    assert F.nvfp4_dequantize(q)[0].tolist() == [-54, 4.5, 0, 0, 0, 0, 4.5, 13.5, -13.5, 27, 36, 0, 0, 9, -18, 0]

    x2 = torch.tensor([[0.3125, -1.7, 0.05, 2.9, -0.61, 0, 1.1, -3.3, 0.22, 0.9, -0.15, 1.45, -2.2, 0.7, 0.33,
                        -0.04]])
    q = F.nvfp4_quantize(x2, four_over_six=False, amax=torch.tensor(10.0))
    assert _hex_bytes(q.scales) == [0x71]
    assert _hex_bytes(q.data) == [0xD1, 0x70, 0x0A, 0xF4, 0x31, 0x59, 0x3E, 0x81]
    bf16_bits = F.nvfp4_dequantize(q, dtype=torch.bfloat16).view(torch.int16)[0, :8].to(torch.int32) & 0xFFFF
    assert bf16_bits.tolist() == [0x3E89, 0xBFCE, 0x0000, 0x404E, 0xBF09, 0x0000, 0x3F89, 0xC04E]
    # The block holds the row max: its scale saturates to 448 (0x7E), same codes.
    q = F.nvfp4_quantize(x2, four_over_six=False)
    assert _hex_bytes(q.scales) == [0x7E] and _hex_bytes(q.data) == [0xD1, 0x70, 0x0A, 0xF4, 0x31, 0x59, 0x3E, 0x81]


def test_nvfp4_edge_blocks():
    zero = F.nvfp4_quantize(torch.zeros(1, 16), four_over_six=False, amax=torch.tensor(5.0))
    assert _hex_bytes(zero.scales) == [0] and _hex_bytes(zero.data) == [0] * 8
    tiny = F.nvfp4_quantize(torch.tensor([[1e-6] + [0.0] * 15]), four_over_six=False, amax=torch.tensor(1000.0))
    assert _hex_bytes(tiny.scales) == [0] and (tiny.data[0, 0] & 0xF) == 0x7
    assert F.nvfp4_dequantize(tiny).abs().max() == 0
    sub = F.nvfp4_quantize(torch.tensor([[3e-3] + [0.0] * 15]), four_over_six=False, amax=torch.tensor(1000.0))
    assert _hex_bytes(sub.scales) == [0x01] and (sub.data[0, 0] & 0xF) == 0x6
    down = F.nvfp4_quantize(torch.tensor([[55.2, 30] + [0.0] * 14]), four_over_six=False,
                            amax=torch.tensor(2688.0))
    assert F.nvfp4_dequantize(down)[0, :2].tolist() == [54.0, 27.0]


@pytest.mark.parametrize("block, scale, packed", [
    ([10, 9, 8.5, 7.5, 5, -2.5, 1.25, 0, -10, 3, 2, -1, 0.6, 6.2, -4.4, 0.3], 0x3D,
     [0x77, 0x67, 0xB5, 0x02, 0x4F, 0x92, 0x61, 0x0D]),     # block A: map-6 under MSE (map-4 under MAE)
    ([10, 8, 7.6, -8.4, 5, 2.5, -7.5, 9, 1, 0, -5, 7.5, 2, 0.5, -9.5, 4], 0x42,
     [0x56, 0xD5, 0x24, 0x6D, 0x01, 0x5C, 0x02, 0x3E]),     # block C: map-4
    ([10, 2.9, 1.6, 0.9, 0.45, -0.2, 3.1, -1.4, 0, 5.2, -0.7, 1.1, 0.35, -2.6, 0.8, 0.05], 0x3D,
     [0x47, 0x12, 0x81, 0xA4, 0x50, 0x19, 0xB0, 0x01]),     # block B: map-6
])
def test_four_over_six_vectors(block, scale, packed):
    q = F.nvfp4_quantize(torch.tensor([block]), four_over_six=True, amax=torch.tensor(1536.0))
    assert q.e4m3_max == 256.0
    assert _hex_bytes(q.scales) == [scale] and _hex_bytes(q.data) == packed


@pytest.mark.parametrize("c, scale, codes", [
    (500, 0x80, "f8 f7 f6 f5 f4 f3 f2 f1 ef ed eb e9 e6 e2 dc d0 50 5c 62 66 69 6b 6d 6f 71 72 73 74 75 76 77 78"),
    (300, 0x7F, "f9 f9 f8 f7 f6 f5 f3 f2 f1 f0 ed eb e8 e4 df d2 52 5f 64 68 6b 6d 70 71 72 73 75 76 77 78 79 79"),
    (0.0035, 0x6F, "f6 f5 f4 f4 f3 f2 f1 f0 ee ec ea e8 e5 e1 db cf 4f 5b 61 65 68 6a 6c 6e 70 71 72 73 74 74 75 76"),
])
def test_mxfp8_vectors(c, scale, codes):
    v = torch.tensor([(i - 15.5) / 15.5 * c for i in range(32)], dtype=torch.float64).float()[None]
    m = F.mxfp8_quantize(v)
    assert _hex_bytes(m.scales) == [scale]
    assert _hex_bytes(m.data) == [int(h, 16) for h in codes.split()]
    zero = F.mxfp8_quantize(torch.zeros(1, 32))
    assert _hex_bytes(zero.scales) == [0] and _hex_bytes(zero.data) == [0] * 32


def _hadamard32():
    return torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(32)] for i in range(32)], dtype=torch.float64)


def test_rht_matches_matrix_and_inverts():
    ramp = F.rht(torch.arange(32.0)[None], sign_mask=0)[0]
    expected = torch.zeros(32)
    expected[[0, 1, 2, 4, 8, 16]] = torch.tensor([496.0, -16, -32, -64, -128, -256]) / math.sqrt(32)
    assert torch.allclose(ramp, expected, atol=1e-5)
    x = torch.randn(7, 96, dtype=torch.float32, generator=torch.Generator().manual_seed(114))
    signs = torch.tensor([-1.0 if (F.DEFAULT_SIGN_MASK >> i) & 1 else 1.0 for i in range(32)], dtype=torch.float64)
    chunks = x.double().reshape(7, 3, 32) * signs
    want = (chunks @ _hadamard32().T / math.sqrt(32)).reshape(7, 96)
    assert (F.rht(x).double() - want).abs().max() < 1e-5
    assert (F.inverse_rht(F.rht(x)) - x).abs().max() < 1e-5
    assert F.rht(torch.tensor([[1.0] + [0.0] * 31]), sign_mask=0)[0].tolist() == [F._f32(1 / math.sqrt(32), "cpu")
                                                                                   .item()] * 32


def test_s2f6_vectors_and_scale_rule():
    s = F.s2f6_quantize(torch.tensor([[1.0, -1.0, 0.3, -0.3, 0.5, -0.5] + [0.0] * 26]), hadamard=False)
    assert _hex_bytes(s.scales) == [0x7F] and s.data[0, :6].tolist() == [64, -64, 19, -19, 32, -32]
    # 127/64 fits scale 1; anything above moves to scale 2 (the block never saturates).
    assert _hex_bytes(F.s2f6_quantize(torch.tensor([[1.984375] + [0.0] * 31]), hadamard=False).scales) == [0x7F]
    assert _hex_bytes(F.s2f6_quantize(torch.tensor([[1.9844] + [0.0] * 31]), hadamard=False).scales) == [0x80]
    zero = F.s2f6_quantize(torch.zeros(1, 32), hadamard=False)
    assert _hex_bytes(zero.scales) == [0] and zero.data.abs().sum() == 0
    # Ties to even: 0.5/64 -> 0, 1.5/64 -> 2 (in units of 1/64).
    ties = F.s2f6_quantize(torch.tensor([[1.0, 0.0078125, 0.0234375] + [0.0] * 29]), hadamard=False)
    assert ties.data[0, 1:3].tolist() == [0, 2]


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_round_trip_error_bounds(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(64, hidden, generator=gen)
    x.view(-1)[torch.randint(0, x.numel(), (x.numel() // 1000,), generator=gen)] *= 30.0  # outliers

    def rel(y):
        return ((y - x).norm() / x.norm()).item()

    nvfp4_46 = rel(F.nvfp4_dequantize(F.nvfp4_quantize(x)))
    nvfp4_plain = rel(F.nvfp4_dequantize(F.nvfp4_quantize(x, four_over_six=False)))
    mxfp8 = rel(F.mxfp8_dequantize(F.mxfp8_quantize(x)))
    s2f6_rht = rel(F.s2f6_dequantize(F.s2f6_quantize(x, hadamard=True)))
    s2f6_plain = rel(F.s2f6_dequantize(F.s2f6_quantize(x, hadamard=False)))
    assert nvfp4_46 < nvfp4_plain < 0.12
    assert mxfp8 < 0.04
    # DESIGN.md §6: RHT+S2F6 <= 1.5% and no worse than MXFP8 without RHT.
    assert s2f6_rht <= 0.015 and s2f6_rht <= mxfp8
    assert s2f6_rht < s2f6_plain


def test_mxfp8_stochastic_rounding_deterministic_and_unbiased():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=gen)
    a = F.mxfp8_quantize(x, rounding="stochastic", seed=11)
    b = F.mxfp8_quantize(x, rounding="stochastic", seed=11)
    c = F.mxfp8_quantize(x, rounding="stochastic", seed=12)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert not torch.equal(a.data.view(torch.uint8), c.data.view(torch.uint8))
    # Unbiased: the mean over seeds converges to x (RNE stays biased for this grid-unaligned input).
    v = torch.full((1, 32), 100.0)
    v[0, 0] = 448.0  # pins the scale to 1, so 100 lies between 96 and 104 (f = 0.5)
    v[0, 1:] = torch.linspace(97.0, 103.0, 31)
    mean = torch.stack([F.mxfp8_dequantize(F.mxfp8_quantize(v, rounding="stochastic", seed=s))
                        for s in range(2000)]).mean(0)
    nearest = F.mxfp8_dequantize(F.mxfp8_quantize(v))
    assert (mean - v).abs().max() < 0.4          # 2000 draws of spacing 8: std of the mean ~0.09
    assert (nearest - v).abs().max() >= 2.0
    # Clamped before the random bits are added: 447.9 (scale 1) rounds to 416 or 448, never to the NaN code;
    # an Inf block gets the largest scale and its Inf element becomes +-448 times it, not NaN.
    edge = torch.tensor([[447.9, -447.9] + [1.0] * 30, [math.inf] + [1.0] * 31])
    for seed in range(64):
        m = F.mxfp8_quantize(edge, rounding="stochastic", seed=seed)
        assert set(F.mxfp8_dequantize(m)[0, :2].abs().tolist()) <= {416.0, 448.0}
        assert int(m.scales.view(torch.uint8)[1, 0]) == 0xFE and int(m.data.view(torch.uint8)[1, 0]) == 0x7E


def _fmix32_plain(h: int) -> int:
    """murmur3's finalizer written out again, independently of ep_comm.formats."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _rbits_plain(seed: int, index: int) -> int:
    """docs/NUMERICS.md "Random bits", one index at a time in plain integers."""
    key = _fmix32_plain((seed % 2**32) ^ 0x9E3779B9) ^ _fmix32_plain((seed >> 32) % 2**32 ^ 0x7F4A7C15)
    pair = index >> 1
    word = _fmix32_plain((pair % 2**32) ^ _fmix32_plain((pair >> 32) % 2**32 ^ key))
    return (word >> (16 * (index % 2))) % 2**16


def test_rbits_reference_values():
    # Pinned values: a CUDA kernel must reproduce exactly these random bits for seed 0 and 1.
    assert F.rbits(0, torch.arange(4)).tolist() == [40417, 47168, 45074, 49629]
    assert F.rbits(1, torch.arange(4)).tolist() == [42964, 51093, 3719, 50751]
    # The definition, recomputed independently, at indices whose pair has a nonzero high word, and large seeds.
    index = [0, 1, 2, 3, 31, 32, 2**32 - 1, 2**32, 2**32 + 5, 2**33 + 10, 2**33 + 11, 2**62 + 3, 2**63 - 1]
    for seed in (0, 1, 7, 2**32 + 7, 2**64 - 1):
        assert F.rbits(seed, torch.tensor(index)).tolist() == [_rbits_plain(seed, i) for i in index], seed
    high = F.rbits(0, torch.tensor([2**33 + 10, 10]))  # same low word of the pair index, different high word
    assert high[0] != high[1]
    # Refused like mxfp8_quantize's seed: outside [0, 2^64) (not wrapped); indices that are not integers.
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="seed must be an int in"):
            F.rbits(seed, torch.arange(4))
    for index in (torch.tensor([0.5, 1.5]), torch.tensor([True]), [0, 1]):
        with pytest.raises(TypeError, match="index must be an integer tensor"):
            F.rbits(0, index)


def test_rbits_uniform_and_uncorrelated():
    """The 16-bit draws look uniform (chi-square over 256 bins of the top and of the low byte, and over the top
    4 bits, all SR uses for bf16 inputs; mean and variance) and independent between neighbours (the two halves of
    one fmix32 word, neighbours from two words, the same index under two seeds)."""
    n = 1 << 18
    g = torch.Generator().manual_seed(21)
    for seed in (0, 1, 99, 2**40 + 3):
        for index in (torch.arange(n), torch.arange(n) + 2**33 - 64,
                      torch.randint(0, 2**40, (n // 2,), generator=g) * 2 + torch.tensor([0, 1]).repeat(n // 4)):
            r = F.rbits(seed, index)
            assert int(r.min()) >= 0 and int(r.max()) < 2**16
            m = r.numel()
            for values, bins in ((r >> 8, 256), (r & 0xFF, 256), (r >> 12, 16)):
                counts = torch.bincount(values, minlength=bins).double()
                chi2 = ((counts - m / bins) ** 2 / (m / bins)).sum().item()
                assert chi2 < (bins - 1) + 6 * math.sqrt(2 * (bins - 1)), (seed, bins, chi2)  # 6 sigma
            rf = r.double()
            assert abs(rf.mean().item() - 32767.5) < 6 * 18918.6 / math.sqrt(m)  # sd of U{0..65535} ~ 18918.6
            assert abs(rf.var().item() / (65536.0**2 / 12) - 1) < 0.02
            if index.numel() != n:  # random indices: no neighbours to compare
                continue
            centered = (rf - 32767.5) / 18918.6
            limit = 6 / math.sqrt(m / 2)
            assert abs((centered[0::2] * centered[1::2]).mean().item()) < limit  # halves of one word
            assert abs((centered[1:-1:2] * centered[2::2]).mean().item()) < limit  # neighbours from two words
            joint = torch.bincount((r[0::2] >> 12) * 16 + (r[1::2] >> 12), minlength=256).double()
            chi2 = ((joint - m / 2 / 256) ** 2 / (m / 2 / 256)).sum().item()
            assert chi2 < 255 + 6 * math.sqrt(2 * 255), (seed, "pair halves", chi2)
    a, b = F.rbits(5, torch.arange(n)).double(), F.rbits(6, torch.arange(n)).double()
    assert abs(((a - 32767.5) * (b - 32767.5)).mean().item() / 18918.6**2) < 6 / math.sqrt(n)


def test_nan_inf_and_zero_rows():
    x = torch.zeros(4, 64)
    x[1, 3] = math.nan
    x[2, 7] = math.inf
    x[3, :] = torch.randn(64)
    q = F.nvfp4_quantize(x)
    y = F.nvfp4_dequantize(q)
    assert y[0].abs().sum() == 0 and _hex_bytes(q.scales[0]) == [0] * 4
    assert q.amax[2] == math.inf and not torch.isnan(q.amax).any()
    assert torch.isfinite(y[3]).all()
    m = F.mxfp8_quantize(x)
    assert int(m.data.view(torch.uint8)[1, 3]) == 0x7F        # NaN element -> E4M3 NaN, scale stays normal
    assert int(m.scales.view(torch.uint8)[2, 0]) == 0xFE      # Inf block -> largest scale
    s = F.s2f6_quantize(x, hadamard=False)
    assert int(s.data[1, 3]) == 127 and s.data[0].abs().sum() == 0


def test_dequantize_accumulate_order_and_skip():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 64, generator=gen)
    s = F.s2f6_quantize(rows)
    index = torch.tensor([[0, 2, -1], [-1, -1, -1], [5, 4, 3]])
    weights = torch.tensor([[0.5, 2.0, 9.0], [1.0, 1.0, 1.0], [1.0, -1.0, 0.25]])
    out = F.s2f6_dequantize_accumulate(s, index, weights, out_dtype=torch.float32)
    decoded = F._s2f6_decode_rotated(s)
    want0 = F.inverse_rht(((0.0 + 0.5 * decoded[0]) + 2.0 * decoded[2])[None])[0]
    assert torch.equal(out[0], want0) and out[1].abs().sum() == 0
    want2 = F.inverse_rht((((0.0 + decoded[5]) - decoded[4]) + 0.25 * decoded[3])[None])[0]
    assert torch.equal(out[2], want2)


def test_nvfp4_to_mxfp8_transposed():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(277))
    q = F.nvfp4_quantize(x)
    m = F.nvfp4_to_mxfp8_transposed(q, rounding="nearest")
    assert m.data.shape == (96, 64) and m.scales.shape == (96, 2)
    dense = F.nvfp4_dequantize(q)
    assert torch.equal(F.mxfp8_dequantize(m), F.mxfp8_dequantize(F.mxfp8_quantize(dense.t().contiguous())))
    with pytest.raises(ValueError, match="multiple of 32"):
        F.nvfp4_to_mxfp8_transposed(F.nvfp4_quantize(torch.randn(40, 32)))


def test_bad_inputs():
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        F.nvfp4_quantize(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 16"):
        F.nvfp4_quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="multiple of 32"):
        F.s2f6_quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        F.mxfp8_quantize(torch.zeros(2, 16))
    with pytest.raises(ValueError, match="rounding"):
        F.mxfp8_quantize(torch.zeros(2, 32), rounding="up")
    with pytest.raises(ValueError, match="broadcast"):
        F.nvfp4_quantize(torch.zeros(4, 32), amax=torch.ones(3))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        F.nvfp4_dequantize(torch.zeros(2, 16))
    for quantize in (F.nvfp4_quantize, F.mxfp8_quantize, F.s2f6_quantize, F.rht):  # sparse: named, not torch's reshape
        with pytest.raises(TypeError, match="must be a dense"):
            quantize(torch.ones(4, 64).to_sparse())
    with pytest.raises(ValueError, match="impl"):
        F.s2f6_quantize(torch.zeros(1, 32), impl="fast")
    with pytest.raises(ValueError, match="sign_mask"):
        F.rht(torch.zeros(1, 32), sign_mask=-1)
    with pytest.raises(TypeError, match="row_index"):
        F.s2f6_dequantize_accumulate(F.s2f6_quantize(torch.zeros(2, 32)), torch.zeros(2, 2))
    s = F.s2f6_quantize(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="float8_e8m0fnu"):  # fp32 scales: refused, not misread as 4 bytes each
        F.s2f6_dequantize(F.S2F6Tensor(s.data, s.scales.view(torch.uint8).float(), s.hadamard, s.sign_mask))
    # Empty inputs are valid and produce empty outputs (with one per-tensor scale too).
    assert F.nvfp4_quantize(torch.zeros(0, 32)).data.shape == (0, 16)
    assert F.nvfp4_quantize(torch.zeros(0, 32), scale_granularity="tensor").data.shape == (0, 16)
    assert F.s2f6_dequantize(F.s2f6_quantize(torch.zeros(0, 64))).shape == (0, 64)


def test_s2f6_dequantize_hadamard_argument():
    x = torch.randn(3, 64)
    s = F.s2f6_quantize(x, hadamard=True)
    assert torch.equal(F.s2f6_dequantize(s, hadamard=True), F.s2f6_dequantize(s))
    assert torch.equal(F.s2f6_dequantize(s, hadamard=False), F._s2f6_decode_rotated(s))  # rotated domain
    with pytest.raises(ValueError, match="without the RHT"):
        F.s2f6_dequantize(F.s2f6_quantize(x, hadamard=False), hadamard=True)


def test_value_checks():
    with pytest.raises(ValueError, match="non-negative"):
        F.nvfp4_quantize(torch.randn(2, 32), amax=torch.tensor([1.0, -1.0]))
    s = F.s2f6_quantize(torch.randn(3, 32))
    with pytest.raises(ValueError, match="row_index values"):
        F.s2f6_dequantize_accumulate(s, torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="row_index values"):
        F.s2f6_dequantize_accumulate(s, torch.tensor([[-2, 0]]))


def test_api_rejects_malformed_containers_seeds_and_amax():
    """Wrong field dtypes, seeds and NaN amaxes are refused with a message instead of a cryptic failure later."""
    x = torch.randn(4, 64)
    q = F.nvfp4_quantize(x, impl="reference")
    with pytest.raises(ValueError, match="scales float8_e4m3fn"):
        F.nvfp4_dequantize(F.NVFP4Tensor(q.data, q.scales.float(), q.amax, q.e4m3_max), impl="reference")
    with pytest.raises(ValueError, match="e4m3_max must be 256.0"):  # other bounds: kernels and reference differ
        F.nvfp4_dequantize(F.NVFP4Tensor(q.data, q.scales, q.amax, 135.0), impl="reference")
    m = F.mxfp8_quantize(x, impl="reference")
    with pytest.raises(ValueError, match="inconsistent MXFP8Tensor"):
        F.mxfp8_dequantize(F.MXFP8Tensor(m.data.float(), m.scales), impl="reference")
    rows32 = F.nvfp4_quantize(torch.randn(32, 64), impl="reference")
    for seed, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="seed"):
            F.nvfp4_to_mxfp8_transposed(rows32, seed=seed, impl="reference")
        with pytest.raises(error, match="seed"):
            F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="reference")
    # Integer scalars of other types are ints (numpy's, torch's): the same bits as the plain int.
    plain = F.mxfp8_quantize(x, rounding="stochastic", seed=5, impl="reference")
    for seed in (np.int64(5), torch.tensor(5), torch.tensor([5], dtype=torch.int32)):
        other = F.mxfp8_quantize(x, rounding="stochastic", seed=seed, impl="reference")
        assert torch.equal(other.data.view(torch.uint8), plain.data.view(torch.uint8))
    # A one-element int64 tensor holds the seed's 64 bits (two's complement), as the kernels read a GPU seed tensor.
    big = F.mxfp8_quantize(x, rounding="stochastic", seed=2**64 - 3, impl="reference")
    other = F.mxfp8_quantize(x, rounding="stochastic", seed=torch.tensor([-3]), impl="reference")
    assert torch.equal(other.data.view(torch.uint8), big.data.view(torch.uint8))
    assert not torch.equal(big.data.view(torch.uint8), plain.data.view(torch.uint8))
    # An unsigned tensor holds the seed as its value, the upper half of the 64-bit range included (read through
    # int64, seeds from 2^63 used to fail with torch's overflow error).
    upper = F.mxfp8_quantize(x, rounding="stochastic", seed=torch.tensor(2**64 - 3, dtype=torch.uint64),
                             impl="reference")
    assert torch.equal(upper.data.view(torch.uint8), big.data.view(torch.uint8))
    # rbits reads a seed as the quantizers do: the same seed object, the same bits.
    index = torch.arange(64)
    assert torch.equal(F.rbits(torch.tensor([-3]), index), F.rbits(2**64 - 3, index))
    assert torch.equal(F.rbits(torch.tensor(2**64 - 3, dtype=torch.uint64), index), F.rbits(2**64 - 3, index))
    with pytest.raises(ValueError, match="seed"):
        F.rbits(torch.tensor([-3], dtype=torch.int32), index)
    with pytest.raises(ValueError, match="not NaN"):
        F.nvfp4_quantize(x, amax=torch.tensor(float("nan")), impl="reference")
    inf_amax = F.nvfp4_quantize(x, amax=torch.tensor(float("inf")), impl="reference")  # a row holding an Inf's
    # A Python int beyond the float range is +Inf, as the docstring says (it raised OverflowError).
    huge = F.nvfp4_quantize(x, amax=10**400, impl="reference")
    assert torch.equal(huge.data, inf_amax.data) and torch.equal(huge.amax, inf_amax.amax.expand_as(huge.amax))
    # Fields that are not tensors (a hand-built or loaded container) are named in a TypeError.
    for kind, container, name in ((F.NVFP4Tensor, q, "amax"), (F.NVFP4Tensor, q, "data"), (F.MXFP8Tensor, m, "scales")):
        bad = dataclasses.replace(container, **{name: getattr(container, name).view(torch.uint8).numpy()})
        dequantize = F.nvfp4_dequantize if kind is F.NVFP4Tensor else F.mxfp8_dequantize
        with pytest.raises(TypeError, match=f"{kind.__name__}.{name} must be a torch.Tensor, got ndarray"):
            dequantize(bad, impl="reference")
    with pytest.raises(TypeError, match="NVFP4Tensor.amax must be a torch.Tensor, got float"):
        F.nvfp4_to_mxfp8_transposed(dataclasses.replace(rows32, amax=1.0), impl="reference")


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_nvfp4_container_takes_torch_packed_fp4_data():
    """DESIGN.md lets packed FP4 data be torch's float4_e2m1fn_x2 or uint8: the container keeps the former as its
    uint8 view (the same storage), so every consumer reads the same bytes."""
    q = F.nvfp4_quantize(torch.randn(4, 64), impl="reference")
    fp4 = dataclasses.replace(q, data=q.data.view(torch.float4_e2m1fn_x2))
    assert fp4.data.dtype == torch.uint8 and fp4.data.data_ptr() == q.data.data_ptr()
    assert torch.equal(F.nvfp4_dequantize(fp4, impl="reference"), F.nvfp4_dequantize(q, impl="reference"))
    assert fp4.shape == q.shape


def test_api_refuses_flags_and_containers_of_other_types_and_keeps_edges():
    """Flags are bools (None or "False" would pick a format silently), S2F6 containers carry a bool hadamard and a
    32-bit sign mask (the kernels take a uint32), seeds fit 64 bits, the transposed requantization takes 0 rows (an
    expert without tokens), and the accumulate is no more differentiable on the reference path than in the kernel."""
    x = torch.randn(4, 64)
    for value in (None, "False", 1):
        with pytest.raises(TypeError, match="four_over_six must be a bool"):
            F.nvfp4_quantize(x, four_over_six=value, impl="reference")
    s = F.s2f6_quantize(x, hadamard=False, impl="reference")
    with pytest.raises(TypeError, match="hadamard must be None or a bool"):
        F.s2f6_dequantize(s, hadamard="no", impl="reference")
    with pytest.raises(TypeError, match="S2F6Tensor.hadamard must be a bool"):
        F.s2f6_dequantize(dataclasses.replace(s, hadamard="yes"), impl="reference")
    with pytest.raises(ValueError, match="sign_mask"):
        F.s2f6_dequantize(dataclasses.replace(s, sign_mask=-1), impl="reference")
    with pytest.raises(ValueError, match="seed must be an int in"):
        F.mxfp8_quantize(x, rounding="stochastic", seed=2**64, impl="reference")
    F.mxfp8_quantize(x, rounding="stochastic", seed=2**64 - 1, impl="reference")
    empty = F.nvfp4_quantize(torch.randn(0, 64), impl="reference")
    m = F.nvfp4_to_mxfp8_transposed(empty, impl="reference")
    assert tuple(m.data.shape) == (64, 0) and tuple(m.scales.shape) == (64, 0)
    weights = torch.rand(2, 2, requires_grad=True)
    out = F.s2f6_dequantize_accumulate(F.s2f6_quantize(x, impl="reference"), torch.tensor([[0, 1], [2, -1]]),
                                       weights, impl="reference")
    assert not out.requires_grad


def test_cuda_glue_hands_the_binding_aligned_rows_and_final_layouts(monkeypatch):
    """The quantizers' CUDA glue (ep_comm._cuda_formats), with a stand-in for the compiled launch that applies the
    binding's own input rule (bind_formats.cpp require_dense: the rows' address and byte stride 16-byte aligned when
    there are rows): every input layout -- one strided row, a transposed row, a row sliced out of a wider one, 3-D,
    many rows with an odd stride, a misaligned storage offset -- reaches the kernel aligned, as [rows, K] over the
    input's values, and the containers come back in the reference's shapes and dtypes. (CPU tensors: this machine has
    no GPU; the glue itself is device-independent.)"""
    import contextlib
    import ctypes
    from ep_comm import _cuda_formats as C
    from ep_comm import _ext

    seen = []
    current = {}

    def _entry(kind):  # a compiled quantizer entry point: the input's arguments come first
        return lambda self, x, x_type, x_row_stride, num_rows, hidden, *rest, **options: self._check(
            kind, x, x_type, x_row_stride, num_rows, hidden)

    class Launch:  # the compiled entry points' argument order (bind_formats.cpp)
        @staticmethod
        def _check(name, x, x_type, x_row_stride, num_rows, hidden):
            elem_bytes = {0: 4, 1: 2, 2: 2}[x_type]
            if num_rows:
                assert ((x | (x_row_stride * elem_bytes)) & 15) == 0, (
                    f"{name}: rows at {x:#x} with stride {x_row_stride} elements are not 16-byte aligned")
            # What the kernel would read, row by row (read during the call: a copy the glue made is alive only then).
            rows = current["x"].reshape(-1, hidden)
            for r in range(num_rows):
                read = ctypes.string_at(x + r * x_row_stride * elem_bytes, hidden * elem_bytes)
                assert read == rows[r].contiguous().view(torch.uint8).numpy().tobytes(), f"{name}: row {r}"
            seen.append((name, num_rows, hidden))

        nvfp4_quantize, mxfp8_quantize, s2f6_quantize = (_entry("nvfp4"), _entry("mxfp8"), _entry("s2f6"))

    monkeypatch.setattr(C, "_lib", lambda: Launch())
    monkeypatch.setattr(_ext, "cuda_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_ext, "current_raw_stream", lambda device: 0)
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 100, generator=gen)
    flat = torch.randn(3 * 64 + 1, generator=gen).to(torch.bfloat16)
    layouts = {
        "one row, stride 100": wide.to(torch.bfloat16)[:1, :64],
        "one transposed row": torch.randn(64, 1, generator=gen).T,
        "contiguous 2-D": torch.randn(4, 64, generator=gen),
        "3-D": torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16),
        "rows with stride 100": wide.to(torch.bfloat16)[:, :64],
        "misaligned offset": flat[1:].reshape(3, 64),
        "1-D": torch.randn(64, generator=gen),
        "no rows": torch.empty(0, 64),
    }
    for name, x in layouts.items():
        seen.clear()
        current["x"] = x
        results = {"nvfp4": C.nvfp4_quantize(x, True, None), "mxfp8": C.mxfp8_quantize(x, "nearest", 0),
                   "s2f6": C.s2f6_quantize(x, True, 0)}
        assert [entry[0] for entry in seen] == ["nvfp4", "mxfp8", "s2f6"], name
        for kind, num_rows, hidden in seen:
            assert (num_rows, hidden) == (x.numel() // 64, 64), f"{name} {kind}"
        expected = {"nvfp4": F.nvfp4_quantize(x, impl="reference"), "mxfp8": F.mxfp8_quantize(x, impl="reference"),
                    "s2f6": F.s2f6_quantize(x, impl="reference")}
        for kind, got in results.items():
            expected_fields = tensor_fields(expected[kind])
            for field, a in tensor_fields(got).items():
                e = expected_fields[field]
                assert (a.shape, a.dtype) == (e.shape, e.dtype) and a.is_contiguous(), f"{name} {kind}.{field}"


def test_auto_impl_falls_back_where_the_kernels_were_not_built(monkeypatch):
    """impl='auto' sends CUDA tensors to the reference, with a warning, on a GPU the extension has no kernel image for
    (asked once per device); impl='cuda' raises naming the GPU. (Stand-ins: this machine has no GPU.)"""
    import contextlib
    import types
    from ep_comm import _ext
    asked = []
    monkeypatch.setattr(_ext, "_C", types.SimpleNamespace(formats_kernels_runnable=lambda: asked.append(1) or False))
    monkeypatch.setattr(_ext, "cuda_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    monkeypatch.setattr(F, "_problem_on_device", {})
    tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 3))
    with pytest.warns(RuntimeWarning, match="go to the torch reference: .* not built for this GPU \\(A100, sm_80\\)"):
        assert not F._use_cuda("auto", tensor)
    assert not F._use_cuda("auto", tensor) and asked == [1]
    with pytest.raises(RuntimeError, match="not built for this GPU \\(A100, sm_80\\)"):
        F._use_cuda("cuda", tensor)
    # A driver older than the runtime _C links fails the same probe: the message says so, not "rebuild".
    monkeypatch.setattr(_ext, "_C", types.SimpleNamespace(
        formats_kernel_image_error=lambda: "cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
    monkeypatch.setattr(F, "_problem_on_device", {})
    with pytest.raises(RuntimeError, match="the driver is older than the CUDA runtime"):
        F._use_cuda("cuda", tensor)
    # Inside a CUDA-graph capture the reference cannot stand in (its constants are synchronous host copies): a clear
    # error instead of a broken capture.
    monkeypatch.setattr(F, "_is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        F._use_cuda("auto", tensor)


def test_dequantizers_are_not_differentiable_on_either_path():
    """As the quantizers: the CUDA path's output has no grad_fn, so the reference's has none either (a hand-built
    container with an amax that requires grad used to give a differentiable result on the reference path only)."""
    x = torch.randn(2, 64)
    q, m, s = F.nvfp4_quantize(x), F.mxfp8_quantize(x), F.s2f6_quantize(x)
    q = F.NVFP4Tensor(q.data, q.scales, torch.nn.Parameter(q.amax.clone()), q.e4m3_max)
    for out in (F.nvfp4_dequantize(q, impl="reference"), F.mxfp8_dequantize(m, impl="reference"),
                F.s2f6_dequantize(s, impl="reference")):
        assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_format_calls_keep_no_graph_and_restore_grad_mode(mode):
    """The format functions run without grad mode (entered only where it is on): from an x that requires grad, no result
    field requires grad, in grad mode, under no_grad and under inference_mode; the caller's grad mode is the same after
    the call, also after a call that raised."""
    x = torch.randn(3, 64, requires_grad=True)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with context():
        grad_mode = torch.is_grad_enabled()
        q = F.nvfp4_quantize(x, scale_granularity="tensor", amax=None)
        q_amax = F.nvfp4_quantize(x, amax=torch.tensor(4.0, requires_grad=True))
        m, s = F.mxfp8_quantize(x, rounding="stochastic", seed=1), F.s2f6_quantize(x)
        outputs = [q.data, q.scales, q.amax, q_amax.amax, m.data, m.scales, s.data, s.scales, F.nvfp4_dequantize(q),
                   F.mxfp8_dequantize(m), F.s2f6_dequantize(s),
                   F.s2f6_dequantize_accumulate(s, torch.tensor([[0, 1]]), torch.ones(1, 2, requires_grad=True))]
        assert torch.is_grad_enabled() == grad_mode
        for out in outputs:
            assert not out.requires_grad and out.grad_fn is None
        with pytest.raises(ValueError):
            F.nvfp4_quantize(x[:, :40])
        assert torch.is_grad_enabled() == grad_mode


def test_containers_refuse_scales_of_other_rows():
    """scales must cover the same rows as data (the CUDA glue reshapes them to [rows, K / block]: fewer rows would be
    read out of bounds)."""
    x = torch.randn(4, 64)
    q, m, s = F.nvfp4_quantize(x), F.mxfp8_quantize(x), F.s2f6_quantize(x)
    with pytest.raises(ValueError, match=r"scales \(1, 4\)"):
        F.nvfp4_dequantize(F.NVFP4Tensor(q.data, q.scales[:1], q.amax, q.e4m3_max))
    with pytest.raises(ValueError, match=r"scales \(1, 2\)"):
        F.mxfp8_dequantize(F.MXFP8Tensor(m.data, m.scales[:1]))
    with pytest.raises(ValueError, match=r"scales \(1, 2\)"):
        F.s2f6_dequantize(F.S2F6Tensor(s.data, s.scales[:1], True))
    with pytest.raises(ValueError, match=r"scales \(2, 2\)"):
        F.s2f6_dequantize_accumulate(F.S2F6Tensor(s.data, s.scales[:2], True), torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match=r"scales \(4, 1, 4\)"):  # same row count, other shape
        F.nvfp4_dequantize(F.NVFP4Tensor(q.data, q.scales[:, None], q.amax, q.e4m3_max))
    # Built by hand from data and scales alone (as DESIGN.md writes it): rotated, like s2f6_quantize's default result.
    assert torch.equal(F.s2f6_dequantize(F.S2F6Tensor(s.data, s.scales)), F.s2f6_dequantize(s))


def test_nvfp4_amax_forms():
    """A per-expert amax is [E, 1] for x [E, N, K]; a 1-D [E] one (which would broadcast along N) is refused."""
    x = torch.randn(4, 4, 32)
    x[1] *= 100
    per_expert = x.abs().amax(dim=(1, 2))
    with pytest.raises(ValueError, match=r"ambiguous.*\[E, 1\]"):
        F.nvfp4_quantize(x, amax=per_expert)
    q = F.nvfp4_quantize(x, four_over_six=False, amax=per_expert[:, None])
    assert torch.equal(q.amax, per_expert[:, None].expand(4, 4))
    for amax in (per_expert[:, None].expand(4, 4), torch.tensor(500.0), 500.0, torch.tensor([500.0])):
        F.nvfp4_quantize(x, amax=amax)  # per row, scalar, one element: unambiguous
    assert torch.equal(F.nvfp4_quantize(x[0], amax=per_expert).amax, per_expert)  # 2-D x: [R] is per row


def test_dequantizers_refuse_integer_dtypes():
    x = torch.randn(2, 64)
    s = F.s2f6_quantize(x)
    for call in (lambda: F.nvfp4_dequantize(F.nvfp4_quantize(x), dtype=torch.int32),
                 lambda: F.mxfp8_dequantize(F.mxfp8_quantize(x), dtype=torch.uint8),
                 lambda: F.s2f6_dequantize(s, dtype=torch.int8),
                 lambda: F.s2f6_dequantize_accumulate(s, torch.tensor([[0, 1]]), out_dtype=torch.int16)):
        with pytest.raises(TypeError, match="floating-point"):
            call()
    assert F.s2f6_dequantize(s, dtype=torch.float64).dtype == torch.float64


def test_dequantize_accumulate_checks_weights_type_and_device():
    s = F.s2f6_quantize(torch.randn(4, 32))
    index = torch.tensor([[0, 1]])
    with pytest.raises(TypeError, match="weights must be a float32 tensor"):
        F.s2f6_dequantize_accumulate(s, index, weights=[[1.0, 1.0]])
    with pytest.raises(ValueError, match="weights are on meta"):
        F.s2f6_dequantize_accumulate(s, index, weights=torch.ones(1, 2, device="meta"))


def test_mxfp8_keeps_nan_and_inf_as_readme_says():
    """docs/NVLINK.md "NaN / Inf inputs": MXFP8 decodes NaN as NaN and Inf as Inf; an Inf's block scale is 0xFE, which
    flushes the other 31 elements of its block to zero. (NVFP4 / S2F6: test_nan_inf_and_zero_rows.)"""
    x = torch.randn(2, 64)
    x[0, 3], x[1, 5] = math.nan, -math.inf
    m = F.mxfp8_quantize(x)
    y = F.mxfp8_dequantize(m)
    assert math.isnan(y[0, 3]) and y[1, 5] == -math.inf and torch.isfinite(y[0, 4:]).all()
    assert int(m.scales.view(torch.uint8)[1, 0]) == 0xFE and y[1, :32].count_nonzero() == 1


def test_api_copies_its_inputs_and_checks_what_it_reinterprets():
    """The result owns its amax (an amax the caller updates in place later does not change it); quantizing a tensor
    that requires grad keeps no graph; a container's fields on different devices, integer tensors given to the byte
    decoders, a non-bool hadamard and non-number amaxes are refused; a one-element amax serves a 1-D x."""
    x = torch.randn(4, 64)
    amax = x.abs().amax(dim=-1)
    q = F.nvfp4_quantize(x, amax=amax, impl="reference")
    before = F.nvfp4_dequantize(q, impl="reference")
    amax.mul_(2.0)
    assert q.amax.data_ptr() != amax.data_ptr() and torch.equal(F.nvfp4_dequantize(q, impl="reference"), before)
    w = torch.nn.Parameter(torch.randn(8, 64))
    for result in (F.nvfp4_quantize(w, impl="reference"), F.mxfp8_quantize(w, impl="reference"),
                   F.s2f6_quantize(w, impl="reference")):
        assert not any(t.requires_grad for t in (result.data, result.scales) + ((result.amax,) if hasattr(
            result, "amax") else ())), type(result).__name__
    with pytest.raises(ValueError, match="NVFP4Tensor.amax is on meta but data is on cpu"):
        F.nvfp4_dequantize(F.NVFP4Tensor(q.data, q.scales, q.amax.to("meta"), q.e4m3_max))
    with pytest.raises(TypeError, match="tensor of bytes"):
        F.ue8m0_decode(torch.tensor([127, 128]))
    with pytest.raises(TypeError, match="tensor of bytes"):
        F.e4m3_decode(torch.tensor([0x38]))
    assert F.ue8m0_decode(torch.tensor([127, 128], dtype=torch.uint8)).tolist() == [1.0, 2.0]
    for hadamard in ("no", None, 1):
        with pytest.raises(TypeError, match=f"hadamard must be a bool, got {re.escape(repr(hadamard))}"):
            F.s2f6_quantize(x, hadamard=hadamard, impl="reference")
    for amax in (-0.0, torch.tensor(-0.0), torch.tensor([1.0, -0.0])):  # -0.0 would decode the rows' zeros as -0.0
        with pytest.raises(ValueError, match="amax must be non-negative and not NaN"):
            F.nvfp4_quantize(x[:2], amax=amax, impl="reference")
    assert F.nvfp4_quantize(x[:2], amax=0.0, impl="reference").amax.view(torch.int32).tolist() == [0, 0]  # +0.0
    for bad in ("3", [1.0], True):
        with pytest.raises(TypeError, match="amax must be"):
            F.nvfp4_quantize(x, amax=bad, impl="reference")
    with pytest.raises(TypeError, match="floating-point"):
        F.nvfp4_quantize(x, amax=torch.tensor(3), impl="reference")
    row = torch.randn(64)
    assert torch.equal(F.nvfp4_quantize(row, amax=torch.tensor([5.0]), impl="reference").data,
                       F.nvfp4_quantize(row, amax=5.0, impl="reference").data)
    assert torch.equal(F.s2f6_quantize(x, sign_mask=np.uint32(5), impl="reference").data,
                       F.s2f6_quantize(x, sign_mask=5, impl="reference").data)


@pytest.mark.cpu
def test_dequantize_accumulate_skips_indices_past_the_rows_while_capturing(monkeypatch):
    """During a CUDA-graph capture the range check (a host read) is skipped; the kernel then skips indices outside
    [0, N), and the reference must too, not gather out of bounds (a device-side assert on CUDA tensors)."""
    s = F.s2f6_quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(3)))
    want = F.s2f6_dequantize_accumulate(s, torch.tensor([[1, -1], [-1, -1]]), out_dtype=torch.float32)
    monkeypatch.setattr(F, "_is_capturing", lambda: True)
    got = F.s2f6_dequantize_accumulate(s, torch.tensor([[1, 4], [7, -3]]), out_dtype=torch.float32, impl="reference")
    assert torch.equal(got, want)


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8", "s2f6"])
def test_containers_need_a_nonempty_last_dimension(kind):
    """The quantizers refuse K = 0, so [N, 0] and 0-d containers are refused by every consumer alike (the CUDA path
    cannot reshape [N, 0] rows; a 0-d one used to fail with an IndexError). MXFP8 [K, 0] is the exception: the
    transposed requantization of 0 rows makes it."""
    u8 = torch.uint8
    if kind == "nvfp4":
        bad = [F.NVFP4Tensor(torch.zeros(4, 0, dtype=u8), torch.zeros(4, 0, dtype=u8), torch.zeros(4), 256.0),
               F.NVFP4Tensor(torch.zeros((), dtype=u8), torch.zeros((), dtype=u8), torch.zeros(()), 256.0)]
        dequantize = F.nvfp4_dequantize
    elif kind == "mxfp8":  # ([K, 0] is allowed: see test_mxfp8_of_no_rows_dequantizes_to_empty)
        bad = [F.MXFP8Tensor(torch.zeros((), dtype=u8), torch.zeros((), dtype=u8))]
        dequantize = F.mxfp8_dequantize
    else:
        bad = [F.S2F6Tensor(torch.zeros(4, 0, dtype=torch.int8), torch.zeros(4, 0, dtype=u8), False),
               F.S2F6Tensor(torch.zeros((), dtype=torch.int8), torch.zeros((), dtype=u8), False)]
        dequantize = F.s2f6_dequantize
    for container in bad:
        with pytest.raises(ValueError, match="non-empty last dimension"):
            dequantize(container, impl="reference")


@pytest.mark.cpu
def test_mxfp8_of_no_rows_dequantizes_to_empty():
    """nvfp4_to_mxfp8_transposed of 0 rows (an expert without tokens in backward) gives MXFP8 [K, 0]; the library's
    dequantizers take it back (it was refused as a container with an empty last dimension)."""
    m = F.nvfp4_to_mxfp8_transposed(F.nvfp4_quantize(torch.randn(0, 64), impl="reference"), impl="reference")
    for dtype in (torch.float32, torch.bfloat16):
        for out in (F.mxfp8_dequantize(m, dtype, impl="reference"), F.dequantize(m, dtype)):
            assert tuple(out.shape) == (64, 0) and out.dtype == dtype
    u8 = torch.uint8
    out = F.mxfp8_dequantize(F.MXFP8Tensor(torch.zeros(2, 3, 0, dtype=u8), torch.zeros(2, 3, 0, dtype=u8)))
    assert tuple(out.shape) == (2, 3, 0)
    with pytest.raises(ValueError, match="inconsistent MXFP8Tensor"):  # the scales must be empty too
        F.mxfp8_dequantize(F.MXFP8Tensor(torch.zeros(4, 0, dtype=u8), torch.zeros(4, 1, dtype=u8)))
    with pytest.raises(ValueError, match="impl must be"):  # impl is still checked
        F.mxfp8_dequantize(m, impl="fast")


@pytest.mark.cpu
def test_reference_keeps_subnormals_when_the_thread_flushes_them():
    """NUMERICS.md: no implementation flushes subnormals. Under torch.set_flush_denormal(True) on this thread (the
    intra-op threads here started before it, so they keep IEEE arithmetic; the next test starts them while it is on)
    the reference gives the bits it gives without flushing, on every row whichever thread computes it, and leaves the
    thread's mode as it found it: an S2F6 block of 3e38 (scale byte 0xFE, whose multiplier 2^-127 is subnormal), MXFP8
    and NVFP4 of subnormal inputs."""
    x_big = torch.zeros(64, 1024)
    x_big[:, ::32] = 3.0e38
    x_tiny = torch.full((4, 32), 1e-39)  # made before flushing (conversions flush too)

    def results():
        s = F.s2f6_quantize(x_big, hadamard=False, impl="reference")
        m = F.mxfp8_quantize(x_tiny, impl="reference")
        q = F.nvfp4_quantize(x_tiny, four_over_six=True, impl="reference")
        return [s.data, s.scales.view(torch.uint8), m.data.view(torch.uint8), m.scales.view(torch.uint8), q.data,
                q.scales.view(torch.uint8), q.amax, F.mxfp8_dequantize(m, impl="reference"),
                F.s2f6_dequantize(s, impl="reference")]

    want = results()
    assert int(want[0][0, 0]) == 113 and float(want[6][0]) > 0  # the code of 3e38; a subnormal amax kept
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush subnormals: nothing to keep")
        try:
            got = results()
            assert (x_tiny * 1.0)[0, 0].item() == 0.0  # the thread still flushes outside the reference
        finally:
            torch.set_flush_denormal(False)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point else b)


_FLUSH_PROGRAM = r"""
import hashlib, json, struct, sys, warnings
import torch
torch.set_num_threads(2)
flush_first = sys.argv[1] == "flush_first"
if flush_first:
    torch.set_flush_denormal(True)
    (torch.ones(1 << 20) * 1.0).sum()  # torch's intra-op threads start while this thread flushes: they flush too
from ep_comm import formats as F  # compiled here, without a .pyc (PYTHONDONTWRITEBYTECODE)
x_big = torch.zeros(64, 1024)
x_big[:, ::32] = 3.0e38
x_tiny = torch.full((512, 1024), 0x000AE398, dtype=torch.int32).view(torch.float32)  # 1e-39
tiny = struct.unpack("<d", struct.pack("<Q", 1 << 44))[0]  # a subnormal double, from its bits (read under DAZ: 0)
def results():
    s = F.s2f6_quantize(x_big, hadamard=False, impl="reference")
    m = F.mxfp8_quantize(x_tiny, impl="reference")
    q = F.nvfp4_quantize(x_tiny, four_over_six=True, impl="reference")
    fields = [s.data, s.scales, m.data, m.scales, q.data, q.scales, q.amax, F.mxfp8_dequantize(m, impl="reference"),
              F.s2f6_dequantize(s, impl="reference")]
    return [hashlib.sha256(f.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for f in fields]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = results()  # with this thread flushing (flush_first)
    if flush_first:
        assert tiny * 1.0 == 0.0, "the thread's flag was not restored"
        torch.set_flush_denormal(False)  # this thread keeps subnormals again; the intra-op threads still flush
    second = results()
    assert tiny * 1.0 != 0.0, "a format call left this thread flushing"
print("RESULT " + json.dumps({"first": first, "second": second, "constant_kept": F._SUBNORMAL != 0.0,
                              "warned": any("flush subnormals" in str(w.message) for w in caught)}))
"""


@pytest.mark.cpu
def test_reference_keeps_subnormals_when_the_intra_op_threads_flush_them():
    """NUMERICS.md: no implementation flushes subnormals. torch's intra-op threads started while
    torch.set_flush_denormal(True) was on flush too, whatever the calling thread does later, and a module compiled on
    a flushing thread reads a subnormal literal as 0.0. In a fresh process that starts its threads while flushing and
    imports ep_comm without a .pyc, the reference gives a clean process's bits (both with the calling thread flushing
    and after it stopped), says once that it runs on one thread, and leaves the caller's flag as it found it."""
    import json
    import os
    import subprocess
    import sys

    def run(mode):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        done = subprocess.run([sys.executable, "-c", _FLUSH_PROGRAM, mode], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        return json.loads(line[len("RESULT "):])

    clean, flushed = run("clean"), run("flush_first")
    assert clean["constant_kept"] and flushed["constant_kept"]
    assert clean["first"] == clean["second"] == flushed["first"] == flushed["second"]
    assert not clean["warned"]
    if not flushed["warned"]:  # (a CPU whose threads never flush: the intra-op check found nothing to keep)
        pytest.skip("this CPU's intra-op threads did not flush subnormals: nothing to keep")


@pytest.mark.cpu
def test_dequantize_takes_any_payload():
    """F.dequantize dispatches on the container: the same bits as each format's own dequantizer, a BF16 payload
    converted, anything else refused."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    cases = ((F.nvfp4_quantize(x), F.nvfp4_dequantize), (F.mxfp8_quantize(x), F.mxfp8_dequantize),
             (F.s2f6_quantize(x), F.s2f6_dequantize))
    for payload, own in cases:
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(F.dequantize(payload, dtype), own(payload, dtype=dtype)), (type(payload), dtype)
    assert torch.equal(F.dequantize(x), x.float()) and F.dequantize(x, torch.bfloat16) is x
    # A container's float8 / float4 field alone has no block scale: refused, not decoded without it.
    mx, q = cases[1][0], cases[0][0]
    fields = [mx.data, q.scales, q.data.view(torch.float8_e4m3fn)]
    if hasattr(torch, "float4_e2m1fn_x2"):  # (absent from older torch)
        fields.append(q.data.view(torch.float4_e2m1fn_x2))
    for field in fields:
        with pytest.raises(TypeError, match="dequantize takes a plain tensor only as a dense payload"):
            F.dequantize(field)
    with pytest.raises(TypeError, match="NVFP4Tensor, MXFP8Tensor, S2F6Tensor"):
        F.dequantize(x.view(torch.int16))
    with pytest.raises(TypeError, match="NVFP4Tensor, MXFP8Tensor, S2F6Tensor"):
        F.dequantize([1.0])


def test_api_edges():
    """Inputs a review found accepted silently or refused with torch's own errors (2026-12-04)."""
    x = torch.randn(2, 32)
    q1, q2 = F.nvfp4_quantize(x, impl="reference"), F.nvfp4_quantize(x.clone(), impl="reference")
    # Containers compare by identity (field-wise == of tensors raised "Boolean value of Tensor ... is ambiguous").
    assert q1 == q1 and q1 != q2 and q1 in [q2, q1] and len({q1, q2}) == 2
    m = F.mxfp8_quantize(x, impl="reference")
    s = F.s2f6_quantize(x, impl="reference")
    assert m == m and m != F.mxfp8_quantize(x, impl="reference") and s == s
    for bad in (None, 0, "yes"):  # (a falsy non-bool skipped the amax check silently)
        with pytest.raises(TypeError, match="check_amax must be a bool"):
            F.nvfp4_quantize(x, amax=-1.0, check_amax=bad, impl="reference")
    with pytest.raises(ValueError):  # (the check itself still runs for check_amax=True)
        F.nvfp4_quantize(x, amax=-1.0, impl="reference")
    # A Python amax above FLT_MAX rounds to fp32 Inf, as a float64 tensor amax does (torch.full raised before).
    huge = F.nvfp4_quantize(x, amax=1e39, impl="reference")
    as_tensor = F.nvfp4_quantize(x, amax=torch.tensor(1e39, dtype=torch.float64), impl="reference")
    assert torch.isinf(huge.amax).all()
    for a, b in ((huge.data, as_tensor.data), (huge.scales.view(torch.uint8), as_tensor.scales.view(torch.uint8)),
                 (huge.amax, as_tensor.amax)):
        assert torch.equal(a, b)
    # A seed tensor that is no one-element integer names what it got ("seed must be an int, got Tensor" before).
    for bad in (torch.tensor(True), torch.tensor(5.0), torch.tensor([5, 6]), torch.tensor([], dtype=torch.int64)):
        with pytest.raises(TypeError, match=f"seed tensor must hold one integer element.*got {bad.dtype} of shape"):
            F.mxfp8_quantize(x, "stochastic", seed=bad, impl="reference")
    one_int32 = F.mxfp8_quantize(x, "stochastic", seed=torch.tensor([5], dtype=torch.int32), impl="reference")
    assert torch.equal(one_int32.data.view(torch.uint8),
                       F.mxfp8_quantize(x, "stochastic", seed=5, impl="reference").data.view(torch.uint8))
    with pytest.raises(ValueError, match="impl must be"):  # (only the containers' dequantizers checked it)
        F.dequantize(torch.ones(2), impl="bogus")
    with pytest.raises(TypeError, match="16 bits or more"):  # (a second, saturating quantization)
        F.dequantize(q1, dtype=torch.float8_e4m3fn, impl="reference")
    assert F.dequantize(q1, dtype=torch.float64, impl="reference").dtype == torch.float64
    # The element helpers: float64 would be rounded twice (to fp32, then to the format); float codes truncated.
    with pytest.raises(TypeError, match="e2m1_encode takes"):
        F.e2m1_encode(torch.tensor([0.25 + 1e-12], dtype=torch.float64))
    with pytest.raises(TypeError, match="e4m3_encode takes"):
        F.e4m3_encode(torch.tensor([1.0625 + 2**-30], dtype=torch.float64))
    with pytest.raises(TypeError, match="integer tensor of codes"):
        F.e2m1_decode(torch.tensor([1.5, 6.0]))
    assert F.e2m1_encode(torch.tensor([0.25 + 1e-7])).tolist() == [1]  # (fp32 input: 0.25000010 rounds up)
