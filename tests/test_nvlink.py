"""The nvlink backend against the reference backend (NCCL) and the single-process oracle: bitwise.

Needs >= 2 GPUs and ep_comm._C (conftest skips otherwise, with the reason). One spawn runs many cases.
Run on the GPU machine:  pytest -m multigpu tests/test_nvlink.py -x -q
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os

import pytest
import torch

from harness import SHARED_GPU, HostReference, multigpu_backend, multigpu_world, run_ranks
from oracle import payload_bytes


def _world() -> int:
    return multigpu_world()


# ----------------------------------------------------------------------------------------------------------
# Helpers (run inside the spawned ranks)
# ----------------------------------------------------------------------------------------------------------
def _make_inputs(rank, num_tokens, hidden, num_experts, topk, routing, world, seed, idx_dtype=torch.int64,
                 edge=False):
    """x bf16 [T, H] (randn with scattered x30 spikes), topk_idx, topk_weights on this rank's GPU. edge: the first token
    rows get special values that every send quantizer (NVFP4 4/6 in registers, MXFP8 in the send or, for the rank's own
    tokens, in the receive) must treat as the reference does -- all +0, all -0, bf16 subnormals, values near the bf16
    maximum, scattered +-Inf and NaN, and one outlier in a row of tiny values."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen)
    if num_tokens:
        spikes = torch.randint(0, x.numel(), (max(1, x.numel() // 300),), generator=gen)
        x.view(-1)[spikes] *= 30.0
    if edge and num_tokens >= 6:
        x[0] = 0.0
        x[1] = -0.0
        x[2] = torch.randn(hidden, generator=gen).sign() * 3e-39 * torch.rand(hidden, generator=gen)
        x[3] = torch.randn(hidden, generator=gen).sign() * 3.3e38
        specials = torch.tensor([float("inf"), float("-inf"), float("nan")])
        where = torch.randint(0, hidden, (max(3, hidden // 64),), generator=gen)
        x[4, where] = specials[torch.arange(where.numel()) % 3]
        x[5] = torch.randn(hidden, generator=gen) * 1e-3
        x[5, hidden // 3] = 1e4
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if routing == "all_to_one":
        scores[:, num_experts // world:] = -1.0
    idx = scores.topk(topk, dim=1).indices
    if routing == "rank_edges" and num_tokens:
        # Each token holds experts at the edges of the ranks' expert ranges (first and last of each rank; a random subset
        # when there are more than K) in random slots, the other slots masked: the layout's "an earlier slot goes to
        # the same rank" test meets both sides of every range boundary, after and before masked slots.
        per_rank = num_experts // world
        edges = torch.tensor(sorted({e for d in range(world) for e in (d * per_rank, (d + 1) * per_rank - 1)}))
        used = min(topk, edges.numel())
        idx = torch.full((num_tokens, topk), -1, dtype=torch.long)
        for t in range(num_tokens):
            slots = torch.randperm(topk, generator=gen)[:used]
            idx[t, slots] = edges[torch.randperm(edges.numel(), generator=gen)[:used]]
    if routing == "masked" and num_tokens:
        mask = torch.rand(num_tokens, topk, generator=gen) < 0.3
        mask[0] = True
        idx = torch.where(mask, torch.full_like(idx, -1), idx)
    weights = torch.rand(num_tokens, topk, generator=gen) + 0.05
    dev = torch.device("cuda", torch.cuda.current_device())
    return x.to(torch.bfloat16).to(dev), idx.to(idx_dtype).to(dev), weights.to(dev)


def _compare_dispatch(name, got, want, fmt):
    assert torch.equal(got.num_tokens_per_expert.cpu(), want.num_tokens_per_expert.cpu()), (name, "counts")
    assert torch.equal(got.expert_offsets.cpu(), want.expert_offsets.cpu()), (name, "offsets")
    rows = int(want.expert_offsets[-1])
    assert got.num_rows >= rows
    for field in ("src_rank", "src_token", "topk_slot"):
        assert torch.equal(getattr(got, field)[:rows].cpu(), getattr(want, field).cpu()), (name, field)
        assert bool((getattr(got, field)[rows:] == -1).all()), (name, field, "unused rows")
    assert torch.equal(got.topk_weight[:rows].view(torch.int32).cpu(), want.topk_weight.view(torch.int32).cpu()), \
        (name, "topk_weight")
    got_bytes = payload_bytes(got.x, fmt)[:rows].cpu()
    want_bytes = payload_bytes(want.x, fmt).cpu()
    if not torch.equal(got_bytes, want_bytes):
        bad = (got_bytes != want_bytes).any(dim=1).nonzero().reshape(-1)[:5].tolist()
        raise AssertionError(f"{name}: payload differs from the reference in rows {bad}")
    return rows


def _expert_out(rows_valid, capacity, hidden, seed, rank, edge=False):
    """Random bf16 expert rows (the first rows_valid of capacity). edge: some rows get special values -- all +0, all
    -0, bf16 subnormals, values near the bf16 maximum (times a top-k weight above 1 they overflow to Inf in fp32), and
    scattered +-Inf and NaN -- so that the combine's zero, overflow and NaN handling is compared with the reference
    too."""
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    valid = torch.randn(rows_valid, hidden, generator=gen) * 2.0
    if edge and rows_valid:
        special = [torch.zeros(hidden), torch.full((hidden,), -0.0),
                   torch.randn(hidden, generator=gen).sign() * 3e-39 * torch.rand(hidden, generator=gen),
                   torch.randn(hidden, generator=gen).sign() * 3.3e38]
        for i, row in enumerate(special):
            valid[(7 * i + seed) % rows_valid] = row
        spots = torch.randint(0, valid.numel(), (max(3, valid.numel() // 5000),), generator=gen)
        values = torch.tensor([float("inf"), float("-inf"), float("nan")])
        valid.view(-1)[spots] = values[torch.arange(spots.numel()) % 3]
    valid = valid.to(torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    padded = torch.zeros(capacity, hidden, dtype=torch.bfloat16)
    padded[:rows_valid] = valid
    return valid.to(dev), padded.to(dev)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).cpu()


def _buffers(hidden, num_experts, topk, max_tokens, dfmt, cfmt, align, num_sms=24, timeout_s=20.0,
             num_local_sms=0, sign_mask=None):
    """(reference Buffer, nvlink Buffer) with the same settings; sign_mask: both Buffers' rht_sign_mask (None:
    default)."""
    import ep_comm
    common = dict(hidden=hidden, num_experts=num_experts, num_topk=topk, max_tokens_per_rank=max_tokens,
                  dispatch_format=dfmt, combine_format=cfmt, expert_alignment=align)
    if sign_mask is not None:
        common["rht_sign_mask"] = sign_mask
    ref = ep_comm.Buffer(None, backend="reference", **common)
    if SHARED_GPU:
        ref = HostReference(ref)  # gloo group: the reference runs on CPU copies
    nvl = ep_comm.Buffer(None, backend="nvlink", num_sms=num_sms, num_local_sms=num_local_sms, timeout_s=timeout_s,
                         **common)
    return ref, nvl


@contextlib.contextmanager
def _buffer_pair(*args, **kwargs):
    """_buffers(...) as a context: both Buffers destroyed on leaving it (the reference first)."""
    ref, nvl = _buffers(*args, **kwargs)
    try:
        yield ref, nvl
    finally:
        ref.destroy()
        nvl.destroy()


def _run_pair(name, rank, world, ref, nvl, x, idx, w, fmt, seed, edge=False, expand=True, ref_idx=None):
    """Dispatch + combine (both local_reduce modes) on both backends; bitwise equal. Returns a digest. expand=False:
    the nvlink dispatch hands out its staging rows and row_index; their gather is compared with the reference.
    ref_idx: the reference dispatches these ids instead, and the nvlink dispatch runs with check_inputs=False.
    Between dispatch and combine the nvlink result's topk_weight is overwritten, as a user may edit it (e.g. normalise
    it in place): the combine must still weight with what dispatch delivered, as the reference's does."""
    want = ref.dispatch(x, idx if ref_idx is None else ref_idx, w)
    got = (nvl.dispatch(x, idx, w, expand=expand) if ref_idx is None
           else nvl.dispatch(x, idx, w, expand=expand, check_inputs=False))
    if not expand:
        assert got.row_index is not None and got.row_index.shape == (got.num_rows,), name
    got = _expert_major(got)
    rows = _compare_dispatch(name, got, want, fmt)
    got.topk_weight.fill_(-3.0)  # the handle keeps its own copy of the weights
    out_ref, out_nvl = _expert_out(rows, got.num_rows, x.shape[1], seed, rank, edge)
    digest = hashlib.sha256()
    for local_reduce in (True, False):
        y_ref = ref.combine(out_ref, want.handle, local_reduce=local_reduce)
        y_nvl = nvl.combine(out_nvl, got.handle, local_reduce=local_reduce)
        bits_ref = _bits(y_ref)
        if isinstance(ref, HostReference):
            # A reference that ran on the CPU writes its NaNs with the CPU's bf16 NaN (0x7FC0 or 0xFFFF: torch's scalar
            # and vectorised conversions differ); the GPU's is 0x7FFF (docs/NUMERICS.md). Only the reference's NaNs
            # are rewritten: ours must still be exactly the GPU's NaN, where the reference has a NaN.
            bits_ref = torch.where(y_ref.cpu().isnan(), torch.full_like(bits_ref, 0x7FFF), bits_ref)
        if not torch.equal(_bits(y_nvl), bits_ref):
            bad = (_bits(y_nvl) != bits_ref).nonzero()[:3].tolist()
            raise AssertionError(f"{name}: combine(local_reduce={local_reduce}) differs in bits at {bad}: "
                                 f"{[hex(int(_bits(y_nvl)[i, j]) & 0xFFFF) for i, j in bad]} vs "
                                 f"{[hex(int(bits_ref[i, j]) & 0xFFFF) for i, j in bad]}")
        digest.update(_bits(y_nvl).numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------------------
def oracle_worker(rank, world):
    """The lead's standard semantic cases (single-process oracle), run on the nvlink backend."""
    from dist_cases import semantics_worker
    return semantics_worker(rank, world, backend="nvlink", device_kind="cuda", hidden=256)


def _direct_self(min_tokens):
    """Buffers created after this take NVFP4's direct self rows from `min_tokens` tokens on (None: the default)."""
    import os
    if min_tokens is None:
        os.environ.pop("EP_COMM_DIRECT_SELF_MIN_TOKENS", None)
    else:
        os.environ["EP_COMM_DIRECT_SELF_MIN_TOKENS"] = str(min_tokens)


def versus_reference_worker(rank, world, direct_self_min_tokens=None):
    """Four format pairs (nvfp4/s2f6, mxfp8/bf16, bf16/s2f6, nvfp4/bf16) at H = 2048/4096/7168, the other pairs (the
    MXFP8 combine among them) and the routing corner cases at smaller H. With direct_self_min_tokens set, the NVFP4
    cases only, with the send storing the rows of each rank at or above that many tokens straight into its output
    (the default keeps them in staging below 2048 tokens)."""
    _direct_self(direct_self_min_tokens)
    cases = []
    for hidden in (2048, 4096, 7168):
        for dfmt, cfmt in (("nvfp4", "s2f6"), ("mxfp8", "bf16"), ("bf16", "s2f6"), ("nvfp4", "bf16")):
            cases.append((hidden, dfmt, cfmt, 1 if hidden != 4096 else 128, "uniform", 16 * world, 8))
    cases += [
        (2048, "nvfp4", "s2f6", 128, "masked", 8 * world, 6),
        (2048, "mxfp8", "s2f6", 1, "all_to_one", 8 * world, 4),
        (7168, "nvfp4", "s2f6", 128, "all_to_one", 64 * world, 8),
        (2080, "mxfp8", "s2f6", 3, "masked", 4 * world, 3),   # H/32 odd, K not a power of two
        # K = 1: one term per token, so the edge rows (+-0, subnormals) reach the combine outputs unmixed
        (2048, "bf16", "bf16", 1, "uniform", 8 * world, 1),
        (2048, "nvfp4", "s2f6", 1, "uniform", 8 * world, 1),
        # experts at the ranks' range edges (the layout's same-rank test); case 18, so no rank is left empty
        (2048, "nvfp4", "s2f6", 1, "rank_edges", 16 * world, 8),
        # row sections whose byte counts are 2 (mod 4): the receive copies them 2 bytes at a time (copy_section)
        (2080, "nvfp4", "s2f6", 16, "masked", 4 * world, 4),  # 130 NVFP4 scale bytes
        (192, "mxfp8", "bf16", 1, "uniform", 8 * world, 2),    # 6 MXFP8 scale bytes
        # the MXFP8 combine: DeepSeek's hidden, then H/32 odd with K not a power of two, and all rows to one rank
        (7168, "nvfp4", "mxfp8", 1, "uniform", 16 * world, 8),
        (2080, "bf16", "mxfp8", 3, "masked", 4 * world, 3),
        (2048, "mxfp8", "mxfp8", 1, "all_to_one", 8 * world, 4),
        (2048, "nvfp4", "mxfp8", 1, "uniform", 8 * world, 1),  # K = 1: the edge values' MXFP8 rows unmixed (+-0, ...)
        # small hidden sizes 32 more than a multiple of 64 (the NVFP4 amax bytes at 9H/16, 2 mod 4), which the nvlink
        # kernels had not run at: all rows to rank 0, so the other ranks receive none (the reference backend's unpack
        # of 0 rows refused that offset until the eighty-first session), then H = 32 with every rank receiving rows
        (96, "nvfp4", "s2f6", 1, "all_to_one", 2 * world, 1),
        (32, "nvfp4", "bf16", 1, "uniform", 2 * world, 2),
    ]
    summary = []
    for case_id, (hidden, dfmt, cfmt, align, routing, experts, topk) in enumerate(cases):
        if direct_self_min_tokens is not None and dfmt != "nvfp4":
            continue
        max_tokens = 96
        tokens = [max_tokens - 37 * r % max_tokens for r in range(world)]
        tokens[world - 1] = 0 if case_id % 3 == 2 else tokens[world - 1]  # an empty rank now and then
        with _buffer_pair(hidden, experts, topk, max_tokens, dfmt, cfmt, align) as (ref, nvl):
            idx_dtype = torch.int32 if case_id % 2 else torch.int64
            for call in range(2):  # second call: buffers reused, new data
                # second call: special token values for the send's (and the own-row receive's) quantizers
                x, idx, w = _make_inputs(rank, tokens[rank], hidden, experts, topk, routing, world,
                                         seed=100 * case_id + call, idx_dtype=idx_dtype, edge=call == 1)
                # special expert-output values: S2F6 and BF16 combines, every K = 1 case
                edge = call == 1 and (case_id % 3 == 0 or topk == 1)
                name = (f"H={hidden} {dfmt}/{cfmt} align={align} {routing} E={experts} K={topk} call={call}"
                        f"{' edge tokens' if call == 1 else ''}{' edge values' if edge else ''}")
                _run_pair(name, rank, world, ref, nvl, x, idx, w, dfmt, seed=case_id, edge=edge)
                summary.append(name)
    return summary


def weight_edges_worker(rank, world):
    """Routing weights at their edges, bitwise against the reference: masked slots holding NaN (a masked slot's weight
    may be anything), selected slots weighted +0, -0 and negative, meeting the special expert outputs (+-Inf and NaN:
    0 * Inf is NaN on both backends); then a call in which no rank has a token, one in which every slot is masked, and
    a plain call after them (the Buffers' epochs and counters stay in step). Five format pairs, both expand modes."""
    hidden, experts, topk, max_tokens = 2048, 8 * world, 4, 48
    for dfmt, cfmt in (("nvfp4", "s2f6"), ("bf16", "bf16"), ("mxfp8", "bf16"), ("bf16", "s2f6"), ("nvfp4", "mxfp8")):
        with _buffer_pair(hidden, experts, topk, max_tokens, dfmt, cfmt, 1) as (ref, nvl):
            for expand in (True, False):
                name = f"{dfmt}/{cfmt} expand={expand}"
                x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "masked", world, seed=83, edge=True)
                w = torch.where(idx < 0, torch.full_like(w, float("nan")), w)
                w[::4, 0], w[1::4, 0], w[2::4, 1] = 0.0, -0.0, -1.5
                _run_pair(f"{name} weight edges", rank, world, ref, nvl, x, idx, w, dfmt, seed=5, edge=True,
                          expand=expand)
                x, idx, w = _make_inputs(rank, 0, hidden, experts, topk, "uniform", world, seed=84)
                _run_pair(f"{name} no tokens anywhere", rank, world, ref, nvl, x, idx, w, dfmt, seed=6,
                          expand=expand)
                x, idx, w = _make_inputs(rank, 16, hidden, experts, topk, "uniform", world, seed=85)
                idx = torch.full_like(idx, -1)
                _run_pair(f"{name} every slot masked", rank, world, ref, nvl, x, idx, w, dfmt, seed=7, expand=expand)
                x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=86)
                _run_pair(f"{name} after them", rank, world, ref, nvl, x, idx, w, dfmt, seed=8, expand=expand)
            nvl._backend.check()
    return "ok"


def block_counts_worker(rank, world, stream_recv=True):
    """Kernels with different grids (send num_sms=3, local phases num_local_sms=5, or 1/2) and calls large
    enough for 63-64 multi-token layout chunks: the per-kernel counters and the chunked layout stay exact. The NVFP4
    case takes direct self rows (a 2-block send: many tokens per warp, one warp per token). One warp per token is
    also what gives rows their row flags: with stream_recv (the default) the receive expands each row as its flag
    arrives, and reads the BF16 self rows from x; without it, the receive waits for the whole send (the
    EP_COMM_NVLINK_STREAM_RECV=0 form, read once per process: the workers are fresh processes)."""
    import os
    os.environ["EP_COMM_NVLINK_STREAM_RECV"] = "1" if stream_recv else "0"
    _direct_self(0)
    summary = []
    # The T = 3000 case: chunks of 46-47 tokens, 368-376 keys over the layout kernel's 8 warps, so most warps rank
    # their keys in two 32-key steps (every other case gives each warp one step at most). The last case: 600 experts per
    # rank, so the receive layout scans them in two rounds of 512 (the second with a short last warp), alignment 3.
    cases = [(256, "bf16", "bf16", 1, 3, 5, 1500, 16), (256, "nvfp4", "s2f6", 16, 1, 2, 1500, 16),
             (512, "mxfp8", "s2f6", 1, 5, 3, 40, 16), (256, "bf16", "s2f6", 1, 4, 6, 3000, 16),
             (256, "nvfp4", "s2f6", 3, 4, 6, 40, 600)]
    for case_id, (hidden, dfmt, cfmt, align, sms, local_sms, max_tokens, experts_per_rank) in enumerate(cases):
        experts, topk = experts_per_rank * world, 8
        tokens = [max_tokens - 101 * r % max_tokens for r in range(world)]
        with _buffer_pair(hidden, experts, topk, max_tokens, dfmt, cfmt, align, num_sms=sms,
                          num_local_sms=local_sms) as (ref, nvl):
            for call in range(3):  # the counters must also agree across calls
                x, idx, w = _make_inputs(rank, tokens[rank], hidden, experts, topk, "masked" if call else "uniform",
                                         world, seed=700 + 10 * case_id + call)
                name = f"blocks {sms}/{local_sms} H={hidden} {dfmt}/{cfmt} align={align} T={tokens[rank]} call={call}"
                _run_pair(name, rank, world, ref, nvl, x, idx, w, dfmt, seed=case_id)
                summary.append(name)
            nvl._backend.check()
    return summary


def _pressure_hash(nvl, x, idx, w, hidden, rank, fmt="nvfp4", alt=None):
    """The same inputs 50 times (dispatch, dispatch again, combine twice per handle) -> one hash (returned, with the
    expert outputs used). alt = (x, idx, w): 100 calls alternating between the two input sets instead, each set one
    hash and the two different -- a call that read rows or counts left by the previous call would give its set a
    second hash, which identical inputs every time would hide."""
    sets = [(x, idx, w)] if alt is None else [(x, idx, w), alt]
    hashes = [set() for _ in sets]
    outs = [None] * len(sets)
    for it in range(50 * len(sets)):
        which = it % len(sets)
        cx, cidx, cw = sets[which]
        res = nvl.dispatch(cx, cidx, cw)
        step = it // len(sets)  # each set's own call count: both sets get the doubled calls below
        if step % 10 == 3:
            res = nvl.dispatch(cx, cidx, cw)  # two dispatches in a row: staging reuse must wait for readers
        if outs[which] is None:
            _, outs[which] = _expert_out(int(res.expert_offsets[-1]), res.num_rows, hidden, 9 + which, rank)
        out = outs[which]
        y1 = nvl.combine(out, res.handle)
        y2 = nvl.combine(out, res.handle, local_reduce=False)
        if step % 10 == 7:
            y1 = nvl.combine(out, res.handle)  # two combines with one handle
        digest = hashlib.sha256(payload_bytes(res.x, fmt)[:int(res.expert_offsets[-1])].cpu().numpy())
        digest.update(_bits(y1).numpy().tobytes())
        digest.update(_bits(y2).numpy().tobytes())
        hashes[which].add(digest.hexdigest())
    for which, found in enumerate(hashes):
        assert len(found) == 1, f"50 identical calls (input set {which}) gave {len(found)} different results"
    if alt is not None:
        assert hashes[0] != hashes[1], "the two input sets gave the same results"
    return next(iter(hashes[0])), outs[0]


def _expert_major(res):
    """res with x in the expert-major layout: itself, or for dispatch(expand=False) its staging rows gathered by
    row_index -- read at once, since they are valid only until the Buffer's next dispatch."""
    return res if res.row_index is None else dataclasses.replace(res, x=res.expert_major_x())


def _graph_matches_eager(nvl, ref, x, idx, w, out, fmt, rank, world, expand=True):
    """Capture dispatch + combine (both local_reduce modes) in a CUDA graph, replay it with new data -- new tokens and
    routing, and new expert outputs for the captured combines: bitwise the eager calls, and the eager dispatch equals
    the reference backend's. expand=False: the rows-only dispatch (the graph's rows are read before the eager call
    reuses the staging area)."""
    tokens, hidden, experts, topk = x.shape[0], x.shape[1], nvl.config.num_experts, idx.shape[1]
    static_x, static_idx, static_w = (t.clone() for t in (x, idx, w))
    static_out = out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator)
            r = nvl.dispatch(static_x, static_idx, static_w, expand=expand)
            nvl.combine(static_out, r.handle)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        g_res = nvl.dispatch(static_x, static_idx, static_w, expand=expand)
        g_y = nvl.combine(static_out, g_res.handle)
        g_y2 = nvl.combine(static_out, g_res.handle, local_reduce=False)
    for trial in range(3):
        nx, nidx, nw = _make_inputs(rank, tokens, hidden, experts, topk, "masked", world, seed=50 + trial)
        static_x.copy_(nx)
        static_idx.copy_(nidx)
        static_w.copy_(nw)
        # New expert outputs too (every row: the replayed dispatch may place its rows elsewhere): the replayed combines
        # must read the captured tensor's current values, which the eager combines below read as well.
        _, new_out = _expert_out(static_out.shape[0], static_out.shape[0], hidden, 70 + trial, rank)
        previous = _bits(static_out)
        static_out.copy_(new_out)
        assert not torch.equal(_bits(static_out), previous), ("graph trial kept the expert outputs", trial)
        graph.replay()
        torch.cuda.synchronize()
        g_rows = _expert_major(g_res)
        g_bits, g_bits2 = _bits(g_y), _bits(g_y2)
        e_res = nvl.dispatch(nx, nidx, nw, expand=expand)
        e_rows = _expert_major(e_res)
        e_y = nvl.combine(static_out, e_res.handle)
        e_y2 = nvl.combine(static_out, e_res.handle, local_reduce=False)
        torch.cuda.synchronize()
        rows = int(e_res.expert_offsets[-1])
        assert torch.equal(g_res.expert_offsets.cpu(), e_res.expert_offsets.cpu()), ("graph offsets", trial)
        assert torch.equal(payload_bytes(g_rows.x, fmt)[:rows].cpu(),
                           payload_bytes(e_rows.x, fmt)[:rows].cpu()), ("graph payload", trial)
        assert torch.equal(g_res.src_token[:rows].cpu(), e_res.src_token[:rows].cpu()), ("graph src", trial)
        assert torch.equal(g_bits, _bits(e_y)), ("graph combine", trial)
        assert torch.equal(g_bits2, _bits(e_y2)), ("graph combine local_reduce=False", trial)
        # and the reference agrees with the eager result
        want = ref.dispatch(nx, nidx, nw)
        _compare_dispatch(f"graph trial {trial}", e_rows, want, fmt)


def streaming_pressure_and_graph_worker(rank, world):
    """Rows with row flags (one warp per token: sends on 2 blocks), expanded by the receive as they arrive, for BF16
    (the receive reads this rank's own rows from x), NVFP4 with direct self rows, NVFP4 with its own rows staged (row
    flags into its own region) and MXFP8: calls alternating between two input sets give one hash per set, calls
    equal the reference backend, and a CUDA-graph replay equals the eager calls. Then calls with new routing each time
    and uneven token counts (256 on one rank, 16 on the other: one send writes row flags, the other splits rows across
    warps and writes none), with x zeroed right after each dispatch is enqueued: the dispatch's last kernel must not
    finish before its send has read x."""
    hidden, experts, topk, max_tokens = 2048, 16 * world, 8, 256
    x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=6)
    alt = _make_inputs(rank, max_tokens, hidden, experts, topk, "masked", world, seed=16)
    # (dispatch format, combine format, send blocks, local blocks, direct self rows from this many tokens or None)
    cases = (("bf16", "bf16", 2, 0, None), ("nvfp4", "s2f6", 2, 2, 0), ("nvfp4", "s2f6", 2, 2, None),
             ("mxfp8", "s2f6", 2, 0, None))
    for dfmt, cfmt, sms, local_sms, direct_self in cases:
        _direct_self(direct_self)
        ref, nvl = _buffers(hidden, experts, topk, max_tokens, dfmt, cfmt, 1, num_sms=sms, num_local_sms=local_sms)
        name = f"streaming {dfmt} direct_self={direct_self}"
        try:
            _, out = _pressure_hash(nvl, x, idx, w, hidden, rank, dfmt, alt=alt)
            _run_pair(name, rank, world, ref, nvl, x, idx, w, dfmt, seed=7)
            for call in range(4):
                tokens = max_tokens if (rank + call) % 2 == 0 else 16
                routing = "masked" if call % 2 else "uniform"
                cx, cidx, cw = _make_inputs(rank, tokens, hidden, experts, topk, routing, world, seed=90 + call)
                want = ref.dispatch(cx.clone(), cidx, cw)
                got = nvl.dispatch(cx, cidx, cw)
                cx.zero_()  # stream-ordered after the dispatch: must not overtake its send
                _compare_dispatch(f"{name} uneven call {call}", got, want, dfmt)
            _graph_matches_eager(nvl, ref, x, idx, w, out, dfmt, rank, world)
            nvl._backend.check()
        finally:
            ref.destroy()
            nvl.destroy()
    _direct_self(None)
    return "ok"


def sync_check_graph_worker(rank, world):
    """EP_COMM_SYNC_CHECK=1 (every eager call synchronizes and checks) leaves CUDA-graph capture alone: dispatch +
    combine captured with it set replay bitwise as the eager calls (a synchronize inside the capture would have
    invalidated it)."""
    import os
    os.environ["EP_COMM_SYNC_CHECK"] = "1"  # every rank: the Buffers compare it
    try:
        hidden, experts, topk, max_tokens = 512, 8 * world, 4, 64
        x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=8)
        with _buffer_pair(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1) as (ref, nvl):
            assert nvl._backend._sync_check
            _, out = _pressure_hash(nvl, x, idx, w, hidden, rank)
            _graph_matches_eager(nvl, ref, x, idx, w, out, "nvfp4", rank, world)
            nvl._backend.check()
    finally:
        os.environ.pop("EP_COMM_SYNC_CHECK", None)
    return "ok"


def _expected_region_kind(world):
    """The symmetric memory an nvlink Buffer must get here, or None where either may be right: CUDA IPC where it is
    forced (EP_COMM_ALLOW_SHARED_GPU=1, the ranks sharing a GPU, or EP_COMM_PEER_MEMORY=ipc); NVSHMEM at world 1 with
    EP_COMM_PEER_MEMORY auto (unset) wherever nvshmem4py imports -- a fallback to CUDA IPC there only warns, which
    would hide an NVSHMEM setup that stopped working. (With more ranks, NVSHMEM may be refused for reasons of the
    machine, e.g. no NVLink between the GPUs, and the fallback is the documented behaviour.)"""
    from ep_comm.backends import nvlink
    if nvlink._shared_gpu_allowed() or nvlink._peer_memory_mode() == "ipc":
        return "ipc"
    if world == 1 and nvlink._peer_memory_mode() == "auto" and nvlink.nvshmem_importable():
        return "nvshmem"
    return None


def _check_region_kind(nvl, world):
    """nvl's symmetric region is of the kind _expected_region_kind names (the fallback's warning in the message)."""
    from ep_comm import _ext
    kind, want = nvl._backend.region.kind, _expected_region_kind(world)
    fallback = [m for m in _ext._warned if "using CUDA IPC peer memory" in m]
    assert want is None or kind == want, f"the nvlink Buffer's symmetric region is {kind!r}, not {want!r}: {fallback}"
    return kind


def _nvshmem_live_allocations():
    """How many NVSHMEM symmetric allocations nvshmem.core holds live in this process, or None where nvshmem.core was
    never imported or its table is not there. NVSHMEM allocates from a heap reserved at its init, so
    torch.cuda.mem_get_info does not see a region leaked there, and nvshmem4py has no public query of the heap's use;
    this reads its own tracker of what nvshmem.core.tensor allocated and free_tensor freed (nvshmem4py 0.4:
    _internal_tracking._mr_references, one NvshmemResource per device whose _mem_references maps each pointer to
    {"type": BufferTypes.NORMAL for an allocation, "freed": ...}). A private table: if a later nvshmem4py drops it,
    this says None and the heap goes unchecked (the region's own state is still checked)."""
    import sys
    if sys.modules.get("nvshmem.core") is None:
        return None
    try:
        from nvshmem.core._internal_tracking import _mr_references
        from nvshmem.core.nvshmem_types import BufferTypes
        live = 0
        for resource in list(_mr_references.values()):
            for entry in list(resource._mem_references.values()):
                live += entry["type"] == BufferTypes.NORMAL and not entry["freed"]
        return live
    except Exception:  # noqa: BLE001 (another nvshmem4py: its table is not there)
        return None


# What pressure_and_graph_worker reports for the memset check where the ranks share a GPU (not profiled there).
_MEMSET_NOT_PROFILED = "not profiled: the ranks share a GPU"


def _memsets_in_steady_state(nvl, x, idx, w, out, calls=3):
    """A torch.profiler trace (CUDA activities) of `calls` dispatch + combine (both local_reduce modes) calls of a
    Buffer already warmed up: the names of its memset events (CUDA runtime calls such as cudaMemsetAsync, device
    activities "Memset (Device)"), which must be none -- the kernels count calls with growing epochs instead of
    resetting flags (csrc/nvlink.h), and every output is a fresh torch.empty. The trace must show the calls' kernels
    (the layout kernel and the combine receive), or it proves nothing. check_inputs=False: the id check is torch's
    sort and reductions, not this backend's protocol."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            res = nvl.dispatch(x, idx, w, check_inputs=False)
            nvl.combine(out, res.handle)
            nvl.combine(out, res.handle, local_reduce=False)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = {e.name for e in events if e.device_type == DeviceType.CUDA}
    for name in ("layout_kernel", "combine_recv_kernel"):
        assert any(name in k for k in kernels), f"the profiler recorded no {name}: {sorted(kernels)[:10]}"
    return sorted({e.name for e in events if "memset" in e.name.lower()})


def pressure_and_graph_worker(rank, world):
    """Races (calls alternating between two input sets, one hash per set) with the NVFP4 self rows staged and stored
    directly by the send (a wait on the peers' counts inside the send): the same hash; no memset in the steady state
    (a profiler trace; not where the ranks share a GPU); graph replay with direct self rows; then Buffer
    create/destroy leaks. Each Buffer's symmetric region is of the kind _expected_region_kind names (at world 1 with
    nvshmem4py: NVSHMEM)."""
    from ep_comm.backends.nvlink import _shared_gpu_allowed
    hidden, experts, topk, max_tokens = 2048, 16 * world, 8, 256
    x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=5)
    alt = _make_inputs(rank, max_tokens, hidden, experts, topk, "masked", world, seed=15)
    results = {}
    _direct_self(None)
    with _buffer_pair(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1) as (ref, nvl):
        results["region"] = _check_region_kind(nvl, world)  # the process's first Buffer: NVSHMEM's init
        staged_hash, _ = _pressure_hash(nvl, x, idx, w, hidden, rank, alt=alt)
    _direct_self(0)
    ref, nvl = _buffers(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1)
    try:
        _check_region_kind(nvl, world)
        results["pressure"], out = _pressure_hash(nvl, x, idx, w, hidden, rank, alt=alt)
        assert results["pressure"] == staged_hash, "direct self rows changed the results"

        _graph_matches_eager(nvl, ref, x, idx, w, out, "nvfp4", rank, world)
        nvl._backend.check()
        results["graph"] = "ok"
        # Steady state (after the pressure calls and the graph's eager calls; the profiler after the capture, not
        # before it). Two processes tracing one time-sliced GPU with CUPTI is not how the profiler is used here: the
        # world-1 and one-rank-per-GPU runs trace the same host path and kernels.
        results["memset"] = _MEMSET_NOT_PROFILED
        if not _shared_gpu_allowed():
            memsets = _memsets_in_steady_state(nvl, x, idx, w, out)
            assert memsets == [], f"memsets in steady-state dispatch / combine calls: {memsets}"
            results["memset"] = "ok"
        nvl._backend.check()
    finally:
        ref.destroy()
        nvl.destroy()
    results["leak"] = _create_destroy_leaks(rank, world)
    return results


def _create_destroy_leaks(rank, world, cycles=24):
    """Create, use and destroy `cycles` nvlink Buffers: torch's allocated memory does not grow, the device's
    free memory (torch.cuda.mem_get_info, after synchronize + empty_cache, every rank settled) drops by less than half
    of one Buffer's symmetric region (the size hint's total_symmetric_bytes), so that a region (CUDA IPC) left behind by
    any one Buffer fails; NVSHMEM's live allocations (_nvshmem_live_allocations: its heap is invisible to
    mem_get_info) are one per live Buffer and back to where they were; and every destroyed backend holds no region, no
    IPC mapping and no host-mapped word -- also while its Buffer object is still referenced (`buf` below). One cycle
    first, unmeasured: the first launches of these kernels' instantiations load their modules.
    The sizes give a 6 MiB region (8 MiB at 8 ranks; the region grows with max_tokens_per_rank, mostly its combine
    area), so that half of it tolerates one stray 2 MiB page of the driver's while a leaked region fails; the calls
    carry 16 tokens only, to keep the cycles short."""
    import gc
    import torch.distributed as dist
    import ep_comm
    hidden, experts, topk, max_tokens, tokens = 2048, 16 * world, 8, 256, 16
    sizes = dict(hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=max_tokens)
    region_bytes = ep_comm.Buffer.get_buffer_size_hint(world_size=world, **sizes).total_symmetric_bytes
    x, idx, w = _make_inputs(rank, tokens, hidden, experts, topk, "uniform", world, seed=25)
    outs = []

    def cycle(live_before):
        with ep_comm.Buffer(None, backend="nvlink", **sizes) as buf:
            region = buf._backend.region
            assert region.nbytes == region_bytes, (region.nbytes, region_bytes)
            live = _nvshmem_live_allocations()
            if region.kind == "nvshmem" and live is not None and live_before is not None:
                # this Buffer's region and nothing left by an earlier one (also the tracker's own check: it sees it)
                assert live == live_before + 1, f"NVSHMEM allocations live: {live}, before the Buffer {live_before}"
            res = buf.dispatch(x, idx, w)
            if not outs:
                outs.append(_expert_out(int(res.expert_offsets[-1]), res.num_rows, hidden, 4, rank)[1])
            buf.combine(outs[0], res.handle)
            buf.combine(outs[0], res.handle, local_reduce=False)
            torch.cuda.synchronize()
            buf._backend.check()
            del res
        backend = buf._backend
        fields = (("region.kind", region.kind), ("NVSHMEM tensor", region._tensor),
                  ("IPC allocation", region._ipc_local), ("host-mapped word", backend._error_host),
                  ("NvlinkContext", backend._ctx))
        held = [name for name, value in fields if value is not None]
        assert not held and region._ipc_opened == [], f"a destroyed Buffer still holds {held} {region._ipc_opened}"

    def settled():
        """(free device bytes, torch's allocated bytes) once every rank's memory has settled; no rank allocates again
        before every rank has read them (the ranks may share the GPU)."""
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
        measured = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
        dist.barrier()
        return measured

    cycle(_nvshmem_live_allocations())
    live_before = _nvshmem_live_allocations()
    free_before, allocated_before = settled()
    for _ in range(cycles):
        cycle(live_before)
    free_after, allocated_after = settled()
    assert allocated_after <= allocated_before, \
        f"torch memory grew by {allocated_after - allocated_before} bytes over {cycles} Buffer create/destroy cycles"
    lost = free_before - free_after
    assert lost < region_bytes // 2, (f"device memory leaked over {cycles} Buffer create/destroy cycles: {lost} bytes "
                                      f"(one Buffer's region: {region_bytes})")
    live_after = _nvshmem_live_allocations()
    assert live_after == live_before, f"NVSHMEM allocations live: {live_after}, before the cycles {live_before}"
    return "ok"


def timeout_worker(rank, world, direct_self=False):
    """Rank 1 skips a dispatch: rank 0's receive (with direct self rows: its send, waiting for rank 1's counts) times
    out and check() names the stage and the peer."""
    import ep_comm
    _direct_self(0 if direct_self else None)
    stage = "dispatch send (waiting for the peer's token counts" if direct_self else "dispatch receive"
    hidden, experts = 256, 4 * world
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=2, max_tokens_per_rank=8,
                         backend="nvlink", timeout_s=0.5)
    try:
        x, idx, w = _make_inputs(rank, 8, hidden, experts, 2, "uniform", world, seed=1)
        if rank == 0:
            # The error surfaces at the latest in check() (at once inside dispatch with EP_COMM_SYNC_CHECK=1).
            with pytest.raises(RuntimeError, match="timed out") as raised:
                buf.dispatch(x, idx, w)
                torch.cuda.synchronize()
                buf._backend.check()
            message = str(raised.value)
            assert "rank 0" in message and stage in message and "peer rank 1" in message, message
            with pytest.raises(RuntimeError, match="timed out"):  # the Buffer stays unusable, loudly
                buf._backend.check()
        torch.cuda.synchronize()
    finally:
        buf.destroy()
    return "ok"


def combine_timeout_worker(rank, world):
    """Both ranks dispatch; rank 1 never combines: rank 0's combine receive times out waiting for rank 1's expert
    outputs, and its error names rank 0, the stage (combine receive), the peer (rank 1) and the call. Rank 1, with
    no call in flight, records no fault, and both destroy their Buffers as usual (rank 1 waits in destroy's barrier
    while rank 0 times out)."""
    import torch.distributed as dist
    import ep_comm
    hidden, experts, tokens = 256, 4 * world, 8
    sizes = dict(hidden=hidden, num_experts=experts, num_topk=2, max_tokens_per_rank=tokens, backend="nvlink")
    x, idx, w = _make_inputs(rank, tokens, hidden, experts, 2, "uniform", world, seed=2)
    # The kernels' first launches (module loading) on a Buffer with a long timeout, not while the short-timeout
    # Buffer's dispatch waits for the peer.
    with ep_comm.Buffer(None, timeout_s=20.0, **sizes) as warm:
        res = warm.dispatch(x, idx, w)
        _, out = _expert_out(int(res.expert_offsets[-1]), res.num_rows, hidden, 3, rank)
        warm.combine(out, res.handle)
        torch.cuda.synchronize()
        del res
    buf = ep_comm.Buffer(None, timeout_s=1.0, **sizes)
    try:
        torch.cuda.synchronize()
        dist.barrier()  # the dispatch starts together on both ranks: only the combine below may exceed timeout_s
        res = buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        buf._backend.check()  # the dispatch completed on both ranks
        dist.barrier()
        message = None
        if rank == 0:
            # The error surfaces at the latest in check() (at once inside combine with EP_COMM_SYNC_CHECK=1). Caught,
            # not raised, so that both ranks reach the barrier below whatever happens here.
            try:
                buf.combine(out, res.handle)
                torch.cuda.synchronize()
                buf._backend.check()
            except RuntimeError as error:
                message = str(error)
        dist.barrier()  # rank 0's combine has given up (or returned)
        if rank == 0:
            assert message is not None, "rank 0's combine returned although rank 1 never combined"
            assert "rank 0 timed out" in message and "(call 1)" in message \
                and "combine receive (waiting for the peer's expert outputs) on peer rank 1" in message, message
            with pytest.raises(RuntimeError, match="timed out"):  # the Buffer stays unusable, loudly
                buf._backend.check()
        else:  # the timeout is rank 0's: rank 1, with nothing in flight, recorded nothing
            assert buf._backend._recorded_fault() is None, buf._backend._recorded_fault()
            buf._backend.check()
        torch.cuda.synchronize()
    finally:
        buf.destroy()
    return "ok"


def stall_worker(rank, world, through_combine=False):
    """Rank 1 stalls on the host for longer than timeout_s between two calls while rank 0 goes on: rank 0's receive of
    dispatch 2 times out, and its next call (already enqueued) must not store into rank 1 or signal it (fail-stop after
    a timeout). Rank 1's dispatch 2 then gets dispatch 2's rows, and its next call times out instead of returning data.
    Tokens carry their call number. The next call is dispatch 3 (which, with a sender that no longer waits, would have
    written over rank 1's unread rows) or, through_combine, combine 2 (both ranks first do dispatch + combine 1: rank
    0's combine 2 then finds every "consumed" flag in, but its inputs are invalid, so it must store nothing -- the
    abort word stops it, not a failed wait)."""
    import os
    import time
    import torch.distributed as dist
    import ep_comm
    hidden, experts, tokens = 256, 4 * world, 8
    # check_inputs=False and no sync check: no host sync inside the calls, so rank 0 enqueues its next call before
    # dispatch 2 gives up (the smoke tier sets EP_COMM_SYNC_CHECK=1, read when the Buffer is made).
    os.environ["EP_COMM_SYNC_CHECK"] = "0"
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=2, max_tokens_per_rank=tokens,
                         dispatch_format="bf16", combine_format="bf16", backend="nvlink", timeout_s=0.5,
                         check_inputs=False)
    try:
        idx = torch.tensor([[0, experts - 1]], device="cuda").repeat(tokens, 1)  # one expert on each rank
        w = torch.ones(tokens, 2, device="cuda")
        calls = {call: torch.full((tokens, hidden), float(call), device="cuda", dtype=torch.bfloat16)
                 for call in (1, 2, 3)}

        def next_call(second):
            return (buf.combine(second.x, second.handle) if through_combine
                    else buf.dispatch(calls[3], idx, w))
        torch.cuda.synchronize()
        dist.barrier()  # call 1 starts together on both ranks: only rank 1's stall below may exceed timeout_s
        first = buf.dispatch(calls[1], idx, w)
        if through_combine:
            buf.combine(first.x, first.handle)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            next_call(buf.dispatch(calls[2], idx, w))  # enqueued before dispatch 2's receive gives up
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match="timed out"):
                buf._backend.check()
            dist.barrier()
            return "ok"
        time.sleep(3.0)
        second = buf.dispatch(calls[2], idx, w)
        torch.cuda.synchronize()
        from_peer = second.src_rank == 0
        assert bool(from_peer.any()), "no row from rank 0"
        values = second.x[from_peer].float()
        assert bool((values == 2.0).all()), f"call 2 got rows of another call: {values.unique().tolist()}"
        with pytest.raises(RuntimeError, match="timed out"):
            next_call(second)
            torch.cuda.synchronize()
            buf._backend.check()
        dist.barrier()
        return "ok"
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def rejected_ids_worker(rank, world):
    """Rank 1's expert ids are rejected (check_inputs) while rank 0's dispatch of the same call is already waiting for
    it: rank 0 must stop waiting at once and name rank 1 (Buffer._validate_together -> give_up), not time out. The
    timeout is long (60 s), so a notice that never arrived shows as a timeout message instead of the one expected.
    Afterwards the Buffer refuses calls on both ranks."""
    import torch.distributed as dist
    import ep_comm
    hidden, experts, tokens = 256, 4 * world, 8
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=2, max_tokens_per_rank=tokens,
                         dispatch_format="bf16", combine_format="bf16", backend="nvlink", timeout_s=60.0)
    try:
        x = torch.ones(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        idx = torch.tensor([[0, experts - 1]], device="cuda").repeat(tokens, 1)
        w = torch.ones(tokens, 2, device="cuda")
        buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            with pytest.raises(ValueError, match="must be in"):
                buf.dispatch(x, idx + experts, w)
            with pytest.raises(RuntimeError, match="gave up after an earlier call raised on this rank"):
                buf.dispatch(x, idx, w)
        else:
            buf.dispatch(x, idx, w)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match="stopped waiting because rank 1 gave up"):
                buf._backend.check()
            with pytest.raises(RuntimeError, match="rank 1 gave up"):  # and stays unusable
                buf.dispatch(x, idx, w)
        dist.barrier()
        return "ok"
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def capacity_fault_worker(rank, world, direct_self=False):
    """check_inputs=False and every token naming one expert in two slots, with top-k above the experts per rank: each
    rank receives more rows than max_recv_rows (sized for min(K, experts per rank) rows per token). The receive must
    write nothing outside its result and record the fault, so that check() raises naming it (it used to write past the
    arena). The dispatch is launched on an arena carved from the middle of a larger tensor (the C++ entry, with the
    table Python uses), so guard words right before and after the arena would show a stray write; two more guard
    tensors are allocated around the call."""
    import ep_comm
    _direct_self(0 if direct_self else None)
    hidden, experts, topk, tokens = 256, 2 * world, 4, 16
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                         backend="nvlink", timeout_s=5.0, check_inputs=False)
    try:
        guard_before = torch.full((1 << 20,), 7, dtype=torch.int32, device="cuda")
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        # Every token: rank 0's two experts, each twice (4 rows for rank 0, whose capacity counts 2 per token).
        idx = torch.tensor([0, 0, 1, 1], device="cuda").repeat(tokens, 1)
        w = torch.rand(tokens, topk, device="cuda")
        guard_after = torch.full((1 << 20,), 7, dtype=torch.int32, device="cuda")
        backend = buf._backend
        words, guard_words = backend._arena_recipe(tokens).words, 1 << 16
        guarded = torch.full((words + 2 * guard_words,), 0x7A7A7A7A, dtype=torch.int32, device="cuda")
        arena = guarded[guard_words:guard_words + words]
        backend._ctx.dispatch_arena(x.data_ptr(), idx.data_ptr(), True, w.data_ptr(), tokens, arena.data_ptr(),
                                    torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        if rank == 0:
            with pytest.raises(RuntimeError, match="outside its result"):
                backend.check()
        assert bool((guarded[:guard_words] == 0x7A7A7A7A).all()), "a write landed right before the arena"
        assert bool((guarded[guard_words + words:] == 0x7A7A7A7A).all()), "a write landed right after the arena"
        assert bool((guard_before == 7).all()) and bool((guard_after == 7).all()), "a write landed outside the result"
        torch.cuda.synchronize()
    finally:
        buf.destroy()
    return "ok"


def rows_worker(rank, world):
    """dispatch(expand=False): the staging rows gathered by row_index equal the reference's expert-major rows, bitwise,
    for every format (special token values included) and alignment, with an empty rank and uneven counts; combine on
    its handle equals the reference. Then expanded and rows-only calls mixed, two rows-only calls in a row (the
    second send must release the first one's staging rows for the peers: else a timeout), one hash; and a CUDA graph of
    a rows-only dispatch + combines replays as the eager calls, which equal the reference."""
    cases = (("nvfp4", "s2f6", 1), ("nvfp4", "bf16", 16), ("mxfp8", "s2f6", 1), ("bf16", "bf16", 8),
             ("bf16", "mxfp8", 4))
    hidden, experts, topk, max_tokens = 2048, 16 * world, 8, 96
    for case_id, (dfmt, cfmt, align) in enumerate(cases):
        tokens = [max_tokens - 37 * r % max_tokens for r in range(world)]
        tokens[world - 1] = 0 if case_id == 1 else tokens[world - 1]
        with _buffer_pair(hidden, experts, topk, max_tokens, dfmt, cfmt, align) as (ref, nvl):
            for call in range(3):
                x, idx, w = _make_inputs(rank, tokens[rank], hidden, experts, topk, "masked" if call else "uniform",
                                         world, seed=200 + 10 * case_id + call, edge=call == 1)
                _run_pair(f"rows {dfmt}/{cfmt} align={align} call={call}", rank, world, ref, nvl, x, idx, w, dfmt,
                          seed=case_id, expand=call == 2)  # rows-only, rows-only (special tokens), expanded
    # Mixed calls, one hash; graph replay.
    with _buffer_pair(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1) as (ref, nvl):
        x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=7)
        hashes, out = set(), None
        for it in range(24):
            expand = it % 3 == 0  # rows-only twice in a row between expanded calls
            res = nvl.dispatch(x, idx, w, expand=expand)
            payload = _expert_major(res).x
            valid = int(res.expert_offsets[-1])
            if out is None:
                _, out = _expert_out(valid, res.num_rows, hidden, 9, rank)
            digest = hashlib.sha256(payload_bytes(payload, "nvfp4")[:valid].cpu().numpy())
            digest.update(_bits(nvl.combine(out, res.handle)).numpy().tobytes())
            hashes.add(digest.hexdigest())
        assert len(hashes) == 1, f"mixed expanded / rows-only calls gave {len(hashes)} different results"
        _graph_matches_eager(nvl, ref, x, idx, w, out, "nvfp4", rank, world, expand=False)
        nvl._backend.check()
    return "ok"


def out_of_range_ids_worker(rank, world):
    """check_inputs=False: expert ids outside [0, E) -- E itself, -5, 2^40 (int64), INT32_MIN / INT32_MAX (int32), a
    token with every slot out of range -- are masked slots in the kernels: dispatch and combine are bitwise the
    reference backend's with those ids set to -1 (docs/NVLINK.md, "check_inputs"), for both id dtypes and an expanded
    and a rows-only dispatch; and nothing is recorded as a fault. The Buffers take a non-default RHT sign vector, which
    the S2F6 combine's forward and inverse RHT must both use to give the reference's bits."""
    hidden, experts, topk, max_tokens = 2048, 8 * world, 4, 32
    with _buffer_pair(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1, sign_mask=0x0F0F5A5A) as (ref, nvl):
        for call, idx_dtype in enumerate((torch.int64, torch.int32)):
            x, idx, w = _make_inputs(rank, max_tokens, hidden, experts, topk, "uniform", world, seed=40 + call,
                                     idx_dtype=idx_dtype)
            bad = idx.clone()
            big = 2**40 if idx_dtype == torch.int64 else 2**31 - 1
            small = -5 if idx_dtype == torch.int64 else -2**31
            bad[0, 0], bad[1, 1], bad[2, topk - 1], bad[3] = experts, small, big, experts + 7
            masked = torch.where((bad < 0) | (bad >= experts), torch.full_like(bad, -1), bad)
            assert int((masked != idx).sum()) == 3 + topk
            _run_pair(f"out-of-range ids {idx_dtype}", rank, world, ref, nvl, x, bad, w, "nvfp4", seed=call,
                      expand=call == 0, ref_idx=masked)
        torch.cuda.synchronize()
        nvl._backend.check()
    return "ok"


def combine_mismatch_worker(rank, world):
    """Combines the ranks do not agree on are found on the device (comb_desc, csrc/nvlink.h): with local_reduce
    different on the ranks, with the handles of two different dispatches, with the handles of two same-size Buffers'
    first dispatches (same call count: the Buffer tag tells them apart), or with one rank combining through the
    combine-row path (begin/finish_combine_rows) while another reduces, every rank raises at its next check naming
    a peer, and the Buffer refuses further calls. Combines that agree raise nothing: one handle combined twice, an older
    handle after a newer dispatch (bitwise the reference's combine of that dispatch), a handle combined on a same-size
    twin Buffer, both local_reduce modes. Also: the handle's dispatch word is the device's call count and the Buffer's
    tag, and the C++ arena table is the one the CPU tests copy (_cpp_arena_layout)."""
    import ep_comm
    hidden, experts, topk, max_tokens = 256, 4 * world, 4, 16
    other = 1 - rank if world == 2 else None
    ref, nvl = _buffers(hidden, experts, topk, max_tokens, "nvfp4", "s2f6", 1, sign_mask=0)  # no signs: an edge
    twin = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=max_tokens,
                          backend="nvlink", timeout_s=20.0, rht_sign_mask=0)
    try:
        cfg = nvl.config
        for rows_only in (False, True):
            for tokens in (0, 5, max_tokens):
                got = nvl._backend._ctx.dispatch_arena_layout(tokens, rows_only)
                want = _cpp_arena_layout(tokens, topk, cfg.max_recv_rows, world, cfg.num_local_experts, max_tokens,
                                         hidden // 2, hidden // 16, True, rows_only)
                assert (list(got[0]), list(got[1]), got[2]) == (list(want[0]), list(want[1]), want[2]), \
                    ("arena table", tokens, rows_only)
        inputs = [_make_inputs(rank, max_tokens, hidden, experts, topk, "masked", world, seed=60 + i) for i in range(2)]
        first = nvl.dispatch(*inputs[0])
        second = nvl.dispatch(*inputs[1])
        torch.cuda.synchronize()
        words = [int(r.handle.dispatch_epoch) for r in (first, second)]
        epoch_mask = (1 << 40) - 1  # dispatch word: epoch in bits 0..39, the Buffer's tag above
        assert words[1] & epoch_mask == (words[0] & epoch_mask) + 1 >= 2, words
        assert words[0] >> 40 == words[1] >> 40 == nvl._backend.buffer_tag != twin._backend.buffer_tag, words
        rows = int(first.expert_offsets[-1])
        out_ref, out = _expert_out(rows, first.num_rows, hidden, 5, rank)
        want = ref.dispatch(*inputs[0])
        for local_reduce in (True, False):
            y_ref = _bits(ref.combine(out_ref, want.handle, local_reduce=local_reduce))
            older = _bits(nvl.combine(out, first.handle, local_reduce=local_reduce))  # after `second` was dispatched
            assert torch.equal(older, y_ref), ("older handle", local_reduce)
            assert torch.equal(_bits(nvl.combine(out, first.handle, local_reduce=local_reduce)), y_ref)
            assert torch.equal(_bits(twin.combine(out, first.handle, local_reduce=local_reduce)), y_ref)
        torch.cuda.synchronize()
        nvl._backend.check()
        twin._backend.check()
    finally:
        ref.destroy()
        twin.destroy()
        nvl.destroy()
    peer = rf"rank {other}" if other is not None else r"rank \d+"
    for case in ("local_reduce", "handles", "buffers", "rows"):
        make = functools.partial(ep_comm.Buffer, None, hidden=hidden, num_experts=experts, num_topk=topk,
                                 max_tokens_per_rank=max_tokens, backend="nvlink", timeout_s=20.0)
        with contextlib.ExitStack() as stack:  # destroys what was made, in reverse order, even if one destroy raises
            buf = make()
            stack.callback(buf.destroy)
            other_buf = buf
            if case == "buffers":
                other_buf = make()
                stack.callback(other_buf.destroy)
            a = buf.dispatch(*inputs[0])
            # "buffers": the same call count on a same-size Buffer -- rank 1 combines that Buffer's handle on `buf`
            b = other_buf.dispatch(*inputs[1])
            zeros = torch.zeros(a.num_rows, hidden, dtype=torch.bfloat16, device=a.x.data.device)
            with pytest.raises(RuntimeError, match=rf"combine \(call 1\) got rows from {peer} that belong to another"):
                if case == "local_reduce":
                    buf.combine(zeros, a.handle, local_reduce=rank == 0)
                elif case == "rows":  # rank 0 through the combine-row path (one row per slot, as local_reduce=False:
                    # the descriptor comes from its wait-only send; nothing writes the rows here), rank 1 reduced
                    if rank == 0:
                        buf.begin_combine_rows(a)
                        buf.finish_combine_rows(a.handle)
                    else:
                        buf.combine(zeros, a.handle, local_reduce=True)
                else:  # "handles": another dispatch of buf; "buffers": the first dispatch of other_buf
                    buf.combine(zeros, (a if rank == 0 else b).handle)
                torch.cuda.synchronize()
                buf._backend.check()
            with pytest.raises(RuntimeError, match="belong to another"):  # and it stays unusable
                buf.dispatch(*inputs[0])
            torch.cuda.synchronize()
    return "ok"


def misuse_worker(rank, world):
    """Arguments the nvlink kernels cannot take are refused on the host, or copied into a form they can take: x or
    expert_out off the Buffer's GPU, a handle of a Buffer with other table sizes, a non-bool local_reduce, wave_sms
    out of range; x and expert_out at addresses that are not 16-byte aligned give the aligned calls' bits; the dispatch
    keeps its own weights. A handle of another Buffer with the same sizes combines as on its own Buffer."""
    import ep_comm
    from dist_cases import _expect
    hidden, experts, topk = 256, 4 * world, 2
    common = dict(hidden=hidden, num_experts=experts, num_topk=topk, backend="nvlink")
    small = ep_comm.Buffer(None, max_tokens_per_rank=8, **common)
    large = ep_comm.Buffer(None, max_tokens_per_rank=16, **common)
    twin = ep_comm.Buffer(None, max_tokens_per_rank=8, **common)
    try:
        x, idx, w = _make_inputs(rank, 8, hidden, experts, topk, "uniform", world, seed=3)
        res = small.dispatch(x, idx, w)
        _, out = _expert_out(int(res.expert_offsets[-1]), res.num_rows, hidden, 4, rank)
        y = small.combine(out, res.handle)
        # The handle of a Buffer with other sizes: refused (its tables would be read with this Buffer's sizes).
        _expect(ValueError, "another Buffer", lambda: large.combine(
            torch.zeros(res.num_rows, hidden, dtype=torch.bfloat16, device=x.device), res.handle))
        # Same sizes: fine, and the same bits.
        assert torch.equal(_bits(twin.combine(out, res.handle)), _bits(y)), "combine on a same-size Buffer differs"
        # Same table sizes but another split of the experts over the ranks: refused (the combine finds a row's rank
        # from its expert id).
        regrouped = ep_comm.Buffer(None, max_tokens_per_rank=8, **dict(common, num_experts=2 * experts))
        try:
            _expect(ValueError, "another Buffer", lambda: regrouped.combine(
                torch.zeros(res.num_rows, hidden, dtype=torch.bfloat16, device=x.device), res.handle))
            # A Buffer with smaller tables made after it must not lower the kernels' shared-memory limits below what
            # this one's layout and receive ask for (they are the kernel functions', shared by every Buffer).
            later_small = ep_comm.Buffer(None, max_tokens_per_rank=8, **common)
            later_small.destroy()
            wide = regrouped.dispatch(x, idx, w)
            local = 2 * experts // world
            want_rows = sum(int(((i >= rank * local) & (i < (rank + 1) * local)).sum())
                            for i in (_make_inputs(r, 8, hidden, experts, topk, "uniform", world, seed=3)[1]
                                      for r in range(world)))
            assert int(wide.num_tokens_per_expert.sum()) == want_rows, (wide.num_tokens_per_expert, want_rows)
            torch.cuda.synchronize()
            regrouped._backend.check()
        finally:
            regrouped.destroy()
        _expect(ValueError, "on this Buffer's GPU", lambda: small.dispatch(x.cpu(), idx.cpu(), w.cpu()))
        # The CPU tier checks the result views against a Python copy of the C++ arena table: here the copy against the
        # table itself.
        cfg = small.config
        for num_tokens in (0, 5, cfg.max_tokens_per_rank):
            for rows_only in (False, True):
                offsets, sizes, total = small._backend._ctx.dispatch_arena_layout(num_tokens, rows_only)
                want = _cpp_arena_layout(num_tokens, topk, cfg.max_recv_rows, world, cfg.num_local_experts,
                                         cfg.max_tokens_per_rank, hidden // 2, hidden // 16, True, rows_only)
                assert (list(offsets), list(sizes), total) == want, (num_tokens, rows_only, offsets, sizes, total)
        _expect(ValueError, "on this Buffer's GPU", lambda: small.combine(out.cpu(), res.handle))
        _expect(TypeError, "local_reduce must be a bool", lambda: small.combine(out, res.handle, local_reduce=1))
        _expect(ValueError, "wave_sms must be in", lambda: small.dispatch_waves(x, idx, w, wave_sms=0))
        # Views starting 6 bytes past an aligned address: copied, the same bits as the aligned tensors.
        flat_x = torch.empty(x.numel() + 8, dtype=torch.bfloat16, device=x.device)
        odd_x = flat_x[3:3 + x.numel()].view_as(x)
        odd_x.copy_(x)
        flat_out = torch.empty(out.numel() + 8, dtype=torch.bfloat16, device=x.device)
        odd_out = flat_out[3:3 + out.numel()].view_as(out)
        odd_out.copy_(out)
        assert odd_x.data_ptr() % 16 and odd_out.data_ptr() % 16
        res_odd = small.dispatch(odd_x, idx, w)
        rows = int(res.expert_offsets[-1])
        assert torch.equal(payload_bytes(res_odd.x, "nvfp4")[:rows].cpu(), payload_bytes(res.x, "nvfp4")[:rows].cpu())
        assert torch.equal(_bits(small.combine(odd_out, res_odd.handle)), _bits(y)), "unaligned expert_out"
        # The dispatch keeps its own weights: zeroing the caller's tensor after the dispatch changes nothing.
        reused = w.clone()
        kept = small.dispatch(x, idx, reused)
        before = small.combine(out, kept.handle, local_reduce=False)
        reused.zero_()
        assert torch.equal(_bits(small.combine(out, kept.handle, local_reduce=False)), _bits(before))
    finally:
        small.destroy()
        large.destroy()
        twin.destroy()
    return "ok"


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
def _malformed_environment_worker(rank, world):
    """A malformed EP_COMM_ALLOW_SHARED_GPU raises for backend "auto" as for "nvlink" (not a quiet fallback to the
    reference backend), and is not read for backend "reference"."""
    import os
    import ep_comm
    os.environ["EP_COMM_ALLOW_SHARED_GPU"] = "true"
    try:
        messages = []
        for backend in ("auto", "nvlink"):
            try:
                ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4,
                               backend=backend).destroy()
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
        ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4,
                       backend="reference").destroy()
    finally:
        os.environ.pop("EP_COMM_ALLOW_SHARED_GPU", None)
    return messages


@pytest.mark.cpu
def test_malformed_nvlink_environment_raises_for_auto_too():
    assert run_ranks(_malformed_environment_worker, 1, backend="gloo") == [
        ["EP_COMM_ALLOW_SHARED_GPU must be 0 or 1, got 'true'"] * 2]


def _malformed_kernel_switch_worker(rank, world):
    """A malformed kernel switch (read by the C++ launcher at the first dispatch, where only its rank would raise and
    the peers would time out) on rank 1 only: every rank's Buffer() raises, naming the switch."""
    import os
    import ep_comm
    if rank == 1:
        os.environ["EP_COMM_NVLINK_PDL"] = "yes"
    try:
        ep_comm.Buffer(None, hidden=64, num_experts=4, num_topk=2, max_tokens_per_rank=4).destroy()
        return None
    except ValueError as error:
        return str(error)
    finally:
        os.environ.pop("EP_COMM_NVLINK_PDL", None)


@pytest.mark.cpu
def test_malformed_nvlink_kernel_switch_raises_on_every_rank():
    messages = run_ranks(_malformed_kernel_switch_worker, 2, backend="gloo")
    assert all(m and "malformed nvlink kernel switch" in m and "EP_COMM_NVLINK_PDL must be one of auto, 0, 1, "
               "not 'yes'" in m for m in messages), messages


@pytest.mark.multigpu
def test_nvlink_sync_check_leaves_graph_capture_alone():
    assert run_ranks(sync_check_graph_worker, _world(), backend=multigpu_backend(), timeout_s=300) == ["ok"] * _world()


@pytest.mark.multigpu
def test_nvlink_oracle_cases():
    world = _world()
    results = run_ranks(oracle_worker, world, backend=multigpu_backend(), timeout_s=600)
    # run_case asserts each case against the oracle inside the ranks; here: every rank ran every case (and the
    # identity round trip).
    from dist_cases import standard_cases
    assert all(len(summaries) == len(standard_cases(world, 256)) + 1 for summaries in results)


@pytest.mark.multigpu
def test_nvlink_dispatches_in_flight_combine_in_any_order():
    """Also with the rank's own NVFP4 rows stored straight into the dispatch output (direct self rows from 0 tokens)."""
    from dist_cases import in_flight_worker
    world = _world()
    for direct_self_min_tokens in (None, 0):
        assert run_ranks(in_flight_worker, world, "nvlink", "cuda", direct_self_min_tokens,
                         backend=multigpu_backend(), timeout_s=600) == ["in flight ok"] * world


@pytest.mark.multigpu
@pytest.mark.skipif(multigpu_world() < 4, reason="needs 4 ranks for two expert-parallel groups of 2: 4 GPUs, or "
                    "EP_COMM_TEST_SHARED_GPU=1 EP_COMM_TEST_SHARED_WORLD=4 on one")
@pytest.mark.parametrize("layout", ["blocked", "strided"])
def test_nvlink_expert_parallel_groups_inside_a_larger_world(layout):
    """Two EP groups of 2 in a world of 4, each group's nvlink Buffers at once, each group with its own inputs: each
    group gives the oracle's results and what an EP world of 2 alone gives with those inputs, bit for bit. On 4 GPUs
    NVSHMEM starts per process over its EP group; ranks sharing one GPU map their peers with CUDA IPC instead."""
    from dist_cases import ep_groups_worker, semantics_worker
    alone = [run_ranks(semantics_worker, 2, "nvlink", "cuda", 256, None, 100 * index, backend=multigpu_backend(),
                       timeout_s=600) for index in range(2)]
    grouped = run_ranks(ep_groups_worker, 4, 2, layout, "nvlink", "cuda", backend=multigpu_backend(), timeout_s=600)
    for global_rank, (index, group_rank, summaries) in enumerate(grouped):
        assert summaries == alone[index][group_rank], (layout, global_rank, index, group_rank)


@pytest.mark.multigpu
def test_nvlink_rows_only_dispatch():
    assert run_ranks(rows_worker, _world(), backend=multigpu_backend(), timeout_s=600) == ["ok"] * _world()


@pytest.mark.multigpu
def test_nvlink_refuses_misuse():
    assert run_ranks(misuse_worker, _world(), backend=multigpu_backend(), timeout_s=300) == ["ok"] * _world()


@pytest.mark.multigpu
def test_nvlink_out_of_range_ids_are_masked_without_checks():
    assert run_ranks(out_of_range_ids_worker, _world(), backend=multigpu_backend(), timeout_s=300) == ["ok"] * _world()


@pytest.mark.multigpu
def test_nvlink_combine_mismatch_across_ranks_is_detected():
    assert run_ranks(combine_mismatch_worker, 2, backend=multigpu_backend(), timeout_s=300) == ["ok", "ok"]


@pytest.mark.multigpu
def test_nvlink_matches_reference():
    run_ranks(versus_reference_worker, _world(), backend=multigpu_backend(), timeout_s=900)


@pytest.mark.multigpu
def test_nvlink_weight_edges_and_calls_without_tokens():
    assert run_ranks(weight_edges_worker, _world(), backend=multigpu_backend(), timeout_s=600) == ["ok"] * _world()


@pytest.mark.multigpu
def test_nvlink_direct_self_rows_match_reference():
    """NVFP4 dispatch with the send storing each rank's own rows into its output: bitwise the reference. From 60
    tokens: rank 0 (96 tokens) stores directly, the others (59 tokens or an empty rank) keep their rows staged."""
    run_ranks(versus_reference_worker, _world(), 60, backend=multigpu_backend(), timeout_s=900)


@pytest.mark.multigpu
def test_nvlink_comm_stream():
    """dispatch / combine on a communication stream with an event: the results of the current-stream calls."""
    import dist_cases
    results = run_ranks(dist_cases.comm_stream_worker, _world(), "nvlink", backend=multigpu_backend(), timeout_s=600)
    assert all(r == "comm stream ok" for r in results)


@pytest.mark.multigpu
def test_nvlink_streaming_receive_pressure_and_graph():
    run_ranks(streaming_pressure_and_graph_worker, _world(), backend=multigpu_backend(), timeout_s=600)


@pytest.mark.multigpu
@pytest.mark.parametrize("stream_recv", [True, False], ids=["streaming-receive", "receive-after-send"])
def test_nvlink_block_counts_and_chunked_layout(stream_recv):
    run_ranks(block_counts_worker, _world(), stream_recv, backend=multigpu_backend(), timeout_s=600)


@pytest.mark.multigpu
def test_nvlink_pressure_graph_and_leaks():
    results = run_ranks(pressure_and_graph_worker, _world(), backend=multigpu_backend(), timeout_s=600)
    assert all(r["graph"] == "ok" and r["leak"] == "ok" for r in results), results
    assert all(r["memset"] in ("ok", _MEMSET_NOT_PROFILED) for r in results), results  # the workers assert it


@pytest.mark.multigpu
@pytest.mark.parametrize("direct_self", [False, True])
def test_nvlink_timeout_names_stage_and_peer(direct_self):
    run_ranks(timeout_worker, 2, direct_self, backend=multigpu_backend(), timeout_s=300)


@pytest.mark.multigpu
def test_nvlink_combine_timeout_names_stage_and_peer():
    """Rank 1 dispatches but never combines (combine_timeout_worker). Named with "timeout": the smoke tiers run it."""
    assert run_ranks(combine_timeout_worker, 2, backend=multigpu_backend(), timeout_s=300) == ["ok", "ok"]


@pytest.mark.multigpu
def test_nvlink_check_finite_misuse_refused_on_every_rank():
    """dist_cases.check_finite_worker on the nvlink backend ("misuse" in the name: the shared-GPU smoke tiers select
    it; bench/device_run.sh test_nvlink_one_rank runs the worker at world 1)."""
    import dist_cases
    assert run_ranks(dist_cases.check_finite_worker, 2, "nvlink", "cuda", backend=multigpu_backend(),
                     timeout_s=300) == ["check_finite ok"] * 2


@pytest.mark.multigpu
def test_nvlink_rejected_ids_stop_the_peers_at_once():
    assert run_ranks(rejected_ids_worker, 2, backend=multigpu_backend(), timeout_s=300) == ["ok", "ok"]


@pytest.mark.multigpu
def test_nvlink_fail_stop_after_a_timeout():
    run_ranks(stall_worker, 2, backend=multigpu_backend(), timeout_s=300)


@pytest.mark.multigpu
def test_nvlink_fail_stop_after_a_timeout_through_a_combine():
    run_ranks(stall_worker, 2, True, backend=multigpu_backend(), timeout_s=300)


@pytest.mark.multigpu
@pytest.mark.parametrize("direct_self", [False, True])
def test_nvlink_rows_past_capacity_are_refused_not_written(direct_self):
    run_ranks(capacity_fault_worker, 2, direct_self, backend=multigpu_backend(), timeout_s=300)


class _FakeIpcExtension:
    """The five CUDA-IPC calls of ep_comm._C that _SymmetricRegion makes, on the host: `fail` names the one that raises
    on this rank ("alloc" or "open"); `freed` / `closed` record what was released."""

    def __init__(self, rank, fail):
        self.rank, self.fail, self.freed, self.closed = rank, fail, [], []

    def nvlink_device_alloc(self, device, nbytes):
        if self.fail == "alloc":
            raise RuntimeError("cudaMalloc: out of memory (fake)")
        return 1000 + self.rank

    def nvlink_ipc_get_handle(self, device, address):
        return bytes([address % 256]) * 64

    def nvlink_ipc_open_handle(self, device, handle):
        if self.fail == "open":
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context (fake)")
        return 2000 + handle[0]

    def nvlink_ipc_close_handle(self, device, address):
        self.closed.append(address)

    def nvlink_device_free(self, device, address):
        self.freed.append(address)


def _region_setup_error(*patches):
    """Builds a 4096-byte _SymmetricRegion on "GPU 0" under `patches` (the faked calls): the message of the
    RuntimeError it raises, or None."""
    import contextlib
    from unittest import mock
    from ep_comm.backends import nvlink
    with contextlib.ExitStack() as stack:
        for patch in (*patches, mock.patch.object(torch.cuda, "current_device", lambda: 0)):
            stack.enter_context(patch)
        try:
            nvlink._SymmetricRegion(None, 4096, 100.0)
        except RuntimeError as error:
            return str(error)
    return None


def _ipc_setup_failure_worker(rank, world, failing_rank, step):
    """_SymmetricRegion over CUDA IPC with the extension's calls faked: one rank's allocation or peer mapping fails.
    Every rank must raise (naming the failing rank and step) instead of waiting, and free what it had made."""
    import os
    from unittest import mock
    from ep_comm import _ext
    os.environ["EP_COMM_PEER_MEMORY"] = "ipc"
    fake = _FakeIpcExtension(rank, step if rank == failing_rank else None)
    message = _region_setup_error(mock.patch.object(_ext, "require_cuda_extension", lambda what: fake))
    return message, fake.freed, fake.closed


@pytest.mark.cpu
@pytest.mark.parametrize("failing_rank,step", [(0, "alloc"), (1, "open")])
def test_nvlink_ipc_setup_failure_raises_on_every_rank(failing_rank, step):
    results = run_ranks(_ipc_setup_failure_worker, 2, failing_rank, step, backend="gloo", timeout_s=120)
    what = "allocating" if step == "alloc" else "mapping a peer's region"
    for rank, (message, freed, closed) in enumerate(results):
        assert message is not None and f"rank {failing_rank}: {what}" in message, (rank, message)
        if step == "alloc":  # the failing rank has nothing to free; the other frees its region, maps nothing
            assert freed == ([] if rank == failing_rank else [1000 + rank]) and closed == [], (rank, freed, closed)
        else:  # every rank frees its region; the rank that mapped its peer unmaps it
            assert freed == [1000 + rank], (rank, freed)
            peer_handle_byte = (1000 + (1 - rank)) % 256  # _FakeIpcExtension: handle = address byte, mapped at 2000 +
            assert closed == ([] if rank == failing_rank else [2000 + peer_handle_byte]), (rank, closed)


@pytest.mark.cpu
def test_undestroyed_buffer_warns_when_collected():
    """A Buffer collected without destroy() warns (ResourceWarning) when its backend holds memory outside torch's
    allocator (the nvlink backend), and stays silent when it was destroyed, when its backend holds none (reference), and
    when its constructor failed before a backend existed."""
    import gc
    import warnings
    from ep_comm import Buffer
    from ep_comm.backends.nvlink import NVLinkBackend
    from ep_comm.backends.reference import ReferenceBackend

    class _Backend:
        def __init__(self, cls):
            self.name = cls.name
            self.holds_unmanaged_memory = getattr(cls, "holds_unmanaged_memory", False)

    def collect(backend_cls, destroyed, with_backend=True):
        buf = object.__new__(Buffer)  # no process group needed: only what __del__ reads
        buf.rank = 0
        if with_backend:
            buf._backend = _Backend(backend_cls)
            buf._destroyed = destroyed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del buf
            gc.collect()
        return [w for w in caught if issubclass(w.category, ResourceWarning)]

    leaked = collect(NVLinkBackend, destroyed=False)
    assert len(leaked) == 1 and "without destroy()" in str(leaked[0].message) and "nvlink" in str(leaked[0].message)
    assert collect(NVLinkBackend, destroyed=True) == []
    assert collect(ReferenceBackend, destroyed=False) == []
    assert collect(NVLinkBackend, destroyed=False, with_backend=False) == []


@pytest.mark.cpu
def test_nvlink_size_hint_without_gpu():
    """Runs anywhere: the region layout is computable without a GPU and is consistent."""
    from ep_comm.backends.nvlink import NVLinkBackend, _RegionLayout
    from ep_comm.types import BufferConfig
    cfg = BufferConfig(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, world_size=2)
    layout = _RegionLayout.of(cfg)
    sizes = NVLinkBackend.size_hint(cfg)
    assert layout.disp_scale_off == 3584 and layout.disp_meta_off == 3584 + 448
    assert sizes.total_symmetric_bytes >= sizes.dispatch_recv_bytes + sizes.combine_recv_bytes
    assert layout.off_staging % 256 == 0 and layout.off_combine % 256 == 0


@pytest.mark.cpu
@pytest.mark.parametrize("world,fmt", [(2, "nvfp4"), (8, "nvfp4"), (8, "bf16"), (72, "mxfp8")])
def test_nvlink_region_sections_are_disjoint(world, fmt):
    """Every section of the symmetric region (the five flag arrays, the combine descriptors, the abort word, counts, row
    flags, staging, combine rows, wave index) lies inside the region, 8-byte aligned, and overlaps no other."""
    from ep_comm.backends.nvlink import _RegionLayout
    from ep_comm.types import BufferConfig
    cfg = BufferConfig(hidden=2048, num_experts=4 * world, num_topk=4, max_tokens_per_rank=96, world_size=world,
                       dispatch_format=fmt)
    L = _RegionLayout.of(cfg)
    w, t, k, e_local = world, 96, 4, 4
    sections = {name: (getattr(L, name), 8 * w) for name in
                ("off_disp_ready", "off_disp_consumed", "off_comb_ready", "off_comb_consumed", "off_disp_counts",
                 "off_comb_desc")}
    sections["off_abort"] = (L.off_abort, 4)
    sections["off_counts"] = (L.off_counts, 4 * w * L.count_stride)
    sections["off_row_flags"] = (L.off_row_flags, 4 * w * t)
    sections["off_staging"] = (L.off_staging, w * t * L.disp_row_bytes)
    sections["off_combine"] = (L.off_combine, t * k * L.comb_row_bytes)
    if fmt == "nvfp4":
        sections["off_wave_index"] = (L.off_wave_index, 4 * w * e_local * t)
    spans = sorted((off, off + size, name) for name, (off, size) in sections.items())
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {next_name}"
    assert spans[-1][1] <= L.total_bytes
    assert all(off % 8 == 0 for off, _ in sections.values())
    assert L.count_stride >= e_local + 2  # expert counts, token count, row flags (0/1)



def _cpp_arena_layout(num_tokens, topk, rows, world, num_local, max_tokens, data_bytes, scale_bytes, nvfp4,
                      rows_only=False):
    """A Python copy of NvlinkContext::arena_layout (csrc/bind_nvlink.cpp): (byte offsets, bytes, total) of the 18
    sections, 256-byte aligned, in the C++ physical order (rows_only: no payload sections, a row_index section)."""
    t, k, r, w, e = num_tokens, topk, rows, world, num_local
    sizes = [4 * t * k, 4 * t * k, 0 if rows_only else r * data_bytes, 0 if rows_only else r * scale_bytes,
             4 * r if nvfp4 else 0, 4 * e, 4 * (e + 1), 4 * r, 4 * r, 4 * r, 4 * r, 4 * w, 4 * w * max_tokens,
             4 * w * max_tokens, 4 * w * max_tokens * k, 4 * r if rows_only else 0, 8, 4 * r]
    offsets, run = [0] * 18, 0
    for i in (0, 1, 4, 5, 6, 7, 8, 9, 10, 17, 11, 12, 13, 14, 16, 15, 2, 3):
        offsets[i] = run
        run += (sizes[i] + 255) // 256 * 256
    return offsets, sizes, max(run, 256)


@pytest.mark.cpu
@pytest.mark.parametrize("hidden", [32, 2080, 7168])
def test_nvlink_mxfp8_combine_rows_take_the_s2f6_layout(hidden):
    """The kernels read and write MXFP8 combine rows at S2F6's offsets (codes, then the scale bytes at comb_scale_off,
    each part 16-byte aligned): both formats get the same row layout, which holds the wire bytes."""
    from ep_comm.backends.nvlink import _RegionLayout
    from ep_comm.types import BufferConfig, combine_bytes_per_token
    layouts = {fmt: _RegionLayout.of(BufferConfig(hidden=hidden, num_experts=8, num_topk=4, max_tokens_per_rank=16,
                                                  world_size=2, combine_format=fmt)) for fmt in ("s2f6", "mxfp8")}
    s2f6, mxfp8 = layouts["s2f6"], layouts["mxfp8"]
    assert (mxfp8.comb_scale_off, mxfp8.comb_row_bytes) == (s2f6.comb_scale_off, s2f6.comb_row_bytes)
    assert mxfp8.comb_scale_off >= hidden and mxfp8.comb_scale_off % 16 == 0 and mxfp8.comb_row_bytes % 16 == 0
    assert mxfp8.comb_row_bytes - mxfp8.comb_scale_off >= hidden // 32
    assert mxfp8.comb_row_bytes >= combine_bytes_per_token("mxfp8", hidden)


@pytest.mark.cpu
@pytest.mark.parametrize("rows_only", [False, True], ids=["expanded", "rows-only"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("num_tokens", [0, 5, 64])
def test_nvlink_dispatch_result_views_of_the_arena(fmt, num_tokens, rows_only):
    """Every DispatchResult tensor and handle array of an nvlink dispatch is the arena section the C++ table names, with
    its dtype and shape: each view's bytes are compared with the arena's bytes at that section (an arena filled with
    distinct words, on the CPU; the GPU tests check the values the kernels write there)."""
    from ep_comm.backends.nvlink import NVLinkBackend
    from ep_comm.types import BufferConfig
    world, hidden, topk, max_tokens = 2, 2080, 3, 64
    cfg = BufferConfig(hidden=hidden, num_experts=8 * world, num_topk=topk, max_tokens_per_rank=max_tokens,
                       world_size=world, dispatch_format=fmt)
    rows, local = cfg.max_recv_rows, cfg.num_local_experts
    data_bytes = {"nvfp4": hidden // 2, "mxfp8": hidden, "bf16": 2 * hidden}[fmt]
    scale_bytes = {"nvfp4": hidden // 16, "mxfp8": hidden // 32, "bf16": 0}[fmt]
    layout = _cpp_arena_layout(num_tokens, topk, rows, world, local, max_tokens, data_bytes, scale_bytes,
                               fmt == "nvfp4", rows_only)
    expanded = _cpp_arena_layout(num_tokens, topk, rows, world, local, max_tokens, data_bytes, scale_bytes,
                                 fmt == "nvfp4")
    # combine reads every arena with the expanded table: its sections must sit where they do there
    assert all(layout[0][i] == expanded[0][i] and layout[1][i] == expanded[1][i]
               for i in (0, 1, 17, 11, 12, 13, 14, 16))

    class FakeContext:
        def dispatch_arena_layout(self, tokens, rows):
            assert tokens == num_tokens and rows == rows_only
            return list(layout[0]), list(layout[1]), layout[2]
    backend = object.__new__(NVLinkBackend)  # only the fields the recipe and the views read
    backend.config, backend._ctx, backend._arena_recipes = cfg, FakeContext(), {}
    backend._staging_generation, backend._destroyed = 4, False
    backend._group_global_ranks = tuple(range(cfg.world_size))  # (what the handle records of the group)
    staging = object()  # rows-only: x is the staging payload, which needs the region (GPU tests)
    backend._staging_payload = lambda: staging
    recipe = backend._arena_recipe(num_tokens, rows_only)
    assert backend._arena_recipe(num_tokens, rows_only) is recipe  # cached
    arena = torch.arange(recipe.words, dtype=torch.int32) * 7 + 3  # distinct words, nonzero bytes
    result = backend._result_in_arena(arena, recipe, num_tokens, 0)
    raw = arena.view(torch.uint8)
    offsets, sizes, _ = layout

    def same_bytes(tensor, section, dtype, shape):
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, (section, tensor.dtype, tuple(tensor.shape))
        got = tensor.contiguous().view(torch.uint8).reshape(-1)
        assert got.numel() == sizes[section], section
        assert torch.equal(got, raw[offsets[section]:offsets[section] + sizes[section]]), section
    if rows_only:
        assert result.x is staging
        same_bytes(result.row_index, 15, torch.int32, (rows,))
        # The staging rows are this dispatch's until the next dispatch (or destroy()): then expert_major_x refuses.
        assert result.staging_valid()
        backend._staging_generation += 1
        assert not result.staging_valid()
        with pytest.raises(RuntimeError, match="rows are gone"):
            result.expert_major_x()
        backend._staging_generation -= 1
        backend._destroyed = True
        assert not result.staging_valid()
    elif fmt == "nvfp4":
        assert result.row_index is None
        same_bytes(result.x.data, 2, torch.uint8, (rows, hidden // 2))
        same_bytes(result.x.scales, 3, torch.float8_e4m3fn, (rows, hidden // 16))
        same_bytes(result.x.amax, 4, torch.float32, (rows,))
    elif fmt == "mxfp8":
        same_bytes(result.x.data, 2, torch.float8_e4m3fn, (rows, hidden))
        same_bytes(result.x.scales, 3, torch.float8_e8m0fnu, (rows, hidden // 32))
    else:
        same_bytes(result.x, 2, torch.bfloat16, (rows, hidden))
    same_bytes(result.num_tokens_per_expert, 5, torch.int32, (local,))
    same_bytes(result.expert_offsets, 6, torch.int32, (local + 1,))
    same_bytes(result.src_rank, 7, torch.int32, (rows,))
    same_bytes(result.src_token, 8, torch.int32, (rows,))
    same_bytes(result.topk_slot, 9, torch.int32, (rows,))
    same_bytes(result.topk_weight, 10, torch.float32, (rows,))
    handle = result.handle
    assert handle.arena_ptr == arena.data_ptr() and handle.num_tokens == num_tokens and handle.num_rows == rows
    # The addresses finish_combine_rows passes to C++ without making the views.
    assert type(handle).send_idx.address(handle) == arena.data_ptr() + offsets[0]
    assert type(handle).send_w.address(handle) == arena.data_ptr() + offsets[1]
    same_bytes(handle.send_idx, 0, torch.int32, (num_tokens, topk))
    same_bytes(handle.send_w, 1, torch.float32, (num_tokens, topk))
    same_bytes(handle.row_weight, 17, torch.float32, (rows,))  # its own copy: not the result's topk_weight
    same_bytes(handle.recv_count, 11, torch.int32, (world,))
    same_bytes(handle.recv_tok, 12, torch.int32, (world * max_tokens,))
    same_bytes(handle.recv_ord, 13, torch.int32, (world * max_tokens,))
    same_bytes(handle.recv_rows, 14, torch.int32, (world * max_tokens * topk,))
    same_bytes(handle.dispatch_epoch, 16, torch.int64, (1,))
    assert type(handle).dispatch_epoch.address(handle) == arena.data_ptr() + offsets[16]


@pytest.mark.cpu
def test_nvlink_limits_env_and_size_hint_constants(monkeypatch):
    """Per-expert tables that would not fit the kernels' shared memory are refused up front (construction used to fail
    in cudaFuncSetAttribute), with the extension's limits and with the Python copies that stand in without it; the
    backend's environment switches take only well-formed values, naming the variable; the Python copies of C++
    constants and sizes match the extension where it is built."""
    from ep_comm import _ext
    from ep_comm.backends import buffer_tag, nvlink
    from ep_comm.types import BufferConfig
    fits = BufferConfig(hidden=2048, num_experts=256, num_topk=8, max_tokens_per_rank=64, world_size=8)
    built = _ext._C if _ext.cuda_extension_available() and hasattr(_ext._C, "nvlink_receive_layout_smem") else None
    for c in (None, built) if built is not None else (None,):  # None: the copies (no extension)
        monkeypatch.setattr(_ext, "_C", c)
        nvlink._check_nvlink_limits(fits)
        for world, experts in ((2, 28000), (8, 45056), (1, 60000)):
            with pytest.raises(ValueError, match="per-expert tables in shared memory"):
                nvlink._check_nvlink_limits(BufferConfig(hidden=2048, num_experts=experts, num_topk=8,
                                                         max_tokens_per_rank=64, world_size=world))
        with pytest.raises(ValueError, match="num_topk <= 32"):
            nvlink._check_nvlink_limits(dataclasses.replace(fits, num_experts=64, num_topk=33))
        with pytest.raises(ValueError, match="up to 1024 ranks"):
            nvlink._check_nvlink_limits(dataclasses.replace(fits, num_experts=2048, world_size=2048))
        with pytest.raises(ValueError, match="hidden <= 1048576"):  # 2 * hidden wrapped 32-bit offsets past 2**30
            nvlink._check_nvlink_limits(dataclasses.replace(fits, hidden=2**30 + 32))
        # (the layout's chunk count sums T + T / 64 in 32 bits: T = 2^31 - 128 wrapped it and laid out one chunk)
        with pytest.raises(ValueError, match="max_tokens_per_rank <= 1073741824"):
            nvlink._check_nvlink_limits(dataclasses.replace(fits, num_experts=8, num_topk=1, world_size=1,
                                                            max_tokens_per_rank=2**31 - 128))
        nvlink._check_nvlink_limits(dataclasses.replace(fits, num_experts=8, num_topk=1, world_size=1,
                                                        max_tokens_per_rank=2**30))
    if built is not None:
        assert (built.nvlink_max_topk, built.nvlink_max_world, built.nvlink_max_dynamic_smem,
                built.nvlink_buffer_tag_bits, built.nvlink_dispatch_epoch_bits) == (
                    nvlink._MAX_TOPK, nvlink._MAX_WORLD, nvlink._MAX_DYNAMIC_SMEM, buffer_tag.BUFFER_TAG_BITS,
                    buffer_tag.DISPATCH_COUNT_BITS)
        for world, experts in ((1, 1), (1, 60000), (2, 28000), (8, 256), (72, 576), (1024, 1024), (1024, 50176)):
            assert built.nvlink_layout_warp_smem(experts, world) == nvlink._layout_warp_smem(experts, world)
            local = experts // world
            assert built.nvlink_receive_layout_smem(world, local) == nvlink._receive_layout_smem(world, local)
    for value, on in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv("EP_COMM_SYNC_CHECK", value)
        assert nvlink._env_flag("EP_COMM_SYNC_CHECK") is on
    for value in ("true", "on", "1 "):
        monkeypatch.setenv("EP_COMM_ALLOW_SHARED_GPU", value)
        with pytest.raises(ValueError, match="EP_COMM_ALLOW_SHARED_GPU must be 0 or 1"):
            nvlink._shared_gpu_allowed()
    monkeypatch.setenv("EP_COMM_DIRECT_SELF_MIN_TOKENS", "")
    assert nvlink._env_count("EP_COMM_DIRECT_SELF_MIN_TOKENS", 2048) == 2048
    monkeypatch.setenv("EP_COMM_DIRECT_SELF_MIN_TOKENS", "1000000000")
    assert nvlink._env_count("EP_COMM_DIRECT_SELF_MIN_TOKENS", 2048) == 10**9
    for value in ("-5", "+7", " 1_000\n", "\u0663", "2147483648"):
        monkeypatch.setenv("EP_COMM_DIRECT_SELF_MIN_TOKENS", value)
        with pytest.raises(ValueError, match="EP_COMM_DIRECT_SELF_MIN_TOKENS must be a whole number"):
            nvlink._env_count("EP_COMM_DIRECT_SELF_MIN_TOKENS", 2048)
    # The hint counts every chunk's layout bases (64 x (E + W) ints) and the wave area.
    assert nvlink.NVLinkBackend.size_hint(fits).layout_bytes >= 4 * 64 * (256 + 8) + 8 * (2 + 32)
    if _ext.cuda_extension_available() and hasattr(_ext._C, "nvlink_layout_max_chunks"):
        assert (_ext._C.nvlink_layout_max_chunks, _ext._C.wave_area_fixed_words) == (
            nvlink._LAYOUT_MAX_CHUNKS, nvlink._WAVE_AREA_FIXED_WORDS)


def _nvshmem_partial_allocation_worker(rank, world):
    """NVSHMEM's symmetric allocation fails on rank 1 only (faked): every rank must raise the same error; none may fall
    back to CUDA IPC (a collective the ranks holding a tensor would never join)."""
    import os
    import sys
    import types
    from unittest import mock
    from ep_comm.backends import nvlink
    os.environ["EP_COMM_PEER_MEMORY"] = "auto"
    os.environ.pop("EP_COMM_ALLOW_SHARED_GPU", None)  # the shared-GPU tier sets it, and it forces CUDA IPC
    package, core = types.ModuleType("nvshmem"), types.ModuleType("nvshmem.core")
    package.core = core
    sys.modules["nvshmem"], sys.modules["nvshmem.core"] = package, core

    class _FakeNvshmem:
        def tensor(self, shape, dtype):
            if rank == 1:
                raise RuntimeError("nvshmem_malloc: out of symmetric heap (fake)")
            return torch.zeros(shape, dtype=dtype)

    fell_back = []
    message = _region_setup_error(
        mock.patch.object(nvlink, "_nvshmem_init", lambda group, nbytes, timeout_s: _FakeNvshmem()),
        mock.patch.object(nvlink._SymmetricRegion, "_open_ipc", lambda self: fell_back.append(True)))
    return message, fell_back


@pytest.mark.cpu
def test_nvlink_partial_nvshmem_allocation_raises_on_every_rank():
    for rank, (message, fell_back) in enumerate(run_ranks(_nvshmem_partial_allocation_worker, 2, backend="gloo",
                                                          timeout_s=120)):
        assert message is not None and "succeeded on some ranks only (rank 1:" in message, (rank, message)
        assert fell_back == [], rank


def _buffer_tag_worker(rank, world):
    from ep_comm.backends import buffer_tag
    if rank == 1:  # a rank that made other Buffers before (its own counter moved on): the tag is still rank 0's
        for _ in range(5):
            buffer_tag.next_buffer_tag()
    return [buffer_tag.agree_buffer_tag(None) for _ in range(3)]


@pytest.mark.cpu
def test_nvlink_buffer_tags_agree_across_ranks_and_differ_per_buffer():
    """Each nvlink Buffer's tag (in every handle's dispatch word, csrc/nvlink.h dispatch_word) is group rank 0's: the
    same on every rank whatever each rank created before, 22 bits, and different for successive Buffers."""
    tags = run_ranks(_buffer_tag_worker, 2, backend="gloo", timeout_s=120)
    assert tags[0] == tags[1], tags
    assert len(set(tags[0])) == 3 and all(0 <= t < 2**22 for t in tags[0]), tags


@pytest.mark.cpu
@pytest.mark.parametrize("case", ["unreported", "reported", "clean"])
def test_nvlink_destroy_warns_about_a_fault_no_call_reported(monkeypatch, case):
    """A fault the kernels record after the last call returned (here a mismatched combine: stage 9, peer 1, call 3)
    is warned about by destroy(), after its synchronize, instead of being lost; one check() already raised is not
    warned about again, and a clean error word gives no warning. On the host: a backend with stand-ins for the device
    calls and a ctypes word as the host-mapped error word."""
    import ctypes
    import warnings
    from types import SimpleNamespace
    import ep_comm.backends.nvlink as nvlink
    from ep_comm.types import BufferConfig
    word = ctypes.c_uint64((1 << 63) | (9 << 48) | (1 << 32) | 3 if case != "clean" else 0)
    backend = object.__new__(nvlink.NVLinkBackend)
    backend.config = BufferConfig(hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=8, world_size=2)
    backend.rank, backend.device, backend.group = 0, 0, None
    backend._destroyed, backend._gave_up, backend._fault_reported = False, None, False
    backend._error_host = ctypes.addressof(word)
    backend.region = SimpleNamespace(free=lambda: None)
    freed = []
    monkeypatch.setattr(nvlink._ext, "_C", SimpleNamespace(nvlink_host_mapped_free=freed.append))
    monkeypatch.setattr(nvlink.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(nvlink.torch.cuda, "current_device", lambda: 0)  # the Buffer's device is current
    monkeypatch.setattr(nvlink.dist, "barrier", lambda group=None: None)
    if case == "reported":
        with pytest.raises(RuntimeError, match=r"combine \(call 3\) got rows from rank 1"):
            backend.check()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.destroy()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if case == "unreported":
        assert len(messages) == 1 and "destroyed with an error no call reported" in messages[0] \
            and "combine (call 3) got rows from rank 1" in messages[0], messages
    else:
        assert messages == [], messages
    assert backend._destroyed and freed == [ctypes.addressof(word)]


@pytest.mark.cpu
def test_nvlink_check_handle_compares_routing_and_device():
    """check_handle on the host (no GPU: a backend object with only what the check reads): a foreign handle passes when
    its routing sizes, table sections and device match, and is refused when the experts are split over the ranks
    otherwise or when its arena is on another device."""
    from types import SimpleNamespace
    from ep_comm.backends.nvlink import NVLinkBackend, NVLinkHandle
    from ep_comm.types import BufferConfig
    sections = tuple((64 * i, 64) for i in range(18))
    backend = object.__new__(NVLinkBackend)
    backend._ctx, backend.torch_device = object(), torch.device("cpu")
    backend._group_global_ranks = (0, 1)  # (its group's global ranks)
    backend.config = BufferConfig(hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=8, world_size=2)
    backend._arena_recipe = lambda num_tokens, rows_only=False: SimpleNamespace(sections=sections)

    def handle(routing, device="cpu"):
        return NVLinkHandle(arena=torch.zeros(4, dtype=torch.int32, device=device), sections=sections, num_tokens=8,
                            num_rows=backend.config.max_recv_rows, num_topk=2, owner=object(), routing=routing)
    backend.check_handle(handle(backend._routing))
    other_split = backend._routing[:-1] + (backend._routing[-1] * 2,)
    with pytest.raises(ValueError, match="another Buffer's dispatch"):
        backend.check_handle(handle(other_split))
    with pytest.raises(ValueError, match="handle of a dispatch on meta"):
        backend.check_handle(handle(backend._routing, device="meta"))
    # A same-size Buffer on a group that numbers the same processes otherwise: its tables name other peers.
    backend.check_handle(dataclasses.replace(handle(backend._routing), group_ranks=(0, 1)))
    with pytest.raises(ValueError, match="another process group"):
        backend.check_handle(dataclasses.replace(handle(backend._routing), group_ranks=(1, 0)))


def _region_with_stand_ins(monkeypatch, states, init):
    """A _SymmetricRegion of rank 0 of 2 whose gathers answer `states` for NVSHMEM's state (the others: every rank as
    this one), with nvshmem4py and _nvshmem_init replaced by stand-ins (no GPU here)."""
    import sys
    import types
    from ep_comm.backends import nvlink
    region = object.__new__(nvlink._SymmetricRegion)
    region.world, region.rank, region.group, region.nbytes, region.device = 2, 0, None, 1 << 20, 0
    region.timeout_s = 100.0
    region._gather = lambda mine: states if isinstance(mine, tuple) else [mine] * 2
    fake = types.ModuleType("nvshmem")
    fake.core = types.ModuleType("nvshmem.core")
    monkeypatch.setitem(sys.modules, "nvshmem", fake)
    monkeypatch.setitem(sys.modules, "nvshmem.core", fake.core)
    monkeypatch.setattr(nvlink, "_nvshmem_init", init)
    return region


@pytest.mark.cpu
@pytest.mark.parametrize("states", [
    # (initialized, over which ranks, an earlier init failed, started on another GPU than this Buffer's)
    [(True, (0, 1), False, False), (False, None, False, False)],   # one rank initialized it over these ranks, one not
    [(True, (0, 1), False, False), (True, (0, 2), False, False)],  # both, over different groups
    [(False, None, True, False), (False, None, False, False)],     # an earlier init failed on one rank only
])
def test_nvshmem_setup_agrees_before_the_init_broadcast(monkeypatch, states):
    """_nvshmem_init broadcasts the unique id only where NVSHMEM is not initialized yet: ranks in different states
    must not enter it (some would wait in the broadcast for the others). They agree first and fall back together."""
    entered = []
    region = _region_with_stand_ins(monkeypatch, states, lambda *args: entered.append(args))
    why = region._setup_nvshmem()
    assert why is not None and "NVSHMEM's state differs between the ranks" in why and entered == []


@pytest.mark.cpu
def test_nvshmem_setup_enters_the_init_when_the_ranks_agree(monkeypatch):
    """The counterpart: ranks in the same state go on to _nvshmem_init (here a stand-in that fails, so the setup
    reports the agreed init failure instead of a state mismatch)."""
    entered = []

    def init(*args):
        entered.append(args)
        raise RuntimeError("stand-in")

    region = _region_with_stand_ins(monkeypatch, [(False, None, False, False)] * 2, init)
    why = region._setup_nvshmem()
    assert len(entered) == 1 and "NVSHMEM init failed: RuntimeError: stand-in" in why, why


@pytest.mark.cpu
def test_nvshmem_collective_calls_say_when_a_rank_waits_too_long(monkeypatch, capfd):
    """NVSHMEM's init, symmetric allocation and free wait for every rank without a timeout of their own: a rank still
    inside one after the Buffer's timeout_s says so on stderr, once, naming the call (a peer that failed before it
    would otherwise leave it hanging silently), and says so again if the call returns after all; a call that returns
    in time says nothing. The stand-in allocation blocks in C while holding the GIL, as nvshmem4py's malloc binding
    does: a Python timer could not fire during it (and, cancelled on the way out, would never say anything)."""
    import ctypes
    import sys
    import time
    from ep_comm import _ext
    if not _ext.cuda_extension_available():
        pytest.skip(f"needs ep_comm._C (its native timer): {_ext.cuda_extension_error()}")
    hold_gil_and_sleep = ctypes.PyDLL(None).usleep  # PyDLL: the GIL stays held during the call

    class SlowAllocation:  # nvshmem.core's calls, the allocation slower than the timeout
        def tensor(self, shape, dtype):
            made = torch.zeros(shape, dtype=dtype)  # (before the wait: torch ops release the GIL)
            end = time.monotonic() + 0.8
            while time.monotonic() < end:  # (usleep may end early on a signal)
                hold_gil_and_sleep(int((end - time.monotonic()) * 1e6) + 1)
            return made

        def get_peer_tensor(self, tensor, rank):
            return tensor

        def free_tensor(self, tensor):
            pass

    entered = []
    region = _region_with_stand_ins(monkeypatch, [(False, None, False, False)] * 2,
                                    lambda *args: entered.append(args) or SlowAllocation())
    region.timeout_s = 0.2
    region._gather = lambda mine: [mine] * 2  # every vote as this rank's (the state vote included: same state)
    # A long switch interval: after the allocation returns, this thread keeps the GIL until the announcer has stopped,
    # so only a timer that fired during the call (not one that got the GIL on the way out) can have said anything.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        assert region._setup_nvshmem() is None and region.kind == "nvshmem"
    finally:
        sys.setswitchinterval(switch_interval)
    assert entered[0][2] == 0.2  # _nvshmem_init's own announcement (around nvshmem.core.init) gets the same timeout
    err = capfd.readouterr().err
    waited = "ep_comm nvlink: rank 0 has waited 0.2 s in NVSHMEM's symmetric allocation (nvshmem.core.tensor)"
    returned = "ep_comm nvlink: rank 0: NVSHMEM's symmetric allocation (nvshmem.core.tensor) ended after"
    assert err.count("ep_comm nvlink:") == 2 and waited in err and "the job must be stopped" in err \
        and returned in err and err.index(waited) < err.index(returned), err
    region._free_symmetric(SlowAllocation(), region._tensor)  # (in time: stop() has joined the silent timer)
    assert capfd.readouterr().err == ""
    with pytest.raises(ValueError, match="seconds must be finite"):
        _ext._C.StallAnnouncer("never", float("nan"))


@pytest.mark.cpu
def test_nvshmem_setup_refused_where_it_was_started_on_another_gpu(monkeypatch):
    """NVSHMEM allocates on the GPU it was started on: a rank whose process started it on another GPU than the new
    Buffer's makes every rank take the same way out (CUDA IPC, or a raise under EP_COMM_PEER_MEMORY=nvshmem), with the
    reason, before any NVSHMEM call."""
    entered = []
    region = _region_with_stand_ins(monkeypatch, [(True, (0, 1), False, False), (True, (0, 1), False, True)],
                                    lambda *args: entered.append(args))
    why = region._setup_nvshmem()
    assert why is not None and why.startswith("rank 1 started NVSHMEM on another GPU than this Buffer's") \
        and entered == [], why


@pytest.mark.gpu
def test_nvlink_peer_link_query_agrees_with_cuda():
    """_C.nvlink_peer_link, the query of the nvlink backend's peer check (_peer_link_problem): a GPU is its own peer,
    with atomics; between two GPUs its access answer is cudaDeviceCanAccessPeer's (torch's), and it leaves the
    current device alone. (Whether a link has native atomics is the driver's answer; the multigpu tier's Buffers,
    which expect the nvlink backend from "auto", fail if NVLink-joined GPUs were refused for lacking them.)"""
    from ep_comm import _ext
    if not hasattr(_ext._C, "nvlink_peer_link"):
        pytest.skip("ep_comm._C was built without the nvlink kernels")
    current = torch.cuda.current_device()
    count = torch.cuda.device_count()
    for device in range(count):
        assert _ext._C.nvlink_peer_link(device, device) == (True, True)
        for peer in range(count):
            if peer != device:
                access, _ = _ext._C.nvlink_peer_link(device, peer)
                assert access == torch.cuda.can_device_access_peer(device, peer), (device, peer)
    assert torch.cuda.current_device() == current


@pytest.mark.cpu
@pytest.mark.parametrize("started_on, expected", [(1, True), (0, False)])
def test_nvshmem_setup_votes_on_the_gpu_nvshmem_started_on(monkeypatch, started_on, expected):
    """What this rank puts in the state vote: whether NVSHMEM, already initialized in this process, runs on another
    GPU than this Buffer's (cuda:0 here)."""
    from ep_comm.backends import nvlink
    voted = []
    region = _region_with_stand_ins(monkeypatch, None, lambda *args: None)
    region._gather = lambda mine: voted.append(mine) or [mine] * 2
    monkeypatch.setattr(nvlink, "_nvshmem_state",
                        {"initialized": True, "group_ranks": (0, 1), "device": started_on, "error": None})
    region._setup_nvshmem()
    assert voted[1] == (True, (0, 1), False, expected), voted


def current_device_kept_worker(rank, world):
    """A Buffer on GPU 1 used while GPU 0 is current: every call runs on GPU 1 and leaves GPU 0 current (the C++ entry
    points select the Buffer's device in their own CUDA runtime, which torch sees as the thread's current device)."""
    import ep_comm
    hidden, experts, topk = 256, 4, 2
    torch.cuda.set_device(1)
    buf = ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=8,
                         backend="nvlink")
    seen = []
    try:
        x, idx, w = (t.to("cuda:1") for t in _make_inputs(rank, 8, hidden, experts, topk, "uniform", world, seed=5))
        torch.cuda.set_device(0)
        res = buf.dispatch(x, idx, w)
        seen.append(torch.cuda.current_device())
        _, out = _expert_out(int(res.expert_offsets[-1]), res.num_rows, hidden, 4, rank)
        y = buf.combine(out.to("cuda:1"), res.handle)
        seen.append(torch.cuda.current_device())
        assert y.device == torch.device("cuda", 1), y.device
    finally:
        buf.destroy()
        seen.append(torch.cuda.current_device())
    assert seen == [0, 0, 0], f"current device after dispatch / combine / destroy: {seen}"
    return "ok"


@pytest.mark.multigpu
@pytest.mark.skipif(SHARED_GPU or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs a second GPU to make current")
def test_nvlink_calls_keep_the_callers_current_device():
    assert run_ranks(current_device_kept_worker, 1, backend="gloo", timeout_s=300) == ["ok"]


@pytest.mark.cpu
def test_nvlink_context_refuses_a_config_that_would_store_outside_the_region():
    """NvlinkContext (the C++ side) checks what the kernels' addressing relies on, also for a direct caller of ep_comm._C:
    a rank outside [0, world), an expert split that is not num_local * world, negative sizes, null base addresses,
    format codes it has no kernels for. The checks come before the context touches a GPU, so they run on the CPU."""
    import re
    from ep_comm import _ext
    if _ext._C is None or not hasattr(_ext._C, "NvlinkContext"):
        pytest.skip("ep_comm._C without the nvlink backend")
    source = open(os.path.join(os.path.dirname(__file__), "..", "csrc", "bind_nvlink.cpp")).read()
    good = {key: 0 for key in re.findall(r'get<[^>]+>\(d, "(\w+)"\)', source)}
    good.update(rank=0, world=2, hidden=256, num_experts=8, num_local=4, topk=2, max_tokens=8, max_recv_rows=64,
                disp_send_blocks=1, disp_recv_blocks=1, comb_send_blocks=1, comb_recv_blocks=1, peer_bases=64,
                local_base=64, state=64, error_word=64)
    for change, message in ((dict(rank=5), "rank must be in"), (dict(rank=-1), "rank must be in"),
                            (dict(num_local=3), "num_local \\* world"), (dict(hidden=-64), "positive multiple of 32"),
                            (dict(max_tokens=-7), ">= 0"), (dict(local_base=0), "must be device addresses"),
                            (dict(comb_fmt=3), "unknown combine format code 3"),
                            (dict(disp_fmt=-1), "unknown dispatch format code -1")):
        with pytest.raises(ValueError, match=message):
            _ext._C.NvlinkContext(0, dict(good, **change))
    # The Python side's combine format codes are the ones this build has kernels for (a Buffer refuses the others).
    from ep_comm.backends.nvlink import _COMBINE_FORMAT_CODE
    assert sorted(_COMBINE_FORMAT_CODE.values()) == sorted(_ext._C.nvlink_combine_format_codes)


@pytest.mark.cpu
@pytest.mark.parametrize("world", [1, 2])
def test_nvlink_failed_launch_gives_up(world):
    """A call's kernel launch that raises (RuntimeError) may follow one of the same call that went out (one C++ entry
    launches two or three kernels), leaving the device call counts one apart: the Buffer gives up -- the peers are
    told (give_up) and every later call raises, also at world 1 -- and the launch error is what the caller sees. An
    argument error (ValueError, raised before any launch) leaves it usable. On the host: a backend with stand-ins."""
    import ctypes
    import ep_comm.backends.nvlink as nvlink
    word = ctypes.c_uint64(0)
    backend = object.__new__(nvlink.NVLinkBackend)
    backend.world, backend.rank = world, 0
    backend._destroyed, backend._gave_up, backend._fault_reported = False, None, False
    backend._error_host = ctypes.addressof(word)
    told = []
    backend.give_up = lambda reason: None if world == 1 else (told.append(reason), setattr(backend, "_gave_up", reason))

    def refused(*args):
        raise ValueError("num_tokens out of range")

    with pytest.raises(ValueError, match="num_tokens out of range"):
        backend._launch_call("combine", refused, 1, 2)
    assert backend._gave_up is None and told == []
    backend.check()  # still usable

    def second_launch_fails(*args):
        raise RuntimeError("ep_comm CUDA error in dispatch receive kernel launch: too many resources requested")

    with pytest.raises(RuntimeError, match="dispatch receive kernel launch"):
        backend._launch_call("dispatch", second_launch_fails, 1, 2)
    assert backend._gave_up is not None and "dispatch: a kernel launch failed" in backend._gave_up
    assert told == ([] if world == 1 else [backend._gave_up])
    with pytest.raises(RuntimeError, match="gave up after an earlier call raised on this rank"):
        backend.check()
