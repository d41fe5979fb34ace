"""Row-wise sharded embedding lookup (torchrec row-wise sharding, DLRM style).

The table [W * rows_per_shard, D] is split into equal row blocks: rank r owns global rows
r*rows_per_shard ... (r+1)*rows_per_shard - 1 as ``local_shard``. Every rank has its own batch of
query ids; each id goes to its owner, the owner looks the row up, and the row comes back.

Per rank: indices [n_r] int64 in [0, W*rows_per_shard) (this rank's queries; n_r may differ per
rank and be 0), local_shard [rows_per_shard, D]  ->  [n_r, D] (bit-exact), the looked-up rows in
the order they come back: grouped by owner rank (owner 0 first), and within one owner in query
order. That is table[indices[order]] with order the stable sort of the ids by owner; the rows are
not put back into query order (the upstream reference returns them this way).

Reference: bucket the ids by owner (stable sort), exchange the per-owner counts (all-to-all), the ids
(all-to-all with those splits), look them up locally, send the rows back (all-to-all).
The split sizes come to the host (.tolist()), as torchrec's input dist does; a kernel may avoid that.

Cost per rank, for ids spread evenly over owners (n = the case's ids per rank): (W-1)/W of the ids
(8 bytes each) leave the rank and (W-1)/W of the rows (D * itemsize each) come back, plus W counts:
link bytes (W-1)/W * n * (8 + D*itemsize) + 8*W. No flops. HBM: read the ids, read the n looked-up
rows from the table, write n rows: n*8 + 2*n*D*itemsize.

Cases: ``rows`` is the whole table, or ``rows_per_rank`` the shard. ``distribution`` "uniform" draws
ids over the whole table; "skewed" sends every id to rank 0's shard (the other owners receive
nothing); ``ragged`` gives rank r ``num_ids + r`` ids (rank 0: 0 ids when num_ids is 0). A rank
that neither sends nor receives an id skips the exchanges in the upstream reference (NCCL allows
it, gloo does not), so every case gives each rank something to send or to receive.
``upstream`` is the upstream factory: 1024 uniform ids per rank, shards [1024, 1024] bf16.
Benchmarks: a DLRM/Criteo-style table (D 128, 4M rows per shard, 64K ids per rank) and a Llama-3 8B
token embedding (vocab 128256 rows of 4096, 8192 tokens per rank).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.tensor_parallel._common import divides_all, dtype_of, itemsize, local_size


def make_inputs(case, rank, world_size, gen):
    rows_per_shard = local_size(case, "rows", world_size)
    num_ids = case["num_ids"] + (rank if case.get("ragged") else 0)
    high = rows_per_shard if case.get("distribution") == "skewed" else world_size * rows_per_shard
    indices = torch.randint(0, high, (num_ids,), generator=gen, device=gen.device, dtype=torch.int64)
    return indices, randn(gen, rows_per_shard, case["dim"], dtype=dtype_of(case))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): the shard [1024, 1024] N(0, 1) first, then 1024 ids uniform over the
    whole table (randint)."""
    rows_per_shard = local_size(case, "rows", world_size)
    local_shard = torch.randn((rows_per_shard, case["dim"]), dtype=dtype_of(case), device=device)
    indices = torch.randint(0, world_size * rows_per_shard, (case["num_ids"],), dtype=torch.long, device=device)
    return indices, local_shard


def reference(indices, local_shard):
    world_size = dist.get_world_size()
    rows_per_shard, dim = local_shard.shape
    owner = torch.div(indices, rows_per_shard, rounding_mode="floor")
    send_ids = indices[torch.sort(owner, stable=True).indices]  # grouped by owner, query order within
    send_counts = torch.bincount(owner, minlength=world_size).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    recv_ids = torch.empty(sum(recv_splits), dtype=indices.dtype, device=indices.device)
    dist.all_to_all_single(recv_ids, send_ids, recv_splits, send_splits)
    rows = local_shard[recv_ids % rows_per_shard]  # every received id is owned here: id - rank*rows_per_shard

    out = torch.empty(indices.numel(), dim, dtype=local_shard.dtype, device=local_shard.device)
    dist.all_to_all_single(out, rows.contiguous(), send_splits, recv_splits)
    return out  # rows in send order (by owner), as they come back


def cost(case, world_size):
    n, dim, size = case["num_ids"], case["dim"], itemsize(case)
    return Cost(link_bytes=(world_size - 1) / world_size * n * (8 + dim * size) + 8 * world_size,
                hbm_bytes=n * 8 + 2 * n * dim * size, pattern="all_to_all (variable splits)")


PROBLEM = Problem(
    name="embedding_lookup", version=2, upstream_id=10, category="tensor_parallel",
    source="torchrec row-wise sharded EmbeddingCollection (input dist, lookup, output dist)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"rows_per_rank": 1024, "dim": 1024, "num_ids": 1024},
                   note="the upstream factory: 1024 ids per rank over the whole table, shards [1024, 1024]")],
    tests=[
        Case("odd_uniform", {"rows": 8 * 37, "dim": 19, "num_ids": 53}, tags=("odd_sizes",)),
        Case("ragged_uniform", {"rows": 8 * 5, "dim": 8, "num_ids": 1, "ragged": True},
             note="rank r queries 1 + r ids over the whole table", tags=("uneven_sizes", "tiny")),
        Case("empty_rank_skewed_to_rank0", {"rows": 8 * 5, "dim": 8, "num_ids": 0, "ragged": True,
                                            "distribution": "skewed"},
             note="rank r queries r ids, all on rank 0's shard: rank 0 sends nothing, the others receive nothing",
             tags=("empty_rank", "skewed", "uneven_sizes", "tiny")),
        Case("skewed_to_rank0", {"rows": 8 * 11, "dim": 33, "num_ids": 17, "distribution": "skewed"},
             note="every id lives on rank 0; the other owners get empty splits",
             tags=("skewed", "uneven_sizes", "odd_sizes")),
    ],
    benchmarks=[
        Case("dlrm_d128_4m_rows_per_shard", {"rows": 8 * (1 << 22), "dim": 128, "num_ids": 65536},
             note="rows given for W=8; at W=2/4 the shards are larger"),
        Case("llama3_8b_token_embedding", {"rows": 128256, "dim": 4096, "num_ids": 8192},
             world_sizes=divides_all(128256)),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
