"""bench/near_tie_rates.py's model of the 4/6 choice (CPU only): its roundings, and its choice against the library's
reference quantizer on random rows."""
import numpy as np
import pytest
import torch

import bench_module
from ep_comm import formats

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def model():
    return bench_module.load("near_tie_rates")


def test_roundings_tie_to_even(model):
    a = np.array([0.0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0])
    assert model.e2m1_round(a).tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    v = np.array([17.0, 19.0, 500.0, 2.0**-9, 3 * 2.0**-10, 0.0])  # E4M3: step 2 in [16, 32), subnormal step 2^-9
    assert model.e4m3_round(v).tolist() == [16.0, 20.0, 448.0, 2.0**-9, 2 * 2.0**-9, 0.0]


def test_choice_matches_the_reference_quantizer(model):
    torch.manual_seed(0)
    x = torch.randn(64, 1024, dtype=torch.float32)
    x[:, ::97] *= 30.0  # outlier columns: more blocks where the two scales differ in their last bits
    q = formats.nvfp4_quantize(x, four_over_six=True, impl="reference")
    chosen = formats.e4m3_decode(q.scales).double().numpy()
    c = model.block_candidates(x.double().numpy())
    differ = c.scale4 != c.scale6
    model_map4 = differ & (c.err4 < c.err6)
    # The model is float64 and the reference fp32: only blocks within a hair of a tie (or of a scale rounding
    # boundary) may disagree.
    agree = np.where(model_map4, chosen == c.scale4, chosen == c.scale6)
    assert differ.mean() > 0.9 and 0.2 < model_map4.mean() < 0.8
    assert agree.mean() > 0.999, f"model and reference choose differently in {(~agree).sum()} of {agree.size} blocks"


def test_rates_grow_with_the_band_and_skip_equal_scales(model):
    rng = np.random.default_rng(1)
    rates = model.near_tie_rates(model.sample("normal", 64, 1024, rng), (14, 10, 7))
    blocks = [rates["bands"][b]["block_fraction"] for b in ("2^-14", "2^-10", "2^-7")]
    assert blocks == sorted(blocks) and blocks[-1] > blocks[0] and blocks[-1] < 0.2
    warps = [rates["bands"][b]["warp_fraction"] for b in ("2^-14", "2^-10", "2^-7")]
    assert warps == sorted(warps) and all(w >= b for w, b in zip(warps, blocks))
    # A block whose two scales are equal (all zeros: both scales 0) is never counted as undecided.
    zeros = model.near_tie_rates(np.zeros((2, 32)), (7,))
    assert zeros["same_scale_fraction"] == 1.0 and zeros["bands"]["2^-7"]["block_fraction"] == 0.0
