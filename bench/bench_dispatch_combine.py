"""Dispatch / combine benchmark: nvlink backend vs the reference backend (NCCL), plus peer-copy ceilings.

    torchrun --nproc_per_node=2 bench/bench_dispatch_combine.py --out bench.json
    python bench/bench_dispatch_combine.py --nproc 2          # spawns itself
    (run(args) works on every rank of an initialized NCCL group; `python -m ep_comm.bench` is the smaller main job)

Shape: H = 7168, top-8 of 256 experts, random routing, 128 / 512 / 4096 / 8192 tokens per rank (flags).
Timing, per kernel pair (dispatch = layout + send + receive kernels; combine = send + receive):
  iso   : median over iterations of one call between CUDA events, each after a barrier + synchronize
          (includes the ranks' launch skew; the pessimistic, latency-style number),
  graph : N calls captured in one CUDA graph, replayed back to back; time / N (steady-state throughput;
          nvlink only — the reference syncs with the host and cannot be captured),
  pipe  : (NCCL baseline, with a BF16 format) all_to_all_single of the BF16 token rows the dispatch moves, N calls
          back to back between events, time / N — the all_to_all figure of H200-BASELINE.md, measured in this run.
dispatch_rows (nvlink, graph): dispatch(expand=False), the received rows left in staging with a row index (no expansion).
With S2F6 or MXFP8 combine also (graph): combine_expert_rows = combine(local_reduce=False), one row per (token, expert);
S2F6 only: combine_rows_begin_finish = what the combine-row form leaves outside the w2 GEMM (MoELayer's default: the
GEMM's epilogue stores the rows), i.e. begin (wait on the peers' flags) + finish (release + receive), here without a GEMM.
Bytes: `wire` = for nvlink, bytes this rank stores into OTHER ranks' memory (the staged row: payload + our per-row
metadata, 4·(2 + 3K) bytes, + padding to 16 B, e.g. 4144 B per NVFP4 row at H = 7168 against a 4036-byte payload), i.e. what
crosses NVLink per rank per direction; for the reference backend the format's payload bytes per row (its metadata
travels in separate collectives, not counted). The main job (`python -m ep_comm.bench`) counts the payload for both,
so its nvlink wire GB/s is ~2.6% below this one's for NVFP4. `bf16_eq` = 2·H per (token, peer rank) row — the
BF16-equivalent rate, the same for every format and backend (the figure to compare across them).
Dispatch rows are this rank's tokens, once per other destination rank; combine rows are the (token, source rank)
pairs this rank received from other ranks (combine_expert_rows: one per received (token, expert) row), which it
sends back.
SMs: the blocks (one per SM) of the op's send / receive kernels as they ran: the BF16 and MXFP8 dispatch send runs
num_sms blocks, every other nvlink kernel (NVFP4 quantize-send, receive/expansion, combine reduction and receive)
num_local_sms (0 = all SMs); the reference is NCCL's choice.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from ep_comm.bench import run_metadata  # noqa: E402
from ep_comm.launch import GPU_ENV  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,512,4096,8192", help="tokens per rank, comma separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--num-local-sms", type=int, default=0, help="blocks of the nvlink local phases (0 = all SMs)")
    p.add_argument("--formats", default="nvfp4/s2f6,mxfp8/s2f6,bf16/bf16",
                   help="dispatch/combine format pairs, comma separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph-calls", type=int, default=8, help="calls per CUDA graph for the 'graph' timing")
    p.add_argument("--no-reference", action="store_true", help="skip the NCCL reference baseline")
    p.add_argument("--no-ceiling", action="store_true", help="skip the peer-copy ceiling")
    p.add_argument("--out", default="", help="write the rows as JSON here (rank 0)")
    p.add_argument("--nproc", type=int, default=0, help="spawn this many ranks (when not under torchrun)")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p, args) -> None:
    """Refuse bad flags here, with argparse's message, not as a traceback from inside every spawned rank."""
    from ep_comm.bench import check_hidden, check_out_path, check_routing_flags, parse_format_pairs, parse_token_counts
    args.token_list = parse_token_counts(p, args.tokens)
    check_routing_flags(p, args, ("experts", "topk", "iters", "graph_calls", "num_sms"))
    if args.num_local_sms < 0 or args.nproc < 0:
        p.error("--num-local-sms and --nproc must not be negative")
    check_hidden(p, args.hidden)
    args.pairs = parse_format_pairs(p, args.formats)
    check_out_path(p, args.out or None)


def _check_world(args, world: int) -> None:
    """The flags that depend on the rank count, checked before any rank starts."""
    if args.experts % world:
        raise SystemExit(f"[bench] --experts {args.experts} is not a multiple of the {world} ranks")


# ----------------------------------------------------------------------------------------------------------
def _iso_time_us(fn, iters, group) -> float:
    """Median over iterations of one call between CUDA events, each after a barrier + synchronize (µs)."""
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _graph_time_us(make_calls, calls, group, reps=5) -> float:
    """make_calls(n) issues n calls; capture them in one graph, replay, time per call (median of reps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        make_calls(1)  # warm-up allocations on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        make_calls(calls)
    graph.replay()
    torch.cuda.synchronize()
    per_call = _iso_time_us(graph.replay, reps, group) / calls
    del graph
    return per_call


def _routing(rank, tokens, hidden, experts, topk):
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.cuda()
    w = torch.rand(tokens, topk, generator=gen).cuda()
    return x, idx, w


def _destinations(idx, world, experts):
    """bool [T, W]: whether token t goes to rank d (one of its experts lives there)."""
    goes = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=idx.device)
    goes.scatter_(1, idx // (experts // world), True)
    return goes


def _peer_rows(idx, rank, world, experts):
    """(token, peer rank) rows this rank sends (each token once per destination rank other than itself)."""
    goes = _destinations(idx, world, experts)
    return int(goes.sum() - goes[:, rank].sum())


def _nccl_all_to_all_rows(args, tokens, rank, world, group, calls=10, reps=5):
    """NCCL baseline in the same run: torch all_to_all_single of BF16 token rows, each token once per destination rank
    it routes to (this rank's own rows included: NCCL copies them locally), the same routing as the dispatch. Timing
    `pipe`: `calls` back-to-back calls between CUDA events after a barrier, per call, median of `reps`."""
    x, idx, _ = _routing(rank, tokens, args.hidden, args.experts, args.topk)
    goes = _destinations(idx, world, args.experts)
    order = [x[goes[:, d]] for d in range(world)]  # rows for destination d, token order
    send = torch.cat(order).contiguous()
    send_counts = torch.tensor([o.shape[0] for o in order], dtype=torch.int64, device="cuda")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
    recv = torch.empty(sum(out_splits), args.hidden, dtype=torch.bfloat16, device="cuda")

    def calls_fn():
        for _ in range(calls):
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    calls_fn()  # warm-up
    us = _iso_time_us(calls_fn, reps, group) / calls
    wire = (sum(in_splits) - in_splits[rank]) * 2 * args.hidden  # bytes to the other ranks
    rate = round(wire / us / 1e3, 1)  # BF16 rows: wire and BF16-equivalent rates are the same
    return [{"backend": "nccl", "kernel": "all_to_all_single (bf16 rows)", "format": "bf16", "tokens": tokens,
             "world": world, "timing": "pipe", "time_us": round(us, 2), "wire_bytes": wire, "wire_GBps": rate,
             "bf16_eq_GBps": rate, "sms": "nccl", "rank": rank}]


def _bench_backend(args, backend, tokens, dfmt, cfmt, rank, world, group):
    import ep_comm
    from ep_comm.backends.nvlink import _RegionLayout
    from ep_comm.bench import combine_send_rows
    from ep_comm.types import combine_bytes_per_token, dispatch_bytes_per_token
    buf = ep_comm.Buffer(group, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                         max_tokens_per_rank=tokens, dispatch_format=dfmt, combine_format=cfmt, backend=backend,
                         num_sms=args.num_sms, num_local_sms=args.num_local_sms, check_inputs=False)
    rows = []
    try:
        x, idx, w = _routing(rank, tokens, args.hidden, args.experts, args.topk)
        res = buf.dispatch(x, idx, w)  # also the dispatch's warm-up
        expert_out = torch.randn(res.num_rows, args.hidden, device="cuda").to(torch.bfloat16)
        buf.combine(expert_out, res.handle)  # the combine's warm-up (its first call is not one of the timed ones)
        peer_rows = _peer_rows(idx, rank, world, args.experts)
        back_rows, back_expert_rows = combine_send_rows(res, rank, tokens)
        if backend == "nvlink":
            layout = _RegionLayout.of(buf.config)
            wire_d, wire_c = peer_rows * layout.disp_row_bytes, back_rows * layout.comb_row_bytes
        else:
            wire_d = peer_rows * dispatch_bytes_per_token(dfmt, args.hidden)
            wire_c = back_rows * combine_bytes_per_token(cfmt, args.hidden)
        bf16_eq = {"dispatch": peer_rows * 2 * args.hidden, "combine": back_rows * 2 * args.hidden}
        timings = {
            "dispatch": {"iso": _iso_time_us(lambda: buf.dispatch(x, idx, w), args.iters, group)},
            "combine": {"iso": _iso_time_us(lambda: buf.combine(expert_out, res.handle), args.iters, group)},
        }
        if backend == "nvlink":
            def dispatches(n):
                for _ in range(n):
                    buf.dispatch(x, idx, w)

            def combines(n):
                for _ in range(n):
                    buf.combine(expert_out, res.handle)
            def row_dispatches(n):  # expand=False: the rows stay in staging, the receive writes row_index only
                for _ in range(n):
                    buf.dispatch(x, idx, w, expand=False)
            timings["dispatch"]["graph"] = _graph_time_us(dispatches, args.graph_calls, group)
            timings["dispatch_rows"] = {"graph": _graph_time_us(row_dispatches, args.graph_calls, group)}
            timings["combine"]["graph"] = _graph_time_us(combines, args.graph_calls, group)
            if cfmt in ("s2f6", "mxfp8"):
                # One row per (token, expert): combine(local_reduce=False); for S2F6 also the part of the combine-row
                # form that is not inside the w2 GEMM's epilogue (begin = wait for the peers' flags, finish = release +
                # receive; MoELayer's default), timed without the GEMM between them.
                def expert_row_combines(n):
                    for _ in range(n):
                        buf.combine(expert_out, res.handle, local_reduce=False)

                def rows_finishes(n):
                    for _ in range(n):
                        buf.begin_combine_rows(res)
                        buf.finish_combine_rows(res.handle)
                timings["combine_expert_rows"] = {"graph": _graph_time_us(expert_row_combines, args.graph_calls,
                                                                          group)}
                if cfmt == "s2f6":
                    timings["combine_rows_begin_finish"] = {"graph": _graph_time_us(rows_finishes, args.graph_calls,
                                                                                    group)}
        expert_rows = back_expert_rows * (layout.comb_row_bytes if backend == "nvlink" else 0)
        # begin + finish alone move no payload (the rows are the GEMM's stores): wire 0, only the time is reported
        # (no BF16-equivalent rate either: the time leaves out the GEMM that stores the rows).
        for kernel, wire in (("dispatch", wire_d), ("dispatch_rows", wire_d), ("combine", wire_c),
                             ("combine_expert_rows", expert_rows), ("combine_rows_begin_finish", 0)):
            if kernel not in timings:
                continue
            fmt = dfmt if kernel.startswith("dispatch") else cfmt
            eq = bf16_eq["dispatch" if kernel.startswith("dispatch") else "combine"]
            for method, us in timings[kernel].items():  # (bf16_eq_GBps: per (token, rank) row, as for combine)
                rows.append({
                    "backend": backend, "kernel": kernel, "format": fmt, "tokens": tokens, "world": world,
                    "timing": method, "time_us": round(us, 2), "wire_bytes": wire,
                    "wire_GBps": round(wire / us / 1e3, 1),
                    "bf16_eq_GBps": None if kernel == "combine_rows_begin_finish" else round(eq / us / 1e3, 1),
                    "sms": _blocks(buf, kernel) if backend == "nvlink" else "nccl", "rank": rank,
                    "peer_memory": buf._backend.region.kind if backend == "nvlink" else "nccl",
                })
        if backend == "nvlink":
            buf._backend.check()
    finally:
        buf.destroy()
    return rows


def _ceiling_rows(rank, world, group, nbytes=1 << 30):
    """Peer copy ceilings from rank 0 to rank 1: copy engine (cudaMemcpyPeer via a cross-device copy_)
    and SM stores into the peer (an elementwise kernel writing through an NVSHMEM peer view)."""
    rows = []
    if world < 2 or torch.cuda.device_count() < 2:
        return rows
    if rank == 0:
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
        dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda:1")
        for _ in range(2):
            dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            times.append(time.perf_counter() - start)
        us = statistics.median(times) * 1e6
        rows.append({"backend": "ceiling", "kernel": "cudaMemcpyPeer (copy engine)", "format": "bytes",
                     "tokens": 0, "world": world, "timing": "host", "time_us": round(us, 1), "wire_bytes": nbytes,
                     "wire_GBps": round(nbytes / us / 1e3, 1), "bf16_eq_GBps": None, "sms": 0, "rank": 0})
        del src, dst
        torch.cuda.empty_cache()
    try:
        import nvshmem.core as nvshmem
        from ep_comm.backends import nvlink as nvl
        if nvl._nvshmem_state["initialized"]:
            sym = nvshmem.tensor((nbytes // 4,), dtype=torch.float32)
            src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
            peer = nvshmem.get_peer_tensor(sym, (rank + 1) % world)
            dist.barrier(group=group)
            if rank == 0:
                try:  # rank 0's own failure stays here: the barrier and the collective free below run on every rank
                    rows.append(_sm_store_row(src, peer, nbytes, world))
                except Exception as error:
                    print(f"[bench] SM-store ceiling skipped: {error}", flush=True)
            torch.cuda.synchronize()
            dist.barrier(group=group)
            nvshmem.free_tensor(sym)
    except Exception as error:  # the ceiling is informative only
        if rank == 0:
            print(f"[bench] SM-store ceiling skipped: {error}", flush=True)
    dist.barrier(group=group)
    return rows


def _sm_store_row(src, peer, nbytes, world) -> dict:
    """SM stores of `src` into the peer view `peer` (all SMs), timed between CUDA events, median of 5."""
    for _ in range(2):
        torch.mul(src, 1.0, out=peer)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mul(src, 1.0, out=peer)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    us = statistics.median(times)
    return {"backend": "ceiling", "kernel": "SM stores into peer (all SMs)", "format": "bytes",
            "tokens": 0, "world": world, "timing": "events", "time_us": round(us, 1),
            "wire_bytes": nbytes, "wire_GBps": round(nbytes / us / 1e3, 1), "bf16_eq_GBps": None,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count, "rank": 0}


def run(args) -> list:
    """Run on every rank of an initialized process group (NCCL); returns this rank's rows. (NVLink multicast is kept off
    by main(), before the process group exists; a caller that makes its own group sets GPU_ENV itself first.)"""
    os.environ.update(GPU_ENV)  # for NVSHMEM, which starts with the first nvlink Buffer
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for tokens in args.token_list:
        for dfmt, cfmt in args.pairs:
            rows += _bench_backend(args, "nvlink", tokens, dfmt, cfmt, rank, world, group)
            if not args.no_reference:
                rows += _bench_backend(args, "reference", tokens, dfmt, cfmt, rank, world, group)
            torch.cuda.empty_cache()
        if not args.no_reference and world > 1 and any(d == "bf16" for d, _ in args.pairs):
            rows += _nccl_all_to_all_rows(args, tokens, rank, world, group)
    if not args.no_ceiling:
        rows += _ceiling_rows(rank, world, group)
    return rows


def _blocks(buf, kernel: str) -> str:
    """'send/receive' blocks of the nvlink kernels behind an op (the begin/finish form: its receive only)."""
    blocks = buf._backend.blocks
    if kernel.startswith("dispatch"):
        return f"{blocks['disp_send_blocks']}/{blocks['disp_recv_blocks']}"
    if kernel == "combine_rows_begin_finish":
        return f"-/{blocks['comb_recv_blocks']}"
    return f"{blocks['comb_send_blocks']}/{blocks['comb_recv_blocks']}"


def print_table(rows) -> None:
    """Every rank's row, rank by rank for each measurement: a collective is done when its last rank is, and the ranks'
    figures can differ by more than the noise (the 2-GPU run of 2026-12-01: NVFP4 dispatch at 128 tokens 26.7 µs on
    rank 0, 32.2 on rank 1). Quote the slowest rank."""
    header = f"{'backend':<10} {'kernel':<30} {'fmt':<6} {'tokens':>6} {'timing':<6} {'rank':>4} {'us':>9} " \
             f"{'wire GB/s':>10} {'bf16eq GB/s':>11} {'SMs':>9}"
    print(header)
    print("-" * len(header))
    order = {}
    for r in rows:  # the measurements in the order rank 0 made them, each with every rank's row
        order.setdefault((r["backend"], r["kernel"], r["format"], r["tokens"], r["timing"]), len(order))
    for r in sorted(rows, key=lambda r: (order[(r["backend"], r["kernel"], r["format"], r["tokens"], r["timing"])],
                                         r["rank"])):
        bf16 = "" if r["bf16_eq_GBps"] is None else r["bf16_eq_GBps"]
        print(f"{r['backend']:<10} {r['kernel']:<30} {r['format']:<6} {r['tokens']:>6} {r['timing']:<6} "
              f"{r['rank']:>4} {r['time_us']:>9} {r['wire_GBps']:>10} {bf16:>11} {str(r['sms']):>9}")


def _main_in_group(args):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    rows = run(args)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        flat = [r for rank_rows in gathered for r in rank_rows]
        print_table(flat)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": run_metadata(), "args": {k: v for k, v in vars(args).items() if k != "pairs"},
                           "rows": flat}, f, indent=1, default=str)
            print(f"[bench] wrote {len(flat)} rows to {args.out}")


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        _main_in_group(args)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    # NVLink multicast off before any process group or NVSHMEM exists (NCCL reads NCCL_NVLS_ENABLE when the communicator
    # is made, which device_id= does at init); spawned ranks inherit it.
    os.environ.update(GPU_ENV)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _check_world(args, int(os.environ["WORLD_SIZE"]))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # device_id: the group is bound to this GPU (NCCL's barrier() otherwise warns that it guesses the device)
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        try:
            _main_in_group(args)
        finally:
            dist.destroy_process_group()
        return
    world = args.nproc or torch.cuda.device_count()
    # One rank only when asked for (--nproc 1): all rows are then the rank's own, which times the kernels' local
    # work without a peer; found by itself, one GPU is more likely a mistake than a wish.
    if world < 1 or (world < 2 and args.nproc != 1):
        raise SystemExit("[bench] needs >= 2 GPUs (run under torchrun, or pass --nproc; --nproc 1 times one rank)")
    if world > torch.cuda.device_count():
        raise SystemExit(f"[bench] --nproc {world} exceeds the {torch.cuda.device_count()} visible GPUs")
    _check_world(args, world)
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
