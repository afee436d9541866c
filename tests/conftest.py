"""Test tiers: `cpu` runs anywhere; `gpu` needs CUDA and ep_comm._C; `multigpu` needs >= 2 GPUs, or one GPU with
EP_COMM_TEST_SHARED_GPU=1 (two ranks share it: tests/harness.py).

GPU tiers skip with the reason (no CUDA device, or the extension's import error), never silently pass.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # harness, oracle and dist_cases are plain modules here

from harness import SHARED_GPU  # noqa: E402

for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                    ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(name, value)


def pytest_collection_modifyitems(config, items):
    import ep_comm
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Two ranks on one GPU (harness.SHARED_GPU: only where exactly one GPU is visible); the spawned ranks inherit the
    # library's switch from this process's environment.
    shared = SHARED_GPU
    if shared:
        os.environ["EP_COMM_ALLOW_SHARED_GPU"] = "1"
    no_ext = None if ep_comm.cuda_extension_available() else ep_comm.cuda_extension_error()
    for item in items:
        # (markers, not item.keywords: a parametrize id such as "gpu" or "nccl" is a keyword too)
        marked = {marker.name for marker in item.iter_markers()}
        if "gpu" in marked or "multigpu" in marked:
            if num_gpus == 0:
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
            elif no_ext:
                item.add_marker(pytest.mark.skip(reason=f"ep_comm._C unavailable: {no_ext}"))
        if "multigpu" in marked and 0 < num_gpus < 2 and not shared:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {num_gpus} (EP_COMM_TEST_SHARED_GPU=1 runs "
                                                    f"2 ranks on it)"))
        if "nccl" in marked and shared:
            item.add_marker(pytest.mark.skip(reason="needs NCCL between GPUs; the ranks share one GPU here"))


def pytest_collection_finish(session):
    """Every test belongs to exactly one tier (cpu, gpu or multigpu): a test without one would run nowhere on purpose,
    and one with two would be skipped by the wrong rule."""
    wrong = [item.nodeid for item in session.items  # markers, not keywords (a parametrize id "cpu" is a keyword too)
             if len({marker.name for marker in item.iter_markers()} & {"cpu", "gpu", "multigpu"}) != 1]
    if wrong:
        raise pytest.UsageError(f"tests without exactly one tier marker (cpu / gpu / multigpu): {wrong[:10]}")


@pytest.fixture(autouse=True)
def _strict_teardown_in_gpu_tiers(request):
    """harness.run_ranks fails a gpu / multigpu test whose rank crashes after reporting (NVSHMEM, CUDA IPC or NCCL
    teardown); cpu tests keep the launcher's warning."""
    import harness
    harness.GPU_TIER_TEST = any(marker.name in ("gpu", "multigpu") for marker in request.node.iter_markers())
    yield
    harness.GPU_TIER_TEST = False
