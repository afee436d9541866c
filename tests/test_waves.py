"""Waves: the wave dispatch receive writes the grouped GEMM's operand rows expert by expert and w1 runs behind it
(csrc/waves.h, Buffer.dispatch_waves, MoELayer(waves=True)). Everything must be bitwise what the plain path gives."""
import dataclasses

import pytest
import torch

import ep_comm
from ep_comm import grouped_gemm as gemm
from ep_comm import moe
from harness import auto_backend, multigpu_backend, run_ranks
from test_moe import _graph_replay_matches_eager  # the whole layer captured once, replayed on new inputs
from test_nvlink import _make_inputs  # tokens with special values (zeros, subnormals, near-max, Inf, NaN)

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 256, 128, 8, 3  # H and I multiples of 64 (the fused GEMM)


def _weights(device):
    gen = torch.Generator().manual_seed(42)
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE ** 0.5
    router = torch.randn(EXPERTS, HIDDEN, generator=gen)
    return w1.to(device), w2.to(device), router.to(device)


# ---------------------------------------------------------------------------------------------------------------
# CPU tier: sizing rule and refusals
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_default_wave_sms_follows_bytes_and_flops():
    # DeepSeek-V3 shapes on 132 SMs: the receive needs ~8% of the GEMM's time per row; twice that share of the SMs.
    assert moe.default_wave_sms(7168, 2048, 132) == 19
    assert moe.default_wave_sms(7168, 2048, 132, "fp8_inexact") == 16  # fewer bytes per row, a faster w1
    with pytest.raises(ValueError, match="precision"):
        moe.default_wave_sms(7168, 2048, 132, "fp8")
    # A thinner expert (less GEMM work per received byte) needs more receive SMs; never more than half, never < 4.
    assert moe.default_wave_sms(7168, 256, 132) > moe.default_wave_sms(7168, 2048, 132)
    assert moe.default_wave_sms(7168, 16, 132) == 66
    assert moe.default_wave_sms(7168, 1 << 20, 132) == 4


def _refusal_worker(rank, world):
    w1, w2, router = _weights("cpu")
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        packed = moe.pack_weights(w1, w2)
        refused = []
        try:
            moe.MoELayer(buf, router, packed, waves=True)
            refused.append(False)
        except ValueError as error:
            refused.append("waves=True needs" in str(error))
        x = torch.randn(4, HIDDEN).to(torch.bfloat16)
        idx = torch.zeros(4, TOPK, dtype=torch.int64) + torch.arange(TOPK)
        try:
            buf.dispatch_waves(x, idx, torch.ones(4, TOPK), wave_sms=4)
            refused.append(False)
        except NotImplementedError as error:
            refused.append("nvlink" in str(error))
        layer = moe.MoELayer(buf, router, packed)  # the default: off wherever waves cannot run
        refused.append(layer.waves is False and layer.wave_sms is None)
        return refused


@pytest.mark.cpu
def test_waves_refused_where_they_cannot_run():
    assert run_ranks(_refusal_worker, 1, backend="gloo") == [[True, True, True]]


def _precision_refusal_worker(rank, world):
    """dispatch_waves' precision is checked before anything else (any backend): a str in grouped_gemm.PRECISIONS, and
    "fp8_inexact" only for hidden % 128 == 0. What each call raised (type name, message)."""
    raised = {}
    idx = torch.zeros(4, TOPK, dtype=torch.int64) + torch.arange(TOPK)
    for hidden in (HIDDEN, 192):  # 192: a multiple of 64 (and 32), not of 128
        x = torch.randn(4, hidden).to(torch.bfloat16)
        cases = {f"{hidden}/fp8": "fp8_inexact", f"{hidden}/bogus": "fp8", f"{hidden}/none": None}
        with ep_comm.Buffer(None, hidden=hidden, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
            for name, precision in cases.items():
                try:
                    buf.dispatch_waves(x, idx, torch.ones(4, TOPK), wave_sms=4, precision=precision)
                    raised[name] = ("nothing", "")
                except Exception as error:  # noqa: BLE001 (the type is what is checked)
                    raised[name] = (type(error).__name__, str(error))
    return raised


@pytest.mark.cpu
def test_wave_precision_refusals():
    raised, = run_ranks(_precision_refusal_worker, 1, backend="gloo")
    for hidden in (HIDDEN, 192):
        kind, message = raised[f"{hidden}/bogus"]
        assert kind == "ValueError" and "precision must be one of" in message and "fp8_inexact" in message, raised
        kind, message = raised[f"{hidden}/none"]
        assert kind == "TypeError" and "precision must be a str" in message, raised
    kind, message = raised["192/fp8"]
    assert kind == "ValueError" and "hidden % 128" in message and "192" in message, raised
    # hidden 256 takes the FP8 rows: refused only for the backend (waves need nvlink).
    assert raised[f"{HIDDEN}/fp8"][0] == "NotImplementedError", raised


@pytest.mark.cpu
def test_gemm_refuses_a_foreign_wave():
    w1, _, _ = _weights("cpu")
    weights = gemm.pack_gemm_weights(moe.pack_weights(w1, torch.zeros(EXPERTS, HIDDEN, INTERMEDIATE)).w1,
                                     swiglu=True)
    x = gemm.ExpandedRows(values=torch.zeros(4, HIDDEN, dtype=torch.float16), row_factor=torch.zeros(4))
    offsets = torch.tensor([0, 4] + [4] * (EXPERTS - 1), dtype=torch.int32)
    counts = torch.tensor([4] + [0] * (EXPERTS - 1), dtype=torch.int32)
    with pytest.raises(TypeError, match="WaveSync"):
        gemm.grouped_gemm_nvfp4(x, offsets, counts, weights, wave=object())
    wave = ep_comm.WaveSync(area=torch.zeros(2 + EXPERTS, dtype=torch.int64), epoch=0, abort=0, error_word=0,
                            timeout_ns=0)
    with pytest.raises(ValueError, match="CUDA grouped GEMM"):
        gemm.grouped_gemm_nvfp4(x, offsets, counts, weights, wave=wave, impl="reference")


# ---------------------------------------------------------------------------------------------------------------
# Two GPUs (nvlink): bitwise the plain path
# ---------------------------------------------------------------------------------------------------------------
def _routings(rank, num_tokens, device):
    """(name, topk_idx int64 [T, K], topk_weights fp32 [T, K]): balanced random, skewed onto rank 0's experts (rank
    1's experts and some of rank 0's get nothing), and masked slots (-1) with one token masked entirely."""
    gen = torch.Generator().manual_seed(900 + rank)
    picks = [torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(num_tokens)]
    balanced = torch.stack(picks) if picks else torch.zeros(0, TOPK, dtype=torch.int64)
    rank0_experts = torch.tensor([0, 1, 3])  # expert 2 and all of rank 1's get nothing
    skewed = rank0_experts[torch.stack([torch.randperm(3, generator=gen) for _ in range(num_tokens)])] \
        if num_tokens else balanced.clone()
    masked = balanced.clone()
    masked[::3, 1] = -1
    masked[:1, :] = -1
    weights = torch.rand(num_tokens, TOPK, generator=gen)
    return [(name, idx.to(device), weights.to(device)) for name, idx in
            (("balanced", balanced), ("skewed", skewed), ("masked", masked))]


def _equal(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _wave_dispatch_matches_plain(buf, packed_w1, x, idx, weights, wave_sms, precision="exact"):
    """dispatch_waves + the wave w1 GEMM against dispatch + expand_nvfp4_rows + w1 (both in `precision`): every
    defined byte equal."""
    plain = buf.dispatch(x, idx, weights)
    plain_rows = gemm.expand_nvfp4_rows(plain.x, num_rows_limit=plain.expert_offsets[-1:], precision=precision)
    # Allocated before the wave dispatch: no kernel may sit between its receive and the wave GEMM (a fill would end
    # the overlap).
    hidden = torch.zeros(plain.num_rows, packed_w1.out_features, dtype=torch.float32, device=x.device)
    waved = buf.dispatch_waves(x, idx, weights, wave_sms=wave_sms, precision=precision)
    result = waved.result
    gemm.grouped_gemm_nvfp4(waved.rows, result.expert_offsets, result.num_tokens_per_expert, packed_w1,
                            out_dtype=torch.float32, out=hidden, wave=waved.wave)
    stale_refused = False
    try:  # a WaveSync runs one GEMM: a second launch would find every work item taken
        gemm.grouped_gemm_nvfp4(waved.rows, result.expert_offsets, result.num_tokens_per_expert, packed_w1,
                                out_dtype=torch.float32, out=hidden, wave=waved.wave)
    except RuntimeError as error:
        stale_refused = "stale" in str(error)
    plain_hidden = torch.zeros_like(hidden)
    gemm.grouped_gemm_nvfp4(plain_rows, plain.expert_offsets, plain.num_tokens_per_expert, packed_w1,
                            out_dtype=torch.float32, out=plain_hidden)
    torch.cuda.synchronize()
    buf.check()
    checks = {}
    used = int(plain.expert_offsets[-1])
    checks["layout"] = _equal(result.expert_offsets, plain.expert_offsets) and _equal(
        result.num_tokens_per_expert, plain.num_tokens_per_expert)
    checks["metadata"] = all(_equal(getattr(result, f), getattr(plain, f))
                             for f in ("src_rank", "src_token", "topk_slot", "topk_weight"))
    checks["payload"] = all(_equal(getattr(result.x, f)[:used], getattr(plain.x, f)[:used])
                            for f in ("data", "scales", "amax"))
    # The GEMM operand rows: defined on every row of an expert (padding rows are not written).
    valid = torch.zeros(result.num_rows, dtype=torch.bool, device=x.device)
    for j, (start, count) in enumerate(zip(plain.expert_offsets[:-1].tolist(), plain.num_tokens_per_expert.tolist())):
        valid[start:start + count] = True
    checks["rows"] = _equal(waved.rows.values[valid], plain_rows.values[valid]) and _equal(
        waved.rows.row_factor[valid], plain_rows.row_factor[valid])
    checks["w1"] = _equal(hidden[valid], plain_hidden[valid])
    # The wave dispatch's handle combines like the plain one.
    expert_out = torch.randn(result.num_rows, buf.config.hidden, device=x.device,
                             generator=torch.Generator(device=x.device).manual_seed(5)).to(torch.bfloat16)
    checks["combine"] = _equal(buf.combine(expert_out, result.handle), buf.combine(expert_out, plain.handle))
    checks["stale_refused"] = stale_refused
    checks["rows_in_use"] = used
    return checks


def _edge_tokens(rank, world, num_tokens, hidden):
    """bf16 [T, H] on this rank's GPU whose first rows hold the special values of test_nvlink._make_inputs(edge=True):
    +0, -0, subnormals, near the bf16 maximum, scattered +-Inf and NaN, an outlier among tiny values."""
    return _make_inputs(rank, num_tokens, hidden, EXPERTS, TOPK, "uniform", world, seed=hidden + 7, edge=True)[0]


def _waves_worker(rank, world):
    device = torch.device("cuda", torch.cuda.current_device())
    w1, w2, router = _weights(device)
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    num_tokens = 40 + 9 * rank  # uneven token counts
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
    x = x.to(device)
    out = {"backend": None}
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=64,
                        expert_alignment=16, backend=auto_backend()) as buf:
        out["backend"] = buf.backend
        if buf.backend != "nvlink":
            return out
        packed = moe.pack_weights(w1[local], w2[local])
        packed_w1 = gemm.pack_gemm_weights(packed.w1, swiglu=True)
        dispatch_checks = {}
        for name, idx, weights in _routings(rank, num_tokens, device):
            for wave_sms in (1, 3, buf.max_wave_sms):
                dispatch_checks[f"{name}/{wave_sms}"] = _wave_dispatch_matches_plain(buf, packed_w1, x, idx, weights,
                                                                                     wave_sms)
        # No tokens on this rank at all (the other rank still sends).
        empty = x[:0] if rank == 1 else x
        idx, weights = _routings(rank, empty.shape[0], device)[0][1:]
        dispatch_checks["rank1_empty"] = _wave_dispatch_matches_plain(buf, packed_w1, empty, idx, weights, 2)
        # Special token values through the wave receive and the wave GEMM.
        edge_x = _edge_tokens(rank, world, num_tokens, HIDDEN)
        for name, idx, weights in _routings(rank, num_tokens, device)[::2]:
            dispatch_checks[f"edge/{name}"] = _wave_dispatch_matches_plain(buf, packed_w1, edge_x, idx, weights, 3)
        out["dispatch"] = dispatch_checks

        layers = {}
        # Token tiles: the automatic one (64 here), 16 (three CTAs per SM) and 128 (a main launch with waves and a
        # remainder launch after it, without).
        for combine_rows, tile in ((True, None), (False, None), (True, 16), (True, 128)):
            plain = moe.MoELayer(buf, router, packed, combine_rows=combine_rows, token_tile=tile, waves=False)
            waved = moe.MoELayer(buf, router, packed, combine_rows=combine_rows, token_tile=tile)  # waves: default
            want = plain(x)
            got = [waved(x) for _ in range(3)]
            interleaved = [plain(x), waved(x)]  # plain and wave calls in any order keep the flags in step
            torch.cuda.synchronize()
            layers[f"rows={combine_rows}/tile={waved.token_tile}"] = {
                "waves": waved.waves, "wave_sms": waved.wave_sms,
                "equal": all(_equal(y, want) for y in got + interleaved),
                "graph": _graph_replay_matches_eager(waved, x, rank)}
        out["layers"] = layers
    # A wave GEMM whose receive never publishes (an area that no dispatch writes): a timeout error naming the
    # stage, not a hang. Own Buffer: it is unusable afterwards.
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=64,
                        timeout_s=0.5, backend=auto_backend()) as buf:
        stray_area = torch.zeros(ep_comm._ext._C.wave_area_fixed_words + EXPERTS // world, dtype=torch.int64,
                                 device=device)  # made before the dispatch: no kernel in between
        waved = buf.dispatch_waves(x, *(_routings(rank, num_tokens, device)[0][1:]), wave_sms=2)
        stray = dataclasses.replace(waved.wave, area=stray_area)
        result = waved.result
        gemm.grouped_gemm_nvfp4(waved.rows, result.expert_offsets, result.num_tokens_per_expert, packed_w1,
                                out_dtype=torch.float32, wave=stray)
        torch.cuda.synchronize()
        try:
            buf.check()
            out["timeout"] = "no error"
        except RuntimeError as error:
            out["timeout"] = str(error)
    out["duplicate_ids"] = _unchecked_duplicate_ids(rank, world, device, x, packed_w1)
    return out


def _unchecked_duplicate_ids(rank, world, device, x, packed_w1):
    """check_inputs=False and every token naming expert 0 (rank 0's) in both of its slots: each source sends expert 0
    two rows per token, 2 T_max in all, so positions past T_max reach the wave receive's per-(source, expert) index
    lists. The receive must record a fault for them and skip those rows (not read the next list's entries), and the
    wave GEMM, which then waits for rows that never come, must give up at once on the Buffer's abort flag instead of
    running into its timeout. What rank 0's check() says, and the seconds until the GEMM was done."""
    import time
    tokens = 16
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=2, max_tokens_per_rank=tokens,
                        timeout_s=30.0, check_inputs=False, backend=auto_backend()) as buf:
        idx = torch.zeros(tokens, 2, dtype=torch.int64, device=device)
        weights = torch.ones(tokens, 2, device=device)
        torch.cuda.synchronize()
        start = time.monotonic()
        waved = buf.dispatch_waves(x[:tokens], idx, weights, wave_sms=2)
        result = waved.result
        gemm.grouped_gemm_nvfp4(waved.rows, result.expert_offsets, result.num_tokens_per_expert, packed_w1,
                                out_dtype=torch.float32, wave=waved.wave)
        torch.cuda.synchronize()
        seconds = time.monotonic() - start
        try:
            buf.check()
            error = "no error"
        except RuntimeError as raised:
            error = str(raised)
    return {"error": error, "seconds": seconds, "expects_fault": rank == 0}


def check_waves_result(result):
    """The assertions on one rank's _waves_worker result (also run at world 1 by bench/device_run.sh)."""
    for name, checks in result["dispatch"].items():
        assert all(v for k, v in checks.items() if k != "rows_in_use"), (name, checks)
    assert result["dispatch"]["balanced/1"]["rows_in_use"] > 0
    for name, layer in result["layers"].items():
        assert layer["waves"] and layer["wave_sms"] >= 1, layer
        assert layer["equal"] and layer["graph"], (name, layer)
    assert "wave GEMM" in result["timeout"] and "timed out" in result["timeout"], result["timeout"]
    duplicate = result["duplicate_ids"]
    if duplicate["expects_fault"]:  # rank 0: the fault, named as such, long before the 30 s timeout
        assert "outside its result" in duplicate["error"] and "two top-k slots" in duplicate["error"], duplicate
        assert duplicate["seconds"] < 10.0, duplicate
    else:  # no row of this call comes to the other ranks: nothing to report
        assert duplicate["error"] == "no error", duplicate


@pytest.mark.multigpu
def test_waves_are_bitwise_the_plain_path():
    for result in run_ranks(_waves_worker, 2, backend=multigpu_backend()):
        if result["backend"] != "nvlink":
            pytest.skip(f"waves need the nvlink backend (the GPUs are not NVLink peers: {result['backend']})")
        check_waves_result(result)


def _fp8_wave_rows_match(buf, x, idx, weights, wave_sms):
    """dispatch_waves(precision="fp8_inexact") against dispatch and the exact wave dispatch: the FP8 operand rows
    bitwise expand_nvfp4_rows(result.x, precision="fp8_inexact") (CUDA kernel and torch reference) on every row of an
    expert, the result (payload, layout, metadata) bitwise the plain one. (The GEMM behind an FP8 wave dispatch:
    _wave_dispatch_matches_plain with precision="fp8_inexact".)"""
    plain = buf.dispatch(x, idx, weights)
    exact = buf.dispatch_waves(x, idx, weights, wave_sms=wave_sms)
    fp8 = buf.dispatch_waves(x, idx, weights, wave_sms=wave_sms, precision="fp8_inexact")
    torch.cuda.synchronize()
    buf.check()
    result, rows = fp8.result, fp8.rows
    used = int(plain.expert_offsets[-1])
    checks = {"form": rows.precision == "fp8_inexact" and exact.rows.precision == "exact"
              and rows.values.dtype == torch.float8_e4m3fn
              and tuple(rows.values.shape) == (result.num_rows, buf.config.hidden)
              and rows.row_factor.dtype == torch.float32 and tuple(rows.row_factor.shape) == (result.num_rows,)}
    checks["layout"] = _equal(result.expert_offsets, plain.expert_offsets) and _equal(
        result.num_tokens_per_expert, plain.num_tokens_per_expert)
    checks["metadata"] = all(_equal(getattr(result, f), getattr(plain, f))
                             for f in ("src_rank", "src_token", "topk_slot", "topk_weight"))
    checks["payload"] = all(_equal(getattr(result.x, f)[:used], getattr(plain.x, f)[:used])
                            and _equal(getattr(result.x, f)[:used], getattr(exact.result.x, f)[:used])
                            for f in ("data", "scales", "amax"))
    valid = torch.zeros(result.num_rows, dtype=torch.bool, device=x.device)
    for start, count in zip(plain.expert_offsets[:-1].tolist(), plain.num_tokens_per_expert.tolist()):
        valid[start:start + count] = True
    for impl in ("auto", "reference"):
        want = gemm.expand_nvfp4_rows(result.x, impl=impl, precision="fp8_inexact")
        checks[f"rows/{impl}"] = want.precision == "fp8_inexact" and _equal(
            rows.values[valid].view(torch.uint8), want.values[valid].view(torch.uint8)) and _equal(
            rows.row_factor[valid], want.row_factor[valid])
    # The exact wave rows of the same call stay what they were (the FP8 form is a separate instantiation).
    want_exact = gemm.expand_nvfp4_rows(result.x)
    checks["exact_rows"] = _equal(exact.rows.values[valid], want_exact.values[valid]) and _equal(
        exact.rows.row_factor[valid], want_exact.row_factor[valid])
    checks["rows_in_use"] = used
    return checks


# H = 7168 (two full steps of the receive per row), 640 (a step whose last words cover only half the warp's lanes) and
# the other wave tests' 256.
FP8_WAVE_HIDDENS = (7168, 640, HIDDEN)


def _fp8_waves_worker(rank, world):
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens = 40 + 9 * rank  # uneven token counts
    out = {"backend": None, "dispatch": {}, "backend_refusal": {}}
    for hidden in FP8_WAVE_HIDDENS:
        x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(100 + rank))
        x = (x * torch.logspace(-3, 3, num_tokens)[:, None]).to(torch.bfloat16).to(device)  # rows of all sizes
        with ep_comm.Buffer(None, hidden=hidden, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=64,
                            expert_alignment=16, backend=auto_backend()) as buf:
            out["backend"] = buf.backend
            if buf.backend != "nvlink":
                return out
            for name, idx, weights in _routings(rank, num_tokens, device):
                for wave_sms in (1, 3, buf.max_wave_sms):
                    out["dispatch"][f"{hidden}/{name}/{wave_sms}"] = _fp8_wave_rows_match(buf, x, idx, weights,
                                                                                          wave_sms)
            empty = x[:0] if rank == 1 else x  # no tokens on rank 1 (the others still send)
            idx, weights = _routings(rank, empty.shape[0], device)[0][1:]
            out["dispatch"][f"{hidden}/rank1_empty"] = _fp8_wave_rows_match(buf, empty, idx, weights, 2)
            edge_x = _edge_tokens(rank, world, num_tokens, hidden)  # special token values
            for name, idx, weights in _routings(rank, num_tokens, device)[::2]:
                out["dispatch"][f"{hidden}/edge/{name}"] = _fp8_wave_rows_match(buf, edge_x, idx, weights, 3)
            # The FP8 w1 GEMM behind the FP8 wave receive: bitwise the plain dispatch + FP8 expansion + w1.
            gen = torch.Generator().manual_seed(hidden)
            local = EXPERTS // world
            packed = moe.pack_weights(torch.randn(local, 2 * INTERMEDIATE, hidden, generator=gen).to(device),
                                      torch.randn(local, hidden, INTERMEDIATE, generator=gen).to(device))
            packed_w1 = gemm.pack_gemm_weights(packed.w1, swiglu=True)
            for name, idx, weights in _routings(rank, num_tokens, device)[:2]:
                for wave_sms in (3, buf.max_wave_sms):
                    out["dispatch"][f"{hidden}/gemm/{name}/{wave_sms}"] = _wave_dispatch_matches_plain(
                        buf, packed_w1, x, idx, weights, wave_sms, precision="fp8_inexact")
            idx, weights = _routings(rank, num_tokens, device)[0][1:]
            out["dispatch"][f"{hidden}/gemm/edge"] = _wave_dispatch_matches_plain(
                buf, packed_w1, edge_x, idx, weights, 3, precision="fp8_inexact")
            # The backend refuses what Buffer.dispatch_waves refuses first.
            try:
                buf._backend.dispatch_waves(x, *_routings(rank, num_tokens, device)[0][1:], 2, precision="fp16")
                out["backend_refusal"][hidden] = "nothing"
            except ValueError as error:
                out["backend_refusal"][hidden] = str(error)
    return out


def check_fp8_waves_result(result):
    """The assertions on one rank's _fp8_waves_worker result (any world size)."""
    for name, checks in result["dispatch"].items():
        assert all(v for k, v in checks.items() if k != "rows_in_use"), (name, checks)
    for hidden in FP8_WAVE_HIDDENS:
        assert result["dispatch"][f"{hidden}/balanced/1"]["rows_in_use"] > 0
    assert sorted(result["backend_refusal"]) == sorted(FP8_WAVE_HIDDENS), result["backend_refusal"]
    assert all("precision must be one of" in text for text in result["backend_refusal"].values()), \
        result["backend_refusal"]


@pytest.mark.gpu
def test_fp8_wave_rows_are_bitwise_expand_nvfp4_rows_world1():
    result, = run_ranks(_fp8_waves_worker, 1, backend="nccl")
    if result["backend"] != "nvlink":
        pytest.skip(f"waves need the nvlink backend (got {result['backend']})")
    check_fp8_waves_result(result)


@pytest.mark.multigpu
def test_fp8_wave_rows_are_bitwise_expand_nvfp4_rows():
    for result in run_ranks(_fp8_waves_worker, 2, backend=multigpu_backend()):
        if result["backend"] != "nvlink":
            pytest.skip(f"waves need the nvlink backend (the GPUs are not NVLink peers: {result['backend']})")
        check_fp8_waves_result(result)


@pytest.mark.cpu
def test_wave_sync_is_single_use():
    """The host-side ticket behind WaveSync.claim: refused once used or superseded, and on a destroyed Buffer (the
    stream check needs a GPU: tests above)."""
    from ep_comm.backends.nvlink import _WaveTicket

    class Backend:
        _destroyed = False
        _wave_ticket = None

    backend = Backend()
    ticket = _WaveTicket(backend, stream=0)
    with pytest.raises(RuntimeError, match="stale"):  # superseded (another call cleared it) or already claimed
        ticket.claim()
    backend._wave_ticket = ticket
    backend._destroyed = True
    with pytest.raises(RuntimeError, match="destroyed"):
        ticket.claim()
