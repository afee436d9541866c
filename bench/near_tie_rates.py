"""How often the NVFP4 4/6 choice is a near-tie: the blocks a fast path with a given error bound cannot decide.

    python bench/near_tie_rates.py [--rows 2048] [--hidden 7168]

A model, not the kernel: float64 numpy, with the NUMERICS steps (row scale 6M / amax with M = 256, block scales
E4M3-rounded from amax_b / 4 and amax_b / 6, E2M1 rounding with ties to the even code, squared error of the decoded
block) but not their fp32 roundings. Rates of near-ties do not depend on those last bits.

The fast 4/6 path (csrc/qm_nvfp4_block.cuh) decides a block only when its two approximate errors differ by more than
a bound, ~2^-14 (A_4 + A_6) with fp32 error chains; a block where both scales are equal needs no bound. Every other
block takes the exact formula, and on the GPU a warp of 32 threads x 2 blocks runs it if any of its 64 blocks needs
it. This prints, per input distribution and relative band 2^-b, the fraction of blocks with
|err_4 - err_6| < 2^-b (err_4 + err_6) and unequal scales, and the fraction of warps with at least one such block:
what a wider bound (f16 error chains: 11-bit significands, ~2^-9 .. 2^-7) would send to the exact formula.
"""
from __future__ import annotations

import argparse
import json
from typing import NamedTuple

import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0  # the largest E4M3 value, where block scales saturate
FOUR_SIX_M = 256.0  # the 4/6 row scale's M (6M = 1536): headroom for map-4's scales
BLOCKS_PER_WARP = 64


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Non-negative values to the E4M3 grid (round to nearest even, saturating at 448; subnormal step 2^-9)."""
    v = np.minimum(v, E4M3_MAX)
    exponent = np.maximum(np.floor(np.log2(np.maximum(v, 2.0**-9))), -6.0)
    step = 2.0 ** (exponent - 3)
    return np.round(v / step) * step  # np.round: ties to even


# Midpoints between neighbouring E2M1 codes; at midpoint j the upper code j + 1 wins a tie iff it is even (j odd).
E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
E2M1_TIE_GOES_UP = np.arange(7) % 2 == 1


def e2m1_round(a: np.ndarray) -> np.ndarray:
    """Non-negative values to the E2M1 grid, clamped at 6, ties to the even code (0.25 -> 0, 0.75 -> 1, 5 -> 4)."""
    a = np.minimum(a, 6.0)[..., None]
    code = ((a > E2M1_MIDPOINTS) | ((a == E2M1_MIDPOINTS) & E2M1_TIE_GOES_UP)).sum(-1)
    return E2M1_VALUES[code]


class BlockCandidates(NamedTuple):
    """Per 16-element block [rows, hidden / 16]: both candidates' block scales (E4M3 values) and squared errors."""
    scale4: np.ndarray
    scale6: np.ndarray
    err4: np.ndarray
    err6: np.ndarray


def block_candidates(x: np.ndarray) -> BlockCandidates:
    """Both 4/6 candidates of every block of rows x [rows, hidden] (float64, hidden % 16 == 0)."""
    amax = np.abs(x).max(1, keepdims=True)
    s_dec = np.where(amax > 0, amax, 1.0) / (6.0 * FOUR_SIX_M)
    blocks = np.abs(x).reshape(x.shape[0], -1, 16)
    block_amax = blocks.max(-1)
    scales, errors = {}, {}
    for k in (4, 6):
        scales[k] = e4m3_round(block_amax / k / s_dec)
        decode = scales[k] * s_dec
        codes = e2m1_round(blocks / np.where(decode > 0, decode, np.inf)[..., None])
        errors[k] = ((codes * decode[..., None] - blocks) ** 2).sum(-1)
    return BlockCandidates(scales[4], scales[6], errors[4], errors[6])


def near_tie_rates(x: np.ndarray, bands: tuple) -> dict:
    c = block_candidates(x)
    same_scale = c.scale4 == c.scale6
    total = c.err4 + c.err6
    gap = np.abs(c.err4 - c.err6)
    out = {"blocks": int(c.err4.size), "map4_fraction": float((~same_scale & (c.err4 < c.err6)).mean()),
           "same_scale_fraction": float(same_scale.mean()), "bands": {}}
    for b in bands:
        undecided = ~same_scale & (gap <= 2.0**-b * total)
        block_fraction = float(undecided.mean())
        out["bands"][f"2^-{b}"] = {"block_fraction": block_fraction,
                                   "warp_fraction": 1.0 - (1.0 - block_fraction) ** BLOCKS_PER_WARP}
    return out


def sample(distribution: str, rows: int, hidden: int, rng: np.random.Generator) -> np.ndarray:
    if distribution == "normal":
        x = rng.standard_normal((rows, hidden))
    elif distribution == "laplace":
        x = rng.laplace(size=(rows, hidden))
    elif distribution == "outlier_columns":  # every 97th column 30x larger, as activation outlier channels
        x = rng.standard_normal((rows, hidden))
        x[:, ::97] *= 30.0
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    return x.astype(np.float32).astype(np.float64)  # fp32 inputs, as the kernels see bf16 / fp32 rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.hidden % 16 != 0 or args.rows < 1:
        raise SystemExit("--hidden must be a multiple of 16 and --rows at least 1")
    rng = np.random.default_rng(args.seed)
    bands = (14, 12, 10, 9, 8, 7)
    results = {}
    for distribution in ("normal", "laplace", "outlier_columns"):
        results[distribution] = near_tie_rates(sample(distribution, args.rows, args.hidden, rng), bands)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
