"""Whole MoE layer forward on GPUs: ep_comm (NVFP4 dispatch + fused NVFP4 grouped GEMM + S2F6 combine) vs the BF16
pipeline (reference backend over NCCL + torch._grouped_mm BF16 + reference combine).

    python bench/bench_moe.py --nproc 2 --out moe.json

Shape (DeepSeek-V3 layer): H = 7168, I = 2048, top-8 of 256 experts (E / W local experts per rank), random
router weights, 128 and 4096 tokens per rank. Weights are random BF16 masters made on the GPU, quantized with
`moe.pack_weights` (NVFP4, per-expert amax) for ep_comm and kept in BF16 for the baseline.
Timing: median over iterations of one forward between CUDA events, each after a barrier + synchronize
(launch skew between ranks included). Reported per rank 0:
  layer        : MoELayer(waves=False).forward (router, dispatch, experts, combine); the default layer, with waves,
                 is waves_layer below
  dispatch / experts / combine : the three stages alone, same inputs
  exposed comm : layer - experts - router; its fraction of (dispatch + combine) alone says how much communication
                 the layer hides (1.0 = none). "experts" is the expert MLP with the bf16 w2 epilogue; the default
                 layer (combine_rows) stores its combine rows from w2's epilogue instead, so the combine send is
                 inside the GEMM and only dispatch and the combine receive can stay exposed
  *_graph      : the same stages each captured in a CUDA graph and replayed (device time, no Python host path)
  bf16 layer   : router + reference dispatch (bf16) + torch._grouped_mm w1, SiLU*up, w2 + reference combine (bf16)
  local_reduce_*: the layer with combine_rows=False (bf16 w2 output, Buffer.combine with local_reduce=True)
  rows_*       : pieces of the combine-row form (experts + combine; begin + finish without the GEMM)
  fp8_*        : MoELayer(expert_precision="fp8_inexact") (the grouped GEMM's opt-in inexact FP8 mode) in its default
                 form (waves and combine rows where they run, as the default layer); fp8_plain_*: with waves=False,
                 combine_rows=False; when H and I are multiples of 128
  waves_*      : the layer with waves=True, the default (dispatch receive overlapped with w1, csrc/waves.h); dispatch_w1 /
                 waves_dispatch_w1: dispatch + w1 alone, plain (with the expansion pass) and waves
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_dispatch_combine import _graph_time_us, _iso_time_us  # noqa: E402  one timing method for the benchmarks
from ep_comm.bench import run_metadata, strict_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,4096", help="tokens per rank, comma separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-baseline", action="store_true", help="skip the BF16 pipeline")
    p.add_argument("--token-tiles", default="auto",
                   help="comma list of MoELayer token tiles (auto = the layer's choice); the first is the main row, "
                        "the others add layer/experts times per tile")
    p.add_argument("--wave-sms", default="auto",
                   help="comma list of wave receive SM counts for MoELayer(waves=True) (auto = default_wave_sms); "
                        "the first is the main waves row, the others add waves<n>_* times")
    p.add_argument("--out", default="")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args(argv)
    try:
        args.wave_sms_list = [None if t == "auto" else int(t) for t in (v.strip() for v in args.wave_sms.split(",")) if t]
    except ValueError:
        p.error("--wave-sms must be a comma list of auto and SM counts")
    if not args.wave_sms_list or any(n is not None and n < 1 for n in args.wave_sms_list):
        p.error("--wave-sms needs at least one value (the main waves row): auto or positive SM counts")
    _check_shape_args(p, args)
    return args


def _check_shape_args(p, args) -> None:
    """Refuse bad flags here, with argparse's message, not as a traceback from every rank after its weights are
    built (11 GB per rank at the default shape)."""
    from ep_comm.bench import check_out_path, check_routing_flags, parse_token_counts
    from ep_comm.grouped_gemm import TOKEN_TILES
    args.token_list = parse_token_counts(p, args.tokens)
    try:
        args.token_tile_list = [None if t == "auto" else int(t)
                                for t in (s.strip() for s in args.token_tiles.split(",")) if t]
    except ValueError:
        p.error("--token-tiles must be a comma list of auto and token tiles")
    if not args.token_tile_list or any(t is not None and t not in TOKEN_TILES for t in args.token_tile_list):
        p.error(f"--token-tiles must be a comma list of auto and {', '.join(map(str, TOKEN_TILES))}")
    # The fused experts pack w1 [E, 2I, H] and w2 [E, H, I] in 64 x 64 tiles: H and I are multiples of 64.
    if args.hidden < 64 or args.hidden % 64 or args.intermediate < 64 or args.intermediate % 64:
        p.error("--hidden and --intermediate must be positive multiples of 64")
    check_routing_flags(p, args, ("iters", "nproc", "topk"), world=args.nproc)
    check_out_path(p, args.out or None)


def _time_ms(fn, iters, group) -> float:
    fn()  # warm-up
    return _iso_time_us(fn, iters, group) / 1e3


def _graph_ms(fn, iters) -> float:
    """fn captured once in a CUDA graph (after a warm-up call on the capture stream) and replayed: ms per replay.
    Collective: every rank captures the same calls."""
    return _graph_time_us(lambda calls: [fn() for _ in range(calls)], 1, None, reps=iters) / 1e3


def _grouped_mm_bf16(x, weights_t, offs):
    """torch._grouped_mm(x [R, K], weights_t [E, K, N] (a transposed view of [E, N, K]), offs int32 [E])."""
    return torch._grouped_mm(x, weights_t, offs=offs)


def random_layer_weights(rank, world, args):
    """The benchmark layer's weights on the current GPU: (w1 bf16 [E_local, 2I, H], w2 bf16 [E_local, H, I], router
    fp32 [E, H], the NVFP4 pack of w1 / w2, and the generator the inputs continue from). BF16 masters (11.3 GB per rank
    at the default shape), quantized once with the CUDA kernels; the router is the same on every rank."""
    from ep_comm import moe

    device = torch.device("cuda", torch.cuda.current_device())
    h, inter, local = args.hidden, args.intermediate, args.experts // world
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    w1 = (torch.randn(local, 2 * inter, h, device=device, generator=gen) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(local, h, inter, device=device, generator=gen) / inter ** 0.5).to(torch.bfloat16)
    router = torch.randn(args.experts, h, device=device, generator=torch.Generator(device=device).manual_seed(7))
    return w1, w2, router, moe.pack_weights(w1, w2), gen


def worker(rank, world, args):
    import ep_comm
    from ep_comm import moe

    device = torch.device("cuda", torch.cuda.current_device())
    h, inter, experts, topk = args.hidden, args.intermediate, args.experts, args.topk
    w1, w2, router, packed, gen = random_layer_weights(rank, world, args)
    # --token-tiles: the first entry is the layer's tile, the others are timed as alternatives ("auto" = None).
    token_tiles = args.token_tile_list
    rows = []
    for tokens in args.token_list:
        x = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
        row = {"tokens_per_rank": tokens, "world": world, "hidden": h, "intermediate": inter, "experts": experts,
               "topk": topk}
        with ep_comm.Buffer(None, hidden=h, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                            dispatch_format="nvfp4", combine_format="s2f6", expert_alignment=16) as buf:
            # The layer without waves (the rows before the tenth session); waves_* below is the default layer.
            layer = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=token_tiles[0], waves=False)
            idx, weights = layer.route(x)
            result = buf.dispatch(x, idx, weights)
            expert_out = layer.experts(result)
            row["backend"] = buf.backend
            row["token_tile"] = layer.token_tile
            row["layer_ms"] = _time_ms(lambda: layer(x), args.iters, None)
            row["router_ms"] = _time_ms(lambda: layer.route(x), args.iters, None)
            # check_inputs=False: the work MoELayer.forward does (ids from topk are valid; no device->host check).
            row["dispatch_ms"] = _time_ms(lambda: buf.dispatch(x, idx, weights, check_inputs=False), args.iters, None)
            row["experts_ms"] = _time_ms(lambda: layer.experts(result), args.iters, None)
            row["combine_ms"] = _time_ms(lambda: buf.combine(expert_out, result.handle), args.iters, None)
            # The same stages captured in CUDA graphs: device time without the Python host path (what a server
            # replaying graphs sees). The BF16 pipeline cannot be captured (its NCCL all_to_all needs host counts).
            row["layer_graph_ms"] = _graph_ms(lambda: layer(x), args.iters)
            row["experts_graph_ms"] = _graph_ms(lambda: layer.experts(result), args.iters)
            row["router_graph_ms"] = _graph_ms(lambda: layer.route(x), args.iters)
            row["dispatch_graph_ms"] = _graph_ms(lambda: buf.dispatch(x, idx, weights), args.iters)
            row["combine_graph_ms"] = _graph_ms(lambda: buf.combine(expert_out, result.handle), args.iters)
            row["combine_rows"] = layer.combine_rows
            # The other combine form, for comparison: combine_rows=False (w2 writes bf16 rows, Buffer.combine with
            # local_reduce=True sends one row per (token, rank)); and the pieces of the combine-row form.
            lr_layer = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=token_tiles[0],
                                    combine_rows=False, waves=False)
            row["local_reduce_layer_ms"] = _time_ms(lambda: lr_layer(x), args.iters, None)
            row["local_reduce_layer_graph_ms"] = _graph_ms(lambda: lr_layer(x), args.iters)
            if layer.combine_rows:
                row["rows_experts_and_combine_graph_ms"] = _graph_ms(lambda: layer.experts_and_combine_rows(result),
                                                                     args.iters)
                # What stays outside w2: begin (a wait on the peers' flags) + finish (release + receive of top-k rows
                # per token), timed without the GEMM in between (the rows' content does not change the work).
                row["rows_begin_finish_graph_ms"] = _graph_ms(
                    lambda: (buf.begin_combine_rows(result), buf.finish_combine_rows(result.handle)), args.iters)
            row["combine_local_reduce_false_graph_ms"] = _graph_ms(
                lambda: buf.combine(expert_out, result.handle, local_reduce=False), args.iters)
            if h % 128 == 0 and inter % 128 == 0:
                fp8_layer = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=token_tiles[0],
                                         expert_precision="fp8_inexact")
                fp8_plain = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=token_tiles[0],
                                         expert_precision="fp8_inexact", waves=False, combine_rows=False)
                row["fp8_waves"], row["fp8_combine_rows"] = fp8_layer.waves, fp8_layer.combine_rows
                row["fp8_layer_ms"] = _time_ms(lambda: fp8_layer(x), args.iters, None)
                row["fp8_layer_graph_ms"] = _graph_ms(lambda: fp8_layer(x), args.iters)
                row["fp8_plain_layer_ms"] = _time_ms(lambda: fp8_plain(x), args.iters, None)
                row["fp8_plain_layer_graph_ms"] = _graph_ms(lambda: fp8_plain(x), args.iters)
                row["fp8_experts_graph_ms"] = _graph_ms(lambda: fp8_layer.experts(result), args.iters)
                y_exact, y_fp8 = lr_layer(x).float(), fp8_plain(x).float()  # the same combine form (local_reduce)
                row["fp8_relative_l2_vs_exact_layer"] = ((y_fp8 - y_exact).norm() / y_exact.norm()).item()
                del fp8_layer, fp8_plain
            for tile in token_tiles[1:]:
                other = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=tile, waves=False)
                row[f"tile{other.token_tile}_layer_ms"] = _time_ms(lambda: other(x), args.iters, None)
                row[f"tile{other.token_tile}_layer_graph_ms"] = _graph_ms(lambda: other(x), args.iters)
                row[f"tile{other.token_tile}_experts_graph_ms"] = _graph_ms(lambda: other.experts(result),
                                                                            args.iters)
            # Waves: the dispatch receive overlapped with w1 (Buffer.dispatch_waves + the wave w1 GEMM). Also the
            # part it changes on its own: dispatch + w1 (plain: dispatch, expansion pass, w1; waves: wave dispatch,
            # w1 behind its receive).
            from ep_comm import grouped_gemm
            hidden_out = torch.empty(result.num_rows, inter, dtype=torch.float32, device=device)

            def plain_dispatch_w1():
                res = buf.dispatch(x, idx, weights, check_inputs=False)
                rows_ = grouped_gemm.expand_nvfp4_rows(res.x, num_rows_limit=res.expert_offsets[-1:])
                grouped_gemm.grouped_gemm_nvfp4(rows_, res.expert_offsets, res.num_tokens_per_expert,
                                                layer._w1_packed, out_dtype=torch.float32, out=hidden_out,
                                                token_tile=layer.token_tile)
            row["dispatch_w1_graph_ms"] = _graph_ms(plain_dispatch_w1, args.iters)
            # Its pieces: the expansion pass and w1 alone (what the waves receive folds in and overlaps).
            limit = result.expert_offsets[-1:]
            row["expand_graph_ms"] = _graph_ms(lambda: grouped_gemm.expand_nvfp4_rows(result.x, num_rows_limit=limit),
                                               args.iters)
            plain_rows = grouped_gemm.expand_nvfp4_rows(result.x, num_rows_limit=limit)
            row["w1_graph_ms"] = _graph_ms(lambda: grouped_gemm.grouped_gemm_nvfp4(
                plain_rows, result.expert_offsets, result.num_tokens_per_expert, layer._w1_packed,
                out_dtype=torch.float32, out=hidden_out, token_tile=layer.token_tile), args.iters)
            for position, sms in enumerate(args.wave_sms_list):
                wave_layer = moe.MoELayer(buf, router, packed, expert_impl="fused", token_tile=token_tiles[0],
                                          waves=True, wave_sms=sms)
                prefix = "waves" if position == 0 else f"waves{wave_layer.wave_sms}"

                def wave_dispatch_w1():
                    waved = buf.dispatch_waves(x, idx, weights, wave_layer.wave_sms, check_inputs=False)
                    res = waved.result
                    grouped_gemm.grouped_gemm_nvfp4(waved.rows, res.expert_offsets, res.num_tokens_per_expert,
                                                    layer._w1_packed, out_dtype=torch.float32, out=hidden_out,
                                                    token_tile=layer.token_tile, wave=waved.wave)
                row[f"{prefix}_sms"] = wave_layer.wave_sms
                row[f"{prefix}_layer_ms"] = _time_ms(lambda: wave_layer(x), args.iters, None)
                row[f"{prefix}_layer_graph_ms"] = _graph_ms(lambda: wave_layer(x), args.iters)
                row[f"{prefix}_dispatch_w1_graph_ms"] = _graph_ms(wave_dispatch_w1, args.iters)
            counts = result.num_tokens_per_expert.float()
            row["rows_per_expert_mean"] = counts.mean().item()
            row["rows_per_expert_max"] = counts.max().item()
        comm = row["dispatch_ms"] + row["combine_ms"]
        exposed = row["layer_ms"] - row["experts_ms"] - row["router_ms"]
        row["exposed_comm_ms"] = exposed
        row["exposed_comm_fraction"] = exposed / comm if comm > 0 else float("nan")
        comm_graph = row["dispatch_graph_ms"] + row["combine_graph_ms"]
        exposed_graph = row["layer_graph_ms"] - row["experts_graph_ms"] - row["router_graph_ms"]
        row["exposed_comm_graph_ms"] = exposed_graph
        row["exposed_comm_graph_fraction"] = exposed_graph / comm_graph if comm_graph > 0 else float("nan")
        # Same measure for the combine_rows=False layer (its combine send and receive run after w2).
        exposed_lr = row["local_reduce_layer_graph_ms"] - row["experts_graph_ms"] - row["router_graph_ms"]
        row["local_reduce_exposed_comm_graph_fraction"] = exposed_lr / comm_graph if comm_graph > 0 else float("nan")
        # Same measure for the waves layer, whose compute is the experts WITHOUT the pass that expands the dispatched
        # NVFP4 rows for the GEMM (its dispatch receive writes the GEMM's rows itself). Subtracting "experts" whole
        # (as until 2026-11-30) counted that pass as hidden communication: 0.15-0.55 too low (bench/RESULTS.md).
        waves_compute = row["experts_graph_ms"] - row["expand_graph_ms"]
        exposed_waves = row["waves_layer_graph_ms"] - waves_compute - row["router_graph_ms"]
        row["waves_exposed_comm_graph_fraction"] = exposed_waves / comm_graph if comm_graph > 0 else float("nan")

        if not args.no_baseline:
            try:
                with ep_comm.Buffer(None, hidden=h, num_experts=experts, num_topk=topk, max_tokens_per_rank=tokens,
                                    dispatch_format="bf16", combine_format="bf16", backend="reference",
                                    expert_alignment=16) as ref:
                    w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views of [E, N, K]

                    def bf16_layer():
                        logits = x.float() @ router.t()
                        top, top_idx = logits.topk(topk, dim=-1)
                        # check_inputs=False: as MoELayer.forward (ids from topk are valid), no extra id check.
                        res = ref.dispatch(x, top_idx, torch.softmax(top, dim=-1), check_inputs=False)
                        offs = res.expert_offsets[1:].to(torch.int32)
                        gate_up = _grouped_mm_bf16(res.x, w1_t, offs)
                        gate, up = gate_up.chunk(2, dim=-1)
                        out = _grouped_mm_bf16((F.silu(gate) * up).to(torch.bfloat16), w2_t, offs)
                        return ref.combine(out.to(torch.bfloat16), res.handle)

                    row["bf16_layer_ms"] = _time_ms(bf16_layer, args.iters, None)
                    row["speedup_vs_bf16"] = row["bf16_layer_ms"] / row["layer_ms"]
                    row["speedup_graph_vs_bf16"] = row["bf16_layer_ms"] / row["layer_graph_ms"]
                    row["local_reduce_speedup_vs_bf16"] = row["bf16_layer_ms"] / row["local_reduce_layer_ms"]
                    row["waves_speedup_vs_bf16"] = row["bf16_layer_ms"] / row["waves_layer_ms"]  # the default layer
                    if "fp8_layer_ms" in row:
                        row["fp8_speedup_vs_bf16"] = row["bf16_layer_ms"] / row["fp8_layer_ms"]
            except Exception as error:  # noqa: BLE001 - a missing baseline is reported, not fatal
                row["bf16_layer_error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():  # the ranks would each fail in NCCL's setup with a traceback
        raise SystemExit("bench_moe: no CUDA device (the MoE layer benchmark runs on GPUs)")
    if args.nproc > torch.cuda.device_count():  # ranks sharing a GPU time-slice it: no performance figure
        raise SystemExit(f"bench_moe: --nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} "
                         "visible (ranks sharing a GPU would be timed as if each had one)")
    from ep_comm.launch import run_ranks
    results = run_ranks(worker, args.nproc, args, backend="nccl", timeout_s=900)
    rows = results[0]
    print(f"{'tokens':>7} {'layer ms':>9} {'disp':>7} {'experts':>8} {'comb':>7} {'exposed':>8} {'bf16 ms':>8} "
          f"{'speedup':>8} | graph: {'layer':>7} {'disp':>6} {'experts':>8} {'comb':>6} {'exposed':>8}")
    for r in rows:
        print(f"{r['tokens_per_rank']:>7} {r['layer_ms']:>9.3f} {r['dispatch_ms']:>7.3f} {r['experts_ms']:>8.3f} "
              f"{r['combine_ms']:>7.3f} {r['exposed_comm_fraction']:>8.2f} {r.get('bf16_layer_ms', float('nan')):>8.3f} "
              f"{r.get('speedup_vs_bf16', float('nan')):>8.2f} |        {r['layer_graph_ms']:>7.3f} "
              f"{r['dispatch_graph_ms']:>6.3f} {r['experts_graph_ms']:>8.3f} {r['combine_graph_ms']:>6.3f} "
              f"{r['exposed_comm_graph_fraction']:>8.2f}")
        print(f"{'':>7} combine_rows={r['combine_rows']} above; combine_rows=False: layer "
              f"{r['local_reduce_layer_ms']:.3f} ms, graph {r['local_reduce_layer_graph_ms']:.3f} ms, exposed "
              f"{r['local_reduce_exposed_comm_graph_fraction']:.2f}"
              + (f"; rows: experts + combine {r['rows_experts_and_combine_graph_ms']:.3f} ms, begin + finish alone "
                 f"{r['rows_begin_finish_graph_ms']:.3f} ms" if r["combine_rows"] else ""))
        print(f"{'':>7} waves ({r['waves_sms']} receive SMs): layer {r['waves_layer_ms']:.3f} ms, graph "
              f"{r['waves_layer_graph_ms']:.3f} ms, exposed {r['waves_exposed_comm_graph_fraction']:.2f}; dispatch + "
              f"w1 graph: waves {r['waves_dispatch_w1_graph_ms']:.3f} ms vs plain {r['dispatch_w1_graph_ms']:.3f} ms "
              f"(expansion pass {r['expand_graph_ms']:.3f}, w1 {r['w1_graph_ms']:.3f})")
        if "fp8_layer_ms" in r:
            print(f"{'':>7} FP8 mode (expert_precision='fp8_inexact'; waves={r['fp8_waves']}, combine_rows="
                  f"{r['fp8_combine_rows']}): layer {r['fp8_layer_ms']:.3f} ms, graph {r['fp8_layer_graph_ms']:.3f} ms;"
                  f" without waves and combine rows {r['fp8_plain_layer_ms']:.3f} ms, graph "
                  f"{r['fp8_plain_layer_graph_ms']:.3f} ms; experts graph {r['fp8_experts_graph_ms']:.3f} ms; "
                  f"relative L2 (without waves and rows) against the combine_rows=False exact layer "
                  f"{r['fp8_relative_l2_vs_exact_layer']:.3e}"
                  + (f"; {r['fp8_speedup_vs_bf16']:.2f}x the BF16 pipeline" if "fp8_speedup_vs_bf16" in r else ""))
        extra = {k: round(v, 3) for k, v in r.items() if k.startswith("tile") or
                 (k.startswith("waves") and k[5:6].isdigit())}
        if extra:
            print(f"{'':>7} token tile {r['token_tile']} above; other tiles: {extra}")
        if "bf16_layer_error" in r:  # the table's bf16 columns are nan: say why here, not only in the JSON
            print(f"{'':>7} BF16 baseline failed: {r['bf16_layer_error']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(strict_json({"meta": run_metadata(), "rows": rows, "per_rank": results}), f, indent=1,
                      allow_nan=False)


if __name__ == "__main__":
    main()
