"""NVFP4 grouped GEMM (ep_comm.grouped_gemm): weight packing, the kernel's decode rule, activation expansion,
the torch reference and (marker `gpu`) the CUDA kernel against the reference.

The CPU tier proves the packed layout independently of the packing code: `test_layout_oracle` decodes every
packed word with the kernel's own bit trick (fp16x2 reinterpretation) and compares each element with the
weight element the contract assigns to that (thread, k-step, pair) position.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as TF

from ep_comm import formats as F
from ep_comm import grouped_gemm as G
from ep_comm import moe
from format_cases import assert_same_floats, edge_rows, make_rows

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------
def random_weights(experts: int, n: int, k: int, seed: int, device="cpu", scale_low: int = 0,
                   scale_high: int = 0x7F) -> F.NVFP4Tensor:
    """Random NVFP4 weights [E, N, K]: every code (incl. -0), scale bytes in [low, high) (0 and E4M3
    subnormals by default), one amax per expert (expert 0 gets amax 0 when E > 2)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(scale_low, scale_high, (experts, n, k // 16), generator=g, dtype=torch.uint8)
    amax = torch.rand(experts, generator=g, dtype=torch.float32) * 8 + 1e-3
    if experts > 2:
        amax[0] = 0.0
    amax = amax[:, None].expand(experts, n).contiguous()
    return F.NVFP4Tensor(data=data.to(device), scales=scales.view(torch.float8_e4m3fn).to(device),
                         amax=amax.to(device), e4m3_max=448.0)


def random_activations(rows: int, k: int, seed: int, device="cpu") -> F.NVFP4Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    return F.nvfp4_quantize(x.to(device), four_over_six=True)


def segments(counts, align: int, extra_rows: int = 5):
    """Offsets [E + 1] with every segment start aligned; the total row count has `extra_rows` unused rows."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + (c + align - 1) // align * align)
    return offsets, offsets[-1] + extra_rows


def valid_mask(offsets, counts, rows: int) -> torch.Tensor:
    mask = torch.zeros(rows, dtype=torch.bool)
    for start, c in zip(offsets, counts):
        mask[start:start + c] = True
    return mask


def fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    bits = bits.to(torch.int64) & 0xFFFF
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.float16)


# The kernel's decode (csrc/grouped_gemm.cu decode_pair0..3), written out independently of ep_comm's constants.
KERNEL_PAIR_DECODE = (
    lambda w: w & 0x8E008E00,
    lambda w: ((w << 3) & 0xFFFFFFFF) & 0x8E008E00,
    lambda w: (((w & 0x40384038) * 66) & 0xFFFFFFFF) & 0x8E008E00,
    lambda w: (((w & 0x20072007) * 516) & 0xFFFFFFFF) & 0x8E008E00,
)


def kernel_decode_pair(word: torch.Tensor, j: int):
    """The kernel's decode of pair j from uint32 words (int64 holding [0, 2^32)): (low, high) as fp16 * 2^-14."""
    h2 = KERNEL_PAIR_DECODE[j](word)
    return fp16_from_bits(h2 & 0xFFFF), fp16_from_bits(h2 >> 16)


def kernel_scale_code_bits(scale_word: torch.Tensor, s: int) -> torch.Tensor:
    """The kernel's fp16 bits of scale * 2^7 for k-step s from a row's 4-byte scale word (int64)."""
    pair = ((scale_word << 7) if s % 2 == 0 else (scale_word >> 1)) & 0x7F807F80
    return (pair >> (16 * (s // 2))) & 0xFFFF


def contract_word(pairs) -> int:
    """uint32 word from 4 (low code, high code) pairs, written straight from the contract (module docstring)."""
    word = 0
    for (lo, hi), mag, sign in zip(pairs, (9, 6, 3, 0), (15, 12, 14, 13)):
        word |= (lo & 7) << mag | (lo >> 3) << sign | (hi & 7) << (mag + 16) | (hi >> 3) << (sign + 16)
    return word


ALL_E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8)  # the 127 finite non-negative E4M3 values (0 and subnormals incl.)


# ----------------------------------------------------------------------------------------------------------
# CPU tier: the decode rule
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_decode_rule_e2m1_all_codes_all_positions():
    for j in range(4):
        for lo in range(16):
            for hi in range(16):
                pairs = [(0, 0)] * 4
                pairs[j] = (lo, hi)
                word = torch.tensor([contract_word(pairs)], dtype=torch.int64)
                low, high = kernel_decode_pair(word, j)
                assert low.item() == E2M1[lo] * 2.0 ** -14 and high.item() == E2M1[hi] * 2.0 ** -14, (j, lo, hi)
                assert math.copysign(1, low.item()) == math.copysign(1, E2M1[lo]), "sign of zero"
                assert math.copysign(1, high.item()) == math.copysign(1, E2M1[hi]), "sign of zero"
    # All 32 bits are used, no field overlaps another, and pair j never leaks into the decode of pair j'.
    full = contract_word([(15, 15)] * 4)
    assert full == 0xFFFFFFFF
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2000, 4, 2), generator=g)
    words = torch.tensor([contract_word(c.tolist()) for c in codes], dtype=torch.int64)
    table = torch.tensor(E2M1, dtype=torch.float32) * 2.0 ** -14
    for j in range(4):
        low, high = kernel_decode_pair(words, j)
        assert torch.equal(low.float(), table[codes[:, j, 0]]) and torch.equal(high.float(), table[codes[:, j, 1]])


@pytest.mark.cpu
def test_decode_rule_scale_codes_all_e4m3():
    x = F.e4m3_decode(ALL_E4M3)
    codes = G._e4m3_scale_codes(ALL_E4M3.view(torch.float8_e4m3fn))
    assert len(set(codes.tolist())) == 127, "scale codes must be lossless"
    rebuilt = fp16_from_bits(codes.to(torch.int64) << 7)               # the kernel's `code << 7`
    assert torch.equal(rebuilt.float(), x * 2.0 ** 7)
    # ... taken from a row's 4-byte scale word: every code in every k-step position, whatever its neighbours.
    c = codes.to(torch.int64)
    for s in range(4):
        for other in (0x00, 0x7E, 0xFF):
            word = sum((c if t == s else torch.full_like(c, other)) << (8 * t) for t in range(4))
            assert torch.equal(kernel_scale_code_bits(word, s), c << 7), (s, other)
    assert torch.equal(G._scale_codes_to_e4m3_float(codes), x)
    # The kernel's fp16 product (e2m1 * 2^-14) * (x * 2^7) is exact: e2m1 * x * 2^-7 for every code and scale.
    e2m1 = (torch.tensor(E2M1, dtype=torch.float32) * 2.0 ** -14).to(torch.float16)
    product = (e2m1[:, None] * rebuilt[None, :]).float()             # fp16 x fp16 -> fp16 (RNE)
    exact = (torch.tensor(E2M1, dtype=torch.float64)[:, None] * x.double()[None, :]) * 2.0 ** -7
    assert torch.equal(product.double(), exact)


# ----------------------------------------------------------------------------------------------------------
# CPU tier: packing
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_swiglu_row_permutation():
    n = 128
    perm = G.swiglu_row_permutation(n)
    assert sorted(perm.tolist()) == list(range(n))
    half = n // 2
    assert perm[:16].tolist() == list(range(8)) + list(range(half, half + 8))
    assert perm[16:32].tolist() == list(range(8, 16)) + list(range(half + 8, half + 16))
    for p in range(n):
        q, g = divmod(p, 16)
        assert perm[p].item() == (8 * q + g if g < 8 else half + 8 * q + g - 8)
    with pytest.raises(ValueError):
        G.swiglu_row_permutation(96)
    with pytest.raises(TypeError, match="n must be an int, got float"):  # (it gave a float32 "permutation")
        G.swiglu_row_permutation(64.0)


@pytest.mark.cpu
def test_column_pair_row_permutation():
    n = 128
    perm = G.column_pair_row_permutation(n)
    assert sorted(perm.tolist()) == list(range(n))
    assert perm[:16].tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    for p in range(n):
        q, g = divmod(p, 16)
        # what the epilogue assumes: a thread's tile rows r0 = 16 w + lane / 4 and r0 + 8 are columns c, c + 1 (c even)
        if g < 8:
            assert perm[p].item() % 2 == 0 and perm[p + 8].item() == perm[p].item() + 1
        assert perm[p].item() // 16 == q
    assert torch.equal(G.pack_gemm_weights(random_weights(1, n, 64, seed=3), swiglu=False).row_perm, perm)
    for bad in (0, 8, 100):
        with pytest.raises(ValueError):
            G.column_pair_row_permutation(bad)
    with pytest.raises(TypeError, match="n must be an int, got str"):  # (it was a string-formatting TypeError)
        G.column_pair_row_permutation("16")


def _as_unpickled_before_row_order(w: G.GemmWeights) -> G.GemmWeights:
    """w as unpickling an object saved before GemmWeights had row_order would rebuild it: its __dict__ without the
    field, so that the class default ("plain") shows through."""
    state = dict(w.__dict__)
    del state["row_order"]
    old = G.GemmWeights.__new__(G.GemmWeights)
    old.__dict__.update(state)
    return old


@pytest.mark.cpu
def test_plain_row_order_is_refused_but_unpacks(monkeypatch):
    """GemmWeights without SwiGLU in the plain row order (what ep_comm packed before 2026-12-02) would give the
    kernel's column-pair epilogue the wrong columns: both GEMM impls refuse them, and unpack_gemm_weights still
    returns their NVFP4 weights, to repack. SwiGLU weights kept their order: an old object is taken."""
    w = random_weights(2, 64, 64, seed=9)
    packed = G.pack_gemm_weights(w, swiglu=False)
    assert packed.row_order == "column_pairs" and packed.experts(0, 1).row_order == "column_pairs"
    # A truly old object: packed in the identity order, as the old packer did, then unpickled without the field.
    with monkeypatch.context() as m:
        m.setattr(G, "column_pair_row_permutation", lambda n, device=None: torch.arange(n, device=device))
        old = _as_unpickled_before_row_order(G.pack_gemm_weights(w, swiglu=False))
    assert old.row_order == "plain" and torch.equal(old.row_perm, torch.arange(64))
    rows = G.expand_nvfp4_rows(random_activations(4, 64, seed=2), impl="reference")
    offsets = torch.tensor([0, 4, 4], dtype=torch.int32)
    counts = torch.tensor([4, 0], dtype=torch.int32)
    for impl in ("reference", "cuda"):
        with pytest.raises(ValueError, match="repack"):
            G.grouped_gemm_nvfp4(rows, offsets, counts, old, impl=impl)
    G.grouped_gemm_nvfp4(rows, offsets, counts, packed, impl="reference")  # the control: the current order runs
    assert torch.equal(G.unpack_gemm_weights(old).data, w.data)
    assert torch.equal(G.pack_gemm_weights(G.unpack_gemm_weights(old), swiglu=False).values, packed.values)
    # SwiGLU: same order as before, so an old object runs.
    w1 = random_weights(2, 64, 64, seed=10)
    old_swiglu = _as_unpickled_before_row_order(G.pack_gemm_weights(w1, swiglu=True))
    assert old_swiglu.row_order == "plain"
    G.grouped_gemm_nvfp4(rows, offsets, counts, old_swiglu, impl="reference")


@pytest.mark.cpu
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 64), (3, 128, 192), (2, 256, 128)])
def test_pack_round_trip(shape, swiglu):
    experts, n, k = shape
    w = random_weights(experts, n, k, seed=n + k + swiglu)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    assert packed.values.dtype == torch.int32 and tuple(packed.values.shape) == (experts, n // 64, k // 64, 128, 4)
    assert packed.scales.dtype == torch.uint8 and tuple(packed.scales.shape) == (experts, n // 64, k // 64, 64, 4)
    assert packed.n == n and packed.k == k and packed.swiglu is swiglu
    assert packed.out_features == (n // 2 if swiglu else n)
    expected_factor = w.amax[:, 0] * torch.tensor(1.0 / (6.0 * 448.0), dtype=torch.float32)
    assert torch.equal(packed.factor, expected_factor) and packed.factor.dtype == torch.float32
    expected = F.nvfp4_dequantize(w, impl="reference")
    actual = G.dequantize_gemm_weights(packed)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), "round trip must be bitwise"
    # and back to the NVFP4 weights themselves (what MoELayer.weights returns from its packed copy)
    unpacked = G.unpack_gemm_weights(packed)
    assert torch.equal(unpacked.data, w.data)
    assert unpacked.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(unpacked.scales.view(torch.uint8), w.scales.view(torch.uint8))
    assert torch.equal(unpacked.amax.view(torch.int32), w.amax.view(torch.int32)) and unpacked.e4m3_max == w.e4m3_max


@pytest.mark.cpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_pack_round_trip_quantized_weights(swiglu):
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(2, 128, 192, generator=g) * torch.tensor([1e-3, 30.0])[:, None, None]
    w1[0, :5] = 0.0
    w2 = torch.randn(2, 192, 64, generator=g)
    weights = moe.pack_weights(w1, w2)
    for w, sw in ((weights.w1, swiglu), (weights.w2, False)):
        packed = G.pack_gemm_weights(w, swiglu=sw)
        expected = F.nvfp4_dequantize(w, impl="reference")
        assert torch.equal(G.dequantize_gemm_weights(packed).view(torch.int32), expected.view(torch.int32))


@pytest.mark.cpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_layout_oracle(swiglu):
    """Every packed element, decoded with the kernel's bit trick, is the contract's weight element."""
    experts, n, k = 1, 128, 128
    w = random_weights(experts, n, k, seed=11 + swiglu)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    codes = torch.stack((w.data.to(torch.int64) & 0xF, w.data.to(torch.int64) >> 4), -1).reshape(experts, n, k)
    e2m1 = torch.tensor(E2M1, dtype=torch.float32)
    scale_values = F.e4m3_decode(w.scales.view(torch.uint8))           # [E, N, K/16]
    words = packed.values.to(torch.int64) & 0xFFFFFFFF                  # [E, mt, kb, t, s]
    scale_codes = packed.scales.to(torch.int64)                         # [E, mt, kb, row, s]
    decoded = [kernel_decode_pair(words, j) for j in range(4)]
    scale_words = sum(scale_codes[..., s] << (8 * s) for s in range(4))  # [E, mt, kb, row]: a row's 4-byte word
    scale_fp16 = torch.stack([fp16_from_bits(kernel_scale_code_bits(scale_words, s)) for s in range(4)],
                             dim=-1).float() * 2.0 ** -7                   # kernel rebuild of the scale
    half = n // 2

    def original_row(p: int) -> int:
        q, g = divmod(p, 16)
        if not swiglu:  # column pairs: tile rows r0 and r0 + 8 of a thread are rows 2 g and 2 g + 1 of the group
            return 16 * q + (2 * g if g < 8 else 2 * (g - 8) + 1)
        return 8 * q + g if g < 8 else half + 8 * q + g - 8

    checked = 0
    for mt in range(n // 64):
        for kb in range(k // 64):
            for t in range(128):
                warp, lane = divmod(t, 32)
                r0 = 16 * warp + lane // 4
                r1 = r0 + 8
                for s in range(4):
                    c = 16 * s + 2 * (lane % 4)
                    for h, r in enumerate((r0, r1)):
                        row = original_row(64 * mt + r)
                        assert scale_fp16[0, mt, kb, r, s].item() == scale_values[0, row, 4 * kb + s].item()
                    for j, (r, dc) in enumerate(((r0, 0), (r1, 0), (r0, 8), (r1, 8))):
                        row = original_row(64 * mt + r)
                        col = 64 * kb + c + dc
                        low, high = decoded[j]
                        got = (low[0, mt, kb, t, s].item(), high[0, mt, kb, t, s].item())
                        want = (e2m1[codes[0, row, col]].item() * 2.0 ** -14,
                                e2m1[codes[0, row, col + 1]].item() * 2.0 ** -14)
                        assert got == want, (mt, kb, t, s, j)
                        assert all(math.copysign(1, a) == math.copysign(1, b) for a, b in zip(got, want))
                        checked += 2
    assert checked == n * k


@pytest.mark.cpu
def test_experts_slice():
    w = random_weights(4, 64, 64, seed=5)
    packed = G.pack_gemm_weights(w, swiglu=False)
    sub = packed.experts(1, 3)
    assert sub.num_experts == 2
    assert torch.equal(G.dequantize_gemm_weights(sub), G.dequantize_gemm_weights(packed)[1:3])
    with pytest.raises(ValueError):
        packed.experts(3, 5)
    with pytest.raises(ValueError, match="empty"):  # the reference would return zeros, the kernel refuse it
        packed.experts(1, 1)
    for bad, name in (((True, 2), "start"), ((0, 1.5), "stop")):  # (True was taken as 1, 1.5 a slicing TypeError)
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            packed.experts(*bad)
    # Hand-made GemmWeights: a row_perm that is no permutation left rows of the unpacked weights uninitialised, and an
    # e4m3_max other than NVFP4's two gave another decode factor.
    for bad, message in ((dataclasses.replace(packed, row_perm=torch.zeros_like(packed.row_perm)), "row_perm must be"),
                         (dataclasses.replace(packed, e4m3_max=300), "e4m3_max must be 448 or 256")):
        for helper in (G.dequantize_gemm_weights, G.unpack_gemm_weights):
            with pytest.raises(ValueError, match=message):
                helper(bad)
    with pytest.raises(ValueError, match="w1 has an expert whose amax is NaN"):  # (it passed)
        G.check_weight_amax(torch.tensor([1.0, float("nan")]), "w1")
    with pytest.raises(ValueError, match="above"):
        G.check_weight_amax(torch.tensor([1.0, float("inf")]), "w1")
    G.check_weight_amax(torch.tensor([1.0, 2.0]), "w1")


@pytest.mark.cpu
def test_reference_paths_under_torchs_new_tf32_setting():
    """The FP32 references switch TF32 off through whichever setting the process uses: once a user has set the newer
    torch.backends.cuda.matmul.fp32_precision, reading the legacy allow_tf32 raises (a fresh interpreter, so that
    this setting does not leak into other tests)."""
    import subprocess
    import sys
    code = """
import torch
from ep_comm import formats, moe
from ep_comm import grouped_gemm as G
if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
    raise SystemExit(77)  # an older torch: only the legacy setting exists (skipped below, with the reason)
torch.backends.cuda.matmul.fp32_precision = "tf32"
w1, w2 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
q = formats.nvfp4_quantize(torch.randn(3, 64))
moe.expert_mlp_reference(q, w1[0], w2[0])
x = G.expand_nvfp4_rows(formats.nvfp4_quantize(torch.randn(8, 64)))
packed = moe.pack_weights(torch.randn(1, 64, 64), torch.randn(1, 64, 32))
G.grouped_gemm_nvfp4(x, torch.tensor([0, 8], dtype=torch.int32), torch.tensor([8], dtype=torch.int32),
                     G.pack_gemm_weights(packed.w1, swiglu=False), impl="reference")
assert torch.backends.cuda.matmul.fp32_precision == "tf32"
"""
    run = subprocess.run([sys.executable, "-c", code])
    if run.returncode == 77:  # was exit 0: an older torch passed without checking anything
        pytest.skip("this torch has no torch.backends.cuda.matmul.fp32_precision (only the legacy allow_tf32)")
    assert run.returncode == 0, f"the reference paths failed under fp32_precision='tf32' (exit {run.returncode})"


@pytest.mark.cpu
def test_gemm_helpers_check_arguments_on_every_path():
    """num_rows_limit and quantize_expanded_rows' inputs are checked on the CPU too (the CUDA path checked them or
    trusted them), and the fused experts refuse weights packed for the other GEMM and non-int32 offsets."""
    q = F.nvfp4_quantize(torch.randn(8, 64))
    for limit in (3, torch.tensor([3], dtype=torch.int64), torch.tensor([1, 2], dtype=torch.int32)):
        with pytest.raises(ValueError, match="num_rows_limit"):
            G.expand_nvfp4_rows(q, num_rows_limit=limit)
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="x must be"):
        G.quantize_expanded_rows(x.double())
    with pytest.raises(TypeError, match="amax must be a float32"):
        G.quantize_expanded_rows(x, amax=torch.ones(4, dtype=torch.int32))
    w = moe.pack_weights(torch.randn(2, 64, 64), torch.randn(2, 64, 32)).w1
    w1, w2 = G.pack_gemm_weights(w, swiglu=True), G.pack_gemm_weights(w, swiglu=False)
    offsets, counts = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w2 must be packed with pack_gemm_weights\(..., swiglu=False\)"):
        moe.fused_expert_mlp(q, offsets, counts, w1, w1)
    with pytest.raises(ValueError, match=r"w1 must be packed with pack_gemm_weights\(..., swiglu=True\)"):
        moe.fused_expert_hidden(q, offsets, counts, w2)
    with pytest.raises(TypeError, match="expert_offsets must be a 1-D int32 tensor"):
        moe.fused_expert_mlp(q, offsets.long(), counts, w1, w2)


# ----------------------------------------------------------------------------------------------------------
# CPU tier: activations
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
@pytest.mark.parametrize("e4m3_max", [256.0, 448.0])
def test_expand_reference_exact(e4m3_max):
    g = torch.Generator().manual_seed(3)
    rows, k = 37, 128
    data = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (rows, k // 16), generator=g, dtype=torch.uint8)
    amax = torch.rand(rows, generator=g) * 100
    amax[0] = 0.0
    q = F.NVFP4Tensor(data, scales.view(torch.float8_e4m3fn), amax, e4m3_max)
    x = G.expand_nvfp4_rows(q, impl="reference")
    assert x.values.dtype == torch.float16 and tuple(x.values.shape) == (rows, k)
    assert x.row_factor.dtype == torch.float32 and tuple(x.row_factor.shape) == (rows,)
    exact, factor = _expanded_by_hand(q)
    assert torch.equal(x.values.double(), exact), "fp16 values must be exact"
    assert torch.equal(x.row_factor, factor)
    # values * row_factor is formats' dequantization up to one fp32 rounding.
    ref = F.nvfp4_dequantize(q, impl="reference")
    got = x.values.float() * x.row_factor[:, None]
    assert torch.all((got - ref).abs() <= ref.abs() * 2.0 ** -22)


def _expanded_by_hand(q: F.NVFP4Tensor):
    """expand_nvfp4_rows's exact form of 2-D q, from the format's definition: float64 [R, K] block values (the E2M1
    value of each nibble, low nibble first, times its E4M3 block scale) and the row factor amax * fp32(1 / (6 M))."""
    rows, k = q.data.shape[0], q.data.shape[1] * 2
    codes = torch.stack((q.data.to(torch.int64) & 0xF, q.data.to(torch.int64) >> 4), -1).reshape(rows, k)
    values = (torch.tensor(E2M1, dtype=torch.float64)[codes].reshape(rows, k // 16, 16)
              * F.e4m3_decode(q.scales.view(torch.uint8)).double()[..., None]).reshape(rows, k)
    return values, q.amax * torch.tensor(1.0 / (6.0 * q.e4m3_max), dtype=torch.float32)


@pytest.mark.cpu
def test_expand_leading_dims_and_empty():
    q = random_activations(6, 64, seed=1)
    q3 = F.NVFP4Tensor(q.data.reshape(2, 3, 32), q.scales.reshape(2, 3, 4), q.amax.reshape(2, 3), q.e4m3_max)
    a, b = G.expand_nvfp4_rows(q), G.expand_nvfp4_rows(q3)
    assert torch.equal(a.values, b.values) and torch.equal(a.row_factor, b.row_factor)
    empty = F.NVFP4Tensor(q.data[:0], q.scales[:0], q.amax[:0], q.e4m3_max)
    assert tuple(G.expand_nvfp4_rows(empty).values.shape) == (0, 64)


def hidden_rows_with_edges(rows: int, k: int, seed: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """w1-output-like rows: format_cases.edge_rows (zero, subnormal, outlier, NaN, Inf, huge rows...), then random rows
    with outliers at a random scale per row (rows > len(edge_rows))."""
    edges = edge_rows(k)
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(2 * torch.randn(rows - edges.shape[0], 1, generator=g))
    return torch.cat([edges, make_rows("outliers", rows - edges.shape[0], k, seed) * scale]).to(device=device,
                                                                                                 dtype=dtype)


@pytest.mark.cpu
def test_quantize_expanded_rows_reference_and_errors():
    x = hidden_rows_with_edges(20, 64, seed=2)
    amax = x.abs().nan_to_num(0.0).amax(-1) * 1.5
    for given in (None, amax):
        got = G.quantize_expanded_rows(x, amax=given)
        # (expanded by hand, not by expand_nvfp4_rows: on CPU that is the path under test)
        values, factor = _expanded_by_hand(F.nvfp4_quantize(x, four_over_six=True, amax=given, impl="reference"))
        assert got.values.dtype == torch.float16 and torch.equal(got.values.double(), values)
        assert torch.equal(got.row_factor, factor)
    empty = G.quantize_expanded_rows(x[:0])
    assert tuple(empty.values.shape) == (0, 64) and tuple(empty.row_factor.shape) == (0,)
    with pytest.raises(ValueError, match="multiple of 16"):
        G.quantize_expanded_rows(x[:, :40])
    with pytest.raises(ValueError, match="amax"):
        G.quantize_expanded_rows(x, amax=amax[:3])
    for bad in (float("nan"), -1.0):  # refused as formats.nvfp4_quantize refuses it
        wrong = amax.clone()
        wrong[4] = bad
        with pytest.raises(ValueError, match="amax must be non-negative and not NaN"):
            G.quantize_expanded_rows(x, amax=wrong)


# ----------------------------------------------------------------------------------------------------------
# CPU tier: the reference GEMM
# ----------------------------------------------------------------------------------------------------------
def straightforward(q_x: F.NVFP4Tensor, w: F.NVFP4Tensor, offsets, counts, swiglu: bool) -> torch.Tensor:
    """float64 per-expert matmul of formats-dequantized operands; rows outside every segment are 0."""
    x = F.nvfp4_dequantize(q_x, impl="reference").double()
    wd = F.nvfp4_dequantize(w, impl="reference").double()
    n = wd.shape[1]
    out = torch.zeros(x.shape[0], n // 2 if swiglu else n, dtype=torch.float64)
    for e, c in enumerate(counts):
        rows = slice(offsets[e], offsets[e] + c)
        y = x[rows] @ wd[e].t()
        if swiglu:
            y = TF.silu(y[:, :n // 2]) * y[:, n // 2:]
        out[rows] = y
    return out


def _row_amax_of(out, mask):
    """Per-row max |out| with NaN as 0 (the NVFP4 quantizer's row amax), 0 for rows outside every segment."""
    a = out.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=1)
    return torch.where(mask, a, torch.zeros_like(a))


@pytest.mark.cpu
def test_reference_row_amax_and_refusals():
    """The reference path's row_amax (max-ed into what the caller passed; other rows untouched) and the argument
    checks: SwiGLU weights only, float32 [R] contiguous on x's device."""
    experts, n, k = 4, 128, 192
    counts = [5, 0, 33, 17]
    offsets, rows = segments(counts, 16)
    w = random_weights(experts, n, k, seed=23, scale_low=0x20, scale_high=0x50)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=24))
    x.values[offsets[2] + 1, 7] = float("nan")  # (a NaN output row: its amax counts NaN as 0, as formats' row amax)
    off_t, cnt_t = torch.tensor(offsets, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)
    packed = G.pack_gemm_weights(w, swiglu=True)
    row_amax = torch.full((rows,), 0.5)
    out = G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, out_dtype=torch.float32, impl="reference",
                               row_amax=row_amax)
    mask = valid_mask(offsets, counts, rows)
    want = torch.maximum(_row_amax_of(out, mask), torch.tensor(0.5))
    assert torch.equal(row_amax[mask], want[mask]) and bool((row_amax[~mask] == 0.5).all())
    assert bool(out[offsets[2] + 1].isnan().all()) and row_amax[offsets[2] + 1] == 0.5
    with pytest.raises(ValueError, match="SwiGLU"):
        G.grouped_gemm_nvfp4(x, off_t, cnt_t, G.pack_gemm_weights(w, swiglu=False), impl="reference",
                             row_amax=torch.zeros(rows))
    for bad in (torch.zeros(rows, dtype=torch.float64), torch.zeros(rows + 1), torch.zeros(rows, 2)[:, 0]):
        with pytest.raises(ValueError, match="row_amax"):
            G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, impl="reference", row_amax=bad)


@pytest.mark.cpu
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("align", [1, 16, 128])
def test_reference_gemm_vs_straightforward(swiglu, align):
    experts, n, k = 4, 128, 192
    counts = [5, 0, 33, 17]
    offsets, rows = segments(counts, align)
    w = random_weights(experts, n, k, seed=21, scale_low=0x20, scale_high=0x50)
    q_x = random_activations(rows, k, seed=22)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    x = G.expand_nvfp4_rows(q_x)
    off_t, cnt_t = torch.tensor(offsets, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)
    expected = straightforward(q_x, w, offsets, counts, swiglu)
    out = G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, out_dtype=torch.float32, impl="reference")
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, packed.out_features)
    rel = torch.linalg.norm(out.double() - expected) / torch.linalg.norm(expected)
    assert rel < 1e-6, rel
    assert torch.all(out[~valid_mask(offsets, counts, rows)] == 0)
    out_bf16 = G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, impl="reference")
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, out.to(torch.bfloat16))
    sentinel = torch.full((rows, packed.out_features), 7.0, dtype=torch.float32)
    G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, out_dtype=torch.float32, impl="reference", out=sentinel)
    mask = valid_mask(offsets, counts, rows)
    assert torch.equal(sentinel[mask], out[mask]) and torch.all(sentinel[~mask] == 7.0)


# ----------------------------------------------------------------------------------------------------------
# CPU tier: bad inputs
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_pack_bad_inputs():
    w = random_weights(2, 64, 64, seed=1)
    with pytest.raises(TypeError):
        G.pack_gemm_weights(w.data, swiglu=False)
    with pytest.raises(ValueError, match="multiples of 64"):
        G.pack_gemm_weights(random_weights(1, 64, 48, seed=1), swiglu=False)
    with pytest.raises(ValueError, match="multiples of 64"):
        G.pack_gemm_weights(random_weights(1, 80, 64, seed=1), swiglu=False)
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        G.pack_gemm_weights(F.NVFP4Tensor(w.data[0], w.scales[0], w.amax[0], 448.0), swiglu=False)
    amax = w.amax.clone()
    amax[0, 3] += 1
    with pytest.raises(ValueError, match="one amax per expert"):
        G.pack_gemm_weights(F.NVFP4Tensor(w.data, w.scales, amax, 448.0), swiglu=False)
    signed_zeros = w.amax.clone()
    signed_zeros[0] = 0.0
    signed_zeros[0, 5] = -0.0  # equal as numbers, not as bits: one packed amax could not give both back
    with pytest.raises(ValueError, match="one amax per expert"):
        G.pack_gemm_weights(F.NVFP4Tensor(w.data, w.scales, signed_zeros, 448.0), swiglu=False)
    negative_zero = w.amax.clone()
    negative_zero[0] = -0.0  # an expert whose amax is -0 along all of N: packed, and given back, bit for bit
    packed = G.pack_gemm_weights(F.NVFP4Tensor(w.data, w.scales, negative_zero, 448.0), swiglu=False)
    assert torch.equal(G.unpack_gemm_weights(packed).amax.view(torch.int32), negative_zero.view(torch.int32))
    assert torch.equal(G.dequantize_gemm_weights(packed).view(torch.int32),
                       F.nvfp4_dequantize(F.NVFP4Tensor(w.data, w.scales, negative_zero, 448.0),
                                          impl="reference").view(torch.int32))
    for bad_byte in (0x7F, 0x80, 0xC0, 0xFF):  # NaN, -0, negative, NaN
        scales = w.scales.view(torch.uint8).clone()
        scales[1, 2, 3] = bad_byte
        with pytest.raises(ValueError, match="finite and non-negative"):
            G.pack_gemm_weights(F.NVFP4Tensor(w.data, scales.view(torch.float8_e4m3fn), w.amax, 448.0), swiglu=False)
    nan_amax = w.amax.clone()
    nan_amax[1] = math.nan
    with pytest.raises(ValueError, match="amax"):
        G.pack_gemm_weights(F.NVFP4Tensor(w.data, w.scales, nan_amax, 448.0), swiglu=False)
    with pytest.raises(TypeError):
        G.pack_gemm_weights(w, swiglu=1)


@pytest.mark.cpu
def test_gemm_bad_inputs():
    experts, n, k = 2, 64, 128
    packed = G.pack_gemm_weights(random_weights(experts, n, k, seed=2), swiglu=True)
    x = G.expand_nvfp4_rows(random_activations(40, k, seed=3))
    off = torch.tensor([0, 16, 32], dtype=torch.int32)
    cnt = torch.tensor([10, 5], dtype=torch.int32)
    ok = G.grouped_gemm_nvfp4(x, off, cnt, packed)
    assert tuple(ok.shape) == (40, n // 2) and ok.dtype == torch.bfloat16

    def call(**kw):
        args = dict(x=x, expert_offsets=off, num_tokens_per_expert=cnt, weights=packed)
        args.update(kw)
        return G.grouped_gemm_nvfp4(**args)

    with pytest.raises(TypeError, match="ExpandedRows"):
        call(x=x.values)
    with pytest.raises(TypeError, match="float16"):
        call(x=G.ExpandedRows(x.values.float(), x.row_factor))
    with pytest.raises(ValueError, match="contiguous"):
        call(x=G.ExpandedRows(torch.cat([x.values, x.values], 1)[:, ::2], x.row_factor))
    with pytest.raises(ValueError, match="K = 64"):
        call(x=G.ExpandedRows(x.values[:, :64].contiguous(), x.row_factor))
    with pytest.raises(ValueError, match="row_factor"):
        call(x=G.ExpandedRows(x.values, x.row_factor[:-1]))
    with pytest.raises(ValueError, match="row_factor"):
        call(x=G.ExpandedRows(x.values, x.row_factor.double()))
    with pytest.raises(TypeError, match="int32"):
        call(expert_offsets=off.long())
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        call(expert_offsets=off[:2])
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        call(num_tokens_per_expert=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="out_dtype"):
        call(out_dtype=torch.float16)
    with pytest.raises(ValueError, match="token_tile"):
        call(token_tile=48)
    with pytest.raises(ValueError, match="impl"):
        call(impl="fast")
    with pytest.raises(ValueError, match="CUDA"):
        call(impl="cuda")
    with pytest.raises(TypeError, match="GemmWeights"):
        call(weights=random_weights(experts, n, k, seed=2))
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.zeros(40, n, dtype=torch.bfloat16))
    # The reference checks the segments (the CUDA path trusts them).
    with pytest.raises(ValueError, match="expert 0"):
        call(num_tokens_per_expert=torch.tensor([17, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_offsets"):
        call(expert_offsets=torch.tensor([0, 16, 41], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert 1"):
        call(num_tokens_per_expert=torch.tensor([1, -1], dtype=torch.int32))
    for bad_tail in (128, 8, True):
        with pytest.raises(ValueError, match="tail_tile"):
            call(tail_tile=bad_tail)
    with pytest.raises(ValueError, match="tail_tile"):
        call(token_tile=32, tail_tile=32)


@pytest.mark.cpu
def test_gemm_refuses_layouts_the_kernel_cannot_take():
    """The host checks that guard the kernel's addressing (its 16-byte operand loads, 2-wide output stores, its one
    device), each refused on the CPU path too, so that the reference takes exactly what the kernel takes."""
    experts, n, k = 2, 64, 128
    packed = G.pack_gemm_weights(random_weights(experts, n, k, seed=2), swiglu=False)
    x = G.expand_nvfp4_rows(random_activations(40, k, seed=3))
    off = torch.tensor([0, 16, 32], dtype=torch.int32)
    cnt = torch.tensor([10, 5], dtype=torch.int32)

    def call(**kw):
        args = dict(x=x, expert_offsets=off, num_tokens_per_expert=cnt, weights=packed)
        args.update(kw)
        return G.grouped_gemm_nvfp4(**args)

    wide = torch.zeros(40, n + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out rows must start at even columns"):
        call(out=wide[:, :n])  # an odd row stride
    flat = torch.zeros(40 * n + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out rows must start at even columns"):
        call(out=flat[1:].view(40, n))  # starts at an odd element
    shifted = torch.zeros(40 * k + 4, dtype=torch.float16)[4:].view(40, k)  # 8 bytes past an aligned start
    shifted.copy_(x.values)
    with pytest.raises(ValueError, match="16-byte aligned"):
        call(x=G.ExpandedRows(shifted, x.row_factor))
    with pytest.raises(ValueError, match="expert_offsets must be contiguous"):
        call(expert_offsets=torch.tensor([0, 9, 16, 9, 32, 9], dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="num_tokens_per_expert must be contiguous"):
        call(num_tokens_per_expert=torch.tensor([10, 0, 5, 0], dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="x.row_factor is on meta"):
        call(x=G.ExpandedRows(x.values, x.row_factor.to("meta")))
    broken = dataclasses.replace(packed, factor=packed.factor[:1])
    with pytest.raises(ValueError, match="inconsistent GemmWeights"):
        call(weights=broken)


@pytest.mark.cpu
def test_gemm_reference_keeps_subnormals_when_the_thread_flushes_them():
    """NUMERICS.md: no implementation flushes subnormals. Under torch.set_flush_denormal(True) the packing, the
    weight dequantization, the expansion and the reference GEMM give the bits they give without it (a packed factor
    of 0 would have made the CUDA path return 0 for those experts too); tiny amaxes make every value subnormal."""
    w = random_weights(2, 64, 64, seed=5)
    w = F.NVFP4Tensor(w.data, w.scales, torch.full_like(w.amax, 1e-36), 448.0)
    q = random_activations(8, 64, seed=6)
    q_tiny = F.NVFP4Tensor(q.data, q.scales, torch.full_like(q.amax, 1e-35), q.e4m3_max)  # subnormal row factors
    off, cnt = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)

    def results():
        packed = G.pack_gemm_weights(w, swiglu=False)
        x = G.expand_nvfp4_rows(q, impl="reference")
        y = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="reference")
        return [packed.factor, G.dequantize_gemm_weights(packed), G.expand_nvfp4_rows(q_tiny).row_factor, y]

    want = results()
    assert all(bool((t.view(torch.int32) != 0).any()) for t in want), "the case must hold nonzero subnormals"
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals: nothing to keep")
    try:
        got = results()
    finally:
        torch.set_flush_denormal(False)
    for a, b in zip(got, want):  # compared as bits: torch.equal itself would read subnormals as 0 when flushing
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.cpu
def test_gemm_on_a_gpu_other_than_hopper_falls_back_or_raises(monkeypatch):
    """The GEMM kernels are sm_90a code: on another GPU, impl='auto' warns once and takes the reference, 'cuda'
    raises naming the GPU (it used to fail in the launcher although the format kernels, built for that GPU, ran).
    Stand-ins: this machine has no GPU; the tensors stay on the CPU, so only the decision is under test."""
    from ep_comm import _ext
    monkeypatch.setattr(G, "_use_cuda", lambda impl, t: impl != "reference")
    monkeypatch.setattr(G, "_has_grouped_gemm_kernel", lambda: True)
    monkeypatch.setattr(_ext, "cuda_extension_available", lambda: True)
    monkeypatch.setattr(G, "_hopper_devices", {})
    monkeypatch.setattr(F, "_problem_on_device", {1: ""})  # the format kernels run there (built for it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "B200")
    tensor = torch.zeros(1)
    tensor_on_gpu = type("T", (), {"device": torch.device("cuda", 1)})()
    with pytest.warns(RuntimeWarning, match="uses the torch reference: .*sm_90a \\(Hopper\\) code and B200 is sm_100"):
        assert not G._use_gemm_kernels("auto", tensor_on_gpu, "grouped_gemm_nvfp4", hopper_only=True)
    with pytest.raises(RuntimeError, match="B200 is sm_100"):
        G._use_gemm_kernels("cuda", tensor_on_gpu, "grouped_gemm_nvfp4", hopper_only=True)
    # The expansion and requantization kernels are not sm_90a-only: they stay on the kernels.
    assert G._use_gemm_kernels("auto", tensor_on_gpu, "expand_nvfp4_rows")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(G, "_hopper_devices", {})
    assert G._use_gemm_kernels("auto", tensor_on_gpu, "grouped_gemm_nvfp4", hopper_only=True)
    # A Hopper GPU whose driver is older than _C's runtime: no kernel runs, so MoELayer's "auto" must not pick the
    # fused experts (it used to, and then its forward failed in a kernel with impl='cuda').
    monkeypatch.setattr(F, "_problem_on_device", {1: "the driver is older than the CUDA runtime"})
    assert "driver is older" in G.gemm_kernels_unavailable(torch.device("cuda", 1))
    assert "driver is older" in G.gemm_kernels_unavailable("cuda:1")  # (a string, as torch.device takes it)
    assert moe._fused_experts_supported(torch.device("cuda", 1), 128, 128)[0] is False
    monkeypatch.setattr(F, "_problem_on_device", {1: ""})
    # A CPU device is not "available" (it was answered for the current GPU, or raised from torch.cuda).
    for device in (torch.device("cpu"), "cpu"):
        assert G.gemm_kernels_unavailable(device) == "cpu is not a CUDA device (the grouped GEMM kernels run on " \
                                                     "sm_90 GPUs)"
    # The GEMM asks with hopper_only (the wiring: a recorder in place of the decision, which then says "reference").
    asked = []
    monkeypatch.setattr(G, "_use_gemm_kernels", lambda impl, t, what, hopper_only=False: asked.append(
        (what, hopper_only)) or False)
    packed = G.pack_gemm_weights(random_weights(2, 64, 64, seed=2), swiglu=False)
    x = G.expand_nvfp4_rows(random_activations(8, 64, seed=3))
    G.grouped_gemm_nvfp4(x, torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32),
                         packed)
    assert ("grouped_gemm_nvfp4", True) in asked, asked
    assert tensor is not None


# ----------------------------------------------------------------------------------------------------------
# GPU tier: the CUDA kernel against the reference
# ----------------------------------------------------------------------------------------------------------
# (experts, N, K); K = 192 and 64 give an odd number of 64-wide k-blocks (a partial last pipeline stage); 70 experts
# make the kernels' tile scan (32 experts per warp pass, find_tile) take three passes and resume across them
SMALL_SHAPES = [(4, 128, 128), (3, 192, 256), (5, 256, 512), (2, 64, 192), (3, 128, 64), (70, 64, 128)]
BIG_SHAPE = (2, 4096, 7168)
# DeepSeek-V3's w2 (the down projection): K = 2048 in, N = 7168 out, 224 S2F6 blocks per combine row (BIG_SHAPE is its
# w1). Its counts: an empty expert (expert 0, whose weights have amax 0), 3 rows (at token tile 128 a remainder-only
# expert: the tail launch), 130 (a full tile and 2 rows: by default one wide tile of 144) and 200 (a full tile of 128
# and 72 rows in a partial one); at token tile 16, 130 and 200 are full tiles and a remainder of 2 and 8.
W2_SHAPE = (4, 7168, 2048)
W2_COUNTS = [0, 3, 130, 200]
COUNT_PATTERN = [0, 1, 17, 130, 64, 255, 0, 3, 128, 31]


def _counts(experts: int, seed: int):
    return [COUNT_PATTERN[(seed + 3 * e) % len(COUNT_PATTERN)] for e in range(experts)]


@functools.lru_cache(maxsize=4)
def _gpu_case(shape, swiglu: bool, align: int):
    """(x, offsets, counts, weights, fp32 reference on the GPU, valid-row mask) for one configuration."""
    experts, n, k = shape
    counts = [3, 200] if shape == BIG_SHAPE else W2_COUNTS if shape == W2_SHAPE else _counts(experts, n + k)
    offsets, rows = segments(counts, align)
    w = random_weights(experts, n, k, seed=n + k, device="cuda", scale_low=0x18, scale_high=0x58)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    q_x = random_activations(rows, k, seed=k + rows, device="cuda")
    x = G.expand_nvfp4_rows(q_x)
    off_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
    ref = G.grouped_gemm_nvfp4(x, off_t, cnt_t, packed, out_dtype=torch.float32, impl="reference")
    return x, off_t, cnt_t, packed, ref, valid_mask(offsets, counts, rows).cuda()


def _check_against_reference(out, ref, mask, out_dtype):
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    assert torch.all(out[~mask] == 0), "rows outside every expert were written"
    if out_dtype == torch.float32:
        rel = (torch.linalg.norm(out.double() - ref.double()) / torch.linalg.norm(ref.double())).item()
        assert rel < 1e-5, f"relative error {rel:.3e}"
    else:
        diff = (out.float() - ref).abs()
        bound = ref.abs() * 2.0 ** -8 * (1 + 1e-3) + 1e-6 * ref.abs().max()
        bad = diff > bound
        assert not bad.any(), f"{int(bad.sum())} bf16 values beyond bf16 rounding; worst {diff.max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", [SMALL_SHAPES[2], BIG_SHAPE])
def test_kernel_full_range_of_weight_scales(shape, swiglu):
    """Scale bytes over E4M3's whole range but NaN (0x00 .. 0x7E: zero, subnormals, up to 448 -- pack_weights puts
    most blocks of real weights at 0x69 .. 0x7E, and every expert has one at 0x7E), against the reference in fp32 and
    bf16; the other kernel tests keep to 0x18 .. 0x58."""
    experts, n, k = shape
    counts = [3, 200] if shape == BIG_SHAPE else _counts(experts, n + k)
    offsets, rows = segments(counts, 16)
    w = random_weights(experts, n, k, seed=n + k + 1, device="cuda", scale_low=0, scale_high=0x7F)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=k + rows + 1, device="cuda"))
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    mask = valid_mask(offsets, counts, rows).cuda()
    ref = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="reference")
    for out_dtype in (torch.float32, torch.bfloat16):
        out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, impl="cuda")
        _check_against_reference(out, ref, mask, out_dtype)


def _clamped_segments(offsets, counts, rows):
    """What the kernel computes for each expert (grouped_gemm.cu clamped_count): the count clamped to its segment,
    the segment clipped to the rows; 0 for a negative start or count."""
    clamped = []
    for e, requested in enumerate(counts):
        begin, end = offsets[e], offsets[e + 1]
        count = min(requested, min(end, rows) - begin)
        clamped.append((begin, 0 if begin < 0 or count < 0 else count))
    return clamped


@pytest.mark.gpu
@pytest.mark.parametrize("offsets,counts", [
    ([0, 16, 32, 48], [17, 5, 16]),          # a count past its segment
    ([0, 16, 32, 48], [-3, 5, 2**31 - 1]),   # negative, INT32_MAX
    ([0, 16, 40, 60], [16, 24, 20]),         # segments past the rows
    ([0, 20, 10, 48], [5, 5, 5]),            # decreasing offsets
    ([-8, 8, 24, 48], [4, 4, 4]),            # a negative start
    ([0, 60, 70, 80], [5, 5, 5]),            # starts past the rows
])
@pytest.mark.parametrize("token_tile,tail_tile", [(None, None), (16, 0), (128, 32)])
def test_inconsistent_segments_stay_inside_x_and_out(offsets, counts, token_tile, tail_tile):
    """The CUDA path cannot check the device-side offsets and counts; its docstring promises it never reads or writes
    outside x and out. x and out are views inside larger buffers whose guard rows hold a sentinel: the guards stay
    untouched, the rows of the clamped segments are the reference's, every other row of out keeps the sentinel."""
    experts, n, k, rows, guard = 3, 128, 128, 48, 16
    w = random_weights(experts, n, k, seed=31, device="cuda", scale_low=0x18, scale_high=0x58)
    packed = G.pack_gemm_weights(w, swiglu=False)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=32, device="cuda"))
    values = torch.full((rows + 2 * guard, k), float("nan"), dtype=torch.float16, device="cuda")
    factors = torch.full((rows + 2 * guard,), float("nan"), device="cuda")
    values[guard:guard + rows], factors[guard:guard + rows] = x.values, x.row_factor
    x_inside = G.ExpandedRows(values[guard:guard + rows], factors[guard:guard + rows])
    out_all = torch.full((rows + 2 * guard, n), -7.0, device="cuda")
    out = out_all[guard:guard + rows]
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    G.grouped_gemm_nvfp4(x_inside, off, cnt, packed, out_dtype=torch.float32, token_tile=token_tile,
                         tail_tile=tail_tile, impl="cuda", out=out)
    torch.cuda.synchronize()
    assert bool((out_all[:guard] == -7.0).all()) and bool((out_all[guard + rows:] == -7.0).all()), \
        "the kernel wrote outside out"
    weights = G.dequantize_gemm_weights(packed)
    x_f32 = x.values.float() * x.row_factor[:, None]
    written = torch.zeros(rows, dtype=torch.bool)
    for e, (begin, count) in enumerate(_clamped_segments(offsets, counts, rows)):
        if count:
            want = x_f32[begin:begin + count] @ weights[e].t()
            got = out[begin:begin + count]
            if want.abs().max() == 0:  # expert 0 of random_weights has amax 0 (E > 2): its rows are exactly 0
                assert torch.equal(got, want), (e, begin, count)
            else:  # as _check_against_reference
                rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
                assert rel < 1e-5, (e, begin, count, rel)
            written[begin:begin + count] = True
    assert bool((out[~written.cuda()] == -7.0).all()), "rows outside the clamped segments were written"


@pytest.mark.gpu
def test_expand_cuda_bitwise():
    q = random_activations(333, 7168, seed=9, device="cuda")
    a = G.expand_nvfp4_rows(q, impl="cuda")
    b = G.expand_nvfp4_rows(q, impl="reference")
    assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
    assert torch.equal(a.row_factor, b.row_factor)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2048, 4096, 7168, 112])
def test_quantize_expanded_rows_cuda_bitwise(dtype, k):
    """The 4/6 quantizer writing w2's operand rows directly: bitwise the CUDA quantizer + CUDA expansion and the torch
    reference, on fresh random rows with edge rows, with and without a given amax, and with a device row limit."""
    from ep_comm import _cuda_formats
    x = hidden_rows_with_edges(301, k, seed=k + 7, device="cuda", dtype=dtype)
    amax = x.float().abs().nan_to_num(0.0, posinf=float("inf")).amax(-1)
    amax[20] = amax[20] * 0.5  # a given amax below the row max: saturated values, the same in every path
    for given in (None, amax):
        got = G.quantize_expanded_rows(x, amax=given, impl="cuda")
        two_kernels = G.expand_nvfp4_rows(_cuda_formats.nvfp4_quantize(x, four_over_six=True, amax=given),
                                          impl="cuda")
        reference = G.quantize_expanded_rows(x, amax=given, impl="reference")
        for want in (two_kernels, reference):
            assert torch.equal(got.values.view(torch.int16), want.values.view(torch.int16))
            assert torch.equal(got.row_factor.view(torch.int32), want.row_factor.view(torch.int32))
    empty = G.quantize_expanded_rows(x[:0], impl="cuda")
    assert tuple(empty.values.shape) == (0, k) and tuple(empty.row_factor.shape) == (0,)
    wrong = amax.clone()
    wrong[7] = float("nan")  # the CUDA path refuses it too (MoELayer's own amax skips the check: check_amax=False)
    with pytest.raises(ValueError, match="amax must be non-negative and not NaN"):
        G.quantize_expanded_rows(x, amax=wrong, impl="cuda")
    limit = torch.tensor([123], dtype=torch.int32, device="cuda")
    part = G.quantize_expanded_rows(x, impl="cuda", num_rows_limit=limit)
    whole = G.quantize_expanded_rows(x, impl="cuda")
    assert torch.equal(part.values[:123].view(torch.int16), whole.values[:123].view(torch.int16))
    assert torch.equal(part.row_factor[:123], whole.row_factor[:123])


@pytest.mark.gpu
def test_row_limit_skips_rows_past_the_device_count():
    """expand_nvfp4_rows / the NVFP4 quantize kernel with a device-side row count (MoELayer's capacity-sized
    intermediates): the rows below it are bitwise those of the full call."""
    from ep_comm import _cuda_formats
    q = random_activations(200, 2048, seed=12, device="cuda")
    limit = torch.tensor([77], dtype=torch.int32, device="cuda")
    full = G.expand_nvfp4_rows(q, impl="cuda")
    part = G.expand_nvfp4_rows(q, impl="cuda", num_rows_limit=limit)
    assert torch.equal(part.values[:77].view(torch.int16), full.values[:77].view(torch.int16))
    x = torch.randn(200, 2048, generator=torch.Generator().manual_seed(675)).cuda()
    whole = _cuda_formats.nvfp4_quantize(x, four_over_six=True, amax=None)
    limited = _cuda_formats.nvfp4_quantize(x, four_over_six=True, amax=None, num_rows_limit=limit)
    assert torch.equal(limited.data[:77], whole.data[:77])
    assert torch.equal(limited.scales[:77].view(torch.uint8), whole.scales[:77].view(torch.uint8))
    assert torch.equal(limited.amax[:77], whole.amax[:77])
    with pytest.raises(ValueError, match="num_rows_limit"):
        G.expand_nvfp4_rows(q, impl="cuda", num_rows_limit=limit.long())


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, limit_rows", [(200, 0), (200, 77), (200, 200), (4001, 2500)])
def test_row_limit_leaves_the_rows_past_it_unwritten(num_rows, limit_rows):
    """The kernels behind num_rows_limit, on outputs the test fills with a sentinel first: rows at or past the device
    count keep the sentinel (this fails if the limit is ignored), rows below it are the full call's. The NVFP4
    quantize kernel in both output forms (codes; fp16 block values + row factor) and the expansion kernel, with the
    limit at 0, inside and at the row count; 4001 rows are more than one wave of the 4/6 codes kernel's CTAs on an
    H100 / H200, so its L2 prefetch of the next wave's rows (bounded by the limit) runs too."""
    from ep_comm import _cuda_formats, _ext
    k = 2048
    limit = torch.tensor([limit_rows], dtype=torch.int32, device="cuda")
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(695)).cuda()

    def filled(shape, dtype):
        count = math.prod(shape) * dtype.itemsize
        return torch.full((count,), 0x5A, dtype=torch.uint8, device="cuda").view(dtype).reshape(shape)

    def check(name, got, want):
        raw_got, raw_want = got.view(torch.uint8).reshape(num_rows, -1), want.view(torch.uint8).reshape(num_rows, -1)
        assert torch.equal(raw_got[:limit_rows], raw_want[:limit_rows]), f"{name}: rows below the limit"
        assert bool((raw_got[limit_rows:] == 0x5A).all()), f"{name}: a row at or past the limit was written"

    codes = dict(data=filled((num_rows, k // 2), torch.uint8), scales=filled((num_rows, k // 16), torch.uint8),
                 amax_out=filled((num_rows,), torch.float32))
    _cuda_formats._launch_nvfp4_quantize(x, True, None, limit, **codes)
    whole = _cuda_formats.nvfp4_quantize(x, four_over_six=True, amax=None)
    check("codes", codes["data"], whole.data)
    check("scales", codes["scales"], whole.scales)
    check("amax", codes["amax_out"], whole.amax)

    operand = dict(block_values=filled((num_rows, k), torch.float16), row_factor=filled((num_rows,), torch.float32))
    _cuda_formats._launch_nvfp4_quantize(x, True, None, limit, **operand)
    values, row_factor = _cuda_formats.nvfp4_quantize_block_values(x, None)
    check("block values", operand["block_values"], values)
    check("row factor", operand["row_factor"], row_factor)

    expanded = filled((num_rows, k), torch.float16)
    scales = whole.scales.view(torch.uint8)
    _ext._C.nvfp4_dequantize(whole.data.data_ptr(), scales.data_ptr(), 0, num_rows, k, float(whole.e4m3_max),
                             expanded.data_ptr(), 2, _ext.current_raw_stream(x.device), limit.data_ptr())
    check("expanded rows", expanded, G.expand_nvfp4_rows(whole, impl="cuda").values)


@pytest.mark.cpu
def test_row_limit_reaches_the_kernels_from_the_public_functions(monkeypatch):
    """The wiring behind num_rows_limit, on the host: expand_nvfp4_rows, quantize_expanded_rows (MoELayer's two
    capacity-sized calls) and the NVFP4 quantize hand the kernels the limit tensor's address (the GPU test above calls
    the kernels directly, so a public function passing 0 instead would go unseen there). The extension is a recorder."""
    from ep_comm import _cuda_formats, _ext
    calls = {}

    class Recorder:
        def nvfp4_dequantize(self, *args):  # (data, scales, amax, rows, k, e4m3_max, out, out_type, stream, limit)
            calls["expand"] = args[9]

        def nvfp4_quantize(self, *args):  # (..., stream, limit, block_values, k, row_factor)
            calls["block_values" if args[16] else "codes"] = args[15]
    recorder = Recorder()
    monkeypatch.setattr(G, "_use_gemm_kernels", lambda *args: True)
    monkeypatch.setattr(G._ext, "_C", recorder)
    monkeypatch.setattr(_cuda_formats, "_lib", lambda: recorder)
    monkeypatch.setattr(_ext, "cuda_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_ext, "current_raw_stream", lambda device: 0)
    limit = torch.tensor([3], dtype=torch.int32)
    G.expand_nvfp4_rows(random_activations(8, 64, seed=1), impl="cuda", num_rows_limit=limit)
    G.quantize_expanded_rows(torch.randn(8, 64), impl="cuda", num_rows_limit=limit)
    _cuda_formats.nvfp4_quantize(torch.randn(8, 64), four_over_six=True, amax=None, num_rows_limit=limit)
    assert calls == {"expand": limit.data_ptr(), "block_values": limit.data_ptr(), "codes": limit.data_ptr()}, calls
    calls.clear()
    G.expand_nvfp4_rows(random_activations(8, 64, seed=1), impl="cuda")
    G.quantize_expanded_rows(torch.randn(8, 64), impl="cuda")
    assert calls == {"expand": 0, "block_values": 0}, calls  # no limit: a null address, every row


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_pack_on_gpu_matches_cpu(swiglu):
    w = random_weights(3, 128, 192, seed=4)
    cpu = G.pack_gemm_weights(w, swiglu=swiglu)
    gpu = G.pack_gemm_weights(F.NVFP4Tensor(w.data.cuda(), w.scales.cuda(), w.amax.cuda(), 448.0), swiglu=swiglu)
    for name in ("values", "scales", "factor", "row_perm"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile", [None, 16, 32, 64, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_kernel_vs_reference_small(shape, swiglu, align, out_dtype, token_tile):
    x, off, cnt, packed, ref, mask = _gpu_case(shape, swiglu, align)
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    assert out.dtype == out_dtype and tuple(out.shape) == tuple(ref.shape)
    _check_against_reference(out, ref, mask, out_dtype)
    again = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    assert torch.equal(out.view(torch.uint8), again.view(torch.uint8)), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile", [None, 16, 32, 64, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [False, True])
def test_kernel_vs_reference_deepseek_shape(swiglu, out_dtype, token_tile):
    x, off, cnt, packed, ref, mask = _gpu_case(BIG_SHAPE, swiglu, 128)
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    _check_against_reference(out, ref, mask, out_dtype)
    again = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda")
    assert torch.equal(out.view(torch.uint8), again.view(torch.uint8)), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile, tail_tile", [(None, None), (16, None), (32, None), (64, None), (128, None),
                                                   (128, 0), (128, 16), (64, 32)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_vs_reference_deepseek_w2_shape(out_dtype, token_tile, tail_tile):
    """DeepSeek-V3's w2 shape (output width 7168 = 112 column tiles of 64 from K = 2048; W2_COUNTS: full tiles,
    partial ones, a tail launch, a wide tile) against the reference, bf16 and fp32 out, deterministic."""
    x, off, cnt, packed, ref, mask = _gpu_case(W2_SHAPE, False, 16)
    assert (packed.out_features, packed.k, tuple(ref.shape)) == (7168, 2048, (x.num_rows, 7168))
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, tail_tile=tail_tile,
                               impl="cuda")
    _check_against_reference(out, ref, mask, out_dtype)
    again = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile,
                                 tail_tile=tail_tile, impl="cuda")
    assert torch.equal(out.view(torch.uint8), again.view(torch.uint8)), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile, tail_tile", [(128, None), (128, 16), (128, 32), (128, 64), (64, 16),
                                                   (64, 32)])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES + [BIG_SHAPE])
def test_kernel_small_remainders_in_a_second_launch(shape, swiglu, token_tile, tail_tile):
    """Token tile 64 or 128 with the small remainders (count % tile in 1 .. tail_tile: e.g. counts 1, 3, 17, 31,
    64, 130, 200, 255 of the pattern) computed by a second launch: against the reference, and bitwise the single
    launch (tail_tile = 0) -- each output element is the same k-ordered sum whatever the tile."""
    x, off, cnt, packed, ref, mask = _gpu_case(shape, swiglu, 16)
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, token_tile=token_tile,
                               tail_tile=tail_tile, impl="cuda")
    _check_against_reference(out, ref, mask, torch.float32)
    single = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, token_tile=token_tile, tail_tile=0,
                                  impl="cuda")
    assert torch.equal(out.view(torch.int32), single.view(torch.int32))


# Counts 1..32 past a multiple of 128 and around them. With wide tiles (the default) an expert takes the wide tile
# when count % 128 > 0 and count <= 144 * (count // 128): 257, 288, 130, 144, 270, 416 here; 145 and 160 (one tile
# of 128, remainder above 16) and 1 keep the tile-32 remainder launch; 300 and 289 a third tile of 128.
WIDE_COUNTS = [257, 288, 130, 144, 145, 160, 0, 300, 1, 289, 256, 270, 416]


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_counts_just_past_multiples_of_128(swiglu, out_dtype):
    """Token tile 128 with the default split (the experts whose count fits tiles of 144 in a tile-144 launch, other
    remainders of 1..32 in a tile-32 launch; test_kernel_wide_tiles runs it with each setting): against the reference, and
    bitwise the single launch (tail_tile = 0), as fp32 / bf16 rows and as combine rows."""
    n, k = 512, 512
    offsets, rows = segments(WIDE_COUNTS, 16)
    w = random_weights(len(WIDE_COUNTS), n, k, seed=11, device="cuda", scale_low=0x18, scale_high=0x58)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=12, device="cuda"))
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(WIDE_COUNTS, dtype=torch.int32, device="cuda")
    mask = valid_mask(offsets, WIDE_COUNTS, rows).cuda()
    ref = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="reference")
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=128, impl="cuda")
    _check_against_reference(out, ref, mask, out_dtype)
    single = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=128, tail_tile=0, impl="cuda")
    assert torch.equal(out.view(torch.uint8), single.view(torch.uint8))
    if swiglu or out_dtype != torch.bfloat16:
        return
    target, areas, dest_rank, dest_row = _local_combine_target(mask, num_ranks=2, topk=3, hidden=n, seed=n + 7)
    G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target, token_tile=128)
    want = F.s2f6_quantize(single[mask], hadamard=True, sign_mask=target.sign_mask)
    got = areas[dest_rank.cuda(), dest_row.cuda()]
    assert torch.equal(got[:, :n], want.data.view(torch.uint8)), "codes differ"
    assert torch.equal(got[:, target.scale_offset:target.scale_offset + n // 32], want.scales.view(torch.uint8))


def _pytest_in_subprocess(test_file: str, selection: str, env: dict, timeout: int = 600):
    """Runs the tests of `test_file` that `selection` (a pytest -k expression) picks in a fresh interpreter with the
    environment `env` (the grouped-GEMM variables are read once per process), and asserts that some ran and all
    passed."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k",
                          selection], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, (selection, run.stdout[-3000:] + run.stderr[-2000:])
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]


@pytest.mark.gpu
def test_kernel_wide_tiles():
    """The split-launch tests under each EP_COMM_GEMM_WIDE_TILE setting (read once per process: hence a subprocess):
    144 (the default; also on 3 persistent CTAs) -- each expert whose count fits tiles of 144 without a remainder pass
    is computed whole by a token-tile-144 launch, bitwise the single tile-128 launch -- and 0 (off: tile-32 remainders
    only)."""
    import os
    tests = ("small_remainders or just_past_multiples or combine_row_epilogue_matches or fused_expert_mlp")
    for extra in ({"EP_COMM_GEMM_WIDE_TILE": "144"}, {"EP_COMM_GEMM_WIDE_TILE": "144", "EP_COMM_GEMM_MAX_CTAS": "3"},
                  {"EP_COMM_GEMM_WIDE_TILE": "0"}):
        _pytest_in_subprocess(__file__, tests, dict(os.environ, **extra), timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["exact", "fp8_inexact"])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_strided_and_offset_out(out_dtype, swiglu, precision):
    """A caller-given out whose rows are wider than N (a view of the first columns of a wider buffer) or that starts
    two elements into its storage (the API takes any even row stride >= N and an even start; the GPU tests otherwise
    pass contiguous outs): bitwise the contiguous call's output, every token tile, and the padding columns and the
    elements before the start untouched."""
    experts, n, k = SMALL_SHAPES[1]
    counts = _counts(experts, n + k)
    offsets, rows = segments(counts, 16)
    w = random_weights(experts, n, k, seed=n + k, device="cuda", scale_low=0x18, scale_high=0x58)
    packed = G.pack_gemm_weights(w, swiglu=swiglu)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=k + rows, device="cuda"), precision=precision)
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    width = n // 2 if swiglu else n
    for token_tile in (None, 16, 32, 64, 128):
        want = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda",
                                    out=torch.zeros(rows, width, dtype=out_dtype, device="cuda"))
        wide = torch.full((rows, width + 32), 7.0, dtype=out_dtype, device="cuda")
        G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda",
                             out=wide[:, :width].zero_())
        flat = torch.full((rows * width + 2,), 7.0, dtype=out_dtype, device="cuda")
        shifted = flat[2:].view(rows, width).zero_()
        G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda",
                             out=shifted)
        what = f"token tile {token_tile}"
        assert_same_floats(wide[:, :width], want, f"strided out, {what}")
        assert bool((wide[:, width:] == 7.0).all()), f"the padding columns were written, {what}"
        assert_same_floats(shifted, want, f"offset out, {what}")
        assert bool((flat[:2] == 7.0).all()), f"the elements before out were written, {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_kernel_leaves_other_rows_untouched(swiglu):
    x, off, cnt, packed, ref, mask = _gpu_case(SMALL_SHAPES[1], swiglu, 16)
    out = torch.full(tuple(ref.shape), 1234.5, dtype=torch.float32, device="cuda")
    G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, impl="cuda", out=out)
    assert torch.all(out[~mask] == 1234.5)
    _check_against_reference(torch.where(mask[:, None], out, torch.zeros_like(out)), ref, mask, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_tile", [None, 16, 128])
@pytest.mark.parametrize("shape", SMALL_SHAPES + [BIG_SHAPE])
def test_kernel_swiglu_row_amax(shape, token_tile, out_dtype):
    """row_amax from w1's epilogue: each valid row's max |out| (bf16 out: of the rounded values), untouched (0)
    elsewhere; the w2 input quantized with it is bitwise the quantizer's own amax pass."""
    from ep_comm import _cuda_formats
    x, off, cnt, packed, ref, mask = _gpu_case(shape, True, 16)
    row_amax = torch.zeros(x.num_rows, dtype=torch.float32, device="cuda")
    out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda",
                               row_amax=row_amax)
    _check_against_reference(out, ref, mask, out_dtype)
    assert torch.equal(row_amax, _row_amax_of(out, mask))
    assert row_amax.max() > 0, "no row got an amax"  # (the case has all-zero rows too: their amax is 0)
    given = _cuda_formats.nvfp4_quantize(out, four_over_six=True, amax=row_amax)
    own = _cuda_formats.nvfp4_quantize(out, four_over_six=True, amax=None)
    assert torch.equal(given.data[mask], own.data[mask])
    assert torch.equal(given.scales[mask].view(torch.uint8), own.scales[mask].view(torch.uint8))
    assert torch.equal(given.amax[mask], own.amax[mask])
    # A NaN row (its row factor NaN: every value NaN, amax 0) and a nonzero start value (max-ed, rows outside the
    # segments untouched).
    nan_row = int(mask.nonzero()[0])
    row_factor = x.row_factor.clone()
    row_factor[nan_row] = float("nan")
    x_nan = G.ExpandedRows(values=x.values, row_factor=row_factor)
    started = torch.full((x.num_rows,), 0.5, device="cuda")
    out = G.grouped_gemm_nvfp4(x_nan, off, cnt, packed, out_dtype=out_dtype, token_tile=token_tile, impl="cuda",
                               row_amax=started)
    assert bool(torch.isnan(out[nan_row]).all())
    assert torch.equal(started, torch.where(mask, torch.clamp(_row_amax_of(out, mask), min=0.5), 0.5))


@pytest.mark.gpu
def test_kernel_tests_on_few_persistent_ctas():
    """The kernel tests again with every launch persistent on 2 CTAs (EP_COMM_GEMM_MAX_CTAS, read once per process:
    hence a subprocess), so each CTA runs many work items: next-item prefetch, odd k-block counts at item
    boundaries, the scan cursor resuming, the combine-row path's per-item refill (and its special rows, refusals and
    aborts); the segment edge cases too (empty experts, inconsistent segments, rows left untouched, a one-row view).
    The kernels are the ones the caller's environment selects: by default the warp-specialized form for tiles 128 and
    144."""
    import os
    env = dict(os.environ, EP_COMM_GEMM_MAX_CTAS="2")
    tests = ("kernel_vs_reference_small or small_remainders or swiglu_row_amax or combine_row_epilogue "
             "or fused_expert_mlp or inconsistent_segments or leaves_other_rows or all_experts_empty or one_row_view")
    _pytest_in_subprocess(__file__, tests, env)
    # The FP8 mode's kernels the same way (their items, stages and prefetch differ from the fp16 ones).
    fp8_file = os.path.join(os.path.dirname(__file__), "test_grouped_gemm_fp8.py")
    _pytest_in_subprocess(fp8_file, "kernel or fused_expert_mlp", env)


def _ws_cases():
    """(name, output) of the token-tile-128 launches (and their wide tiles of 144) that the warp-specialized form
    computes (the default; EP_COMM_GEMM_WS=0 the classic kernel), on inputs made from fixed seeds, so that a process
    with the form and one without compute the same cases. Covers one and three k-blocks (an odd count), spare weight
    tiles (N = 192, 320, 576: three, five and nine 64-row tiles), more than 32 experts, the split launches (remainders, wide tiles), the SwiGLU row amax, the combine-row
    epilogue, and padding rows full of NaN right after each expert's rows (the warp-specialized form reads a tile's
    rows past the count instead of zero-filling them: they must stay in their own, unstored columns)."""
    cases = []
    shapes = SMALL_SHAPES + [(3, 320, 192), (2, 192, 64), (2, 576, 128)]
    for shape in shapes + [BIG_SHAPE, W2_SHAPE]:
        for swiglu in ((False, True) if shape != W2_SHAPE else (False,)):
            if swiglu and shape[1] % 16:
                continue
            x, off, cnt, packed, _, mask = _gpu_case(shape, swiglu, 16)
            for out_dtype in (torch.float32, torch.bfloat16):
                out = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=out_dtype, token_tile=128, impl="cuda")
                cases.append((f"{shape} swiglu={swiglu} {out_dtype}", out))
            single = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.float32, token_tile=128, tail_tile=0,
                                          impl="cuda")
            cases.append((f"{shape} swiglu={swiglu} single launch", single))
            padded = x.values.clone()
            padded[~mask] = float("nan")
            x_padded = G.ExpandedRows(values=padded, row_factor=x.row_factor)
            out = G.grouped_gemm_nvfp4(x_padded, off, cnt, packed, out_dtype=torch.float32, token_tile=128,
                                       impl="cuda", out=torch.full_like(single, 7.0))
            cases.append((f"{shape} swiglu={swiglu} NaN padding", out))
            if not swiglu:  # the combine-row epilogue (MoELayer's w2): the whole target, 0xA5 outside the rows
                for name, rows in (("combine rows", x), ("combine rows, NaN padding", x_padded)):
                    target, areas, _, _ = _local_combine_target(mask, num_ranks=2, topk=3,
                                                                hidden=packed.out_features,
                                                                seed=packed.out_features + 5)
                    G.grouped_gemm_nvfp4_combine_rows(rows, off, cnt, packed, target, token_tile=128)
                    cases.append((f"{shape} {name}", areas.clone()))
            if swiglu:
                started = torch.zeros(x.num_rows, device="cuda")
                G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.bfloat16, token_tile=128, impl="cuda",
                                     row_amax=started)
                cases.append((f"{shape} row amax", started))
    n, k = 512, 512
    offsets, rows = segments(WIDE_COUNTS, 16)
    w = random_weights(len(WIDE_COUNTS), n, k, seed=11, device="cuda", scale_low=0x18, scale_high=0x58)
    x = G.expand_nvfp4_rows(random_activations(rows, k, seed=12, device="cuda"))
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    cnt = torch.tensor(WIDE_COUNTS, dtype=torch.int32, device="cuda")
    for swiglu in (False, True):
        packed = G.pack_gemm_weights(w, swiglu=swiglu)
        cases.append((f"wide counts swiglu={swiglu}",
                      G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.bfloat16, token_tile=128,
                                           impl="cuda")))
    return cases


def _profiled_ws_cases():
    """_ws_cases, and the names of the grouped-GEMM kernels that computed them (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        cases = _ws_cases()
        torch.cuda.synchronize()
    return cases, {event.name for event in profile.events() if "grouped_gemm_nvfp4_" in event.name}


def _ws_save(path: str):
    """Classic side of test_kernel_warp_specialized_is_bitwise_the_classic_kernel (EP_COMM_GEMM_WS=0): the cases, saved;
    and no warp-specialized kernel ran."""
    cases, ran = _profiled_ws_cases()
    ran = {name for name in ran if "grouped_gemm_nvfp4_ws_kernel" in name}
    assert not ran, f"EP_COMM_GEMM_WS=0 still ran {sorted(ran)}"
    torch.save([(name, out.cpu()) for name, out in cases], path)
    print(f"{len(cases)} cases saved")


def _ws_compare(path: str):
    """Warp-specialized side of test_kernel_warp_specialized_is_bitwise_the_classic_kernel: every case bitwise the
    saved one, and the warp-specialized kernel did run (the launcher takes the classic one where the form does not
    apply: the kernel names in the profile tell which ran)."""
    saved = torch.load(path)
    cases, ran = _profiled_ws_cases()
    names = {name for name in ran if "grouped_gemm_nvfp4_ws_kernel" in name}
    # And no tile-128 / 144 launch fell back to the classic kernel (it would pass bitwise trivially).
    classic = {name for name in ran if "grouped_gemm_nvfp4_kernel" in name and
               any(form in name for form in ("<128,", "<144,", "ILi128E", "ILi144E"))}
    assert not classic, f"classic tile-128/144 kernels ran on the warp-specialized side: {sorted(classic)}"
    # (Each instance: token tiles 128 and 144 (the wide last tiles), with the direct epilogues and with combine rows;
    # demangled "<128, false>" or mangled "ILi128ELb0E".)
    for tile, combine_rows in ((128, False), (128, True), (144, False), (144, True)):
        forms = (f"<{tile}, {str(combine_rows).lower()}>", f"ILi{tile}ELb{int(combine_rows)}E")
        assert any(form in name for name in names for form in forms), \
            f"the warp-specialized kernel (tile {tile}, combine rows: {combine_rows}) did not run; ran: {sorted(names)}"
    assert [name for name, _ in cases] == [name for name, _ in saved]
    for (name, out), (_, want) in zip(cases, saved):
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), name
    print(f"{len(cases)} cases bitwise equal")


@pytest.mark.gpu
def test_kernel_warp_specialized_is_bitwise_the_classic_kernel(tmp_path):
    """The warp-specialized form of token tiles 128 / 144 (the default; EP_COMM_GEMM_WS=0 selects the classic kernel,
    read once per process: hence subprocesses) gives the classic kernel's bits on every case of _ws_cases (same work
    items and k order per output element, same epilogue), also on few persistent CTAs (many items per CTA: the ring
    and the item queue continue across items)."""
    import os
    import subprocess
    import sys
    # Both sides choose their kernels from the defaults and what is set here alone: no grouped-GEMM variable from the
    # caller (a classic tuning override would keep the classic kernel on the warp-specialized side too, and
    # EP_COMM_GEMM_WIDE_TILE=0 would leave the tile-144 instances out).
    base_env = {name: value for name, value in os.environ.items() if not name.startswith("EP_COMM_GEMM_")}
    path = str(tmp_path / "classic.pt")
    here = os.path.dirname(os.path.abspath(__file__))

    def child(function: str, extra: dict):
        script = f"import sys; sys.path.insert(0, {here!r}); import test_grouped_gemm as T; T.{function}({path!r})"
        return subprocess.run([sys.executable, "-c", script], env=dict(base_env, **extra), capture_output=True,
                              text=True, timeout=600)

    run = child("_ws_save", {"EP_COMM_GEMM_WS": "0"})
    assert run.returncode == 0 and "cases saved" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    # (The kernel tests against the reference run on few persistent CTAs with the default kernels, the form among them,
    # in test_kernel_tests_on_few_persistent_ctas.)
    for extra in ({}, {"EP_COMM_GEMM_MAX_CTAS": "3"}):
        run = child("_ws_compare", extra)
        assert run.returncode == 0 and "bitwise equal" in run.stdout, (extra, run.stdout[-3000:] + run.stderr[-3000:])


@pytest.mark.gpu
def test_kernel_all_experts_empty_and_no_rows():
    x, off, _, packed, ref, _ = _gpu_case(SMALL_SHAPES[0], False, 16)
    zero = torch.zeros(packed.num_experts, dtype=torch.int32, device="cuda")
    out = G.grouped_gemm_nvfp4(x, off, zero, packed, out_dtype=torch.float32, impl="cuda")
    torch.cuda.synchronize()
    assert torch.all(out == 0)
    empty = G.ExpandedRows(x.values[:0], x.row_factor[:0])
    out = G.grouped_gemm_nvfp4(empty, torch.zeros_like(off), zero, packed, out_dtype=torch.float32, impl="cuda")
    assert tuple(out.shape) == (0, packed.out_features)


def _local_combine_target(mask, num_ranks: int, topk: int, hidden: int, seed: int, area_offset: int = 256):
    """A CombineRowsTarget whose "ranks" are areas of one local allocation (filled with 0xA5), with the valid rows
    (mask) mapped to distinct random (rank, token, slot) rows. Returns (target, areas [W, T * K, row_bytes] view,
    (rank, row in area) per valid row)."""
    from ep_comm.types import CombineRowsTarget, s2f6_combine_row_layout
    rows = mask.shape[0]
    valid = int(mask.sum())
    tokens = (valid + num_ranks * topk - 1) // (num_ranks * topk) + 3
    scale_offset, row_bytes = s2f6_combine_row_layout(hidden)
    area_bytes = tokens * topk * row_bytes
    memory = torch.full((area_offset + num_ranks * area_bytes + 256,), 0xA5, dtype=torch.uint8, device="cuda")
    base = memory.data_ptr()
    # Each fake rank's "region" starts area_bytes apart; the area sits at area_offset within it.
    bases = torch.tensor([base + r * area_bytes for r in range(num_ranks)], dtype=torch.int64, device="cuda")
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_ranks * tokens * topk, generator=g)[:valid]
    src_rank = torch.full((rows,), -1, dtype=torch.int32)
    src_token = torch.full((rows,), -1, dtype=torch.int32)
    topk_slot = torch.full((rows,), -1, dtype=torch.int32)
    src_rank[mask.cpu()] = (slots // (tokens * topk)).int()
    src_token[mask.cpu()] = (slots % (tokens * topk) // topk).int()
    topk_slot[mask.cpu()] = (slots % topk).int()
    target = CombineRowsTarget(bases=bases, area_offset=area_offset, src_rank=src_rank.cuda(),
                               src_token=src_token.cuda(), topk_slot=topk_slot.cuda(), num_topk=topk,
                               max_tokens=tokens, hidden=hidden, row_bytes=row_bytes, scale_offset=scale_offset, sign_mask=0x9E3779B9)
    areas = memory[area_offset:area_offset + num_ranks * area_bytes].view(num_ranks, tokens * topk, row_bytes)
    return target, areas, slots // (tokens * topk), slots % (tokens * topk)


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile, tail_tile", [(None, None), (16, None), (32, None), (64, None), (128, None),
                                                   (128, 0), (128, 16), (64, 32)])
@pytest.mark.parametrize("shape", SMALL_SHAPES + [BIG_SHAPE, pytest.param(W2_SHAPE, id="deepseek_w2")])
def test_kernel_combine_row_epilogue_matches_bf16_output_then_s2f6(shape, token_tile, tail_tile):
    """The combine-row epilogue (out_type 2) against the bf16 epilogue followed by the S2F6 quantizer: every valid
    row's codes and scales, at its (rank, token, slot) row of the target, bitwise; every other byte untouched."""
    x, off, cnt, packed, _, mask = _gpu_case(shape, False, 16)
    check_combine_rows_match_bf16_then_s2f6(x, off, cnt, packed, mask, token_tile, tail_tile,
                                            seed=packed.out_features + 7)


# Row factors that make whole rows special in the GEMM's output: NaN, zero, overflowing to +-Inf in bf16 (and in the
# fp32 accumulator's product), and so small that the row is subnormal or zero in bf16.
SPECIAL_ROW_FACTORS = (float("nan"), 0.0, 3.0e38, -3.0e38, 1.0e-38, 1.0e-42, float("inf"))


def with_special_row_factors(x, mask):
    """x with the SPECIAL_ROW_FACTORS on spread-out valid rows (and their negatives on some more): the rows the
    combine-row epilogue's RHT + S2F6 must encode exactly as the S2F6 quantizer does. Returns (x', special rows)."""
    valid = mask.nonzero().flatten().tolist()
    step = max(1, len(valid) // (2 * len(SPECIAL_ROW_FACTORS)))
    rows = valid[::step][:2 * len(SPECIAL_ROW_FACTORS)]
    factor = x.row_factor.clone()
    for i, row in enumerate(rows):
        value = SPECIAL_ROW_FACTORS[i % len(SPECIAL_ROW_FACTORS)]
        factor[row] = value if i < len(SPECIAL_ROW_FACTORS) else -value
    return dataclasses.replace(x, row_factor=factor), rows


@pytest.mark.gpu
@pytest.mark.parametrize("token_tile", [None, 16, 128])
def test_kernel_combine_row_epilogue_special_rows(token_tile):
    """The combine-row epilogue on rows that are NaN, zero, +-Inf, overflowing or subnormal after the outer scale:
    bitwise the bf16 epilogue followed by the S2F6 quantizer (RHT included), as for finite rows."""
    x, off, cnt, packed, _, mask = _gpu_case(SMALL_SHAPES[2], False, 16)
    special, rows = with_special_row_factors(x, mask)
    assert_special_rows_reached(special, off, cnt, packed, rows, token_tile)
    check_combine_rows_match_bf16_then_s2f6(special, off, cnt, packed, mask, token_tile, None, seed=31)


def assert_special_rows_reached(special, off, cnt, packed, rows, token_tile) -> None:
    """The special row factors do make the GEMM's bf16 output hold NaN rows, infinite values and all-zero rows (so
    the combine-row comparison meets them; also used by the FP8 mode's test)."""
    bf16 = G.grouped_gemm_nvfp4(special, off, cnt, packed, out_dtype=torch.bfloat16, token_tile=token_tile,
                                impl="cuda").float()
    picked = bf16[torch.tensor(rows, device="cuda")]
    assert bool(torch.isnan(picked).all(dim=1).any()) and bool(torch.isinf(picked).any())
    assert bool((picked == 0).all(dim=1).any())


def check_combine_rows_match_bf16_then_s2f6(x, off, cnt, packed, mask, token_tile, tail_tile, seed: int) -> None:
    """grouped_gemm_nvfp4_combine_rows into a local target against grouped_gemm_nvfp4's bf16 rows through the S2F6
    quantizer: codes and scales bitwise at each valid row's (rank, token, slot) row; no other byte of the areas
    written (also used by the FP8 mode's test)."""
    hidden = packed.out_features
    target, areas, dest_rank, dest_row = _local_combine_target(mask, num_ranks=2, topk=3, hidden=hidden, seed=seed)
    before = areas.clone()
    G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target, token_tile=token_tile, tail_tile=tail_tile)
    bf16 = G.grouped_gemm_nvfp4(x, off, cnt, packed, out_dtype=torch.bfloat16, token_tile=token_tile,
                                tail_tile=tail_tile, impl="cuda")
    want = F.s2f6_quantize(bf16[mask], hadamard=True, sign_mask=target.sign_mask)
    got = areas[dest_rank.cuda(), dest_row.cuda()]
    assert torch.equal(got[:, :hidden], want.data.view(torch.uint8)), "codes differ"
    scale_bytes = got[:, target.scale_offset:target.scale_offset + hidden // 32]
    assert torch.equal(scale_bytes, want.scales.view(torch.uint8)), "scales differ"
    written = torch.zeros(areas.shape[:2], dtype=torch.bool, device="cuda")
    written[dest_rank.cuda(), dest_row.cuda()] = True
    assert torch.equal(areas[~written], before[~written]), "rows that no valid row maps to were written"
    pad = torch.ones(areas.shape[-1], dtype=torch.bool, device="cuda")
    pad[:hidden] = False
    pad[target.scale_offset:target.scale_offset + hidden // 32] = False
    assert torch.equal(areas[written][:, pad], before[written][:, pad]), "bytes between codes and scales written"


@pytest.mark.gpu
def test_kernel_combine_row_epilogue_stores_nothing_once_aborted():
    """CombineRowsTarget.abort_flag: with the flag clear the rows are stored; once it is set (a Buffer that gave up
    after a timeout) not one byte of the target areas changes -- fail-stop towards the peers."""
    import dataclasses
    x, off, cnt, packed, _, mask = _gpu_case(SMALL_SHAPES[0], False, 16)
    target, areas, _, _ = _local_combine_target(mask, num_ranks=2, topk=2, hidden=packed.out_features, seed=11)
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    target = dataclasses.replace(target, abort_flag=flag.data_ptr())
    before = areas.clone()
    G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target)
    assert not torch.equal(areas, before), "flag clear: the rows must be stored"
    areas.copy_(before)
    flag[0] = 1
    G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target)
    torch.cuda.synchronize()
    assert torch.equal(areas, before), "flag set: the epilogue stored rows"


@pytest.mark.gpu
def test_kernel_combine_row_epilogue_skips_rows_that_name_no_destination():
    """Counts that take in each segment's padding (expert_offsets.diff(), as a caller might) reach rows whose
    (src_rank, src_token, topk_slot) are the dispatch's -1s; a rank past the table, a token past the area or a slot
    past num_topk name no row either. Those rows are not stored -- bases[-1] would be a wild address, local or over
    NVLink -- and the valid rows are, bitwise as with the exact counts; nothing else in the areas changes."""
    import dataclasses
    x, off, cnt, packed, _, mask = _gpu_case(SMALL_SHAPES[1], False, 16)
    hidden, rows = packed.out_features, mask.shape[0]
    target, areas, dest_rank, dest_row = _local_combine_target(mask, num_ranks=2, topk=3, hidden=hidden, seed=21)
    tokens = areas.shape[1] // target.num_topk
    before = areas.clone()
    G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, target)
    want = areas.clone()
    # Padding counted in; and three of the padding rows get one bad field each (the rest of the triple valid).
    padded_counts = torch.diff(torch.cat([off, torch.tensor([rows], dtype=torch.int32, device="cuda")]))[:-1]
    assert bool((padded_counts > cnt).any()), "the case needs padding rows"
    pad_rows = (~mask).nonzero().flatten()
    pad_rows = pad_rows[pad_rows < int(off[-1])][:3].tolist()
    assert len(pad_rows) == 3
    src_rank, src_token, topk_slot = (t.clone() for t in (target.src_rank, target.src_token, target.topk_slot))
    for row, (rank, token, slot) in zip(pad_rows, [(2, 0, 0), (0, tokens, 0), (1, 0, 3)]):
        src_rank[row], src_token[row], topk_slot[row] = rank, token, slot
    bad = dataclasses.replace(target, src_rank=src_rank, src_token=src_token, topk_slot=topk_slot)
    areas.copy_(before)
    G.grouped_gemm_nvfp4_combine_rows(x, off, padded_counts.contiguous(), packed, bad)
    torch.cuda.synchronize()
    assert torch.equal(areas, want), "rows naming no destination were stored (or the valid rows differ)"
    assert not torch.equal(want, before)


@pytest.mark.gpu
def test_kernel_combine_row_epilogue_refuses_bad_targets():
    x, off, cnt, packed, _, mask = _gpu_case(SMALL_SHAPES[0], False, 16)
    target, _, _, _ = _local_combine_target(mask, num_ranks=1, topk=2, hidden=packed.out_features, seed=3)
    import dataclasses
    with pytest.raises(ValueError, match="columns"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, dataclasses.replace(target, hidden=64))
    with pytest.raises(ValueError, match="src_token"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, dataclasses.replace(target, src_token=target.src_token[:3]))
    with pytest.raises(ValueError, match="row_bytes"):  # no room for the scales
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed,
                                          dataclasses.replace(target, row_bytes=target.scale_offset))
    swiglu = G.pack_gemm_weights(random_weights(4, 256, 128, seed=1, device="cuda"), swiglu=True)
    with pytest.raises(ValueError, match="SwiGLU"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, swiglu, target)
    with pytest.raises(TypeError, match="CombineRowsTarget"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, dataclasses.asdict(target))
    with pytest.raises(ValueError, match="num_topk"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, dataclasses.replace(target, num_topk=0))
    with pytest.raises(ValueError, match="max_tokens"):
        G.grouped_gemm_nvfp4_combine_rows(x, off, cnt, packed, dataclasses.replace(target, max_tokens=0))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")  # torch's note on the mode it uses
def test_fused_expert_mlp_matches_reference_experts_without_host_sync():
    """moe.fused_expert_mlp (w1+SwiGLU -> NVFP4 4/6 requant -> w2 on the grouped GEMM) against
    moe.expert_mlp_reference per expert, on a capacity-sized layout (unused rows past expert_offsets[-1]),
    with torch's sync debug mode turning any host synchronization into an error."""
    experts, hidden, inter = 3, 256, 128
    g = torch.Generator().manual_seed(21)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    packed = moe.pack_weights(w1.cuda(), w2.cuda())
    w1_gemm = G.pack_gemm_weights(packed.w1, swiglu=True)
    w2_gemm = G.pack_gemm_weights(packed.w2, swiglu=False)
    counts = [5, 0, 37]
    offsets, rows = segments(counts, align=16, extra_rows=40)
    tokens = random_activations(rows, hidden, seed=22, device="cuda")
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    counts_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe.fused_expert_mlp(tokens, offsets_t, counts_t, w1_gemm, w2_gemm)
        again = moe.fused_expert_mlp(tokens, offsets_t, counts_t, w1_gemm, w2_gemm)
        h_fused = moe.fused_expert_hidden(tokens, offsets_t, counts_t, w1_gemm, amax_in_w1=True)
        h_pass = moe.fused_expert_hidden(tokens, offsets_t, counts_t, w1_gemm, amax_in_w1=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    valid = valid_mask(offsets, counts, rows).cuda()
    # The w2 input with the amax from w1's epilogue is bitwise the one with the quantizer's own amax pass.
    assert torch.equal(h_fused.values[valid].view(torch.int16), h_pass.values[valid].view(torch.int16))
    assert torch.equal(h_fused.row_factor[valid], h_pass.row_factor[valid])
    w1_f, w2_f = F.nvfp4_dequantize(packed.w1), F.nvfp4_dequantize(packed.w2)
    for e, (start, count) in enumerate(zip(offsets, counts)):
        if count == 0:
            continue
        rows_e = slice(start, start + count)
        segment = F.NVFP4Tensor(tokens.data[rows_e], tokens.scales[rows_e], tokens.amax[rows_e], tokens.e4m3_max)
        want = moe.expert_mlp_reference(segment, w1_f[e], w2_f[e]).float()
        got = out[rows_e].float()
        assert torch.equal(out[rows_e], again[rows_e]), "not deterministic"
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 5e-3, f"expert {e}: relative L2 {rel:.2e}"


@pytest.mark.gpu
def test_kernel_takes_a_one_row_view_with_any_row_stride():
    """A one-row x.values view of a wider tensor is contiguous for torch whatever its stride(0) (68 here, not a
    multiple of 8): the GEMM passes the row length as the stride instead of refusing it."""
    w = random_weights(1, 64, 64, seed=41, device="cuda", scale_low=0x18, scale_high=0x58)
    packed = G.pack_gemm_weights(w, swiglu=False)
    x = G.expand_nvfp4_rows(random_activations(4, 64, seed=42, device="cuda"))
    wide = torch.zeros(4, 68, dtype=torch.float16, device="cuda")
    wide[:, :64] = x.values
    one = G.ExpandedRows(values=wide[:1, :64], row_factor=x.row_factor[:1].contiguous())
    assert one.values.is_contiguous() and one.values.stride(0) == 68
    off = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    cnt = torch.tensor([1], dtype=torch.int32, device="cuda")
    out = G.grouped_gemm_nvfp4(one, off, cnt, packed, out_dtype=torch.float32, impl="cuda")
    ref = G.grouped_gemm_nvfp4(one, off, cnt, packed, out_dtype=torch.float32, impl="reference")
    _check_against_reference(out, ref, torch.ones(1, dtype=torch.bool, device="cuda"), torch.float32)


@pytest.mark.cpu
def test_cpu_api_edges():
    """Inputs a review found accepted silently or named wrongly (2026-12-04)."""
    x = torch.randn(4, 32)
    nan_amax = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    # check_amax=False skips the amax check on the reference path too (it used to check anyway, with a host read).
    rows = G.quantize_expanded_rows(x, amax=nan_amax, impl="reference", check_amax=False)
    assert rows.values.shape == (4, 32)
    with pytest.raises(ValueError, match="non-negative"):
        G.quantize_expanded_rows(x, amax=nan_amax, impl="reference")
    with pytest.raises(TypeError, match="check_amax must be a bool"):
        G.quantize_expanded_rows(x, amax=nan_amax, impl="reference", check_amax=None)
    # Weights whose NVFP4 decode overflows (finite masters of |w| > FLT_MAX / 448) are refused when packed.
    w = torch.randn(2, 64, 64)
    w[1] *= 1e36 / float(w[1].abs().max())
    q = F.nvfp4_quantize(w, four_over_six=False, amax=moe._per_expert_amax(w), impl="reference")
    with pytest.raises(ValueError, match="has an expert whose largest"):
        G.pack_gemm_weights(q, swiglu=False)
    # The FP8 column order helper takes the FP8 rows only (fp16 rows came back with scrambled columns).
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        G.fp8_rows_in_column_order(torch.randn(2, 32).half())
    # A 2-D int32 offsets tensor is named by its shape, not by its (right) dtype.
    with pytest.raises(TypeError, match=r"got torch.int32 of shape \(1, 3\)"):
        G._check_segments(torch.zeros(1, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 2)
