"""The library inside torch.compile (ep_comm/_compile.py): its entry points run eagerly, with graph breaks around them,
so a compiled model gets the eager bits, and inductor never generates code for the formats' exact rules (torch 2.13's
CPU code generator could not even build the S2F6 / MXFP8 quantizers: an InductorError on their float8_e8m0fnu
bitcasts, before the boundary)."""
import shutil

import pytest
import torch

import ep_comm
from ep_comm import formats, moe, training
from format_cases import as_bytes
from harness import run_ranks

HIDDEN, INTERMEDIATE, EXPERTS, TOPK, TOKENS = 128, 64, 8, 3, 24

# inductor (torch.compile's default backend) builds C++ on the CPU; Triton on the GPU needs none.
needs_cpp_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                        reason="inductor's CPU code generator needs a C++ compiler")


class RecordingBackend:
    """A torch.compile backend that runs the captured graphs as they are and records the operations in them."""

    def __init__(self):
        self.operations = []

    def __call__(self, graph_module, example_inputs):
        self.operations += [getattr(node.target, "__name__", str(node.target)) for node in graph_module.graph.nodes
                            if node.op in ("call_function", "call_method")]
        return graph_module.forward

    def only_the_callers_arithmetic(self) -> bool:
        """Dynamo captured the caller's multiplies (and additions) and nothing else: none of the library's operations."""
        return "mul" in self.operations and set(self.operations) <= {"mul", "add"}


def _same_bits(a, b) -> bool:
    """Bitwise equality of two tensors (compared as bytes: NaN payloads and the sign of zero count), or of two format
    objects' tensor fields."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a.detach()), as_bytes(b.detach()))
    fields = [name for name, value in vars(a).items() if isinstance(value, torch.Tensor)]
    return bool(fields) and all(_same_bits(getattr(a, name), getattr(b, name)) for name in fields)


def _format_round_trip(x):
    """The formats between two operations of the caller's own (x * 2 and the sum are exact in fp32 here)."""
    y = x * 2
    return (formats.nvfp4_quantize(y), formats.mxfp8_quantize(y, rounding="stochastic", seed=7),
            formats.s2f6_quantize(y), formats.dequantize(formats.s2f6_quantize(y)) + 1)


def _inputs(seed: int, device="cpu"):
    """bf16 rows [48, 256] over 12 decades, with an outlier, zeros and a NaN."""
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-6, 6, 48)[:, None]
    x[3, 5], x[4] = 3e4, 0.0
    x[7, 9] = float("nan")
    return x.to(torch.bfloat16).to(device)


@pytest.mark.cpu
def test_formats_run_eagerly_inside_a_compiled_function():
    """Dynamo captures only the caller's own two operations, not one of the formats' (hundreds before the boundary),
    and the results are the eager bits, for fresh data too (no value baked in at the first call)."""
    backend = RecordingBackend()
    compiled = torch.compile(_format_round_trip, backend=backend)
    for seed in (1, 2):
        x = _inputs(seed)
        eager, traced = _format_round_trip(x), compiled(x)
        assert all(_same_bits(a, b) for a, b in zip(eager, traced))
    assert backend.only_the_callers_arithmetic(), backend.operations


@pytest.mark.cpu
@needs_cpp_compiler
def test_inductor_builds_a_function_that_quantizes():
    """The default backend (inductor, C++ on the CPU) compiles the caller's operations and leaves the formats eager:
    the eager bits (before the boundary: InductorError on the S2F6 and MXFP8 scale bitcasts)."""
    torch._dynamo.reset()
    compiled = torch.compile(_format_round_trip)
    x = _inputs(3)
    assert all(_same_bits(a, b) for a, b in zip(_format_round_trip(x), compiled(x)))


def _layer_and_training_worker(rank, world, device_kind):
    """One rank: MoELayer and an ep_comm.training step (dispatch -> expert_mlp -> combine, forward and backward; then
    with the ExpertMLP module over three steps), each
    eager, then compiled with a recording backend and with inductor, between two operations of the caller's own
    (x * 2 and y * 2: exact in bf16). Returns, per case, whether every output and gradient has the eager bits, and
    whether dynamo captured nothing but those multiplies."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE ** 0.5
    router = torch.randn(EXPERTS, HIDDEN, generator=gen).to(device)
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    out = {}
    with ep_comm.Buffer(None, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=TOKENS,
                        expert_alignment=32) as buf, training.GradBuffers.create(buf) as grads:
        layer = moe.MoELayer(buf, router, moe.pack_weights(w1[local].to(device), w2[local].to(device)))

        def layer_between(x):
            return layer(x * 2) * 2

        backend = RecordingBackend()
        by_recorder, by_inductor = torch.compile(layer_between, backend=backend), torch.compile(layer_between)
        same = []
        for step in range(2):  # fresh tokens at the second call
            x = torch.randn(TOKENS - rank, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank))
            x = x.to(torch.bfloat16).to(device)
            eager = layer_between(x)
            same += [_same_bits(eager, by_recorder(x)), _same_bits(eager, by_inductor(x))]
        out["layer"] = (all(same), backend.only_the_callers_arithmetic())

        w1_local = torch.nn.Parameter(w1[local].clone().to(device))
        w2_local = torch.nn.Parameter(w2[local].clone().to(device))

        def step_between(x, topk_idx, topk_weights):
            routed = training.dispatch(buf, grads, x * 2, topk_idx, topk_weights)
            return training.combine(training.expert_mlp(routed, w1_local, w2_local, seed=3), routed) * 2

        def gradients(step, x, params):
            topk_weights, topk_idx = torch.softmax(x.detach().float() @ router.t(), dim=-1).topk(TOPK, dim=-1)
            x = x.detach().requires_grad_()
            topk_weights = topk_weights.requires_grad_()
            y = step(x, topk_idx, topk_weights)
            grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(77 + rank)).to(y)
            for p in params:
                p.grad = None
            y.backward(grad_y)
            return [y, x.grad, topk_weights.grad] + [p.grad for p in params]

        backend = RecordingBackend()
        same = []
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(40 + rank)).to(torch.bfloat16).to(device)
        eager = gradients(step_between, x, [w1_local, w2_local])
        for compiled in (torch.compile(step_between, backend=backend), torch.compile(step_between)):
            same.append(all(_same_bits(a, b) for a, b in zip(eager, gradients(compiled, x, [w1_local, w2_local]))))
        out["training"] = (all(same), backend.only_the_callers_arithmetic())

        # training.ExpertMLP, the module form: its forward hashes a call counter into the seed, which dynamo would
        # otherwise trace (and inductor failed to build from the second call on). Three modules with the same seed
        # (one eager, one per backend) take the same three steps; each step's outputs and gradients must agree.
        modules = [training.ExpertMLP(EXPERTS // world, HIDDEN, INTERMEDIATE, device=device, seed=9) for _ in range(3)]

        def module_step(module):
            def step(x, topk_idx, topk_weights):
                routed = training.dispatch(buf, grads, x * 2, topk_idx, topk_weights)
                return training.combine(module(routed), routed) * 2
            return step

        backend = RecordingBackend()
        steps = [module_step(modules[0]), torch.compile(module_step(modules[1]), backend=backend),
                 torch.compile(module_step(modules[2]))]
        same = []
        for call in range(3):
            x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(60 + 10 * call + rank))
            x = x.to(torch.bfloat16).to(device)
            results = [gradients(step, x, list(module.parameters())) for step, module in zip(steps, modules)]
            same += [all(_same_bits(a, b) for a, b in zip(results[0], other)) for other in results[1:]]
        out["expert_mlp_module"] = (all(same), backend.only_the_callers_arithmetic())
    return out


@pytest.mark.cpu
@needs_cpp_compiler
def test_moe_layer_and_training_step_compile_to_the_eager_bits():
    """2 CPU ranks over gloo (reference backend): the compiled layer and training step give the eager outputs and
    gradients bit for bit, and dynamo captures only the caller's multiplies."""
    for result in run_ranks(_layer_and_training_worker, 2, "cpu", backend="gloo"):
        assert result == {"layer": (True, True), "training": (True, True), "expert_mlp_module": (True, True)}, result


@pytest.mark.gpu
def test_moe_layer_and_training_step_compile_to_the_eager_bits_on_a_gpu():
    """World 1 on a GPU (nvlink backend, fused experts where the GPU has them; inductor's own code is Triton here)."""
    assert run_ranks(_layer_and_training_worker, 1, "cuda", backend="nccl") == \
        [{"layer": (True, True), "training": (True, True), "expert_mlp_module": (True, True)}]
