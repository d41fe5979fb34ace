"""Sparse-embedding exchange (DGL / GraphStorm distributed sparse embeddings): route (id, value) pairs
to the rank that owns each id, owner = id % W.

Per rank: idx [n] int64 in [0, num_nodes) (n differs per rank, may be 0; owners skewed, some ranks
own none of a rank's ids), value [n, D] (the run's precision, bf16 by default; a gradient or embedding
row per id), num_nodes int, group=None (the default group)
  ->  (recv_idx [m] int64, recv_value [m, D]): the pairs every rank sent here, rank 0's first, and
      from each rank in the order they appear in its idx (a stable sort by owner). Bit-exact.

Cost: a rank sends its n pairs, (W-1)/W of them to other ranks: link = (W-1)/W * n*(8 + D*b) with n
the mean pairs per rank. HBM: the permutation and the exchange read and write the pairs twice:
4*n*(8 + D*b).

Cases: ``upstream`` is the upstream benchmark's input (idx [1024] in [0, 100000), value [1024, 128]).
Benchmarks: GraphStorm learnable node embeddings on ogbn-papers100M (111,059,956 nodes): a
mini-batch of 1024 seeds with fanout (15, 10) touches about 150k distinct nodes per rank; their
gradient rows (128-d) are pushed to the owners (``papers100m_emb128``); ``mag240m_emb768`` is the
same push with MAG240M's 768-d features for 40k nodes.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import all_to_all_rows, dtype_of, exchange_counts, skewed_counts


def make_inputs(case, rank, world_size, gen):
    num_ids = case["ids_per_rank"]
    if not case.get("even", False):
        num_ids = skewed_counts(gen.shared, world_size, num_ids * world_size, case.get("num_empty", 0))[rank]
    # Skewed owners: each rank sends most of its ids to a few owners and none to some.
    owner_weights = torch.rand(world_size, generator=gen, device=gen.device).pow(4)
    owner_weights[torch.randint(0, world_size, (1,), generator=gen, device=gen.device)] = 0.0
    owners = torch.multinomial(owner_weights, num_ids, replacement=True, generator=gen) if num_ids else \
        torch.empty(0, dtype=torch.int64, device=gen.device)
    slots = torch.randint(0, case["num_nodes"] // world_size, (num_ids,), generator=gen, device=gen.device)
    idx = slots * world_size + owners
    value = randn(gen, num_ids, case["dim"], dtype=dtype_of(case))
    return idx, value, case["num_nodes"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): ids uniform in [0, num_nodes) (owners even on average), then N(0, 1) values
    in the run's dtype."""
    idx = torch.randint(0, case["num_nodes"], (case["ids_per_rank"],), dtype=torch.long, device=device)
    value = torch.randn((case["ids_per_rank"], case["dim"]), dtype=dtype_of(case), device=device)
    return idx, value, case["num_nodes"], None


def reference(idx, value, num_nodes, group=None):
    world_size = dist.get_world_size(group)
    owner = idx % world_size
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world_size).tolist()
    recv_counts = exchange_counts(send_counts, idx.device, group)
    recv_idx = all_to_all_rows(idx[order], send_counts, recv_counts, group)
    recv_value = all_to_all_rows(value[order], send_counts, recv_counts, group)
    return recv_idx, recv_value


def cost(case, world_size):
    pair_bytes = 8 + case["dim"] * dtype_of(case).itemsize
    sent = case["ids_per_rank"] * pair_bytes
    return Cost(link_bytes=(world_size - 1) / world_size * sent, hbm_bytes=4 * sent, pattern="all_to_all")


PROBLEM = Problem(
    name="gnn_sparse_embedding_all2all", version=3, upstream_id=67, category="beyond_llm",
    source="DGL / GraphStorm distributed sparse embedding (push of (id, value) pairs to id % W)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"ids_per_rank": 1024, "even": True, "num_nodes": 100_000, "dim": 128})],
    tests=[
        Case("skewed_owners", {"ids_per_rank": 45, "num_nodes": 1000, "dim": 7},
             tags=("uneven_sizes", "skewed", "odd_sizes")),
        Case("one_rank_empty", {"ids_per_rank": 30, "num_nodes": 97, "dim": 16, "num_empty": 1},
             tags=("empty_rank", "uneven_sizes", "skewed")),
        Case("few_ids_dim33", {"ids_per_rank": 9, "num_nodes": 100_000, "dim": 33},
             note="a handful of ids a rank, rows of 33 features", tags=("tiny", "odd_sizes", "uneven_sizes")),
    ],
    benchmarks=[
        Case("papers100m_emb128", {"ids_per_rank": 150_000, "num_nodes": 111_059_956, "dim": 128}),
        Case("mag240m_emb768", {"ids_per_rank": 40_000, "num_nodes": 244_160_499, "dim": 768}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
