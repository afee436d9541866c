"""ep_comm.launch.run_ranks (the spawn harness of the tests and the main job): failures are reported and reaped."""
import os
import time

import pytest
import torch

from ep_comm.launch import run_ranks


def _fail_or_sleep(rank, world):
    if rank == 0:
        raise ValueError("boom")
    time.sleep(60.0)  # killed by run_ranks once rank 0 has failed


def _processes():
    """(pid, parent pid, state letter, command line) of every process (Linux /proc); those that end while being read
    are left out."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    cmdline = handle.read()
            except OSError:
                continue
            yield int(entry), int(fields[1]), fields[0], cmdline


def _spawned_children():
    """Processes this one spawned through multiprocessing (their command line carries --multiprocessing-fork), alive
    or exited but never waited for (zombies): pid -> state letter. The resource tracker, a child that multiprocessing
    keeps for the whole session, does not carry that flag."""
    me = os.getpid()
    # A zombie's cmdline is empty: count every zombie child, and live children by their flag.
    return {pid: state for pid, parent, state, cmdline in _processes()
            if parent == me and (state == "Z" or b"--multiprocessing-fork" in cmdline)}


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
    """The first failure to arrive in full, the others by their message."""
    with pytest.raises(AssertionError) as raised:
        run_ranks(_both_fail, 2, backend="gloo", timeout_s=60)
    text = str(raised.value)
    # Both ranks fail right after the rendezvous: both reports are read (the harness drains for a second after the
    # first), whichever came first in full.
    first, other = (0, 1) if text.startswith("rank 0 failed") else (1, 0)
    assert text.startswith(f"rank {first} failed") and f"failure of rank {first}" in text, text
    assert f"rank {other} also failed: ValueError: failure of rank {other}" in text, text


def _fail_then_peer_fails(rank, world):
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("the cause, on rank 1")
    dist.barrier()  # fails once rank 1 has left: the consequence


@pytest.mark.cpu
def test_the_cause_is_shown_in_full_not_the_lowest_rank():
    """Rank 1 fails first and rank 0 fails because of it: rank 1's traceback is the one shown in full (it used to be
    the lowest failing rank's, here only gloo's "connection closed")."""
    with pytest.raises(AssertionError) as raised:
        run_ranks(_fail_then_peer_fails, 2, backend="gloo", timeout_s=120)
    text = str(raised.value)
    assert text.startswith("rank 1 failed") and "Traceback" in text and "the cause, on rank 1" in text, text
    assert "rank 0 also failed" in text or "rank 0" not in text, text


def _sleep_long(rank, world):
    time.sleep(120.0)


@pytest.mark.cpu
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc to list processes")
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_ranks_do_not_outlive_the_launcher(signal_name):
    """`timeout`, `kill` and job schedulers send SIGTERM, and a SIGKILL can follow: the ranks must not outlive the
    launching process (on GPUs they would hold the devices). SIGTERM: the launcher kills them, then dies of the signal
    itself (its default disposition, not an exception a caller could catch: pytest under `timeout` must stop); SIGKILL:
    the ranks' parent-death signal ends them."""
    import signal
    import subprocess
    import sys
    sent = getattr(signal, signal_name)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, %r); import test_launch; from ep_comm.launch import run_ranks; "
            "run_ranks(test_launch._sleep_long, 2, backend='gloo', timeout_s=300)" % tests_dir)
    launcher = subprocess.Popen([sys.executable, "-c", code])
    ranks = []
    try:
        for _ in range(600):  # until both ranks run (spawning imports torch: seconds)
            ranks = _children_of(launcher.pid, b"--multiprocessing-fork")
            if len(ranks) == 2 or launcher.poll() is not None:
                break
            time.sleep(0.1)
        assert len(ranks) == 2, f"the ranks did not start: {ranks}, launcher exit code {launcher.poll()}"
        time.sleep(1.0)  # past the ranks' start-up
        assert launcher.poll() is None, f"the launcher ended before the signal (exit code {launcher.poll()})"
        launcher.send_signal(sent)
        assert launcher.wait(timeout=60) == -sent, \
            f"launcher exit code {launcher.returncode}, not death by {signal_name}"
        alive = ranks
        for _ in range(100):
            alive = [pid for pid in ranks if _alive(pid)]
            if not alive:
                break
            time.sleep(0.1)
        assert alive == [], f"ranks {alive} still run after the launcher got {signal_name}"
    finally:  # nothing left behind, also when the test fails (the ranks are reparented once the launcher is gone)
        for pid in set(ranks) | set(_children_of(launcher.pid, b"")):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def _children_of(parent: int, flag: bytes) -> list:
    """Live (not zombie) processes whose parent is `parent` and whose command line holds `flag`."""
    return [pid for pid, ppid, state, cmdline in _processes() if ppid == parent and state != "Z" and flag in cmdline]


def _alive(pid: int) -> bool:
    """Running (a zombie, or a process reparented and already reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
    # strict_teardown (the GPU tiers' harness): the same crash fails the run.
    with pytest.raises(AssertionError, match=r"ranks \[1\] reported but then exited with codes \[7\]"):
        run_ranks(_report_then_crash_at_exit, 2, backend="gloo", timeout_s=120, strict_teardown=True)


def _fail_while_peer_returns_a_tensor(rank, world):
    import torch
    if rank == 0:
        raise ValueError("the real error, on rank 0")
    time.sleep(0.5)  # reports after rank 0's error has arrived, then exits before the parent reads the report
    return torch.ones(4)


@pytest.mark.cpu
def test_a_tensor_result_does_not_hide_a_peers_error():
    """Results travel as pickle bytes: a tensor sent through the queue's own pickler is a file descriptor that its
    process must be alive to hand over, and reading it after that rank exited raised FileNotFoundError, hiding the
    error and skipping the kills."""
    with pytest.raises(AssertionError, match="the real error, on rank 0"):
        run_ranks(_fail_while_peer_returns_a_tensor, 2, backend="gloo", timeout_s=120)
    import torch
    got = run_ranks(_tensor_result, 2, backend="gloo", timeout_s=120)
    assert all(torch.equal(t, torch.full((3,), float(r))) for r, t in enumerate(got)), got


def _tensor_result(rank, world):
    import torch
    return torch.full((3,), float(rank))


def _hang_or_fail(rank, world):
    if rank == 0:
        time.sleep(120.0)  # a hang: never reports
    raise ValueError("gave up waiting for rank 0")


@pytest.mark.cpu
def test_a_rank_still_running_is_named_with_the_failure():
    """Rank 1 fails while rank 0 is still running (a hang there is a likely cause): the error names rank 0 too."""
    with pytest.raises(AssertionError) as raised:
        run_ranks(_hang_or_fail, 2, backend="gloo", timeout_s=120)
    text = str(raised.value)
    assert "rank 1 failed" in text and "ranks [0] were still running without a report" in text, text


def _report_then_linger(rank, world):
    """Reports, then cannot exit: a non-daemon thread runs on (standing in for a hang in a teardown)."""
    import threading
    if rank == 1:
        threading.Thread(target=time.sleep, args=(60.0,), daemon=False).start()
    return rank


@pytest.mark.cpu
def test_a_hang_at_teardown_fails_or_warns():
    with pytest.raises(AssertionError, match=r"ranks \[1\] reported but did not exit within 10 s"):
        run_ranks(_report_then_linger, 2, backend="gloo", timeout_s=120)
    with pytest.warns(RuntimeWarning, match=r"ranks \[1\] reported but did not exit within 10 s"):
        assert run_ranks(_report_then_linger, 2, backend="gloo", timeout_s=120, hang_at_teardown="warn") == [0, 1]


@pytest.mark.cpu
@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan"), True, "60"])
def test_timeout_must_be_finite_and_positive(timeout_s):
    with pytest.raises(ValueError, match="timeout_s must be a finite positive number"):
        run_ranks(_tensor_result, 1, backend="gloo", timeout_s=timeout_s)


def _barrier(rank, world):
    import torch.distributed as dist
    dist.barrier()
    return rank


@pytest.mark.cpu
def test_ranks_rendezvous_under_torchrun(monkeypatch):
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE for its children; inherited, it made every rank a client of a store
    nobody serves (each waited until the collective timeout)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert run_ranks(_barrier, 2, backend="gloo", timeout_s=60) == [0, 1]


@pytest.mark.cpu
def test_a_world_of_no_ranks_is_refused():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            run_ranks(print, bad)


@pytest.mark.cpu
def test_a_bad_backend_is_refused_before_spawning(monkeypatch):
    # (a typo was refused by each spawned rank; "nccl" without a GPU failed in every rank with a ZeroDivisionError)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'gllo'"):
        run_ranks(print, 2, backend="gllo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend='nccl' needs a CUDA GPU"):
        run_ranks(print, 2, backend="nccl")


def _report_then_get_killed_while_waiting(rank, world):
    """Rank 1 reports at once, then is SIGKILLed (the OOM killer, an NCCL watchdog abort) while it waits for the
    parent's signal to leave the group; rank 0 reports a few seconds later."""
    import signal
    import threading
    if rank == 1:
        threading.Thread(target=lambda: (time.sleep(1.0), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
        return "ok"
    time.sleep(4.0)
    return "ok"


@pytest.mark.cpu
def test_a_rank_killed_while_waiting_to_leave_does_not_hang_the_launcher():
    """The parent's teardown signal was a multiprocessing Event, whose set() waits without a timeout for every sleeping
    waiter to wake: a rank killed while it waited hung the launcher for good, past timeout_s (run in a subprocess here,
    so that the old behaviour fails the test instead of hanging it)."""
    import subprocess
    import sys
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, warnings; sys.path.insert(0, %r); import test_launch; from ep_comm.launch import run_ranks\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    print(run_ranks(test_launch._report_then_get_killed_while_waiting, 2, backend='gloo', timeout_s=60))\n"
            "print([str(w.message) for w in caught])" % tests_dir)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("run_ranks hung after a rank was killed while waiting to leave its group")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['ok', 'ok']" in done.stdout and "ranks [1] reported but then exited with codes [-9]" in done.stdout, \
        done.stdout
