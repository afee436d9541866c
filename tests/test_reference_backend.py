"""The reference backend (all_to_all_single) against the single-process oracle, on gloo and NCCL."""
import pytest
import torch

import dist_cases
from harness import run_ranks


def _both_workers(rank, world, backend, device_kind):
    return dist_cases.semantics_worker(rank, world, backend, device_kind), \
        dist_cases.errors_worker(rank, world, backend, device_kind)


@pytest.mark.cpu
def test_gloo_world2_semantics_and_errors():
    results = run_ranks(_both_workers, 2, "reference", "cpu", backend="gloo")
    semantics, errors = zip(*results)
    assert all(e == "errors ok" for e in errors)
    # Every rank checked every case; the identity round trip stayed within the format error bounds.
    assert all(len(s) == len(dist_cases.standard_cases(2)) + 1 for s in semantics)


@pytest.mark.cpu
@pytest.mark.parametrize("world", [3, 4])
def test_gloo_semantics(world):
    results = run_ranks(dist_cases.semantics_worker, world, "reference", "cpu", backend="gloo")
    assert len(results) == world


@pytest.mark.cpu
def test_gloo_world8_small():
    """EP8 on CPU ranks: the world-size-independent semantics at the largest size issue 5 asks for."""
    results = run_ranks(dist_cases.scaling_worker, 8, "reference", "cpu", backend="gloo", timeout_s=900)
    assert len(results) == 8


@pytest.mark.multigpu
def test_nccl_world2_semantics_and_errors():
    world = min(torch.cuda.device_count(), 8)
    results = run_ranks(_both_workers, world, "reference", "cuda", backend="nccl")
    assert len(results) == world
