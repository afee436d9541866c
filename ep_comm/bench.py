"""The main job: real dispatch/combine on every GPU found, or on CPU ranks over gloo when there is none.

    python -m ep_comm.bench                      # all visible GPUs (backend auto), or 2 CPU ranks
    python -m ep_comm.bench --tokens 4096 --hidden 7168 --topk 8 --experts 256 --out result.json

For each (dispatch format, combine format) pair it prints: wire bytes per token and destination, median dispatch and
combine time (GPU: device time of calls enqueued back to back, timed by CUDA events; CPU: wall time), wire GB/s (payload
bytes that leave the rank for other ranks / time, per rank; the per-row metadata the nvlink kernels also store, 112
bytes per row at top-8, is not counted), BF16-equivalent GB/s (2·H bytes per token-destination / time), the combine's
own error (relative L2 against a BF16 combine of the same expert rows) and the end-to-end error (relative L2 and SQNR in
dB against the unquantized result) for a toy expert (a per-expert scale). The detailed GPU benchmark with NCCL and
peer-copy baselines is bench/bench_dispatch_combine.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

from .launch import run_ranks
from .types import COMBINE_FORMATS, DISPATCH_FORMATS, combine_bytes_per_token, dispatch_bytes_per_token

DEFAULT_PAIRS = "nvfp4/s2f6,mxfp8/s2f6,bf16/bf16"


# Flag checks shared by this main job, the benchmarks in bench/ and the examples: bad values are refused with
# argparse's message before any rank starts, not as one traceback per rank from inside the Buffer.
def check_routing_flags(parser, args, positive, world=None, world_what="ranks") -> None:
    """Each flag in `positive` >= 1, --topk <= --experts, and (world given) --experts a multiple of the ranks."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.topk > args.experts:
        parser.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if world is not None and args.experts % world:
        parser.error(f"--experts {args.experts} is not a multiple of the {world} {world_what}")


def check_hidden(parser, hidden: int) -> None:
    """--hidden: a positive multiple of 32 (S2F6 and MXFP8 blocks; NVFP4's 16 divides it)."""
    if hidden < 1 or hidden % 32:
        parser.error(f"--hidden must be a positive multiple of 32, got {hidden}")


def check_out_path(parser, out: Optional[str]) -> None:
    """--out (None: not given): a file that can be written, checked now, not after a run of many minutes."""
    if out is None:
        return
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out) or not os.path.isdir(folder):
        parser.error(f"--out {out!r}: not a writable file path (its folder must exist)")
    existed = os.path.exists(out)
    try:  # (an open, not os.access: root passes that check for read-only files and folders)
        with open(out, "a"):
            pass
    except OSError as error:
        parser.error(f"--out {out!r}: cannot be written ({error.strerror})")
    if not existed:
        os.remove(out)


def parse_format_pairs(parser, text: str) -> list:
    """--formats "d/c,d/c": the (dispatch format, combine format) pairs, each a known format."""
    pairs = [tuple(pair.split("/")) for pair in text.split(",") if pair]
    if not pairs:
        parser.error("--formats names no dispatch/combine pair")
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in DISPATCH_FORMATS or pair[1] not in COMBINE_FORMATS:
            parser.error(f"--formats pair {'/'.join(pair)!r}: dispatch is one of {'/'.join(DISPATCH_FORMATS)}, "
                         f"combine one of {'/'.join(COMBINE_FORMATS)}")
    return pairs


def parse_token_counts(parser, text: str) -> list:
    """--tokens "128,4096": positive token counts."""
    try:
        counts = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens must be a comma list of token counts, got {text!r}")
    if not counts or min(counts) < 1:
        parser.error(f"--tokens must name positive token counts, got {text!r}")
    return counts


def parse_args(argv=None):
    """The command line (README, "Quick start") as an argparse.Namespace, GPU or CPU defaults filled in and checked;
    argparse's error (exit 2) for a bad value."""
    parser = argparse.ArgumentParser(prog="python -m ep_comm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (GPU default 4096, CPU 256)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (GPU default 7168, CPU 1024)")
    parser.add_argument("--topk", type=int, default=None, help="top-k (default 8 on GPU, 4 on CPU)")
    parser.add_argument("--experts", type=int, default=None, help="global experts (GPU default 256, CPU 32)")
    parser.add_argument("--formats", default=DEFAULT_PAIRS, help=f"dispatch/combine pairs (default {DEFAULT_PAIRS})")
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "nvlink"])
    parser.add_argument("--ranks", type=int, default=None, help="ranks (default: every GPU, or 2 CPU ranks)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (GPU default 20, CPU 5)")
    parser.add_argument("--cpu", action="store_true", help="use CPU ranks over gloo even when GPUs exist")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before the run counts as hung and its ranks are killed (default 900; large CPU "
                             "runs take longer)")
    args = parser.parse_args(argv)
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0 and not args.cpu
    args.device = "cuda" if use_gpu else "cpu"
    defaults = dict(tokens=4096, hidden=7168, topk=8, experts=256, iters=20) if use_gpu else dict(
        tokens=256, hidden=1024, topk=4, experts=32, iters=5)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ranks_chosen = args.ranks is None  # (print_table says why the default took fewer GPUs than there are)
    if args.ranks is None:
        # Every GPU, or the most ranks up to that which divide the experts (256 over 6 GPUs cannot): said in the table.
        args.ranks = max(r for r in range(1, torch.cuda.device_count() + 1) if args.experts % r == 0) \
            if use_gpu else 2
    if use_gpu and args.ranks > torch.cuda.device_count():
        parser.error(f"--ranks {args.ranks} exceeds the {torch.cuda.device_count()} visible GPUs")
    check_hidden(parser, args.hidden)
    check_routing_flags(parser, args, ("tokens", "iters", "ranks", "experts", "topk"), world=args.ranks)
    if args.backend == "nvlink" and args.device == "cpu":
        parser.error("--backend nvlink needs GPUs (these ranks run on the CPU over gloo); use auto or reference")
    check_out_path(parser, args.out)
    if not 0 < args.timeout <= 1e6:  # (NaN and inf fail too: the collectives' timeout must be a finite duration)
        parser.error(f"--timeout must be a positive number of seconds up to 1e6, got {args.timeout}")
    args.pairs = parse_format_pairs(parser, args.formats)
    return args


def _expert_scale(experts: torch.Tensor) -> torch.Tensor:
    return 1.0 + (experts.to(torch.float32) % 7) / 8.0


def _make_inputs(args, rank, device):
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 1000),), generator=gen)] *= 20.0
    scores = torch.rand(args.tokens, args.experts, generator=gen)
    topk_idx = scores.topk(args.topk, dim=1).indices
    weights = torch.softmax(torch.randn(args.tokens, args.topk, generator=gen), dim=1)
    return x.to(torch.bfloat16).to(device), topk_idx.to(device), weights.to(device)


def _time_calls(buf, x, topk_idx, weights, expert_out, iters: int, device):
    """(dispatch seconds per call, combine seconds per call, last combine output) over `iters` dispatch + combine
    pairs. GPU: the pairs are enqueued back to back (no host sync, no barrier between them) with a CUDA event before and
    after each call, so an interval is the call's device time whenever the host keeps ahead of the GPU (an eager call
    costs ~45-57 us of host time on the H200 machine's CPU, up to ~95 on a slow one: bench/profile_host.py); a call
    shorter than that shows its host cost instead. The reference backend syncs with the host in every call (it reads the
    split sizes), so on GPUs its intervals include that host work and the GPU's idle time. CPU ranks (gloo): the wall
    time of each call, the ranks aligned by a barrier before it."""
    import torch.distributed as dist

    dispatch_times, combine_times = [], []
    y = None
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * iters + 1)]
        torch.cuda.synchronize()
        dist.barrier()
        events[0].record()
        for i in range(iters):
            result = buf.dispatch(x, topk_idx, weights, check_inputs=False)
            events[2 * i + 1].record()
            y = buf.combine(expert_out, result.handle)
            events[2 * i + 2].record()
        events[-1].synchronize()
        for i in range(iters):
            dispatch_times.append(events[2 * i].elapsed_time(events[2 * i + 1]) * 1e-3)
            combine_times.append(events[2 * i + 1].elapsed_time(events[2 * i + 2]) * 1e-3)
        return dispatch_times, combine_times, y
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        result = buf.dispatch(x, topk_idx, weights, check_inputs=False)
        dispatch_times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        y = buf.combine(expert_out, result.handle)
        combine_times.append(time.perf_counter() - start)
    return dispatch_times, combine_times, y


def _worker(rank, world, args):
    import torch.distributed as dist

    import ep_comm
    from ep_comm import formats
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    x, topk_idx, weights = _make_inputs(args, rank, device)
    num_local = args.experts // world
    # Tokens that leave this rank: one per (token, other destination rank).
    dest = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
    goes_to = torch.zeros(args.tokens, world, dtype=torch.bool, device=device)
    for d in range(world):
        goes_to[:, d] = (dest == d).any(dim=1)
    remote_pairs = int(goes_to.sum()) - int(goes_to[:, rank].sum())  # rows this rank's dispatch sends away
    # Unquantized result of the toy expert (per-expert scale), FP32.
    reference = (weights[..., None] * _expert_scale(topk_idx)[..., None] * x.float()[:, None, :]).sum(dim=1)
    rows = []
    for dispatch_format, combine_format in args.pairs:
        buf = ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                             max_tokens_per_rank=args.tokens, dispatch_format=dispatch_format,
                             combine_format=combine_format, backend=args.backend)
        # Two warm-up iterations with the Buffer's input checks (the expert-id check copies to the host), then the
        # timed ones (_time_calls): the inputs are the same tensors, so they skip that check, as MoELayer does.
        for iteration in range(2):
            dist.barrier()
            result = buf.dispatch(x, topk_idx, weights)
            if iteration == 0:
                combine_pairs = combine_send_rows(result, rank, args.tokens)[0]
                offsets = result.expert_offsets.to(torch.int64).cpu()
                experts_of_row = torch.zeros(result.num_rows, dtype=torch.int64)
                for j in range(num_local):
                    experts_of_row[offsets[j]:offsets[j + 1]] = rank * num_local + j
                expert_out = (formats.dequantize(result.x)
                              * _expert_scale(experts_of_row.to(device))[:, None]).to(torch.bfloat16)
                expert_out[result.src_rank < 0] = 0
            dist.barrier()
            y = buf.combine(expert_out, result.handle)
        dispatch_times, combine_times, y = _time_calls(buf, x, topk_idx, weights, expert_out, args.iters, device)
        error = (y.float() - reference).norm().item()
        signal = reference.norm().item()
        buf_backend = buf.backend
        buf.destroy()
        # The combine's own error: against a BF16 combine (FP32 sums) of the same expert rows, through a dispatch of
        # the same tokens in the same format (the same deterministic row layout). A BF16 combine is that reference.
        combine_error = 0.0
        if combine_format != "bf16":
            exact = ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                                   max_tokens_per_rank=args.tokens, dispatch_format=dispatch_format,
                                   combine_format="bf16", backend=args.backend)
            exact_y = exact.combine(expert_out, exact.dispatch(x, topk_idx, weights).handle).float()
            exact.destroy()
            combine_signal = exact_y.norm().item()
            combine_error = (y.float() - exact_y).norm().item() / combine_signal if combine_signal else 0.0
        t_dispatch, t_combine = statistics.median(dispatch_times), statistics.median(combine_times)
        d_bytes = dispatch_bytes_per_token(dispatch_format, args.hidden)
        c_bytes = combine_bytes_per_token(combine_format, args.hidden)
        bf16_bytes = 2 * args.hidden
        rows.append(dict(
            rank=rank, backend=buf_backend, dispatch_format=dispatch_format, combine_format=combine_format,
            dispatch_bytes_per_token=d_bytes, combine_bytes_per_token=c_bytes, remote_token_pairs=remote_pairs,
            dispatch_us=t_dispatch * 1e6, combine_us=t_combine * 1e6,
            # No rows to other ranks (one rank): no wire rate to give (None, "n/a" in the table), rather than 0.
            dispatch_wire_gbps=remote_pairs * d_bytes / t_dispatch / 1e9 if remote_pairs else None,
            combine_wire_gbps=combine_pairs * c_bytes / t_combine / 1e9 if combine_pairs else None,
            dispatch_bf16_equiv_gbps=remote_pairs * bf16_bytes / t_dispatch / 1e9 if remote_pairs else None,
            combine_bf16_equiv_gbps=combine_pairs * bf16_bytes / t_combine / 1e9 if combine_pairs else None,
            combine_row_pairs=combine_pairs,
            combine_rel_l2_error=combine_error,
            rel_l2_error=error / signal if signal else 0.0,
            sqnr_db=20 * math.log10(signal / error) if error else float("inf")))
    return rows


def print_table(rows, args) -> None:
    """Prints rank 0's figures per format pair, then, with several ranks, each pair's slowest rank (rank skew shows
    there; the JSON has every rank's rows)."""
    rank0 = [r for r in rows if r["rank"] == 0]
    print(f"ep_comm.bench: {args.ranks} {args.device.upper()} ranks, backend {rank0[0]['backend'] if rank0 else '?'}, "
          f"tokens/rank {args.tokens}, hidden {args.hidden}, top-{args.topk} of {args.experts} experts, "
          f"{args.iters} timed iterations (median; rank 0 shown)")
    header = (f"{'dispatch/combine':<17}{'B/tok d':>9}{'B/tok c':>9}{'disp us':>10}{'comb us':>10}"
              f"{'d GB/s':>9}{'d bf16eq':>10}{'c GB/s':>9}{'c bf16eq':>10}{'comb L2':>9}{'e2e L2':>9}{'SQNR dB':>9}")
    print(header)
    print("-" * len(header))

    def rate(value):  # GB/s: 3 significant digits below 100 (CPU ranks move MB/s), one decimal above
        if value is None:
            return "n/a"  # nothing crossed to another rank
        return f"{value:.1f}" if value >= 100 else f"{value:.3g}"

    def micros(value):  # one decimal, in the column's width up to ~1 s (CPU ranks can take seconds)
        return f"{value:.1f}" if value < 1e6 else f"{value:.3e}"
    for r in rank0:
        print(f"{r['dispatch_format'] + '/' + r['combine_format']:<17}{r['dispatch_bytes_per_token']:>9}"
              f"{r['combine_bytes_per_token']:>9}{micros(r['dispatch_us']):>10}{micros(r['combine_us']):>10}"
              f"{rate(r['dispatch_wire_gbps']):>9}{rate(r['dispatch_bf16_equiv_gbps']):>10}"
              f"{rate(r['combine_wire_gbps']):>9}{rate(r['combine_bf16_equiv_gbps']):>10}"
              f"{r['combine_rel_l2_error']:>9.4f}{r['rel_l2_error']:>9.4f}{r['sqnr_db']:>9.1f}")
    print("comb L2: the combine's own error (against a BF16 combine of the same expert rows); e2e L2 / SQNR: "
          "dispatch + combine against the unquantized toy expert")
    if args.ranks > 1:
        for r in rank0:
            pair = [o for o in rows if (o["dispatch_format"], o["combine_format"]) ==
                    (r["dispatch_format"], r["combine_format"])]
            slow_d = max(pair, key=lambda o: o["dispatch_us"])
            slow_c = max(pair, key=lambda o: o["combine_us"])
            print(f"{r['dispatch_format'] + '/' + r['combine_format']:<17}slowest rank: dispatch "
                  f"{micros(slow_d['dispatch_us'])} us (rank {slow_d['rank']}), combine {micros(slow_c['combine_us'])} "
                  f"us (rank {slow_c['rank']})")
    if args.device == "cuda" and getattr(args, "ranks_chosen", False) and args.ranks < torch.cuda.device_count():
        print(f"{args.ranks} of the {torch.cuda.device_count()} visible GPUs: --experts must be a multiple of the "
              f"ranks")
    if rank0 and (rank0[0]["dispatch_wire_gbps"] is None or rank0[0]["combine_wire_gbps"] is None):
        print("n/a: one rank, so no token crosses to another rank (the times are the kernels' local work)"
              if args.ranks == 1 else "n/a: rank 0 sent no rows to another rank in that direction")


def combine_send_rows(result, rank: int, tokens: int) -> tuple:
    """(rows, expert rows) a rank's combine stores into other ranks after `result` (its dispatch): one per (token, source
    rank) pair it received from another rank (local_reduce=True), and one per received (token, expert) row
    (local_reduce=False). These are the other ranks' tokens, not this rank's own dispatch rows: the two counts differ by
    the routing's imbalance."""
    remote = (result.src_rank >= 0) & (result.src_rank != rank)
    pairs = result.src_rank[remote].to(torch.int64) * tokens + result.src_token[remote].to(torch.int64)
    return int(torch.unique(pairs).numel()), int(remote.sum())


def strict_json(value):
    """value with its non-finite floats as the strings "nan", "inf", "-inf" (in dicts, lists and tuples, at any depth):
    strict JSON has no NaN / Infinity, and such figures occur (an exact result's SQNR, the errors of a NaN output, an
    exposed fraction whose communication time is 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _git_commit() -> Optional[str]:
    """EP_COMM_SOURCE_COMMIT when set (a copy of a working tree whose .git, if any, is not that tree's: the device
    machine's copy carried an older HEAD), else HEAD of the checkout the package runs from, with "+dirty" for local
    changes; None outside a git checkout."""
    if os.environ.get("EP_COMM_SOURCE_COMMIT"):
        return os.environ["EP_COMM_SOURCE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        # Only this project's checkout: an install inside another repository (a .venv in it) must not record that
        # repository's HEAD (git looks for a .git upwards from root).
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not top or os.path.realpath(top) != os.path.realpath(root) or subprocess.run(
                ["git", "-C", root, "ls-files", "--error-unmatch", "ep_comm/bench.py"], capture_output=True,
                timeout=10).returncode != 0:
            return None
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(command: Optional[str] = None) -> dict:
    """What every benchmark JSON (this main job's and bench/*.py's) records about its run, so that a file found on its
    own still says what it measured: date (UTC), command line (default: this process's), host, git commit, torch and
    CUDA versions, and the visible GPUs."""
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command or " ".join([os.path.basename(sys.executable)] + sys.argv),
        "host": platform.node(),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
    }


def write_report(path: str, args, **figures) -> None:
    """A benchmark's JSON file: {"meta": run_metadata(), "args": the parsed arguments but `out`, **figures}, strict
    JSON (strict_json)."""
    report = {"meta": run_metadata(), "args": {k: v for k, v in vars(args).items() if k != "out"}, **figures}
    with open(path, "w") as f:
        json.dump(strict_json(report), f, indent=1)


def main(argv=None) -> int:
    """Runs the benchmark on the ranks parse_args chose, prints the table, writes --out; the process exit code."""
    args = parse_args(argv)
    # (each spawned rank sets launch.GPU_ENV before it touches NCCL)
    # A rank slow to exit after reporting (NCCL or peer-memory teardown) is warned about: the figures are in.
    per_rank = run_ranks(_worker, args.ranks, args, backend="nccl" if args.device == "cuda" else "gloo",
                         timeout_s=args.timeout, hang_at_teardown="warn")
    rows = [row for rank_rows in per_rank for row in rank_rows]
    print_table(rows, args)
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "pairs"}
        meta.update(run_metadata(" ".join([os.path.basename(sys.executable), "-m", "ep_comm.bench"]
                                          + (sys.argv[1:] if argv is None else list(argv)))))
        with open(args.out, "w") as handle:
            json.dump(strict_json({"config": meta, "results": rows}), handle, indent=1, allow_nan=False)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
