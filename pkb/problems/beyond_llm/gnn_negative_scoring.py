"""Link-prediction ranking (GraphStorm / DGL-KE ``calc_ranking`` + gather): rank each positive edge's
score among its negatives, gather every rank's rankings and compute the MRR from them.

Per rank: local_pos_scores [n] (bf16), local_neg_scores [n, K] (bf16); n differs per rank and may be 0
  ->  (ranking [sum of n over ranks] int64: rank 0's rankings first, the same on every rank,
       mrr [] fp32 = mean of 1 / ranking over all of them).

Tie rule (upstream left it to CUDA's sort): GraphStorm ranks ``sigmoid(score)`` with a descending sort
of [pos, neg...], the positive in column 0. The sigmoid is strictly increasing, so pkb ranks the
scores themselves, exactly as they are in bf16: ranking = 1 + #{k : neg[k] > pos} (a negative equal to
the positive does not outrank it, as in a stable sort). bf16 scores tie often; the rule fixes them.

Cost: the rankings are all-gathered: each rank receives the (W-1)/W of the N = W*n rankings it does not
hold, N*8 bytes: link = (W-1)/W * N*8. (Gathering the raw scores instead, as upstream does, moves
(K+1)*2/8 times more.) flops: n*K comparisons. HBM: read the scores n*(K+1)*2, write N*8.

Benchmarks: ogbl-citation2 is evaluated with 1000 negatives per positive over 86,956 test edges
(``citation2_1000neg``: the test edges split over the ranks); ``wikikg90m_1000neg`` is a larger
batch of 200k positives per evaluation step, as in DGL-KE's WikiKG90M runs.
"""

import torch

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.beyond_llm._common import all_gather_rows, dtype_of, skewed_counts


def positives_per_rank(case, world_size):
    return -(-case["num_pos"] // world_size)


def make_inputs(case, rank, world_size, gen):
    sizes = skewed_counts(gen.shared, world_size, case["num_pos"], case.get("num_empty", 0))
    sizes[0] = max(sizes[0], 1)  # never an empty evaluation overall
    num_pos = sizes[rank]
    dtype = dtype_of(case)
    local_pos_scores = (randn(gen, num_pos) + 1.0).to(dtype)
    local_neg_scores = randn(gen, num_pos, case["num_neg"], dtype=dtype)
    return local_pos_scores, local_neg_scores


def reference(local_pos_scores, local_neg_scores, group=None):
    ranking = 1 + (local_neg_scores > local_pos_scores.view(-1, 1)).sum(dim=1, dtype=torch.int64)
    all_rankings, _ = all_gather_rows(ranking, group)
    mrr = (1.0 / all_rankings.to(torch.float64)).mean().to(torch.float32)
    return all_rankings, mrr


def cost(case, world_size):
    total = case["num_pos"]
    local = positives_per_rank(case, world_size)
    itemsize = dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * total * 8, flops=local * case["num_neg"],
                hbm_bytes=local * (case["num_neg"] + 1) * itemsize + total * 8, pattern="all_gather")


PROBLEM = Problem(
    name="gnn_negative_scoring", version=1, upstream_id=69, category="beyond_llm",
    source="GraphStorm / DGL-KE link-prediction evaluation (calc_ranking + gather of rankings, MRR)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("skewed_bf16_ties", {"num_pos": 45, "num_neg": 33, "dtype": "bfloat16"}),
        Case("one_rank_empty", {"num_pos": 21, "num_neg": 100, "dtype": "bfloat16", "num_empty": 1}),
        Case("fp32_few", {"num_pos": 11, "num_neg": 7, "dtype": "float32"}),
    ],
    benchmarks=[
        Case("citation2_1000neg", {"num_pos": 86_956, "num_neg": 1000, "dtype": "bfloat16"}),
        Case("wikikg90m_1000neg", {"num_pos": 200_000, "num_neg": 1000, "dtype": "bfloat16"}),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
