"""Distributed k-NN evaluation (DINOv2 ``KnnModule.compute_neighbors``): the train set is sharded over
the ranks; every rank's test queries are scored against every shard, each shard keeps its top k, and
the query's owner merges the W lists into the final top k.

Per rank: test_features_rank [q_r, D] (bf16; q_r differs per rank and may be 0),
train_features_rank_T [D, t_r] (bf16; this rank's train shard, transposed; t_r may be below max_k),
train_labels_rank [1, t_r] int64, max_k int
  ->  (topk_sims [q_r, max_k] bf16, topk_labels [q_r, max_k] int64) for this rank's own queries.

Similarity and tie rule (upstream left the order of bf16 ties to CUDA's top-k): the similarity of a
query and a train vector is their dot product rounded to bf16 (DINOv2 runs ``torch.mm`` in the
features' dtype). Train vectors are ordered by similarity, largest first, and equal similarities by
global train index, lowest first; the global index of shard r's column j is (t_0 + ... + t_{r-1}) + j.
The features are multiples of 2^-6 with small integer numerators, so every dot product is exact in
fp32 whatever the summation order, and its bf16 rounding is unique: an honest kernel can match the
order exactly. The sum of all t_r is at least max_k.

The reference all-gathers the queries (DINOv2 broadcasts each owner's in turn: the same data), takes
each shard's top min(k, t_r) by the rule above and sends each owner its queries' lists (DINOv2 gathers
them on the owner), where a stable sort merges them (ranks in order, so equal similarities stay in
global-index order).

Cost: every rank receives the other ranks' queries, (W-1)*q*D*b bytes, and sends back k results
(bf16 + int64 label) per foreign query: link = (W-1)*q*(D*b + k*(b + 8)). flops: 2*(W*q)*D*t
for the similarities. HBM: read the train shard once, D*t*b, plus the queries.

Benchmarks: DINOv2 evaluates k-NN on ImageNet-1k (1,281,167 train images) with max_k = 200 and 256
queries per rank per step, with ViT-S/14 (384-d) and ViT-g/14 (1536-d) features; the train set is
split over the ranks.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.beyond_llm._common import all_gather_rows, all_to_all_rows, skewed_counts

_STEP = 2.0**-6  # features are small integers times this: dot products are exact in fp32


def _features(gen, *shape, magnitude):
    numerators = torch.randint(-magnitude, magnitude + 1, shape, generator=gen, device=gen.device)
    return (numerators.float() * _STEP).to(torch.bfloat16)


def make_inputs(case, rank, world_size, gen):
    queries = skewed_counts(gen.shared, world_size, case["queries_per_rank"] * world_size, case.get("num_empty", 0))
    train = [case["train_total"] // world_size + (1 if r < case["train_total"] % world_size else 0)
             for r in range(world_size)]
    if case.get("skew_train", False):  # move most of the last shard to the first
        moved = train[-1] - max(1, case["max_k"] // 3)
        train[0], train[-1] = train[0] + moved, train[-1] - moved
    magnitude = case["magnitude"]
    test_features_rank = _features(gen, queries[rank], case["dim"], magnitude=magnitude)
    train_features_rank_T = _features(gen, case["dim"], train[rank], magnitude=magnitude)
    train_labels_rank = torch.randint(0, case["num_classes"], (1, train[rank]), generator=gen, device=gen.device)
    return test_features_rank, train_features_rank_T, train_labels_rank, case["max_k"]


def _top_k(sims, labels, k):
    """The first k by (similarity desc, position asc): a stable descending sort keeps equal ones in order."""
    order = torch.sort(sims, dim=1, descending=True, stable=True).indices[:, :k]
    return sims.gather(1, order), labels.gather(1, order)


def reference(test_features_rank, train_features_rank_T, train_labels_rank, max_k, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    queries, query_counts = all_gather_rows(test_features_rank, group)
    num_queries, shard_size = queries.shape[0], train_features_rank_T.shape[1]
    sims = (queries.float() @ train_features_rank_T.float()).to(torch.bfloat16)
    top_sims, top_labels = _top_k(sims, train_labels_rank.expand(num_queries, -1), min(max_k, shard_size))
    # Pad short shards' lists to max_k with entries that rank last, so every row has the same size.
    pad = max_k - top_sims.shape[1]
    top_sims = torch.cat([top_sims, top_sims.new_full((num_queries, pad), float("-inf"))], dim=1)
    top_labels = torch.cat([top_labels, top_labels.new_full((num_queries, pad), -1)], dim=1)
    # Each owner gets its queries' lists from every shard, shard 0 first.
    own = query_counts[rank]
    recv_counts = [own] * world_size
    got_sims = all_to_all_rows(top_sims, query_counts, recv_counts, group).view(world_size, own, max_k)
    got_labels = all_to_all_rows(top_labels, query_counts, recv_counts, group).view(world_size, own, max_k)
    # Shards in rank order, each in (similarity, index) order: the stable merge keeps global-index order.
    merged_sims = got_sims.permute(1, 0, 2).reshape(own, world_size * max_k)
    merged_labels = got_labels.permute(1, 0, 2).reshape(own, world_size * max_k)
    return _top_k(merged_sims, merged_labels, max_k)


def cost(case, world_size):
    itemsize = 2
    q, dim, k = case["queries_per_rank"], case["dim"], case["max_k"]
    train = case["train_total"] / world_size
    link = (world_size - 1) * q * (dim * itemsize + k * (itemsize + 8))
    return Cost(link_bytes=link, flops=2 * world_size * q * dim * train,
                hbm_bytes=dim * train * itemsize + world_size * q * dim * itemsize, pattern="all_gather+all_to_all")


PROBLEM = Problem(
    name="dinov2_distributed_knn", version=1, upstream_id=79, category="beyond_llm",
    source="DINOv2 eval/knn.py KnnModule (broadcast queries, per-shard top-k, gather and merge on the owner)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("ties_uneven_queries", {"queries_per_rank": 5, "dim": 24, "train_total": 203, "max_k": 9,
                                     "num_classes": 7, "magnitude": 2},
             note="tiny numerators: many equal similarities, decided by the global index"),
        Case("short_shard_empty_rank", {"queries_per_rank": 4, "dim": 40, "train_total": 160, "max_k": 20,
                                        "num_classes": 1000, "magnitude": 15, "num_empty": 1, "skew_train": True},
             note="the last shard holds fewer than max_k vectors; one rank has no queries"),
    ],
    benchmarks=[
        Case("dinov2_vits14_imagenet1k", {"queries_per_rank": 256, "dim": 384, "train_total": 1_281_167,
                                          "max_k": 200, "num_classes": 1000, "magnitude": 15}),
        Case("dinov2_vitg14_imagenet1k", {"queries_per_rank": 256, "dim": 1536, "train_total": 1_281_167,
                                          "max_k": 200, "num_classes": 1000, "magnitude": 7}),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
