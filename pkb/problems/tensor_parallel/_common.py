"""Helpers shared by the tensor-parallel problems: dtypes, sharded sizes, gathers along a dimension.

Sizes in cases are global (``tokens``, ``hidden``, ``vocab``...); a rank's share is ``size // W`` and
a case whose sizes a world size does not divide lists the world sizes it runs at.

Precision: the inputs that upstream's factory builds from its ``dtype`` argument are built in the
run's precision (``case["dtype"]``, which the harness sets on every case: bf16 by default, as
upstream's ``--dtype``), in every case kind; where a module's docstring says bf16 for them, that is
the default. Dtypes that belong to the function stay fixed (int64 ids and targets, fp32 scales, and
the inputs upstream's factory makes bf16 whatever its ``dtype``: 84's grad_output, 86's x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def dtype_of(case, key: str = "dtype") -> torch.dtype:
    """The run's precision (``case["dtype"]``; bf16 for a case read outside a run)."""
    return getattr(torch, case.get(key, "bfloat16"))


def itemsize(case, key: str = "dtype") -> int:
    return dtype_of(case, key).itemsize


def local_size(case, key: str, world_size: int) -> int:
    """A rank's share of the sharded size ``key``: ``case[key + "_per_rank"]`` where the case fixes the
    share (the upstream factory fixes per-rank shapes, e.g. ``k_per_rank`` 512 at every W), else
    ``case[key] // world_size``."""
    per_rank = case.get(f"{key}_per_rank")
    return per_rank if per_rank is not None else case[key] // world_size


def global_size(case, key: str, world_size: int) -> int:
    """The whole size ``key`` across ranks: ``case[key]``, or the fixed per-rank share times W."""
    per_rank = case.get(f"{key}_per_rank")
    return per_rank * world_size if per_rank is not None else case[key]


def upstream_randn(case, device, *shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One ``torch.randn(shape)`` per shape, in order, in the run's dtype on ``device``, from the global
    generators: the draws of most of upstream's factory branches (``upstream_inputs``)."""
    return tuple(torch.randn(shape, dtype=dtype_of(case), device=device) for shape in shapes)


def upstream_targets(batch: int, seq: int, vocab: int, step: int, offset: int, trial: int, device) -> torch.Tensor:
    """Upstream's fixed targets [batch, seq] int64 (no draw): flat token t gets ``(t * step + offset + trial) %
    vocab``; ``step`` and ``offset`` are each problem's constants in upstream's factory."""
    token_ids = torch.arange(batch * seq, dtype=torch.long, device=device)
    return (token_ids * step + offset + trial).remainder(vocab).reshape(batch, seq)


def divides_all(*sizes: int, world_sizes=(2, 4, 8)) -> tuple[int, ...]:
    """The world sizes among ``world_sizes`` that divide every one of ``sizes``."""
    return tuple(w for w in world_sizes if all(size % w == 0 for size in sizes))


def all_gather_cat(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (one all_gather_into_tensor).

    The output is gathered flat ([W * numel], which gloo needs) and the rank axis is then moved next
    to ``dim`` and merged into it.
    """
    world_size = dist.get_world_size(group)
    flat = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(flat, tensor.contiguous().view(-1), group=group)
    stacked = flat.view(world_size, *tensor.shape)
    shape = list(tensor.shape)
    shape[dim] *= world_size
    return stacked.movedim(0, dim).reshape(shape)


def all_gather_list_cat(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The same as ``all_gather_cat`` through the list form of all-gather (as Megatron's gather does)."""
    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
