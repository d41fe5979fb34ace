"""GNN feature exchange, backward (DGL GraphBolt ``CooperativeConvFunction.backward``).

The reverse of the forward exchange: every rank sends the gradient rows of the features it received
back to their owners, and the owner sums them into its seed rows (a sparse COO matrix times the
received rows in GraphBolt; an index-add here).

Per rank (M[a][b] = rows rank a sent to rank b in the forward pass, skewed, with empty entries; peers
listed rank-rotated as in the forward problem: entry j belongs to rank p_j = (rank + j) % W):
  grad_output [sum(counts_sent), D] fp32 (in every run precision, as upstream's factory makes it; the
  gradients of the rows received from p_0, p_1, ..., in that order), seed_inverse_ids [sum(counts_received)]
  int64 in [0, seed_size) (with repeats; some seeds unused),
  seed_size int, counts_sent = [M[p_j][rank] for j], counts_received = [M[rank][p_j] for j], group=None
  ->  grad [seed_size, D] fp32: grad[i] = sum of the returned rows whose seed_inverse_id is i (zero if none).

Cost: the (W-1)/W of the R = rows_per_rank rows (D*4 bytes each) that leave the rank cross the link:
link = (W-1)/W * R*D*4. HBM: the exchange reads and writes R rows, the index-add reads them and reads
and writes the gradient rows: 3*R*D*4 + 2*seed_size*D*4. flops: R*D additions.

Tolerance: a seed row sums its repeats in any order (atomics on a GPU): a few fp32 roundings of
values of size ~1 (atol 1e-5); a row missing one contribution is off by ~1.

Cases: ``upstream`` is the upstream benchmark's input (grad_output [1024, 128] fp32, 1024 ids below
seed_size = 512, 1024/W rows to and from every peer). Benchmarks: the backward of the forward problem's
ogbn-papers100M layers (200k rows of 128, 40k of 256).
"""

import torch

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import all_to_all_rows_rotated, upstream_exchange
from pkb.problems.beyond_llm.gnn_feature_exchange_all2all import count_matrix, rotated_counts


def make_inputs(case, rank, world_size, gen):
    counts_sent, counts_received = rotated_counts(count_matrix(case, world_size, gen), rank)
    seed_size = case["seed_size"] + case.get("seed_size_step", 1) * rank
    grad_output = randn(gen, sum(counts_sent), case["dim"])
    seed_inverse_ids = torch.randint(0, seed_size, (sum(counts_received),), generator=gen, device=gen.device)
    return grad_output, seed_inverse_ids, seed_size, counts_sent, counts_received, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) fp32 grad_output, then uniform ids (with repeats) below seed_size."""
    grad_output, seed_inverse_ids, counts_sent, counts_received = upstream_exchange(
        case, world_size, case["rows_per_rank"], torch.float32, device)
    return grad_output, seed_inverse_ids, case["seed_size"], counts_sent, counts_received, None


def reference(grad_output, seed_inverse_ids, seed_size, counts_sent, counts_received, group=None):
    returned = all_to_all_rows_rotated(grad_output, counts_sent, counts_received, group)
    grad = torch.zeros((seed_size, *grad_output.shape[1:]), dtype=torch.float32, device=grad_output.device)
    return grad.index_add_(0, seed_inverse_ids, returned.float()).to(grad_output.dtype)


def cost(case, world_size):
    row_bytes = case["dim"] * 4
    moved = case["rows_per_rank"] * row_bytes
    return Cost(link_bytes=(world_size - 1) / world_size * moved, flops=case["rows_per_rank"] * case["dim"],
                hbm_bytes=3 * moved + 2 * case["seed_size"] * row_bytes, pattern="all_to_all")


PROBLEM = Problem(
    name="gnn_feature_exchange_all2all_backward", version=2, upstream_id=66, category="beyond_llm",
    source="DGL GraphBolt cooperative minibatching (CooperativeConvFunction.backward)", world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"rows_per_rank": 1024, "even": True, "seed_size": 512, "seed_size_step": 0,
                                "dim": 128})],
    tests=[
        Case("skewed_odd_dim", {"rows_per_rank": 41, "seed_size": 9, "dim": 13},
             tags=("uneven_sizes", "skewed", "odd_sizes")),
        Case("empty_pairs", {"rows_per_rank": 19, "seed_size": 4, "dim": 6, "num_empty": 1},
             tags=("uneven_sizes", "empty_rank")),
        Case("sparse_seeds", {"rows_per_rank": 12, "seed_size": 40, "dim": 5},
             note="more seeds than returned rows: many gradient rows stay zero",
             tags=("uneven_sizes", "odd_sizes", "shape_regime")),
    ],
    benchmarks=[
        Case("papers100m_layer0", {"rows_per_rank": 200_000, "seed_size": 150_000, "dim": 128}),
        Case("papers100m_hidden256", {"rows_per_rank": 40_000, "seed_size": 30_000, "dim": 256}),
    ],
    tolerance=Tolerance(atol=1e-5, rtol=1e-5), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
