"""Backends: `reference` (torch.distributed all_to_all_single, gloo or NCCL) and `nvlink` (fused kernels
writing into peers' symmetric memory)."""
