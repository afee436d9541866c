"""Worker functions run on every rank by tests/harness.run_ranks (many cases per spawn)."""
from __future__ import annotations

import dataclasses
import hashlib
import os

import torch
import torch.distributed as dist

import ep_comm
from ep_comm.types import _map_payload
from format_cases import assert_same_floats
from oracle import Case, expected_combine, expected_dispatch, make_inputs, payload_bytes, run_expert


def _device(backend_kind: str):
    return torch.device("cuda", torch.cuda.current_device()) if backend_kind != "cpu" else torch.device("cpu")


def check_dispatch(case: Case, rank: int, world: int, result, inputs) -> None:
    """Compare a DispatchResult with the oracle: layout, metadata and payload bytes, padding."""
    expected = expected_dispatch(case, rank, world, inputs)
    num_local = case.num_experts // world
    counts = result.num_tokens_per_expert.cpu().tolist()
    offsets = result.expert_offsets.cpu().tolist()
    assert counts == [len(e) for e in expected.entries], (case.name, counts)
    assert offsets[0] == 0
    payload = payload_bytes(result.x, case.dispatch_format).cpu()
    src_rank, src_token = result.src_rank.cpu(), result.src_token.cpu()
    slot, weight = result.topk_slot.cpu(), result.topk_weight.cpu()
    for j in range(num_local):
        start, count = offsets[j], counts[j]
        assert start % case.expert_alignment == 0, (case.name, j, start)
        assert offsets[j + 1] - start == -(-count // case.expert_alignment) * case.expert_alignment
        for i, (s, t, k, w) in enumerate(expected.entries[j]):
            row = start + i
            assert (int(src_rank[row]), int(src_token[row]), int(slot[row])) == (s, t, k), (case.name, j, i)
            assert float(weight[row]) == w, (case.name, j, i)
            assert torch.equal(payload[row], expected.payload_rows[(s, t)]), (case.name, "payload", j, i)
        padding = slice(start + count, offsets[j + 1])
        assert (src_rank[padding] == -1).all() and (src_token[padding] == -1).all() and (slot[padding] == -1).all()
        assert (weight[padding] == 0).all() and (payload[padding] == 0).all(), (case.name, "padding", j)


def run_case(case: Case, rank: int, world: int, backend: str, device, repeat_check: bool = False,
             group=None) -> dict:
    """One case on a Buffer over `group` (None: the world), where this process is rank `rank` of `world`."""
    inputs = [make_inputs(case, r, world) for r in range(world)]
    x, topk_idx, weights = (t.to(device) for t in inputs[rank])
    buf = ep_comm.Buffer(group, hidden=case.hidden, num_experts=case.num_experts, num_topk=case.num_topk,
                         max_tokens_per_rank=case.max_tokens, dispatch_format=case.dispatch_format,
                         combine_format=case.combine_format, expert_alignment=case.expert_alignment,
                         backend=backend)
    hashes = []
    with buf:
        for _ in range(2 if repeat_check else 1):
            result = buf.dispatch(x, topk_idx, weights)
            check_dispatch(case, rank, world, result, inputs)
            expert_out = run_expert(result, case, rank, world).to(device)
            digest = hashlib.sha256()
            for local_reduce in (True, False):
                got = buf.combine(expert_out, result.handle, local_reduce=local_reduce).cpu()
                want = expected_combine(case, rank, world, inputs, local_reduce)
                assert got.dtype == torch.bfloat16 and got.shape == want.shape
                # NaN bits differ between the CPU's and the GPU's conversions (docs/NUMERICS.md): NaN positions are
                # compared, everything else bit for bit (the edge cases' Inf / NaN tokens).
                assert_same_floats(got, want, f"{case.name}: combine(local_reduce={local_reduce}) against the oracle")
                digest.update(got.view(torch.int16).numpy().tobytes())
            hashes.append(digest.hexdigest())
    if repeat_check:
        assert hashes[0] == hashes[1], f"{case.name}: two identical runs differ"
    return {"case": case.name, "hash": hashes[0]}


def standard_cases(world: int, hidden: int = 256):
    uneven = tuple(11 + 5 * r for r in range(world))
    empty = tuple(0 if r == 1 else 9 + r for r in range(world))
    experts = 4 * world
    return [
        Case("nvfp4_s2f6_uniform", hidden, experts, 4, uneven, "uniform"),
        # edge=True: zeros, subnormals, a tiny row with an outlier, +-Inf / NaN and near-bf16-max tokens through each
        # dispatch format and both combine formats (NaN / Inf reach the MXFP8 and BF16 cases' outputs).
        Case("mxfp8_bf16_masked_align4", hidden, experts, 3, uneven, "masked", "mxfp8", "bf16", 4, seed=1, edge=True),
        Case("bf16_bf16_skewed", hidden, experts, 2, uneven, "skewed", "bf16", "bf16", seed=2),
        Case("nvfp4_s2f6_all_to_one_align8", hidden, experts, 2, uneven, "all_to_one", expert_alignment=8, seed=3,
             edge=True),
        Case("nvfp4_bf16_empty_rank", hidden, 8 * world, 2, empty, "uniform", "nvfp4", "bf16", seed=4),
        Case("bf16_s2f6_masked", hidden, experts, 4, uneven, "masked", "bf16", "s2f6", seed=5, edge=True),
        Case("bf16_bf16_order", hidden, experts, 4, uneven, "cancel", "bf16", "bf16", seed=6),
        Case("bf16_s2f6_order", hidden, experts, 4, uneven, "cancel", "bf16", "s2f6", seed=6),
        # The MXFP8 combine: edge rows (NaN / Inf / outliers reach its blocks), masked slots, an empty rank.
        Case("nvfp4_mxfp8_masked_align4", hidden, experts, 4, uneven, "masked", "nvfp4", "mxfp8", 4, seed=8,
             edge=True),
        Case("mxfp8_mxfp8_empty_rank", hidden, 8 * world, 3, empty, "skewed", "mxfp8", "mxfp8", seed=9, edge=True),
    ]


def semantics_worker(rank: int, world: int, backend: str = "reference", device_kind: str = "cpu",
                     hidden: int = 256, group=None, seed_offset: int = 0):
    """Every standard case against the oracle; the first twice (bitwise determinism). group: the Buffers' process
    group (None: the world), of which this process is rank `rank` of `world`. seed_offset: added to every case's
    seed (other inputs, the same cases)."""
    device = _device(device_kind)
    summaries = []
    for index, case in enumerate(standard_cases(world, hidden)):
        case = dataclasses.replace(case, seed=case.seed + seed_offset)
        summaries.append(run_case(case, rank, world, backend, device, repeat_check=(index == 0), group=group))
    summaries.append(identity_roundtrip(rank, world, backend, device, hidden, group, seed_offset))
    return summaries


def ep_groups(world: int, ep_size: int, layout: str):
    """The expert-parallel groups of a data x expert parallel world, as a trainer makes them (new_group is collective:
    every rank makes every group): "blocked" puts ranks [i * ep_size, (i + 1) * ep_size) together (EP inside a node),
    "strided" ranks i, i + D, i + 2D, ... with D = world // ep_size. Returns (the groups, this rank's group, its
    index)."""
    if world % ep_size:
        raise ValueError(f"a world of {world} ranks does not split into EP groups of {ep_size}")
    data_parallel = world // ep_size
    if layout == "blocked":
        members = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(data_parallel)]
    elif layout == "strided":
        members = [list(range(i, world, data_parallel)) for i in range(data_parallel)]
    else:
        raise ValueError(f"layout must be 'blocked' or 'strided', got {layout!r}")
    groups = [dist.new_group(ranks) for ranks in members]
    me = dist.get_rank()
    index = next(i for i, ranks in enumerate(members) if me in ranks)
    return groups, groups[index], index


def ep_groups_worker(rank: int, world: int, ep_size: int, layout: str, backend: str = "reference",
                     device_kind: str = "cpu", hidden: int = 256):
    """The standard cases on Buffers over this rank's expert-parallel group (ep_groups), every group at once, group g
    with its own inputs (seed_offset 100 g, made from the group rank). Returns (g, group rank, semantics_worker's
    summaries): equal to what an EP world of ep_size ranks alone gives with that seed_offset, bitwise, if the Buffer
    numbers peers by group rank and its collectives stay inside the group (rows of another group would change the
    results, as the groups' inputs differ)."""
    _, group, index = ep_groups(world, ep_size, layout)
    group_rank = dist.get_rank(group)
    return index, group_rank, semantics_worker(group_rank, ep_size, backend, device_kind, hidden, group, 100 * index)


_IN_FLIGHT_SCHEDULES = (("D0", "D1", "D2", "C2", "C1", "C0", "C0", "C1", "C2"),  # (D i: dispatch i, C i: combine i)
                        ("D0", "D1", "C0", "D2", "C2", "C1"))


def in_flight_worker(rank: int, world: int, backend: str = "reference", device_kind: str = "cpu",
                     direct_self_min_tokens=None):
    """Several dispatches in flight on one Buffer, as a pipeline schedule's micro-batches have them: three dispatches
    of different inputs (and token counts), and their combines, in the orders of _IN_FLIGHT_SCHEDULES (all dispatches
    first, then the combines in reverse and again in dispatch order; combines between later dispatches). Each result
    must still be what the oracle says when its first combine comes, after later dispatches, and every combine, of an
    earlier handle too, must give the oracle's output bit for bit: a handle carries all its combine needs.
    direct_self_min_tokens (nvlink): EP_COMM_DIRECT_SELF_MIN_TOKENS for these Buffers (0: the send stores the rank's
    own NVFP4 rows straight into its output at any size; the default does so from 2048 tokens, more than these)."""
    device = _device(device_kind)
    saved_env = os.environ.get("EP_COMM_DIRECT_SELF_MIN_TOKENS")
    if direct_self_min_tokens is not None:
        os.environ["EP_COMM_DIRECT_SELF_MIN_TOKENS"] = str(direct_self_min_tokens)
    try:
        bases = [Case("in_flight_nvfp4_s2f6", 256, 4 * world, 4, (), "uniform", expert_alignment=4),
                 Case("in_flight_bf16_masked", 256, 4 * world, 3, (), "masked", "bf16", "bf16", edge=True)]
        for base, schedule in ((base, schedule) for base in bases for schedule in _IN_FLIGHT_SCHEDULES):
            cases = [dataclasses.replace(base, seed=20 + i, tokens=tuple(12 + 3 * r - 4 * i for r in range(world)))
                     for i in range(3)]
            inputs = [[make_inputs(case, r, world) for r in range(world)] for case in cases]
            with ep_comm.Buffer(None, hidden=base.hidden, num_experts=base.num_experts, num_topk=base.num_topk,
                                max_tokens_per_rank=max(case.max_tokens for case in cases),
                                dispatch_format=base.dispatch_format, combine_format=base.combine_format,
                                expert_alignment=base.expert_alignment, backend=backend) as buf:
                results, expert_outs = {}, {}
                for event in schedule:
                    i = int(event[1])
                    if event[0] == "D":
                        results[i] = buf.dispatch(*(t.to(device) for t in inputs[i][rank]))
                        continue
                    if i not in expert_outs:
                        check_dispatch(cases[i], rank, world, results[i], inputs[i])
                        expert_outs[i] = run_expert(results[i], cases[i], rank, world).to(device)
                    for local_reduce in (True, False):
                        got = buf.combine(expert_outs[i], results[i].handle, local_reduce=local_reduce).cpu()
                        want = expected_combine(cases[i], rank, world, inputs[i], local_reduce)
                        assert_same_floats(got, want, f"{cases[i].name}: micro-batch {i}'s combine in schedule "
                                                      f"{schedule} (local_reduce={local_reduce})")
    finally:
        if saved_env is None:
            os.environ.pop("EP_COMM_DIRECT_SELF_MIN_TOKENS", None)
        else:
            os.environ["EP_COMM_DIRECT_SELF_MIN_TOKENS"] = saved_env
    return "in flight ok"


def identity_roundtrip(rank: int, world: int, backend: str, device, hidden: int, group=None,
                       seed_offset: int = 0) -> dict:
    """Identity routing, unit weights: combine(dispatch(x)) == x for bf16, within the format error otherwise."""
    errors = {}
    # Relative L2 bounds: the dispatch format's error plus the combine's (Gaussian rows; MXFP8's 3 mantissa bits
    # give ~3% per quantization, S2F6 after the RHT ~1%).
    bounds = {("bf16", "bf16"): 0.0, ("nvfp4", "s2f6"): 0.12, ("mxfp8", "s2f6"): 0.05, ("bf16", "mxfp8"): 0.05,
              ("nvfp4", "mxfp8"): 0.13}
    for dispatch_format, combine_format in bounds:
        case = Case("identity", hidden, 2 * world, 1, tuple(64 for _ in range(world)), "uniform",
                    dispatch_format, combine_format, unit_weights=True, seed=7 + seed_offset)
        x, topk_idx, weights = (t.to(device) for t in make_inputs(case, rank, world))
        with ep_comm.Buffer(group, hidden=hidden, num_experts=case.num_experts, num_topk=1, max_tokens_per_rank=64,
                            dispatch_format=dispatch_format, combine_format=combine_format,
                            backend=backend) as buf:
            result = buf.dispatch(x, topk_idx, weights)
            if dispatch_format == "bf16":
                expert_out = result.x
            elif dispatch_format == "nvfp4":
                expert_out = ep_comm.formats.nvfp4_dequantize(result.x, dtype=torch.bfloat16)
            else:
                expert_out = ep_comm.formats.mxfp8_dequantize(result.x, dtype=torch.bfloat16)
            y = buf.combine(expert_out, result.handle)
        if (dispatch_format, combine_format) == ("bf16", "bf16"):
            assert torch.equal(y.view(torch.int16), x.view(torch.int16)), "bf16 identity round trip is not exact"
        error = ((y.float() - x.float()).norm() / x.float().norm()).item()
        bound = bounds[(dispatch_format, combine_format)]
        assert error <= bound, f"identity {dispatch_format}/{combine_format}: relative error {error:.4f} > {bound}"
        errors[f"{dispatch_format}/{combine_format}"] = error
    return {"case": "identity", "errors": errors}


def _expect(error_type, text, fn):
    try:
        fn()
    except error_type as error:
        assert text in str(error), f"expected {text!r} in {error!r}"
        return
    raise AssertionError(f"expected {error_type.__name__} containing {text!r}")


def errors_worker(rank: int, world: int, backend: str = "reference", device_kind: str = "cpu"):
    """Bad input gives clear errors on every rank (and no rank hangs)."""
    device = _device(device_kind)
    hidden, experts, topk = 64, 4 * world, 2
    _expect(ValueError, "multiple of 32", lambda: ep_comm.Buffer(
        None, hidden=48, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend))
    _expect(ValueError, "differ between", lambda: ep_comm.Buffer(
        None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend,
        dispatch_format="nvfp4" if rank == 0 else "mxfp8"))
    # The nvlink backend's environment too (read between its collectives at creation): compared, not left to hang.
    if world > 1:
        saved = os.environ.pop("EP_COMM_SYNC_CHECK", None)
        try:
            if rank == 0:
                os.environ["EP_COMM_SYNC_CHECK"] = "yes"  # malformed, and on one rank only
            _expect(ValueError, "EP_COMM_SYNC_CHECK", lambda: ep_comm.Buffer(
                None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend))
        finally:
            os.environ.pop("EP_COMM_SYNC_CHECK", None)
            if saved is not None:
                os.environ["EP_COMM_SYNC_CHECK"] = saved
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                         backend=backend)
    x = torch.randn(4, hidden, device=device).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [-1, -1]], device=device)
    w = torch.rand(4, topk, device=device)
    _expect(TypeError, "bfloat16", lambda: buf.dispatch(x.float(), idx, w))
    _expect(ValueError, "[num_tokens, 64]", lambda: buf.dispatch(x[:, :32], idx, w))
    _expect(ValueError, "max_tokens_per_rank", lambda: buf.dispatch(
        torch.zeros(9, hidden, dtype=torch.bfloat16, device=device), torch.zeros(9, topk, dtype=torch.int64,
                                                                                   device=device),
        torch.zeros(9, topk, device=device)))
    _expect(ValueError, "must be in [-1", lambda: buf.dispatch(x, idx + experts, w))
    _expect(ValueError, "must be in [-1", lambda: buf.dispatch(x, idx - 1, w))
    _expect(ValueError, "same expert", lambda: buf.dispatch(x, torch.tensor([[0, 0], [2, 3], [1, -1], [-1, -1]],
                                                                             device=device), w))
    duplicate = torch.tensor([[3, 3], [2, 3], [1, -1], [-1, -1]], device=device)
    _expect(ValueError, "same expert", lambda: buf.dispatch(x, duplicate, w, check_inputs=True))  # per call too
    unchecked = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                               backend=backend, check_inputs=False)
    _expect(ValueError, "same expert", lambda: unchecked.dispatch(x, duplicate, w, check_inputs=True))
    unchecked.destroy()
    _expect(TypeError, "torch.cuda.Stream", lambda: buf.dispatch(x, idx, w, comm_stream="side"))
    _expect(TypeError, "torch.cuda.Event", lambda: buf.dispatch(x, idx, w, done_event=object()))
    _expect(TypeError, "int32 or int64", lambda: buf.dispatch(x, idx.float(), w))
    _expect(TypeError, "float32", lambda: buf.dispatch(x, idx, w.double()))
    _expect(ValueError, "topk_idx must be", lambda: buf.dispatch(x, idx[:, :1], w))
    result = buf.dispatch(x, idx, w)
    _expect(ValueError, "expert_out must be", lambda: buf.combine(
        torch.zeros(result.num_rows + 1, hidden, dtype=torch.bfloat16, device=device), result.handle))
    _expect(TypeError, "bfloat16", lambda: buf.combine(
        torch.zeros(result.num_rows, hidden, device=device), result.handle))
    y = buf.combine(torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device), result.handle)
    assert y.shape == (4, hidden) and not y.float().abs().any()
    _expect(TypeError, "result.handle", lambda: buf.combine(
        torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device), result))
    _expect(TypeError, "handle", lambda: buf.combine(
        torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device), None))
    other = ep_comm.Buffer(None, hidden=hidden, num_experts=2 * experts, num_topk=topk, max_tokens_per_rank=8,
                           backend=backend)
    foreign = other.dispatch(x, idx, w)
    _expect(ValueError, "another Buffer", lambda: buf.combine(
        torch.zeros(foreign.num_rows, hidden, dtype=torch.bfloat16, device=device), foreign.handle))
    other.combine(torch.zeros(foreign.num_rows, hidden, dtype=torch.bfloat16, device=device), foreign.handle)
    other.destroy()
    _expect(TypeError, "local_reduce must be a bool", lambda: buf.combine(
        torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device), result.handle, local_reduce=None))
    # The dispatch keeps its own weights: the caller may reuse (here: zero) its weights tensor before the combine, and
    # combine(local_reduce=False), which applies them on the source rank, still uses the dispatched values.
    reused = w.clone()
    kept = buf.dispatch(x, idx, reused)
    rows_out = torch.randn(kept.num_rows, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    before = buf.combine(rows_out.to(device), kept.handle, local_reduce=False)
    reused.zero_()
    after = buf.combine(rows_out.to(device), kept.handle, local_reduce=False)
    assert before.float().abs().sum() > 0 and torch.equal(before.view(torch.int16), after.view(torch.int16)), \
        "combine(local_reduce=False) used weights changed after the dispatch"
    # Different combine arguments on different ranks: every rank raises (no abort of the process group).
    if world > 1:
        _expect(ValueError, "differ between ranks", lambda: buf.combine(
            torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device), result.handle,
            local_reduce=(rank == 0)))
        if backend == "reference":
            # The handles of two dispatches with the same row counts (the same routing, other experts would do too)
            # on different ranks: every rank raises instead of combining mismatched rows. (nvlink: not detected.)
            again = buf.dispatch(x, idx, w)
            for local_reduce in (True, False):
                _expect(ValueError, "from the handle of another dispatch", lambda: buf.combine(
                    torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device),
                    (result if rank == 0 else again).handle, local_reduce=local_reduce))
            # Two same-size Buffers (say two MoE layers), one dispatch each: equal configurations and call counts, so
            # only the Buffers' tags tell their handles apart. One Buffer's handle on every rank is fine; mixed, every
            # rank raises.
            twins = [ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                                    backend=backend) for _ in range(2)]
            firsts = [twin.dispatch(x, idx, w) for twin in twins]
            rows = torch.zeros(firsts[0].num_rows, hidden, dtype=torch.bfloat16, device=device)
            _expect(ValueError, "another dispatch or Buffer", lambda: twins[0].combine(
                rows, firsts[0 if rank == 0 else 1].handle))
            for first in firsts:
                assert twins[0].combine(rows, first.handle).shape == (4, hidden)
            for twin in twins:
                twin.destroy()
    # Forward-only: inputs that need grad are refused (not silently cut out of backward); no_grad works.
    _expect(RuntimeError, "no autograd", lambda: buf.dispatch(x.clone().requires_grad_(), idx, w))
    _expect(RuntimeError, "no autograd", lambda: buf.dispatch(x, idx, w.clone().requires_grad_()))
    with torch.no_grad():
        buf.dispatch(x.clone().requires_grad_(), idx, w)
    _expect(RuntimeError, "no autograd", lambda: buf.combine(
        torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device).requires_grad_(), result.handle))
    # Inputs rejected on one rank only: every rank raises (no rank left waiting in the exchange).
    one_bad = idx.clone()
    if rank == world - 1:
        one_bad[0, 0] = experts + 5
    _expect(ValueError, "must be in [-1" if rank == world - 1 else f"rejected on rank(s) [{world - 1}]",
            lambda: buf.dispatch(x, one_bad, w))
    last = rank == world - 1
    if backend == "reference" and world > 1:
        # The same for a combine or an autograd input rejected on one rank; and a per-call check_inputs that differs
        # between ranks still meets in the same collectives. The Buffer works on afterwards.
        wrong_out = torch.zeros(result.num_rows, hidden, dtype=torch.float32 if last else torch.bfloat16, device=device)
        _expect(TypeError if last else ValueError, "bfloat16" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.combine(wrong_out, result.handle))
        grad_x = x.clone().requires_grad_() if last else x
        _expect(RuntimeError if last else ValueError, "no autograd" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.dispatch(grad_x, idx, w))
        mixed = buf.dispatch(x, idx, w, check_inputs=(rank == 0))
        assert mixed.num_rows == result.num_rows
        # A local_reduce that is not a bool on one rank: every rank raises, none waits in the combine's exchange.
        _expect(TypeError if last else ValueError,
                "local_reduce must be a bool" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.combine(torch.zeros(mixed.num_rows, hidden, dtype=torch.bfloat16, device=device),
                                    mixed.handle, local_reduce=None if last else True))
        # So do dispatch arguments: expand not a bool, a check_inputs that is not a bool, a tensor on a device
        # this group's collectives cannot take (meta here). Every rank raises in the same call, so the Buffer's next
        # call still meets on every rank (the last line).
        _expect(TypeError if last else ValueError, "expand must be a bool" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.dispatch(x, idx, w, expand=1 if last else True))
        _expect(TypeError if last else ValueError,
                "check_inputs must be None or a bool" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.dispatch(x, idx, w, check_inputs=torch.ones(2) if last else None))
        meta_x = torch.empty_like(x, device="meta") if last else x
        _expect(ValueError, "reference backend over" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.dispatch(meta_x, idx.to(meta_x.device), w.to(meta_x.device)))
        meta_out = torch.empty(mixed.num_rows, hidden, dtype=torch.bfloat16, device="meta" if last else device)
        _expect(ValueError, "reference backend over" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.combine(meta_out, mixed.handle))
        # A sparse tensor on one rank (it would fail inside the backend on that rank alone): refused together.
        for field in range(3):
            args = [x, idx, w]
            if last:
                args[field] = args[field].to_sparse()
            _expect(TypeError if last else ValueError,
                    "must be a dense (strided) tensor" if last else f"rejected on rank(s) [{world - 1}]",
                    lambda: buf.dispatch(*args))
        rows_out = torch.zeros(mixed.num_rows, hidden, dtype=torch.bfloat16, device=device)
        _expect(TypeError if last else ValueError,
                "expert_out must be a dense" if last else f"rejected on rank(s) [{world - 1}]",
                lambda: buf.combine(rows_out.to_sparse() if last else rows_out, mixed.handle))
        assert buf.dispatch(x, idx, w).num_rows == mixed.num_rows
        # A Buffer destroyed on one rank only (a program error): that rank says so, the others raise at once instead
        # of waiting out timeout_s in the agreement.
        lone = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                              backend=backend)
        lone_result = lone.dispatch(x, idx, w)
        if last:
            lone.destroy()
        for call in (lambda: lone.dispatch(x, idx, w),
                     lambda: lone.combine(torch.zeros(lone_result.num_rows, hidden, dtype=torch.bfloat16,
                                                      device=device), lone_result.handle)):
            _expect(RuntimeError if last else ValueError, "destroyed" if last else f"rejected on rank(s) [{world - 1}]",
                    call)
        lone.destroy()
    # Without the check, ids outside [0, E) are masked slots (as on nvlink): the same result as -1 there.
    unchecked = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                               backend=backend, check_inputs=False)
    far = idx.clone()
    far[0, 1], far[1, 0] = experts + 5, -7
    masked = idx.clone()
    masked[0, 1], masked[1, 0] = -1, -1
    got, want = unchecked.dispatch(x, far, w), unchecked.dispatch(x, masked, w)
    assert torch.equal(got.num_tokens_per_expert, want.num_tokens_per_expert)
    assert torch.equal(payload_bytes(got.x, "nvfp4"), payload_bytes(want.x, "nvfp4"))
    unchecked.destroy()
    buf.destroy()
    _expect(RuntimeError, "destroyed", lambda: buf.dispatch(x, idx, w))
    # Arguments are compared across ranks before they are validated: an invalid or different value on one rank
    # raises on every rank; so do a different backend or format_impl.
    _expect(ValueError, "differ between", lambda: ep_comm.Buffer(
        None, hidden=48 if rank == world - 1 else hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
        backend=backend))
    _expect(ValueError, "differ between", lambda: ep_comm.Buffer(
        None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
        backend=backend if rank == 0 else "auto"))
    _expect(ValueError, "differ between", lambda: ep_comm.Buffer(
        None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend,
        format_impl="auto" if rank == 0 else "reference"))
    _expect(ValueError, "differ between", lambda: ep_comm.Buffer(
        None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend,
        check_inputs=(rank == 0)))
    _expect(ValueError, "format_impl", lambda: ep_comm.Buffer(
        None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend,
        format_impl="fast"))
    if device_kind == "cpu":  # the CUDA quantizers on a gloo group (CPU tensors): refused when built, not per call
        _expect(ValueError, "format_impl='cuda' needs", lambda: ep_comm.Buffer(
            None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, backend=backend,
            format_impl="cuda"))
    dist.barrier()
    return "errors ok"


def scaling_worker(rank: int, world: int, backend: str = "reference", device_kind: str = "cpu"):
    """Two cases at any world size (used for EP8 on CPU and EP4/EP8 on GPUs)."""
    device = _device(device_kind)
    tokens = tuple(7 + 3 * r for r in range(world))
    cases = [Case("scale_nvfp4_s2f6", 128, 4 * world, 4, tokens, "uniform", expert_alignment=2),
             Case("scale_bf16_masked", 128, 2 * world, 2, tokens, "masked", "bf16", "bf16", seed=9)]
    return [run_case(case, rank, world, backend, device) for case in cases]


def comm_stream_worker(rank: int, world: int, backend: str = "reference"):
    """dispatch and combine on a communication stream (CUDA), each checked where a missing mechanism would show:
    * ordering after the current stream: the input is written there behind a long sleep just before the dispatch
      (without the wait, the dispatch would read stale data);
    * the current stream does not wait for the comm stream (nvlink backend): with the comm stream held back by a
      sleep, an event recorded on the current stream right after the dispatch completes while the dispatch has not
      (a Buffer that made the current stream wait for the comm stream would fail this);
    * the input's mark for the caching allocator: the comm stream is held back by a sleep, the input is freed on
      the current stream and its memory handed out and filled there (without the mark, the dispatch would read the
      fill);
    * the Buffer's own calls stay in call order across streams: a comm-stream call held back by a sleep on rank 0
      only, then a current-stream call with other inputs. Unordered, rank 0 would run them in the other order than
      the other ranks, and the two calls' results would mix (or the call would time out);
    * two CUDA-graph captures in a row (nvlink backend), the first ending with a comm-stream combine: the second
      capture's first call does not wait on the first capture's event (CUDA refuses it);
    * a combine on another current stream than its dispatch's, held back by a sleep, after the dispatch result was
      dropped and its memory refilled on the dispatch's stream: the handle's memory stays reserved;
    and the results are bitwise those of the same calls on the current stream. check_inputs=False: no host sync
    (which would order the streams by itself). The reference backend reads its split sizes on the host in every call,
    which waits for the comm stream and so orders the streams by itself: there only the ordering after the current
    stream and bitwise equality can show a fault; the other parts need the nvlink backend (test_nvlink_comm_stream)."""
    device = _device("cuda")
    hidden, experts, topk, tokens = 2048, 8 * world, 4, 96
    sleep_cycles = 200_000_000  # ~0.1 s at H200 clocks
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                         backend=backend, check_inputs=False)
    try:
        x, idx, w = make_inputs(Case("comm_stream", hidden, experts, topk, (tokens,) * world, "uniform", seed=17),
                                rank, world, device)
        want = buf.dispatch(x, idx, w)
        x_other = (x.float() * -0.5).to(x.dtype)  # other bits for the ordering check (part 4)
        want_other = buf.dispatch(x_other, idx, w)
        gen = torch.Generator().manual_seed(17 + rank)
        expert_out = (torch.randn(want.num_rows, hidden, generator=gen) * 2).to(torch.bfloat16).to(device)
        want_y = buf.combine(expert_out, want.handle)
        torch.cuda.synchronize()
        fmt = buf.config.dispatch_format
        rows = int(want.expert_offsets[-1])

        def same(got, name, expected=want):
            assert torch.equal(got.expert_offsets, expected.expert_offsets), f"{name}: offsets"
            assert torch.equal(got.src_token[:rows], expected.src_token[:rows]), f"{name}: src_token"
            assert torch.equal(payload_bytes(got.x, fmt)[:rows], payload_bytes(expected.x, fmt)[:rows]), \
                f"{name}: payload"

        side = torch.cuda.Stream(device=device)
        # 1. ordered after the current stream's earlier work.
        xs = torch.zeros_like(x)
        torch.cuda._sleep(sleep_cycles)
        xs.copy_(x)
        dispatched = torch.cuda.Event()
        got = buf.dispatch(xs, idx, w, comm_stream=side, done_event=dispatched)
        torch.cuda.current_stream().wait_event(dispatched)
        same(got, "comm stream, after the current stream's copy")
        torch.cuda.synchronize()
        # 2. the current stream goes on while the comm stream is busy. Not observable on the reference backend: its
        # dispatch reads the split sizes on the host, so it returns only once the comm stream has run.
        if backend == "nvlink":
            with torch.cuda.stream(side):
                torch.cuda._sleep(5 * sleep_cycles)  # ~0.5 s: room for a slow host between enqueue and query
            dispatched = torch.cuda.Event()
            got = buf.dispatch(x, idx, w, comm_stream=side, done_event=dispatched)
            marker = torch.cuda.Event()
            marker.record()
            marker.synchronize()
            assert not dispatched.query(), "the current stream waited for the comm-stream dispatch"
            torch.cuda.current_stream().wait_event(dispatched)
            same(got, "comm stream, current stream not held")
        # 3. the input stays reserved for the comm stream after the caller frees it.
        xs = x.clone()
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
        dispatched = torch.cuda.Event()
        got = buf.dispatch(xs, idx, w, comm_stream=side, done_event=dispatched)
        del xs
        reused = torch.empty_like(x).fill_(7.0)
        torch.cuda.current_stream().wait_event(dispatched)
        same(got, "comm stream, input freed on the current stream")
        combined = torch.cuda.Event()
        y = buf.combine(expert_out, got.handle, comm_stream=side, done_event=combined)
        torch.cuda.current_stream().wait_event(combined)
        assert torch.equal(y.view(torch.int16), want_y.view(torch.int16)), "comm stream: combine"
        # 4. a current-stream call right after a comm-stream call (no wait by the caller): ordered by the Buffer.
        torch.cuda.synchronize()
        if rank == 0:
            with torch.cuda.stream(side):
                torch.cuda._sleep(sleep_cycles)
        first = buf.dispatch(x, idx, w, comm_stream=side)
        second = buf.dispatch(x_other, idx, w)
        torch.cuda.synchronize()
        same(first, "comm-stream call followed by a current-stream call")
        same(second, "current stream right after a comm-stream call", want_other)
        # 5. two calls on two current streams (micro-batches on two streams, no comm_stream): the second is ordered
        # after the first by the Buffer (they share its device state), not run beside it. The first on a side stream,
        # then on the default stream (raw handle 0, which torch.cuda.ExternalStream would turn into a fresh pool
        # stream: an event there orders nothing).
        other = torch.cuda.Stream(device=device)
        for first_stream, where in ((side, "one current stream"), (torch.cuda.current_stream(), "the default stream")):
            torch.cuda.synchronize()
            with torch.cuda.stream(first_stream):
                if rank == 0:
                    torch.cuda._sleep(sleep_cycles)
                first = buf.dispatch(x, idx, w)
            with torch.cuda.stream(other):
                second = buf.dispatch(x_other, idx, w)
                y_other = buf.combine(expert_out, second.handle)
            torch.cuda.synchronize()
            same(first, f"a call on {where} followed by one on another")
            same(second, f"another current stream after a call on {where}", want_other)
            # (the same routing and expert rows as want's: the same bits, whichever dispatch's handle)
            assert torch.equal(y_other.view(torch.int16), want_y.view(torch.int16)), f"combine after {where}"
        # 6. a dispatch without expansion on the comm stream (nvlink: its rows stay in the Buffer's staging area, a
        # region the caching allocator does not own), held back by a sleep; the rows gathered on the current stream
        # after done_event are the expanding dispatch's, and a combine from its handle is too.
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
        dispatched = torch.cuda.Event()
        rows_only = buf.dispatch(x, idx, w, comm_stream=side, done_event=dispatched, expand=False)
        torch.cuda.current_stream().wait_event(dispatched)
        assert rows_only.row_index is not None, "expand=False on the comm stream: no row_index"
        assert torch.equal(rows_only.expert_offsets, want.expert_offsets), "expand=False on the comm stream: offsets"
        assert torch.equal(payload_bytes(rows_only.expert_major_x(), fmt), payload_bytes(want.x, fmt)[:rows]), \
            "expand=False on the comm stream: gathered payload"
        y_rows_only = buf.combine(expert_out, rows_only.handle)
        torch.cuda.synchronize()
        assert torch.equal(y_rows_only.view(torch.int16), want_y.view(torch.int16)), \
            "expand=False on the comm stream: combine"
        # nvlink: its staging rows are this dispatch's only until the next dispatch; gathering them after it raises.
        if backend == "nvlink":
            buf.dispatch(x, idx, w)
            try:
                rows_only.expert_major_x()
                stale = "gathered"
            except RuntimeError as error:
                stale = str(error)
            assert "rows are gone" in stale, f"expand=False result read after the next dispatch: {stale}"
        # 7. reads of such a result enqueued after done_event come before the next dispatch reuses the staging: a read
        # on the comm stream followed by a dispatch on the current stream, and a read on the caller's current stream
        # followed by a dispatch from another current stream. Each read is held back by a sleep and the next dispatch
        # (other rows) is enqueued right behind it: not ordered after the read, it would overwrite the rows first.
        for reader in ("comm stream", "caller's stream"):
            torch.cuda.synchronize()
            dispatched = torch.cuda.Event()
            held = buf.dispatch(x, idx, w, comm_stream=side, done_event=dispatched, expand=False)
            read_stream = side if reader == "comm stream" else torch.cuda.current_stream()
            with torch.cuda.stream(read_stream):
                read_stream.wait_event(dispatched)
                torch.cuda._sleep(sleep_cycles)
                index = held.row_index[:rows].long()
                read = payload_bytes(_map_payload(held.x, lambda t: t[index.clamp(min=0)]), fmt)  # staging: strided
            with torch.cuda.stream(torch.cuda.current_stream() if reader == "comm stream" else other):
                following = buf.dispatch(x_other, idx, w, expand=False)
            torch.cuda.synchronize()
            present = index >= 0
            assert torch.equal(read[present], payload_bytes(want.x, fmt)[:rows][present]), \
                f"expand=False, read on the {reader}: the next dispatch overwrote the rows before the read"
            got_following = payload_bytes(following.expert_major_x(), fmt)
            assert torch.equal(got_following, payload_bytes(want_other.x, fmt)[:rows]), \
                f"expand=False, read on the {reader}: the next dispatch's rows"
        # 8. two CUDA-graph captures, as a server captures one graph per batch size: the first ends with a combine on
        # the comm stream, the second begins with a dispatch on its own capture stream. That dispatch must not wait on
        # the event the first capture recorded (an event of another capture), and both graphs replay, one after the
        # other, to the eager results.
        if backend == "nvlink":
            expert_out_b = (expert_out.float() * -0.5 + 1.0).to(torch.bfloat16)  # graph B's combine: other values
            want_y_other = buf.combine(expert_out_b, buf.dispatch(x_other, idx, w).handle)
            assert not torch.equal(want_y_other.view(torch.int16), want_y.view(torch.int16))
            torch.cuda.synchronize()
            capture_stream = torch.cuda.Stream(device=device)
            graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph_a, stream=capture_stream):
                a_res = buf.dispatch(x, idx, w)
                joined = torch.cuda.Event()
                a_y = buf.combine(expert_out, a_res.handle, comm_stream=side, done_event=joined)
                torch.cuda.current_stream().wait_event(joined)  # side joins back before the capture ends
            with torch.cuda.graph(graph_b, stream=capture_stream):
                b_res = buf.dispatch(x_other, idx, w)
                b_y = buf.combine(expert_out_b, b_res.handle)
            for graph in (graph_a, graph_b, graph_a, graph_b):
                graph.replay()
            torch.cuda.synchronize()
            same(a_res, "graph ending with a comm-stream combine")
            assert torch.equal(a_y.view(torch.int16), want_y.view(torch.int16)), "graph A: comm-stream combine"
            same(b_res, "the next graph's first dispatch", want_other)
            assert torch.equal(b_y.view(torch.int16), want_y_other.view(torch.int16)), "graph B: combine"
            del graph_a, graph_b
        # 9. dispatch on the current stream, combine on another current stream held back by a sleep, and the
        # dispatch result dropped right after on the first stream, its memory handed out and filled there: the Buffer
        # marks the handle's memory in use on the combine's stream (the handle is opaque: the caller cannot), so the
        # combine still reads the routing it was given.
        torch.cuda.synchronize()
        dropped = buf.dispatch(x, idx, w)
        handle_tensors = [(t.shape, t.dtype) for t in ep_comm.buffer._tensors_in(dropped.handle) if t.is_cuda]
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
            y_dropped = buf.combine(expert_out, dropped.handle)
        del dropped
        fills = [torch.full(shape, -7, dtype=dtype, device=device) for shape, dtype in handle_tensors]
        torch.cuda.synchronize()
        assert torch.equal(y_dropped.view(torch.int16), want_y.view(torch.int16)), \
            "combine on another stream after its dispatch result was dropped"
        del fills
        del reused
    finally:
        buf.destroy()
    return "comm stream ok"


def check_finite_worker(rank: int, world: int, backend: str = "reference", device_kind: str = "cpu"):
    """Buffer(check_finite=True): the rows combine reads are exactly the result's rows with a source (src_rank >= 0);
    NaN in a padding row (never read) passes, bitwise the clean combine; Inf in a read row of expert_out, and NaN in
    dispatch's x, raise NonFiniteInputError on the rank holding them, naming the row and column. The peers: the call
    is abandoned on every rank (reference: at once, "rejected on rank(s)"; nvlink: the rank gives up, the peers' kernels
    stop waiting and their check() names it; a fresh Buffer for the dispatch case). Without check_finite the same NaN
    is quantized without an error. Also the argument's type check."""
    import pytest
    device = _device(device_kind)
    hidden, experts, topk, tokens = 64, 4 * world, 2, 6
    sizes = dict(hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8, expert_alignment=4,
                 backend=backend, timeout_s=60.0)
    _expect(TypeError, "check_finite must be a bool", lambda: ep_comm.Buffer(None, check_finite=1, **sizes))
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, topk, generator=gen).to(device)
    nan_x = x.clone()
    nan_x[3, 5] = float("nan")
    last = world - 1

    def peer_stopped(buf, stopped_by):
        """A peer's view of a call that rank `stopped_by` abandoned."""
        if backend == "reference":
            return  # (the agreement itself raised on this rank: see the callers)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=f"rank {stopped_by} gave up"):
            buf._backend.check()

    with ep_comm.Buffer(None, check_finite=False, **sizes) as plain:  # no check: the NaN is quantized, no error
        res = plain.dispatch(nan_x, idx, w)
        plain.combine(torch.zeros(res.num_rows, hidden, dtype=torch.bfloat16, device=device), res.handle)
    buf = ep_comm.Buffer(None, check_finite=True, **sizes)
    try:
        res = buf.dispatch(x, idx, w)
        rows = buf._backend.rows_read_by_combine(res.handle)
        # (nvlink: rows past expert_offsets[-1] are capacity, their metadata never written)
        sourced = torch.nonzero(res.src_rank[:int(res.expert_offsets[-1])] >= 0).flatten()
        assert torch.equal(rows.sort().values.cpu(), sourced.cpu()), (rows.tolist(), sourced.tolist())
        padding = sorted(set(range(res.num_rows)) - set(sourced.tolist()))
        assert padding, "expert_alignment 4 (and nvlink's capacity) leaves rows without a source"
        expert_out = torch.randn(res.num_rows, hidden, generator=gen).to(torch.bfloat16).to(device)
        clean = buf.combine(expert_out, res.handle)
        noisy = expert_out.clone()
        noisy[padding] = float("nan")
        assert torch.equal(buf.combine(noisy, res.handle).view(torch.int16), clean.view(torch.int16))
        bad_row = int(sourced[len(sourced) // 2])
        inf_out = expert_out.clone()
        inf_out[bad_row, 7] = float("inf")
        if rank == 0:
            _expect(ep_comm.NonFiniteInputError, f"expert_out row {bad_row} holds inf at column 7",
                    lambda: buf.combine(inf_out, res.handle))
        elif backend == "reference":
            _expect(ValueError, "rejected on rank(s) [0]", lambda: buf.combine(expert_out, res.handle))
        else:
            buf.combine(expert_out, res.handle)
            peer_stopped(buf, 0)
    finally:
        if backend != "reference":
            torch.cuda.synchronize()
        buf.destroy()
    with ep_comm.Buffer(None, check_finite=True, **sizes) as buf:
        if backend != "reference":
            buf.dispatch(x, idx, w)  # one clean call first: the kernels loaded on every rank
            torch.cuda.synchronize()
            dist.barrier()
        if rank == last:
            _expect(ep_comm.NonFiniteInputError, "x row 3 holds nan at column 5", lambda: buf.dispatch(nan_x, idx, w))
        elif backend == "reference":
            _expect(ValueError, f"rejected on rank(s) [{last}]", lambda: buf.dispatch(x, idx, w))
        else:
            buf.dispatch(x, idx, w)
            peer_stopped(buf, last)
        if backend != "reference":
            torch.cuda.synchronize()
    return "check_finite ok"
