"""The reference backend (all_to_all_single) against the single-process oracle, on gloo and NCCL."""
import pytest
import torch
import torch.distributed as dist

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
@pytest.mark.parametrize("world", [1, 2])
def test_check_finite_refuses_nan_and_inf_in_read_rows_only(world):
    assert run_ranks(dist_cases.check_finite_worker, world, "reference", "cpu", backend="gloo") == \
        ["check_finite ok"] * world


@pytest.mark.cpu
@pytest.mark.parametrize("world", [3, 4])
def test_gloo_semantics(world):
    results = run_ranks(dist_cases.semantics_worker, world, "reference", "cpu", backend="gloo")
    assert len(results) == world


@pytest.mark.cpu
@pytest.mark.parametrize("layout", ["blocked", "strided"])
def test_gloo_expert_parallel_groups_inside_a_larger_world(layout):
    """Data x expert parallelism: 4 ranks in two EP groups of 2, every group's Buffers at once, each group with its
    own inputs. Each group gives what an EP world of 2 alone gives with those inputs, bit for bit (the same hashes of
    every case's outputs): peers are numbered by group rank, and no rows cross between the groups."""
    alone = [run_ranks(dist_cases.semantics_worker, 2, "reference", "cpu", 256, None, 100 * index, backend="gloo")
             for index in range(2)]
    assert alone[0] != alone[1]  # (the groups' inputs differ: rows of the other group would show)
    grouped = run_ranks(dist_cases.ep_groups_worker, 4, 2, layout, backend="gloo")
    placement = [(0, 0), (0, 1), (1, 0), (1, 1)] if layout == "blocked" else [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(index, group_rank) for index, group_rank, _ in grouped] == placement
    for global_rank, (index, group_rank, summaries) in enumerate(grouped):
        assert summaries == alone[index][group_rank], (layout, global_rank, index, group_rank)


@pytest.mark.cpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_dispatches_in_flight_combine_in_any_order(world):
    assert run_ranks(dist_cases.in_flight_worker, world, backend="gloo") == ["in flight ok"] * world


@pytest.mark.cpu
def test_gloo_world8_small():
    """EP8 on CPU ranks: the world-size-independent semantics at the largest size issue 5 asks for."""
    results = run_ranks(dist_cases.scaling_worker, 8, "reference", "cpu", backend="gloo", timeout_s=900)
    assert len(results) == 8


def _idle_until(marker: str, limit_s: float = 60.0) -> bool:
    """Outside any collective, until rank 0 has created `marker` (it raised): True, or False after limit_s."""
    import os
    import time
    give_up = time.monotonic() + limit_s
    while not os.path.exists(marker) and time.monotonic() < give_up:
        time.sleep(0.05)
    return os.path.exists(marker)


def _missing_peer_worker(rank, world, raised_marker):
    """Rank 1 never calls dispatch: rank 0's wait ends after timeout_s with the rank and stage named, while rank 1 is
    still alive and idle (it waits for rank 0's marker file, not in a collective)."""
    import ep_comm
    buf = ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference",
                         timeout_s=1.0)
    if rank == 1:
        # No collective after this: rank 0's timeout leaves the group unusable. Staying alive until rank 0 has raised
        # means rank 0's error cannot come from this rank's exit (which the backend would also word "waited more than
        # timeout_s" once that much time had passed); 60 s only bounds the wait of a rank 0 that never raises.
        return "absent" if _idle_until(raised_marker) else "rank 0 had not raised after 60 s"
    x = torch.randn(4, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [-1, -1]])
    try:
        buf.dispatch(x, idx, torch.rand(4, 2))
    except RuntimeError as error:
        return str(error)
    finally:
        open(raised_marker, "w").close()
    return "no error"


def _lone_call_after_destroy_worker(rank, world, raised_marker):
    """Both ranks destroy the Buffer, then rank 0 alone calls dispatch on it: it waits for the agreement's timeout (a
    peer's Buffer destroyed on one rank only must still be told), and the error then says the Buffer was destroyed."""
    import ep_comm
    buf = ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference",
                         timeout_s=1.0)
    buf.destroy()
    if rank == 1:
        return "absent" if _idle_until(raised_marker) else "rank 0 had not raised after 60 s"
    try:
        buf.dispatch(torch.randn(4, 64).to(torch.bfloat16), torch.tensor([[0, 1]] * 4), torch.rand(4, 2))
    except RuntimeError as error:
        return str(error)
    finally:
        open(raised_marker, "w").close()
    return "no error"


def _small_buffer_error(group, error_type) -> str:
    """The message of the `error_type` that a small reference Buffer over `group` raises, or "no error"."""
    import ep_comm
    try:
        ep_comm.Buffer(group, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference")
    except error_type as error:
        return str(error)
    return "no error"


def _not_a_member_worker(rank, world):
    group = dist.new_group([0, 1])  # (collective: every rank makes it)
    return "member" if rank != 2 else _small_buffer_error(group, ValueError)


def _group_of_another_type_worker(rank, world):
    """A group argument that is no ProcessGroup (a name, a number) names the argument (torch's own error did not)."""
    return [_small_buffer_error(group, TypeError) for group in ("world", 5)]


def _lone_constructor_worker(rank, world):
    """Rank 0 creates a Buffer that rank 1 never creates (over a group with a 3 s timeout): rank 0's error names
    ep_comm.Buffer and the likely cause, not only gloo's timeout."""
    import datetime
    import time
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)  # past rank 0's timeout, without joining its collective
        return "absent"
    return _small_buffer_error(group, RuntimeError)


@pytest.mark.cpu
def test_gloo_misuse_named_for_what_it_is(tmp_path):
    import warnings
    with warnings.catch_warnings():
        # (rank 0's abandoned all_reduce is still pending in gloo when it exits, which may abort it after it reported:
        # run_ranks warns of a crash at teardown; the result this test checks has arrived by then)
        warnings.filterwarnings("ignore", message=r"run_ranks: ranks \[0\] reported but then exited",
                                category=RuntimeWarning)
        results = run_ranks(_lone_call_after_destroy_worker, 2, str(tmp_path / "rank0_raised"), backend="gloo",
                            timeout_s=120)
    assert results[1] == "absent", results[1]
    assert "this ep_comm.Buffer was destroyed, and its peers did not join" in results[0], results[0]
    results = run_ranks(_not_a_member_worker, 3, backend="gloo")
    assert results[:2] == ["member", "member"] and "is not a member of the process group" in results[2], results
    results = run_ranks(_lone_constructor_worker, 2, backend="gloo", timeout_s=120)
    assert results[1] == "absent", results
    assert results[0].startswith("ep_comm.Buffer(): the ranks' comparison of the constructor arguments failed on "
                                 "rank 0"), results[0]
    for messages in run_ranks(_group_of_another_type_worker, 1, backend="gloo"):
        assert messages[0].startswith("group must be a torch.distributed ProcessGroup") and "got str" in messages[0]
        assert messages[1].startswith("group must be a torch.distributed ProcessGroup") and "got int" in messages[1]


@pytest.mark.cpu
def test_gloo_peer_that_never_calls_raises_after_timeout(tmp_path):
    results = run_ranks(_missing_peer_worker, 2, str(tmp_path / "rank0_raised"), backend="gloo", timeout_s=120)
    # No wall-clock assertion (tests never assert on timings, DESIGN.md section 6): the backend words it "waited more
    # than timeout_s" only once it has measured at least timeout_s itself (not early), and rank 1 was still alive,
    # outside any collective, when rank 0 raised (not a transport error from a peer's exit).
    assert results[1] == "absent", results[1]
    message = results[0]
    assert "rank 0 waited more than timeout_s=1.0 s in" in message, message


def _default_backend_group_worker(rank, world, port, raised_marker):
    """A group made by init_process_group() without a backend, which dist.get_backend calls "undefined" (torch gives
    it gloo on a CPU machine): "auto" picks the reference backend, which knows the group carries CPU tensors over
    gloo -- it refuses other devices, and its waits end after timeout_s (here rank 1 never dispatches a second
    time) instead of the process group's 30 minutes."""
    import torch.distributed as dist
    import ep_comm
    dist.destroy_process_group()
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {"get_backend": str(dist.get_backend())}
    buf = ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, timeout_s=1.0)
    out["backend"] = buf.backend
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [-1, -1]])
    result = buf.dispatch(x, idx, torch.rand(4, 2))
    out["combined"] = tuple(buf.combine(torch.zeros(result.num_rows, 64, dtype=torch.bfloat16), result.handle).shape)
    try:
        buf._backend.check_device("x", torch.empty(4, 64, device="meta"))
        out["meta"] = "taken"
    except ValueError as error:
        out["meta"] = str(error)
    if rank == 1:  # alive and outside any collective until rank 0 has raised (as _missing_peer_worker)
        _idle_until(raised_marker)
        return out
    try:
        buf.dispatch(x, idx, torch.rand(4, 2))
        out["timeout"] = "no error"
    except RuntimeError as error:
        out["timeout"] = str(error)
    finally:
        open(raised_marker, "w").close()
    return out


@pytest.mark.cpu
def test_group_without_a_backend_name_is_served_as_gloo(tmp_path):
    from ep_comm.launch import free_port
    results = run_ranks(_default_backend_group_worker, 2, free_port(), str(tmp_path / "rank0_raised"),
                        backend="gloo", timeout_s=120)
    for out in results:
        assert out["backend"] == "reference" and out["combined"] == (4, 64), out
        assert "needs x on cpu, got meta" in out["meta"], out
    assert "rank 0 waited more than timeout_s=1.0 s in" in results[0]["timeout"], results[0]


def _short_group_timeout_worker(rank, world, port, raised_marker):
    """The process group's own timeout (2 s) ends rank 0's wait before timeout_s (100 s) while rank 1 is alive and
    idle: worded as that timeout, not as a peer that failed or exited."""
    import datetime
    import torch.distributed as dist
    import ep_comm
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=2))
    buf = ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference",
                         timeout_s=100.0)
    if rank == 1:
        _idle_until(raised_marker)
        return "absent"
    try:
        buf.dispatch(torch.randn(4, 64).to(torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, -1], [-1, -1]]),
                     torch.rand(4, 2))
        return "no error"
    except RuntimeError as error:
        return str(error)
    finally:
        open(raised_marker, "w").close()


@pytest.mark.cpu
def test_a_shorter_group_timeout_is_named_as_such(tmp_path):
    from ep_comm.launch import free_port
    message, absent = run_ranks(_short_group_timeout_worker, 2, free_port(), str(tmp_path / "rank0_raised"),
                                backend="gloo", timeout_s=120)
    assert absent == "absent"
    assert "the process group's own timeout (below timeout_s=100.0 s)" in message, message


def _format_impl_cuda_without_kernels_worker(rank, world):
    """format_impl='cuda' on an NCCL group (stood in for: the transport map says cuda:nccl) where rank 1 has no CUDA
    kernels: every rank's Buffer() raises, naming rank 1, instead of each call failing after its first collective."""
    import ep_comm
    from ep_comm import _ext
    from ep_comm.backends import reference
    reference.device_backends = lambda group: {"cpu": "gloo", "cuda": "nccl"}
    reference.torch.cuda.current_device = lambda: 0
    if rank == 1:
        _ext.cuda_extension_available = lambda: False
    else:
        _ext.cuda_extension_available = lambda: True
        ep_comm.formats._kernel_image_problem = lambda device: ""
    try:
        ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4, backend="reference",
                       format_impl="cuda")
        return None
    except RuntimeError as error:
        return str(error)


@pytest.mark.cpu
def test_format_impl_cuda_is_checked_on_every_rank_at_construction():
    for message in run_ranks(_format_impl_cuda_without_kernels_worker, 2, backend="gloo", timeout_s=120):
        assert message and "cannot run on rank 1 (ep_comm._C is unavailable" in message, message


def _argument_types_differ_worker(rank, world):
    """hidden=64 on rank 0 and 64.0 on rank 1: equal as numbers, but only rank 1's fails validate(). Every rank must
    raise at construction (none goes on to its first collective alone)."""
    import ep_comm
    try:
        ep_comm.Buffer(None, hidden=64 if rank == 0 else 64.0, num_experts=4, num_topk=2, max_tokens_per_rank=8,
                       backend="reference", timeout_s=5.0)
    except (TypeError, ValueError) as error:
        return str(error)
    return "constructed"


@pytest.mark.cpu
def test_buffer_arguments_of_another_type_raise_on_every_rank():
    for message in run_ranks(_argument_types_differ_worker, 2, backend="gloo", timeout_s=120):
        assert "arguments differ between rank" in message and ("64 vs 64.0" in message or "64.0 vs 64" in message), \
            message


def _ranks_on_two_hosts_worker(rank, world, nvshmem_on, peer_memory="auto", check_raises_on=()):
    """The backend vote with the nvlink backend pretending to be available on every rank, the ranks on two hosts and
    nvshmem4py present on the ranks in nvshmem_on: the Buffer refuses backend='nvlink' (or, with nvshmem4py on every
    rank, goes on to set it up -- here the stand-in constructor) instead of failing in a CUDA IPC setup.
    peer_memory: EP_COMM_PEER_MEMORY on every rank (ipc: CUDA IPC even with nvshmem4py). check_raises_on: the ranks
    whose availability check raises (its error must be the reason given, not the hosts)."""
    import os
    import socket
    import ep_comm
    from ep_comm.backends import nvlink
    os.environ["EP_COMM_PEER_MEMORY"] = peer_memory
    socket.gethostname = lambda: f"node{rank}"

    def is_available(group, identities=None):
        if rank in check_raises_on:
            raise RuntimeError("uncorrectable ECC error (test)")
        return True, ""
    nvlink.NVLinkBackend.is_available = staticmethod(is_available)
    nvlink.nvshmem_importable = lambda: rank in nvshmem_on

    class Constructed(Exception):
        pass

    def construct(self, group, config):
        raise Constructed()

    nvlink.NVLinkBackend.__init__ = construct
    try:
        ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="nvlink")
    except RuntimeError as error:
        return str(error)
    except Constructed:
        return "constructed"
    return "no error"


@pytest.mark.cpu
def test_nvlink_refused_across_hosts_without_nvshmem():
    for message in run_ranks(_ranks_on_two_hosts_worker, 2, (0,), backend="gloo", timeout_s=120):
        assert "backend='nvlink' is unavailable" in message and "run on 2 hosts (node0, node1)" in message, message
    assert run_ranks(_ranks_on_two_hosts_worker, 2, (0, 1), backend="gloo", timeout_s=120) == ["constructed"] * 2
    # EP_COMM_PEER_MEMORY=ipc maps peers with CUDA IPC even where nvshmem4py is installed: refused too.
    for message in run_ranks(_ranks_on_two_hosts_worker, 2, (0, 1), "ipc", backend="gloo", timeout_s=120):
        assert "run on 2 hosts (node0, node1) and ranks [0, 1] would map their peers with CUDA IPC" in message, message
    # A rank whose availability check raised keeps its own reason (it used to read as "nvshmem4py is not installed").
    for message in run_ranks(_ranks_on_two_hosts_worker, 2, (0, 1), "auto", (0,), backend="gloo", timeout_s=120):
        assert "rank 0: the nvlink backend's availability check raised" in message and "ECC" in message, message


def _fake_nvlink_node(device, device_count, capability, peer_link=lambda _device, _peer: (True, True)):
    """Inside one rank's process (run_ranks spawns each): a faked node on which the nvlink backend could run.
    ep_comm._C with the nvlink kernels (`peer_link(device, peer)` answers its link query), `device_count` GPUs with
    UUIDs GPU-0, GPU-1, ..., this rank on GPU `device`, of compute capability `capability()`, kernel images runnable,
    no nvshmem4py; the Buffer is shown an NCCL group (a gloo group picks the reference backend without asking nvlink;
    the reference backend keeps the real gloo map). The nvlink constructor is a stand-in that raises the returned
    exception class, so that the Buffer's choice can be seen."""
    import types
    from ep_comm import _ext, buffer, formats
    from ep_comm.backends import nvlink
    buffer.device_backends = lambda group: {"cpu": "gloo", "cuda": "nccl"}
    _ext._C = types.SimpleNamespace(NvlinkContext=object, nvlink_max_world=8, nvlink_peer_link=peer_link)
    _ext.cuda_extension_available = lambda: True
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: device_count
    torch.cuda.current_device = lambda: device
    torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid=f"GPU-{index}")
    torch.cuda.get_device_capability = lambda device=None: capability()
    formats._kernel_image_problem = lambda device: ""
    nvlink.nvshmem_importable = lambda: False

    class Constructed(Exception):
        pass

    def construct(self, group, config):
        raise Constructed()

    nvlink.NVLinkBackend.__init__ = construct
    return Constructed


def _auto_falls_back_worker(rank, world):
    """backend="auto" where the nvlink backend cannot run, on a faked node (_fake_nvlink_node) of two sm_90 GPUs with
    NVLink-like links, rank r on GPU r. The control: there "auto" goes to the nvlink backend (a stand-in constructor).
    Then rank 1's GPU turns sm_80: is_available refuses it with its reason, every rank takes the reference backend and
    warns once (two Buffers made), backend="nvlink" raises with it."""
    import warnings
    import ep_comm
    from ep_comm.backends import nvlink
    capability = {0: (9, 0), 1: (9, 0)}
    Constructed = _fake_nvlink_node(rank, 2, lambda: capability[rank])
    kw = dict(hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8)
    out = {"available": nvlink.NVLinkBackend.is_available(None)}
    try:
        ep_comm.Buffer(None, backend="auto", **kw)
        out["control"] = "no nvlink attempt"
    except Constructed:
        out["control"] = "nvlink"
    capability[1] = (8, 0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        buffers = [ep_comm.Buffer(None, backend="auto", **kw) for _ in range(2)]
        out["backends"] = [b.backend for b in buffers]
        try:
            ep_comm.Buffer(None, backend="nvlink", **kw)
            out["nvlink"] = "no error"
        except RuntimeError as error:
            out["nvlink"] = str(error)
    for b in buffers:
        b.destroy()
    out["warnings"] = [str(w.message) for w in warned if issubclass(w.category, RuntimeWarning)]
    return out


@pytest.mark.cpu
def test_auto_falls_back_to_reference_when_nvlink_cannot_run():
    reason = "rank 1: needs compute capability >= 9.0 (sm_90a build), found 8.0"
    for rank, out in enumerate(run_ranks(_auto_falls_back_worker, 2, backend="gloo", timeout_s=120)):
        assert out["available"] == (True, ""), out  # the faked setting passes every other check of is_available
        assert out["control"] == "nvlink", out
        assert out["backends"] == ["reference", "reference"], out
        fallback = [w for w in out["warnings"] if "using the reference backend" in w]
        assert len(fallback) == 1 and fallback[0].endswith(f"because the nvlink backend is unavailable: {reason}"), \
            (rank, out["warnings"])
        assert out["nvlink"] == f"backend='nvlink' is unavailable: {reason}", out


def _peer_links_worker(rank, world, gpus, link, shared_gpu, hosts=None, uuid_readable=True):
    """The nvlink backend's peer check (backends/nvlink.py _peer_link_problem) on a faked node (_fake_nvlink_node) of
    4 sm_90 GPUs, rank r on GPU gpus[r], every link answering `link` = (access, native atomics). hosts: each rank's
    host name (then with nvshmem4py "installed", as ranks on two hosts need); uuid_readable=False: the GPU's
    properties raise. Returns what backend="auto" and backend="nvlink" chose (the nvlink constructor is a stand-in)
    and which (device, peer) links this rank asked about."""
    import os
    import socket
    import types
    import warnings
    import ep_comm
    from ep_comm.backends import nvlink
    asked = []

    def peer_link(device, peer):
        asked.append((device, peer))
        return link
    # Set either way: the shared-GPU test runs (EP_COMM_TEST_SHARED_GPU) export it as 1 to every rank they start.
    os.environ["EP_COMM_ALLOW_SHARED_GPU"] = "1" if shared_gpu else "0"
    Constructed = _fake_nvlink_node(gpus[rank], 4, lambda: (9, 0), peer_link)
    if hosts is not None:
        socket.gethostname = lambda: hosts[rank]
        nvlink.nvshmem_importable = lambda: True
    if not uuid_readable:
        def unreadable(index):
            raise RuntimeError("no properties")
        torch.cuda.get_device_properties = unreadable
    else:
        torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid=f"GPU-{index}")
    out = {}
    for backend in ("auto", "nvlink"):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                made = ep_comm.Buffer(None, backend=backend, hidden=64, num_experts=4, num_topk=2,
                                      max_tokens_per_rank=8)
                out[backend] = made.backend
                made.destroy()
            except Constructed:
                out[backend] = "nvlink"
            except RuntimeError as error:
                out[backend] = str(error)
        out[backend + " warnings"] = [str(w.message) for w in warned if issubclass(w.category, RuntimeWarning)]
    out["asked"] = asked
    return out


@pytest.mark.cpu
def test_nvlink_peer_check_follows_each_ranks_gpu():
    """Ranks on GPUs 2 and 3 with NVLink-like links: each rank asks about the other's GPU (found by UUID), not GPUs
    0 and 1, and both backends choose nvlink."""
    outs = run_ranks(_peer_links_worker, 2, (2, 3), (True, True), False, backend="gloo", timeout_s=120)
    for rank, out in enumerate(outs):
        assert out["auto"] == "nvlink" and out["nvlink"] == "nvlink", out
        assert out["asked"] == [(2 + rank, 3 - rank)] * 2, out


@pytest.mark.cpu
@pytest.mark.parametrize("link, reason", [
    ((True, False), "rank 0: GPU cuda:0 reaches rank 1's GPU cuda:1 without native peer atomics (a PCIe link, not "
                    "NVLink): the nvlink kernels' flags and counters need them"),
    ((False, False), "rank 0: GPU cuda:0 cannot access rank 1's GPU cuda:1 as a peer (no NVLink/P2P)"),
])
def test_nvlink_refused_without_peer_atomics_or_access(link, reason):
    """A PCIe-like link (access without native atomics) or none: "auto" takes the reference backend and says why
    (rank 0's reason, the first), "nvlink" raises with it, on every rank."""
    for out in run_ranks(_peer_links_worker, 2, (0, 1), link, False, backend="gloo", timeout_s=120):
        assert out["auto"] == "reference", out
        assert out["auto warnings"] == [f"ep_comm: using the reference backend (torch.distributed all_to_all) "
                                        f"because the nvlink backend is unavailable: {reason}"], out
        assert out["nvlink"] == f"backend='nvlink' is unavailable: {reason}", out


@pytest.mark.cpu
def test_nvlink_peer_check_across_hosts():
    """Ranks on two hosts (NVSHMEM across one NVLink domain): no link query for the other host's GPU, which this
    process cannot see (here: a PCIe-like answer that would refuse it); but one GPU UUID on both hosts is one GPU, and
    is refused."""
    outs = run_ranks(_peer_links_worker, 2, (0, 1), (True, False), False, ("node0", "node1"), backend="gloo",
                     timeout_s=120)
    assert all(out["auto"] == "nvlink" and out["nvlink"] == "nvlink" and out["asked"] == [] for out in outs), outs
    for out in run_ranks(_peer_links_worker, 2, (0, 0), (True, True), False, ("node0", "node1"), backend="gloo",
                         timeout_s=120):
        assert out["auto"] == "reference" and "ranks 0 and 1 use the same GPU" in out["nvlink"], out


@pytest.mark.cpu
def test_nvlink_refused_when_the_gpu_uuid_cannot_be_read():
    """A GPU whose properties cannot be read gives no UUID: the peer check cannot run, so nvlink is refused (not
    skipped) with that reason."""
    reason = ("rank 0: could not read this GPU's UUID (torch.cuda.get_device_properties(...).uuid), which the peer "
              "check needs")
    for out in run_ranks(_peer_links_worker, 2, (0, 1), (True, True), False, None, False, backend="gloo",
                         timeout_s=120):
        assert out["auto"] == "reference" and out["nvlink"] == f"backend='nvlink' is unavailable: {reason}", out


@pytest.mark.cpu
def test_nvlink_refused_on_one_gpu_for_two_ranks_unless_shared_gpu_is_allowed():
    """Both ranks on GPU 0 (e.g. no torch.cuda.set_device(local_rank)): refused with the remedy, without asking about
    any link; with EP_COMM_ALLOW_SHARED_GPU=1 (the correctness-testing mode) accepted."""
    reason = ("rank 0: ranks 0 and 1 use the same GPU (cuda:0 here, GPU-0): give each rank its own GPU "
              "(torch.cuda.set_device(local_rank) before creating the Buffer); EP_COMM_ALLOW_SHARED_GPU=1 lets ranks "
              "share one for correctness tests only")
    for out in run_ranks(_peer_links_worker, 2, (0, 0), (True, True), False, backend="gloo", timeout_s=120):
        assert out["auto"] == "reference" and out["nvlink"] == f"backend='nvlink' is unavailable: {reason}", out
        assert out["asked"] == [], out
    for out in run_ranks(_peer_links_worker, 2, (0, 0), (True, True), True, backend="gloo", timeout_s=120):
        assert out["auto"] == "nvlink" and out["nvlink"] == "nvlink" and out["asked"] == [], out


def _agreement_worker(rank, world):
    """The reference backend's per-call agreement (raise_together) on its own: the ranks' tensors on different device
    types (rank 0 CPU, rank 1 CUDA, as on a group with both gloo and NCCL: the agreement runs over gloo) make every
    rank raise naming both; unknown types (None) and equal types pass; a failed check on one rank still takes
    precedence (its own error there, the others name it)."""
    import ep_comm
    buf = ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference")
    out = []
    for types_of_ranks, failing in ((("cpu", "cuda"), None), (("cpu", None), None), (("cuda", "cuda"), None),
                                    (("cpu", "cuda"), 1)):
        error = KeyError("own check") if rank == failing else None
        try:
            buf._backend.raise_together(error, "rejected on rank(s) {ranks}", 7, types_of_ranks[rank])
            out.append("passed")
        except (KeyError, ValueError) as raised:
            out.append(f"{type(raised).__name__}: {raised}")
    buf.destroy()
    return out


@pytest.mark.cpu
def test_ranks_agree_on_the_device_type_of_a_call():
    mixed = ("ValueError: the ranks passed this call's tensors on different device types (rank 0: cpu, rank 1: cuda): "
             "every rank must use the same (over a group with both gloo and NCCL, CPU tensors go over gloo and CUDA "
             "tensors over NCCL, and the two never meet); this call is abandoned on every rank")
    rank0, rank1 = run_ranks(_agreement_worker, 2, backend="gloo", timeout_s=120)
    assert rank0 == [mixed, "passed", "passed", "ValueError: rejected on rank(s) [1]"], rank0
    assert rank1 == [mixed, "passed", "passed", "KeyError: 'own check'"], rank1


def _exception_in_with_block_worker(rank, world):
    """An exception leaving `with Buffer(...)`: the backend is told to give up first (nvlink: the peers stop waiting
    for this rank), then destroyed; a destroy() that fails too is warned about and does not replace the exception."""
    import warnings
    import ep_comm
    calls, caught = [], []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for destroy_fails in (False, True):
            try:
                with ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8,
                                    backend="reference") as buf:
                    buf._backend.give_up = lambda reason: calls.append(reason)
                    if destroy_fails:
                        def failing_destroy():
                            calls.append("destroy")
                            raise RuntimeError("destroy failed")
                        buf._backend.destroy = failing_destroy
                    raise KeyError(f"own error {destroy_fails}")
            except KeyError as error:
                caught.append(str(error))
            except RuntimeError as error:
                caught.append(f"replaced by {error}")
    return calls, caught, [str(w.message) for w in warned if issubclass(w.category, RuntimeWarning)]


@pytest.mark.cpu
def test_exception_leaving_the_with_block_gives_up_then_destroys():
    (calls, caught, warned), = run_ranks(_exception_in_with_block_worker, 1, backend="gloo", timeout_s=120)
    assert caught == ["'own error False'", "'own error True'"], caught
    reason = "an exception left the `with Buffer` block: KeyError('own error"
    assert len(calls) == 3 and reason in calls[0] and reason in calls[1] and calls[2] == "destroy", calls
    assert any("destroy() after an exception in the `with` block failed" in w for w in warned), warned


def _sign_mask_worker(rank, world, sign_mask):
    """A combine with a non-default RHT sign vector: the sender's rotation and the receiver's inverse use the same
    mask, so the S2F6 combine stays within its quantization error of the BF16 combine of the same rows (a receiver on
    another mask would be off by ~100%). Both local_reduce modes."""
    import ep_comm
    kw = dict(hidden=128, num_experts=8, num_topk=3, max_tokens_per_rank=16, backend="reference")
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(12, 128, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(12)])
    w = torch.rand(12, 3, generator=g)
    errors = []
    differs = []
    with ep_comm.Buffer(None, rht_sign_mask=sign_mask, **kw) as s2f6, \
            ep_comm.Buffer(None, combine_format="bf16", **kw) as bf16, \
            ep_comm.Buffer(None, **kw) as default_mask:
        res, res_bf16, res_default = s2f6.dispatch(x, idx, w), bf16.dispatch(x, idx, w), default_mask.dispatch(x, idx, w)
        out = torch.randn(res.num_rows, 128, generator=g).to(torch.bfloat16)
        for local_reduce in (True, False):
            got = s2f6.combine(out, res.handle, local_reduce=local_reduce).float()
            want = bf16.combine(out, res_bf16.handle, local_reduce=local_reduce).float()
            errors.append(((got - want).norm() / want.norm()).item())
            # The mask is used, not ignored: the other rotation rounds other values (a backend that applied the
            # default mask on both sides would pass the bound above with these exact bits).
            default = default_mask.combine(out, res_default.handle, local_reduce=local_reduce).float()
            differs.append(not torch.equal(got, default))
    return errors, differs


@pytest.mark.cpu
def test_combine_with_another_rht_sign_mask():
    for errors, differs in run_ranks(_sign_mask_worker, 2, 0x12345678, backend="gloo", timeout_s=120):
        assert all(error < 0.05 for error in errors), errors
        assert all(differs), differs


@pytest.mark.multigpu
@pytest.mark.nccl
def test_nccl_comm_stream():
    """dispatch / combine on a communication stream with an event: the results of the current-stream calls."""
    results = run_ranks(dist_cases.comm_stream_worker, 2, "reference", backend="nccl")
    assert all(r == "comm stream ok" for r in results)


@pytest.mark.multigpu
@pytest.mark.nccl
def test_nccl_world2_semantics_and_errors():
    world = min(torch.cuda.device_count(), 8)
    results = run_ranks(_both_workers, world, "reference", "cuda", backend="nccl")
    assert len(results) == world


@pytest.mark.cpu
def test_expert_id_check_edges():
    """Buffer's input check (one device->host copy): masked slots may repeat, K = 1 has no duplicates, the
    first offending token is named, and the range error reports the observed range."""
    from ep_comm import InvalidRoutingError
    from ep_comm.buffer import _check_expert_ids
    assert issubclass(InvalidRoutingError, ValueError)
    _check_expert_ids(torch.tensor([[-1, -1, 3], [0, 1, 2]]), 4)          # repeated -1 is not a duplicate
    _check_expert_ids(torch.tensor([[3], [3], [-1]]), 4)                  # K = 1
    _check_expert_ids(torch.zeros(0, 2, dtype=torch.int64), 4)            # no tokens
    with pytest.raises(InvalidRoutingError, match=r"token 2 selects the same expert .*\[1, 5, 1\]"):
        _check_expert_ids(torch.tensor([[0, 1, 2], [3, -1, -1], [1, 5, 1], [2, 2, 0]]), 8)
    with pytest.raises(ValueError, match=r"must be in \[-1, 4\); got range \[-2, 3\]"):
        _check_expert_ids(torch.tensor([[0, 3], [-2, 1]]), 4)
    with pytest.raises(ValueError, match=r"must be in \[-1, 4\); got range \[0, 4\]"):
        _check_expert_ids(torch.tensor([[0, 4], [4, 4]], dtype=torch.int32), 4)  # range is reported first
    wide = torch.arange(40).repeat(3, 1)                                   # a wide top-k (K = 40)
    wide[1, 5] = -1
    wide[1, 7] = -1
    _check_expert_ids(wide, 64)
    wide[2, 30] = wide[2, 3]
    with pytest.raises(ValueError, match="token 2 selects the same expert"):
        _check_expert_ids(wide, 64)


@pytest.mark.cpu
def test_expert_id_check_refuses_non_finite_weights_of_selected_slots():
    """With the weights, the same check (and the same device->host copy) refuses a NaN or infinite weight on a
    selected slot, naming token, slot and expert; a masked slot's weight is never used and may be anything."""
    from ep_comm.buffer import _check_expert_ids
    idx = torch.tensor([[0, 1], [2, -1], [3, 0]])
    weights = torch.tensor([[0.5, 0.5], [1.0, float("nan")], [0.25, 0.75]])
    _check_expert_ids(idx, 4, weights)                                     # NaN on the masked slot: fine
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = weights.clone()
        w[2, 1] = bad
        with pytest.raises(ValueError, match=r"token 2 has the routing weight .* in top-k slot 1 \(expert 0\)"):
            _check_expert_ids(idx, 4, w)
    _check_expert_ids(idx, 4)                                              # without weights: ids only, as before


def _masked_weights_worker(rank, world):
    """One gloo rank: the combine of a dispatch whose masked slots hold NaN weights is bitwise the one whose masked
    slots hold 0 (they are never used), for four format pairs and both local_reduce modes."""
    import ep_comm
    gen = torch.Generator().manual_seed(rank)
    tokens, hidden, experts, topk = 16, 256, 4 * world, 3
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    idx[::2, 1] = -1
    idx[3] = -1
    w = torch.rand(tokens, topk, generator=gen)
    masked_nan = torch.where(idx < 0, torch.full_like(w, float("nan")), w)
    masked_zero = torch.where(idx < 0, torch.zeros_like(w), w)
    for dfmt, cfmt in (("bf16", "bf16"), ("nvfp4", "s2f6"), ("mxfp8", "bf16"), ("bf16", "s2f6")):
        with ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                            dispatch_format=dfmt, combine_format=cfmt, backend="reference") as buf:
            for local_reduce in (True, False):
                outs = []
                for weights in (masked_zero, masked_nan):
                    res = buf.dispatch(x, idx, weights, check_inputs=True)
                    rows = torch.randn(res.num_rows, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
                    outs.append(buf.combine(rows, res.handle, local_reduce=local_reduce))
                assert not outs[1].isnan().any(), (dfmt, cfmt, local_reduce)
                assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (dfmt, cfmt, local_reduce)
    return "ok"


@pytest.mark.cpu
def test_masked_slots_weights_are_never_used():
    assert run_ranks(_masked_weights_worker, 2) == ["ok", "ok"]


def _input_types_worker(rank, world):
    """One gloo rank: what the Buffer does with a NaN routing weight (refused with the check, on both forms of the
    call), with check_inputs that is not a bool, with numpy integers as sizes, and how a numpy bool is named."""
    import numpy as np
    import ep_comm
    messages = []
    with ep_comm.Buffer(None, hidden=np.int64(64), num_experts=np.int32(2), num_topk=2, max_tokens_per_rank=4,
                        backend="reference") as buf:
        assert buf.config.hidden == 64 and type(buf.config.hidden) is int
        x = torch.ones(2, 64, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [0, 1]])
        w = torch.tensor([[float("nan"), 0.5], [0.5, 0.5]])
        for call in (lambda: buf.dispatch(x, idx, w), lambda: buf.dispatch(x, idx, w, check_inputs=True)):
            try:
                call()
                messages.append("NaN weight accepted")
            except ValueError as error:
                messages.append("refused" if "routing weight nan" in str(error) else repr(error))
        unchecked = buf.dispatch(x, idx, w, check_inputs=False)          # the caller's choice: no check, no sync
        assert unchecked.num_rows == 4
        for value in ("off", 1, np.bool_(False)):
            try:
                buf.dispatch(x, idx, w.nan_to_num(), check_inputs=value)
                messages.append(f"check_inputs={value!r} accepted")
            except TypeError as error:
                messages.append(str(error))
        result = buf.dispatch(x, idx, w.nan_to_num())
        try:
            buf.combine(torch.zeros(result.num_rows, 64, dtype=torch.bfloat16),
                        result.handle, local_reduce=np.bool_(True))
            messages.append("numpy bool accepted")
        except TypeError as error:
            messages.append(str(error))
    try:
        ep_comm.Buffer(None, hidden=64, num_experts=2, num_topk=2, max_tokens_per_rank=4, backend="reference",
                       check_inputs="no")
        messages.append("Buffer(check_inputs='no') accepted")
    except TypeError as error:
        messages.append(str(error))
    return messages


@pytest.mark.cpu
def test_buffer_input_types_and_non_finite_weights():
    (messages,) = run_ranks(_input_types_worker, 1, backend="gloo", timeout_s=120)
    assert messages[:2] == ["refused", "refused"], messages
    assert messages[2] == "check_inputs must be None or a bool, got str", messages
    assert messages[3] == "check_inputs must be None or a bool, got int", messages
    assert messages[4].startswith("check_inputs must be None or a bool, got numpy."), messages
    assert messages[5].startswith("local_reduce must be a bool, got numpy."), messages
    assert messages[6] == "check_inputs must be a bool, got str", messages


@pytest.mark.cpu
def test_integer_like_sizes():
    """numpy integers are sizes; bools, tensors and floats are not (BufferConfig.validate refuses them, naming numpy
    types as such); the size hint takes what the Buffer takes."""
    import numpy as np
    import ep_comm
    from ep_comm.types import BufferConfig, as_int
    assert as_int(np.int64(64)) == 64 and type(as_int(np.int32(8))) is int
    for value in (True, np.bool_(True), torch.tensor(64), torch.tensor([64]), 64.0, "64"):
        assert as_int(value) is value
    base = dict(hidden=64, num_experts=8, num_topk=2, max_tokens_per_rank=16, world_size=2)
    with pytest.raises(TypeError, match="num_topk must be an int, got numpy.bool"):
        BufferConfig(**dict(base, num_topk=np.bool_(True))).validate()
    with pytest.raises(TypeError, match="hidden must be an int, got torch.Tensor"):
        BufferConfig(**dict(base, hidden=torch.tensor(64))).validate()
    hint = ep_comm.Buffer.get_buffer_size_hint(backend="reference", **{k: np.int64(v) for k, v in base.items()})
    assert hint == ep_comm.Buffer.get_buffer_size_hint(backend="reference", **base)
    # numpy scalars for timeout_s too (float32, int64), as a float; a numpy bool stays refused
    for value in (np.float32(100), np.int64(100), np.float64(100)):
        config = BufferConfig(**dict(base, timeout_s=value))
        config.validate()
        assert type(config.timeout_s) is float and config.timeout_s == 100.0
    with pytest.raises(TypeError, match="timeout_s"):
        BufferConfig(**dict(base, timeout_s=np.bool_(True))).validate()
    # The combine receives at most K rows per token (min(W, K) reduced, K unreduced): with W > K the hint is T * K
    # rows, not T * W (it was 8x too large at W = 64, K = 8).
    wide = dict(base, num_experts=64, world_size=64)
    sizes = ep_comm.Buffer.get_buffer_size_hint(backend="reference", **wide)
    assert sizes.combine_recv_bytes == 2 * 16 * ep_comm.types.combine_bytes_per_token("s2f6", 64)


def _check_inputs_differs_worker(rank, world):
    """check_inputs that is not a bool on one rank (a tensor, which has no single truth value): every rank raises the
    same ValueError (arguments differ), none waits in the construction's collective."""
    import ep_comm
    try:
        ep_comm.Buffer(None, hidden=64, num_experts=2, num_topk=2, max_tokens_per_rank=4, backend="reference",
                       check_inputs=torch.ones(2) if rank == 0 else True)
        return "constructed"
    except ValueError as error:
        return "differ" if "differ between" in str(error) else repr(error)


@pytest.mark.cpu
def test_check_inputs_of_another_type_on_one_rank():
    assert run_ranks(_check_inputs_differs_worker, 2, backend="gloo", timeout_s=120) == ["differ", "differ"]


def _edited_weights_worker(rank, world):
    """A DispatchResult's topk_weight edited in place between dispatch and combine (a user normalising it, say): the
    combine still weights with what dispatch delivered (the handle's own copy), in both local_reduce modes."""
    import ep_comm
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=gen)
    with ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8,
                        backend="reference") as buf:
        res = buf.dispatch(x, idx, w)
        expert_out = torch.randn(res.num_rows, 64, generator=gen).to(torch.bfloat16)
        before = [buf.combine(expert_out, res.handle, local_reduce=mode) for mode in (True, False)]
        res.topk_weight.fill_(-3.0)
        after = [buf.combine(expert_out, res.handle, local_reduce=mode) for mode in (True, False)]
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, after))


@pytest.mark.cpu
def test_combine_ignores_edits_of_the_results_topk_weight():
    assert run_ranks(_edited_weights_worker, 2, backend="gloo", timeout_s=120) == [True, True]


@pytest.mark.cpu
def test_buffer_config_rejects_wrong_types_and_values():
    """Values that would pass the range checks but fail (or silently misalign) later are refused up front."""
    import ep_comm
    from ep_comm.types import BufferConfig
    base = dict(hidden=64, num_experts=8, num_topk=2, max_tokens_per_rank=16, world_size=2)
    BufferConfig(**base).validate()
    for name, value in (("hidden", 64.0), ("expert_alignment", 1.5), ("max_tokens_per_rank", True),
                        ("rht_sign_mask", 1.5), ("num_sms", "24")):
        with pytest.raises(TypeError, match=name):
            BufferConfig(**dict(base, **{name: value})).validate()
    for value in (-1.0, 0, float("inf"), float("nan"), 1e-12, 1e14):  # 1e14 s overflowed the gloo wait
        with pytest.raises(ValueError, match="timeout_s"):
            BufferConfig(**dict(base, timeout_s=value)).validate()
    for value in (True, "10", None):  # not a number: a TypeError, like the integer fields'
        with pytest.raises(TypeError, match="timeout_s must be a number"):
            BufferConfig(**dict(base, timeout_s=value)).validate()
    for name in ("hidden", "max_tokens_per_rank", "expert_alignment"):  # 32-bit indices in kernels and results
        with pytest.raises(ValueError, match=f"{name}|2\\*\\*31"):
            BufferConfig(**dict(base, **{name: 2**31 if name != "hidden" else 2**31 + 32})).validate()
    with pytest.raises(ValueError, match="receive layout would hold"):
        BufferConfig(**dict(base, max_tokens_per_rank=2**29)).validate()  # 2 ranks x 2**29 x top-2 rows
    for name, value in (("num_sms", 0), ("num_sms", 4097), ("num_local_sms", -1), ("num_local_sms", 2**27)):
        with pytest.raises(ValueError, match=name):  # 2**27 blocks of 16 warps wrapped the kernels' 32-bit warp count
            BufferConfig(**dict(base, **{name: value})).validate()
    with pytest.raises(ValueError, match="num_topk <= 32"):  # a hint for what the nvlink backend refuses
        ep_comm.Buffer.get_buffer_size_hint(backend="nvlink", **dict(base, num_experts=64, num_topk=40))
    with pytest.raises(ValueError, match="up to 1024 ranks"):
        ep_comm.Buffer.get_buffer_size_hint(backend="nvlink", **dict(base, num_experts=2048, world_size=2048))
    with pytest.raises(ValueError, match="size hint"):
        ep_comm.Buffer.get_buffer_size_hint(backend="typo", **base)
    assert ep_comm.Buffer.get_buffer_size_hint(backend="reference", **base).dispatch_recv_bytes >= 0
    # The combine hint covers a local_reduce=False combine (one row per (token, expert)), not only one row per
    # (token, rank): with K > W that is K / W times more.
    wide = dict(base, num_topk=8, world_size=2)
    row_bytes = ep_comm.combine_bytes_per_token("s2f6", wide["hidden"])
    assert ep_comm.Buffer.get_buffer_size_hint(backend="reference", **wide).combine_recv_bytes >= \
        wide["max_tokens_per_rank"] * 8 * row_bytes



@pytest.mark.cpu
def test_wire_byte_counts_of_each_format():
    """dispatch / combine_bytes_per_token: the README's figures at H = 7168 (NVFP4 4036 = 3584 codes + 448 scales + 4,
    MXFP8 and S2F6 7392, BF16 14336), and a ValueError for a row width the format cannot carry (a partial last
    block, zero, negative, not an int) or an unknown format, instead of a number."""
    import ep_comm
    assert [ep_comm.dispatch_bytes_per_token(f, 7168) for f in ("nvfp4", "mxfp8", "bf16")] == [4036, 7392, 14336]
    assert [ep_comm.combine_bytes_per_token(f, 7168) for f in ("s2f6", "mxfp8", "bf16")] == [7392, 7392, 14336]
    bad = ((ep_comm.dispatch_bytes_per_token, "nvfp4", 7), (ep_comm.dispatch_bytes_per_token, "nvfp4", 0),
           (ep_comm.dispatch_bytes_per_token, "nvfp4", -64), (ep_comm.dispatch_bytes_per_token, "mxfp8", 48),
           (ep_comm.dispatch_bytes_per_token, "bf16", 64.0), (ep_comm.dispatch_bytes_per_token, "bf16", True),
           (ep_comm.combine_bytes_per_token, "s2f6", 48), (ep_comm.combine_bytes_per_token, "bf16", 0),
           (ep_comm.dispatch_bytes_per_token, "fp8", 64), (ep_comm.combine_bytes_per_token, "nvfp4", 64))
    for function, fmt, hidden in bad:
        with pytest.raises(ValueError):
            function(fmt, hidden)
    # A numpy width gives a Python int, as annotated (it gave numpy.int64).
    import numpy as np
    counts = [ep_comm.dispatch_bytes_per_token("nvfp4", np.int64(64)), ep_comm.combine_bytes_per_token("s2f6",
                                                                                                      np.int32(64))]
    assert counts == [40, 66] and all(type(count) is int for count in counts), counts
    # An unchecked config (validate() not called) refuses its derived sizes with a ValueError, not a
    # ZeroDivisionError.
    from ep_comm.types import BufferConfig
    unchecked = BufferConfig(hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4, world_size=0)
    for derived in ("num_local_experts", "max_recv_rows"):
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            getattr(unchecked, derived)


_TWO_BUFFER_SIZES = dict(hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4, dispatch_format="bf16",
                         combine_format="bf16", backend="reference", timeout_s=30)


def _two_same_size_buffers(rank):
    """Two reference Buffers A and B of the same sizes (_TWO_BUFFER_SIZES) over the world group, and a call's inputs
    (x, topk_idx, topk_weights: 4 tokens, top-2 of 4 experts, weights 1) that depend on the rank."""
    import ep_comm
    sizes = _TWO_BUFFER_SIZES
    return (ep_comm.Buffer(None, **sizes), ep_comm.Buffer(None, **sizes),
            torch.full((4, 64), 1.0 + rank, dtype=torch.bfloat16), torch.tensor([[0, 2], [1, 3], [0, 3], [2, 1]]),
            torch.ones(4, 2))


def _two_buffers_worker(rank, world, reversed_group_too: bool):
    """Two misuses of two same-size Buffers, each of which exchanged one Buffer's rows as the other's without a word:
    the ranks calling the Buffers' dispatches in different orders (rank 0: A then B, rank 1: B then A), and (with
    reversed_group_too) every rank combining the handle of a Buffer whose group numbers the same processes the other
    way round (new_group([1, 0], sort_ranks=False), torch >= 2.12) on a world-group Buffer. Then what stays allowed:
    the same Buffers in the same order, and the handle on the Buffer that made it."""
    import torch.distributed as dist
    import ep_comm
    a, b, x, idx, w = _two_same_size_buffers(rank)
    want = (2 * x.float()).to(torch.bfloat16)  # identity experts, two slots of weight 1
    out = {}
    first = a if rank == 0 else b
    try:
        first.dispatch(x, idx, w)
        out["orders"] = "accepted"
    except ValueError as error:
        out["orders"] = str(error)
    buffers = [a, b]
    if reversed_group_too:
        r = ep_comm.Buffer(dist.new_group([1, 0], sort_ranks=False), **_TWO_BUFFER_SIZES)
        buffers.append(r)
        result = r.dispatch(x, idx, w)
        try:
            a.combine(result.x.clone(), result.handle)
            out["reversed_handle"] = "accepted"
        except ValueError as error:
            out["reversed_handle"] = str(error)
        out["own_handle"] = bool(torch.equal(r.combine(result.x.clone(), result.handle), want))
    ra, rb = a.dispatch(x, idx, w), b.dispatch(x, idx, w)
    out["same_order"] = bool(torch.equal(a.combine(ra.x.clone(), ra.handle), want)
                             and torch.equal(b.combine(rb.x.clone(), rb.handle), want))
    for buffer in buffers:
        buffer.destroy()
    return out


def _combine_against_first_dispatch_worker(rank, world):
    """Rank 0 combines on Buffer A (a handle of Buffer B) while rank 1 makes A's first dispatch: the two calls had the
    same agreement id (A's tag), so both ranks went on into different exchanges and waited out the timeout. Both must
    raise at the agreement, naming the calls, and A must stay usable."""
    import time
    a, b, x, idx, w = _two_same_size_buffers(rank)
    rb = b.dispatch(x, idx, w)
    out = {}
    start = time.monotonic()
    try:
        if rank == 0:
            a.combine(rb.x.clone(), rb.handle)
        else:
            a.dispatch(x, idx, w)
        out["mixed"] = "accepted"
    except ValueError as error:
        out["mixed"] = str(error)
    out["seconds"] = time.monotonic() - start
    ra = a.dispatch(x, idx, w)
    out["after"] = bool(torch.equal(a.combine(ra.x.clone(), ra.handle), (2 * x.float()).to(torch.bfloat16)))
    a.destroy()
    b.destroy()
    return out


@pytest.mark.cpu
def test_a_combine_against_a_first_dispatch_on_another_rank_raises_at_once():
    for rank, out in enumerate(run_ranks(_combine_against_first_dispatch_worker, 2, backend="gloo", timeout_s=120)):
        assert "made different calls on this Buffer (rank 0: combine, rank 1: dispatch)" in out["mixed"], (rank, out)
        assert out["seconds"] < 20, (rank, out)  # at the agreement, not after timeout_s = 30 s
        assert out["after"], (rank, out)


def _new_group_keeps_rank_order() -> bool:
    """torch >= 2.12: new_group(..., sort_ranks=False) (before, every group numbered its ranks in global order)."""
    import inspect
    import torch.distributed as dist
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


@pytest.mark.cpu
def test_two_same_size_buffers_called_in_different_orders_raise_instead_of_mixing_rows():
    for out in run_ranks(_two_buffers_worker, 2, False, backend="gloo", timeout_s=120):
        assert "made this call on different Buffers or out of step" in out["orders"], out
        assert out["same_order"], out


@pytest.mark.cpu
def test_a_handle_from_a_group_in_another_rank_order_is_refused():
    if not _new_group_keeps_rank_order():  # (torch 2.11 on the GPU machine: there only the test above runs)
        pytest.skip(f"torch {torch.__version__}'s new_group has no sort_ranks: no group can number these processes "
                    "the other way round")
    for out in run_ranks(_two_buffers_worker, 2, True, backend="gloo", timeout_s=120):
        assert "made this call on different Buffers or out of step" in out["orders"], out
        assert "another process group" in out["reversed_handle"], out
        assert out["own_handle"] and out["same_order"], out


def _rows_only_worker(rank, world):
    """Reference backend, dispatch(expand=False): row_index names x's rows (x is already expert-major: arange over
    the received rows, -1 on padding), and expert_major_x() gives the expanded dispatch's x."""
    import ep_comm
    from oracle import payload_bytes
    hidden, experts, topk = 64, 4 * world, 2
    with ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=16,
                        expert_alignment=4) as buf:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(9 + rank, hidden, generator=gen).to(torch.bfloat16)
        idx = torch.rand(x.shape[0], experts, generator=gen).topk(topk, dim=1).indices
        w = torch.rand(x.shape[0], topk, generator=gen)
        full = buf.dispatch(x, idx, w)
        rows = buf.dispatch(x, idx, w, expand=False)
        assert full.row_index is None and rows.row_index.dtype == torch.int32
        padding = full.src_rank < 0
        assert bool((rows.row_index[padding] == -1).all()) and bool(padding.any())
        assert torch.equal(rows.row_index[~padding].long(), torch.arange(full.num_rows)[~padding])
        assert torch.equal(payload_bytes(rows.expert_major_x(), "nvfp4"), payload_bytes(full.x, "nvfp4"))
        try:
            buf.dispatch(x, idx, w, expand=0)
            return "expand=0 accepted"
        except TypeError:
            pass
    return "ok"


@pytest.mark.cpu
def test_reference_rows_only_dispatch():
    assert run_ranks(_rows_only_worker, 2, backend="gloo") == ["ok", "ok"]


def _nvfp4_few_rows_worker(rank, world):
    """NVFP4 dispatch where a rank receives 0 or 1 rows, at hidden sizes whose amax bytes sit at an offset 9H/16 that
    is not a multiple of 4 (H = 32, 96): the received rows' amax and codes are the sender's, and combine runs."""
    import ep_comm
    from ep_comm import formats
    outcome = []
    for hidden in (32, 96, 64):
        def tokens(of_rank):  # both ranks can rebuild each other's tokens
            gen = torch.Generator().manual_seed(100 * hidden + of_rank)
            return torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
        x = tokens(rank)
        w = torch.rand(3, 1, generator=torch.Generator().manual_seed(rank))
        # expert 0 lives on rank 0, expert 1 on rank 1. "none": everything to rank 0, so rank 1 receives 0 rows;
        # "one": rank 0's token 0 goes to rank 1, its only row.
        for case in ("none", "one"):
            idx = torch.zeros(3, 1, dtype=torch.int64)
            if case == "one" and rank == 0:
                idx[0, 0] = 1
            with ep_comm.Buffer(None, hidden=hidden, num_experts=2, num_topk=1, max_tokens_per_rank=4,
                                backend="reference", dispatch_format="nvfp4") as buf:
                res = buf.dispatch(x, idx, w)
                expected_rows = {("none", 0): 6, ("none", 1): 0, ("one", 0): 5, ("one", 1): 1}[(case, rank)]
                valid = int(res.expert_offsets[-1])
                ok = int(res.num_tokens_per_expert.sum()) == expected_rows
                for row in range(valid):
                    src_rank, src_token = int(res.src_rank[row]), int(res.src_token[row])
                    if src_rank < 0:
                        continue
                    sent = formats.nvfp4_quantize(tokens(src_rank)[src_token:src_token + 1])
                    ok = ok and torch.equal(res.x.amax[row:row + 1].view(torch.int32), sent.amax.view(torch.int32))
                    ok = ok and torch.equal(res.x.data[row:row + 1], sent.data)
                out = buf.combine(formats.dequantize(res.x, torch.bfloat16), res.handle)
                ok = ok and tuple(out.shape) == (3, hidden) and bool(torch.isfinite(out.float()).all())
            outcome.append((hidden, case, ok))
    return outcome


@pytest.mark.cpu
def test_nvfp4_dispatch_of_zero_or_one_rows_at_unaligned_amax_offsets():
    results = run_ranks(_nvfp4_few_rows_worker, 2, backend="gloo", timeout_s=180)
    for rank_result in results:
        assert all(ok for _, _, ok in rank_result), rank_result


def _results_compare_by_identity_worker(rank, world):
    """Two dispatches' results and handles: == is identity (no ambiguous tensor comparison), and list / set bookkeeping
    of in-flight handles (micro-batches) works."""
    import dataclasses

    import ep_comm
    from ep_comm.backends.nvlink import NVLinkHandle
    with ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference") as buf:
        x = torch.randn(4, 64).to(torch.bfloat16)
        idx = torch.tensor([[0, 1], [2, 3], [1, -1], [0, 3]])
        first, second = (buf.dispatch(x, idx, torch.rand(4, 2)) for _ in range(2))
        for a, b in ((first, second), (first.handle, second.handle)):
            assert a == a and a != b and not (a == b), type(a).__name__
            assert a != dataclasses.replace(a), type(a).__name__  # (a copy with the same fields is another object)
        pending = [first.handle, second.handle]
        pending.remove(second.handle)
        assert pending == [first.handle] and first.handle in {first.handle} and second.handle not in pending
        for result in (first, second):
            buf.combine(torch.zeros(result.num_rows, 64, dtype=torch.bfloat16), result.handle)
    arena = torch.zeros(8, dtype=torch.int32)
    handles = [NVLinkHandle(arena=arena.clone(), sections=(), num_tokens=1, num_rows=1, num_topk=1) for _ in range(2)]
    assert handles[0] != handles[1] and handles.index(handles[1]) == 1
    return "ok"


@pytest.mark.cpu
def test_results_and_handles_compare_by_identity():
    assert run_ranks(_results_compare_by_identity_worker, 1, backend="gloo", timeout_s=120) == ["ok"]
