"""Gradient clipping by the global norm for models with expert-parallel experts: `training.clip_grad_norm_`, and the
norm alone: `training.grad_norm`.

torch.nn.utils.clip_grad_norm_ assumes that every rank holds the same parameters, or DTensors of one device mesh. A
model with expert parallelism holds neither, and torch's function fails or, worse, clips each rank by its own norm
(seen with torch 2.13 on 2 and 4 CPU ranks, tests/test_trainer_wrappers.py):
* experts as plain per-rank parameters (ExpertMLP without ep_mesh) under DDP: each rank's norm counts its own experts
  only, so the EP ranks clip by different factors and the replicated parameters (the router) drift apart, silently;
* FSDP2 (`fully_shard(experts, mesh=mesh["dp"])` inside `fully_shard(model, <every rank>)`), with or without
  ep_mesh: the experts' DTensors and the rest live on different meshes, and torch.stack of their norms raises;
* DDP with ExpertMLP(ep_mesh=...): DTensor experts beside plain tensors, which torch's foreach norm refuses.

`clip_grad_norm_` computes the norm of the whole model's gradient, each distinct parameter counted once, the same
value on every rank, and scales every gradient by the same factor. What each kind of gradient contributes:
* a DTensor (FSDP2's parameters, ExpertMLP(ep_mesh=...)'s experts): its whole value's norm, by its own placement
  (its local shards' parts gathered over each mesh dimension it is sharded along; replicated dimensions hold copies);
* a plain tensor named in `expert_parameters` (this rank's own experts, not DTensors over the EP group): summed over
  `ep_group`, the ranks that hold the layer's other experts; a DTensor named there (the experts sharded by FSDP2 over
  "dp" only) likewise, after its own reduction. An ExpertMLP's weights without ep_mesh must be named there (refused
  otherwise, once it has run a forward over an EP group of more than one rank);
* any other plain tensor: replicated, the same on every rank (what DDP keeps), counted as it is.
With pipeline parallelism each rank holds its stages' parameters (several model chunks under an interleaved schedule:
pass them all in one call): `pp_group` (the ranks that hold the other stages at this rank's place, one per pipeline
rank) sums the stages' parts, so the norm is the whole model's on every stage, as TorchTitan sums its stages' norms
before clipping (torch's function, again, sees one stage only).
Every reduction gathers the ranks' values and combines them in rank order, so every rank gets the same bits (an
all-reduce may add in another order in each communicator, and a MAX all-reduce may drop a NaN). One `ep_group` for
all the named experts: a model whose layers split their experts over different groups is not covered. Norms of BF16
gradients are taken in BF16, as torch takes them. `grad_norm` gives the same norm without scaling anything (for
logging: clipping with max_norm = inf would still multiply every gradient by 1).
A parameter whose .grad is None but that has a `main_grad` tensor (Megatron's convention, and
ExpertMLP(accumulate_into_main_grad=True)'s: the backward adds into main_grad) contributes its main_grad, and
clip_grad_norm_ scales that main_grad.
Both run eagerly inside a compiled model (a graph break around each call), as the library's other entry points.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch

from ._compile import eager_only
from .training_experts import _EXPERT_MLPS, _is_dtensor, _local


def _gradient_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """p's gradient: p.grad, or, where that is None, a `main_grad` tensor (Megatron's convention, which
    ExpertMLP(accumulate_into_main_grad=True) follows: the backward adds into main_grad and leaves .grad None), else
    None."""
    if p.grad is not None:
        return p.grad
    main_grad = getattr(p, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else None


def _mesh_ranks(mesh) -> set:
    return set(mesh.mesh.flatten().tolist())


def _local_part(grads: list, norm_type: float, foreach: Optional[bool], device) -> torch.Tensor:
    """This rank's part of a list of gradients (DTensors: their local shards) as a float64 scalar on `device`: the
    sum of |x|^p, or for p = inf the max |x| (NaN kept; 0 without elements)."""
    local = [t for t in map(_local, grads) if t.numel() > 0]  # (an empty shard: no inf norm of an empty tensor)
    if not local:
        return torch.zeros((), dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm(local, norm_type, False, foreach).to(device, torch.float64)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def _combine_over(value: torch.Tensor, group, infinite: bool) -> torch.Tensor:
    """value (a float64 scalar part) of every rank of `group`, gathered and combined in rank order -- summed, or the
    max for p = inf -- so that every rank gets the same bits and a NaN anywhere stays NaN."""
    import torch.distributed as dist
    size = dist.get_world_size(group)
    if size == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(parts, value.contiguous(), group=group)
    stacked = torch.stack(parts)
    return stacked.amax() if infinite else stacked.sum()


def _dtensor_part(grads: list, mesh, placements, norm_type: float, foreach: Optional[bool], device) -> torch.Tensor:
    """The part of DTensor gradients of one mesh and placement: local shards' parts combined over each mesh
    dimension they are sharded along (replicated dimensions hold copies: counted once)."""
    infinite = math.isinf(norm_type)
    value = _local_part(grads, norm_type, foreach, device)
    for dim, placement in enumerate(placements):  # (no Partial placement: _check_groups refused it)
        # (every placement but Replicate spreads distinct elements over the dimension: Shard, and FSDP2's
        # _StridedShard over an already sharded DTensor, for which is_shard() is False in torch 2.13)
        if not placement.is_replicate():
            value = _combine_over(value, mesh.get_group(dim), infinite)
    return value


def _check_per_rank_experts_named(param_ids: set, expert_ids: set, what: str) -> None:
    """Refuses the weights of an ExpertMLP without ep_mesh (this rank's own experts; as FSDP2's DTensors over "dp"
    too) among `parameters` but not in expert_parameters, once the module has run over an EP group of more than one
    rank: counted as replicated they would make each EP rank's norm its own, silently. (Experts replicated over the
    ranks, EP groups of one rank, are counted as they are.)"""
    for module in list(_EXPERT_MLPS):
        if module.ep_mesh is not None or getattr(module, "_ep_group_size", 1) <= 1:
            continue
        for w in (module.w1, module.w2):
            if id(w) in param_ids and id(w) not in expert_ids:
                raise ValueError(f"{what}: an ExpertMLP's weight (this rank's own experts: ExpertMLP without "
                                 "ep_mesh, run over an EP group of more than one rank) is in parameters but not in "
                                 "expert_parameters; name every such layer's experts there, e.g. "
                                 "expert_parameters=layer.experts.parameters(), with ep_group (the Buffer's group), "
                                 "or make them with ep_mesh")


def _group_ranks(group) -> set:
    import torch.distributed as dist
    return set(dist.get_process_group_ranks(group))


def _check_groups(grads: list, experts: list, ep_group, pp_group, what: str) -> None:
    """The refusals of gradients and groups that would be counted wrongly: a DTensor gradient with a Partial placement;
    ep_mesh DTensors named as per-rank experts; with pp_group, an ep_group or a DTensor's mesh that shares a rank other
    than this one with it (that part would be counted once per stage). Not detected (it would need a collective): a
    pp_group that also holds data-parallel replicas of this rank's stage, which counts their parts once per replica."""
    import torch.distributed as dist
    me = dist.get_rank() if ep_group is not None or pp_group is not None else None
    pp_ranks = _group_ranks(pp_group) if pp_group is not None else None
    for grad in (g for g in grads if _is_dtensor(g)):
        if any(placement.is_partial() for placement in grad.placements):
            raise ValueError(f"{what}: a gradient is a DTensor with a Partial placement (its values still to be summed "
                             "over ranks): reduce it first")
        if pp_ranks is not None and _mesh_ranks(grad.device_mesh) & pp_ranks != {me}:
            raise ValueError(f"{what}: a gradient is a DTensor whose mesh also holds another rank of pp_group (another "
                             "pipeline stage): each stage's parameters must live on meshes of that stage's ranks")
    if ep_group is not None:
        ep_ranks = _group_ranks(ep_group)
        for p in experts:
            if _is_dtensor(p) and _mesh_ranks(p.device_mesh) & ep_ranks != {me}:
                raise ValueError(f"{what}: a DTensor of expert_parameters is spread over other ranks of "
                                 "ep_group already (ExpertMLP(ep_mesh=...)'s weights): leave it out of "
                                 "expert_parameters, its norm covers every expert")
    if pp_ranks is None:
        return
    if me not in pp_ranks:
        raise ValueError(f"{what}: this rank is not in pp_group")
    if ep_group is not None and _group_ranks(ep_group) & pp_ranks != {me}:
        raise ValueError(f"{what}: ep_group and pp_group share ranks other than this one; pp_group holds one rank "
                         "per pipeline stage, ep_group the ranks of this stage that split its experts")


def _device_of(grads: list, params: list, groups) -> torch.device:
    """Where the reductions run: the first gradient's device, else the first parameter's; for a rank without
    parameters, the current CUDA device where a group is NCCL's (its collectives need CUDA tensors), else the CPU."""
    import torch.distributed as dist
    if grads:
        return grads[0].device
    if params:
        return params[0].device
    if any(g is not None and "nccl" in str(dist.get_backend(g)) for g in groups) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_on_refusal(refusal: Optional[ValueError], pp_group, what: str) -> None:
    """Raises on every rank of pp_group if any of them refused its arguments: its own refusal, or one naming the
    ranks that refused, with the first one's reason (the reasons gathered as objects, as the nvlink backend's setup
    agrees on its failures)."""
    import torch.distributed as dist
    reasons = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(reasons, None if refusal is None else str(refusal), group=pp_group)
    if refusal is not None:
        raise refusal
    refused = [(rank, why) for rank, why in zip(dist.get_process_group_ranks(pp_group), reasons) if why is not None]
    if refused:
        raise ValueError(f"{what}: the pipeline stage of rank(s) {[rank for rank, _ in refused]} (pp_group) refused "
                         f"its arguments; rank {refused[0][0]}: {refused[0][1]}")


def _total_norm(parameters, norm_type, expert_parameters, ep_group, pp_group, error_if_nonfinite, foreach,
                what: str) -> tuple:
    """(total: the float32 scalar norm, grads: every gradient counted, in the parameters' order), grad_norm's
    computation (its docstring), shared with clip_grad_norm_; `what` names the caller in errors."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = list({id(p): p for p in params}.values())  # (each parameter once, in its first place)
    experts = [expert_parameters] if isinstance(expert_parameters, torch.Tensor) else list(expert_parameters)
    expert_ids = {id(p) for p in experts}
    # (each parameter with a gradient, and that gradient, looked up once: .grad, else main_grad)
    param_grads = [(p, g) for p in params for g in (_gradient_of(p),) if g is not None]
    device = _device_of([g for _, g in param_grads], params, (ep_group, pp_group))
    try:
        norm_type = float(norm_type)
        if not (norm_type > 0.0):
            raise ValueError(f"{what}: norm_type must be > 0 or inf, got {norm_type}")
        if not expert_ids <= {id(p) for p in params}:
            raise ValueError(f"{what}: every tensor of expert_parameters must also be in parameters")
        if experts and ep_group is None:
            raise ValueError(f"{what}: expert_parameters needs ep_group, the group the experts are split over "
                             "(the Buffer's group)")
        _check_per_rank_experts_named({id(p) for p, _ in param_grads}, expert_ids, what)
        _check_groups([g for _, g in param_grads], experts, ep_group, pp_group, what)
        refusal = None
    except ValueError as error:
        refusal = error
    # The ranks of one stage hold the same parameters and arguments, so they refuse alike; the stages do not, and a
    # stage that refused alone would leave the others waiting in the gathers below: with pp_group every stage learns
    # of any refusal first (one small gather, a host synchronization).
    if pp_group is not None:
        _agree_on_refusal(refusal, pp_group, what)
    elif refusal is not None:
        raise refusal

    # The gradients by kind, in the parameters' order (the same on every rank, so the reductions match):
    # (in expert_parameters, the DTensor mesh and placements, or None) -> gradients.
    groups: dict = {}
    for p, grad in param_grads:
        layout = (grad.device_mesh, tuple(grad.placements)) if _is_dtensor(grad) else None
        groups.setdefault((id(p) in expert_ids, layout), []).append(grad)
    grads = [g for gs in groups.values() for g in gs]

    # Each kind's part (sum of |x|^p, or max |x|) over the ranks that hold its pieces, summed (max) over the kinds; the
    # named experts' also over ep_group, the stage's over pp_group. (float64: the p-th power of a float32 norm can
    # overflow float32.)
    infinite = math.isinf(norm_type)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    own_experts = torch.zeros((), dtype=torch.float64, device=device)
    for (is_expert, layout), gs in groups.items():
        part = _local_part(gs, norm_type, foreach, device) if layout is None \
            else _dtensor_part(gs, *layout, norm_type, foreach, device)
        if is_expert:
            own_experts = torch.maximum(own_experts, part) if infinite else own_experts + part
        else:
            replicated = torch.maximum(replicated, part) if infinite else replicated + part
    if ep_group is not None:
        own_experts = _combine_over(own_experts, ep_group, infinite)
    stage = torch.maximum(replicated, own_experts) if infinite else replicated + own_experts
    if pp_group is not None:
        stage = _combine_over(stage, pp_group, infinite)
    total = (stage if infinite else stage.pow(1.0 / norm_type)).float()
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"{what}: the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}; error_if_nonfinite=False goes on with it)")
    return total, grads


@eager_only  # (its gathers of 0-dim norms cannot be traced: dynamo's functional all_gather raised on them)
@torch.no_grad()
def grad_norm(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], norm_type: float = 2.0, *,
              expert_parameters: Iterable[torch.Tensor] = (), ep_group=None, pp_group=None,
              error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm of the whole model's gradient (module docstring), the value clip_grad_norm_ returns, without scaling
    any gradient: a float32 scalar tensor (not a DTensor), the same bits on every rank, on the gradients' device.

    parameters: every parameter of the model (with pp_group: every parameter this rank holds, all its model chunks'
    under an interleaved schedule, in one call; an iterable of tensors or DTensors, or one tensor; a tensor listed
    twice counts once), in the same order on every rank of a stage, with gradients on the same ones (the reductions
    are collective: a rank that differs waits). expert_parameters: those of them that are
    this rank's own experts as plain parameters (`ExpertMLP` without `ep_mesh`: `layer.experts.parameters()` of every
    such layer, also when FSDP2 shards them over "dp"; refused if left out); leave out ExpertMLP(ep_mesh=...)'s
    weights, whose DTensors already span the EP group (refused). ep_group: the Buffer's group (the ranks over which
    the experts are split); needed with expert_parameters; given, every rank of it makes one gather over it.
    pp_group: with pipeline parallelism, the ranks that hold the other stages at this rank's place (one per pipeline
    rank; refused where it shares a rank other than this one with ep_group or with a gradient's DTensor mesh; not
    detected: a pp_group that also holds data-parallel replicas of this stage, whose parts it would count once per
    replica); every rank of it makes two gathers over it: one that lets every stage raise when one refuses its
    arguments (a host synchronization), then the norm's. norm_type: p > 0 or inf. error_if_nonfinite: raise if the
    total is NaN or Inf (a host synchronization). foreach: for the norms, as torch's (None: its default per device). No
    other host synchronization (not tried inside a CUDA graph capture)."""
    return _total_norm(parameters, norm_type, expert_parameters, ep_group, pp_group, error_if_nonfinite, foreach,
                       "grad_norm")[0]


@eager_only
@torch.no_grad()
def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, *, expert_parameters: Iterable[torch.Tensor] = (), ep_group=None,
                    pp_group=None, error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for expert-parallel models (module docstring): scales every gradient of
    `parameters` in place by min(1, max_norm / (total + 1e-6)), total the norm of the whole model's gradient
    (`grad_norm`), and returns total: a float32 scalar tensor (not a DTensor), the same bits on every rank, on the
    gradients' device. The arguments are grad_norm's, and max_norm: a float (inf: every factor is 1).
    """
    total, grads = _total_norm(parameters, norm_type, expert_parameters, ep_group, pp_group, error_if_nonfinite,
                               foreach, "clip_grad_norm_")

    # One factor for every gradient (the local tensors of DTensors: their storage), one foreach multiply per device.
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict = {}
    for local in map(_local, grads):
        by_device.setdefault(local.device, []).append(local)
    for grad_device, locals_ in by_device.items():
        torch._foreach_mul_(locals_, clip_coef.to(grad_device))
    return total
