"""Symmetric memory: a buffer every rank allocates at once, whose peers' copies a kernel can read and write.

A thin layer over ``torch.distributed._symmetric_memory`` that works the same in ``cuda`` mode
(NCCL group, one GPU per rank) and ``shared-gpu`` mode (gloo group, several ranks on one GPU, with
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` set by the harness). Multicast is never used.

Every call here that allocates is collective: all ranks call it in the same order with the same
shape and dtype. Allocate once (e.g. cached by shape at module level), not on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SymmetricBuffer:
    """One rank's view of a symmetric allocation.

    local: this rank's buffer as a tensor.  buffer_ptrs_dev: address of a device array of W pointers
    (uint64), one per rank's buffer.  signal_pad_ptrs_dev: the same for the per-rank signal pads.
    """

    local: torch.Tensor
    handle: object
    rank: int
    world_size: int

    @property
    def buffer_ptrs(self) -> list[int]:
        return list(self.handle.buffer_ptrs)

    @property
    def buffer_ptrs_dev(self) -> int:
        return int(self.handle.buffer_ptrs_dev)

    @property
    def signal_pad_ptrs_dev(self) -> int:
        return int(self.handle.signal_pad_ptrs_dev)

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer, with this buffer's shape and dtype (reads and writes go over NVLink)."""
        return self.handle.get_buffer(rank, tuple(self.local.shape), self.local.dtype)

    def barrier(self, channel: int = 0) -> None:
        """A barrier among the ranks, run on the current CUDA stream (no host synchronisation)."""
        self.handle.barrier(channel=channel)


def symmetric_buffer(shape, dtype: torch.dtype, device: torch.device | None = None,
                     group: dist.ProcessGroup | None = None) -> SymmetricBuffer:
    """Allocate a symmetric buffer of ``shape`` and ``dtype`` on this rank's GPU and rendezvous it."""
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    device = device or torch.device("cuda", torch.cuda.current_device())
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch releases, harmless on newer ones
        enable(group.group_name)
    local = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, group.group_name)
    return SymmetricBuffer(local, handle, handle.rank, handle.world_size)
