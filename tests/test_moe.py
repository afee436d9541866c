"""MoELayer on gloo ranks (reference experts) and on GPUs (fused NVFP4 grouped GEMM and reference experts) against
a token-by-token single-process oracle."""
import dataclasses

import pytest
import torch

import ep_comm
from ep_comm import formats, moe
from format_cases import require_format_kernels
from harness import auto_backend, multigpu_backend, nvlink_can_run, run_ranks
from oracle import Case, expected_combine, nvfp4_expert_mlp

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 128, 64, 8, 3


def _master_weights():
    gen = torch.Generator().manual_seed(42)
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE ** 0.5
    router = torch.randn(EXPERTS, HIDDEN, generator=gen)
    return w1, w2, router


ROUTINGS = ("balanced", "skewed")


def _layer_inputs(routing, world, router):
    """Tokens per rank, every rank's x (bf16 [T_r, H]) and the router for one routing kind, made from `router`
    [E, H]. "balanced": Gaussian tokens and router rows as given (each expert gets ~T * K / E rows). "skewed":
    every token and every router row share a direction d (x.d = 2 for every token, router rows 0.05 * Gaussian +
    pull_e * d), so experts 0 and 1 are in nearly
    every token's top-k, 2-4 share the third slot and 5-7 get nothing (at world 2: 137, 137, 62, 33, 42, 0, 0, 0 rows;
    rank 0 holds 369 of the 411 rows, a hot expert spans more than one token tile and rank 1 has three empty experts),
    while the top-k logits stay within ~2 of each other, so every slot's weight matters (smallest ~0.03)."""
    if routing == "balanced":
        tokens = tuple(20 + 7 * r for r in range(world))
        return tokens, [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(100 + r)).to(torch.bfloat16)
                        for r, t in enumerate(tokens)], router
    assert routing == "skewed", routing
    direction = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7))
    direction /= direction.norm()
    pull = torch.tensor([1.5, 1.5, 0.75, 0.75, 0.75, 0.0, 0.0, 0.0])
    assert pull.numel() == EXPERTS
    tokens = tuple(60 + 17 * r for r in range(world))
    xs = []
    for r, t in enumerate(tokens):
        z = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(100 + r))
        xs.append((z - (z @ direction)[:, None] * direction + 2.0 * direction).to(torch.bfloat16))
    return tokens, xs, 0.05 * router + pull[:, None] * direction


def _masked_slots(topk_idx):
    """A copy of topk_idx [T, K] with -1 slots: slot 0 of every third token, slot K - 1 of every fourth, and every
    slot of token 1 (its combine output must be zero)."""
    masked = topk_idx.clone()
    masked[::3, 0] = -1
    masked[::4, -1] = -1
    masked[1] = -1
    return masked


def _moe_worker(rank, world, device_kind="cpu", backend="auto", routing="balanced", combine_format="s2f6"):
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    w1, w2, router = _master_weights()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    tokens, xs, router = _layer_inputs(routing, world, router)
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=max(tokens),
                        combine_format=combine_format, backend=backend) as buf:
        packed = moe.pack_weights(w1[local].to(device), w2[local].to(device))
        layer = moe.MoELayer(buf, router.to(device), packed)
        try:
            moe.MoELayer(buf, router.to(device), packed, token_tile=100)
            bad_tile_refused = False
        except ValueError as error:
            bad_tile_refused = "token_tile must be None or one of" in str(error)
        try:  # combine_rows needs fused experts on the nvlink backend: refused clearly elsewhere
            moe.MoELayer(buf, router.to(device), packed, expert_impl="reference", combine_rows=True)
            combine_rows_refused = False
        except ValueError as error:
            combine_rows_refused = "combine_rows=True needs" in str(error)
        rows_api_refused = True  # Buffer.begin_combine_rows: the reference backend has no peer addresses to offer
        if buf.backend == "reference":
            result = buf.dispatch(xs[rank].to(device), *layer.route(xs[rank].to(device)))
            try:
                buf.begin_combine_rows(result)
                rows_api_refused = False
            except NotImplementedError:
                pass
            try:  # and a layer without combine rows refuses the combined call before any work
                layer.experts_and_combine_rows(result)
                rows_api_refused = False
            except ValueError as error:
                rows_api_refused = rows_api_refused and "combine_rows=True" in str(error)
            buf.combine(layer.experts(result), result.handle)  # the reference backend's collectives stay in step
        y = layer(xs[rank].to(device)).cpu()
        y_again = layer(xs[rank].to(device)).cpu()
        # The weights a layer hands back for saving are the ones it was given, bitwise (the fused path unpacks them
        # from its packed copy, which is the only one it keeps).
        given, back = packed, layer.weights
        weights_kept = (layer._weights is None) == (layer.expert_impl == "fused") and all(
            torch.equal(getattr(given, w).data, getattr(back, w).data)
            and torch.equal(getattr(given, w).scales.view(torch.uint8), getattr(back, w).scales.view(torch.uint8))
            and torch.equal(getattr(given, w).amax, getattr(back, w).amax) for w in ("w1", "w2"))
        backend, expert_impl, layer_combine_rows = buf.backend, layer.expert_impl, layer.combine_rows
        # The routing the oracle uses is computed here from its definition (FP32 logits, top-k, softmax over the k
        # chosen logits), not taken from layer.route, which is under test: it must agree with it.
        inputs = []
        for x in xs:
            logits = x.to(device).float() @ router.to(device).float().t()
            top_logits, idx_want = logits.topk(TOPK, dim=-1)
            w_want = torch.softmax(top_logits, dim=-1)
            idx_got, w_got = layer.route(x.to(device))
            assert torch.equal(idx_got, idx_want), "MoELayer.route picked other experts than FP32 logits + top-k"
            assert w_got.dtype == torch.float32 and torch.allclose(w_got, w_want, rtol=1e-6, atol=0.0), \
                "MoELayer.route weights are not the softmax over the top-k logits"
            inputs.append((x, idx_want.cpu(), w_want.cpu()))
        # On GPUs: the fused GEMM against the reference experts with the same combine (local_reduce=True), to bound
        # the GEMM's difference directly.
        y_reference = (moe.MoELayer(buf, router.to(device), packed, expert_impl="reference")(xs[rank].to(device)).cpu()
                       if device_kind == "cuda" else y)
        y_fused = (moe.MoELayer(buf, router.to(device), packed, combine_rows=False)(xs[rank].to(device)).cpu()
                   if device_kind == "cuda" else y)
        graph_equal = _graph_replay_matches_eager(layer, xs[rank].to(device), rank) if expert_impl == "fused" else None
        rows = _combine_rows_checks(buf, router.to(device), packed, xs[rank].to(device), rank) \
            if expert_impl == "fused" and buf.combine_rows_supported else None
        # Masked routing (-1 slots: the router never masks, a caller's routing may): the layer's experts between the
        # Buffer's dispatch and combine, against the oracle below on the same masked inputs.
        masked_inputs = [(x, _masked_slots(idx), w) for x, idx, w in inputs]
        x_m, idx_m, w_m = masked_inputs[rank]
        result_m = buf.dispatch(x_m.to(device), idx_m.to(device), w_m.to(device))
        y_masked = buf.combine(layer.experts(result_m), result_m.handle).cpu()
        default_precision = layer.expert_precision

    # Oracle: every token alone, the same quantization points, the combine semantics of DESIGN.md §3.
    packed_all = moe.pack_weights(w1, w2)
    w1_all = formats.nvfp4_dequantize(packed_all.w1)
    w2_all = formats.nvfp4_dequantize(packed_all.w2)
    case = Case("moe", HIDDEN, EXPERTS, TOPK, tokens, "uniform" if routing == "balanced" else routing,
                combine_format=combine_format)
    # Both combine modes' oracles: the layer's own semantics (one row per (token, expert) when w2 writes the combine
    # rows itself) must be the nearer one -- the GPU bounds on vs_oracle alone are too loose to tell the modes apart.
    expert_fn = lambda payload, e: nvfp4_expert_mlp(payload, w1_all[e], w2_all[e])  # noqa: E731
    want_by_mode = {mode: expected_combine(case, rank, world, inputs, local_reduce=mode, expert_fn=expert_fn)
                    for mode in (True, False)}
    want = want_by_mode[not layer_combine_rows]
    want_masked = expected_combine(case, rank, world, masked_inputs, local_reduce=True, expert_fn=expert_fn)
    # Unquantized FP32 layer: the error NVFP4 dispatch + NVFP4 weights/activations + S2F6 combine cost.
    x, idx, w = inputs[rank]
    exact = torch.zeros(x.shape[0], HIDDEN)
    for slot in range(TOPK):
        for e in range(EXPERTS):
            sel = idx[:, slot] == e
            if sel.any():
                gate, up = (x[sel].float() @ w1[e].t()).chunk(2, dim=-1)
                exact[sel] += w[sel, slot, None] * ((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    if rows is not None:  # the combine-row layer against the local_reduce=False oracle (and the other mode's)
        y_rows = rows.pop("y")
        rows["vs_oracle"], rows["vs_other_mode"] = rel(y_rows, want_by_mode[False]), rel(y_rows, want_by_mode[True])
    return {"vs_oracle": rel(y, want), "vs_other_mode": rel(y, want_by_mode[layer_combine_rows]),
            "deterministic": torch.equal(y, y_again), "vs_fp32": rel(y, exact),
            "backend": backend, "expert_impl": expert_impl, "fused_vs_reference": rel(y_fused, y_reference),
            "graph_equal": graph_equal, "bad_tile_refused": bad_tile_refused, "combine_rows": rows,
            "combine_rows_refused": combine_rows_refused, "layer_combine_rows": layer_combine_rows,
            "rows_api_refused": rows_api_refused, "weights_kept": weights_kept,
            "masked_vs_oracle": rel(y_masked, want_masked), "masked_token_zero": not y_masked[1].any().item(),
            "default_precision": default_precision, "combine_format": combine_format,
            # rows per expert over every rank's tokens (the oracle's routing): what check_routing tests
            "rows_per_expert": torch.bincount(torch.cat([i.flatten() for _, i, _ in inputs]), minlength=EXPERTS)
            .tolist(), "routing": routing}


def check_routing(result):
    """The routing the worker's inputs gave is the kind it was meant to test: balanced (every expert has rows, none
    more than twice the mean), or skewed (some expert empty, the busiest more than twice the mean)."""
    rows = result["rows_per_expert"]
    mean = sum(rows) / len(rows)
    if result["routing"] == "balanced":
        assert min(rows) > 0 and max(rows) <= 2 * mean, rows
    else:
        assert min(rows) == 0 and max(rows) > 2 * mean, rows


def _moe_edge_worker(rank, world, device_kind="cpu", backend="auto"):
    """The layer's default path with top-1 routing and an idle rank, as serving often has: rank 0 forwards 0 tokens
    (every rank at world 1), then a few; a transposed (non-contiguous) input gives the contiguous one's bits. Each
    forward against the token-by-token oracle of `_moe_worker` (its routing from layer.route, which that worker
    checks)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    w1, w2, router = _master_weights()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    packed_all = moe.pack_weights(w1, w2)
    w1_all, w2_all = formats.nvfp4_dequantize(packed_all.w1), formats.nvfp4_dequantize(packed_all.w2)
    expert_fn = lambda payload, e: nvfp4_expert_mlp(payload, w1_all[e], w2_all[e])  # noqa: E731
    out = {}
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=1, max_tokens_per_rank=16,
                        backend=backend) as buf:
        layer = moe.MoELayer(buf, router.to(device), moe.pack_weights(w1[local].to(device), w2[local].to(device)))
        for name, tokens in (("idle rank 0", (0,) + tuple(9 + r for r in range(1, world))),
                             ("after it", tuple(5 + r for r in range(world)))):
            xs = [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(300 + 10 * r + t))
                  .to(torch.bfloat16) for r, t in enumerate(tokens)]
            y = layer(xs[rank].to(device)).cpu()
            inputs = [(x, *(t.cpu() for t in layer.route(x.to(device)))) for x in xs]
            want = expected_combine(Case("moe-edge", HIDDEN, EXPERTS, 1, tokens, "uniform"), rank, world, inputs,
                                    local_reduce=not layer.combine_rows, expert_fn=expert_fn)
            error = 0.0 if tokens[rank] == 0 else ((y.float() - want.float()).norm() / want.float().norm()).item()
            out[name] = {"shape": tuple(y.shape), "dtype": y.dtype, "vs_oracle": error}
        x_t = xs[rank].t().contiguous().t().to(device)  # same values, column-major
        out["transposed_equal"] = not x_t.is_contiguous() and torch.equal(layer(x_t).cpu(), y)
        out["expert_impl"], out["backend"] = layer.expert_impl, buf.backend
    return out


FP8_HIDDEN, FP8_INTERMEDIATE = 256, 128  # the FP8 mode's K % 128


def _fp8_expert_oracle(w1_packed, w2_packed):
    """expert_fn for expected_combine: one expert of MoELayer(expert_precision="fp8_inexact") on the reference paths
    (FP8 rows of the token, w1 with SwiGLU, NVFP4 4/6 of the hidden row, FP8 rows, w2; FP32, then bf16)."""
    from ep_comm import grouped_gemm as G

    def run(payload, expert):
        one = [torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)]
        w1, w2 = w1_packed.experts(expert, expert + 1), w2_packed.experts(expert, expert + 1)
        h = G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(payload, impl="reference", precision="fp8_inexact"), *one, w1,
                                 out_dtype=torch.float32, impl="reference")
        q = formats.nvfp4_quantize(h, four_over_six=True, impl="reference")
        return G.grouped_gemm_nvfp4(G.expand_nvfp4_rows(q, impl="reference", precision="fp8_inexact"), *one, w2,
                                    impl="reference")
    return run


def _moe_fp8_worker(rank, world, device_kind="cuda", backend="auto"):
    """MoELayer(expert_precision="fp8_inexact") on the GPU, in its default form (waves and combine rows where they can
    run: the nvlink backend) and without them: each against the token-by-token oracle of the same FP8 steps (what
    differs is the kernel's FP8 accumulation, which can move a few NVFP4 roundings of the w2 input) with the combine
    semantics of its form; the waves bitwise the plain dispatch; the combine rows bitwise `Buffer.combine(experts,
    local_reduce=False)`; against the exact layer on the same Buffer (the mode's error); its refusals (a reference
    layer, a bad name); and a CUDA graph of its forward replayed on new inputs (bitwise eager)."""
    from ep_comm import grouped_gemm as G
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(43)
    w1 = torch.randn(EXPERTS, 2 * FP8_INTERMEDIATE, FP8_HIDDEN, generator=gen) / FP8_HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, FP8_HIDDEN, FP8_INTERMEDIATE, generator=gen) / FP8_INTERMEDIATE ** 0.5
    router = torch.randn(EXPERTS, FP8_HIDDEN, generator=gen)
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    packed_all = moe.pack_weights(w1, w2)
    oracle = _fp8_expert_oracle(G.pack_gemm_weights(packed_all.w1, swiglu=True),
                                G.pack_gemm_weights(packed_all.w2, swiglu=False))
    tokens = tuple(6 + 3 * r for r in range(world))
    xs = [torch.randn(t, FP8_HIDDEN, generator=torch.Generator().manual_seed(500 + r)).to(torch.bfloat16)
          for r, t in enumerate(tokens)]
    out = {}
    with ep_comm.Buffer(None, hidden=FP8_HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=16,
                        backend=backend) as buf:
        packed = moe.pack_weights(w1[local].to(device), w2[local].to(device))
        layer = moe.MoELayer(buf, router.to(device), packed, expert_precision="fp8_inexact")
        plain = moe.MoELayer(buf, router.to(device), packed, expert_precision="fp8_inexact", waves=False,
                             combine_rows=False)
        exact = moe.MoELayer(buf, router.to(device), packed)
        x = xs[rank].to(device)
        y, y_plain, y_exact = layer(x).cpu(), plain(x).cpu(), exact(x).cpu()
        inputs = [(t, *(r.cpu() for r in layer.route(t.to(device)))) for t in xs]
        case = Case("moe-fp8", FP8_HIDDEN, EXPERTS, TOPK, tokens, "uniform")
        want = expected_combine(case, rank, world, inputs, local_reduce=not layer.combine_rows, expert_fn=oracle)
        want_plain = expected_combine(case, rank, world, inputs, local_reduce=True, expert_fn=oracle)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        out.update(vs_oracle=rel(y, want), plain_vs_oracle=rel(y_plain, want_plain), vs_exact=rel(y, y_exact),
                   waves=layer.waves, combine_rows=layer.combine_rows, expert_impl=layer.expert_impl,
                   backend=buf.backend, plain_forms=(plain.waves, plain.combine_rows),
                   graph_equal=_graph_replay_matches_eager(layer, x, rank))
        if layer.waves:  # the wave receive's FP8 rows and w1 behind it: bitwise the plain dispatch's path
            waves_only = moe.MoELayer(buf, router.to(device), packed, expert_precision="fp8_inexact",
                                      combine_rows=False)
            out["waves_equal"] = torch.equal(waves_only(x).view(torch.int16), plain(x).view(torch.int16))
        if layer.combine_rows:  # w2's FP8 combine-row epilogue: bitwise the bf16 experts through combine
            idx, weights = layer.route(x)
            result = buf.dispatch(x, idx, weights)
            expected = buf.combine(layer.experts(result), result.handle, local_reduce=False)
            got = layer.experts_and_combine_rows(result)
            out["combine_rows_equal"] = torch.equal(got.view(torch.int16), expected.view(torch.int16))
        refused = []
        for kwargs, message in (({"expert_impl": "reference"}, "mode of the fused grouped GEMM"),
                                ({"expert_precision": "fp8"}, "expert_precision must be one of")):
            try:
                moe.MoELayer(buf, router.to(device), packed, **{"expert_precision": "fp8_inexact", **kwargs})
            except ValueError as error:
                if message in str(error):
                    refused.append(tuple(kwargs))
        out["refused"] = refused
        # The layer's experts are fused_expert_mlp in that mode, bit for bit.
        idx, weights = layer.route(xs[rank].to(device))
        result = buf.dispatch(xs[rank].to(device), idx, weights)
        mlp = moe.fused_expert_mlp(result.x, result.expert_offsets, result.num_tokens_per_expert, layer._w1_packed,
                                   layer._w2_packed, token_tile=layer.token_tile, precision="fp8_inexact")
        rows = int(result.expert_offsets[-1])
        out["experts_equal"] = torch.equal(layer.experts(result)[:rows].view(torch.int16), mlp[:rows].view(torch.int16))
        out["precision_read_only"] = False
        try:
            layer.expert_precision = "exact"
        except AttributeError:
            out["precision_read_only"] = True
    return out


def check_moe_fp8_result(result):
    nvlink = result["backend"] == "nvlink"
    assert result["expert_impl"] == "fused" and result["waves"] == result["combine_rows"] == nvlink, result
    assert result["plain_forms"] == (False, False), result
    if nvlink:
        assert result["waves_equal"] and result["combine_rows_equal"], result
    # The kernel's FP8 accumulation differs from the oracle's FP32 by ~2e-3 in w1's output (tests/
    # test_grouped_gemm_fp8.py); that moves some NVFP4 roundings of the w2 input, and a 2e-3 perturbation of w1's
    # output moves this MLP's result by ~2.5% (a CPU check at these shapes). Measured 2.9% (H200, world 1 and 2 ranks
    # sharing it). Integration errors show as 10% (the exact mode's rows) or more.
    assert result["vs_oracle"] < 5e-2 and result["plain_vs_oracle"] < 5e-2, result
    assert 0.0 < result["vs_exact"] < 0.2, result  # the FP8 mode really ran (not the exact kernels' bits)
    assert len(result["refused"]) == 2, result
    assert result["graph_equal"], result  # captured once, replayed on new inputs: bitwise eager
    assert result["experts_equal"] and result["precision_read_only"], result


def check_moe_edge_result(result, rank, world, bound):
    assert result["idle rank 0"]["shape"] == ((0 if rank == 0 else 9 + rank), HIDDEN), result
    assert result["after it"]["shape"] == (5 + rank, HIDDEN), result
    assert result["idle rank 0"]["dtype"] == result["after it"]["dtype"] == torch.bfloat16, result
    assert result["idle rank 0"]["vs_oracle"] < bound and result["after it"]["vs_oracle"] < bound, result
    assert result["transposed_equal"], result


def _combine_rows_checks(buf, router, packed, x, rank):
    """MoELayer(combine_rows=True) on the nvlink backend: w2's epilogue stores RHT + S2F6 rows into the source ranks'
    combine areas. Bitwise `Buffer.combine(experts(result), handle, local_reduce=False)` on the same dispatch, the
    same twice, and captured in a CUDA graph (replay bitwise eager)."""
    layer = moe.MoELayer(buf, router, packed, combine_rows=True)
    topk_idx, topk_weights = layer.route(x)
    result = buf.dispatch(x, topk_idx, topk_weights)
    expected = buf.combine(layer.experts(result), result.handle, local_reduce=False)
    got = layer.experts_and_combine_rows(result)
    again = layer.experts_and_combine_rows(result)
    # Masked top-k slots (-1; the router never masks, a caller may): every third token's second slot, and the first
    # token entirely -- its output row must be zero, as combine's.
    masked_idx = topk_idx.clone()
    masked_idx[::3, 1 % masked_idx.shape[1]] = -1
    masked_idx[:1] = -1
    masked = buf.dispatch(x, masked_idx, topk_weights)
    masked_expected = buf.combine(layer.experts(masked), masked.handle, local_reduce=False)
    masked_got = layer.experts_and_combine_rows(masked)
    torch.cuda.synchronize()
    return {"equal_to_combine": torch.equal(got.view(torch.int16), expected.view(torch.int16)),
            "masked_equal_to_combine": torch.equal(masked_got.view(torch.int16), masked_expected.view(torch.int16))
            and (x.shape[0] == 0 or not bool(masked_got[0].any())),
            "deterministic": torch.equal(got.view(torch.int16), again.view(torch.int16)),
            "graph_equal": _graph_replay_matches_eager(layer, x, rank), "y": layer(x).cpu(),
            "misuse_refused": _combine_rows_misuse_refused(buf, result, x, topk_idx, topk_weights, expected,
                                                           packed)}


def _combine_rows_misuse_refused(buf, result, x, topk_idx, topk_weights, expert_out_like, packed):
    """begin / finish out of order, a foreign result, other calls while rows are open, and the combine-row GEMM on
    another stream than its begin or with a target whose combine was finished: each refused on the host before any
    kernel (every rank makes the same calls, so the flag protocol stays in step)."""
    import dataclasses
    from ep_comm import grouped_gemm as gemm
    refused = []
    w2 = gemm.pack_gemm_weights(packed.w2, swiglu=False)
    rows = gemm.ExpandedRows(values=torch.zeros(result.num_rows, w2.k, dtype=torch.float16, device=x.device),
                             row_factor=torch.zeros(result.num_rows, device=x.device))

    def gemm_into(target):
        gemm.grouped_gemm_nvfp4_combine_rows(rows, result.expert_offsets, result.num_tokens_per_expert, w2, target)

    def expect(error_type, text, fn):
        try:
            fn()
            refused.append(False)
        except error_type as error:
            refused.append(text in str(error))
    expect(RuntimeError, "without begin_combine_rows", lambda: buf.finish_combine_rows(result.handle))
    expect(ValueError, "own dispatch", lambda: buf.begin_combine_rows(dataclasses.replace(result, handle=None)))
    target = buf.begin_combine_rows(result)
    other_stream = torch.cuda.Stream()
    with torch.cuda.stream(other_stream):
        expect(RuntimeError, "stream of its begin_combine_rows", lambda: gemm_into(target))
    expect(RuntimeError, "has not been finished", lambda: buf.begin_combine_rows(result))
    expect(RuntimeError, "has not been finished", lambda: buf.dispatch(x, topk_idx, topk_weights))
    expect(RuntimeError, "has not been finished", lambda: buf.combine(expert_out_like.new_zeros(
        result.num_rows, x.shape[1]), result.handle))
    expect(ValueError, "given to begin_combine_rows", lambda: buf.finish_combine_rows(dataclasses.replace(result.handle)))
    buf.finish_combine_rows(result.handle)  # closes the pair (stale rows: the result is not used)
    expect(RuntimeError, "is stale", lambda: gemm_into(target))  # its stores would land in a published combine
    torch.cuda.synchronize()
    return all(refused) and len(refused) == 8


def _graph_replay_matches_eager(layer, x, rank):
    """The whole fused layer (router, dispatch, experts, combine) captured once in a CUDA graph, replayed on new
    inputs: bitwise the eager forward on those inputs (fails at capture if any step synchronizes the host)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)  # warm-up outside the graph (allocator)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_y = layer(static_x)
    equal = []
    for trial in range(2):
        new_x = torch.randn(x.shape, generator=torch.Generator().manual_seed(500 + 10 * trial + rank))
        static_x.copy_(new_x.to(torch.bfloat16))
        graph.replay()
        eager = layer(static_x.clone())
        torch.cuda.synchronize()
        equal.append(torch.equal(static_y.view(torch.int16), eager.view(torch.int16)))
    return all(equal)


@pytest.mark.cpu
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_layer_matches_token_by_token_oracle(routing):
    for result in run_ranks(_moe_worker, 2, "cpu", "auto", routing, backend="gloo"):
        check_routing(result)
        assert result["deterministic"]
        assert result["weights_kept"]  # the reference path keeps the given weights
        assert result["bad_tile_refused"]  # token_tile is checked whichever expert path the layer picks
        assert result["combine_rows_refused"]
        assert not result["layer_combine_rows"]  # gloo ranks: reference experts, reference backend
        assert result["rows_api_refused"]
        # Same quantization points; only matmul batching (accumulation order) differs from the oracle, which runs
        # each expert on one token at a time. CPU FP32 matmuls sum in an order that depends on the batch: with the
        # balanced routing's <= 24 rows per expert the layer gave the oracle's bits (0.0 measured); with the skewed
        # one's 137-row experts a few rows' sums differ in the last bit and move an NVFP4 code of the SwiGLU output
        # (2 of rank 1's 77 tokens, 2.6e-4 measured). Either bound is far below what the other combine mode gives
        # against this oracle (0.009 balanced, 0.012 skewed).
        bound = 1e-5 if routing == "balanced" else 2e-3
        assert result["vs_oracle"] < bound and result["vs_other_mode"] > 5 * bound, result
        assert result["masked_vs_oracle"] < bound and result["masked_token_zero"], result  # the same, masked slots
        assert result["default_precision"] == "exact", result
        # Four NVFP4 quantizations (tokens, w1, SwiGLU output, w2; ~9% each on Gaussian data) and S2F6: ~22%
        # relative L2 against the unquantized FP32 layer on these random weights (0.218 measured on CPU).
        assert 0.0 < result["vs_fp32"] < 0.3, result


@pytest.mark.cpu
def test_moe_layer_with_an_mxfp8_combine_matches_the_oracle():
    """The layer on a Buffer whose combine is MXFP8: the oracle with MXFP8 rows on the wire, as closely as with S2F6."""
    for result in run_ranks(_moe_worker, 2, "cpu", "auto", "balanced", "mxfp8", backend="gloo"):
        assert result["deterministic"] and not result["layer_combine_rows"]
        assert result["vs_oracle"] < 1e-5 and result["vs_other_mode"] > 5e-5, result  # as the S2F6 test's bound
        assert result["masked_vs_oracle"] < 1e-5 and result["masked_token_zero"], result
        assert 0.0 < result["vs_fp32"] < 0.3, result


@pytest.mark.cpu
def test_moe_layer_with_top1_and_an_idle_rank_matches_the_oracle():
    for rank, result in enumerate(run_ranks(_moe_edge_worker, 2, backend="gloo")):
        check_moe_edge_result(result, rank, 2, 1e-5)  # reference experts: the oracle's arithmetic (as above)


@pytest.mark.cpu
def test_pack_weights_and_layer_reject_bad_shapes():
    w1, w2, _ = _master_weights()
    packed = moe.pack_weights(w1, w2)
    assert packed.w1.data.shape == (EXPERTS, 2 * INTERMEDIATE, HIDDEN // 2) and packed.w1.e4m3_max == 448.0
    assert torch.equal(packed.w1.amax[:, 0], w1.abs().amax(dim=(1, 2)))  # one amax per expert
    with pytest.raises(ValueError, match="w2 must be"):
        moe.pack_weights(w1, w2[:, :, :-16])
    for bad in (float("inf"), float("nan")):  # one non-finite weight would silently spoil its whole expert
        w1_bad = w1.clone()
        w1_bad[0, 0, 0] = bad
        with pytest.raises(ValueError, match="w1 holds NaN or Inf"):
            moe.pack_weights(w1_bad, w2)
    with pytest.raises(ValueError, match="must not be empty"):
        moe.pack_weights(w1[:, :0], w2[:, :, :0])
    # Finite but so large that the NVFP4 weights would decode to Inf / NaN (docs/NUMERICS.md, known limits): refused,
    # by pack_weights and by the layer for weights packed some other way; just below the bound, taken.
    bound = torch.finfo(torch.float32).max / 448
    w1_huge = w1.clone()
    w1_huge[3] *= 1.01 * bound / float(w1_huge[3].abs().max())
    with pytest.raises(ValueError, match="w1 has an expert whose largest"):
        moe.pack_weights(w1_huge, w2)
    w1_big = w1.clone()
    w1_big[3] *= 0.99 * bound / float(w1_big[3].abs().max())
    big = moe.pack_weights(w1_big, w2)
    assert torch.isfinite(formats.nvfp4_dequantize(big.w1, impl="reference")).all()
    forged = moe.PackedExpertWeights(w1=formats.nvfp4_quantize(w1_huge, four_over_six=False,
                                                               amax=moe._per_expert_amax(w1_huge)), w2=big.w2)
    with pytest.raises(ValueError, match="weights.w1 has an expert whose largest"):
        moe._check_packed_weights(forged)
    # expert_mlp_reference names its own arguments for shapes that do not chain.
    tokens = formats.nvfp4_quantize(torch.randn(3, HIDDEN))
    w1_f, w2_f = (formats.nvfp4_dequantize(w, impl="reference") for w in (packed.w1, packed.w2))
    with pytest.raises(ValueError, match="expert_mlp_reference needs NVFP4 tokens"):
        moe.expert_mlp_reference(tokens, w1_f[0, :-1], w2_f[0])
    with pytest.raises(ValueError, match="expert_mlp_reference needs NVFP4 tokens"):
        moe.expert_mlp_reference(tokens, w1_f[0], w2_f[0, :, :-16])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            moe.default_wave_sms(HIDDEN, bad, 132)


@pytest.mark.gpu
def test_pack_weights_on_the_gpu_from_bf16_masters_gives_the_cpu_bytes():
    """pack_weights of bf16 masters on the GPU (the CUDA plain NVFP4 quantizer with one amax per expert) writes the
    same bytes as on the CPU (the torch reference), and both are nvfp4_quantize(four_over_six=False) with each
    expert's amax in the [E, 1] form; an outlier weight and an expert of tiny weights included."""
    require_format_kernels("cuda")  # (else pack_weights on the GPU is the torch reference, compared with itself)
    w1, w2, _ = _master_weights()
    w1[0, 3, 5] = 40.0  # expert 0's amax, far above its other weights
    w2[1] *= 1e-3
    masters = (w1.to(torch.bfloat16), w2.to(torch.bfloat16))
    on_cpu = moe.pack_weights(*masters)
    on_gpu = moe.pack_weights(*(w.cuda() for w in masters))
    for name, master in zip(("w1", "w2"), masters):
        amax = master.float().abs().amax(dim=2).amax(dim=1, keepdim=True)
        want = formats.nvfp4_quantize(master, four_over_six=False, amax=amax, impl="reference")
        for packed in (on_cpu, on_gpu):
            got = getattr(packed, name)
            assert torch.equal(got.data.cpu(), want.data), name
            assert torch.equal(got.scales.view(torch.uint8).cpu(), want.scales.view(torch.uint8)), name
            assert torch.equal(got.amax.cpu(), want.amax) and got.e4m3_max == want.e4m3_max, name


@pytest.mark.cpu
def test_pack_weights_errors_name_w1_and_w2():
    w1, w2, _ = _master_weights()
    with pytest.raises(ValueError, match=r"H and I must be multiples of 16.*w1 \(8, 128, 120\)"):
        moe.pack_weights(w1[:, :, :120], w2[:, :120])
    with pytest.raises(ValueError, match=r"H and I must be multiples of 16.*I = 40"):
        moe.pack_weights(w1[:, :80], w2[:, :, :40])
    with pytest.raises(TypeError, match="w2 must be a bfloat16, float16 or float32 tensor, got torch.float64"):
        moe.pack_weights(w1, w2.double())
    with pytest.raises(TypeError, match="w1 must be"):
        moe.pack_weights(w1.tolist(), w2)


def _tiny_experts():
    from ep_comm import grouped_gemm
    w1, w2, _ = _master_weights()
    packed = moe.pack_weights(w1[:2], w2[:2])
    tokens = formats.nvfp4_quantize(torch.randn(6, HIDDEN))
    offsets, counts = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)
    return (tokens, offsets, counts, grouped_gemm.pack_gemm_weights(packed.w1, swiglu=True),
            grouped_gemm.pack_gemm_weights(packed.w2, swiglu=False))


@pytest.mark.cpu
def test_fused_experts_refuse_cpu_tensors_naming_the_reference_path():
    tokens, offsets, counts, w1, w2 = _tiny_experts()
    with pytest.raises(ValueError, match=r"fused experts need CUDA tensors on an sm_90 GPU \(use expert_mlp_reference"):
        moe.fused_expert_mlp(tokens, offsets, counts, w1, w2)
    with pytest.raises(ValueError, match="fused experts need CUDA tensors"):
        moe.fused_expert_hidden(tokens, offsets, counts, w1)
    supported, why = moe._fused_experts_supported(torch.device("cpu"), HIDDEN, INTERMEDIATE)
    assert not supported and "expert weights are on cpu" in why  # the layer checks the weights' device
    # Weights that do not chain, or tokens of another width: named before anything runs (not after w1, by the
    # expansion's or w2's own checks).
    import dataclasses
    with pytest.raises(ValueError, match="w2 must be packed for the same 2 experts with K = w1's output features"):
        moe.fused_expert_mlp(tokens, offsets, counts, w1, dataclasses.replace(w2, k=2 * w2.k))
    with pytest.raises(ValueError, match=f"the tokens have {2 * HIDDEN} features but w1 was packed for K = {HIDDEN}"):
        moe.fused_expert_hidden(formats.nvfp4_quantize(torch.randn(6, 2 * HIDDEN)), offsets, counts, w1)
    with pytest.raises(ValueError, match="repack them with pack_gemm_weights"):  # w2 in the pre-2026-12-02 row order
        moe.fused_expert_mlp(tokens, offsets, counts, w1, dataclasses.replace(w2, row_order="plain"))
    # Missing weights: named (w2=None reached the w2 GEMM after w1 had run, as an AttributeError).
    with pytest.raises(TypeError, match="w2 must be GemmWeights from pack_gemm_weights"):
        moe.fused_expert_mlp(tokens, offsets, counts, w1, None)
    with pytest.raises(TypeError, match="w1 must be GemmWeights from pack_gemm_weights"):
        moe.fused_expert_hidden(tokens, offsets, counts, None)
    # Tokens in another format: named as such (a plain tensor's width was read as packed codes, twice too wide).
    for other in (torch.randn(6, HIDDEN).to(torch.bfloat16), formats.mxfp8_quantize(torch.randn(6, HIDDEN))):
        with pytest.raises(TypeError, match="the fused experts take NVFP4 tokens"):
            moe.fused_expert_mlp(other, offsets, counts, w1, w2)


def _matmuls_exact_inside() -> bool:
    """Whether FP32 matmuls run as FP32 here: no autocast, no TF32 (read through the API torch uses for it)."""
    matmul = torch.backends.cuda.matmul
    tf32_off = matmul.fp32_precision == "ieee" if hasattr(matmul, "fp32_precision") else not matmul.allow_tf32
    return tf32_off and not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


@pytest.mark.cpu
@pytest.mark.parametrize("setting", ["precision medium", "legacy allow_tf32"])
def test_expert_mlp_reference_is_fp32_under_autocast_and_tf32(monkeypatch, setting):
    """The FP32 oracle's matmuls run as FP32 (as grouped_gemm's reference: exact_fp32_matmuls) inside the caller's
    autocast region and TF32 setting, give the same bits as without them, and leave the caller's setting as it was:
    torch's own getter still answers afterwards (writing the legacy setter after the newer API makes it raise)."""
    w1, w2, _ = _master_weights()
    tokens = formats.nvfp4_quantize(torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5)))
    want = moe.expert_mlp_reference(tokens, w1[0], w2[0])
    seen = []
    silu = torch.nn.functional.silu
    monkeypatch.setattr(torch.nn.functional, "silu", lambda v: seen.append(_matmuls_exact_inside()) or silu(v))
    previous = torch.get_float32_matmul_precision()
    try:
        if setting == "precision medium":
            torch.set_float32_matmul_precision("medium")
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = moe.expert_mlp_reference(tokens, w1[0], w2[0])
        assert seen == [True]
        assert torch.equal(got, want)
        if setting == "precision medium":
            assert torch.get_float32_matmul_precision() == "medium"
        else:
            assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(previous)



@pytest.mark.cpu
def test_exact_fp32_matmuls_restores_settings_when_threads_overlap():
    """The precision flags are process-wide: threads that are inside exact_fp32_matmuls at the same time must leave the
    caller's setting behind, not the "ieee" one of them set (each saving and restoring on its own did: the second
    thread saved the first one's "ieee" and restored it last). Every thread sees IEEE FP32 inside."""
    import threading
    from ep_comm.grouped_gemm import exact_fp32_matmuls
    previous = torch.get_float32_matmul_precision()
    inside = threading.Barrier(4)
    seen = []
    errors = []

    def work():
        try:
            for _ in range(50):
                with exact_fp32_matmuls():
                    seen.append(_matmuls_exact_inside())
            with exact_fp32_matmuls():  # all four inside at once at least once
                inside.wait(timeout=30)
                seen.append(_matmuls_exact_inside())
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    try:
        torch.set_float32_matmul_precision("high")
        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors and len(seen) == 4 * 51 and all(seen)
        assert torch.get_float32_matmul_precision() == "high"
        matmul = torch.backends.cuda.matmul
        if hasattr(matmul, "fp32_precision"):
            assert matmul.fp32_precision == "tf32"
        else:
            assert matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(previous)


def _layer_knobs_worker(rank, world):
    w1, w2, router = _master_weights()
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        packed = moe.pack_weights(w1, w2)
        messages = []
        for kwargs in (dict(wave_sms=-5), dict(wave_sms=True), dict(token_tile=64, expert_impl="reference"),
                       dict(wave_sms=4, waves=False)):
            try:
                moe.MoELayer(buf, router, packed, **kwargs)
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
        # With the automatic choices a valid knob is kept for where it applies (here: neither does).
        layer = moe.MoELayer(buf, router, packed, token_tile=64, wave_sms=4)
        return messages, layer.token_tile, layer.wave_sms


@pytest.mark.cpu
def test_layer_checks_token_tile_and_wave_sms_on_every_path():
    (messages, token_tile, wave_sms), = run_ranks(_layer_knobs_worker, 1, backend="gloo")
    assert "wave_sms must be None or a positive int" in messages[0] and "positive int" in messages[1], messages
    assert "expert_impl='reference' has none" in messages[2] and "waves=False has none" in messages[3], messages
    assert token_tile is None and wave_sms is None


def _layer_misuse_worker(rank, world):
    w1, w2, router = _master_weights()
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        packed = moe.pack_weights(w1, w2)
        refused = []
        for bad, error in (((buf, router, (w1, w2)), TypeError),                       # raw master weights
                           ((buf, router.long(), packed), TypeError),                  # an integer router
                           ((buf, router, moe.PackedExpertWeights(                     # w2 of another I
                               w1=packed.w1, w2=moe.pack_weights(w1[:, :32], w2[:, :, :16]).w2)), ValueError)):
            try:
                moe.MoELayer(*bad)
            except error:
                refused.append(True)
        layer = moe.MoELayer(buf, router, packed)
        # A result of a Buffer with other sizes: refused (the reference experts zeroed the rows of the experts past
        # their own, silently).
        with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=2 * EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as wide:
            xw = torch.randn(4, HIDDEN).to(torch.bfloat16)
            other = wide.dispatch(xw, torch.stack([torch.randperm(2 * EXPERTS)[:TOPK] for _ in range(4)]),
                                  torch.rand(4, TOPK))
            try:
                layer.experts(other)
                refused.append(False)
            except ValueError as error:
                refused.append("dispatch result of this layer's Buffer" in str(error))
        # Routing does not depend on x's memory layout (BLAS may sum a transposed copy in another order).
        xs = torch.randn(16, HIDDEN)
        idx_a, w_a = layer.route(xs)
        idx_b, w_b = layer.route(xs.t().contiguous().t())
        refused.append(torch.equal(idx_a, idx_b) and torch.equal(w_a, w_b))
        x = torch.randn(4, HIDDEN).to(torch.bfloat16).requires_grad_()
        try:  # forward-only: a grad-requiring input is refused, not silently cut out of backward
            layer(x)
            refused.append(False)
        except RuntimeError as error:
            refused.append("no autograd" in str(error))
        with torch.no_grad():
            y = layer(x)
            # The reference experts read the counts on the host: inside a CUDA-graph capture they refuse, clearly
            # (a stand-in for the capture state: this CPU rank cannot capture).
            result = buf.dispatch(x.detach(), *layer.route(x.detach()))
            capturing, moe._is_capturing = moe._is_capturing, lambda: True
            try:
                layer.experts(result)
                refused.append(False)
            except RuntimeError as error:
                refused.append("cannot be captured in a CUDA graph" in str(error))
            finally:
                moe._is_capturing = capturing
        # route on its own checks x as forward does (a narrow x gave a raw matmul error, a 1-D one [K]-shaped
        # results, an integer one a silent cast).
        for bad in (x.detach()[:, :32], x.detach()[0], x.detach().long(), x.detach().tolist()):
            try:
                layer.route(bad)
                refused.append(False)
            except (TypeError, ValueError) as error:
                refused.append(str(error).startswith("x must be"))
        return all(refused) and len(refused) == 11 and tuple(y.shape) == (4, HIDDEN)


@pytest.mark.cpu
def test_layer_refuses_bad_weights_and_autograd():
    assert run_ranks(_layer_misuse_worker, 1, backend="gloo") == [True]



def _layer_weight_format_and_state_worker(rank, world):
    """The weights' documented format is checked on the reference path too (the fused path's packing refuses the same
    weights), the boolean knobs are bools, and load_state_dict refuses a non-finite router as the constructor does."""
    w1, w2, router = _master_weights()
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        packed = moe.pack_weights(w1, w2)
        four_six = moe.PackedExpertWeights(w1=formats.nvfp4_quantize(w1, four_over_six=True), w2=packed.w2)
        per_row = moe.PackedExpertWeights(w1=packed.w1, w2=formats.nvfp4_quantize(
            w2, four_over_six=False, amax=w2.abs().amax(dim=-1).float()))
        messages = []
        for weights, kwargs in ((four_six, {}), (per_row, {}), (packed, dict(combine_rows="no")),
                                (packed, dict(waves=1))):
            try:
                moe.MoELayer(buf, router, weights, expert_impl="reference", **kwargs)
                messages.append(None)
            except (TypeError, ValueError) as error:
                messages.append(f"{type(error).__name__}: {error}")
        # Values the fused path's packing refuses (a corrupted checkpoint): a NaN amax of one expert, a NaN scale byte,
        # a negative scale. The reference path would give wrong, finite outputs for the tokens routed there.
        nan_amax = packed.w1.amax.clone()
        nan_amax[1] = float("nan")
        nan_scale = packed.w2.scales.view(torch.uint8).clone()
        nan_scale[0, 3, 1] = 0x7F
        negative_scale = packed.w1.scales.view(torch.uint8).clone()
        negative_scale[2, 0, 0] |= 0x80
        value_messages = []
        for weights in (dataclasses.replace(packed, w1=dataclasses.replace(packed.w1, amax=nan_amax)),
                        dataclasses.replace(packed, w2=dataclasses.replace(
                            packed.w2, scales=nan_scale.view(packed.w2.scales.dtype))),
                        dataclasses.replace(packed, w1=dataclasses.replace(
                            packed.w1, scales=negative_scale.view(packed.w1.scales.dtype)))):
            try:
                moe.MoELayer(buf, router, weights, expert_impl="reference")
                value_messages.append(None)
            except ValueError as error:
                value_messages.append(str(error))
        messages.append(value_messages)
        layer = moe.MoELayer(buf, router, packed)
        before = layer.router_weight.clone()
        state = layer.state_dict()
        state["router_weight"] = state["router_weight"].clone()
        state["router_weight"][3, 5] = float("nan")
        try:
            layer.load_state_dict(state)
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
        kept = torch.equal(layer.router_weight, before)
        layer.load_state_dict({"router_weight": router * 2})  # a finite router still loads
        loaded = torch.equal(layer.router_weight, router * 2)
        # A w1 of odd N cannot stack gate and up rows: refused at construction, not in the first forward's chunk(2).
        odd_w1 = dataclasses.replace(packed.w1, data=packed.w1.data[:, 1:].contiguous(),
                                     scales=packed.w1.scales[:, 1:].contiguous(),
                                     amax=packed.w1.amax[:, 1:].contiguous())
        try:
            moe.MoELayer(buf, router, dataclasses.replace(packed, w1=odd_w1), expert_impl="reference")
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
        return messages, kept, loaded


@pytest.mark.cpu
def test_layer_checks_weight_format_knob_types_and_loaded_router():
    (messages, kept, loaded), = run_ranks(_layer_weight_format_and_state_worker, 1, backend="gloo")
    assert messages[0] and "weights.w1 must be plain NVFP4 (e4m3_max 448" in messages[0], messages
    assert messages[1] and "weights.w2 must have one amax per expert" in messages[1], messages
    assert messages[2] == "TypeError: combine_rows must be None or a bool, got 'no'", messages
    assert messages[3] == "TypeError: waves must be None or a bool, got 1", messages
    assert messages[4] == ["weights.w1 amax must be finite and non-negative",
                           "weights.w2 scales must be finite and non-negative (E4M3 bytes 0x00..0x7E); found "
                           "negative or NaN scales",
                           "weights.w1 scales must be finite and non-negative (E4M3 bytes 0x00..0x7E); found "
                           "negative or NaN scales"], messages
    assert messages[5] and "router_weight holds NaN or Inf values: not loaded" in messages[5], messages
    assert messages[6] and "weights.w1 must stack gate and up rows (an even N)" in messages[6], messages
    assert kept and loaded


@pytest.mark.cpu
def test_packed_weights_load_with_weights_only_unpickling(tmp_path):
    """Saved expert weights load with torch.load's weights-only unpickling, the safe default (no arbitrary code)."""
    w1, w2, _ = _master_weights()
    packed = moe.pack_weights(w1, w2)
    torch.save(packed, tmp_path / "experts.pt")
    loaded = torch.load(tmp_path / "experts.pt", weights_only=True)
    assert isinstance(loaded, moe.PackedExpertWeights) and isinstance(loaded.w1, formats.NVFP4Tensor)
    for name in ("w1", "w2"):
        a, b = getattr(packed, name), getattr(loaded, name)
        assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        assert torch.equal(a.amax, b.amax) and a.e4m3_max == b.e4m3_max
    s2f6 = formats.s2f6_quantize(torch.randn(2, 64), hadamard=True)
    torch.save(s2f6, tmp_path / "s2f6.pt")
    again = torch.load(tmp_path / "s2f6.pt", weights_only=True)
    assert torch.equal(again.data, s2f6.data) and again.hadamard and again.sign_mask == s2f6.sign_mask
    # The grouped GEMM's packed operands too (pack_gemm_weights is the offline step MoELayer's kernels take).
    from ep_comm import grouped_gemm
    gemm = grouped_gemm.pack_gemm_weights(packed.w1, swiglu=True)
    torch.save(gemm, tmp_path / "gemm.pt")
    loaded_gemm = torch.load(tmp_path / "gemm.pt", weights_only=True)
    assert isinstance(loaded_gemm, grouped_gemm.GemmWeights)
    for name in ("values", "scales", "factor", "amax", "row_perm"):
        assert torch.equal(getattr(loaded_gemm, name), getattr(gemm, name)), name
    assert (loaded_gemm.n, loaded_gemm.k, loaded_gemm.swiglu, loaded_gemm.e4m3_max, loaded_gemm.row_order) == \
        (gemm.n, gemm.k, gemm.swiglu, gemm.e4m3_max, gemm.row_order)


@pytest.mark.cpu
def test_expert_mlp_reference_refuses_weights_that_require_grad():
    """The oracle has no autograd (the NVFP4 rounding of the w2 input cuts the graph): weights that require grad are
    refused under grad mode, instead of w2 getting a gradient and w1 silently none; under no_grad they are fine."""
    w1, w2, _ = _master_weights()
    packed = moe.pack_weights(w1, w2)
    w1d, w2d = (formats.nvfp4_dequantize(w, dtype=torch.float32)[0] for w in (packed.w1, packed.w2))
    tokens = formats.nvfp4_quantize(torch.randn(3, HIDDEN), four_over_six=True)
    want = moe.expert_mlp_reference(tokens, w1d, w2d)
    for name in ("w1", "w2"):
        args = {"w1": w1d, "w2": w2d}
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match=f"no autograd \\({name} requires grad\\)"):
            moe.expert_mlp_reference(tokens, args["w1"], args["w2"])
        with torch.no_grad():
            assert torch.equal(moe.expert_mlp_reference(tokens, args["w1"], args["w2"]), want)


def _layer_cast_and_one_bad_rank_worker(rank, world):
    w1, w2, router = _master_weights()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        layer = moe.MoELayer(buf, router, moe.pack_weights(w1[local], w2[local]))
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        with torch.no_grad():
            want = layer(x)
            # The router is FP32 inside an autocast region too (bf16 logits would pick other experts at near-ties).
            plain = layer.route(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = layer.route(x)
            assert autocast[1].dtype == torch.float32 and all(map(torch.equal, plain, autocast)), "route under autocast"
            layer.to(torch.bfloat16)  # a trainer's module-wide cast also casts the router buffer
            got = layer(x)
            # A move to another device is refused (the packed expert weights would stay behind), and leaves the layer
            # as it was.
            try:
                layer.to("meta")
                moved = "moved"
            except RuntimeError as error:
                moved = str(error)
            assert "cannot move from cpu to meta" in moved and layer.router_weight.device.type == "cpu", moved
            assert set(layer.state_dict()) == {"router_weight"}
            try:
                moe.MoELayer(buf, router.to("meta"), moe.pack_weights(w1[local], w2[local]))
                split = "accepted"
            except ValueError as error:
                split = str(error)
            assert "router_weight is on meta but the expert weights are on cpu" in split, split
            # A wrong hidden size on the last rank only: every rank raises at once, none waits for the others.
            bad = x[:, :HIDDEN // 2] if rank == world - 1 else x
            try:
                layer(bad)
                raised = None
            except (ValueError, TypeError) as error:
                raised = str(error)
        change = ((got.float() - want.float()).norm() / want.float().norm()).item()
        return change, raised


@pytest.mark.cpu
def test_layer_survives_a_bf16_cast_and_a_bad_input_on_one_rank():
    results = run_ranks(_layer_cast_and_one_bad_rank_worker, 2, backend="gloo")
    for rank, (change, raised) in enumerate(results):
        # The router's weights rounded to bf16 move the softmax weights a little (0.3% / 0.6% measured; no top-k
        # changes for these inputs); a broken cast would fail or produce garbage.
        assert 0.0 <= change < 0.05, change
        assert raised is not None and ("x must be [num_tokens" in raised if rank == 1 else "rejected on rank(s) [1]"
                                       in raised), raised


def _token_shapes_worker(rank, world, device_kind="cpu", backend="auto"):
    """forward on [batch, sequence, H] and [a, b, c, H] (the leading dimensions are the tokens) gives the [T, H] call's
    bits in x's shape, an empty batch included; a 1-D x and a wrong last dimension are refused. Returns the failures."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    w1, w2, router = _master_weights()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    failures = []
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=24,
                        expert_alignment=16, backend=backend) as buf, torch.no_grad():
        layer = moe.MoELayer(buf, router.to(device), moe.pack_weights(w1[local].to(device), w2[local].to(device)))
        x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
        want = layer(x)
        for shape in ((2, 12, HIDDEN), (3, 2, 4, HIDDEN), (0, 5, HIDDEN)):
            tokens = x[:int(torch.tensor(shape[:-1]).prod())]
            got = layer(tokens.reshape(shape))
            if got.shape != shape or got.dtype != torch.bfloat16 or \
                    not torch.equal(got.reshape(-1, HIDDEN).view(torch.int16), want[:tokens.shape[0]].view(torch.int16)):
                failures.append(f"shape {shape}")
        for bad, text in ((x[0], "x must be [num_tokens"), (x.reshape(2, 12, HIDDEN)[..., :64], "got (2, 12, 64)")):
            try:
                layer(bad)
                failures.append(f"{tuple(bad.shape)} accepted")
            except ValueError as error:
                if text not in str(error):
                    failures.append(f"{tuple(bad.shape)}: {error}")
    return failures


@pytest.mark.cpu
def test_layer_takes_tokens_with_leading_dimensions():
    assert run_ranks(_token_shapes_worker, 2, backend="gloo") == [[], []]


@pytest.mark.gpu
def test_layer_takes_tokens_with_leading_dimensions_on_the_gpu():
    """World 1 on one GPU: the fused experts (and combine rows, waves where they run) on the reshaped tokens."""
    assert run_ranks(_token_shapes_worker, 1, "cuda", backend="nccl") == [[]]


def check_gpu_moe_result(result, nvlink_expected):
    """The assertions on one rank's _moe_worker result on GPUs (also run at world 1 by bench/device_run.sh when only
    one GPU is lent)."""
    assert result["deterministic"]
    assert result["weights_kept"], result
    assert result["vs_oracle"] < 1e-2, result   # GPU vs CPU FP32 matmul accumulation order
    # That bound alone would pass the other combine mode too (~0.009 off this oracle): the layer's own is the nearer.
    assert result["vs_oracle"] < result["vs_other_mode"], result
    # Masked slots (the layer's experts between dispatch and combine), against the oracle on the same masked routing.
    assert result["masked_vs_oracle"] < 1e-2 and result["masked_token_zero"], result
    assert result["default_precision"] == "exact", result
    assert result["bad_tile_refused"] and result["combine_rows_refused"], result  # checked on every backend
    assert 0.0 < result["vs_fp32"] < 0.3, result
    if torch.cuda.get_device_capability() == (9, 0):
        assert result["expert_impl"] == "fused", result
    if nvlink_expected:
        assert result["backend"] == "nvlink", result  # else the combine-row checks below would not run
    if result["combine_format"] != "s2f6":  # combine rows are S2F6 only: the layer combines its bf16 rows
        assert not result["layer_combine_rows"] and result["combine_rows"] is None, result
        return
    # Fused GEMM vs FP32 torch experts: same quantization points; FP32 summation order and SiLU's exp differ,
    # which can move a rare SwiGLU output across an NVFP4 rounding boundary (documented bound 5e-3).
    assert result["fused_vs_reference"] < 5e-3, result
    if result["expert_impl"] == "fused":
        assert result["graph_equal"], result
    rows = result["combine_rows"]
    if result["expert_impl"] == "fused" and result["backend"] == "nvlink":
        assert result["layer_combine_rows"], result  # the default where it can run
        assert rows["equal_to_combine"] and rows["deterministic"] and rows["graph_equal"], rows
        assert rows["masked_equal_to_combine"], rows
        assert rows["misuse_refused"], rows
        assert rows["vs_oracle"] < 1e-2 and rows["vs_oracle"] < rows["vs_other_mode"], rows


@pytest.mark.multigpu
def test_moe_layer_on_gpus_matches_oracle():
    """Same check over NCCL with backend auto (nvlink where available) and the CUDA quantization kernels."""
    peers = nvlink_can_run()
    for routing in ROUTINGS:
        for result in run_ranks(_moe_worker, 2, "cuda", auto_backend(), routing, backend=multigpu_backend()):
            check_routing(result)
            check_gpu_moe_result(result, peers)
    edge = run_ranks(_moe_edge_worker, 2, "cuda", auto_backend(), backend=multigpu_backend())
    for rank, result in enumerate(edge):
        check_moe_edge_result(result, rank, 2, 1e-2)  # GPU vs CPU FP32 accumulation order (as above)
        if torch.cuda.get_device_capability() == (9, 0):
            assert result["expert_impl"] == "fused", result
        if peers:
            assert result["backend"] == "nvlink", result
    for result in run_ranks(_moe_fp8_worker, 2, "cuda", auto_backend(), backend=multigpu_backend()):
        check_moe_fp8_result(result)


def _layer_ownership_worker(rank, world):
    """What the layer takes from the caller: masters given as nn.Parameters pack without an autograd graph, the router
    is the layer's own FP32 copy (outside autograd), a non-finite router is refused; a forward input on another device
    on one rank raises on every rank; the experts refuse a row-index dispatch and another format's; the layer cannot be
    copied or pickled (its Buffer cannot), with an error that says what to save instead."""
    import copy
    import pickle
    w1, w2, router = _master_weights()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    w1_param, w2_param = torch.nn.Parameter(w1[local].clone()), torch.nn.Parameter(w2[local].clone())
    router_param = torch.nn.Parameter(router.clone())
    out = {}
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8) as buf:
        packed = moe.pack_weights(w1_param, w2_param)
        out["packed_grad"] = packed.w1.amax.requires_grad or packed.w2.amax.requires_grad
        layer = moe.MoELayer(buf, router_param, packed, expert_impl="reference")
        out["router_own"] = (layer.router_weight is not router_param and not layer.router_weight.requires_grad
                             and layer.router_weight.dtype == torch.float32)
        with torch.no_grad():
            router_param.add_(1.0)  # the caller's later edit does not reach the layer
        out["router_kept"] = torch.equal(layer.router_weight, router)
        # load_state_dict(assign=True) installs the caller's tensor itself: the layer keeps its own copy instead (on
        # its device, in its dtype, not sharing storage), and a meta router (no values) is refused, the old one kept.
        given = (router * 3).to(torch.bfloat16)
        layer.load_state_dict({"router_weight": given}, assign=True)
        with torch.no_grad():
            given.add_(1.0)
        out["assigned_own"] = (layer.router_weight.dtype == torch.float32
                               and torch.equal(layer.router_weight, (router * 3).to(torch.bfloat16).float()))
        try:
            layer.load_state_dict({"router_weight": torch.empty_like(router, device="meta")}, assign=True)
            out["meta_router"] = "loaded"
        except RuntimeError as error:
            out["meta_router"] = str(error)
        out["meta_router_kept"] = layer.router_weight.device.type == "cpu"
        layer.load_state_dict({"router_weight": router})
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        y = layer(x)  # grad mode on, x detached: the layer's own tensors need no grad
        out["forward_shape"] = tuple(y.shape)
        nan_router = router.clone()
        nan_router[3, 5] = float("nan")
        try:
            moe.MoELayer(buf, nan_router, packed)
            out["nan_router"] = "accepted"
        except ValueError as error:
            out["nan_router"] = str(error)
        bad = torch.empty_like(x, device="meta") if rank == world - 1 else x
        try:
            layer(bad)
            out["meta_x"] = None
        except ValueError as error:
            out["meta_x"] = str(error)
        with torch.no_grad():
            topk_idx, topk_weights = layer.route(x)

            def refusals(result):  # what the two expert paths say to a result they cannot take
                messages = []
                for consume in (layer.experts, layer.experts_and_combine_rows):
                    try:
                        consume(result)
                        messages.append("accepted")
                    except ValueError as error:
                        messages.append(str(error))
                return messages

            rows = buf.dispatch(x, topk_idx, topk_weights, expand=False)
            out["rows_experts"] = refusals(rows)
            buf.combine(layer.experts(buf.dispatch(x, topk_idx, topk_weights)), rows.handle)  # ranks stay in step
            # Another format's result (its Buffer's rows are no NVFP4Tensor) is refused by name, not by an
            # AttributeError inside the experts.
            out["other_format"] = []
            for fmt in ("bf16", "mxfp8"):
                with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8,
                                    dispatch_format=fmt) as other:
                    out["other_format"] += refusals(other.dispatch(x, topk_idx, topk_weights))
        copies = []
        for attempt in (lambda: copy.deepcopy(layer), lambda: pickle.dumps(layer)):
            try:
                attempt()
                copies.append("copied")
            except TypeError as error:
                copies.append(str(error))
        out["copies"] = copies
    return out


@pytest.mark.cpu
def test_layer_owns_its_router_and_refuses_what_it_cannot_do():
    import subprocess
    import sys
    # `import ep_comm` alone gives ep_comm.moe (a fresh interpreter: this module's own import of moe would mask it).
    subprocess.run([sys.executable, "-c", "import ep_comm; ep_comm.moe.MoELayer"], check=True)
    for rank, out in enumerate(run_ranks(_layer_ownership_worker, 2, backend="gloo")):
        assert out["packed_grad"] is False and out["router_own"] and out["router_kept"], out
        assert out["assigned_own"] and out["meta_router_kept"], out
        assert "router_weight is a meta tensor: not loaded" in out["meta_router"], out
        assert out["forward_shape"] == (4, HIDDEN), out
        assert "router_weight holds NaN or Inf" in out["nan_router"], out
        expected = "x is on meta" if rank == 1 else "rejected on rank(s) [1]"
        assert out["meta_x"] is not None and expected in out["meta_x"], out
        assert all("needs an expanding dispatch" in message for message in out["rows_experts"]), out
        assert len(out["other_format"]) == 4 and all("needs the result of an NVFP4 dispatch" in message
                                                     for message in out["other_format"]), out
        assert all("cannot be pickled or copied" in message for message in out["copies"]), out


def _router_and_subnormals_worker(rank, world):
    """A float64 router past FP32's range (the layer keeps an FP32 copy) in the constructor and in load_state_dict;
    pack_weights, route and the layer's forward on a CPU thread that flushes subnormals against one that does not."""
    h, inter, experts, topk = 32, 16, 2, 2
    w1 = torch.randn(experts, 2 * inter, h, generator=torch.Generator().manual_seed(0))
    w2 = torch.randn(experts, h, inter, generator=torch.Generator().manual_seed(1))
    out = {}
    with ep_comm.Buffer(None, hidden=h, num_experts=experts, num_topk=topk, max_tokens_per_rank=4) as buf:
        wide = torch.zeros(experts, h, dtype=torch.float64)
        wide[1, 3] = 1e39  # finite in float64, Inf as FP32
        try:
            moe.MoELayer(buf, wide, moe.pack_weights(w1, w2))
            out["wide_router"] = "accepted"
        except ValueError as error:
            out["wide_router"] = str(error)
        router = torch.zeros(experts, h)
        router[0, 0] = 1.0  # token logits 100 apart: the second routing weight exp(-100) is subnormal
        w1_tiny = w1.clone()
        w1_tiny[1] *= 1e-39  # expert 1's w1 all subnormal: its amax too
        w2_big = w2.clone()
        w2_big[0] = 0.0  # expert 0 outputs zeros: a token's output is its subnormal-weighted expert-1 row
        w2_big[1] *= 1e6
        x = torch.randn(4, h, generator=torch.Generator().manual_seed(3))
        x[:, 0] = 100.0
        x = x.to(torch.bfloat16)
        layer = moe.MoELayer(buf, router, moe.pack_weights(w1, w2_big))
        try:
            layer.load_state_dict({"router_weight": wide}, strict=False)
            out["wide_load"] = "loaded"
        except RuntimeError as error:
            out["wide_load"] = str(error)
        out["router_kept"] = bool(torch.equal(layer.router_weight, router))

        def results():
            packed = moe.pack_weights(w1_tiny, w2)
            topk_idx, topk_weights = layer.route(x)
            return [packed.w1.data, packed.w1.amax, topk_idx, topk_weights, layer(x)]

        want = results()
        flushing = torch.set_flush_denormal(True)
        try:
            got = results()
        finally:
            torch.set_flush_denormal(False)
        out["flushing"] = flushing
        out["subnormals"] = [float(want[1][1, 0]), float(want[3][0, 1])]
        # (bit patterns: fp32 as int32, bf16 through its exact fp32 value; codes and indices as they are)
        out["same"] = [torch.equal(w.float().view(torch.int32), g.float().view(torch.int32)) if w.is_floating_point()
                       else torch.equal(w, g) for w, g in zip(want, got)]
    return out


@pytest.mark.cpu
def test_layer_router_range_and_subnormals_on_a_flushing_thread():
    """MoELayer checks its router as the FP32 copy it keeps (a float64 1e39 would be Inf there: every token's routing
    weights NaN, its output near zero) in the constructor and in load_state_dict; pack_weights (the per-expert amax),
    route (the softmax) and the forward keep subnormals on a CPU thread that flushes them (NUMERICS.md: as a GPU
    computes them)."""
    out = run_ranks(_router_and_subnormals_worker, 1, backend="gloo")[0]
    assert "router_weight holds NaN or Inf" in out["wide_router"], out
    assert "router_weight holds NaN or Inf values: not loaded" in out["wide_load"] and out["router_kept"], out
    if not out["flushing"]:
        pytest.skip("this CPU cannot flush subnormals: nothing to keep")
    assert all(0 < v < torch.finfo(torch.float32).tiny for v in out["subnormals"]), out
    assert all(out["same"]), out

@pytest.mark.cpu
def test_combine_rows_target_is_good_between_its_begin_and_finish():
    """The host-side ticket behind CombineRowsTarget.claim: refused once its begin is closed or superseded, and on a
    destroyed Buffer (the stream check and the launcher's call need a GPU: _combine_rows_misuse_refused)."""
    from ep_comm.backends.nvlink import _RowsTicket

    class Backend:
        _destroyed = False
        _rows_handle = None

    backend, handle = Backend(), object()
    ticket = _RowsTicket(backend, handle, stream=0)
    with pytest.raises(RuntimeError, match="stale"):  # finished: no begin open
        ticket.claim()
    backend._rows_handle = object()
    with pytest.raises(RuntimeError, match="stale"):  # another begin's handle
        ticket.claim()
    backend._rows_handle = handle
    backend._destroyed = True
    with pytest.raises(RuntimeError, match="destroyed"):
        ticket.claim()
