"""Pencil transposes for the distributed FFT problems (PhysicsNeMo ``distributed_transpose``).

A pencil transpose swaps which of two axes is split over the ranks: every rank cuts its block along
the axis that becomes split into W chunks, sends chunk d to rank d, and concatenates what it receives
along the axis that becomes whole. Complex blocks travel as real pairs (gloo has no complex dtype).
Also upstream's inputs of both problems: one field drawn whole on every rank, each rank keeping its slab.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problem import upstream_seed


def transpose(block: torch.Tensor, split_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """``block`` is whole along ``split_dim`` (its size divisible by W) and split along ``gather_dim``;
    returns the block split along ``split_dim`` and whole along ``gather_dim`` (rank order)."""
    world_size = dist.get_world_size(group)
    split_dim, gather_dim = split_dim % block.dim(), gather_dim % block.dim()
    chunks = torch.stack(block.chunk(world_size, dim=split_dim))  # [W, ...]
    is_complex = chunks.is_complex()
    send = torch.view_as_real(chunks).contiguous() if is_complex else chunks.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    recv = torch.view_as_complex(recv) if is_complex else recv
    return torch.cat(recv.unbind(0), dim=gather_dim)


def upstream_field(upstream_id: int, shape, trial: int, device) -> torch.Tensor:
    """Upstream's whole fp32 field [*shape] of N(0, 1) values, the same on every rank: its factory seeds every
    rank as rank 0 (``upstream_seed(upstream_id, 0, trial)``) and draws the global field, then slices it."""
    upstream_seed(upstream_id, 0, trial)
    return torch.randn(tuple(shape), dtype=torch.float32, device=device)


def rank_slab(field: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Slab ``rank`` of ``field`` along ``dim`` (W equal slabs in rank order), contiguous."""
    size = field.shape[dim] // world_size
    return field.narrow(dim, rank * size, size).contiguous()
