"""ep_comm.training.ExpertMLP / expert_mlp (trainable NVFP4 experts, MXFP8 + SR backward) against an FP32 oracle.

The oracle (`_oracle`) is written apart from the implementation: one expert at a time, FP32 matmuls on dequantized
operands (no BF16 GEMM outputs, no grouped GEMM, no per-row factors), SwiGLU's backward by torch autograd, and the
same quantizers (formats' torch references) with the seeds the module docstring names. The implementation rounds its
GEMM outputs to BF16 (all but the weight gradients of FP32 masters on sm_90: tests/test_grouped_wgrad.py), so some
stochastic roundings of its backward see inputs one BF16 ulp away from the oracle's and
land on the neighbouring E4M3 code, and the forward's NVFP4 requantization of the w2 input amplifies the same BF16
rounding: the comparison is a relative L2 bound (`_BOUNDS`), far below what a transposed operand, a wrong factor, a
misplaced segment or a missing mask gives (O(1)).
"""
import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F

import ep_comm
from ep_comm import formats, moe, training
from ep_comm.training_experts import _ExpertMLPFunction, _as_int64, _mix64, _saved_for_backward, grad_seed
from format_cases import as_bytes, assert_same_nvfp4, require_format_kernels
from harness import multigpu_backend, multigpu_world, nvlink_backend, run_ranks

HIDDEN, INTER, TOPK, MAX_TOKENS, ALIGNMENT = 64, 32, 2, 48, 32
# Relative L2 bounds against the oracle for (out, d rows, d w1, d w2): ~3x the largest of 30 random cases on CPU
# (means 2.7, 1.4, 1.3, 3.1%; maxima 5.7, 2.0, 2.3, 7.0%). The output and d w2 move most: the implementation rounds
# w1's outputs to BF16 (torch._grouped_mm), and the NVFP4 4/6 requantization of the w2 input turns a 2^-9 change into
# another E4M3 block scale or 4/6 choice for some blocks.
_BOUNDS = (0.15, 0.06, 0.07, 0.2)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def _inputs(rank: int, num_experts: int, num_tokens: int):
    """x bf16 [T, H] (an outlier), topk_idx [T, K] (masked slots; no token for local expert 1), weights fp32 [T, K]."""
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    if num_tokens:
        x[0, 3] = 12.0  # (an outlier, not so large that its row's error is all the relative L2 measures)
    choices = [e for e in range(num_experts) if e % 4 != 1]  # (local expert 1 of every rank gets no token)
    idx = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:TOPK]]
                       for _ in range(num_tokens)]) if num_tokens else torch.zeros(0, TOPK, dtype=torch.long)
    if num_tokens > 3:
        idx[2, 1] = -1
    weights = torch.softmax(torch.randn(num_tokens, TOPK, generator=gen), dim=-1)
    return x, idx, weights


def _oracle(result, w1: torch.Tensor, w2: torch.Tensor, g: torch.Tensor, seed: int):
    """FP32 (out [R, H], d rows [R, H], d w1, d w2) for one rank's dispatch result and output gradient g, on CPU."""
    result_x = formats.NVFP4Tensor(data=result.x.data.cpu(), scales=result.x.scales.cpu(), amax=result.x.amax.cpu(),
                                   e4m3_max=result.x.e4m3_max)
    num_rows = result.num_rows
    padded = -(-num_rows // 32) * 32
    use = (result.src_rank >= 0).cpu()
    offsets = result.expert_offsets.tolist()
    packed = moe.pack_weights(w1.detach().cpu(), w2.detach().cpu())
    W1 = formats.nvfp4_dequantize(packed.w1, impl="reference")
    W2 = formats.nvfp4_dequantize(packed.w2, impl="reference")
    x = torch.where(use[:, None], formats.nvfp4_dequantize(result_x, impl="reference"), 0.0)
    with moe.exact_fp32_matmuls():
        gate_up = torch.zeros(num_rows, 2 * INTER)
        for e in range(W1.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            gate_up[rows] = x[rows] @ W1[e].t()
        gate_up.requires_grad_()
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        hq = formats.nvfp4_quantize(F.pad(h.detach(), (0, 0, 0, padded - num_rows)), impl="reference")
        h_dense = formats.nvfp4_dequantize(hq, impl="reference")
        out = torch.zeros(num_rows, HIDDEN)
        for e in range(W1.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            out[rows] = h_dense[rows] @ W2[e].t()
        g = torch.where(use[:, None], g.cpu().to(torch.bfloat16), torch.zeros((), dtype=torch.bfloat16))

        def mx(t, name):
            q = formats.mxfp8_quantize(t, rounding="stochastic", seed=grad_seed(seed, name), impl="reference")
            return formats.mxfp8_dequantize(q, impl="reference")

        g_rows = mx(g, "g_rows")
        d_h = torch.zeros(num_rows, INTER)
        for e in range(W1.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            d_h[rows] = g_rows[rows] @ W2[e]
        (d_gate_up,) = torch.autograd.grad(h, gate_up, d_h)
        d_gate_up = torch.where(use[:, None], d_gate_up, 0.0)
        d_rows_q = mx(d_gate_up, "d_gate_up_rows")
        d_x = torch.zeros(num_rows, HIDDEN)
        for e in range(W1.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            d_x[rows] = d_rows_q[rows] @ W1[e]
        g_t = mx(F.pad(g, (0, 0, 0, padded - num_rows)).t().contiguous(), "g_tokens")
        d_t = mx(F.pad(d_gate_up, (0, 0, 0, padded - num_rows)).t().contiguous(), "d_gate_up_tokens")
        h_t = formats.mxfp8_dequantize(formats.nvfp4_to_mxfp8_transposed(hq, seed=grad_seed(seed, "h_tokens"),
                                                                          impl="reference"), impl="reference")
        masked_x = formats.NVFP4Tensor(
            data=F.pad(result_x.data, (0, 0, 0, padded - num_rows)),
            scales=F.pad(torch.where(use[:, None], result_x.scales.view(torch.uint8), 0),
                         (0, 0, 0, padded - num_rows)).view(torch.float8_e4m3fn),
            amax=F.pad(torch.where(use, result_x.amax, 0.0), (0, padded - num_rows)),
            e4m3_max=result_x.e4m3_max)
        x_t = formats.mxfp8_dequantize(formats.nvfp4_to_mxfp8_transposed(masked_x, seed=grad_seed(seed, "x_tokens"),
                                                                          impl="reference"), impl="reference")
        d_w1, d_w2 = torch.zeros_like(W1), torch.zeros_like(W2)
        for e in range(W1.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            d_w2[e] = g_t[:, rows] @ h_t[:, rows].t()
            d_w1[e] = d_t[:, rows] @ x_t[:, rows].t()
    return out, d_x, d_w1, d_w2


def _buffer(world: int, backend: str = "reference", **overrides):
    sizes = dict(hidden=HIDDEN, num_experts=4 * world, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                 expert_alignment=ALIGNMENT, backend=backend)
    sizes.update(overrides)
    return ep_comm.Buffer(None, **sizes)


def oracle_worker(rank, world, backend="reference", device_kind="cpu"):
    """The Function alone on a real dispatch result against the oracle, then the same result with NaN garbage rows
    appended past the rows in use (nvlink's capacity rows): bitwise the same outputs and gradients on the rows in
    use (or, where the garbage changes the padded row count, within the oracle's bounds)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    x, idx, weights = (t.to(device) for t in _inputs(rank, 4 * world, 40 if rank == 0 else 17))
    experts = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=11 + rank)
    seed = 2**40 + 3
    with _buffer(world, backend) as buf:
        result = buf.dispatch(x, idx, weights)
        num_rows = result.num_rows
        g = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
        g[result.src_rank < 0] = float("nan")  # (the gradient of rows not in use must reach nothing)

        def run(res, keep_weight_values=False):
            rows = torch.zeros(res.num_rows, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
            experts.zero_grad()
            out = _ExpertMLPFunction.apply(rows, experts.w1, experts.w2, res, seed, keep_weight_values)
            out.backward(F.pad(g, (0, 0, 0, res.num_rows - num_rows), value=float("nan")))
            return out.detach(), rows.grad, experts.w1.grad.clone(), experts.w2.grad.clone()

        got = run(result)
        _check_w2_input_is_the_swiglu_in_nvfp4_four_six(experts, result, seed, device)
        _check_main_grad_accumulation(experts, result, g, seed, device)
        want = _oracle(result, experts.w1, experts.w2, g, seed)
        names = ("out", "d rows", "d w1", "d w2")
        for name, a, b in zip(names, run(result, keep_weight_values=True), got):  # (the values kept, not decoded again)
            assert torch.equal(a, b), f"keep_weight_values changed {name}"
        errors = {name: _relative_error(a.cpu(), b) for name, a, b in zip(names, got, want)}
        for name, bound in zip(names, _BOUNDS):
            assert errors[name] < bound, (name, errors)
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
        assert got[2].dtype == torch.float32 and got[2].shape == experts.w1.shape
        unused = result.src_rank < 0
        assert not got[0][unused].any() and not got[1][unused].any()
        assert not got[2][1].any() and not got[3][1].any(), "expert 1 got no token: zero weight gradients"
        # The forward is the inference MoELayer's reference experts on the same packed weights, up to the BF16
        # rounding of the w1 outputs.
        packed = experts.pack()
        w1d, w2d = (formats.nvfp4_dequantize(w, impl="reference").to(device) for w in (packed.w1, packed.w2))
        offsets = result.expert_offsets.tolist()
        inference = torch.zeros_like(got[0])
        for e in range(4):
            rows = slice(offsets[e], offsets[e] + int(result.num_tokens_per_expert[e]))
            if rows.stop > rows.start:
                tokens = dataclasses.replace(result.x, data=result.x.data[rows], scales=result.x.scales[rows],
                                             amax=result.x.amax[rows])
                inference[rows] = moe.expert_mlp_reference(tokens, w1d[e], w2d[e])
        assert _relative_error(got[0], inference) < _BOUNDS[0], (_relative_error(got[0], inference), errors)

        # Garbage past the rows in use: NaN scales and amax, random codes, src_rank -1; same padded row count.
        extra = -(-num_rows // 32) * 32 - num_rows or 32
        gen = torch.Generator().manual_seed(9)

        def garbage(t, fill):
            tail = torch.randint(0, 256, (extra,) + tuple(t.shape[1:]), generator=gen, dtype=torch.uint8)
            tail = tail.to(device).view(t.dtype) if t.element_size() == 1 else torch.full(
                (extra,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=device)
            return torch.cat([t, tail])
        scales = garbage(result.x.scales, 0)
        scales[num_rows:] = torch.full_like(scales[num_rows:].view(torch.uint8), 0x7F).view(scales.dtype)
        padded_x = dataclasses.replace(result.x, data=garbage(result.x.data, 0), scales=scales,
                                       amax=garbage(result.x.amax, float("nan")))
        padded = dataclasses.replace(result, x=padded_x, src_rank=garbage(result.src_rank, -1),
                                     num_rows=num_rows + extra)
        again = run(padded)
        same_padding = -(-(num_rows + extra) // 32) == -(-num_rows // 32)
        if same_padding:  # bitwise (the token-axis roundings number their elements by the padded row count)
            for name, a, b in zip(names, again, got):
                assert torch.equal(a[:num_rows] if a.shape[0] == num_rows + extra else a, b), name
        else:
            want = _oracle(padded, experts.w1, experts.w2, F.pad(g, (0, 0, 0, extra), value=float("nan")), seed)
            for name, a, b, bound in zip(names, again, want, _BOUNDS):
                assert _relative_error(a.cpu(), b) < bound, name
        assert not again[0][num_rows:].any() and not again[1][num_rows:].any()
    return "oracle ok"


def _check_w2_input_is_the_swiglu_in_nvfp4_four_six(experts, result, seed, device):
    """The forward's w2 input, bit for bit: silu(gate) * up of w1's saved BF16 output times its FP32 row factor, zero
    on rows not in use and up to the padded count, quantized by the formats reference to NVFP4 with 4/6 and a
    per-token amax. (The oracle's relative bounds cannot tell plain NVFP4 here from 4/6: a mutation audit's plain
    quantization passed them.)"""
    rows = torch.zeros(result.num_rows, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = _ExpertMLPFunction.apply(rows, experts.w1, experts.w2, result, seed, False)
    saved = _saved_for_backward(out.grad_fn)  # (the forward's _Saved, rebuilt as the backward does)
    gate, up = (saved.gate_up_bf16.float() * saved.w1_row_factor[:, None]).chunk(2, dim=-1)
    swiglu = torch.zeros(saved.padded_rows, INTER, device=device)
    swiglu[:result.num_rows] = torch.where((result.src_rank >= 0)[:, None], F.silu(gate) * up, 0.0)
    want = formats.nvfp4_quantize(swiglu, four_over_six=True, impl="reference")
    assert saved.hidden.e4m3_max == formats.NVFP4_ACTIVATION_E4M3_MAX, saved.hidden.e4m3_max
    assert_same_nvfp4(saved.hidden, want, "the w2 input")


def _check_main_grad_accumulation(experts, result, g, seed, device):
    """accumulate_into_main_grad: the weight gradients added into FP32 main_grad buffers in place, bitwise `main_grad +
    the gradient` an FP32 master of the same values gets (the wgrad kernel accumulates in FP32 whatever the master
    dtype, and elsewhere a BF16 gradient is exact in FP32); .grad untouched, grad_added_to_main_grad set; the output
    and the rows' gradient the same bits. Also with main_grad buffers sliced out of one flat FP32 buffer at offsets
    that are not 16-byte aligned (as a trainer's flat gradient buffer gives), and with an upstream gradient that is
    contiguous but starts at an odd element (as torch.cat in the loss gives): the same bits."""
    def run(mlp, accumulate, grad=g):
        rows = torch.zeros(result.num_rows, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
        mlp.zero_grad()
        out = _ExpertMLPFunction.apply(rows, mlp.w1, mlp.w2, result, seed, False, accumulate)
        out.backward(grad)
        return out.detach(), rows.grad

    def flat_main_grads(weights, values):
        """main_grad views of one flat FP32 buffer, each starting 1 element (4 bytes) past a 16-byte boundary."""
        flat = torch.zeros(sum(w.numel() + 4 for w in weights), device=device)
        start = 1
        for w, v in zip(weights, values):
            w.main_grad = flat[start:start + w.numel()].view(w.shape)
            w.main_grad.copy_(v)
            assert w.main_grad.is_contiguous() and w.main_grad.data_ptr() % 16 == 4
            start += -(-(w.numel() + 1) // 4) * 4

    for dtype in (torch.float32, torch.bfloat16):
        reference = training.ExpertMLP(4, HIDDEN, INTER, device=device)
        twin = training.ExpertMLP(4, HIDDEN, INTER, device=device, dtype=dtype)
        with torch.no_grad():
            for ref_w, twin_w, w in ((reference.w1, twin.w1, experts.w1), (reference.w2, twin.w2, experts.w2)):
                twin_w.copy_(w.to(dtype))
                ref_w.copy_(twin_w.float())
        want = run(reference, False)
        before = []
        for i, w in enumerate((twin.w1, twin.w2)):
            w.main_grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(i)).to(device)
            w.grad_added_to_main_grad = False
            before.append(w.main_grad.clone())
        got = run(twin, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), dtype
        for w, ref_w, old in zip((twin.w1, twin.w2), (reference.w1, reference.w2), before):
            assert w.grad is None and w.grad_added_to_main_grad, dtype
            assert torch.equal(w.main_grad, old + ref_w.grad), \
                f"{dtype}: main_grad is not main_grad + the gradient in {(w.main_grad != old + ref_w.grad).sum()} values"
        flat_main_grads((twin.w1, twin.w2), before)
        odd_grad = torch.cat([torch.zeros(3, dtype=g.dtype, device=device), g.flatten()])[3:].view(g.shape)
        assert odd_grad.is_contiguous() and odd_grad.data_ptr() % 16 == 6
        got = run(twin, True, odd_grad)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{dtype}, misaligned buffers"
        for w, ref_w, old in zip((twin.w1, twin.w2), (reference.w1, reference.w2), before):
            assert torch.equal(w.main_grad, old + ref_w.grad), f"{dtype}: a misaligned main_grad"


def _frozen_worker(rank, world):
    """Inputs that do not require grad get none, and the others the same bits as with every input requiring grad (each
    rounding has its own seed whatever else is computed)."""
    x, idx, weights = _inputs(rank, 4, 40)
    experts = training.ExpertMLP(4, HIDDEN, INTER, seed=21)
    with _buffer(1) as buf:
        result = buf.dispatch(x, idx, weights)
        g = torch.randn(result.num_rows, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

        def grads(want_rows, want_w1, want_w2):
            rows = torch.zeros(result.num_rows, HIDDEN, dtype=torch.bfloat16, requires_grad=want_rows)
            w1 = experts.w1.detach().clone().requires_grad_(want_w1)
            w2 = experts.w2.detach().clone().requires_grad_(want_w2)
            _ExpertMLPFunction.apply(rows, w1, w2, result, 77).backward(g)
            return rows.grad, w1.grad, w2.grad

        every = grads(True, True, True)
        for wanted in ((False, True, True), (True, False, True), (True, True, False), (False, False, True),
                       (True, False, False), (False, True, False)):
            got = grads(*wanted)
            for want, a, b, name in zip(wanted, got, every, ("rows", "w1", "w2")):
                assert (a is None) != want and (a is None or torch.equal(a, b)), (wanted, name)
    return "frozen ok"


@pytest.mark.cpu
def test_frozen_inputs_get_no_gradient_and_the_others_the_same_bits():
    assert run_ranks(_frozen_worker, 1, backend="gloo") == ["frozen ok"]


def _dense_rows_worker(rank, world):
    """routed.x is made only when asked for: ExpertMLP's forward and backward never dequantize the dispatched rows into
    dense ones (it reads the NVFP4 payload; its row gradient goes back through routed.carrier), and x still gets its
    gradient. Asked for first under torch.no_grad(), routed.x is still differentiable, kept, and gives x the same
    gradient bits as when asked for with autograd on."""
    made = []
    dense_rows = training._dense_rows
    training._dense_rows = lambda *args: made.append(1) or dense_rows(*args)
    try:
        x, idx, weights = _inputs(rank, 4, 40)
        experts = training.ExpertMLP(4, HIDDEN, INTER, seed=5)
        with _buffer(1) as buf, training.GradBuffers.create(buf) as grads:
            x_leaf = x.clone().requires_grad_()
            routed = training.dispatch(buf, grads, x_leaf, idx, weights)
            training.combine(experts(routed), routed).float().square().sum().backward()
            assert not made and x_leaf.grad is not None and x_leaf.grad.float().abs().sum() > 0
            assert "x" not in vars(routed)  # (cached_property: not made behind the test's back either)

            def x_gradient(first_access_without_grad: bool) -> torch.Tensor:
                leaf = x.clone().requires_grad_()
                routed = training.dispatch(buf, grads, leaf, idx, weights)
                if first_access_without_grad:
                    with torch.no_grad():
                        rows = routed.x
                else:
                    rows = routed.x
                assert rows is routed.x and rows.requires_grad and rows.grad_fn is not None
                training.combine((rows * 3).to(torch.bfloat16), routed).float().square().sum().backward()
                return leaf.grad

            before = len(made)
            plain, under_no_grad = x_gradient(False), x_gradient(True)
            assert len(made) == before + 2  # (one dequantize per dispatch, whatever the number of accesses)
            assert plain.float().abs().sum() > 0 and torch.equal(plain, under_no_grad)
    finally:
        training._dense_rows = dense_rows
    return "dense rows ok"


@pytest.mark.cpu
def test_dense_rows_are_made_only_when_asked_for():
    assert run_ranks(_dense_rows_worker, 1, backend="gloo") == ["dense rows ok"]


def training_worker(rank, world, steps=12, backend="reference", device_kind="cpu"):
    """dispatch -> ExpertMLP -> combine with a router, a few SGD steps on a teacher's outputs: the loss falls."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    num_experts = 4 * world
    gen = torch.Generator().manual_seed(77)
    router = torch.nn.Parameter((torch.randn(num_experts, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device))
    x, _, _ = _inputs(rank, num_experts, MAX_TOKENS)
    target = torch.tanh(x.float() @ torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device)
    x = x.to(device)
    losses = []
    with _buffer(world, backend) as buf, training.GradBuffers.create(buf) as grads:
        experts = training.ExpertMLP(4, HIDDEN, INTER, seed=rank, device=device, keep_weight_values=rank == 1)
        params = [router, *experts.parameters()]
        optimizer = torch.optim.SGD(params, lr=2.0)
        for _ in range(steps):
            optimizer.zero_grad()
            scores = torch.softmax(x.float() @ router.t(), dim=-1)
            topk_weights, topk_idx = scores.topk(TOPK, dim=-1)
            routed = training.dispatch(buf, grads, x, topk_idx, topk_weights)
            y = training.combine(experts(routed), routed)
            loss = F.mse_loss(y.float(), target)
            loss.backward()
            torch.distributed.all_reduce(router.grad)  # (replicated: every rank's tokens' share)
            assert all(torch.isfinite(p.grad).all() for p in params)
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    return "training ok"


def errors_worker(rank, world):
    x, idx, weights = _inputs(rank, 4 * world, 8)
    experts = training.ExpertMLP(4, HIDDEN, INTER)
    with _buffer(world) as buf, training.GradBuffers.create(buf) as grads, \
            _buffer(world, expert_alignment=8) as unaligned, training.GradBuffers.create(unaligned) as grads8, \
            _buffer(world, dispatch_format="bf16") as plain, training.GradBuffers.create(plain) as grads_bf16:
        routed = training.dispatch(buf, grads, x, idx, weights)
        with pytest.raises(ValueError, match="expert_alignment"):
            experts(training.dispatch(unaligned, grads8, x, idx, weights))
        with pytest.raises(ValueError, match="dispatch_format='nvfp4'"):
            experts(training.dispatch(plain, grads_bf16, x, idx, weights))
        assert experts.calls == 0  # (the refused calls drew no seed)
        with pytest.raises(ValueError, match="local experts"):
            training.expert_mlp(routed, experts.w1[:3], experts.w2[:3], 0)
        with pytest.raises(ValueError, match="w2"):
            training.expert_mlp(routed, experts.w1, experts.w2[:, :, :16], 0)
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            training.expert_mlp(routed, experts.w1.half(), experts.w2, 0)
        # (Malformed weights are named, not an AttributeError or an unpacking error from the routing checks.)
        with pytest.raises(TypeError, match="w1 must be a float32 or bfloat16 tensor"):
            training.expert_mlp(routed, None, experts.w2, 0)
        with pytest.raises(TypeError, match="w2 must be a float32 or bfloat16 tensor"):
            training.expert_mlp(routed, experts.w1, None, 0)
        for w1 in (experts.w1[0], experts.w1[None]):
            with pytest.raises(ValueError, match="w1 is"):
                training.expert_mlp(routed, w1, experts.w2, 0)
        with pytest.raises(TypeError, match="torch.float32 or torch.bfloat16"):
            training.ExpertMLP(4, HIDDEN, INTER, dtype=torch.float16)
        # (the constructor refuses sizes the first forward would refuse only after the collective dispatch, and ones
        # torch.empty would refuse with its own message)
        for args, error, message in (((4, HIDDEN, 48), ValueError, "intermediate must be a positive multiple of 32"),
                                     ((4, 24, INTER), ValueError, "hidden must be a positive multiple of 32"),
                                     ((-1, HIDDEN, INTER), ValueError, "num_local_experts must be positive"),
                                     ((4, True, INTER), TypeError, "hidden must be an int, got bool"),
                                     ((4, float(HIDDEN), INTER), TypeError, "hidden must be an int, got float")):
            with pytest.raises(error, match=message):
                training.ExpertMLP(*args)
        with pytest.raises(TypeError, match="keep_weight_values must be a bool"):
            training.ExpertMLP(4, HIDDEN, INTER, keep_weight_values=1)
        with pytest.raises(TypeError, match="training.dispatch"):
            training.expert_mlp(buf.dispatch(x, idx, weights), experts.w1, experts.w2, 0)
        with pytest.raises(ValueError, match="multiple of 32"):
            training.expert_mlp(routed, torch.zeros(4, 32, HIDDEN), torch.zeros(4, HIDDEN, 16), 0)
        with pytest.raises(TypeError, match="keep_weight_values"):
            training.expert_mlp(routed, experts.w1, experts.w2, 0, keep_weight_values=1)
        with pytest.raises(TypeError, match="accumulate_into_main_grad"):
            training.expert_mlp(routed, experts.w1, experts.w2, 0, accumulate_into_main_grad=1)
        with pytest.raises(ValueError, match="w1 has no main_grad"):
            training.expert_mlp(routed, experts.w1, experts.w2, 0, accumulate_into_main_grad=True)
        experts.w1.main_grad = torch.zeros(experts.w1.shape)
        experts.w2.main_grad = torch.zeros(experts.w2.shape, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="w2.main_grad must be a contiguous float32"):
            training.expert_mlp(routed, experts.w1, experts.w2, 0, accumulate_into_main_grad=True)
        experts.w2.main_grad = torch.zeros(experts.w2.shape).transpose(1, 2).contiguous().transpose(1, 2)
        with pytest.raises(ValueError, match="not contiguous"):
            training.expert_mlp(routed, experts.w1, experts.w2, 0, accumulate_into_main_grad=True)
        del experts.w1.main_grad, experts.w2.main_grad
        # A second backward through the same graph (retain_graph) is refused, not answered with zeros.
        y = experts(routed)
        y.float().sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="a second time"):
            y.float().sum().backward()
    return "errors ok"


def _check_quantize_as_pack_weights(device):
    """quantize_expert_weights(w) on `device` is pack_weights' w1, and both are the documented rule computed here on the
    CPU by the torch reference: plain NVFP4 (four_over_six=False) with each expert's own amax in the [E, 1] form."""
    gen = torch.Generator().manual_seed(3)
    w_cpu = torch.randn(3, 64, 64, generator=gen) * torch.tensor([1.0, 1e-3, 50.0])[:, None, None]
    w = w_cpu.to(device)
    got = training.quantize_expert_weights(w)
    packed = moe.pack_weights(w, w[:, :, :32]).w1
    expert_amax = w_cpu.abs().amax(dim=2).amax(dim=1, keepdim=True)
    rule = formats.nvfp4_quantize(w_cpu, four_over_six=False, amax=expert_amax, impl="reference")
    for want, what in ((packed, "pack_weights"), (rule, "the reference rule")):
        for name in ("data", "scales", "amax"):
            a, b = getattr(got, name).cpu(), getattr(want, name).cpu()
            assert torch.equal(a.view(torch.uint8) if name == "scales" else a,
                               b.view(torch.uint8) if name == "scales" else b), f"{name} vs {what}"


def _arena_result_worker(rank, world):
    """_ExpertMLPFunction on a DispatchResult laid out as the nvlink backend lays it out (every field a view of one
    arena, made here from a reference-backend result), with the result's topk_weight edited in place between forward
    and backward (allowed: docs/TRAINING.md, Buffer.dispatch). The backward must not trip autograd's version check on
    the saved tensors that are views of the result, and the gradients are those of the same step without the edit (the
    experts' backward reads no weight). Returns the three gradients' byte equality."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=gen)[:TOPK] for _ in range(40)])
    weights = torch.softmax(torch.randn(40, TOPK, generator=gen), -1)
    experts = training.ExpertMLP(4, HIDDEN, INTER, seed=3)
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=4, num_topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        expert_alignment=ALIGNMENT, backend="reference") as buf:
        plain = buf.dispatch(x, idx, weights)
        rows = plain.num_rows
        data_bytes, scale_bytes = plain.x.data.numel(), plain.x.scales.numel()
        arena = torch.zeros((data_bytes + scale_bytes) // 4 + 3 * rows + plain.expert_offsets.numel(), dtype=torch.int32)
        arena_bytes, as_floats = arena.view(torch.uint8), arena.view(torch.float32)
        data = arena_bytes[:data_bytes].view(plain.x.data.shape)
        scales = arena_bytes[data_bytes:data_bytes + scale_bytes].view(plain.x.scales.shape).view(plain.x.scales.dtype)
        word = (data_bytes + scale_bytes) // 4
        amax = as_floats[word:word + rows]
        src_rank = arena[word + rows:word + 2 * rows]
        topk_weight = as_floats[word + 2 * rows:word + 3 * rows]
        offsets = arena[word + 3 * rows:]
        for view, value in ((data, plain.x.data), (scales.view(torch.uint8), plain.x.scales.view(torch.uint8)),
                            (amax, plain.x.amax), (src_rank, plain.src_rank), (topk_weight, plain.topk_weight),
                            (offsets, plain.expert_offsets)):
            view.copy_(value)
        in_arena = dataclasses.replace(plain, x=formats.NVFP4Tensor(data, scales, amax, plain.x.e4m3_max),
                                       src_rank=src_rank, topk_weight=topk_weight, expert_offsets=offsets)
        gradients = []
        for result, edit in ((plain, False), (in_arena, True)):
            rows_leaf = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
            experts.zero_grad(set_to_none=True)
            out = _ExpertMLPFunction.apply(rows_leaf, experts.w1, experts.w2, result, 5, False)
            if edit:
                result.topk_weight.mul_(0.5)
            out.float().square().sum().backward()
            gradients.append([rows_leaf.grad, experts.w1.grad, experts.w2.grad])
    return [torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(*gradients)]


@pytest.mark.cpu
def test_backward_survives_an_in_place_edit_of_the_dispatch_result():
    assert run_ranks(_arena_result_worker, 1, backend="gloo") == [[True, True, True]]


@pytest.mark.cpu
def test_expert_weights_quantize_as_pack_weights():
    _check_quantize_as_pack_weights(torch.device("cpu"))
    # (a 2-D w was an IndexError from the amax helper; an integer one would be quantized as its values)
    with pytest.raises(ValueError, match="tensor must be one of"):  # (a KeyError)
        grad_seed(0, "x")
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        training.quantize_expert_weights(torch.zeros(64, 64))
    with pytest.raises(TypeError, match="w must be a float32, bfloat16 or float16 tensor, got torch.int32"):
        training.quantize_expert_weights(torch.zeros(2, 64, 64, dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_expert_weights_quantize_as_pack_weights():
    require_format_kernels("cuda")  # (else both sides are the torch reference)
    _check_quantize_as_pack_weights(torch.device("cuda"))


@pytest.mark.cpu
@pytest.mark.parametrize("world", [1, 2])
def test_gloo_expert_mlp_matches_oracle(world):
    assert run_ranks(oracle_worker, world, "reference", "cpu", backend="gloo") == ["oracle ok"] * world


@pytest.mark.cpu
def test_stochastic_rounding_averages_out():
    """The backward's MXFP8 roundings are stochastic and fresh per seed: the mean weight gradient over 16 seeds is
    ~4x closer to the gradient without backward quantization than one seed's (nearest rounding would not move)."""
    assert run_ranks(_averaging_worker, 1, backend="gloo") == ["averaging ok"]


def _averaging_worker(rank, world):
    x, idx, weights = _inputs(rank, 4, 48)
    experts = training.ExpertMLP(4, HIDDEN, INTER, seed=5)
    with _buffer(1) as buf:
        result = buf.dispatch(x, idx, weights)
        g = torch.randn(result.num_rows, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        grads = []
        for seed in range(16):
            experts.zero_grad()
            rows = torch.zeros(result.num_rows, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
            _ExpertMLPFunction.apply(rows, experts.w1, experts.w2, result, seed).backward(g)
            grads.append(experts.w2.grad.clone())
        # Without backward quantization: dW2[e] = g_e^T h_e, FP32, h the forward's NVFP4 w2 input (from the oracle's
        # forward pieces).
        exact = _unquantized_w2_grad(result, experts, g)
        single = _relative_error(grads[0], exact)
        mean = _relative_error(torch.stack(grads).mean(0), exact)
        assert single > 1e-3 and mean < 0.5 * single, (single, mean)
    return "averaging ok"


def _unquantized_w2_grad(result, experts, g):
    use = result.src_rank >= 0
    packed = experts.pack()
    W1 = formats.nvfp4_dequantize(packed.w1)
    x = torch.where(use[:, None], formats.nvfp4_dequantize(result.x), 0.0)
    offsets = result.expert_offsets.tolist()
    grad = torch.zeros_like(experts.w2)
    with moe.exact_fp32_matmuls():
        for e in range(4):
            rows = slice(offsets[e], offsets[e + 1])
            gate, up = (x[rows] @ W1[e].t()).chunk(2, dim=-1)
            h = formats.nvfp4_dequantize(formats.nvfp4_quantize(F.silu(gate) * up))
            grad[e] = g[rows].float().t() @ h
    return grad


@pytest.mark.cpu
def test_gloo_expert_mlp_trains_and_refuses_bad_input():
    assert run_ranks(training_worker, 2, backend="gloo") == ["training ok"] * 2
    assert run_ranks(errors_worker, 1, backend="gloo") == ["errors ok"]


def _default_dtype_step_worker(rank, world, default_dtype):
    """One dispatch -> ExpertMLP(seed=0) -> combine -> backward on CPU with torch's default dtype set to
    `default_dtype` while the layer is made and runs. Returns the output and the gradients of x, the routing weights,
    w1 and w2."""
    x, idx, weights = _inputs(rank, 4, 16)
    x = x.requires_grad_()
    weights = weights.requires_grad_()
    torch.set_default_dtype(default_dtype)
    try:
        with _buffer(1) as buf, training.GradBuffers.create(buf) as grads:
            experts = training.ExpertMLP(4, HIDDEN, INTER, seed=0)
            routed = training.dispatch(buf, grads, x, idx, weights)
            y = training.combine(experts(routed), routed)
            (y.float() * torch.linspace(-1, 1, HIDDEN, dtype=torch.float32)).sum().backward()
            return [t.detach().clone() for t in (y, x.grad, weights.grad, experts.w1.grad, experts.w2.grad)]
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.cpu
def test_gloo_training_step_does_not_depend_on_the_default_dtype():
    """The trainable experts' initial weights are drawn in FP32 and combine's backward sums its dots in FP32 whatever
    torch.set_default_dtype says: a float64 default gives the same step bit for bit (it gave other weights, and
    float64 dots with other bits)."""
    want = run_ranks(_default_dtype_step_worker, 1, torch.float32, backend="gloo")[0]
    got = run_ranks(_default_dtype_step_worker, 1, torch.float64, backend="gloo")[0]
    for name, w, g in zip(("y", "x", "topk_weights", "w1", "w2"), want, got):
        assert w.dtype == g.dtype and torch.equal(w, g), f"{name} ({w.dtype} / {g.dtype}) depends on the default dtype"


def _tiny_step_worker(rank, world, flush: bool):
    """One dispatch -> ExpertMLP -> combine -> backward on CPU whose gradients reach the subnormal range inside the
    library (weights scaled by 1e-5, the loss by 1e-25; the test's own operations make only normal numbers), with
    this thread flushing subnormals or not. Returns the gradients of x, the routing weights, w1 and w2."""
    x, idx, weights = _inputs(rank, 4, 16)
    x = x.requires_grad_()
    weights = weights.requires_grad_()
    with _buffer(1) as buf, training.GradBuffers.create(buf) as grads:
        experts = training.ExpertMLP(4, HIDDEN, INTER, seed=1)
        with torch.no_grad():
            experts.w1.mul_(1e-5)
            experts.w2.mul_(1e-5)
        if flush and not torch.set_flush_denormal(True):
            return None  # this CPU cannot flush subnormals: nothing to keep
        try:
            routed = training.dispatch(buf, grads, x, idx, weights)
            y = training.combine(experts(routed), routed)
            (y.float() * 1e-25).sum().backward()
        finally:
            torch.set_flush_denormal(False)
        return [t.grad.clone() for t in (x, weights, experts.w1, experts.w2)]


@pytest.mark.cpu
def test_gloo_training_step_keeps_subnormals_when_the_thread_flushes_them():
    """NUMERICS.md: no implementation flushes subnormals, and the torch forms give the kernels' bits (the GPU never
    flushes). So combine's backward rows and routing-weight gradient (ep_comm.training) and the trainable experts'
    forward and backward (ep_comm.training_experts) give the same gradients, bit for bit, on a CPU thread under
    torch.set_flush_denormal(True); subnormal gradients included."""
    want = run_ranks(_tiny_step_worker, 1, False, backend="gloo")[0]
    got = run_ranks(_tiny_step_worker, 1, True, backend="gloo")[0]
    if got is None:
        pytest.skip("this CPU cannot flush subnormals: nothing to keep")
    tiny = torch.finfo(torch.float32).tiny
    assert any(bool(((g != 0) & (g.float().abs() < tiny)).any()) for g in want[1:]), "no subnormal gradient to keep"
    for name, w, g in zip(("x", "topk_weights", "w1", "w2"), want, got):
        bits = torch.int16 if w.dtype == torch.bfloat16 else torch.int32  # (bf16 x, fp32 others: bit patterns)
        assert torch.equal(w.view(bits), g.view(bits)), f"d {name} changed under a flushing thread"


@pytest.mark.gpu
def test_cuda_expert_mlp_matches_oracle():
    assert run_ranks(oracle_worker, 1, "nvlink", "cuda", backend="nccl") == ["oracle ok"]


@pytest.mark.multigpu
def test_nvlink_expert_mlp_matches_oracle_and_trains():
    """Every rank's experts against the oracle, and a few training steps, with the GPU ranks' own Buffers."""
    world, backend = multigpu_world(), nvlink_backend()
    assert run_ranks(oracle_worker, world, backend, "cuda", backend=multigpu_backend()) == ["oracle ok"] * world
    assert run_ranks(training_worker, world, 12, backend, "cuda", backend=multigpu_backend()) == \
        ["training ok"] * world


def _row_case(num_rows: int, width: int, seed: int, device):
    """bf16 [R, width] rows with outliers, a zero row, NaN / Inf and tiny values; src_rank int32 [R] with rows not in
    use (NaN garbage in one of them); an fp32 row factor [R] with a zero and a huge value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, width, generator=gen) * torch.exp(2 * torch.randn(num_rows, 1, generator=gen))
    src = torch.randint(-1, 3, (num_rows,), generator=gen, dtype=torch.int32)
    factor = torch.rand(num_rows, generator=gen) * 0.1
    if num_rows > 6:
        x[1, 3], x[2, :] = 3e4, 0.0
        x[3, 5], x[4, 7], x[5, :] = float("nan"), float("inf"), 1e-30
        src[1:6] = 0
        x[6, :] = float("nan")
        src[6] = -1
        factor[2], factor[3] = 0.0, 1e30
    return x.to(torch.bfloat16).to(device), src.to(device), factor.to(device)


@pytest.mark.gpu
def test_block_values_kernel_is_bitwise_the_reference():
    """_block_values' CUDA path (the dequantize kernel's bf16 block-value form) against its CPU path (the grouped GEMM
    expansion's fp16 block values, widened), bit for bit (NaN as NaN): random code and scale bytes -- every E4M3 scale
    code, NaN ones (0x7F, 0xFF) included, as nvlink capacity rows may hold --, odd row counts. (The block values do
    not depend on amax; the factors, amax times one constant on both paths, are compared for completeness.)"""
    from ep_comm.training_experts import _block_values
    gen = torch.Generator().manual_seed(91)
    for rows, k in ((1, 32), (37, 2048), (130, 7168)):
        data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(0, 256, (rows, k // 16), generator=gen, dtype=torch.uint8)
        scales[0, :] = torch.arange(k // 16, dtype=torch.int64).remainder(256).to(torch.uint8)
        amax = torch.rand(rows, generator=gen) * 10
        amax[::5] = 0.0
        amax[1::7] = 1e-30
        q = formats.NVFP4Tensor(data, scales.view(torch.float8_e4m3fn), amax, 448.0)
        want_values, want_factor = _block_values(q)
        q_cuda = formats.NVFP4Tensor(data.cuda(), scales.view(torch.float8_e4m3fn).cuda(), amax.cuda(), 448.0)
        assert formats._use_cuda("auto", q_cuda.data), "the CUDA path is not taken: this would compare the reference"
        got_values, got_factor = _block_values(q_cuda)
        got_values, got_factor = got_values.cpu(), got_factor.cpu()
        assert got_values.dtype == torch.bfloat16 and got_values.shape == want_values.shape == (rows, k)
        assert torch.equal(got_values.isnan(), want_values.isnan()), (rows, k)
        finite = ~want_values.isnan()
        assert torch.equal(got_values[finite].view(torch.int16), want_values[finite].view(torch.int16)), (rows, k)
        assert torch.equal(got_factor.view(torch.int32), want_factor.view(torch.int32)), (rows, k)


@pytest.mark.gpu
def test_row_kernels_match_their_torch_forms(monkeypatch):
    """csrc/training_experts.cu bit for bit against the torch forms the CPU path runs (NaN as NaN), at row counts that
    are and are not multiples of 32 and widths past one tile."""
    from format_cases import assert_same_floats
    from ep_comm import training_experts as te
    device = torch.device("cuda")
    probe = torch.zeros(8, device=device)
    for kernel in ("mxfp8_round_trips", "swiglu_rows", "swiglu_backward_rows", "scale_rows", "widen_bf16"):
        assert te._row_kernels(probe, kernel) is not None, f"{kernel} is not in ep_comm._C: nothing would be tested"

    def both(fn):
        kernel = fn()
        with monkeypatch.context() as patch:
            patch.setattr(te, "_row_kernels", lambda t, kernel: None)
            torch_form = fn()
        return kernel, torch_form

    for num_rows, width, extra in ((0, 64, 0), (1, 32, 0), (77, 96, 32), (300, 7168, 0), (1025, 2048, 0),
                                   (64, 4096, 0)):
        x, src, factor = _row_case(num_rows, width, num_rows + width, device)
        padded = -(-num_rows // 32) * 32 + extra
        (rows, tokens), (rows_t, tokens_t) = both(lambda: te._mxfp8_round_trips(x, src, padded, 2**40 + 5, 9))
        assert_same_floats(rows, rows_t, f"mxfp8 rows {num_rows}x{width}")
        assert_same_floats(tokens, tokens_t, f"mxfp8 tokens {num_rows}x{width}")
        (_, only_tokens), _ = both(lambda: te._mxfp8_round_trips(x, src, padded, None, 9))
        assert_same_floats(only_tokens, tokens_t, "tokens alone")
        (only_rows, no_tokens), _ = both(lambda: te._mxfp8_round_trips(x, src, padded, 2**40 + 5, None))
        assert no_tokens is None  # (the weights need no gradient: the rows alone)
        assert_same_floats(only_rows, rows_t, "rows alone")
        scaled, scaled_t = both(lambda: te._scale_rows_(x.clone(), factor, src))
        assert_same_floats(scaled, scaled_t, f"scale_rows {num_rows}x{width}")
        if width % 16 == 0:
            swiglu, swiglu_t = both(lambda: te._swiglu_rows(x, factor, src, padded))
            assert_same_floats(swiglu, swiglu_t, f"swiglu {num_rows}x{width}")
            d_hidden = x[:, :width // 2].contiguous()
            d_factor = factor.flip(0).contiguous()
            back, back_t = both(lambda: te._swiglu_backward_rows(d_hidden, d_factor, x, factor, src))
            assert_same_floats(back, back_t, f"swiglu backward {num_rows}x{width}")
        widened, widened_t = both(lambda: te._to_master_dtype(x, torch.float32))
        assert_same_floats(widened, widened_t, f"widen {num_rows}x{width}")
        unused = (src < 0).nonzero()
        if unused.numel():
            assert not scaled[unused[:, 0]].any() and not rows[unused[:, 0]].any()


def _no_rows_worker(rank, world):
    """A rank whose experts get no token (reference backend: a result of 0 rows): an empty output, zero weight
    gradients, an empty gradient for the rows."""
    experts = training.ExpertMLP(4, HIDDEN, INTER)
    with _buffer(1) as buf:
        result = buf.dispatch(torch.zeros(0, HIDDEN, dtype=torch.bfloat16), torch.zeros(0, TOPK, dtype=torch.long),
                              torch.zeros(0, TOPK))
        assert result.num_rows == 0
        rows = torch.zeros(0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        out = _ExpertMLPFunction.apply(rows, experts.w1, experts.w2, result, 3)
        assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16
        out.sum().backward()
        assert rows.grad.shape == (0, HIDDEN) and not experts.w1.grad.any() and not experts.w2.grad.any()
        assert experts.w1.grad.dtype == torch.float32
    return "no rows ok"


def _seed_worker(rank, world, backend="reference", device_kind="cpu"):
    """ExpertMLP's call seed is _mix64(_mix64(seed) ^ calls), the calls counted on the weights' device: its calls give
    the bits of expert_mlp with those int seeds (on a GPU the seeds are derived there, and the roundings read them
    there); a seed tensor gives the bits of its int (two's complement from 2^63); state_dict carries the count, so a
    module loaded from it draws the next call's noise, not the first call's again."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    x, idx, weights = (t.to(device) for t in _inputs(rank, 4, 40))
    with _buffer(1, backend) as buf, training.GradBuffers.create(buf) as grads:
        routed = training.dispatch(buf, grads, x, idx, weights)
        # (the experts' part alone)
        routed = dataclasses.replace(routed, carrier=routed.carrier.detach().requires_grad_())
        g = torch.randn(routed.result.num_rows, HIDDEN, generator=torch.Generator().manual_seed(4))
        g = g.to(torch.bfloat16).to(device)

        def step(mlp, seed=None):
            out = mlp(routed) if seed is None else training.expert_mlp(routed, mlp.w1, mlp.w2, seed)
            return (out.detach(), *torch.autograd.grad(out, (routed.carrier, mlp.w1, mlp.w2), g))

        def same(a, b):
            return all(torch.equal(p, q) for p, q in zip(a, b))

        mlp = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=2**64 - 5)
        assert mlp.call_count.device == device
        first = step(mlp)
        assert mlp.calls == 1 and same(first, step(mlp, _mix64(_mix64(2**64 - 5) ^ 1)))
        for value in (7, 2**63 + 12345):
            assert same(step(mlp, torch.tensor(_as_int64(value), device=device)), step(mlp, value)), value
        second = step(mlp)
        assert mlp.calls == 2 and same(second, step(mlp, _mix64(_mix64(2**64 - 5) ^ 2)))
        assert not torch.equal(second[2], first[2]), "the second call repeated the first call's rounding noise"
        loaded = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=1)
        loaded.load_state_dict(mlp.state_dict())
        assert (loaded.seed, loaded.calls) == (2**64 - 5, 2)
        assert same(step(loaded), step(mlp))
    if device.type == "cuda":  # the seed kernel's argument checks
        from ep_comm import _ext
        seeds, stream = torch.zeros(10, dtype=torch.int64, device=device), _ext.current_raw_stream(device)
        with pytest.raises(ValueError, match="at most 8 seeds"):
            _ext._C.mix_seeds(seeds.data_ptr(), False, [1] * 9, seeds[1:].data_ptr(), stream)
        with pytest.raises(ValueError, match="invalid arguments"):  # (out overlaps in)
            _ext._C.mix_seeds(seeds[1:].data_ptr(), True, [1, 2], seeds.data_ptr(), stream)
        assert not seeds.any()  # (nothing launched)
    return "seeds ok"


@pytest.mark.cpu
def test_expert_mlp_call_seeds_count_and_resume():
    assert run_ranks(_seed_worker, 1, backend="gloo") == ["seeds ok"]


def _microbatch_worker(rank, world, backend="reference", device_kind="cpu"):
    """ExpertMLP(..., is_first_microbatch=True / False): the micro-batches after the first reuse its NVFP4 weights (and,
    with keep_weight_values, their BF16 block values) instead of quantizing again -- the bits of a twin that quantizes
    at every call; a call with False is refused before any call with True, after None, and after an in-place update of
    a weight (an optimizer step), and a True call after that quantizes the new weights."""
    import ep_comm.training_experts as te
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind != "cpu" else torch.device("cpu")
    x, idx, weights = (t.to(device) for t in _inputs(rank, 4, 40))
    quantized, decoded = [], []
    quantize, decode = te.quantize_expert_weights, te._weight_values
    te.quantize_expert_weights = lambda w: quantized.append(w.shape) or quantize(w)  # (counts the quantizations
    te._weight_values = lambda q: decoded.append(q.data.shape) or decode(q)          # and the weights' decodes)
    try:
        with _buffer(1, backend) as buf, training.GradBuffers.create(buf) as grads:
            routed = training.dispatch(buf, grads, x, idx, weights)
            routed = dataclasses.replace(routed, carrier=routed.carrier.detach().requires_grad_())
            g = torch.randn(routed.result.num_rows, HIDDEN, generator=torch.Generator().manual_seed(6))
            g = g.to(torch.bfloat16).to(device)

            def step(mlp, first):
                out = mlp(routed, is_first_microbatch=first)
                return (out.detach(), *torch.autograd.grad(out, (routed.carrier, mlp.w1, mlp.w2), g))

            for keep in (False, True):
                mlp = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=3, keep_weight_values=keep)
                twin = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=3, keep_weight_values=keep)
                with pytest.raises(RuntimeError, match="call with is_first_microbatch=True first"):
                    mlp(routed, is_first_microbatch=False)
                with pytest.raises(TypeError, match="is_first_microbatch must be None or a bool"):
                    mlp(routed, is_first_microbatch=1)
                assert mlp.calls == 0  # (a refused call draws no seed)
                for update in range(2):
                    for first in (True, False, False):
                        del quantized[:], decoded[:]
                        got = step(mlp, first)
                        # (quantized by the True call only; decoded by every forward and backward, or -- values kept
                        # -- once, by the True call's forward)
                        assert (len(quantized), len(decoded)) == (2 if first else 0, (2 if first else 0) if keep else 4)
                        want = step(twin, None)
                        for name, a, b in zip(("out", "d rows", "d w1", "d w2"), got, want):
                            assert torch.equal(a, b), (keep, update, first, name)
                    cache = mlp._weight_cache
                    assert (cache.w1_values is not None) == keep and (cache.w2_values is not None) == keep
                    with torch.no_grad():  # (an optimizer step: in place)
                        for mod in (mlp, twin):
                            mod.w1.mul_(0.5)
                            mod.w2.add_(0.01)
                    with pytest.raises(RuntimeError, match="changed since the call with is_first_microbatch=True"):
                        mlp(routed, is_first_microbatch=False)
                    assert mlp.calls == twin.calls
                mlp(routed)  # (None: drops what was kept)
                with pytest.raises(RuntimeError, match="no weights were kept"):
                    mlp(routed, is_first_microbatch=False)
                mlp(routed, is_first_microbatch=True)
                mlp.release_weight_cache()
                with pytest.raises(RuntimeError, match="no weights were kept"):
                    mlp(routed, is_first_microbatch=False)
                # A parameter replaced by another (whatever its address and version), or moved: refused.
                mlp(routed, is_first_microbatch=True)
                mlp.w1 = torch.nn.Parameter(mlp.w1.detach().clone())
                with pytest.raises(RuntimeError, match="replaced, moved"):
                    mlp(routed, is_first_microbatch=False)
                mlp(routed, is_first_microbatch=True)
                mlp.to(torch.bfloat16)  # (a move drops what was kept)
                with pytest.raises(RuntimeError, match="no weights were kept"):
                    mlp(routed, is_first_microbatch=False)
                # A step of any torch optimizer since the True call: refused, whether or not it moved the counters
                # (here it updates another tensor).
                mlp(routed, is_first_microbatch=True)
                other = torch.nn.Parameter(torch.zeros(2))
                other.grad = torch.ones(2)
                torch.optim.SGD([other], lr=0.1).step()
                with pytest.raises(RuntimeError, match="a torch optimizer of this process"):
                    mlp(routed, is_first_microbatch=False)
                # The kept weights are neither pickled nor deep-copied (they refer to this module's parameters): the
                # copies load and need True again; the module itself keeps them.
                mlp(routed, is_first_microbatch=True)
                calls = mlp.calls
                for copy_of in (lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy):
                    other = copy_of(mlp)
                    assert other._weight_cache is None and other.calls == calls
                    with pytest.raises(RuntimeError, match="no weights were kept"):
                        other(routed, is_first_microbatch=False)
                assert mlp._weight_cache is not None
                mlp(routed, is_first_microbatch=False)
    finally:
        te.quantize_expert_weights, te._weight_values = quantize, decode
    return "micro-batches ok"


@pytest.mark.cpu
def test_expert_mlp_reuses_the_first_microbatch_weights():
    assert run_ranks(_microbatch_worker, 1, backend="gloo") == ["micro-batches ok"]


@pytest.mark.cpu
def test_expert_mlp_deferred_init_and_old_pickles():
    """reset_parameters() after construction on the meta device and to_empty() gives the constructor's weights and a
    zero call count; a module pickled when the count was the int attribute `calls` loads with that count."""
    made = training.ExpertMLP(2, HIDDEN, INTER, seed=2**63 + 1, dtype=torch.bfloat16)
    deferred = training.ExpertMLP(2, HIDDEN, INTER, seed=2**63 + 1, dtype=torch.bfloat16, device="meta")
    deferred.to_empty(device="cpu")
    deferred.call_count.fill_(12345)  # (to_empty leaves garbage there)
    deferred.reset_parameters()
    assert torch.equal(deferred.w1, made.w1) and torch.equal(deferred.w2, made.w2) and deferred.calls == 0
    state = dict(made.__dict__)
    state["_buffers"] = {name: b for name, b in made._buffers.items() if name != "call_count"}
    state["calls"] = 7
    old = training.ExpertMLP.__new__(training.ExpertMLP)
    old.__setstate__(state)
    assert old.calls == 7 and old.call_count.device == made.w1.device and old._weight_cache is None
    # Torch's recipe for big models: build on the meta device, then load_state_dict(..., assign=True). The meta module's
    # state_dict works (count 0), and the loaded one has the checkpoint's weights and call count (on the weights'
    # device: fill_ on the meta count would have kept nothing).
    made.call_count.fill_(5)
    on_meta = training.ExpertMLP(2, HIDDEN, INTER, seed=1, dtype=torch.bfloat16, device="meta")
    assert on_meta.state_dict()["_extra_state"]["calls"] == 0
    on_meta.load_state_dict(made.state_dict(), assign=True)
    assert torch.equal(on_meta.w1, made.w1) and on_meta.seed == made.seed
    assert on_meta.calls == 5 and on_meta.call_count.device == made.w1.device


def _graph_worker(rank, world, backend):
    """ExpertMLP's forward and backward captured in one CUDA graph: each replay, after new weights written in place (as
    an optimizer step does) and a new output gradient, gives the bits of an eager twin at the same call count, and a
    replay of the same inputs draws new rounding noise (the call counter and the seeds live on the device)."""
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, weights = (t.to(device) for t in _inputs(rank, 4, 40))
    with _buffer(1, backend) as buf, training.GradBuffers.create(buf) as grads:
        routed = training.dispatch(buf, grads, x, idx, weights)
        routed = dataclasses.replace(routed, carrier=routed.carrier.detach().requires_grad_())
        g = torch.zeros(routed.result.num_rows, HIDDEN, dtype=torch.bfloat16, device=device)
        graphed = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=9)
        eager = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=9)

        def step(mlp):
            out = mlp(routed)
            return (out, *torch.autograd.grad(out, (routed.carrier, mlp.w1, mlp.w2), g))

        side = torch.cuda.Stream()  # (torch's capture recipe: warm up on a side stream first)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(graphed)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step(graphed)
        assert graphed.calls == 2  # (the capture records the count's increment without running it)
        gen = torch.Generator().manual_seed(8)
        w1_grads = []
        for replay in range(3):
            if replay < 2:  # (the third replay repeats the second one's inputs)
                for name in ("w1", "w2"):
                    value = torch.randn(getattr(graphed, name).shape, generator=gen) / HIDDEN ** 0.5
                    for mlp in (graphed, eager):
                        getattr(mlp, name).data.copy_(value)
                g.copy_(torch.randn(g.shape, generator=gen).to(torch.bfloat16))
            eager.call_count.copy_(graphed.call_count)
            graph.replay()
            want = step(eager)
            for name, a, b in zip(("out", "d rows", "d w1", "d w2"), static, want):
                assert torch.equal(a, b), (replay, name)
            w1_grads.append(static[2].clone())
        assert graphed.calls == 5
        assert not torch.equal(w1_grads[1], w1_grads[2]), "a replay repeated the previous replay's rounding noise"
    return "graph ok"


def _layer_graph_worker(rank, world, backend, comm_stream=False):
    """A whole training layer in one CUDA graph: training.dispatch, ExpertMLP, training.combine and backward. Each
    replay, after new tokens, routing, routing weights, output gradient and weights were written into the captured
    tensors, gives the bits of the same step run eagerly with a twin ExpertMLP at the same call count, on the same
    Buffers: the output and the gradients of x, the routing weights, w1 and w2. comm_stream: the captured step runs
    the forward's dispatch and combine on a comm_stream held up by a sleep kernel before each (ExpertMLP must wait for
    the dispatch, the caller for the combine); the eager twin runs without one."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * world
    x, idx, weights = (t.to(device) for t in _inputs(rank, num_experts, 40))
    with _buffer(world, backend) as buf, training.GradBuffers.create(buf) as grads:
        graphed = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=21)
        eager = training.ExpertMLP(4, HIDDEN, INTER, device=device, seed=21)
        x_leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
        static_idx = idx.clone()
        grad_y = torch.zeros(x.shape[0], HIDDEN, dtype=torch.bfloat16, device=device)

        comm = torch.cuda.Stream() if comm_stream else None

        def held_up():  # the comm_stream, joined to the current stream (so into a capture) and then delayed
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                torch.cuda._sleep(5_000_000)
            return comm

        def step(mlp, x_in, idx_in, w_in, on_comm=False):
            routed = training.dispatch(buf, grads, x_in, idx_in, w_in, comm_stream=held_up() if on_comm else None)
            done = torch.cuda.Event() if on_comm else None
            y = training.combine(mlp(routed), routed, comm_stream=held_up() if on_comm else None, done_event=done)
            if done is not None:
                torch.cuda.current_stream().wait_event(done)
            y.backward(grad_y)
            return y

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(graphed, x_leaf, static_idx, w_leaf, comm_stream)
        torch.cuda.current_stream().wait_stream(side)
        for leaf in (x_leaf, w_leaf, graphed.w1, graphed.w2):
            leaf.grad = None  # (the graph's backward assigns the gradients)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step(graphed, x_leaf, static_idx, w_leaf, comm_stream)
        gen = torch.Generator().manual_seed(30 + rank)
        for replay in range(3):
            with torch.no_grad():
                nx = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
                nidx = idx.cpu()[torch.randperm(x.shape[0], generator=gen)]  # (the same experts, other tokens)
                nw = torch.rand(weights.shape, generator=gen) + 0.1
                for static, new in ((x_leaf, nx), (static_idx, nidx), (w_leaf, nw),
                                    (grad_y, torch.randn(grad_y.shape, generator=gen).to(torch.bfloat16))):
                    static.copy_(new)
                for name in ("w1", "w2"):
                    value = torch.randn(getattr(graphed, name).shape, generator=gen) / HIDDEN ** 0.5
                    for mlp in (graphed, eager):
                        getattr(mlp, name).copy_(value)
            eager.call_count.copy_(graphed.call_count)
            graph.replay()
            ex, ew = x_leaf.detach().clone().requires_grad_(), w_leaf.detach().clone().requires_grad_()
            eager.w1.grad = eager.w2.grad = None
            e_y = step(eager, ex, static_idx.clone(), ew)
            for name, a, b in (("y", static_y, e_y), ("d x", x_leaf.grad, ex.grad), ("d weights", w_leaf.grad, ew.grad),
                               ("d w1", graphed.w1.grad, eager.w1.grad), ("d w2", graphed.w2.grad, eager.w2.grad)):
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (replay, name)
            if x.shape[0]:
                assert static_y.abs().sum() > 0 and x_leaf.grad.abs().sum() > 0
        assert graphed.calls == 5
    return "layer graph ok"


@pytest.mark.gpu
def test_cuda_expert_mlp_seeds_and_cuda_graph():
    assert run_ranks(_seed_worker, 1, "nvlink", "cuda", backend="nccl") == ["seeds ok"]
    assert run_ranks(_graph_worker, 1, "nvlink", backend="nccl") == ["graph ok"]
    assert run_ranks(_microbatch_worker, 1, "nvlink", "cuda", backend="nccl") == ["micro-batches ok"]


@pytest.mark.gpu
def test_cuda_training_layer_with_expert_mlp_in_a_cuda_graph():
    assert run_ranks(_layer_graph_worker, 1, "nvlink", backend="nccl") == ["layer graph ok"]
    assert run_ranks(_layer_graph_worker, 1, "nvlink", True, backend="nccl") == ["layer graph ok"]


@pytest.mark.multigpu
def test_nvlink_training_layer_with_expert_mlp_in_a_cuda_graph():
    world = multigpu_world()
    assert run_ranks(_layer_graph_worker, world, "nvlink", backend=multigpu_backend()) == ["layer graph ok"] * world
    assert run_ranks(_layer_graph_worker, world, "nvlink", True, backend=multigpu_backend()) == \
        ["layer graph ok"] * world


@pytest.mark.cpu
def test_expert_mlp_without_rows():
    assert run_ranks(_no_rows_worker, 1, backend="gloo") == ["no rows ok"]
