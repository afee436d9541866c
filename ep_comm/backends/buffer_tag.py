"""Buffer tags: a number every rank of a Buffer agrees on at creation, carried in each dispatch handle, so that a
combine can tell apart the handles of two Buffers with the same sizes and call counts (two MoE layers, one dispatch
each per step). The nvlink layout kernel writes it next to the dispatch epoch (csrc/nvlink.h dispatch_word); the
reference backend puts it into ReferenceHandle.dispatch_id. Both compare it across the ranks of a combine."""

from __future__ import annotations

import itertools
import os
import secrets
import threading

import torch.distributed as dist

BUFFER_TAG_BITS = 22  # csrc/nvlink.h kBufferTagBits (ep_comm._C.nvlink_buffer_tag_bits)
DISPATCH_COUNT_BITS = 40  # the call count's share below the tag: csrc/nvlink.h kDispatchEpochBits

_lock = threading.Lock()
_next_tags = None  # this process's tag counter (as group rank 0): drawn on first use, drawn again after a fork


def _reset_in_child() -> None:
    """After a fork: a fresh lock (another thread may have held the parent's at the fork) and a fresh start (the
    parent's sequence would give parent and child the same tags)."""
    global _lock, _next_tags
    _lock = threading.Lock()
    _next_tags = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def next_buffer_tag() -> int:
    """This process's next tag: successive values (mod 2^22) from a random start drawn in this process."""
    global _next_tags
    with _lock:
        if _next_tags is None:
            _next_tags = itertools.count(secrets.randbits(BUFFER_TAG_BITS))
        return next(_next_tags) % (1 << BUFFER_TAG_BITS)


def agree_buffer_tag(group) -> int:
    """The tag of a new Buffer: group rank 0's next one, the same on every rank (one all_gather_object over `group`,
    so every rank must call it, in the same order as its other collectives). Buffers whose group rank 0 is the same
    process get successive tags from a random start, others random ones (two Buffers collide with probability
    2^-22 at worst)."""
    mine = next_buffer_tag()
    votes = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, mine, group=group)
    return int(votes[0])

