"""Run a function on N local ranks (one process each): free port, gloo or NCCL, a hard timeout.

Used by the main job (`python -m ep_comm.bench`), the benchmarks and the tests. The worker gets (rank, world_size,
*args) and returns a picklable value. A rank that raises reports its traceback; a run that exceeds `timeout_s` (a hang)
kills every child and raises with the ranks that did not finish — it never waits forever; a rank killed while it still
runs first prints every thread's stack to stderr (SIGUSR1). The first failure to arrive is shown in full (the others,
often its consequences, by their last line). The ranks do not outlive the launcher: SIGTERM to it kills them, and on
Linux they get SIGTERM when it dies. Spawning imports torch in every child, so callers run many cases per spawn. Each
child takes (CPUs it may use) // N threads for torch's CPU ops, unless OMP_NUM_THREADS is set.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import math
import numbers
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port; run_ranks retries if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this rank gets SIGTERM when the launching process dies (killed with SIGKILL, say), instead of running on
    and holding its GPU; elsewhere nothing (the parent's SIGTERM handling below still covers a terminated parent)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 (no libc prctl: the rank runs without the parent-death signal)
        return
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)


def _entry(rank, world_size, port, backend, worker, args, results, collective_timeout_s, teardown, parent_pid):
    _die_with_parent(parent_pid)
    if hasattr(signal, "SIGUSR1"):  # the parent asks for every thread's stack (stderr) before it kills a hung rank
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.distributed as dist
    reported = False

    os.environ.update(GPU_ENV)
    # Under torchrun (which sets it) torch's tcp:// rendezvous would make every rank a client of an agent store that
    # this launcher never starts: every rank would wait for a server until the collective timeout.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # The ranks share this machine's cores: each takes its share for torch's CPU ops unless OMP_NUM_THREADS says
    # otherwise (torchrun sets 1). With every rank at the default (all cores), their thread pools oversubscribe the
    # CPU, which slows the CPU-side ranks (gloo tests, the reference backend on CPU copies) many times over.
    if "OMP_NUM_THREADS" not in os.environ:
        # The CPUs this process may run on (a cpuset or affinity mask can be smaller than the machine).
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cpus // world_size))
    try:
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            # Binds the group to this rank's GPU: NCCL's barrier() otherwise warns that it guesses the device.
            device_id = torch.device("cuda", torch.cuda.current_device())
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout_s),
                                    device_id=device_id)
        except Exception as error:
            if "EADDRINUSE" in str(error) or "address already in use" in str(error):
                results.put((rank, "port_in_use", str(error)))
                return
            raise
        value = worker(rank, world_size, *args)
        # Sent as plain pickle bytes: the queue's own pickler would pass a tensor as a file descriptor that this
        # process must still be alive to hand over (it may have exited by the time the parent reads it), and it
        # pickles in a background thread, where a failure would only look like a hang.
        try:
            payload = pickle.dumps(value)
        except Exception as error:
            raise TypeError(f"rank {rank}'s worker returned a value that cannot be sent to the parent "
                            f"({type(value).__name__}): {error}") from error
        results.put((rank, "ok", payload))
        reported = True
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                if reported:
                    # The ranks leave the group together, once the parent has every report: a rank that destroyed
                    # its group and exited while a peer's gloo threads still used it once made that peer abort at exit
                    # ("terminate called without an active exception", CI, twenty-eighth session), which run_ranks
                    # reports as a crash. The parent's signal, not a barrier: a worker may leave the group unusable.
                    _wait_for_flag(teardown, timeout_s=60.0)
                dist.destroy_process_group()
        except Exception:
            pass


def _wait_for_flag(flag, timeout_s: float) -> None:
    """Poll a shared byte until the parent sets it (or timeout_s passes). Not a multiprocessing Event: Event.set()
    waits, without a timeout, for every sleeping waiter to wake, so one rank killed while it waited (the OOM killer,
    an NCCL watchdog abort) hung the parent in set(), before its timeout and its cleanup could run."""
    deadline = time.monotonic() + timeout_s
    while not flag.value and time.monotonic() < deadline:
        time.sleep(0.02)


class _PortInUse(Exception):
    """The rendezvous port was taken between choosing it and binding it: retry with another."""


class _Terminated(BaseException):
    """SIGTERM arrived while the ranks ran: unwinds through the cleanup that kills them (not an Exception, so that no
    `except Exception` of a worker's caller swallows it)."""


@contextlib.contextmanager
def _ranks_end_with_sigterm():
    """SIGTERM (what `timeout`, `kill` and job schedulers send) to the launching process while ranks run first unwinds
    through the cleanup that kills them, then is delivered again with the process's own disposition: the default ends
    the process as SIGTERM would have (a pytest under `timeout` stops), a handler of the application's runs. Only from
    the main thread (Python delivers signals there) and where SIGTERM has a Python-visible disposition other than
    "ignored"; elsewhere the ranks' parent-death signal ends them with the process."""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous is signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    terminated = False
    try:
        yield
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.raise_signal(signal.SIGTERM)
        # Still here: the application's handler returned. The ranks are gone, so there is no result to give.
        raise RuntimeError("run_ranks: the launching process got SIGTERM; its ranks were killed")


def run_ranks(worker, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600.0,
              strict_teardown: bool = False, hang_at_teardown: str = "raise"):
    """Run worker(rank, world_size, *args) on `world_size` spawned processes; return the per-rank results.
    timeout_s: finite and positive; the collectives' own timeout is max(30 s, timeout_s / 2).
    strict_teardown: a rank that exits with a non-zero code after reporting raises (default: a warning).
    hang_at_teardown: a rank that reported but did not exit within 10 s is killed, then "raise" (the default: a hang
    is a failure) or "warn" (the results are returned: what a benchmark that has its figures wants)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite positive number of seconds, got {timeout_s!r}")
    if hang_at_teardown not in ("raise", "warn"):
        raise ValueError(f"hang_at_teardown must be 'raise' or 'warn', got {hang_at_teardown!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")  # (0 returned [] untried)
    # (checked before spawning: a typo was refused by every rank, and "nccl" without a GPU failed in each rank with a
    # ZeroDivisionError from its device choice)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        raise RuntimeError("backend='nccl' needs a CUDA GPU and this process sees none: use backend='gloo'")
    for attempt in range(3):
        try:
            with _ranks_end_with_sigterm():
                return _run_once(worker, world_size, args, backend, timeout_s, strict_teardown, hang_at_teardown)
        except _PortInUse:
            if attempt == 2:
                raise AssertionError("could not bind a free rendezvous port in 3 attempts")
    raise AssertionError("unreachable")


def _drain(results, outcome) -> None:
    """Read what the ranks have already sent (a short wait for the queue's feeder threads)."""
    while True:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue_module.Empty:
            return
        except Exception:  # noqa: BLE001 (an unreadable message: what was read is kept, the ranks are still killed)
            return
        outcome[rank] = (status, value)


def _last_line(text) -> str:
    """The last non-empty line of a rank's error report (its exception type and message)."""
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def _silent_exits(processes, outcome) -> list:
    """Ranks whose process has exited without a report."""
    return [r for r, p in enumerate(processes) if p.exitcode is not None and r not in outcome]


def _dump_stacks_then_kill(processes, dump: bool = True) -> None:
    """Ranks still running after a failure or a timeout: SIGUSR1 first (each rank prints every thread's Python stack
    to stderr: where it hangs; not for a handled condition, dump=False), then kill and reap (a killed child left
    unjoined stays a zombie of this process)."""
    alive = [p for p in processes if p.is_alive()]
    if alive and dump and hasattr(signal, "SIGUSR1"):
        for process in alive:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGUSR1)
        end = time.monotonic() + 1.0
        for process in alive:
            process.join(timeout=max(0.0, end - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _run_once(worker, world_size: int, args, backend: str, timeout_s: float, strict_teardown: bool,
              hang_at_teardown: str):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    collective_timeout_s = max(30.0, timeout_s / 2)
    # Set to 1 once every rank reported (or the run failed): the ranks then leave their group. A lock-free shared byte
    # (_wait_for_flag says why not an Event): setting it cannot block on a dead rank.
    teardown = ctx.RawValue("b", 0)
    processes = [ctx.Process(target=_entry, daemon=True,
                             args=(rank, world_size, port, backend, worker, args, results, collective_timeout_s,
                                   teardown, os.getpid()))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    outcome = {}
    first_error = None  # the rank whose error report arrived first: most often the cause, its peers failing after it
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s (hang? killed; the "
                                     f"stacks of those that had started are on stderr); finished: {sorted(outcome)}")
            try:
                rank, status, value = results.get(timeout=min(remaining, 5.0))
            except queue_module.Empty:
                # A rank that exited (with any code, 0 included) without reporting never will: once what it may
                # have sent just before exiting is read, it is dead.
                if _silent_exits(processes, outcome):
                    _drain(results, outcome)
                    if any(status in ("error", "port_in_use") for status, _ in outcome.values()):
                        break  # a report read just now: raised below, with its traceback
                    dead = _silent_exits(processes, outcome)
                    if dead:
                        raise AssertionError(f"ranks {dead} exited without reporting (exit codes "
                                             f"{[processes[r].exitcode for r in dead]})")
                continue
            outcome[rank] = (status, value)
            if status in ("error", "port_in_use"):
                if status == "error":
                    first_error = rank
                break
    finally:
        teardown.value = 1
        for process in processes:
            process.join(timeout=10 if len(outcome) == world_size else 1)
        lingering = [rank for rank, process in enumerate(processes) if process.is_alive()]
        silent = []
        if len(outcome) < world_size:  # reports still in the queue, then who exited on its own (before the kills)
            _drain(results, outcome)
            silent = _silent_exits(processes, outcome)
        not_reported = [rank for rank in lingering if rank not in outcome]
        # (a rendezvous port taken by another program is retried: no stacks for that)
        _dump_stacks_then_kill(processes, dump=not any(status == "port_in_use" for status, _ in outcome.values()))
    if any(status == "port_in_use" for status, _ in outcome.values()):
        raise _PortInUse()
    errors = {rank: value for rank, (status, value) in outcome.items() if status == "error"}
    if errors:
        rank = first_error if first_error in errors else min(errors)
        # A rank that died first (os._exit, a crash) makes its peers fail in their next collective: name it, since
        # the error reported is then only the consequence.
        died = (f"ranks {silent} exited without reporting (exit codes {[processes[r].exitcode for r in silent]}; "
                f"the cause of the failure below, or a consequence); " if silent else "")
        # The first error to arrive in full (else the lowest failing rank); the others by their last line (a rank that
        # fails and exits makes its peers fail in their next collective, later: their reports are the consequence).
        others = "".join(f"\nrank {r} also failed: {_last_line(errors[r])}" for r in sorted(errors) if r != rank)
        # A rank still running without a report (a hang there can be what the failing rank timed out waiting for):
        # its stack went to stderr before it was killed.
        hung = (f"\nranks {not_reported} were still running without a report (killed; their stacks are on stderr): "
                f"a hang there may be the cause" if not_reported else "")
        raise AssertionError(f"{died}rank {rank} failed:\n{errors[rank]}{others}{hung}")
    # Every rank reported. A hang after that (process-group, NVSHMEM or CUDA IPC teardown, a finalizer) is a failure,
    # not a pass. A crash after that is warned about, not raised: a rare abort of a gloo rank at exit ("terminate called
    # without an active exception", once in CI in the twenty-eighth session, not reproduced in ~50 reruns and not
    # explained) would otherwise make CI fail at random; the warning names the ranks and codes wherever it happens.
    if lingering:
        message = (f"ranks {lingering} reported but did not exit within 10 s (a hang at teardown; killed, their stacks "
                   f"are on stderr)")
        if hang_at_teardown == "raise":
            raise AssertionError(message)
        warnings.warn(f"run_ranks: {message}", RuntimeWarning, stacklevel=2)
    crashed = [rank for rank, process in enumerate(processes) if process.exitcode != 0 and rank not in lingering]
    if crashed and strict_teardown:
        raise AssertionError(f"ranks {crashed} reported but then exited with codes "
                             f"{[processes[r].exitcode for r in crashed]} (a crash at teardown)")
    if crashed:
        warnings.warn(f"run_ranks: ranks {crashed} reported but then exited with codes "
                      f"{[processes[r].exitcode for r in crashed]} (a crash at teardown)", RuntimeWarning, stacklevel=2)
    return [pickle.loads(outcome[rank][1]) for rank in range(world_size)]
