"""What the trainable experts cost (ep_comm.training.ExpertMLP: NVFP4 forward, MXFP8 + SR backward), against the same
SwiGLU experts in plain BF16 autograd over torch._grouped_mm, and against the dense BF16 ceiling -- one GPU, same run.

    python bench/bench_training_experts.py --tokens 4096 --experts 32 --out training_experts.json

The rows come from a real NVFP4 dispatch (nvlink backend, one rank: every expert local, E experts, top-k, expert
alignment 32), so the layout is the one training uses (capacity rows included). Median milliseconds of:
  ours_forward, ours_forward_backward : _ExpertMLPFunction (weights quantized to NVFP4 each call; backward: six MXFP8
      SR quantizations and four grouped GEMMs), with a gradient for the rows and both weights (set to None before
      each backward, as zero_grad() does: no accumulation pass; the same for the baseline);
  bf16_forward, bf16_forward_backward : BF16 rows, silu(gate) * up, torch._grouped_mm forward and torch's own
      autograd of it (the BF16 baseline of DESIGN.md §6 for the expert compute), on master weights of the same dtype
      as ours cast to BF16 inside autograd (as autocast does: with FP32 masters it casts them forward and widens the
      gradients back);
  gemms_only : the four backward + two forward BF16 grouped GEMMs of ours alone, on the same operands (what the
      quantization, masking and scaling passes cost on top is ours_forward_backward - gemms_only);
  ours_forward_backward_kept_values : ours with keep_weight_values=True (the forward's BF16 weight values kept for
      the backward instead of decoded again from the NVFP4 weights: 2 bytes per weight held, as autocast holds);
  ours_forward_backward_torch_wgrad : ours with EP_COMM_WGRAD_GEMM=torch (FP32 masters: the weight gradients from
      torch._grouped_mm in BF16, widened, instead of csrc/grouped_wgrad.cu; the same call otherwise);
  ours_forward_backward_main_grad : ours with accumulate_into_main_grad=True (the weight gradients added into FP32
      main_grad buffers by the wgrad GEMM's stores, Megatron-style gradient accumulation), against
  ours_forward_backward_then_add, bf16_forward_backward_then_add : ours / the baseline, then main_grad += w.grad for
      both weights (what a trainer that keeps FP32 main gradients does without the fusion);
  ours_forward_backward_seed_tensor : ours with the seed in a device tensor, incremented on the device at every step
      (the graph-safe form ExpertMLP uses: the backward's six seeds derived there by one more launch), and
  ours_forward_backward_graph : the same step captured once in a CUDA graph and replayed (the host's launches gone);
      (alternating_ms: ours with an int seed, with accumulate_into_main_grad, the micro-batch rows, the seed tensor,
      the graph and the two BF16 baselines again, in three alternating rounds: the clock drifts between rows timed
      far apart);
  ours_microbatch, ours_microbatch_kept_values, ours_microbatch_main_grad : a micro-batch after the first of a step
      (ExpertMLP's is_first_microbatch=False): the NVFP4 weights of the first one reused (with kept values: their BF16
      block values too; main_grad: kept values and accumulate_into_main_grad, the gradient-accumulation regime),
      against
  bf16_weights_forward_backward : the BF16 baseline on BF16 weight copies made once outside the step (a BF16 trainer's
      micro-batch: no cast, BF16 weight gradients, no accumulation pass -- a lower bound for that trainer);
  wgrad_ours, wgrad_torch : the two weight-gradient GEMMs alone on random BF16 operands of the backward's shapes, into
      FP32: csrc/grouped_wgrad.cu against torch._grouped_mm + the widening kernel (FP32 masters only);
  dense_bf16_tflops : torch.mm in BF16 on 8192^3, the tensor-core ceiling of this GPU in this run.
TFLOP/s counts 6 R H I (forward) and 18 R H I (forward + backward) over the rows in use. Timing only; the gradients
are checked in tests/test_training_experts.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import ep_comm  # noqa: E402
from bench_formats import time_ms  # noqa: E402  same directory: one timing method for the benchmarks
from bench_grouped_gemm import mm_ceiling_tflops  # noqa: E402  the dense BF16 ceiling, measured the same way
from ep_comm import formats, training  # noqa: E402
from ep_comm.bench import parse_token_counts, write_report  # noqa: E402
from ep_comm.launch import run_ranks  # noqa: E402
from ep_comm.training_experts import (_ExpertMLPFunction, _WeightCache, _weight_gradient,  # noqa: E402
                                     quantize_expert_weights)


def captured(step, leaves=()):
    """step captured once in a CUDA graph (after warm-up calls on a side stream, torch's recipe; the gradients of
    `leaves` set to None before the capture, so that the graph assigns them): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, inter, experts = args.hidden, args.intermediate, args.experts
    figures = {"dense_bf16_tflops": mm_ceiling_tflops(), "cases": []}
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx = torch.rand(tokens, experts, generator=gen).topk(args.topk, dim=1).indices.to(device)
        weights = torch.softmax(torch.randn(tokens, args.topk, generator=gen), dim=1).to(device)
        with ep_comm.Buffer(None, hidden=hidden, num_experts=experts, num_topk=args.topk, max_tokens_per_rank=tokens,
                            expert_alignment=32, backend="nvlink") as buf:
            result = buf.dispatch(x, topk_idx, weights)
            rows_in_use = int(result.expert_offsets[-1])
            mlp = training.ExpertMLP(experts, hidden, inter, device=device, dtype=getattr(torch, args.master_dtype))
            rows = torch.zeros(result.num_rows, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
            grad = torch.randn(result.num_rows, hidden, dtype=torch.bfloat16, device=device)

            def ours_forward():
                with torch.no_grad():
                    return _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, 1)

            def ours_forward_backward(keep_weight_values=False, accumulate_into_main_grad=False):
                rows.grad = mlp.w1.grad = mlp.w2.grad = None  # (as zero_grad(): no accumulation pass)
                _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, 1, keep_weight_values,
                                         accumulate_into_main_grad).backward(grad)

            for w in (mlp.w1, mlp.w2):  # (FP32 gradient buffers for the main_grad rows)
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)

            seed = torch.zeros((), dtype=torch.int64, device=device)

            def ours_forward_backward_seed_tensor():
                rows.grad = mlp.w1.grad = mlp.w2.grad = None
                seed.add_(1)  # (a new seed per step, counted on the device: what a graph replays)
                _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, seed).backward(grad)

            cache = _WeightCache(masters=(), versions=(), w1=quantize_expert_weights(mlp.w1),
                                 w2=quantize_expert_weights(mlp.w2), keep_values=False)
            kept_cache = dataclasses.replace(cache, keep_values=True)

            def ours_microbatch(kept=False, main_grad=False):
                rows.grad = mlp.w1.grad = mlp.w2.grad = None
                _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, 1, kept, main_grad,
                                         kept_cache if kept else cache).backward(grad)

            def ours_forward_backward_then_add():
                ours_forward_backward()
                for w in (mlp.w1, mlp.w2):
                    w.main_grad.add_(w.grad)

            # The BF16 baseline on the same rows and segments.
            ends = result.expert_offsets[1:].contiguous()
            # (Masters of the same dtype as ours, cast to BF16 inside autograd as autocast does: with FP32 masters the
            # baseline pays the forward cast and the gradients' widening too.)
            x_rows = formats.dequantize(result.x, torch.bfloat16)[:rows_in_use].detach().requires_grad_()
            w1 = mlp.w1.detach().clone().requires_grad_()
            w2 = mlp.w2.detach().clone().requires_grad_()
            g_rows = grad[:rows_in_use]

            def bf16_mlp():
                w1_bf16, w2_bf16 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
                gate, up = torch._grouped_mm(x_rows, w1_bf16.transpose(1, 2), offs=ends).chunk(2, dim=-1)
                return torch._grouped_mm(F.silu(gate) * up, w2_bf16.transpose(1, 2), offs=ends)

            w1_weights = mlp.w1.detach().to(torch.bfloat16).requires_grad_()
            w2_weights = mlp.w2.detach().to(torch.bfloat16).requires_grad_()

            def bf16_weights_forward_backward():
                x_rows.grad = w1_weights.grad = w2_weights.grad = None
                gate, up = torch._grouped_mm(x_rows, w1_weights.transpose(1, 2), offs=ends).chunk(2, dim=-1)
                torch._grouped_mm(F.silu(gate) * up, w2_weights.transpose(1, 2), offs=ends).backward(g_rows)

            def bf16_forward():
                with torch.no_grad():
                    return bf16_mlp()

            def bf16_forward_backward():
                x_rows.grad = w1.grad = w2.grad = None
                bf16_mlp().backward(g_rows)

            main_grads = [torch.zeros(w.shape, dtype=torch.float32, device=device) for w in (w1, w2)]

            def bf16_forward_backward_then_add():
                bf16_forward_backward()
                for w, main_grad in zip((w1, w2), main_grads):
                    main_grad.add_(w.grad)

            # The six grouped GEMMs of ours alone, on operands of the same shapes and layouts.
            padded = -(-result.num_rows // 32) * 32
            a_h = torch.randn(result.num_rows, hidden, dtype=torch.bfloat16, device=device)
            a_i = torch.randn(result.num_rows, inter, dtype=torch.bfloat16, device=device)
            a_2i = torch.randn(result.num_rows, 2 * inter, dtype=torch.bfloat16, device=device)
            t_h = torch.randn(hidden, padded, dtype=torch.bfloat16, device=device)
            t_i = torch.randn(inter, padded, dtype=torch.bfloat16, device=device)
            t_2i = torch.randn(2 * inter, padded, dtype=torch.bfloat16, device=device)
            v1, v2 = w1.detach().to(torch.bfloat16), w2.detach().to(torch.bfloat16)

            def gemms_only():
                torch._grouped_mm(a_h, v1.transpose(1, 2), offs=ends)
                torch._grouped_mm(a_i, v2.transpose(1, 2), offs=ends)
                torch._grouped_mm(a_h, v2, offs=ends)
                torch._grouped_mm(t_h, t_i.t(), offs=ends)
                torch._grouped_mm(a_2i, v1, offs=ends)
                torch._grouped_mm(t_2i, t_h.t(), offs=ends)

            def with_torch_wgrad(fn):
                def run():
                    os.environ["EP_COMM_WGRAD_GEMM"] = "torch"
                    try:
                        fn()
                    finally:
                        del os.environ["EP_COMM_WGRAD_GEMM"]
                return run

            def wgrad_ours():
                _weight_gradient(t_h, t_i, ends, torch.float32)
                _weight_gradient(t_2i, t_h, ends, torch.float32)

            wgrad_torch = with_torch_wgrad(wgrad_ours)
            timed = [("ours_forward", ours_forward), ("ours_forward_backward", ours_forward_backward),
                     ("ours_forward_backward_kept_values", lambda: ours_forward_backward(keep_weight_values=True)),
                     ("bf16_forward", bf16_forward), ("bf16_forward_backward", bf16_forward_backward),
                     ("gemms_only", gemms_only),
                     ("ours_forward_backward_main_grad", lambda: ours_forward_backward(accumulate_into_main_grad=True)),
                     ("ours_forward_backward_then_add", ours_forward_backward_then_add),
                     ("bf16_forward_backward_then_add", bf16_forward_backward_then_add)]
            if mlp.w1.dtype == torch.float32:
                timed += [("ours_forward_backward_torch_wgrad", with_torch_wgrad(ours_forward_backward)),
                          ("wgrad_ours", wgrad_ours), ("wgrad_torch", wgrad_torch)]
            timed += [("ours_microbatch", ours_microbatch),
                      ("ours_microbatch_kept_values", lambda: ours_microbatch(kept=True)),
                      ("ours_microbatch_main_grad", lambda: ours_microbatch(kept=True, main_grad=True)),
                      ("bf16_weights_forward_backward", bf16_weights_forward_backward)]
            graph_step = captured(ours_forward_backward_seed_tensor)
            timed += [("ours_forward_backward_seed_tensor", ours_forward_backward_seed_tensor),
                      ("ours_forward_backward_graph", graph_step)]
            row = {"tokens": tokens, "rows_in_use": rows_in_use, "num_rows": result.num_rows,
                   # (the layouts torch._grouped_mm returns: a strided weight gradient costs a slow cast)
                   "wgrad_out_strides": list(torch._grouped_mm(t_h, t_i.t(), offs=ends).stride()),
                   "dgrad_out_strides": list(torch._grouped_mm(a_h, v2, offs=ends).stride())}
            for name, fn in timed:
                row[name + "_ms"] = time_ms(fn, iters=args.iters, batches=args.batches)
            # The rows above run one after another, and the GPU's clock drifts between them: the forms compared in
            # the write-up also in alternating rounds.
            alternating = (("int_seed", ours_forward_backward),
                           ("main_grad", lambda: ours_forward_backward(accumulate_into_main_grad=True)),
                           ("microbatch", ours_microbatch), ("microbatch_kept_values", lambda: ours_microbatch(True)),
                           ("microbatch_main_grad", lambda: ours_microbatch(True, True)),
                           ("seed_tensor", ours_forward_backward_seed_tensor), ("graph", graph_step),
                           ("bf16", bf16_forward_backward), ("bf16_weights", bf16_weights_forward_backward))
            rounds = {name: [] for name, _ in alternating}
            for _ in range(3):
                for name, fn in alternating:
                    rounds[name].append(time_ms(fn, iters=args.iters, batches=args.batches))
            row["alternating_ms"] = rounds
            flops = 6.0 * rows_in_use * hidden * inter  # (the wgrads: 2 R H I for w2, 4 R H I for w1)
            for name, scale in (("ours_forward", 1), ("ours_forward_backward", 3), ("bf16_forward", 1),
                                ("bf16_forward_backward", 3), ("gemms_only", 3), ("wgrad_ours", 1), ("wgrad_torch", 1),
                                ("ours_forward_backward_torch_wgrad", 3), ("ours_forward_backward_kept_values", 3),
                                ("ours_forward_backward_main_grad", 3), ("ours_forward_backward_then_add", 3),
                                ("bf16_forward_backward_then_add", 3), ("ours_forward_backward_seed_tensor", 3),
                                ("ours_forward_backward_graph", 3), ("ours_microbatch", 3),
                                ("ours_microbatch_kept_values", 3), ("ours_microbatch_main_grad", 3),
                                ("bf16_weights_forward_backward", 3)):
                if name + "_ms" in row:
                    row[name + "_tflops"] = scale * flops / (row[name + "_ms"] * 1e-3) / 1e12
            row["speedup_forward_backward_vs_bf16"] = row["bf16_forward_backward_ms"] / row["ours_forward_backward_ms"]
            if args.profile:
                from torch.profiler import ProfilerActivity, profile as torch_profile
                ours_forward_backward()
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    ours_forward_backward()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=110)
                row["kernel_profile"] = table
                print(table)
            figures["cases"].append(row)
            mlp = rows = grad = x_rows = w1 = w2 = a_h = a_i = a_2i = t_h = t_i = t_2i = v1 = v2 = None  # (freed)
            main_grads = timed = cache = kept_cache = w1_weights = w2_weights = None  # (the graph's pool with it)
            torch.cuda.empty_cache()
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096", help="tokens (one rank), comma-separated")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32, help="local experts (DeepSeek-V3's 256 over 8 ranks)")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--master-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="ExpertMLP's master weights (the BF16 baseline's weights are BF16 either way)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="torch.profiler of one forward + backward (ours)")
    parser.add_argument("--out", default=None, help="JSON file for the figures")
    args = parser.parse_args(argv)
    args.tokens = parse_token_counts(parser, args.tokens)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    (figures,) = run_ranks(_worker, 1, args, backend="nccl", timeout_s=900)
    print(f"dense BF16 mm ceiling: {figures['dense_bf16_tflops']:.0f} TFLOP/s; master weights {args.master_dtype}")
    for row in figures["cases"]:
        print(f"tokens {row['tokens']} ({row['rows_in_use']} rows in use of {row['num_rows']}): "
              f"ours fwd {row['ours_forward_ms']:.2f} ms ({row['ours_forward_tflops']:.0f} TFLOP/s), fwd+bwd "
              f"{row['ours_forward_backward_ms']:.2f} ms ({row['ours_forward_backward_tflops']:.0f}); BF16 fwd "
              f"{row['bf16_forward_ms']:.2f} ms, fwd+bwd {row['bf16_forward_backward_ms']:.2f} ms "
              f"({row['bf16_forward_backward_tflops']:.0f}); the six GEMMs alone {row['gemms_only_ms']:.2f} ms "
              f"({row['gemms_only_tflops']:.0f}); ours / BF16 speed {row['speedup_forward_backward_vs_bf16']:.2f}x; "
              f"with keep_weight_values {row['ours_forward_backward_kept_values_ms']:.2f} ms; "
              f"_grouped_mm output strides: wgrad {row['wgrad_out_strides']}, dgrad {row['dgrad_out_strides']}")
        print(f"  FP32 main_grad accumulation: ours accumulate_into_main_grad "
              f"{row['ours_forward_backward_main_grad_ms']:.2f} ms, ours then main_grad += grad "
              f"{row['ours_forward_backward_then_add_ms']:.2f} ms, BF16 then main_grad += grad "
              f"{row['bf16_forward_backward_then_add_ms']:.2f} ms (ours / BF16 "
              f"{row['bf16_forward_backward_then_add_ms'] / row['ours_forward_backward_main_grad_ms']:.2f}x)")
        print(f"  micro-batches after the first (ms): ours {row['ours_microbatch_ms']:.2f}, with kept values "
              f"{row['ours_microbatch_kept_values_ms']:.2f}, kept values + main_grad "
              f"{row['ours_microbatch_main_grad_ms']:.2f}; BF16 on BF16 weight copies "
              f"{row['bf16_weights_forward_backward_ms']:.2f}")
        print("  alternating rounds (ms): " + "; ".join(f"{name} " + " / ".join(f"{ms:.2f}" for ms in times)
                                                     for name, times in row["alternating_ms"].items()))
        if "wgrad_ours_ms" in row:
            print(f"  weight gradients into FP32: fwd+bwd with torch's wgrad "
                  f"{row['ours_forward_backward_torch_wgrad_ms']:.2f} ms; the two wgrads alone: ours "
                  f"{row['wgrad_ours_ms']:.2f} ms ({row['wgrad_ours_tflops']:.0f} TFLOP/s), torch._grouped_mm + "
                  f"widening {row['wgrad_torch_ms']:.2f} ms ({row['wgrad_torch_tflops']:.0f})")
    if args.out:
        write_report(args.out, args, figures=figures)


if __name__ == "__main__":
    main()
