"""Link-prediction ranking (GraphStorm / DGL-KE ``calc_ranking`` over every rank's scores): rank each
positive edge's score among its negatives, for the positives of all ranks.

Per rank: local_pos_scores [n], local_neg_scores [n, K] (the run's precision, bf16 by default; n differs
per rank and may be 0), group=None (the default group)
  ->  ranking [sum of n over ranks] int64, rank 0's positives first, the same on every rank.

ranking[i] is the 1-based position of positive i in a descending sort of ``sigmoid([pos_i, neg_i...])``
(GraphStorm sorts the sigmoid in the scores' dtype): 1 + the number of negatives that score higher.
The sigmoid is strictly increasing, so pkb counts ``neg > pos`` on the scores themselves. A tie of the
two sigmoids would make the position depend on the sort's tie order; the inputs rule ties out: scores
lie in [-3.5, 3.5] and every negative is at least 0.5 away from its positive, which keeps their
sigmoids at least 3 bf16 ulps apart (more in fp16 and fp32).

Cost: pkb ranks locally and all-gathers the rankings: each rank receives the (W-1)/W of the N rankings
it does not hold, N*8 bytes: link = (W-1)/W * N*8. (Gathering the raw scores instead, as GraphStorm
does, moves (K+1)*2/8 times more.) flops: n*K comparisons. HBM: read the scores n*(K+1)*b, write N*8.

Cases: ``upstream`` has the upstream factory's shapes (max(16, min(1024 // W, 1280)) + rank % 3 positives
per rank, 1000 negatives each). Benchmarks: ogbl-citation2 is evaluated with 1000 negatives per positive
over 86,956 test edges (``citation2_1000neg``: the test edges split over the ranks); ``wikikg90m_1000neg`` is a larger
batch of 200k positives per evaluation step, as in DGL-KE's WikiKG90M runs.
"""

import torch

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.beyond_llm._common import all_gather_rows, dtype_of, skewed_counts

_MARGIN = 0.5  # the least distance between a negative score and its positive


def upstream_counts(case, world_size):
    """Positives per rank in the upstream factory: max(16, min(m // W, 1280)) + rank % 3."""
    return [max(16, min(case["m"] // world_size, 1280)) + rank % 3 for rank in range(world_size)]


def total_positives(case, world_size):
    return sum(upstream_counts(case, world_size)) if "m" in case.params else case["num_pos"]


def make_inputs(case, rank, world_size, gen):
    if "m" in case.params:
        sizes = upstream_counts(case, world_size)
    else:
        sizes = skewed_counts(gen.shared, world_size, case["num_pos"], case.get("num_empty", 0))
        sizes[0] = max(sizes[0], 1)  # never an empty evaluation overall
    num_pos, dtype = sizes[rank], dtype_of(case)
    pos = (randn(gen, num_pos, scale=0.8) + 1.0).clamp(-2.5, 2.5).to(dtype).float()
    neg = randn(gen, num_pos, case["num_neg"]).clamp(-3.5, 3.5)
    # Push negatives closer than the margin out to it, away from their positive (no sigmoid ties).
    gap = neg - pos.view(-1, 1)
    push = torch.where(gap >= 0, _MARGIN, -_MARGIN) + pos.view(-1, 1)
    neg = torch.where(gap.abs() < _MARGIN, push, neg)
    return pos.to(dtype), neg.to(dtype), None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) positive, then negative scores in the run's dtype (ties possible)."""
    num_pos, dtype = upstream_counts(case, world_size)[rank], dtype_of(case)
    local_pos_scores = torch.randn((num_pos,), dtype=dtype, device=device)
    return local_pos_scores, torch.randn((num_pos, case["num_neg"]), dtype=dtype, device=device), None


def reference(local_pos_scores, local_neg_scores, group=None):
    # Rank locally (sigmoid is monotone: compare the scores), then all-gather the rankings in rank order.
    ranking = 1 + (local_neg_scores > local_pos_scores.view(-1, 1)).sum(dim=1, dtype=torch.int64)
    all_rankings, _ = all_gather_rows(ranking, group)
    return all_rankings


def cost(case, world_size):
    total = total_positives(case, world_size)
    local = -(-total // world_size)
    itemsize = dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * total * 8, flops=local * case["num_neg"],
                hbm_bytes=local * (case["num_neg"] + 1) * itemsize + total * 8, pattern="all_gather")


PROBLEM = Problem(
    name="gnn_negative_scoring", version=3, upstream_id=69, category="beyond_llm",
    source="GraphStorm / DGL-KE link-prediction evaluation (calc_ranking over every rank's scores)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"m": 1024, "num_neg": 1000},
             note="max(16, min(1024 // W, 1280)) + rank % 3 positives per rank, 1000 negatives each"),
    ],
    tests=[
        Case("skewed", {"num_pos": 45, "num_neg": 33}, tags=("uneven_sizes", "odd_sizes")),
        Case("one_rank_empty", {"num_pos": 21, "num_neg": 100, "num_empty": 1}, tags=("empty_rank", "uneven_sizes")),
        Case("few_odd", {"num_pos": 11, "num_neg": 7}, tags=("tiny", "odd_sizes", "uneven_sizes")),
    ],
    benchmarks=[
        Case("citation2_1000neg", {"num_pos": 86_956, "num_neg": 1000}),
        Case("wikikg90m_1000neg", {"num_pos": 200_000, "num_neg": 1000}),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
