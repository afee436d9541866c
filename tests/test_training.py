"""ep_comm.training (autograd for dispatch / combine) against single-process torch autograd of the same layer.

The reference builds y[t] = sum_k w[t, k] * (xq[t] @ W[e_k]) for every rank's tokens in FP32, with xq the dequantized
dispatch payload (straight-through: d xq / d x = identity) and the output gradient the one that reaches the experts
(the BF16 gradient itself, or its MXFP8 round trip for grad_format "mxfp8"). Every gradient -- of x, of the routing
weights and of the experts' weights -- must match it to BF16 rounding (the dispatched rows, expert outputs and
gradient rows are BF16); a wrong weight, a missing or doubled row, or a misplaced slot is an O(1) error.
"""
import contextlib
import hashlib

import pytest
import torch

import ep_comm
from ep_comm import formats, training
from format_cases import as_bytes, assert_same_floats, require_format_kernels
from harness import multigpu_backend, multigpu_world, nvlink_backend, run_ranks

HIDDEN, TOPK, MAX_TOKENS, ALIGNMENT = 64, 3, 9, 4


def _tokens_of(rank: int) -> int:
    return (7, 0, 9, 4)[rank % 4]  # uneven, one rank with none


def _inputs(rank: int, num_experts: int):
    """Rank `rank`'s x bf16 [T, H], topk_idx [T, K] (distinct experts, some slots masked), weights fp32 [T, K] and
    output gradient bf16 [T, H]: the same on every rank that makes them (one seed per rank)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    num_tokens = _tokens_of(rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    if num_tokens:
        x[0, 5] = 40.0  # an outlier: a block whose 4/6 choice differs from its neighbours'
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, TOPK, dtype=torch.long)
    if num_tokens > 2:
        idx[1, 2] = -1
        idx[2, 0] = -1
    weights = torch.rand(num_tokens, TOPK, generator=gen) + 0.1
    grad_y = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    return x, idx, weights, grad_y


def _expert_weights(num_experts: int) -> torch.Tensor:
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7)) / HIDDEN ** 0.5


def _round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the dispatch delivers for rows x (bf16 [T, H]), dense fp32, rounded to BF16 as training.dispatch's rows."""
    if fmt == "nvfp4":
        dense = formats.nvfp4_dequantize(formats.nvfp4_quantize(x, impl="reference"), impl="reference")
    elif fmt == "mxfp8":
        dense = formats.mxfp8_dequantize(formats.mxfp8_quantize(x, impl="reference"), impl="reference")
    else:
        dense = x.float()
    return dense.to(torch.bfloat16).float()


def _reference(world: int, num_experts: int, dispatch_format: str, grad_format: str):
    """FP32 autograd of the whole layer over every rank's tokens: (y per rank, d x per rank, d w per rank, d W)."""
    W = _expert_weights(num_experts).requires_grad_()
    ys, leaves, weight_leaves, loss = [], [], [], 0.0
    for rank in range(world):
        x, idx, weights, grad_y = _inputs(rank, num_experts)
        leaf = x.float().requires_grad_()
        weight_leaf = weights.clone().requires_grad_()
        xq = leaf + (_round_trip(x, dispatch_format) - leaf).detach()  # straight-through
        y = torch.zeros(x.shape[0], HIDDEN)
        for k in range(TOPK):
            chosen = idx[:, k] >= 0
            out = torch.einsum("th,thj->tj", xq, W[idx[:, k].clamp(min=0)])
            y = y + torch.where(chosen[:, None], weight_leaf[:, k:k + 1] * out, torch.zeros(()))
        g = _round_trip(grad_y, grad_format)  # the gradient the experts see
        loss = loss + (y * g).sum()
        ys.append(y.detach())
        leaves.append(leaf)
        weight_leaves.append(weight_leaf)
    loss.backward()
    return ys, [l.grad for l in leaves], [w.grad for w in weight_leaves], W.grad


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def _run_experts(routed, W_local: torch.Tensor) -> torch.Tensor:
    """expert_out bf16 [R, H]: each local expert's segment times its weight (FP32), zero elsewhere."""
    result = routed.result
    offsets = result.expert_offsets.tolist()
    counts = result.num_tokens_per_expert.tolist()
    out = torch.zeros(routed.x.shape[0], HIDDEN, device=routed.x.device)
    for j, count in enumerate(counts):
        rows = torch.arange(offsets[j], offsets[j] + count, device=routed.x.device)
        out = out.index_add(0, rows, routed.x[rows].float() @ W_local[j])
    return out.to(torch.bfloat16)


@contextlib.contextmanager
def _case_buffers(num_experts: int, case, backend: str):
    """(Buffer, GradBuffers) for one (dispatch, combine, gradient[, input gradient]) format case at this file's sizes
    (the input gradient's combine format: bf16 unless given), destroyed after."""
    dispatch_format, combine_format, grad_format = case[:3]
    input_grad_format = case[3] if len(case) > 3 else "bf16"
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=num_experts, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        dispatch_format=dispatch_format, combine_format=combine_format, expert_alignment=ALIGNMENT,
                        backend=backend) as buf, \
            training.GradBuffers.create(buf, grad_format, input_grad_format=input_grad_format) as grads:
        yield buf, grads


def _case_leaves(rank: int, world: int, device):
    """The step's leaves (x, routing weights, this rank's expert weights W [E/W, H, H]; all require grad), the routing
    and the output gradient of _inputs(rank), for 4 * world experts."""
    num_experts = 4 * world
    x, idx, weights, grad_y = (t.to(device) for t in _inputs(rank, num_experts))
    num_local = num_experts // world
    mine = slice(rank * num_local, (rank + 1) * num_local)
    W_local = _expert_weights(num_experts)[mine].to(device).requires_grad_()
    return x.clone().requires_grad_(), weights.clone().requires_grad_(), W_local, idx, grad_y


def _assert_matches_reference(case, rank: int, want, y, x_leaf, w_leaf, W_local, what: str = "") -> None:
    """y and the leaves' gradients against _reference's (want: its four results) for rank `rank`."""
    want_y, want_dx, want_dw, want_dW = want
    num_local = W_local.shape[0]
    # S2F6's 8-bit codes and MXFP8's 3 mantissa bits (~2.7% relative L2 on Gaussian rows) against BF16 rounding
    tolerance = {"s2f6": 3e-2, "mxfp8": 4e-2, "bf16": 1e-2}
    y_tolerance = tolerance[case[1]]
    dx_tolerance = tolerance[case[3] if len(case) > 3 else "bf16"]  # the input gradient's combine format
    if y.shape[0]:
        assert _relative_error(y.cpu(), want_y[rank]) < y_tolerance, (case, what + "y")
        assert _relative_error(x_leaf.grad.cpu(), want_dx[rank]) < dx_tolerance, (case, what + "d x")
        assert _relative_error(w_leaf.grad.cpu(), want_dw[rank]) < 1e-2, (case, what + "d topk_weights")
    else:
        assert x_leaf.grad.shape == (0, HIDDEN) and w_leaf.grad.shape == (0, TOPK)
    local_dW = want_dW[rank * num_local:(rank + 1) * num_local]
    assert _relative_error(W_local.grad.cpu(), local_dW) < 1e-2, (case, what + "d W")
    assert x_leaf.grad.dtype == torch.bfloat16 and w_leaf.grad.dtype == torch.float32


def training_worker(rank, world, backend="reference", device_kind="cpu", formats_list=(("nvfp4", "s2f6", "bf16"),)):
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    num_experts = 4 * world
    checked = []
    for case in formats_list:
        want = _reference(world, num_experts, case[0], case[2])
        x_leaf, w_leaf, W_local, idx, grad_y = _case_leaves(rank, world, device)
        with _case_buffers(num_experts, case, backend) as (buf, grads):
            routed = training.dispatch(buf, grads, x_leaf, idx, w_leaf)
            valid = int(routed.result.expert_offsets[-1])
            # Rows past those in use (nvlink capacity) and padding rows are zero.
            assert not routed.x[valid:].any() and not routed.x[(routed.result.src_rank < 0)].any()
            y = training.combine(_run_experts(routed, W_local), routed)
            (y.float() * grad_y.float()).sum().backward()
        _assert_matches_reference(case, rank, want, y, x_leaf, w_leaf, W_local)
        if y.shape[0]:
            assert (w_leaf.grad[idx < 0] == 0).all(), (case, "masked slots get no gradient")
        checked.append(case)
    return checked


def rows_only_worker(rank, world, backend="reference", device_kind="cpu"):
    """routed.x used without combine (dispatch's backward makes its own unit-weight handle): d x[t] is, in every
    column, the number of rows token t was sent as (its unmasked slots) -- exact; and x that does not require grad
    still lets the routing weights and expert weights train."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    num_experts = 4 * world
    x, idx, weights, _ = (t.to(device) for t in _inputs(rank, num_experts))
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=num_experts, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        expert_alignment=ALIGNMENT, backend=backend, timeout_s=60) as buf, \
            training.GradBuffers.create(buf) as grads:
        # (Tokens of stride 0, as the gradient of a sum is: on a rank with none, the reference backend used to fail to
        # view them as bytes.)
        for fmt_buf in (buf, grads.rows):
            fmt_buf.dispatch(torch.zeros((), dtype=torch.bfloat16, device=device).expand(x.shape[0], HIDDEN), idx,
                             weights)
        x_leaf = x.clone().requires_grad_()
        routed = training.dispatch(buf, grads, x_leaf, idx, weights)
        routed.x.float().sum().backward()
        want = (idx >= 0).sum(dim=1, keepdim=True).expand(-1, HIDDEN).to(torch.bfloat16)
        assert torch.equal(x_leaf.grad, want)

        # No grad for x: the weights still get theirs.
        w_leaf = weights.clone().requires_grad_()
        routed = training.dispatch(buf, grads, x, idx, w_leaf)
        y = training.combine(routed.x.clone(), routed)
        y.float().sum().backward()
        assert w_leaf.grad is not None and w_leaf.grad.shape == weights.shape
        if x.shape[0]:
            assert w_leaf.grad[idx >= 0].abs().sum() > 0

        # Ranks whose autograd graphs differ still make the same backward calls: on rank 0 the weights and x require
        # grad and the expert outputs come from the rows; on the others nothing of theirs requires grad and their
        # experts return zeros. (Before the anchor, the ranks' backward calls differed and they timed out.)
        mine = rank == 0
        x_in = x.clone().requires_grad_() if mine else x
        w_in = weights.clone().requires_grad_() if mine else weights
        routed = training.dispatch(buf, grads, x_in, idx, w_in)
        expert_out = routed.x * 2 if mine else torch.zeros_like(routed.x)
        training.combine(expert_out, routed).float().sum().backward()
        if mine:
            assert x_in.grad is not None and w_in.grad is not None

        # No reference cycle: a dispatch's state (its payload, the gradient rows) goes with its last reference, not at
        # the garbage collector's next pass.
        import gc
        import weakref
        gc.disable()
        try:
            routed = training.dispatch(buf, grads, x.clone().requires_grad_(), idx, weights)
            y = training.combine(routed.x.clone(), routed)
            y.float().sum().backward()
            state = weakref.ref(routed.link)
            del routed, y, expert_out
            assert state() is None
        finally:
            gc.enable()
    return "rows only ok"


def _integer_outputs(src_rank, src_token, slot):
    """Integer-valued expert outputs [n, H] in [-30, 30] from each row's (source rank, token, slot): every product and
    sum of the routing-weight dots is an exact integer below 2^24, in any order."""
    h = torch.arange(HIDDEN)
    key = (src_rank * 131 + src_token * 7 + slot * 3)[:, None] + h * 5
    return (key % 61 - 30).float()


def exact_weights_worker(rank, world, backend="reference", device_kind="cpu"):
    """The routing-weight gradients are exact end to end: with integer-valued expert outputs and output gradients
    every dot is an integer that needs more than BF16's 8 bits, and d w must equal it bit for bit (a path that kept
    only BF16 precision, or lost a part, fails). Padding and capacity rows of expert_out hold NaN: nothing of them
    may reach a gradient."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    num_experts = 4 * world
    x, idx, weights, _ = (t.to(device) for t in _inputs(rank, num_experts))
    gen = torch.Generator().manual_seed(50 + rank)
    grad_y = torch.randint(-30, 31, (x.shape[0], HIDDEN), generator=gen).to(torch.bfloat16).to(device)
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=num_experts, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        dispatch_format="bf16", combine_format="bf16", expert_alignment=ALIGNMENT,
                        backend=backend) as buf, training.GradBuffers.create(buf) as grads:
        w_leaf = weights.clone().requires_grad_()
        routed = training.dispatch(buf, grads, x, idx, w_leaf)
        result = routed.result
        in_use = (result.src_rank >= 0).cpu()
        expert_out = torch.full((result.num_rows, HIDDEN), float("nan"))
        expert_out[in_use] = _integer_outputs(result.src_rank.cpu()[in_use], result.src_token.cpu()[in_use],
                                              result.topk_slot.cpu()[in_use])
        y = training.combine(expert_out.to(torch.bfloat16).to(device), routed)
        (y.float() * grad_y.float()).sum().backward()
    tokens = torch.arange(x.shape[0]).repeat_interleave(TOPK)
    slots = torch.arange(TOPK).repeat(x.shape[0])
    outputs = _integer_outputs(torch.full_like(tokens, rank), tokens, slots).view(x.shape[0], TOPK, HIDDEN)
    want = (outputs * grad_y.cpu().float()[:, None, :]).sum(dim=-1)  # exact integers
    want = torch.where(idx.cpu() >= 0, want, torch.zeros(()))
    got = w_leaf.grad.cpu()
    assert torch.equal(got, want), (got - want).abs().max()
    assert x.shape[0] == 0 or want.abs().max() > 512  # (dots that BF16 alone could not carry)
    return "exact weights ok"


def _experts_on_device(routed, W_local: torch.Tensor) -> torch.Tensor:
    """_run_experts without a host step (CUDA-graph capturable), on every one of the R rows as expert code that ignores
    the segments would run: each row times its expert's weight (the expert found from expert_offsets on the device;
    the capacity rows past the rows in use go with the last expert). So a non-finite value in routed.x or in its
    gradient on a row not in use reaches the weight gradient (as 0 * NaN): that is how the MXFP8 rows' left-over NaN
    scales were found (test_dense_rows_are_zero_outside_the_rows_in_use_whatever_they_hold)."""
    offsets = routed.result.expert_offsets
    rows = torch.arange(routed.x.shape[0], dtype=offsets.dtype, device=routed.x.device)
    expert = torch.searchsorted(offsets[1:].contiguous(), rows, right=True).clamp(max=W_local.shape[0] - 1)
    return torch.einsum("rh,rhj->rj", routed.x.float(), W_local[expert]).to(torch.bfloat16)


def _new_inputs(num_tokens: int, num_experts: int, seed: int, device):
    """Fresh x, topk_idx (masked slots), weights, output gradient and expert weights of the same shapes as _inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, TOPK, dtype=torch.long)
    idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.2, torch.full((), -1), idx)
    weights = torch.rand(num_tokens, TOPK, generator=gen) + 0.1
    grad_y = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    W = torch.randn(num_experts, HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5
    return [t.to(device) for t in (x, idx, weights, grad_y, W)]


def graph_worker(rank, world, backend="nvlink", formats_list=(("nvfp4", "s2f6", "bf16"),), experts=None, trials=3,
                 comm_stream=False):
    """A whole training step -- training.dispatch, experts, training.combine, loss.backward() -- captured in one CUDA
    graph (nvlink backend): the first replay, on _inputs, matches FP32 torch autograd as training_worker's eager step
    does; then three replays, each after new tokens, routing, routing weights, output gradient and expert weights were
    written into the captured tensors, are bitwise equal to the same step run eagerly on the same Buffers (and two
    eager steps to each other). experts: the expert function (default _experts_on_device); trials: the replays.
    comm_stream: the captured step runs the forward's dispatch and combine on a comm_stream (the eager steps it is
    compared with do not)."""
    experts = _experts_on_device if experts is None else experts
    side = torch.cuda.Stream() if comm_stream else None
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * world
    checked = []
    for case in formats_list:
        want = _reference(world, num_experts, case[0], case[2])
        # The captured tensors: leaves that require grad, and the routing and output gradient.
        x_leaf, w_leaf, W_local, static_idx, static_grad_y = _case_leaves(rank, world, device)
        mine = slice(rank * W_local.shape[0], (rank + 1) * W_local.shape[0])
        with _case_buffers(num_experts, case, backend) as (buf, grads):

            made = []  # the RoutedTokens of the last step

            def step(x_in, idx_in, w_in, W_in, g_in, comm=None):
                routed = training.dispatch(buf, grads, x_in, idx_in, w_in, comm_stream=comm)
                made[:] = [routed]
                done = torch.cuda.Event() if comm is not None else None
                y = training.combine(experts(routed, W_in), routed, comm_stream=comm, done_event=done)
                if done is not None:  # (this also joins the comm_stream back into a capture)
                    torch.cuda.current_stream().wait_event(done)
                (y.float() * g_in.float()).sum().backward()
                return y

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (allocator, autograd's accumulators)
                    step(x_leaf, static_idx, w_leaf, W_local, static_grad_y, side)
            torch.cuda.current_stream().wait_stream(stream)
            for leaf in (x_leaf, w_leaf, W_local):
                leaf.grad = None  # (the graph's backward then assigns, not accumulates, the gradients)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_y = step(x_leaf, static_idx, w_leaf, W_local, static_grad_y, side)
            graph.replay()
            # The captured dispatch's result read after the capture (its comm_stream event belongs to the capture:
            # RoutedTokens.wait must not wait on it from outside, which CUDA refuses).
            assert int(made[0].result.expert_offsets[-1]) >= 0
            torch.cuda.synchronize()
            _assert_matches_reference(case, rank, want, static_y, x_leaf, w_leaf, W_local, "graph ")

            for trial in range(trials):
                nx, nidx, nw, ng, nW = _new_inputs(x_leaf.shape[0], num_experts, 300 + 10 * trial + rank, device)
                previous = [t.clone() for t in (static_y, x_leaf.grad, w_leaf.grad, W_local.grad)]
                with torch.no_grad():
                    for static, new in ((x_leaf, nx), (static_idx, nidx), (w_leaf, nw), (static_grad_y, ng),
                                        (W_local, nW[mine])):
                        static.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                got = [t.clone() for t in (static_y, x_leaf.grad, w_leaf.grad, W_local.grad)]
                # The same step eagerly, twice, on fresh leaves with the same values, on the same Buffers.
                eager = []
                for _ in range(2):
                    ex, ew, eW = (t.clone().requires_grad_() for t in (nx, nw, nW[mine]))
                    e_y = step(ex, nidx, ew, eW, ng)
                    eager.append((e_y, ex.grad, ew.grad, eW.grad))
                torch.cuda.synchronize()
                for name, g_t, e_t, e2_t, old in zip(("y", "d x", "d topk_weights", "d W"), got, eager[0], eager[1],
                                                     previous):
                    assert_same_floats(e2_t, e_t, f"{case} trial {trial}: {name}, a second eager step")
                    assert_same_floats(g_t, e_t, f"{case} trial {trial}: {name}, the graph replay vs the eager step")
                    assert g_t.numel() == 0 or not torch.equal(g_t, old), (case, trial, "replay kept the old", name)
            del graph
        checked.append(case)
    return checked


def comm_stream_worker(rank, world, backend="nvlink", formats_list=(("nvfp4", "s2f6", "bf16"),)):
    """training.dispatch / combine on a comm_stream give the bits of the same step without one (y and every gradient),
    while the streams are made to race with sleep kernels: the current stream is held up before it writes the tokens
    and routing weights that the dispatch reads, and before it writes the expert outputs that the combine reads (a
    call that did not wait for the current stream would read stale values); the comm_stream is held up before the
    dispatch and the combine (code that read their results before they were ready would read stale rows). A matmul
    on the current stream after the dispatch stands for the work the comm_stream lets overlap: when it has finished,
    the nvlink dispatch must not have (so it did run on the comm_stream)."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * world
    side = torch.cuda.Stream()

    def held_up(stream):  # a sleep on `stream` after the work enqueued so far on the current stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)

    checked = []
    for case in formats_list:
        x_leaf, w_leaf, W_local, idx, grad_y = _case_leaves(rank, world, device)
        with _case_buffers(num_experts, case, backend) as (buf, grads):

            def step(comm_stream):
                x_in, w_in, W_in = (t.detach().clone().requires_grad_() for t in (x_leaf, w_leaf, W_local))
                with torch.no_grad():  # stale values that a dispatch running early would read
                    x_in.fill_(float("nan"))
                    w_in.fill_(-1.0)
                torch.cuda._sleep(20_000_000)
                with torch.no_grad():
                    x_in.copy_(x_leaf)
                    w_in.copy_(w_leaf)
                if comm_stream is not None:
                    held_up(comm_stream)  # (the dispatch, enqueued after this, ends late)
                routed = training.dispatch(buf, grads, x_in, idx, w_in, comm_stream=comm_stream)
                assert (routed.done_event is not None) == (comm_stream is not None)
                overlapped = torch.randn(512, 512, device=device) @ torch.randn(512, 512, device=device)
                if comm_stream is not None and backend == "nvlink":
                    # (nvlink only: the reference backend reads counts on the host inside its dispatch, so the call
                    # returns only once the comm_stream has got through most of it.)
                    beside = torch.cuda.Event()
                    beside.record()
                    beside.synchronize()
                    assert not routed.done_event.query(), "the dispatch did not run beside the current stream"
                expert_out = _experts_on_device(routed, W_in)
                torch.cuda._sleep(20_000_000)
                expert_out = expert_out * 1  # (written late: the combine must wait for it)
                done = torch.cuda.Event() if comm_stream is not None else None
                if comm_stream is not None:
                    held_up(comm_stream)
                y = training.combine(expert_out, routed, comm_stream=comm_stream, done_event=done)
                if done is not None:
                    torch.cuda.current_stream().wait_event(done)
                (y.float() * grad_y.float()).sum().backward()
                assert overlapped.isfinite().all()
                return [t.detach().clone() for t in (y, x_in.grad, w_in.grad, W_in.grad)]

            want = step(None)
            got = step(side)
            again = step(None)
            torch.cuda.synchronize()
            for name, g_t, w_t, a_t in zip(("y", "d x", "d topk_weights", "d W"), got, want, again):
                assert_same_floats(a_t, w_t, f"{case}: {name}, two steps without comm_stream")
                assert_same_floats(g_t, w_t, f"{case}: {name}, with comm_stream vs without")
        checked.append(case)
    return checked


def reference_capture_worker(rank, world):
    """The reference backend is not capturable: a capture of training.dispatch on it (or of a plain Buffer call) is
    refused with a message naming the nvlink backend, before anything is enqueued, and the Buffer still works after."""
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, weights, _ = (t.to(device) for t in _inputs(rank, 4 * world))
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=4 * world, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        expert_alignment=ALIGNMENT, backend="reference") as buf, \
            training.GradBuffers.create(buf) as grads:
        for call in (lambda: training.dispatch(buf, grads, x, idx, weights), lambda: buf.dispatch(x, idx, weights)):
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph.*nvlink"):
                with torch.cuda.graph(graph):
                    call()
        result = buf.dispatch(x, idx, weights)  # (still usable, on every rank)
        assert int(result.expert_offsets[-1]) >= int((idx >= 0).sum())
    return "reference refuses capture"


def checkpoint_worker(rank, world, backend="reference", device_kind="cpu"):
    """Activation checkpointing (torch.utils.checkpoint, reentrant and not) around two stacked layers of router ->
    training.dispatch -> training.expert_mlp -> training.combine: the backward recomputes each layer's forward, with
    its dispatch and combine (collectives, every rank in the same order), and must give the outputs and every gradient
    (x, router, both layers' expert weights) of the step without checkpointing, bit for bit. On a GPU (larger layers)
    it also measures the memory the forward leaves allocated for the backward (torch.cuda.memory_allocated).
    Returns {"failed": the checks that failed, "alive_mib": {mode: MiB} on a GPU}."""
    from torch.utils.checkpoint import checkpoint
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    hidden, intermediate, max_tokens = (1024, 512, 256) if on_gpu else (128, 64, 24)
    num_experts, num_topk, num_tokens = 4 * world, 3, max_tokens - rank
    gen = torch.Generator().manual_seed(5)
    local = slice(rank * 4, rank * 4 + 4)
    params = [torch.nn.Parameter(torch.randn(num_experts, hidden, generator=gen).to(device))]  # the router
    for _ in range(2):  # each layer's local experts: w1 [4, 2I, H], w2 [4, H, I]
        params.append(torch.nn.Parameter((torch.randn(num_experts, 2 * intermediate, hidden, generator=gen)[local]
                                          / hidden ** 0.5).to(device)))
        params.append(torch.nn.Parameter((torch.randn(num_experts, hidden, intermediate, generator=gen)[local]
                                          / intermediate ** 0.5).to(device)))
    x0 = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
    failed, alive_mib = [], {}
    with ep_comm.Buffer(None, hidden=hidden, num_experts=num_experts, num_topk=num_topk, max_tokens_per_rank=max_tokens,
                        expert_alignment=32, backend=backend) as buf, training.GradBuffers.create(buf) as grads:

        def layer(h, layer_index):
            topk_weights, topk_idx = torch.softmax(h.float() @ params[0].t(), dim=-1).topk(num_topk, dim=-1)
            routed = training.dispatch(buf, grads, h, topk_idx, topk_weights)
            w1, w2 = params[1 + 2 * layer_index], params[2 + 2 * layer_index]
            return training.combine(training.expert_mlp(routed, w1, w2, seed=10 + layer_index), routed)

        def step(mode):
            x = x0.clone().requires_grad_()
            for p in params:
                p.grad = None
            if on_gpu:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            h = x
            for layer_index in range(2):
                h = layer(h, layer_index) if mode is None else \
                    checkpoint(layer, h, layer_index, use_reentrant=mode == "reentrant")
            if on_gpu:
                torch.cuda.synchronize()
                alive_mib[str(mode)] = round((torch.cuda.memory_allocated() - before) / 2**20, 2)
            h.float().square().sum().backward()
            return [h.detach(), x.grad] + [p.grad for p in params]

        step(None)  # (a first step makes what every step reuses: the gradient Buffers' lazily made state, etc.)
        plain = step(None)
        for mode in ("reentrant", "non-reentrant"):
            again = step(mode)
            failed += [f"{mode}: tensor {i}" for i, (a, b) in enumerate(zip(plain, again))
                       if b is None or a.shape != b.shape or not torch.equal(as_bytes(a), as_bytes(b))]
    return {"failed": failed, "alive_mib": alive_mib}


_SCHEDULES = {  # (F i: micro-batch i's forward, B i: its backward)
    "sequential": ("F0", "B0", "F1", "B1", "F2", "B2"),
    "all forwards first": ("F0", "F1", "F2", "B0", "B1", "B2"),
    "one forward ahead": ("F0", "F1", "B0", "F2", "B1", "B2"),
    "backwards reversed": ("F0", "F1", "F2", "B2", "B1", "B0"),
}


def pipeline_worker(rank, world, backend="reference", device_kind="cpu", ep_layout=None, input_offset=0):
    """Micro-batches of a pipeline schedule: three micro-batches (different tokens and token counts) through router ->
    training.dispatch -> training.expert_mlp -> training.combine on one Buffer and its GradBuffers, forwards and
    backwards in the orders of _SCHEDULES (GPipe's, 1F1B's, ...). Each micro-batch's output and its own gradients
    (torch.autograd.grad: of its x, the router and both expert weights) must be those of the sequential schedule, bit
    for bit: a forward in flight keeps everything its backward needs, whatever runs in between.
    ep_layout ("blocked" / "strided"): the Buffers are made over this rank's expert-parallel group of 2 (two groups in
    a world of 4, dist_cases.ep_groups), every group at once, group g with the tokens of input_offset g. Returns (the
    differences found, [] when none; a digest of every result; the rank in the Buffers' group; g, 0 without
    ep_layout): with ep_layout, the digest must be that of an EP world of 2 alone with input_offset g."""
    group, index = None, 0
    if ep_layout is not None:
        from dist_cases import ep_groups
        _, group, index = ep_groups(world, 2, ep_layout)
        rank, world, input_offset = torch.distributed.get_rank(group), 2, index
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    hidden, intermediate, max_tokens, num_topk = 128, 64, 24, 3
    num_experts = 4 * world
    gen = torch.Generator().manual_seed(6)
    local = slice(rank * 4, rank * 4 + 4)
    router = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=gen).to(device))
    w1 = torch.nn.Parameter((torch.randn(num_experts, 2 * intermediate, hidden, generator=gen)[local]
                             / hidden ** 0.5).to(device))
    w2 = torch.nn.Parameter((torch.randn(num_experts, hidden, intermediate, generator=gen)[local]
                             / intermediate ** 0.5).to(device))
    inputs = [torch.randn(max_tokens - rank - 5 * i, hidden,
                          generator=torch.Generator().manual_seed(10 * rank + i + 1000 * input_offset))
              .to(torch.bfloat16).to(device) for i in range(3)]
    runs = {}
    with ep_comm.Buffer(group, hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                        max_tokens_per_rank=max_tokens, expert_alignment=32, backend=backend) as buf, \
            training.GradBuffers.create(buf) as grads:
        for name, schedule in _SCHEDULES.items():
            leaves, outputs, results = {}, {}, {}
            for event in schedule:
                i = int(event[1])
                if event[0] == "F":
                    leaves[i] = inputs[i].clone().requires_grad_()
                    topk_weights, topk_idx = torch.softmax(leaves[i].float() @ router.t(), dim=-1).topk(num_topk, -1)
                    routed = training.dispatch(buf, grads, leaves[i], topk_idx, topk_weights)
                    outputs[i] = training.combine(training.expert_mlp(routed, w1, w2, seed=20 + i), routed)
                else:
                    loss = outputs[i].float().square().sum()
                    results[i] = [outputs[i].detach()] + list(torch.autograd.grad(loss, [leaves[i], router, w1, w2]))
            runs[name] = [results[i] for i in range(3)]
    differences = []
    for name, run in runs.items():
        for i, (want, got) in enumerate(zip(runs["sequential"], run)):
            differences += [f"{name}: micro-batch {i}, tensor {j}" for j, (a, b) in enumerate(zip(want, got))
                            if a.shape != b.shape or not torch.equal(as_bytes(a), as_bytes(b))]
    digest = hashlib.sha256()
    for tensor in (t for results in runs.values() for micro_batch in results for t in micro_batch):
        digest.update(as_bytes(tensor).cpu().numpy().tobytes())
    return differences, digest.hexdigest(), rank, index


def checkpoint_empty_rank_worker(rank, world):
    """Non-reentrant checkpointing of router -> training.dispatch -> training.expert_mlp, with the combine outside the
    region, where rank 1's experts receive no row. The recomputation starts at the first saved tensor the backward
    unpacks, and it runs the dispatch (a collective): every rank must start it at the same point, so the experts save
    a placeholder where they have no rows. Returns whether the step's outputs and gradients equal those without
    checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint
    hidden, intermediate, num_experts, num_topk, num_tokens = 64, 32, 8, 2, 16
    gen = torch.Generator().manual_seed(1)
    router = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=gen))
    w1 = torch.nn.Parameter(torch.randn(4, 2 * intermediate, hidden, generator=gen) / 8)
    w2 = torch.nn.Parameter(torch.randn(4, hidden, intermediate, generator=gen) / 6)
    x0 = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with ep_comm.Buffer(None, hidden=hidden, num_experts=num_experts, num_topk=num_topk, max_tokens_per_rank=num_tokens,
                        expert_alignment=32, backend="reference", timeout_s=60) as buf, \
            training.GradBuffers.create(buf) as grads:

        def region(h):
            logits = (h.float() @ router.t()).masked_fill(torch.arange(num_experts) >= 4, -1e9)  # rank 0's experts
            topk_weights, topk_idx = torch.softmax(logits, -1).topk(num_topk, -1)
            routed = training.dispatch(buf, grads, h, topk_idx, topk_weights)
            return training.expert_mlp(routed, w1, w2, seed=5), routed

        results = []
        for checkpointed in (False, True):
            x = x0.clone().requires_grad_()
            for p in (router, w1, w2):
                p.grad = None
            out, routed = checkpoint(region, x, use_reentrant=False) if checkpointed else region(x)
            y = training.combine(out, routed)
            y.float().square().sum().backward()
            results.append([y.detach(), x.grad, router.grad, w1.grad, w2.grad])
        rows_here = routed.result.num_rows
    return rows_here, all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(*results))


def errors_worker(rank, world):
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=4 * world, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        backend="reference") as buf, \
            ep_comm.Buffer(None, hidden=2 * HIDDEN, num_experts=4 * world, num_topk=TOPK,
                           max_tokens_per_rank=MAX_TOKENS, dispatch_format="bf16", combine_format="bf16",
                           backend="reference") as wide, \
            training.GradBuffers.create(buf) as grads:
        x, idx, weights, _ = _inputs(rank, 4 * world)
        with pytest.raises(ValueError, match="grad_format"):
            training.GradBuffers.create(buf, "nvfp4")
        with pytest.raises(ValueError, match="input_grad_format must be one of"):
            training.GradBuffers.create(buf, input_grad_format="s2f6")
        with pytest.raises(TypeError, match="takes the forward's ep_comm.Buffer, got NoneType"):  # (AttributeError)
            training.GradBuffers.create(None)
        with pytest.raises(ValueError, match="hidden"):
            training.dispatch(buf, training.GradBuffers(rows=wide, weights=grads.weights), x, idx, weights)
        with pytest.raises(ValueError, match="GradBuffers.rows must combine in bf16 or mxfp8, has 's2f6'"):
            training.dispatch(buf, training.GradBuffers(rows=buf, weights=grads.weights), x, idx, weights)
        with pytest.raises(TypeError, match="GradBuffers"):
            training.dispatch(buf, buf, x, idx, weights)
        with pytest.raises(TypeError, match="what ep_comm.training.dispatch returned"):
            training.combine(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), buf.dispatch(x, idx, weights))
        # A comm_stream that is not a CUDA stream is refused (by the Buffer's own check, before its collective), for
        # the dispatch and the combine; CPU ranks have no streams at all.
        with pytest.raises(TypeError, match="comm_stream must be a torch.cuda.Stream"):
            training.dispatch(buf, grads, x, idx, weights, comm_stream="side")
        routed = training.dispatch(buf, grads, x, idx, weights)
        assert routed.done_event is None and routed.result is routed.link.result  # (no stream: nothing to wait for)
        with pytest.raises(TypeError, match="comm_stream must be a torch.cuda.Stream"):
            training.combine(routed.x, routed, comm_stream="side")
        with pytest.raises(TypeError, match="done_event must be a torch.cuda.Event"):
            training.combine(routed.x, routed, done_event="done")
        assert training.combine(routed.x, routed).shape == x.shape  # (the refusals left the ranks in step)
        # The plain calls still refuse tensors that require grad, and name this module.
        with pytest.raises(RuntimeError, match="ep_comm.training"):
            buf.dispatch(x.clone().requires_grad_(), idx, weights)
        # Inside a CUDA-graph capture the reference backend refuses, naming the nvlink backend (a stand-in for the
        # capture state: CPU ranks cannot capture; the GPU form is reference_capture_worker), on every rank alike.
        from ep_comm import buffer as buffer_module
        capturing, buffer_module._is_capturing = buffer_module._is_capturing, lambda: True
        try:
            with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph.*nvlink"):
                training.dispatch(buf, grads, x, idx, weights)
        finally:
            buffer_module._is_capturing = capturing
        assert buf.dispatch(x, idx, weights).num_rows >= 0  # (still in step with its peers)
    return "errors ok"


@pytest.mark.cpu
def test_fp32_split_into_three_bf16_parts_is_exact():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(100000, generator=gen) * torch.exp2(torch.randint(-100, 100, (100000,), generator=gen).float())
    largest = torch.tensor([0x7F7FFFFF], dtype=torch.int32).view(torch.float32)  # FLT_MAX: hi must not round to Inf
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1.0, -3.0e38, 3.0e38, 3.4e38, 1e-30, 65504.0, 1.0000001]),
                        largest, -largest])
    parts = training.split_fp32_in_bf16(values)
    assert parts.dtype == torch.bfloat16 and parts.shape == (values.numel(), 3)
    assert torch.equal(training.join_bf16_parts(parts), values)
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    back = training.join_bf16_parts(training.split_fp32_in_bf16(special))
    assert back[0] == float("inf") and back[1] == -float("inf") and back[2].isnan()
    assert training.weights_hidden(8) == 32 and training.weights_hidden(11) == 64 and training.weights_hidden(1) == 32
    # What they cannot round-trip is refused (float64 was rounded silently, a 4th part dropped, a 2-part row an
    # IndexError; weights_hidden(2.5) was 32.0 and weights_hidden(-5) 0).
    with pytest.raises(TypeError, match="takes a float32 tensor, got torch.float64"):
        training.split_fp32_in_bf16(torch.tensor([1 + 2.0 ** -40], dtype=torch.float64))
    for bad in (torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"join_bf16_parts takes bf16 \[\.\.\., 3\]"):
            training.join_bf16_parts(bad)
    with pytest.raises(TypeError, match="join_bf16_parts takes a bf16 tensor"):
        training.join_bf16_parts(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="num_topk must be an int"):
        training.weights_hidden(2.5)
    with pytest.raises(ValueError, match="num_topk must be positive"):
        training.weights_hidden(-5)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_dense_rows_are_zero_outside_the_rows_in_use_whatever_they_hold(fmt):
    """routed.x is zero on the rows not in use (padding, nvlink capacity rows), whatever bytes those rows of the
    payload hold: left-over codes and scales of earlier calls, NaN encodings included (an MXFP8 scale byte 0xFF is
    E8M0's NaN and made a zero code NaN before the scales were masked too -- found on the H200 by the CUDA-graph
    test's eager twin, whose capacity rows held such bytes)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, HIDDEN, generator=gen).to(torch.bfloat16)
    payload = {"nvfp4": lambda: formats.nvfp4_quantize(x, impl="reference"),
               "mxfp8": lambda: formats.mxfp8_quantize(x, impl="reference"), "bf16": lambda: x.clone()}[fmt]()
    in_use = torch.tensor([True, False] * 6)
    garbage = ~in_use
    zero = torch.zeros((), dtype=torch.bfloat16)
    want = torch.where(in_use[:, None], formats.dequantize(payload, torch.bfloat16), zero)
    for fill in (0xFF, 0x7F, 0x80):  # (NaN in E8M0 and E4M3, NaN in E4M3, -0 / 2^1 scales)
        if fmt == "bf16":
            payload[garbage] = float("nan")
        else:
            for name in ("data", "scales"):
                getattr(payload, name).view(torch.uint8)[garbage] = fill
            if fmt == "nvfp4":
                payload.amax[garbage] = float("nan")
        got = training._dense_rows(payload, torch.bfloat16, in_use)
        assert torch.equal(got, want), (fmt, hex(fill))  # (values: NVFP4's negative codes give -0.0 there)


@pytest.mark.cpu
def test_combine_backward_rows_refuses_mismatched_tensors():
    g, e, weight, src_rank = _rows_case(8, 64, 1, "cpu")
    slot = torch.zeros(8, dtype=torch.int32)
    for bad in ((g, e[:4], weight, src_rank), (g, e.float(), weight, src_rank), (g, e, weight[:4], src_rank),
                (g, e, weight, src_rank.long()), (g[:, :48], e[:, :48], weight, src_rank),
                (g, e, weight, src_rank, slot.long(), 32), (g, e, weight, src_rank, slot[:4], 32),
                (g, e, weight, src_rank, slot, 24), (g, e, weight, src_rank, slot, 0),
                (g, e, weight, src_rank, slot, True), (g, e, weight, src_rank, None, 32),
                (g, e, weight, src_rank, slot + 11, 32), (g, e, weight, src_rank, slot - 1, 32), (None, e, weight,
                                                                                                 src_rank)):
        for function in (training.combine_backward_rows, training.combine_backward_rows_reference):
            with pytest.raises(ValueError, match="combine_backward_rows"):
                function(*bad)
    # A slot whose 3 columns do not fit was a silently dropped routing-weight gradient; rows not in use may hold any
    # slot.
    with pytest.raises(ValueError, match=r"topk_slot of the rows in use must be in \[0, 10\)"):
        training.combine_backward_rows(g, e, weight, src_rank, slot + 10, 32)
    unused = src_rank.clone()
    unused[:] = -1
    assert training.combine_backward_rows(g, e, weight, unused, slot + 10, 32).weight_rows.abs().sum() == 0


_ALL_FORMATS = (("nvfp4", "s2f6", "bf16"), ("bf16", "bf16", "bf16"), ("mxfp8", "s2f6", "mxfp8"),
                ("nvfp4", "bf16", "mxfp8"), ("nvfp4", "mxfp8", "mxfp8", "mxfp8"))


@pytest.mark.cpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_gradients_match_torch_autograd(world):
    results = run_ranks(training_worker, world, "reference", "cpu", _ALL_FORMATS, backend="gloo")
    assert results == [list(_ALL_FORMATS)] * world


@pytest.mark.cpu
def test_gloo_rows_only_and_errors():
    assert run_ranks(rows_only_worker, 2, "reference", "cpu", backend="gloo") == ["rows only ok"] * 2
    assert run_ranks(exact_weights_worker, 2, "reference", "cpu", backend="gloo") == ["exact weights ok"] * 2
    assert run_ranks(errors_worker, 2, backend="gloo") == ["errors ok"] * 2


@pytest.mark.cpu
def test_gloo_activation_checkpointing_gives_the_same_step():
    assert run_ranks(checkpoint_worker, 2, backend="gloo") == [{"failed": [], "alive_mib": {}}] * 2


@pytest.mark.cpu
@pytest.mark.parametrize("world", [1, 2])
def test_gloo_pipeline_schedules_give_each_micro_batch_the_same_step(world):
    assert [result[0] for result in run_ranks(pipeline_worker, world, backend="gloo")] == [[]] * world


@pytest.mark.cpu
@pytest.mark.parametrize("layout", ["blocked", "strided"])
def test_gloo_training_in_expert_parallel_groups_inside_a_larger_world(layout):
    """Two EP groups of 2 in a world of 4, each with its own tokens: each group's training steps (forwards, backwards
    and their collectives over the group) give what an EP world of 2 alone gives with those tokens, bit for bit."""
    alone = [run_ranks(pipeline_worker, 2, "reference", "cpu", None, offset, backend="gloo") for offset in range(2)]
    assert alone[0][0][1] != alone[1][0][1]  # (the groups' tokens differ: rows of the other group would show)
    grouped = run_ranks(pipeline_worker, 4, "reference", "cpu", layout, backend="gloo")
    placement = [(0, 0), (0, 1), (1, 0), (1, 1)] if layout == "blocked" else [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(index, group_rank) for _, _, group_rank, index in grouped] == placement
    for differences, digest, group_rank, index in grouped:
        assert differences == [] and digest == alone[index][group_rank][1], (layout, index, group_rank)


@pytest.mark.cpu
def test_gloo_non_reentrant_checkpointing_with_a_rank_without_rows():
    (rows_0, same_0), (rows_1, same_1) = run_ranks(checkpoint_empty_rank_worker, 2, backend="gloo")
    assert rows_0 > 0 and rows_1 == 0 and same_0 and same_1


@pytest.mark.gpu
def test_nvlink_one_rank_activation_checkpointing_gives_the_same_step_and_frees_memory():
    """Also: both checkpointing modes leave far less memory allocated between forward and backward than the step
    without it (the expert MLP's saved tensors go through save_for_backward: as ctx attributes, non-reentrant
    checkpointing could not free them)."""
    (result,) = run_ranks(checkpoint_worker, 1, "nvlink", "cuda", backend="nccl")
    print("memory left for the backward (MiB):", result["alive_mib"])
    alive = result["alive_mib"]
    assert result["failed"] == [] and alive["reentrant"] < 0.25 * alive["None"] \
        and alive["non-reentrant"] < 0.25 * alive["None"], result


@pytest.mark.gpu
def test_nvlink_one_rank_gradients_match_torch_autograd():
    assert run_ranks(training_worker, 1, "nvlink", "cuda", _ALL_FORMATS, backend="nccl") == [list(_ALL_FORMATS)]
    assert run_ranks(rows_only_worker, 1, "nvlink", "cuda", backend="nccl") == ["rows only ok"]
    assert run_ranks(exact_weights_worker, 1, "nvlink", "cuda", backend="nccl") == ["exact weights ok"]
    assert run_ranks(pipeline_worker, 1, "nvlink", "cuda", backend="nccl")[0][0] == []


@pytest.mark.gpu
def test_nvlink_one_rank_training_step_in_a_cuda_graph():
    assert run_ranks(graph_worker, 1, "nvlink", _ALL_FORMATS, backend="nccl") == [list(_ALL_FORMATS)]
    assert run_ranks(reference_capture_worker, 1, backend="nccl") == ["reference refuses capture"]


@pytest.mark.gpu
def test_nvlink_one_rank_comm_stream_gives_the_same_step():
    assert run_ranks(comm_stream_worker, 1, "nvlink", _ALL_FORMATS, backend="nccl") == [list(_ALL_FORMATS)]
    assert run_ranks(comm_stream_worker, 1, "reference", _ALL_FORMATS[:1], backend="nccl") == [list(_ALL_FORMATS[:1])]
    assert run_ranks(graph_worker, 1, "nvlink", _ALL_FORMATS[:1], None, 3, True, backend="nccl") == \
        [list(_ALL_FORMATS[:1])]


@pytest.mark.multigpu
def test_nvlink_comm_stream_gives_the_same_step():
    world = multigpu_world()
    assert run_ranks(comm_stream_worker, world, "nvlink", _ALL_FORMATS, backend=multigpu_backend()) == \
        [list(_ALL_FORMATS)] * world
    assert run_ranks(graph_worker, world, "nvlink", _ALL_FORMATS[:1], None, 3, True, backend=multigpu_backend()) == \
        [list(_ALL_FORMATS[:1])] * world


@pytest.mark.multigpu
def test_nvlink_training_step_in_a_cuda_graph():
    world = multigpu_world()
    assert run_ranks(graph_worker, world, "nvlink", _ALL_FORMATS, backend=multigpu_backend()) == \
        [list(_ALL_FORMATS)] * world


@pytest.mark.multigpu
def test_nvlink_gradients_match_torch_autograd():
    world, backend = multigpu_world(), nvlink_backend()
    results = run_ranks(training_worker, world, backend, "cuda", _ALL_FORMATS, backend=multigpu_backend())
    assert results == [list(_ALL_FORMATS)] * world
    assert run_ranks(rows_only_worker, world, backend, "cuda", backend=multigpu_backend()) == \
        ["rows only ok"] * world
    assert run_ranks(exact_weights_worker, world, backend, "cuda", backend=multigpu_backend()) == \
        ["exact weights ok"] * world
    assert [result[0] for result in
            run_ranks(pipeline_worker, world, backend, "cuda", backend=multigpu_backend())] == [[]] * world


def _rows_case(num_rows: int, hidden: int, seed: int, device):
    """Random bf16 g, expert_out [R, H] with outliers, zero rows and NaN / Inf in rows in use, NaN garbage in the rows
    not in use (src_rank -1), weights of both signs and zero."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(num_rows, hidden, generator=gen) * torch.exp2(torch.randint(-20, 20, (num_rows, 1), generator=gen))
    e = torch.randn(num_rows, hidden, generator=gen)
    src_rank = torch.randint(-1, 3, (num_rows,), generator=gen, dtype=torch.int32)
    weight = torch.rand(num_rows, generator=gen) * 2 - 0.5
    if num_rows > 4:
        g[1] = 0.0
        e[2, :5] = 3.0e4  # outliers
        g[3, 7] = float("nan")
        e[4, 1] = float("inf")
        weight[0] = 0.0
    unused = src_rank < 0
    g[unused] = float("nan")
    e[unused] = float("nan")
    weight[unused] = float("nan")
    return (g.to(torch.bfloat16).to(device), e.to(torch.bfloat16).to(device), weight.to(device), src_rank.to(device))


@pytest.mark.cpu
def test_routed_tokens_wait_only_from_the_dispatchs_own_capture(monkeypatch):
    """RoutedTokens.wait (stand-in streams and capture ids): it waits on the current stream when the read is in the
    capture the comm_stream dispatch was made in (0: both eager); a captured dispatch read after its replay (outside any
    capture) makes no wait (the replay orders it) and no warning; a read inside another capture makes no wait (CUDA
    refuses it) and warns once; a dispatch without a comm_stream never waits. `result` and `x` go through it."""
    import types
    import warnings
    from ep_comm import _ext
    waits = []
    now = {"capture": 0}

    class Stream:
        def wait_event(self, event):
            waits.append(event)

    monkeypatch.setattr(_ext, "capture_id", lambda raw: now["capture"])
    monkeypatch.setattr(_ext, "current_raw_stream", lambda device: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(_ext, "_warned", set())
    link = types.SimpleNamespace(result="the result")

    def routed(capture, event="done"):
        return training.RoutedTokens(topk_weights=torch.zeros(1), carrier=torch.zeros(()), link=link, token=None,
                                     done_event=event, capture=capture)

    for made, read, waited, warned in ((0, 0, True, False), (7, 7, True, False), (7, 0, False, False),
                                       (0, 7, False, True), (7, 8, False, True)):
        waits.clear()
        now["capture"] = read
        monkeypatch.setattr(_ext, "_warned", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert routed(made).result == "the result"
        assert waits == (["done"] if waited else []), (made, read)
        assert any("CUDA-graph capture" in str(w.message) for w in caught) == warned, (made, read)
    waits.clear()
    now["capture"] = 0
    assert routed(0, event=None).result == "the result" and waits == []


def _dot_in_kernel_order(g_row: torch.Tensor, e_row: torch.Tensor) -> float:
    """<g, e> in csrc/training_rows.h's order, one numpy FP32 addition at a time: lane l of 32 adds its 8 columns of
    each 256-column chunk in column order (chunk 0 first), then lane l += lane l + d for d = 16, 8, 4, 2, 1. (bf16
    products are exact in FP32.)"""
    import numpy as np
    g, e = g_row.float().numpy(), e_row.float().numpy()
    lanes = np.zeros(32, dtype=np.float32)
    with np.errstate(all="ignore"):  # (Inf - Inf and NaN rows)
        for chunk in range(-(-g.size // 256)):
            for lane in range(32):
                for column in range(8):
                    index = chunk * 256 + lane * 8 + column
                    if index < g.size:
                        lanes[lane] = np.float32(lanes[lane] + np.float32(g[index] * e[index]))
        for d in (16, 8, 4, 2, 1):
            for lane in range(d):
                lanes[lane] = np.float32(lanes[lane] + lanes[lane + d])
    return float(lanes[0])


@pytest.mark.cpu
def test_combine_backward_rows_reference_semantics():
    g, e, weight, src_rank = _rows_case(40, 352, 0, "cpu")  # (352: a partial last 256-column chunk)
    slot = torch.randint(0, 8, (40,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    rows = training.combine_backward_rows_reference(g, e, weight, src_rank, slot, training.weights_hidden(8))
    grad, dots = rows.grad_expert_out, rows.dots
    used = src_rank >= 0
    assert torch.equal(grad[~used].float(), torch.zeros_like(grad[~used].float())) and not dots[~used].any()
    assert_same_floats(grad[used], (g[used].float() * weight[used, None]).to(torch.bfloat16), "f(w * g)")
    want = (g[used].double() * e[used].double()).sum(dim=-1)
    finite = torch.isfinite(want)
    assert torch.allclose(dots[used][finite].double(), want[finite], rtol=1e-5, atol=1e-3)
    assert torch.equal(torch.isnan(dots[used]), torch.isnan(want))  # NaN and Inf - Inf rows stay NaN
    # The sum order, bit for bit (the docstring's promise; another order changed 17 of these 31 rows' dots and passed
    # the tolerance above): written out here one FP32 addition at a time.
    assert_same_floats(dots[used], torch.tensor([_dot_in_kernel_order(g[r], e[r]) for r in used.nonzero().flatten()
                                                 .tolist()], dtype=torch.float32), "the dots' FP32 sum order")
    # The weight rows: each row in use holds its dot's three parts in its slot's columns, zeros elsewhere.
    carried = rows.weight_rows
    assert carried.dtype == torch.bfloat16 and carried.shape == (40, 32)
    assert not carried[~used].float().any()
    for row in used.nonzero().flatten().tolist():
        first = 3 * int(slot[row])
        assert_same_floats(training.join_bf16_parts(carried[row, first:first + 3]), dots[row], f"row {row}'s parts")
        others = torch.cat([carried[row, :first], carried[row, first + 3:]])
        assert not others.float().any(), row
    assert training.combine_backward_rows_reference(g, e, weight, src_rank).weight_rows is None


@pytest.mark.gpu
def test_combine_backward_rows_kernel_matches_reference():
    """csrc/training_rows.cu against its torch form, bit for bit (NaN as NaN), on fresh random rows: the rows'
    gradients, the dots and the weight rows (dots of every magnitude, NaN and Inf among them)."""
    require_format_kernels("cuda")  # (else combine_backward_rows is its torch form, compared with itself)
    shapes = [(0, 64), (1, 32), (37, 96), (300, 7168), (1025, 2048), (20000, 96), (77, 352)]
    for seed, (num_rows, hidden) in enumerate(shapes):  # (20000: rows > the grid; 96, 352: partial chunks)
        g, e, weight, src_rank = _rows_case(num_rows, hidden, 100 + seed, "cuda")
        if num_rows > 8:  # subnormal products and subnormal w * g (a flush-to-zero build would differ here)
            g[5] = (torch.randn(hidden) * 2.0 ** -130).to(torch.bfloat16).to(g.device)
            e[5] = (torch.randn(hidden) * 2.0 ** -5).to(torch.bfloat16).to(g.device)
            weight[5] = 2.0 ** -10
            src_rank[5] = 0
        num_topk = 1 + seed % 11  # (11: weights_hidden 64, two lanes' columns per row)
        slot = torch.randint(0, num_topk, (num_rows,), dtype=torch.int32).to(g.device)
        columns = training.weights_hidden(num_topk)
        rows = training.combine_backward_rows(g, e, weight, src_rank, slot, columns)
        want = training.combine_backward_rows_reference(g, e, weight, src_rank, slot, columns)
        what = f"at {num_rows} x {hidden}"
        assert_same_floats(rows.grad_expert_out, want.grad_expert_out, f"d expert_out {what}")
        assert_same_floats(rows.dots, want.dots, f"dots {what}")
        assert_same_floats(rows.weight_rows, want.weight_rows, f"weight rows {what}")
        plain = training.combine_backward_rows(g, e, weight, src_rank)  # (no weight rows asked for)
        assert plain.weight_rows is None
        assert_same_floats(plain.dots, want.dots, f"dots without weight rows {what}")
    # A view at an odd offset into its storage (not 16-byte aligned): copied, not faulted on.
    g, e, weight, src_rank = _rows_case(16, 64, 9, "cuda")
    flat = torch.zeros(16 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:].copy_(g.flatten())
    odd = flat[1:].view(16, 64)
    assert_same_floats(training.combine_backward_rows(odd, e, weight, src_rank).dots,
                       training.combine_backward_rows_reference(g, e, weight, src_rank).dots, "unaligned g")


@pytest.mark.gpu
def test_combine_backward_rows_takes_its_torch_form_where_the_kernels_cannot_run(monkeypatch):
    """A GPU the build has no kernel image for (stood in for by formats._kernel_image_problem): the torch form with a
    warning, as every other kernel path does, not a launch that fails with 'no kernel image' (before: no warning, the
    kernel launched)."""
    g, e, weight, src_rank = _rows_case(37, 96, 5, "cuda")
    monkeypatch.setattr(formats, "_kernel_image_problem", lambda device: "no kernel image for this GPU (test)")
    monkeypatch.setattr(training._ext, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no kernel image for this GPU"):
        rows = training.combine_backward_rows(g, e, weight, src_rank)
    want = training.combine_backward_rows_reference(g, e, weight, src_rank)
    assert_same_floats(rows.grad_expert_out, want.grad_expert_out, "d expert_out")
    assert_same_floats(rows.dots, want.dots, "dots")
