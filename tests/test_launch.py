"""ep_comm.launch.run_ranks (the spawn harness of the tests and the main job): failures are reported and reaped."""
import os
import time

import pytest

from ep_comm.launch import run_ranks


def _fail_or_sleep(rank, world):
    if rank == 0:
        raise ValueError("boom")
    time.sleep(60.0)  # killed by run_ranks once rank 0 has failed


def _zombie_children():
    """Children of this process that have exited but were never waited for (Linux /proc)."""
    me, zombies = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] == "Z":
                zombies.append(int(entry))
    return zombies


@pytest.mark.cpu
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc to list child processes")
def test_failed_rank_is_reported_and_every_rank_reaped():
    with pytest.raises(AssertionError, match="rank 0 failed"):
        run_ranks(_fail_or_sleep, 2, backend="gloo", timeout_s=60)
    assert _zombie_children() == []
