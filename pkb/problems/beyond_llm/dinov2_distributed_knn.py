"""Distributed k-NN evaluation (DINOv2 ``KnnModule.compute_neighbors``): the train set is sharded over
the ranks; every rank's test queries are scored against every shard, each shard keeps its top k, and
the query's owner merges the W lists into the final top k.

Per rank: test_features_rank [q_r, D] (q_r differs per rank and may be 0), train_features_rank_T [D, t_r]
(this rank's train shard, transposed, contiguous; t_r >= max_k, else ValueError, as in DINOv2; both in
the run's precision, bf16 by default), train_labels_rank [1, t_r] int64, max_k int, group=None (the
default group)
  ->  (topk_sims [q_r, max_k] (the features' dtype), topk_labels [q_r, max_k] int64) for this rank's own
      queries, largest similarity first.

Similarity: the dot product of a query and a train vector in the features' dtype (DINOv2 runs the GEMM
in it). DINOv2 leaves the order of equal similarities to the top-k kernel, so the inputs
keep the top max_k + 1 similarities of every query apart: each query is one feature axis d scaled
by c in [0.5, 1]; along every axis, max_k + 1 train vectors (at random places of the global train
set) hold a ladder of values 1.03^m, m = 0..max_k, and all others stay below 0.9. The similarities
c * 1.03^m are exact in fp32 and several bf16 ulps apart (more in fp16 and fp32), so every honest kernel finds the same
top k in the same order, and the labels must match exactly.

The reference all-gathers the queries (DINOv2 broadcasts each owner's in turn: the same data), takes
each shard's top k and sends each owner its queries' lists (DINOv2 gathers them on the owner), where
they are merged into the top k.

Cost: every rank receives the other ranks' queries, (W-1)*q*D*b bytes, and sends back k results
(a similarity of b bytes + an int64 label) per foreign query: link = (W-1)*q*(D*b + k*(b + 8)). flops: 2*(W*q)*D*t
for the similarities. HBM: read the train shard once, D*t*b, plus the queries.

Benchmarks: DINOv2 evaluates k-NN on ImageNet-1k (1,281,167 train images) with max_k = 200 and 256
queries per rank per step, with ViT-S/14 (384-d) and ViT-g/14 (1536-d) features; the train set is
split over the ranks. The ``upstream`` case is the upstream factory's: 32 queries per rank, 384-d,
16,384 train vectors in all (16384/W per rank), max_k = 200.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.beyond_llm._common import all_gather_rows, all_to_all_rows, dtype_of, skewed_counts

_RATIO = 1.03  # between neighbouring ladder values: >= 3 bf16 ulps
_BACKGROUND = 0.9  # every value off the ladders stays within +-this, below the lowest rung (1.0)


def shard_sizes(case, world_size):
    train = [case["train_total"] // world_size + (1 if r < case["train_total"] % world_size else 0)
             for r in range(world_size)]
    if case.get("skew_train", False):  # the last shard keeps only max_k vectors, the first takes the rest
        moved = train[-1] - case["max_k"]
        train[0], train[-1] = train[0] + moved, train[-1] - moved
    return train


def make_inputs(case, rank, world_size, gen):
    dim, max_k, total = case["dim"], case["max_k"], case["train_total"]
    if case.get("even_queries", False):
        queries = [case["queries_per_rank"]] * world_size
    else:
        queries = skewed_counts(gen.shared, world_size, case["queries_per_rank"] * world_size, case.get("num_empty", 0))
    train = shard_sizes(case, world_size)
    offset = sum(train[:rank])
    # Train shard: small background values, then along every axis d the ladder's rungs at their global
    # places (shared by every rank: a random permutation, read from a random start per axis).
    train_T = (torch.randn(dim, train[rank], generator=gen, device=gen.device) * 0.3).clamp(-_BACKGROUND, _BACKGROUND)
    rungs = min(max_k + 1, total)
    order = torch.randperm(total, generator=gen.shared, device=gen.device)
    start = torch.randint(0, total, (dim, 1), generator=gen.shared, device=gen.device)
    places = order[(start + torch.arange(rungs, device=gen.device)) % total]  # [D, rungs] global indices
    values = _RATIO ** torch.arange(rungs, device=gen.device, dtype=torch.float32).expand(dim, -1)
    mine = (places >= offset) & (places < offset + train[rank])
    axis = torch.arange(dim, device=gen.device).view(-1, 1).expand(-1, rungs)
    train_T[axis[mine], places[mine] - offset] = values[mine]
    # Queries: one axis each, scaled by c in [0.5, 1].
    num_queries = queries[rank]
    test_features = torch.zeros(num_queries, dim, device=gen.device)
    axes = torch.randint(0, dim, (num_queries,), generator=gen, device=gen.device)
    scales = 0.5 + 0.5 * torch.rand(num_queries, generator=gen, device=gen.device)
    test_features[torch.arange(num_queries, device=gen.device), axes] = scales
    train_labels_rank = torch.randint(0, case["num_classes"], (1, train[rank]), generator=gen, device=gen.device)
    dtype = dtype_of(case)
    return test_features.to(dtype), train_T.to(dtype), train_labels_rank, max_k, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) bf16 queries, then train vectors, each normalised in bf16 and cast to
    the run's dtype; label of train vector i of rank r: (r * t_r + i) mod num_classes."""
    dtype, dim, num_train = dtype_of(case), case["dim"], shard_sizes(case, world_size)[rank]
    test_features = torch.randn((case["queries_per_rank"], dim), dtype=torch.bfloat16, device=device)
    train_features = torch.randn((num_train, dim), dtype=torch.bfloat16, device=device)
    test_features = torch.nn.functional.normalize(test_features, dim=1, p=2)
    train_features = torch.nn.functional.normalize(train_features, dim=1, p=2)
    label_ids = rank * num_train + torch.arange(num_train, dtype=torch.long, device=device)
    train_labels_rank = label_ids.remainder(case["num_classes"]).view(1, num_train)
    return (test_features.to(dtype=dtype).contiguous(), train_features.to(dtype=dtype).t().contiguous(),
            train_labels_rank, case["max_k"], None)


def _top_k(sims, labels, k):
    order = torch.sort(sims, dim=1, descending=True, stable=True).indices[:, :k]
    return sims.gather(1, order), labels.gather(1, order)


def reference(test_features_rank, train_features_rank_T, train_labels_rank, max_k, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if max_k > train_features_rank_T.shape[1]:
        raise ValueError(f"max_k={max_k} exceeds this rank's {train_features_rank_T.shape[1]} train vectors")
    queries, query_counts = all_gather_rows(test_features_rank, group)
    num_queries = queries.shape[0]
    sims = (queries.float() @ train_features_rank_T.float()).to(queries.dtype)
    top_sims, top_labels = _top_k(sims, train_labels_rank.expand(num_queries, -1), max_k)
    # Each owner gets its queries' lists from every shard, shard 0 first, and merges them.
    own = query_counts[rank]
    recv_counts = [own] * world_size
    got_sims = all_to_all_rows(top_sims, query_counts, recv_counts, group).view(world_size, own, max_k)
    got_labels = all_to_all_rows(top_labels, query_counts, recv_counts, group).view(world_size, own, max_k)
    merged_sims = got_sims.permute(1, 0, 2).reshape(own, world_size * max_k)
    merged_labels = got_labels.permute(1, 0, 2).reshape(own, world_size * max_k)
    return _top_k(merged_sims, merged_labels, max_k)


def cost(case, world_size):
    itemsize = dtype_of(case).itemsize
    q, dim, k = case["queries_per_rank"], case["dim"], case["max_k"]
    train = case["train_total"] / world_size
    link = (world_size - 1) * q * (dim * itemsize + k * (itemsize + 8))
    return Cost(link_bytes=link, flops=2 * world_size * q * dim * train,
                hbm_bytes=dim * train * itemsize + world_size * q * dim * itemsize, pattern="all_gather+all_to_all")


PROBLEM = Problem(
    name="dinov2_distributed_knn", version=3, upstream_id=79, category="beyond_llm",
    source="DINOv2 eval/knn.py KnnModule (broadcast queries, per-shard top-k, gather and merge on the owner)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"queries_per_rank": 32, "even_queries": True, "dim": 384, "train_total": 16_384,
                          "max_k": 200, "num_classes": 1000},
             note="32 queries per rank, 16384/W train vectors per rank, max_k 200"),
    ],
    tests=[
        Case("uneven_queries", {"queries_per_rank": 5, "dim": 24, "train_total": 203, "max_k": 9, "num_classes": 7},
             tags=("uneven_sizes", "odd_sizes", "argument_value")),
        Case("min_shard_empty_rank", {"queries_per_rank": 4, "dim": 40, "train_total": 160, "max_k": 20,
                                      "num_classes": 1000, "num_empty": 1, "skew_train": True},
             note="the last shard holds exactly max_k vectors; one rank has no queries",
             tags=("empty_rank", "uneven_sizes", "argument_value")),
    ],
    benchmarks=[
        Case("dinov2_vits14_imagenet1k", {"queries_per_rank": 256, "dim": 384, "train_total": 1_281_167,
                                          "max_k": 200, "num_classes": 1000}),
        Case("dinov2_vitg14_imagenet1k", {"queries_per_rank": 256, "dim": 1536, "train_total": 1_281_167,
                                          "max_k": 200, "num_classes": 1000}),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
