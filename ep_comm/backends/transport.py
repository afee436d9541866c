"""Which torch.distributed backend carries which device's tensors in a process group."""
from __future__ import annotations

import torch.distributed as dist


def device_backends(group) -> dict:
    """{device type: backend name} of `group`, e.g. {"cpu": "gloo", "cuda": "nccl"}.

    Read from dist.get_backend_config(group) ("cpu:gloo,cuda:nccl"), not dist.get_backend: a group made by
    init_process_group() without a backend reports "undefined" there, although torch gave it gloo on a CPU machine
    and NCCL where there is a GPU. A plain name (torch without get_backend_config) maps gloo to cpu and nccl to cuda."""
    try:
        config = str(dist.get_backend_config(group)).lower()
    except AttributeError:
        config = str(dist.get_backend(group)).lower()
    backends = {}
    for part in config.split(","):
        device, _, name = part.strip().rpartition(":")
        if device:
            backends[device] = name
        elif name == "gloo":
            backends["cpu"] = name
        elif name == "nccl":
            backends["cuda"] = name
    return backends


def describe(group) -> str:
    """The group's backends for messages ("cpu:gloo", "cuda:nccl", ...)."""
    return ",".join(f"{device}:{name}" for device, name in device_backends(group).items()) or "no known backend"


def group_global_ranks(group) -> tuple:
    """The global ranks of `group`'s processes in group-rank order."""
    return tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))


def check_handle_group(handle_ranks: tuple, own_ranks: tuple) -> None:
    """ValueError unless a dispatch handle made on a group of `handle_ranks` (group_global_ranks; empty: not recorded)
    fits a Buffer whose group has `own_ranks`: a handle names peers by group rank, so a group of the same processes in
    another order would send its rows to other processes."""
    if handle_ranks and handle_ranks != own_ranks:
        raise ValueError(f"combine got the handle of a dispatch on another process group (global ranks "
                         f"{list(handle_ranks)} in group-rank order; this Buffer's group: {list(own_ranks)}): pass "
                         f"the handle to the Buffer that dispatched it")
