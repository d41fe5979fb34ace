"""GNN feature exchange, forward (DGL GraphBolt cooperative minibatching, ``CooperativeConvFunction.forward``).

In cooperative minibatching every rank samples for its own seeds, then sends each node id to the rank
that owns it. The owner answers with the feature rows of those ids: it gathers the rows
``local_features[seed_inverse_ids]`` (the ids it received, relabelled to its local seed rows, in the
order it received them, grouped by requesting rank) and sends group r back to rank r.

Per rank (M[a][b] = rows rank a sends to rank b, a skewed matrix with empty entries; GraphBolt lists its
peers rank-rotated: entry j of a per-peer list, and chunk j of the rows, belong to rank p_j = (rank + j) % W):
  local_features [seed_size, D] (the run's precision, bf16 by default),
  seed_inverse_ids [sum_j M[rank][p_j]] int64 in [0, seed_size),
  counts_sent = [M[p_j][rank] for j] (rows this rank gets from p_j: it sent p_j that many ids earlier),
  counts_received = [M[rank][p_j] for j] (ids this rank got from p_j, so rows it sends back),
  group=None (the default group)
  ->  out [sum(counts_sent), D]: the rows from p_0 = rank itself, then p_1, ... (bit-exact copies).

Cost (nccl-tests all-to-all): with R = rows_per_rank (mean rows each rank sends) and D*b bytes a row,
the (W-1)/W of them that go to other ranks cross the link: link = (W-1)/W * R*D*b. HBM: the gather
reads and writes R rows, the exchange reads them and writes the R received: 4*R*D*b.

Cases: ``upstream`` is the upstream benchmark's input (local_features [768, 128], 1024 ids, 1024/W
rows to and from every peer). Benchmarks: ogbn-papers100M (128-d features) under GraphBolt cooperative
minibatching with 1024 seeds per rank and fanouts (10, 10, 10): the first layer's exchange moves on
the order of 10^5 rows per rank; ``papers100m_layer0`` uses 200k rows of 128 bf16 features,
``papers100m_hidden256`` the next layer's 256-d hidden features for 40k rows.
"""

import torch

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import all_to_all_rows_rotated, dtype_of, skewed_counts, upstream_exchange


def count_matrix(case, world_size, gen):
    """M[a][b]: rows rank a sends to rank b (the same on every rank: drawn from ``gen.shared``, or even)."""
    if case.get("even", False):
        return [[case["rows_per_rank"] // world_size] * world_size for _ in range(world_size)]
    counts = skewed_counts(gen.shared, world_size * world_size, case["rows_per_rank"] * world_size,
                           num_empty=case.get("num_empty", 0) * world_size)
    return [counts[a * world_size:(a + 1) * world_size] for a in range(world_size)]


def rotated_counts(matrix, rank):
    """(counts_sent, counts_received) of ``rank`` in rank-rotated peer order."""
    peers = [(rank + j) % len(matrix) for j in range(len(matrix))]
    return [matrix[peer][rank] for peer in peers], [matrix[rank][peer] for peer in peers]


def make_inputs(case, rank, world_size, gen):
    counts_sent, counts_received = rotated_counts(count_matrix(case, world_size, gen), rank)
    seed_size = case["seed_size"] + case.get("seed_size_step", 1) * rank
    local_features = randn(gen, seed_size, case["dim"], dtype=dtype_of(case))
    seed_inverse_ids = torch.randint(0, seed_size, (sum(counts_received),), generator=gen, device=gen.device)
    return local_features, seed_inverse_ids, counts_sent, counts_received, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) local_features in the run's dtype, then uniform ids (with repeats)."""
    features, seed_inverse_ids, counts_sent, counts_received = upstream_exchange(
        case, world_size, case["seed_size"], dtype_of(case), device)
    return features, seed_inverse_ids, counts_sent, counts_received, None


def reference(local_features, seed_inverse_ids, counts_sent, counts_received, group=None):
    rows = local_features[seed_inverse_ids]
    return all_to_all_rows_rotated(rows, counts_received, counts_sent, group)


def cost(case, world_size):
    row_bytes = case["dim"] * dtype_of(case).itemsize
    sent = case["rows_per_rank"] * row_bytes
    return Cost(link_bytes=(world_size - 1) / world_size * sent, hbm_bytes=4 * sent, pattern="all_to_all")


PROBLEM = Problem(
    name="gnn_feature_exchange_all2all", version=3, upstream_id=65, category="beyond_llm",
    source="DGL GraphBolt cooperative minibatching (CooperativeConvFunction.forward)", world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"rows_per_rank": 1024, "even": True, "seed_size": 768, "seed_size_step": 0,
                                "dim": 128})],
    tests=[
        Case("skewed_odd_dim", {"rows_per_rank": 37, "seed_size": 11, "dim": 19},
             tags=("uneven_sizes", "skewed", "odd_sizes")),
        Case("empty_pairs", {"rows_per_rank": 23, "seed_size": 5, "dim": 8, "num_empty": 1},
             note="one peer pair per rank on average exchanges nothing", tags=("uneven_sizes", "empty_rank")),
        Case("narrow_rows", {"rows_per_rank": 50, "seed_size": 30, "dim": 3},
             note="3 features a row: 6 bytes in bf16", tags=("uneven_sizes", "odd_sizes")),
    ],
    benchmarks=[
        Case("papers100m_layer0", {"rows_per_rank": 200_000, "seed_size": 150_000, "dim": 128}),
        Case("papers100m_hidden256", {"rows_per_rank": 40_000, "seed_size": 30_000, "dim": 256}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
