"""ep_comm.training inside the data-parallel wrappers trainers use: FSDP2 (`fully_shard`) and DDP.

The layer is a replicated router and this rank's `training.ExpertMLP`, over a Buffer on the expert-parallel (EP) group
of a 2-D mesh ("dp", "ep"): experts are sharded by EP and replicated over "dp", the router over every rank. Each
wrapped run is compared with the same steps taken by hand -- no wrapper, the router's gradients summed over every
rank and the experts' over their "dp" group, both divided by the world size (the gradient of the mean of the ranks'
losses: _hand_steps) -- and must give the same losses and weights, bit for bit:

* fsdp2: `fully_shard(experts, mesh=mesh["dp"])` with `set_gradient_divide_factor(world)` inside
  `fully_shard(layer, mesh=<every rank>)` (TorchTitan's layout for expert parallelism), FP32 parameters;
* fsdp2_bf16: the same with `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`; the hand-taken steps
  run the layer on BF16 copies of FP32 masters, which is what the policy does;
* fsdp2_accumulate: two micro-batches per step, the experts kept unsharded between them (gradients reduced and
  weights resharded at the last one), `is_first_microbatch` True then False (the weights quantized once per step),
  against is_first_microbatch None;
* ddp: `DistributedDataParallel` over every rank with the experts' parameters and buffer left to the hand-taken
  reduction (`_set_params_and_buffers_to_ignore_for_model`): DDP would otherwise average distinct experts over the EP
  ranks, and its construction would broadcast rank 0's experts to every rank;
* fsdp2_dtensor, fsdp2_dtensor_bf16, fsdp2_dtensor_accumulate, ddp_dtensor: the same with
  `ExpertMLP(ep_mesh=mesh["ep"])`, whose weights are DTensors of the whole layer's experts (the form distributed
  checkpoints need: checkpoint_worker below); fsdp2_dtensor_bf16 is TorchTitan's usual setting (BF16 parameters, FP32
  reduction, DTensor experts).
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import ep_comm
from ep_comm import training, training_experts
from ep_comm.training_experts import _local  # (a DTensor's local tensor, else the tensor)
from format_cases import as_bytes
from harness import SHARED_GPU, multigpu_world, run_ranks

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, MAX_TOKENS, STEPS, LR = 128, 64, 8, 2, 16, 3, 0.5
# (the loss is a sum, not a mean: a rank without tokens has a loss of 0, not NaN)
WRAPPERS = ("fsdp2", "fsdp2_bf16", "fsdp2_accumulate", "ddp", "fsdp2_dtensor", "fsdp2_dtensor_bf16",
            "fsdp2_dtensor_accumulate", "ddp_dtensor")


class MoEBlock(torch.nn.Module):
    """router [E, H] (replicated) -> training.dispatch -> ExpertMLP (E / ep_size experts) -> training.combine.
    forward(x bf16 [T, H], is_first_microbatch=None) -> bf16 [T, H]."""

    def __init__(self, buffer, grads, ep_rank: int, ep_size: int, dtype: torch.dtype, device, ep_mesh=None):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, NUM_EXPERTS, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3))
                                     / HIDDEN ** 0.5)
        # (with ep_mesh: DTensors of all the layer's experts, one seed for every rank, which ExpertMLP mixes with the
        # rank's place in the mesh)
        self.experts = training.ExpertMLP(NUM_EXPERTS // ep_size, HIDDEN, INTERMEDIATE, dtype=dtype, device=device,
                                          seed=100 + (0 if ep_mesh is not None else ep_rank), ep_mesh=ep_mesh)
        self.buffer, self.grads = buffer, grads

    def forward(self, x, is_first_microbatch=None):
        scores = torch.softmax(x.float() @ self.router.weight.float().t(), dim=-1)
        topk_weights, topk_idx = scores.topk(TOPK, dim=-1)
        routed = training.dispatch(self.buffer, self.grads, x, topk_idx, topk_weights)
        return training.combine(self.experts(routed, is_first_microbatch=is_first_microbatch), routed)


def _tokens(rank: int, step: int, micro_batch: int, device) -> torch.Tensor:
    """This rank's bf16 [T, H] input of a step's micro-batch: uneven sizes, rank 1 without tokens at step 1."""
    num_tokens = 0 if (rank, step) == (1, 1) else MAX_TOKENS - 3 * (rank % 4) - micro_batch
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro_batch)
    return torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(device)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's sharded parameters and gradients), else the tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _hand_steps(make_block, rank, world, dp_group, micro_batches, param_dtype):
    """The wrappers' steps taken by hand: FP32 masters, the layer run on copies in param_dtype, gradients (FP32)
    summed over micro-batches, then the gradient of the mean of the ranks' losses: the router's summed over every
    rank, the experts' over dp_group (an expert's gradient already sums its EP group's tokens, which dispatch and
    combine bring to it), each divided by the world size, as TorchTitan divides its experts' (FSDP2:
    set_gradient_divide_factor); SGD. Returns (the losses, {name: FP32 master after the steps})."""
    block = make_block(torch.float32)
    masters = {name: _local(p).detach().clone().requires_grad_() for name, p in block.named_parameters()}
    block.to(param_dtype)
    optimizer = torch.optim.SGD(masters.values(), lr=LR)
    device = block.router.weight.device
    losses = []
    for step in range(STEPS):
        with torch.no_grad():
            for name, p in block.named_parameters():
                _local(p).copy_(masters[name])
        for micro_batch in range(micro_batches):
            loss = block(_tokens(rank, step, micro_batch, device)).float().square().sum() / 1024
            loss.backward()
            losses.append(loss.detach())
        for name, p in block.named_parameters():
            grad = _local(p.grad).float()
            group = dp_group if name.startswith("experts.") else None
            dist.all_reduce(grad, group=group)
            masters[name].grad = grad / world
            p.grad = None
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: m.detach() for name, m in masters.items()}


def _steps(model, block, rank, world, mesh, wrapper, micro_batches, divide_after, optimizer, device,
           before_step=None):
    """_wrapped_steps' training loop: the losses. before_step(model, block): called with the step's gradients in place,
    before the optimizer takes them."""
    losses = []
    for step in range(STEPS):
        for micro_batch in range(micro_batches):
            last = micro_batch == micro_batches - 1
            if wrapper.endswith("accumulate"):
                # Gradients reduced and the experts resharded at the step's last micro-batch only (FSDP2's
                # accumulation); sharded again, they are gathered anew at the next step, whose first micro-batch
                # quantizes them again (is_first_microbatch=True).
                model.set_requires_gradient_sync(last)
                block.experts.set_reshard_after_backward(last)
                first = micro_batch == 0
            else:
                first = None
            loss = model(_tokens(rank, step, micro_batch, device), first).float().square().sum() / 1024
            loss.backward()
            losses.append(loss.detach())
        if wrapper.startswith("fsdp2") and divide_after:
            for p in block.experts.parameters():
                p.grad /= mesh["ep"].size()  # (reduced over "dp" and divided by its size: / ep more is / world)
        if wrapper.startswith("ddp"):  # the experts: reduced by hand over the ranks holding them
            for p in block.experts.parameters():
                grad = _local(p.grad)
                dist.all_reduce(grad, group=mesh["dp"].get_group())
                grad /= world
        if before_step is not None:
            before_step(model, block)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _param_groups(model):
    """The optimizer's parameter groups: plain tensors, then DTensors. Under DDP with `ep_mesh` the experts' DTensor
    weights sit beside plain tensors, and torch's foreach step -- its default on CUDA -- refuses a group that mixes the
    two ("got mixed torch.Tensor and DTensor": seen on one H100, torch 2.11), so the experts get a group of their own
    (docs/TRAINING.md). Under FSDP2 every parameter is a DTensor, without `ep_mesh` under DDP none: one group."""
    from torch.distributed.tensor import DTensor
    params = list(model.parameters())
    groups = ([p for p in params if not isinstance(p, DTensor)], [p for p in params if isinstance(p, DTensor)])
    return [{"params": group} for group in groups if group]


def _wrapped_steps(make_block, rank, world, mesh, wrapper, before_step=None, count_quantizations=True):
    """The same steps with the layer wrapped as `wrapper` says (module docstring); before_step: see _steps;
    count_quantizations: check the weight quantizations' count (which assumes rows at every step: not where a rank is
    an EP group of its own). Returns (the losses, {name: FP32 parameter after the steps})."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel
    block = make_block(torch.float32)
    device = block.router.weight.device
    micro_batches = 2 if wrapper.endswith("accumulate") else 1
    divide_after = False
    if wrapper.startswith("fsdp2"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if wrapper.endswith("bf16") else MixedPrecisionPolicy()
        # Accumulation keeps the experts' weights gathered from the first micro-batch's forward to the step's end:
        # ExpertMLP's is_first_microbatch=False reuses the quantization of exactly those tensors.
        keep = wrapper.endswith("accumulate")
        fully_shard(block.experts, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=not keep)
        # The experts' sum over "dp" divided by the world size (_hand_steps), not by "dp"'s size: FSDP2's own divide
        # factor where NCCL reduces (its PreMulSum), else a division of the reduced gradients before the step (gloo
        # has no PreMulSum).
        divide_after = dist.get_backend() != "nccl"
        if not divide_after:
            block.experts.set_gradient_divide_factor(world)
        fully_shard(block, mesh=mesh._flatten("dp_ep"), mp_policy=policy)
        model = block
    else:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            block, ["experts.w1", "experts.w2", "experts.call_count"])
        model = DistributedDataParallel(block, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(_param_groups(model), lr=LR)
    # (the weight quantizations, counted: with is_first_microbatch, one of w1 and w2 per step -- the second micro-batch
    # reuses the first's -- where None quantizes at every call)
    quantized = []
    quantize = training_experts.quantize_expert_weights
    training_experts.quantize_expert_weights = lambda w: quantized.append(1) or quantize(w)
    try:
        losses = _steps(model, block, rank, world, mesh, wrapper, micro_batches, divide_after, optimizer, device,
                        before_step)
    finally:
        training_experts.quantize_expert_weights = quantize
    if count_quantizations and len(quantized) != 2 * STEPS * (1 if wrapper.endswith("accumulate") else micro_batches):
        raise AssertionError(f"{wrapper}: {len(quantized)} weight quantizations in {STEPS} steps")
    params = {name.removeprefix("module."): _full(p) for name, p in model.named_parameters()}
    return losses, params


@contextlib.contextmanager
def _mesh_and_buffers(world, ep_size, backend, device_kind, pp=1):
    """The 2-D mesh ("dp", "ep") of (world / ep_size, ep_size) ranks and a Buffer with its GradBuffers over the EP
    group: yields (device, mesh, ep_rank, buffer, grads, pp_group). pp > 1: pipeline stages -- the mesh ("pp", "dp",
    "ep") of (pp, world / (pp ep_size), ep_size), `mesh` this rank's stage's ("dp", "ep"), pp_group the ranks of the
    other stages at this rank's place (else None)."""
    from torch.distributed.device_mesh import init_device_mesh
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if pp == 1:
        mesh, pp_group = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep")), None
    else:
        stages = init_device_mesh(device.type, (pp, world // (pp * ep_size), ep_size),
                                  mesh_dim_names=("pp", "dp", "ep"))
        mesh, pp_group = stages["dp", "ep"], stages["pp"].get_group()
    ep_group = mesh["ep"].get_group()
    with ep_comm.Buffer(ep_group, hidden=HIDDEN, num_experts=NUM_EXPERTS, num_topk=TOPK,
                        max_tokens_per_rank=MAX_TOKENS, expert_alignment=32, backend=backend, timeout_s=120) as buf, \
            training.GradBuffers.create(buf) as grads:
        yield device, mesh, dist.get_rank(ep_group), buf, grads, pp_group


def wrapper_worker(rank, world, ep_size, wrapper, backend="reference", device_kind="cpu"):
    """One wrapper's steps against the hand-taken ones on a mesh (world / ep_size, ep_size). Returns the differences
    found ([] when none)."""
    with _mesh_and_buffers(world, ep_size, backend, device_kind) as (device, mesh, ep_rank, buf, grads, _):
        ep_group = mesh["ep"].get_group()
        ep_mesh = mesh["ep"] if "dtensor" in wrapper else None

        def make_block(dtype):
            return MoEBlock(buf, grads, ep_rank, ep_size, dtype, device, ep_mesh)

        param_dtype = torch.bfloat16 if wrapper.endswith("bf16") else torch.float32
        micro_batches = 2 if wrapper.endswith("accumulate") else 1
        want_losses, want = _hand_steps(make_block, rank, world, mesh["dp"].get_group(), micro_batches, param_dtype)
        got_losses, got = _wrapped_steps(make_block, rank, world, mesh, wrapper)
    if ep_mesh is not None:  # the hand-taken experts as the whole layer's, as the DTensors' full tensors are
        for name in ("experts.w1", "experts.w2"):
            parts = [torch.empty_like(want[name]) for _ in range(ep_size)]
            dist.all_gather(parts, want[name], group=ep_group)
            want[name] = torch.cat(parts)
    differences = [f"loss {i}: {a.item()} vs {b.item()}" for i, (a, b) in enumerate(zip(want_losses, got_losses))
                   if not torch.equal(a, b)]
    if len(want_losses) != len(got_losses) or sorted(want) != sorted(got):
        differences.append(f"steps or parameters differ: {len(want_losses)} / {len(got_losses)}, {sorted(want)} / "
                           f"{sorted(got)}")
    differences += [f"{name}: max |difference| {(want[name] - got[name]).abs().max().item()}" for name in want
                    if name in got and not torch.equal(as_bytes(want[name]), as_bytes(got[name]))]
    # (the experts must differ between EP ranks: a wrapper that broadcast or averaged them over EP makes them equal)
    w1 = got.get("experts.w1", torch.zeros(1))
    w1 = w1.chunk(ep_size)[ep_rank].contiguous() if ep_mesh is not None else w1  # (this rank's experts)
    gathered = [torch.empty_like(w1) for _ in range(ep_size)]
    dist.all_gather(gathered, w1, group=ep_group)
    if ep_size > 1 and torch.equal(gathered[0], gathered[1]):
        differences.append("the EP ranks' experts are equal")
    return differences


def _check(results):
    for differences in results:
        assert differences == [], differences


@pytest.mark.cpu
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("world,ep_size", [(2, 2), (4, 2)])
def test_gloo_wrapped_training_equals_the_hand_taken_steps(world, ep_size, wrapper):
    _check(run_ranks(wrapper_worker, world, ep_size, wrapper, backend="gloo"))


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nvlink_one_rank_wrapped_training_equals_the_hand_taken_steps(wrapper):
    """World 1 (NCCL, the nvlink backend): the wrappers' parameter swaps, hooks and streams around the CUDA kernels."""
    _check(run_ranks(wrapper_worker, 1, 1, wrapper, "nvlink", "cuda", backend="nccl"))


@pytest.mark.multigpu
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("ep_share", ["all", "half"])
def test_nvlink_wrapped_training_equals_the_hand_taken_steps(wrapper, ep_share):
    """One rank per GPU over NCCL (FSDP2 needs NCCL's collectives on CUDA tensors: not with ranks sharing a GPU over
    gloo), the EP group every rank ("all") or half of them ("half": the experts sharded and reduced over a "dp" of 2 or
    more, with FSDP2's divide factor)."""
    if SHARED_GPU:
        pytest.skip("FSDP2 and DDP on CUDA tensors need NCCL: one rank per GPU")
    world = multigpu_world()
    ep_size = world if ep_share == "all" else world // 2
    _check(run_ranks(wrapper_worker, world, ep_size, wrapper, "auto", "cuda", backend="nccl"))


def _true_gradient_norms(block, ep_group) -> tuple:
    """(2-norm, max norm) of the whole layer's gradient, every parameter once, in float64 from the full gradients:
    the router's (the same on every rank), the experts' of every EP rank (gathered over ep_group unless they are
    ExpertMLP(ep_mesh=...)'s DTensors, whose full value is the whole layer's already)."""
    squares, largest = 0.0, 0.0
    for name, p in block.named_parameters():
        grad = _full(p.grad)
        if name.startswith("experts.") and block.experts.ep_mesh is None:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(parts, grad, group=ep_group)
            grad = torch.cat(parts)
        squares += grad.double().square().sum().item()
        largest = max(largest, grad.abs().max().item())
    return squares ** 0.5, largest


def clip_worker(rank, world, ep_size, wrapper, backend="reference", device_kind="cpu", name_experts=True, pp=1):
    """`training.clip_grad_norm_` at each step of a wrapped layer (wrapper_worker's wrappers): the max norm (max_norm
    inf: nothing scaled) equal to the whole layer's, the 2-norm within 1e-5 of it and the same bits on every rank, and
    every gradient scaled (max_norm half the norm) by exactly min(1, max_norm / (norm + 1e-6)); `training.grad_norm`
    the same norm, nothing scaled. name_experts: the experts without ep_mesh named in expert_parameters (False:
    counted as replicated, right at EP 1). pp > 1: that many pipeline stages, each a layer of its own over its ranks
    (FSDP2 wrappers only: DDP here would average over every rank), and the norm the whole model's (every stage's
    layer) through pp_group. Returns the differences found ([] when none)."""
    differences = []
    with _mesh_and_buffers(world, ep_size, backend, device_kind, pp) as (device, mesh, ep_rank, buf, grads, pp_group):
        ep_group = mesh["ep"].get_group()
        ep_mesh = mesh["ep"] if "dtensor" in wrapper else None

        def clip_and_check(model, block):
            # (without ep_mesh the experts are this rank's own: named to clip_grad_norm_ with their group)
            experts = list(block.experts.parameters()) if ep_mesh is None and name_experts else []
            want_norm, want_max = _true_gradient_norms(block, ep_group)
            if pp_group is not None:  # (every stage's layer: the stages' squares summed, their maxima's max)
                stage = torch.tensor([want_norm ** 2, want_max], dtype=torch.float64)
                stages = [torch.empty_like(stage) for _ in range(pp)]
                dist.all_gather(stages, stage, group=pp_group)
                # (a missing sum shows where every stage's norm is nonzero, a missing max where the maxima differ)
                if min(x[0].item() for x in stages) <= 0 or len({x[1].item() for x in stages}) < 2:
                    differences.append(f"stages' (norm^2, max) {stages}: the test would not see a missing reduction")
                want_norm, want_max = sum(x[0] for x in stages).item() ** 0.5, max(x[1] for x in stages).item()
            groups = dict(expert_parameters=experts, ep_group=ep_group, pp_group=pp_group)
            got_max = training.clip_grad_norm_(model.parameters(), float("inf"), float("inf"), **groups)
            if got_max.item() != want_max:
                differences.append(f"max norm {got_max.item()} vs {want_max}")
            before = [_local(p.grad).clone() for p in model.parameters()]
            logged = training.grad_norm(model.parameters(), **groups)
            if any(not torch.equal(_local(p.grad), grad) for p, grad in zip(model.parameters(), before)):
                differences.append("grad_norm changed a gradient")
            max_norm = want_norm / 2
            got = training.clip_grad_norm_(model.parameters(), max_norm, **groups)
            if abs(got.item() - want_norm) > 1e-5 * want_norm:
                differences.append(f"norm {got.item()} vs {want_norm}")
            if not torch.equal(logged, got):
                differences.append(f"grad_norm {logged.item()} vs clip_grad_norm_'s {got.item()}")
            norms = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(norms, got)
            if any(not torch.equal(n, got) for n in norms):
                differences.append(f"ranks' norms differ: {[n.item() for n in norms]}")
            coef = torch.clamp(max_norm / (got + 1e-6), max=1.0)
            for (name, p), grad in zip(model.named_parameters(), before):
                if not torch.equal(_local(p.grad), grad * coef.to(grad.device)):
                    differences.append(f"{name}: gradient not scaled by {coef.item()}")

        _wrapped_steps(lambda dtype: MoEBlock(buf, grads, ep_rank, ep_size, dtype, device, ep_mesh), rank, world // pp,
                       mesh, wrapper, clip_and_check, count_quantizations=ep_size > 1)
    return differences


CLIP_WRAPPERS = ("fsdp2", "fsdp2_dtensor", "fsdp2_dtensor_accumulate", "ddp", "ddp_dtensor")


@pytest.mark.cpu
@pytest.mark.parametrize("wrapper", CLIP_WRAPPERS)
@pytest.mark.parametrize("world,ep_size", [(2, 2), (4, 2)])
def test_gloo_clip_grad_norm_is_the_whole_layers(world, ep_size, wrapper):
    """torch.nn.utils.clip_grad_norm_ fails for each of these wrappers but DDP without ep_mesh, where each EP rank
    clips by its own experts' norm (ep_comm/training_clip.py); training.clip_grad_norm_ clips them all alike."""
    _check(run_ranks(clip_worker, world, ep_size, wrapper, backend="gloo"))


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", ("fsdp2_dtensor", "ddp", "ddp_dtensor"))
def test_nvlink_one_rank_clip_grad_norm(wrapper):
    """World 1 (NCCL): the CUDA forms (torch's foreach norms and multiplies) of the same checks."""
    _check(run_ranks(clip_worker, 1, 1, wrapper, "nvlink", "cuda", backend="nccl"))


@pytest.mark.multigpu
@pytest.mark.parametrize("wrapper", CLIP_WRAPPERS)
def test_nvlink_clip_grad_norm(wrapper):
    """One rank per GPU over NCCL, "dp" of 2 where there are 4 or more GPUs (else EP over both)."""
    if SHARED_GPU:
        pytest.skip("FSDP2 and DDP on CUDA tensors need NCCL: one rank per GPU")
    world = multigpu_world()
    _check(run_ranks(clip_worker, world, world // 2 if world >= 4 else world, wrapper, "auto", "cuda",
                     backend="nccl"))


@pytest.mark.cpu
@pytest.mark.parametrize("world,wrapper", [(4, "fsdp2"), (4, "fsdp2_dtensor"), (8, "fsdp2_dtensor")])
def test_gloo_clip_grad_norm_across_pipeline_stages(world, wrapper):
    """4 or 8 ranks as 2 pipeline stages of EP 2 (8: each stage's experts sharded over a "dp" of 2 as well), each
    stage's layer under FSDP2 over its own ranks: through pp_group the norm is the whole model's, the same on every
    rank (torch's, and ours without pp_group, would give each stage its own)."""
    _check(run_ranks(clip_worker, world, 2, wrapper, "reference", "cpu", True, 2, backend="gloo"))


def stage_refusal_worker(rank, world):
    """2 ranks as 2 pipeline stages (pp_group: both): rank 1's arguments are refused (expert parameters without their
    group), rank 0's are valid. Both must raise -- rank 0 naming rank 1 -- instead of rank 0 waiting in the norm's
    gather for a rank that has left. Returns the errors found ([] when none)."""
    layer = torch.nn.Linear(4, 4)
    layer.weight.grad, layer.bias.grad = torch.ones(4, 4), torch.ones(4)
    experts = [layer.weight] if rank == 1 else []
    try:
        training.clip_grad_norm_(layer.parameters(), 1.0, expert_parameters=experts, pp_group=dist.group.WORLD)
    except ValueError as error:
        words = "needs ep_group" if rank == 1 else "rank(s) [1]"
        return [] if words in str(error) else [f"{words!r} not in {error}"]
    return ["not refused"]


@pytest.mark.cpu
def test_gloo_clip_grad_norm_refusal_on_one_stage_reaches_every_stage():
    _check(run_ranks(stage_refusal_worker, 2, backend="gloo", timeout_s=120))


@pytest.mark.cpu
@pytest.mark.parametrize("wrapper", ("fsdp2", "ddp"))
def test_gloo_clip_grad_norm_of_replicated_experts(wrapper):
    """EP groups of one rank (2 replicas): the experts are the same on both ranks and count as replicated, unnamed
    (not refused)."""
    _check(run_ranks(clip_worker, 2, 1, wrapper, "reference", "cpu", False, backend="gloo"))


def clip_errors_worker(rank, world):
    """clip_grad_norm_'s refusals (2 ranks, EP 2, before any collective but, with pp_group, the stages' agreement):
    expert parameters without their group or outside parameters, ExpertMLP(ep_mesh=...)'s DTensors named as expert
    parameters, a norm type <= 0, an ExpertMLP's per-rank experts (without ep_mesh) left out of expert_parameters, in
    whole or in part, also those of a deep copy; the pipeline groups that would count a stage twice (grad_norm's
    refusals are the same); and a NaN gradient with error_if_nonfinite, for the 2-norm and the max norm (after the
    reductions, so on every rank: the NaN is one rank's own expert's; a MAX all-reduce could drop it)."""
    errors = []
    with _mesh_and_buffers(world, world, "reference", "cpu") as (device, mesh, ep_rank, buf, grads, _):
        ep_group = mesh["ep"].get_group()
        plain = MoEBlock(buf, grads, ep_rank, world, torch.float32, device)
        sharded = MoEBlock(buf, grads, ep_rank, world, torch.float32, device, mesh["ep"])
        for block in (plain, sharded):
            block(_tokens(rank, 0, 0, device)).float().square().sum().backward()
        experts = list(plain.experts.parameters())
        copied = copy.deepcopy(plain.experts)  # (a stack of layers is often made by deep copies)
        for w in copied.parameters():
            w.grad = torch.zeros_like(w)
        cases = [
            (lambda: training.clip_grad_norm_(plain.parameters(), 1.0, expert_parameters=experts), ValueError,
             "needs ep_group"),
            (lambda: training.clip_grad_norm_(plain.router.parameters(), 1.0, expert_parameters=experts,
                                              ep_group=ep_group), ValueError, "must also be in parameters"),
            (lambda: training.clip_grad_norm_(sharded.parameters(), 1.0,
                                              expert_parameters=sharded.experts.parameters(), ep_group=ep_group),
             ValueError, "leave it out of expert_parameters"),
            (lambda: training.clip_grad_norm_(plain.parameters(), 1.0, 0.0), ValueError, "norm_type must be > 0"),
            # (per-rank experts not named: each EP rank would clip by its own norm)
            (lambda: training.clip_grad_norm_(plain.parameters(), 1.0, ep_group=ep_group), ValueError,
             "in parameters but not in expert_parameters"),
            (lambda: training.clip_grad_norm_(plain.parameters(), 1.0, expert_parameters=[plain.experts.w1],
                                              ep_group=ep_group),
             ValueError, "in parameters but not in expert_parameters"),
            (lambda: training.clip_grad_norm_(copied.parameters(), 1.0, ep_group=ep_group), ValueError,
             "in parameters but not in expert_parameters"),
            # (pipeline stages: pp_group holds one rank per stage; a group or mesh spanning stages counts them twice)
            (lambda: training.grad_norm(plain.parameters(), expert_parameters=experts, ep_group=ep_group,
                                        pp_group=ep_group), ValueError, "grad_norm: ep_group and pp_group share"),
            (lambda: training.grad_norm(sharded.parameters(), pp_group=dist.group.WORLD), ValueError,
             "mesh also holds another rank of pp_group"),
            (lambda: training.grad_norm(plain.parameters(), -1.0), ValueError, "grad_norm: norm_type must be > 0"),
        ]
        for call, kind, words in cases:
            try:
                call()
                errors.append(f"not refused: {words}")
            except kind as error:
                if words not in str(error):
                    errors.append(f"{words!r} not in {error}")
        if rank == 1:
            plain.experts.w1.grad[0, 0, 0] = float("nan")
        for norm_type in (2.0, float("inf")):
            try:
                training.clip_grad_norm_(plain.parameters(), 1.0, norm_type, expert_parameters=experts,
                                         ep_group=ep_group, error_if_nonfinite=True)
                errors.append(f"a NaN gradient not refused (norm {norm_type})")
            except RuntimeError as error:
                if "non-finite" not in str(error):
                    errors.append(f"'non-finite' not in {error}")
    return errors


@pytest.mark.cpu
def test_gloo_clip_grad_norm_refusals():
    _check(run_ranks(clip_errors_worker, 2, backend="gloo"))


def checkpoint_worker(rank, world, save_ep, load_ep, path, backend="reference", device_kind="cpu"):
    """A distributed checkpoint (torch.distributed.checkpoint) of the FSDP2 layer with ExpertMLP(ep_mesh=...), saved
    on a mesh (world / save_ep, save_ep) after one SGD step and loaded into a new layer (other initial weights) on a
    mesh (world / load_ep, load_ep). Returns the differences found ([] when none): every expert of the layer (the
    DTensors' full tensors), the router and ExpertMLP's extra state (seed, call count) must come back bit for bit, also
    where the EP size differs (each rank then loads other experts than it saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def layer(ep_size, seed_offset):
        mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
        buf = ep_comm.Buffer(mesh["ep"].get_group(), hidden=HIDDEN, num_experts=NUM_EXPERTS, num_topk=TOPK,
                             max_tokens_per_rank=MAX_TOKENS, expert_alignment=32, backend=backend, timeout_s=120)
        grads = training.GradBuffers.create(buf)
        block = MoEBlock(buf, grads, mesh["ep"].get_local_rank(), ep_size, torch.float32, device, mesh["ep"])
        block.experts.seed += seed_offset
        block.experts.reset_parameters()
        fully_shard(block.experts, mesh=mesh["dp"])
        fully_shard(block, mesh=mesh._flatten("dp_ep"))
        return block, buf, grads

    saved, buf, grads = layer(save_ep, 0)
    optimizer = torch.optim.SGD(saved.parameters(), lr=LR)
    saved(_tokens(rank, 0, 0, device)).float().square().sum().backward()
    optimizer.step()
    want = {name: _full(p) for name, p in saved.named_parameters()}
    want_state = saved.experts.get_extra_state()
    dcp.save(get_model_state_dict(saved), checkpoint_id=path)
    grads.destroy()
    buf.destroy()

    loaded, buf, grads = layer(load_ep, 7)
    before = _full(loaded.experts.w1)
    state = get_model_state_dict(loaded)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(loaded, state)
    got = {name: _full(p) for name, p in loaded.named_parameters()}
    differences = [f"{name}: max |difference| {(want[name] - got[name]).abs().max().item()}" for name in want
                   if not torch.equal(as_bytes(want[name]), as_bytes(got[name]))]
    if torch.equal(before, got["experts.w1"]):
        differences.append("the loaded layer's experts were the saved ones before the load: the test shows nothing")
    if loaded.experts.get_extra_state() != want_state:
        differences.append(f"extra state {loaded.experts.get_extra_state()} vs {want_state}")
    grads.destroy()
    buf.destroy()
    return differences


@pytest.mark.cpu
@pytest.mark.parametrize("world,save_ep,load_ep", [(2, 2, 2), (4, 2, 2), (4, 2, 4), (4, 4, 1)])
def test_gloo_distributed_checkpoint_keeps_every_ranks_experts(world, save_ep, load_ep, tmp_path):
    assert run_ranks(checkpoint_worker, world, save_ep, load_ep, str(tmp_path), backend="gloo") == [[]] * world


@pytest.mark.gpu
def test_nvlink_one_rank_distributed_checkpoint(tmp_path):
    assert run_ranks(checkpoint_worker, 1, 1, 1, str(tmp_path), "nvlink", "cuda", backend="nccl") == [[]]


def _refused(call, error, *texts) -> None:
    """call() must raise `error` with every one of texts in its message."""
    try:
        call()
    except error as e:
        assert all(text in str(e) for text in texts), e
    else:
        raise AssertionError(f"not refused: {texts}")


def ep_mesh_errors_worker(rank, world):
    """ExpertMLP(ep_mesh=...) on 2 gloo ranks: its shapes, its pack(), and its refusals. Returns "ok"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    one_rank_ep = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))["ep"]
    experts = training.ExpertMLP(4, HIDDEN, INTERMEDIATE, ep_mesh=mesh["ep"], seed=5)
    assert tuple(experts.w1.shape) == (4 * world, 2 * INTERMEDIATE, HIDDEN)
    assert tuple(experts.w1.to_local().shape) == (4, 2 * INTERMEDIATE, HIDDEN)
    # the rank's seed is mixed with its place in the mesh: the ranks' experts differ, and pack() packs the local ones
    parts = [torch.empty(4, 2 * INTERMEDIATE, HIDDEN) for _ in range(world)]
    dist.all_gather(parts, experts.w1.to_local().detach().contiguous())
    assert not torch.equal(parts[0], parts[1])
    # ep_rank (Buffer.rank) mixes the rank in the same way without a mesh: the same weights as ep_mesh's local ones;
    # without either, every rank that passes the seed draws the same experts (replicas)
    by_rank = training.ExpertMLP(4, HIDDEN, INTERMEDIATE, ep_rank=mesh["ep"].get_local_rank(), seed=5)
    assert torch.equal(by_rank.w1.detach(), experts.w1.to_local().detach())
    assert torch.equal(by_rank.w2.detach(), experts.w2.to_local().detach())
    same = training.ExpertMLP(4, HIDDEN, INTERMEDIATE, seed=5).w1.detach().contiguous()
    dist.all_gather(parts, same)
    assert torch.equal(parts[0], parts[1])
    packed = experts.pack()
    want = ep_comm.moe.pack_weights(experts.w1.to_local().detach(), experts.w2.to_local().detach())
    assert torch.equal(as_bytes(packed.w1.data), as_bytes(want.w1.data))
    for kwargs, error, text in (({"ep_mesh": "ep"}, TypeError, "1-D torch DeviceMesh"),
                                ({"ep_mesh": mesh, }, TypeError, "1-D torch DeviceMesh"),
                                ({"ep_mesh": mesh["ep"], "accumulate_into_main_grad": True}, ValueError,
                                 "accumulate_into_main_grad"),
                                ({"ep_mesh": mesh["ep"], "ep_rank": rank}, ValueError, "ep_rank or ep_mesh, not both"),
                                ({"ep_rank": -1}, ValueError, "ep_rank must be this rank's place"),
                                ({"ep_rank": "0"}, TypeError, "ep_rank")):
        _refused(lambda: training.ExpertMLP(4, HIDDEN, INTERMEDIATE, **kwargs), error, text)
    with ep_comm.Buffer(mesh["ep"].get_group(), hidden=HIDDEN, num_experts=NUM_EXPERTS, num_topk=TOPK,
                        max_tokens_per_rank=MAX_TOKENS, expert_alignment=32) as buf, \
            training.GradBuffers.create(buf) as grads:
        wrong = MoEBlock(buf, grads, 0, 1, torch.float32, "cpu", one_rank_ep)  # 8 experts on a mesh of one rank
        _refused(lambda: wrong(_tokens(rank, 0, 0, "cpu")), ValueError,
                 "the local experts would not be the ones routed here")
        # is_first_microbatch with DTensor weights: a foreach optimizer step (torch's default for DTensors on CUDA)
        # moves no version counter of theirs, yet the kept weights are refused after it; a move drops them (torch
        # swaps DTensor parameters, which weak references to them would stop).
        block = MoEBlock(buf, grads, rank, world, torch.float32, "cpu", mesh["ep"])
        x = _tokens(rank, 0, 0, "cpu")
        block(x, True).float().sum().backward()
        torch.optim.SGD(block.experts.parameters(), lr=0.1, foreach=True).step()
        _refused(lambda: block(x, False), RuntimeError, "a torch optimizer of this process")
        block(x, True)
        block.to(torch.float64).to(torch.float32)
        _refused(lambda: block(x, False), RuntimeError, "no weights were kept")
    # Without ep_mesh, FSDP2 over "dp" of 2 ranks makes the weights 1-D DTensors sharded along the experts, as
    # ep_mesh's look: still refused where the whole local experts are needed.
    plain = training.ExpertMLP(4, HIDDEN, INTERMEDIATE, seed=5)
    fully_shard(plain, mesh=init_device_mesh("cpu", (world,)))
    for call in (plain.reset_parameters, plain.pack):
        _refused(call, RuntimeError, "initialise before sharding")
    fully_shard(experts, mesh=mesh["dp"])  # (a "dp" of one rank: the weights become DTensors over both dimensions)
    for call in (experts.reset_parameters, experts.pack):
        _refused(call, RuntimeError, "initialise before sharding", "unshard()")
    experts.unshard()  # (FSDP2's gathered weights: the placement ExpertMLP made, so pack() takes them)
    assert torch.equal(as_bytes(experts.pack().w1.data), as_bytes(want.w1.data))
    experts.reshard()
    return "ok"


@pytest.mark.cpu
def test_gloo_expert_mlp_on_an_ep_mesh_shapes_and_refusals():
    assert run_ranks(ep_mesh_errors_worker, 2, backend="gloo") == ["ok"] * 2


def clip_main_grad_worker(rank, world):
    """ExpertMLP(accumulate_into_main_grad=True) (2 ranks, EP 2, reference backend): the experts' gradients live in
    main_grad (.grad stays None). grad_norm counts them (the norm equals that of the same step with plain .grad), the
    unnamed per-rank experts are refused as with .grad, and clip_grad_norm_ scales main_grad by the factor it scales the
    router's .grad by. Before: the experts were left out of the norm and never clipped. Returns the problems found."""
    hidden, inter, topk = 64, 32, 2
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(40, hidden, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(4 * world, generator=gen)[:topk] for _ in range(40)])
    w = torch.softmax(torch.randn(40, topk, generator=gen), -1)
    problems = []
    with ep_comm.Buffer(None, hidden=hidden, num_experts=4 * world, num_topk=topk, max_tokens_per_rank=48,
                        expert_alignment=32, backend="reference") as buf, training.GradBuffers.create(buf) as grads:
        norms = []
        for main_grad in (False, True):
            router = torch.nn.Linear(hidden, hidden).bfloat16()
            with torch.no_grad():
                for i, p in enumerate(router.parameters()):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(50 + i)))
            mlp = training.ExpertMLP(4, hidden, inter, seed=3, ep_rank=rank, accumulate_into_main_grad=main_grad)
            if main_grad:
                for p in (mlp.w1, mlp.w2):
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            routed = training.dispatch(buf, grads, router(x), idx, w)
            training.combine(mlp(routed), routed).float().square().sum().backward()
            for p in router.parameters():  # (replicated, as DDP keeps it)
                dist.all_reduce(p.grad)
            params = list(router.parameters()) + list(mlp.parameters())
            experts = list(mlp.parameters())
            if main_grad:
                if mlp.w1.grad is not None:
                    problems.append("accumulate_into_main_grad left a .grad")
                try:
                    training.grad_norm(params)
                    problems.append("unnamed per-rank experts with main_grad not refused")
                except ValueError as error:
                    if "in parameters but not in expert_parameters" not in str(error):
                        problems.append(f"unexpected refusal: {error}")
            norms.append(training.grad_norm(params, expert_parameters=experts, ep_group=dist.group.WORLD))
            if main_grad:
                before = [t.clone() for t in (mlp.w1.main_grad, mlp.w2.main_grad, router.weight.grad)]
                total = training.clip_grad_norm_(params, 1e-3, expert_parameters=experts, ep_group=dist.group.WORLD)
                coef = 1e-3 / (total + 1e-6)
                for old, new, name in zip(before, (mlp.w1.main_grad, mlp.w2.main_grad, router.weight.grad),
                                          ("w1.main_grad", "w2.main_grad", "router grad")):
                    want = old * coef.to(old.dtype)
                    if not torch.allclose(new.float(), want.float(), rtol=1e-2, atol=0):
                        problems.append(f"{name} not scaled by the clip factor")
        # The same gradients as values (main_grad is FP32 of what .grad held in FP32 masters): the same norm.
        if not torch.allclose(norms[0], norms[1], rtol=1e-5):
            problems.append(f"norm with main_grad {norms[1].item()} != with .grad {norms[0].item()}")
    return problems


@pytest.mark.cpu
def test_gloo_clip_grad_norm_counts_main_grad():
    _check(run_ranks(clip_main_grad_worker, 2, backend="gloo"))


def compiled_norm_worker(rank, world):
    """grad_norm inside torch.compile (2 gloo ranks, a named expert): run eagerly (a graph break around it), the eager
    bits; fullgraph=True raises at compile time, as around the library's other entry points. Before: dynamo traced it
    and its gather of 0-dim norms raised on every rank."""
    import torch._dynamo
    r = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
    r.grad = torch.ones(4, 4)
    e = torch.nn.Parameter(torch.randn(3, 4))
    e.grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    eager = training.grad_norm([r, e], expert_parameters=[e], ep_group=dist.group.WORLD)
    problems = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda ps: training.grad_norm(ps, expert_parameters=[e], ep_group=dist.group.WORLD) * 1,
                             backend="eager")
    got = compiled([r, e])
    if not torch.equal(got, eager):
        problems.append(f"compiled {got.item()} != eager {eager.item()}")
    torch._dynamo.reset()
    try:
        torch.compile(lambda ps: training.grad_norm(ps, expert_parameters=[e], ep_group=dist.group.WORLD),
                      fullgraph=True, backend="eager")([r, e])
        problems.append("fullgraph=True did not raise")
    except Exception as error:  # noqa: BLE001 (dynamo's error type varies between torch versions)
        if "skip" not in str(error).lower() and "disable" not in str(error).lower():
            problems.append(f"fullgraph=True raised something else: {type(error).__name__}: {str(error)[:200]}")
    return problems


@pytest.mark.cpu
def test_gloo_grad_norm_runs_eagerly_inside_torch_compile():
    _check(run_ranks(compiled_norm_worker, 2, backend="gloo"))
