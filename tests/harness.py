"""The tests' spawn harness is the package's own launcher (ep_comm.launch), plus the multi-rank tiers' setting.

Multi-rank GPU tests normally run one rank per GPU over NCCL. With EP_COMM_TEST_SHARED_GPU=1 on a machine with one
GPU they run 2 ranks on that GPU instead (`SHARED_GPU`): the ranks talk over gloo, the nvlink backend maps its peer
over CUDA IPC (EP_COMM_ALLOW_SHARED_GPU, set by conftest.py), and the reference backend, which needs NCCL for CUDA
tensors, runs on CPU copies of the inputs (`HostReference`; the reference formats give the CUDA kernels' bits). The
ranks' kernels progress as the driver time-slices the two processes: slow, and a check of the multi-rank protocol
(counts, flags and rows from another rank), never of speed.
"""
import os

from ep_comm.launch import GPU_ENV, free_port  # noqa: F401
from ep_comm.launch import run_ranks as _launch_ranks


def _shared_gpu() -> bool:
    """EP_COMM_TEST_SHARED_GPU=1 where exactly one GPU is visible (with more, the multi-rank tiers run one rank per
    GPU as usual): the one place that decides it, for conftest.py and the tests alike."""
    if os.environ.get("EP_COMM_TEST_SHARED_GPU", "0") != "1":
        return False
    import torch
    return torch.cuda.is_available() and torch.cuda.device_count() == 1


SHARED_GPU = _shared_gpu()

# Set by conftest.py for the duration of each gpu / multigpu test (device scripts that call run_ranks directly use NCCL,
# which is strict by itself).
GPU_TIER_TEST = False


def run_ranks(worker, world_size, *args, backend="gloo", timeout_s=600.0):
    """ep_comm.launch.run_ranks. Where GPU teardown runs (NCCL groups, and every gpu / multigpu test: NVSHMEM, CUDA IPC,
    NCCL), a rank that crashes after reporting fails the test instead of only warning. The cpu tier's gloo runs keep
    the launcher's warning: a rare gloo abort at exit (once in CI, twenty-eighth session) is not the code under test."""
    return _launch_ranks(worker, world_size, *args, backend=backend, timeout_s=timeout_s,
                         strict_teardown=backend == "nccl" or GPU_TIER_TEST)


def multigpu_backend() -> str:
    """The process-group backend of the multi-rank GPU tests: NCCL, or gloo when the ranks share a GPU."""
    return "gloo" if SHARED_GPU else "nccl"


def multigpu_world(most: int = 8) -> int:
    """Ranks of the multi-rank GPU tests: one per visible GPU (at most `most`), or, sharing one GPU,
    EP_COMM_TEST_SHARED_WORLD ranks (default 2; 4 and 8 check the protocol at those world sizes)."""
    import torch
    if SHARED_GPU:
        return min(int(os.environ.get("EP_COMM_TEST_SHARED_WORLD", "2")), most)
    return min(torch.cuda.device_count(), most) if torch.cuda.is_available() else 2


def auto_backend() -> str:
    """The Buffer backend a multi-rank GPU test asks for: "auto" (nvlink where the GPUs are peers), or "nvlink" when
    the ranks share a GPU ("auto" picks the reference backend on a gloo group)."""
    return "nvlink" if SHARED_GPU else "auto"


def nvlink_can_run() -> bool:
    """Whether the nvlink backend can run for the multi-rank GPU tests: the ranks share a GPU, or GPUs 0 and 1 map each
    other's memory (what backend "auto" asks of them)."""
    from ep_comm import _ext
    return SHARED_GPU or _ext._C.nvlink_peer_link(0, 1) == (True, True)


def nvlink_backend() -> str:
    """The Buffer backend of a multi-rank GPU test that is about the nvlink backend: "nvlink" where it can run
    (nvlink_can_run); elsewhere the test is skipped, because "auto" would pick the reference backend there with only a
    warning and the test would not test nvlink."""
    import pytest
    if not nvlink_can_run():
        pytest.skip("GPUs 0 and 1 are not peers: the nvlink backend cannot run here")
    return "nvlink"


class HostReference:
    """A reference-backend Buffer fed CPU copies: what `dispatch` returns stays on the CPU (the tests compare with
    .cpu()), `combine` returns its bf16 rows on the device of its input. Used where the ranks share a GPU and talk
    over gloo, which moves CPU tensors only."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.config = buffer.config

    def dispatch(self, x, topk_idx, topk_weights, **kwargs):
        return self.buffer.dispatch(x.cpu(), topk_idx.cpu(), topk_weights.cpu(), **kwargs)

    def combine(self, expert_out, handle, **kwargs):
        return self.buffer.combine(expert_out.cpu(), handle, **kwargs).to(expert_out.device)

    def destroy(self):
        self.buffer.destroy()
