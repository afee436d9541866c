"""Test tiers: `cpu` runs anywhere; `gpu` needs CUDA and ep_comm._C; `multigpu` needs >= 2 GPUs.

GPU tiers skip with the reason (no CUDA device, or the extension's import error), never silently pass.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # harness, oracle and dist_cases are plain modules here

for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                    ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(name, value)


def pytest_collection_modifyitems(config, items):
    import ep_comm
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_ext = None if ep_comm.cuda_extension_available() else ep_comm.cuda_extension_error()
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if num_gpus == 0:
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
            elif no_ext:
                item.add_marker(pytest.mark.skip(reason=f"ep_comm._C unavailable: {no_ext}"))
        if "multigpu" in item.keywords and 0 < num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {num_gpus}"))
