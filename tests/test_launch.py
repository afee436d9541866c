"""ep_comm.launch.run_ranks (the spawn harness of the tests and the main job): failures are reported and reaped."""
import os
import time

import pytest

from ep_comm.launch import run_ranks


def _fail_or_sleep(rank, world):
    if rank == 0:
        raise ValueError("boom")
    time.sleep(60.0)  # killed by run_ranks once rank 0 has failed


def _spawned_children():
    """Processes this one spawned through multiprocessing (their command line carries --multiprocessing-fork), alive
    or exited but never waited for (zombies): pid -> state letter (Linux /proc). The resource tracker, a child that
    multiprocessing keeps for the whole session, does not carry that flag."""
    me, children = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    cmdline = handle.read()
            except OSError:
                continue
            # A zombie's cmdline is empty: count every zombie child, and live children by their flag.
            if int(fields[1]) == me and (fields[0] == "Z" or b"--multiprocessing-fork" in cmdline):
                children[int(entry)] = fields[0]
    return children


@pytest.mark.cpu
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc to list child processes")
def test_failed_rank_is_reported_and_every_rank_reaped():
    before = _spawned_children()
    with pytest.raises(AssertionError, match="rank 0 failed"):
        run_ranks(_fail_or_sleep, 2, backend="gloo", timeout_s=60)
    # Rank 1 sleeps for 60 s: it must have been killed (not left running) and waited for (not left a zombie).
    left = {pid: state for pid, state in _spawned_children().items() if pid not in before}
    assert left == {}, f"rank processes left behind (pid: state): {left}"


def _both_fail(rank, world):
    raise ValueError(f"failure of rank {rank}")


@pytest.mark.cpu
def test_every_failing_rank_is_named():
    """The lowest failing rank in full, the others by their message (the first is not always the cause)."""
    with pytest.raises(AssertionError) as raised:
        run_ranks(_both_fail, 2, backend="gloo", timeout_s=60)
    text = str(raised.value)
    # Both ranks fail right after the rendezvous: both reports are read (the harness drains for a second after the
    # first), the lowest rank's in full.
    assert "rank 0 failed" in text and "failure of rank 0" in text
    assert "rank 1 also failed: ValueError: failure of rank 1" in text


def _die_then_barrier(rank, world):
    import torch.distributed as dist
    if rank == 0:
        os._exit(3)  # a crash: no report
    dist.barrier()  # fails once rank 0 is gone


def _exit_quietly(rank, world):
    if rank == 1:
        os._exit(0)  # exits "successfully" without ever reporting
    return rank


@pytest.mark.cpu
def test_a_rank_that_dies_is_named_and_not_waited_for():
    # The survivor's collective error is reported with the rank whose death caused it.
    with pytest.raises(AssertionError, match=r"ranks \[0\] exited without reporting \(exit codes \[3\];.*rank 1 failed"):
        run_ranks(_die_then_barrier, 2, backend="gloo", timeout_s=120)
    # An exit with code 0 and no report is a death too, found as one rather than at the timeout: a run that waited for
    # the timeout raises "did not finish within 120 s" instead, which this match refuses (no wall-clock assertion:
    # tests never assert on timings, DESIGN.md section 6).
    with pytest.raises(AssertionError, match=r"ranks \[1\] exited without reporting \(exit codes \[0\]\)"):
        run_ranks(_exit_quietly, 2, backend="gloo", timeout_s=120)


def _report_then_crash_at_exit(rank, world):
    """Reports "ok", then the process exits with code 7 at teardown (an atexit handler standing in for a crash in a
    finalizer or in NVSHMEM / CUDA IPC teardown)."""
    import atexit
    if rank == 1:
        atexit.register(os._exit, 7)
    return "ok"


@pytest.mark.cpu
def test_a_crash_after_reporting_is_named():
    with pytest.warns(RuntimeWarning, match=r"ranks \[1\] reported but then exited with codes \[7\]"):
        assert run_ranks(_report_then_crash_at_exit, 2, backend="gloo", timeout_s=120) == ["ok", "ok"]
