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
