"""Helpers shared by the beyond-LLM problems: the run's dtype, variable-size exchanges, skewed splits, and
upstream's draws that several problems share.

The exchanges here are the plain c10d patterns the references are built from (sizes first, then the
payload), written once so every reference reads as its workload's steps, not as bookkeeping.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problem import DEFAULT_PRECISION, PRECISIONS


def dtype_of(case) -> torch.dtype:
    """The run's precision: ``case["dtype"]``, which the harness sets on every case it hands out (the
    default precision for a case read outside a run, e.g. its cost listed)."""
    name = case.get("dtype")
    return getattr(torch, name) if name else PRECISIONS[DEFAULT_PRECISION]


def all_gather_sizes(count: int, device, group=None) -> list[int]:
    """Every rank's ``count`` (an int), in rank order."""
    world_size = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    sizes = torch.empty(world_size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(sizes, mine, group=group)
    return sizes.tolist()


def all_gather_rows(rows: torch.Tensor, group=None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's ``rows`` (any number of rows, same trailing shape) in rank order.

    Sizes are gathered first; the payload is padded to the largest rank and gathered flat (gloo needs
    a flat output), then the padding is cut away. Returns (gathered rows, rows per rank).
    """
    sizes = all_gather_sizes(rows.shape[0], rows.device, group)
    most = max(max(sizes), 1)  # never an empty payload, even when every rank brings no rows
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = rows.new_empty(len(sizes) * padded.numel())
    dist.all_gather_into_tensor(gathered, padded.reshape(-1), group=group)
    gathered = gathered.view(len(sizes), most, *rows.shape[1:])
    return torch.cat([gathered[r, : sizes[r]] for r in range(len(sizes))]), sizes


def exchange_counts(send_counts: list[int], device, group=None) -> list[int]:
    """All-to-all of one int per peer: returns how many rows each peer will send to this rank."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """Send ``rows[sum(send_counts[:d]) : ...]`` to rank d; receive ``recv_counts[s]`` rows from rank s."""
    out = rows.new_zeros((sum(recv_counts), *rows.shape[1:]))  # zeros: a broken exchange stays harmless
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return out


def all_to_all_rows_rotated(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                            group=None) -> torch.Tensor:
    """``all_to_all_rows`` in GraphBolt's rank-rotated peer order: entry j of the counts, and chunk j of
    ``rows`` and of the result, belong to rank (rank + j) % W (entry 0 is this rank itself)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    entry_of = [(peer - rank) % world_size for peer in range(world_size)]
    send_chunks = rows.split(list(send_counts))
    received = all_to_all_rows(torch.cat([send_chunks[j] for j in entry_of]), [send_counts[j] for j in entry_of],
                               [recv_counts[j] for j in entry_of], group)
    recv_chunks = received.split([recv_counts[j] for j in entry_of])  # in peer order
    return torch.cat([recv_chunks[(rank + j) % world_size] for j in range(world_size)])


def skewed_counts(gen: torch.Generator, num: int, total_mean: int, num_empty: int = 0) -> list[int]:
    """``num`` counts drawn heavy-tailed around ``total_mean`` in all, ``num_empty`` of them zero (at most
    ``num - 1``).

    Drawn from ``gen`` (pass ``gen.shared`` where every rank must agree on them). The zeros sit at
    random places, so empty partitions land on varying ranks.
    """
    weights = torch.rand(num, generator=gen, device=gen.device).pow(3.0) + 0.02
    num_empty = min(num_empty, num - 1)  # at least one entry stays non-empty
    if num_empty:
        empty = torch.randperm(num, generator=gen, device=gen.device)[:num_empty]
        weights[empty] = 0.0
    counts = torch.floor(weights / weights.sum() * total_mean + 0.5).to(torch.int64)
    return counts.tolist()


def upstream_exchange(case, world_size: int, num_rows: int, dtype: torch.dtype, device) -> tuple:
    """Upstream's GraphBolt exchange draws (problems 65, 66; after its seed): rows [num_rows, dim] N(0, 1) in
    ``dtype``, then ``rows_per_rank`` seed_inverse_ids in [0, seed_size); rows_per_rank / W rows to and from
    every peer. Returns (rows, seed_inverse_ids, counts_sent, counts_received)."""
    rows = torch.randn((num_rows, case["dim"]), dtype=dtype, device=device)
    seed_inverse_ids = torch.randint(0, case["seed_size"], (case["rows_per_rank"],), dtype=torch.long, device=device)
    per_peer = case["rows_per_rank"] // world_size
    return rows, seed_inverse_ids, [per_peer] * world_size, [per_peer] * world_size
