"""What ep_comm.training's autograd costs: one forward + backward through dispatch and combine, against the forward
Buffer calls alone, in the same run (eager calls, CUDA events; every visible GPU up to --nproc, one rank each).

    python bench/bench_training.py --tokens 128,4096 --out training.json

The experts are the identity (expert_out = the dispatched rows, so the timing is the library's alone). Per token
count, median milliseconds of:
  forward_buffer   : Buffer.dispatch + Buffer.combine (no autograd), the forward's floor;
  forward_buffer_comm : the same on a comm_stream (the current stream waits for the combine's event);
  buffer_calls     : the six Buffer calls a forward + backward makes, alone (no autograd, no torch ops between);
  forward_training : training.dispatch + training.combine (+ the dense rows: the NVFP4 payload dequantized to bf16);
  forward_backward : the same plus .backward() of a sum over the output: a BF16 (or MXFP8) dispatch of the output
                     gradient, the routing-weight dots and their small dispatch + combine, and a BF16 combine of the
                     input gradient;
  forward_backward_graph : the same step captured once in a CUDA graph and replayed (gradients assigned, not
                     accumulated: set to None before the capture, as zero_grad() does).
With --layer-experts E (default 32; 0: off), at each token count, a whole training layer on its own Buffers
(top-k of E experts, all local, expert alignment 32): training.dispatch, training.ExpertMLP (FP32 masters,
intermediate size --layer-intermediate), training.combine and backward, gradients set to None before each step:
  layer_eager  : the step as eager autograd;
  layer_graph  : the step captured once in a CUDA graph and replayed.
With --shared-intermediate I_s (default 2048; 0: off), at each token count, a layer with a shared expert (a BF16
SwiGLU MLP of intermediate I_s on the rank's own tokens, torch matmuls) beside the identity experts:
training.dispatch, the shared expert, the dense rows, training.combine, their sum (and backward):
  shared_alone            : the shared expert's forward alone, the most that overlapping can hide;
  shared_forward_serial   : the layer's forward, every call on the current stream;
  shared_forward_overlap  : the same with dispatch and combine on a comm_stream: the shared expert, enqueued after
                            the dispatch, runs beside it;
  shared_*_overlap_capped : the same with the communication kernels on --shared-comm-sms blocks (num_local_sms;
                            by default they take every SM, and the kernel beside them gets SMs as they finish);
  shared_step_* : forward + backward (the backward is the same in every mode);
  shared_step_*_graph : forward + backward captured in a CUDA graph and replayed.
Every row also has its host milliseconds per call (_host_ms: no synchronization inside the loop; close to the device
figure means host-bound). Timing only; nothing here is asserted (tests/test_training.py checks the gradients, the
graph replays included).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import ep_comm  # noqa: E402
from bench_formats import time_ms  # noqa: E402  same directory: one timing method for the benchmarks
from bench_training_experts import captured  # noqa: E402  (and one capture recipe)
from ep_comm import training  # noqa: E402
from ep_comm.bench import (check_hidden, check_out_path, check_routing_flags, parse_token_counts,  # noqa: E402
                           write_report)
from ep_comm.launch import run_ranks  # noqa: E402
from ep_comm.types import COMBINE_FORMATS, DISPATCH_FORMATS  # noqa: E402


def _grad_buffers(buf, args):
    """The backward Buffers of `buf` in the formats the command line names (collective)."""
    return training.GradBuffers.create(buf, args.grad_format, input_grad_format=args.input_grad_format)


def _time_into(row: dict, name: str, fn, args) -> None:
    """row[name + "_ms"]: fn's median device milliseconds (CUDA events); row[name + "_host_ms"]: host milliseconds per
    call, no synchronization inside the loop (where it is close to the device figure, the call is host-bound)."""
    row[name + "_ms"] = time_ms(fn, iters=args.iters, batches=args.batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    row[name + "_host_ms"] = 1e3 * (time.perf_counter() - start) / args.iters
    torch.cuda.synchronize()


def _time_layer(row: dict, x: torch.Tensor, args) -> None:
    """A whole training layer (dispatch, ExpertMLP, combine, backward) eager and as a graph replay: row["layer_*"]."""
    device = x.device
    tokens, hidden, experts = x.shape[0], args.hidden, args.layer_experts
    gen = torch.Generator().manual_seed(99)
    topk_idx = torch.rand(tokens, experts, generator=gen).topk(args.topk, dim=1).indices.to(device)
    weights = torch.softmax(torch.randn(tokens, args.topk, generator=gen), dim=1).to(device)
    grad_y = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    with ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=args.topk, max_tokens_per_rank=tokens,
                        dispatch_format=args.dispatch_format, combine_format=args.combine_format, expert_alignment=32,
                        backend="nvlink") as buf, _grad_buffers(buf, args) as grads:
        mlp = training.ExpertMLP(buf.config.num_local_experts, hidden, args.layer_intermediate, device=device)
        x_leaf = x.clone().requires_grad_()
        w_leaf = weights.clone().requires_grad_()
        leaves = (x_leaf, w_leaf, mlp.w1, mlp.w2)

        def layer_step():
            routed = training.dispatch(buf, grads, x_leaf, topk_idx, w_leaf, check_inputs=False)
            training.combine(mlp(routed), routed).backward(grad_y)

        def layer_eager():
            for leaf in leaves:
                leaf.grad = None  # (as zero_grad(): no accumulation pass, as in the graph)
            layer_step()

        _time_into(row, "layer_eager", layer_eager, args)
        _time_into(row, "layer_graph", captured(layer_step, leaves), args)
        row["layer"] = {"experts": experts, "intermediate": args.layer_intermediate,
                        "rows_in_use": int(buf.dispatch(x, topk_idx, weights).expert_offsets[-1])}


def _time_shared(row: dict, buf, grads, x_leaf, topk_idx, w_leaf, args) -> None:
    """The shared-expert layer with and without a comm_stream (row["shared_*"]; see the module docstring)."""
    device = x_leaf.device
    hidden, inter = args.hidden, args.shared_intermediate
    gen = torch.Generator().manual_seed(5)
    w1 = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(torch.bfloat16).to(device)
    w1.requires_grad_()
    w2.requires_grad_()
    comm = torch.cuda.Stream(device)
    grad_y = torch.ones(x_leaf.shape, dtype=torch.bfloat16, device=device)
    cfg = buf.config
    # The same Buffer with its kernels on args.shared_comm_sms blocks (num_local_sms): by default they take every SM,
    # so a kernel beside them gets SMs only as their blocks finish.
    capped = ep_comm.Buffer(None, hidden=cfg.hidden, num_experts=cfg.num_experts, num_topk=cfg.num_topk,
                            max_tokens_per_rank=cfg.max_tokens_per_rank, dispatch_format=cfg.dispatch_format,
                            combine_format=cfg.combine_format, num_local_sms=args.shared_comm_sms, backend="nvlink")
    capped_grads = _grad_buffers(capped, args)
    modes = {"serial": (buf, grads, None), "overlap": (buf, grads, comm),
             "overlap_capped": (capped, capped_grads, comm)}

    def shared_expert():
        gate, up = (x_leaf @ w1.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.t()

    def forward(mode: str):
        layer_buf, layer_grads, stream = modes[mode]
        routed = training.dispatch(layer_buf, layer_grads, x_leaf, topk_idx, w_leaf, check_inputs=False,
                                   comm_stream=stream)
        shared = shared_expert()  # (enqueued after the dispatch: beside it when the dispatch is on the comm_stream)
        done = torch.cuda.Event() if stream is not None else None
        y = training.combine(routed.x, routed, comm_stream=stream, done_event=done)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        return y + shared

    def step(mode: str):
        for leaf in (x_leaf, w_leaf, w1, w2):
            leaf.grad = None
        forward(mode).backward(grad_y)

    with torch.no_grad():
        _time_into(row, "shared_alone", shared_expert, args)
    for mode in modes:
        _time_into(row, f"shared_forward_{mode}", lambda: forward(mode), args)
        _time_into(row, f"shared_step_{mode}", lambda: step(mode), args)
        _time_into(row, f"shared_step_{mode}_graph", captured(lambda: step(mode), (x_leaf, w_leaf, w1, w2)), args)
    row["shared"] = {"intermediate": inter, "capped_comm_sms": args.shared_comm_sms}
    if args.profile and row["tokens"] == min(args.tokens):
        # Where the host time goes, without and with the comm_stream: the forward, then forward + backward.
        for mode in ("serial", "overlap"):
            for name, fn in (("forward", forward), ("step", step)):
                key = f"shared_{name}_{mode}_profile"
                row[key] = _host_profile(lambda: fn(mode), 20)
                print(f"host profile, shared-expert {name}, {mode}:\n" + row[key])
    capped_grads.destroy()
    capped.destroy()


def _host_profile(fn, calls: int) -> str:
    """cProfile of `calls` calls of fn (then a device synchronization): the top functions by own and by cumulative
    time. (Python 3.12's cProfile sees every thread, the autograd engine's device thread included.)"""
    import cProfile
    import io
    import pstats
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(24)
    stats.sort_stats("cumulative").print_stats(36)
    return text.getvalue()


def _worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device())
    figures = []
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx = torch.rand(tokens, args.experts, generator=gen).topk(args.topk, dim=1).indices.to(device)
        weights = torch.softmax(torch.randn(tokens, args.topk, generator=gen), dim=1).to(device)
        with ep_comm.Buffer(None, hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                            max_tokens_per_rank=tokens, dispatch_format=args.dispatch_format,
                            combine_format=args.combine_format, backend="nvlink") as buf, \
                _grad_buffers(buf, args) as grads:
            x_leaf = x.clone().requires_grad_()
            w_leaf = weights.clone().requires_grad_()
            expert_out = torch.zeros(buf.config.max_recv_rows, args.hidden, dtype=torch.bfloat16, device=device)

            def forward_buffer():
                result = buf.dispatch(x, topk_idx, weights, check_inputs=False)
                return buf.combine(expert_out[:result.num_rows], result.handle)

            comm = torch.cuda.Stream(device)

            def forward_buffer_comm():  # the same on a comm_stream: what the stream bookkeeping costs the host
                done = torch.cuda.Event()
                result = buf.dispatch(x, topk_idx, weights, check_inputs=False, comm_stream=comm)
                out = buf.combine(expert_out[:result.num_rows], result.handle, comm_stream=comm, done_event=done)
                torch.cuda.current_stream(device).wait_event(done)
                return out

            grad_y = torch.ones(tokens, args.hidden, dtype=torch.bfloat16, device=device)
            ones = torch.ones_like(weights)
            width = grads.weights.config.hidden
            small = torch.zeros(tokens, width, dtype=torch.bfloat16, device=device)
            small_rows = torch.zeros(buf.config.max_recv_rows, width, dtype=torch.bfloat16, device=device)

            def buffer_calls():  # the six Buffer calls of forward + backward alone: what the rest of it costs on top
                result = buf.dispatch(x, topk_idx, weights, check_inputs=False)
                buf.combine(expert_out[:result.num_rows], result.handle)
                sent = grads.rows.dispatch(grad_y, topk_idx, ones, check_inputs=False)
                handle = grads.weights.dispatch(small, topk_idx, ones, check_inputs=False).handle
                grads.weights.combine(small_rows[:result.num_rows], handle)
                return grads.rows.combine(sent.x, sent.handle)

            def forward_training():
                routed = training.dispatch(buf, grads, x_leaf, topk_idx, w_leaf, check_inputs=False)
                return training.combine(routed.x, routed)

            def forward_backward():
                x_leaf.grad = w_leaf.grad = None  # (as in the graph, whose capture starts without them: no accumulation)
                forward_training().float().sum().backward()

            row = {"tokens": tokens}
            for name, fn in (("forward_buffer", forward_buffer), ("forward_buffer_comm", forward_buffer_comm),
                             ("buffer_calls", buffer_calls),
                             ("forward_training", forward_training), ("forward_backward", forward_backward)):
                _time_into(row, name, fn, args)
            _time_into(row, "forward_backward_graph", captured(forward_backward, (x_leaf, w_leaf)), args)
            if args.shared_intermediate:
                _time_shared(row, buf, grads, x_leaf, topk_idx, w_leaf, args)
            if args.layer_experts:
                _time_layer(row, x, args)
            if args.profile and tokens == min(args.tokens) and rank == 0:
                # Where the host time of forward + backward goes (eager: a small call is host-bound).
                row["profile_top"] = _host_profile(forward_backward, 20)
                print(row["profile_top"])
                # The torch ops' own host time (both threads), per op name.
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(20):
                        forward_backward()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                  max_name_column_width=60)
                row["host_op_profile"] = table
                print(table)
            if args.profile and tokens == max(args.tokens) and rank == 0:
                # Where the device time of forward + backward goes: CUDA kernels by total time.
                forward_backward()
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        forward_backward()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60)
                row["kernel_profile"] = table
                print(table)
            figures.append(row)
    return figures


def _check_args(parser, args, num_gpus: int) -> int:
    """Refuse bad flags with argparse's message before any rank starts (not as a traceback from every rank after its
    Buffers are built); returns the rank count, one per GPU up to --nproc."""
    args.tokens = parse_token_counts(parser, args.tokens)
    check_hidden(parser, args.hidden)
    world = max(1, min(args.nproc, num_gpus))
    check_routing_flags(parser, args, ("experts", "topk", "iters", "batches", "nproc", "shared_comm_sms"),
                        world=world)
    for name in ("layer_experts", "shared_intermediate"):  # (0 turns those rows off)
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.layer_experts % world:
        parser.error(f"--layer-experts {args.layer_experts} is not a multiple of the {world} ranks")
    if args.layer_experts and args.topk > args.layer_experts:
        parser.error(f"--topk {args.topk} exceeds --layer-experts {args.layer_experts}")
    for name in ("layer_intermediate",) + (("shared_intermediate",) if args.shared_intermediate else ()):
        if getattr(args, name) < 1 or getattr(args, name) % 32:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of 32, got {getattr(args, name)}")
    check_out_path(parser, args.out)
    if num_gpus == 0:
        parser.error("needs CUDA GPUs (the nvlink backend)")
    return world


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,4096", help="tokens per rank, comma-separated")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--dispatch-format", default="nvfp4", choices=DISPATCH_FORMATS)
    parser.add_argument("--combine-format", default="s2f6", choices=COMBINE_FORMATS)
    parser.add_argument("--grad-format", default="bf16", choices=training.GRAD_FORMATS)
    parser.add_argument("--input-grad-format", default="bf16", choices=training.GRAD_FORMATS,
                        help="combine format of the input gradient (dispatch's backward)")
    parser.add_argument("--layer-experts", type=int, default=32, help="experts of the whole-layer rows (0: none)")
    parser.add_argument("--layer-intermediate", type=int, default=2048, help="ExpertMLP intermediate size there")
    parser.add_argument("--shared-intermediate", type=int, default=2048,
                        help="intermediate size of the shared expert of the comm_stream rows (0: none)")
    parser.add_argument("--shared-comm-sms", type=int, default=24,
                        help="num_local_sms of the Buffer of the capped comm_stream rows")
    parser.add_argument("--nproc", type=int, default=2, help="ranks, one per GPU (at most the visible GPUs)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON file for the figures")
    parser.add_argument("--profile", action="store_true", help="cProfile and torch.profiler (CPU ops) 20 forward + "
                        "backward calls each at the smallest token count (host time), torch.profiler 3 at the largest "
                        "(CUDA kernels), rank 0")
    args = parser.parse_args(argv)
    world = _check_args(parser, args, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    per_rank = run_ranks(_worker, world, args, backend="nccl", timeout_s=900)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            print(f"rank {rank} tokens {row['tokens']:5d}: Buffer dispatch + combine "
                  f"{1e3 * row['forward_buffer_ms']:9.1f} us, training forward "
                  f"{1e3 * row['forward_training_ms']:9.1f} us, "
                  f"forward + backward {1e3 * row['forward_backward_ms']:9.1f} us (host "
                  f"{1e3 * row['forward_buffer_host_ms']:.1f} / {1e3 * row['forward_training_host_ms']:.1f} / "
                  f"{1e3 * row['forward_backward_host_ms']:.1f} us); its six Buffer calls alone "
                  f"{1e3 * row['buffer_calls_ms']:.1f} us (host {1e3 * row['buffer_calls_host_ms']:.1f}); "
                  f"forward + backward as a graph {1e3 * row['forward_backward_graph_ms']:.1f} us (host "
                  f"{1e3 * row['forward_backward_graph_host_ms']:.1f})")
            if "shared_alone_ms" in row:
                print(f"rank {rank} tokens {row['tokens']:5d}: with a shared expert (alone "
                      f"{1e3 * row['shared_alone_ms']:.1f} us; Buffer dispatch + combine on a comm_stream "
                      f"{1e3 * row['forward_buffer_comm_ms']:.1f} us, host "
                      f"{1e3 * row['forward_buffer_comm_host_ms']:.1f}): forward serial / comm_stream "
                      f"{1e3 * row['shared_forward_serial_ms']:.1f} / {1e3 * row['shared_forward_overlap_ms']:.1f} us, "
                      f"forward + backward {1e3 * row['shared_step_serial_ms']:.1f} / "
                      f"{1e3 * row['shared_step_overlap_ms']:.1f} us, as a graph "
                      f"{1e3 * row['shared_step_serial_graph_ms']:.1f} / "
                      f"{1e3 * row['shared_step_overlap_graph_ms']:.1f} us; comm kernels on "
                      f"{args.shared_comm_sms} SMs: forward "
                      f"{1e3 * row['shared_forward_overlap_capped_ms']:.1f}, as a graph "
                      f"{1e3 * row['shared_step_overlap_capped_graph_ms']:.1f} us")
            if "layer_eager_ms" in row:
                print(f"rank {rank} tokens {row['tokens']:5d}: whole layer with ExpertMLP ({row['layer']}) eager "
                      f"{row['layer_eager_ms']:.3f} ms (host {row['layer_eager_host_ms']:.3f}), graph "
                      f"{row['layer_graph_ms']:.3f} ms (host {row['layer_graph_host_ms']:.3f})")
    if args.out:
        write_report(args.out, args, world=world, ranks=per_rank)


if __name__ == "__main__":
    main()
