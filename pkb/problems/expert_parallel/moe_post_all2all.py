"""MoE combine: restore the expert outputs to source-rank order, all-to-all them home, and sum each
token's k expert outputs weighted by its routing weights (VeOmni MoE ``tokens_post_all2all``).

Per rank r (E experts, rank r holds experts [r*E/W, (r+1)*E/W)):
  expert_outputs [sum(output_splits), H]   r's experts' outputs, grouped by local expert, then by
                                           source rank (the layout moe_pre_all2all produces);
  routing_weights [T, k] (positive, each row sums to ~1); selected_experts [T, k] int64;
  num_experts E; input_splits / output_splits [W] Python ints; num_global_tokens_per_local_expert
  [W, E/W] int64; routing_map [E, T] bool; local_input_permutation_mapping [T*k] int64 (expert-major
  token indices); org_hidden_states_shape torch.Size([T, H]); group None.
expert_outputs and routing_weights are in the run's precision (bf16 by default).
->  [T, H]: out[t] = sum_j routing_weights[t, j] * (output of expert selected_experts[t, j] for t),
computed in fp32 and rounded once to the dtype the upstream's product has (that of expert_outputs
and routing_weights together; the upstream multiplied and summed in that dtype).

The routing of all ranks is drawn from ``gen.shared``, so the split sizes follow it. The upstream case
has upstream's structure: every expert gets exactly T*k/E tokens of every rank, so the splits are
[T*k/W] * W, every count T*k/E and expert_outputs T*k rows on every rank, as upstream's synthetic
uniform splits (which ignored the routing; here the routing is balanced to match them). Tests include
a rank with no tokens and skewed routing (the last rank's experts get nearly every token, rank 0's
none).

Cost: each token needs one row back from every other rank that holds one of its experts (that rank
can pre-sum its experts' weighted outputs; the k routing weights, 4 bytes each, are not counted):
link bytes T * H * bytes * R, R = (W-1)(1 - C(E-E/W, k)/C(E, k)) the expected number of such ranks.
Flops: a multiply-add per element of every expert output, 2 * T*k*H. HBM: read the expert outputs
(T*k*H on average) and weights, write the output (T*H).

Benchmarks: 4096 tokens per rank, DeepSeek-V3 (256 experts, top-8, hidden 7168) at EP 8, Qwen3-30B-A3B
(128, top-8, hidden 2048) at EP 4, Mixtral 8x7B (8, top-2, hidden 4096) at EP 8.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.expert_parallel._common import (dtype_of, expected_remote_ranks, permutation_mapping,
                                                  routed_case, sort_chunks_by_idxs, upstream_routing,
                                                  upstream_split_sizes, upstream_tokens_per_local_expert)


def make_inputs(case, rank, world_size, gen):
    tokens, selected, input_splits, output_splits, per_local = routed_case(case, rank, world_size, gen)
    num_tokens, hidden, dtype = tokens[rank], case["hidden"], dtype_of(case)
    expert_outputs = randn(gen, sum(output_splits), hidden, dtype=dtype)
    routing_weights = torch.softmax(randn(gen, num_tokens, case["top_k"]), dim=-1).to(dtype)
    selected_experts = selected[rank]
    routing_map = F.one_hot(selected_experts, case["experts"]).sum(dim=1).T.bool().contiguous()   # [E, T]
    return (expert_outputs, routing_weights, selected_experts, case["experts"], input_splits, output_splits,
            per_local, routing_map, permutation_mapping(routing_map), torch.Size([num_tokens, hidden]), None)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: each token's k experts from ``randperm``, then per token a softmax of k N(0, 1) in the run's
    dtype, then the T*k expert outputs; even splits and counts that ignore the routing (as moe_pre_all2all's)."""
    num_tokens, hidden, num_experts, top_k = case["tokens"], case["hidden"], case["experts"], case["top_k"]
    dtype = dtype_of(case)
    selected = upstream_routing(num_tokens, num_experts, top_k, device)
    routing_map = F.one_hot(selected, num_experts).sum(dim=1).T.bool().contiguous()                # [E, T]
    selected_experts = selected.sort(dim=1).values  # upstream reads them back from the map: ascending
    routing_weights = torch.stack([torch.randn(top_k, dtype=dtype, device=device).softmax(dim=0)
                                   for _ in range(num_tokens)])
    total = int(routing_map.sum())
    expert_outputs = torch.randn(total, hidden, dtype=dtype, device=device)
    splits = upstream_split_sizes(total, world_size)
    per_local = upstream_tokens_per_local_expert(total, world_size, num_experts // world_size, device)
    return (expert_outputs, routing_weights, selected_experts, num_experts, splits, list(splits), per_local,
            routing_map, permutation_mapping(routing_map), torch.Size([num_tokens, hidden]), None)


def reference(expert_outputs, routing_weights, selected_experts, num_experts, input_splits, output_splits,
              num_global_tokens_per_local_expert, routing_map, local_input_permutation_mapping,
              org_hidden_states_shape, group=None):
    world_size = dist.get_world_size(group)
    num_local_experts = num_experts // world_size
    hidden_dim = expert_outputs.size(-1)
    # Chunks are ordered (local expert, source rank); the all-to-all wants them by source rank.
    by_source_rank = torch.arange(num_local_experts * world_size).view(num_local_experts, world_size).T.ravel()
    expert_outputs = sort_chunks_by_idxs(expert_outputs, num_global_tokens_per_local_expert.T.ravel(), by_source_rank)
    returned = expert_outputs.new_empty((sum(input_splits), hidden_dim))
    dist.all_to_all_single(returned, expert_outputs.contiguous(), output_split_sizes=list(input_splits),
                           input_split_sizes=list(output_splits), group=group)
    # Weighted un-permute in fp32: row i of `returned` is token mapping[i]'s output from its expert.
    probs_TE = torch.zeros(routing_weights.shape[0], num_experts, dtype=torch.float32, device=returned.device)
    probs_TE.scatter_add_(1, selected_experts, routing_weights.float())
    permuted_probs = probs_TE.T.contiguous().masked_select(routing_map.bool())
    combined = torch.zeros(tuple(org_hidden_states_shape), dtype=torch.float32, device=returned.device)
    combined.index_add_(0, local_input_permutation_mapping, returned.float() * permuted_probs.unsqueeze(-1))
    return combined.to(torch.promote_types(expert_outputs.dtype, routing_weights.dtype))


def cost(case, world_size):
    tokens, hidden, experts, top_k = case["tokens"], case["hidden"], case["experts"], case["top_k"]
    item = dtype_of(case).itemsize
    remote = expected_remote_ranks(experts, top_k, world_size)
    hbm = (tokens * top_k * hidden + tokens * hidden) * item + tokens * top_k * (item + 8)
    return Cost(link_bytes=tokens * hidden * item * remote, flops=2 * tokens * top_k * hidden, hbm_bytes=hbm,
                pattern="all_to_all (combine)")


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": 8, "top_k": 2, "hidden": 1024, "balanced": True},
         note="the upstream factory's defaults: 1024 tokens of 1024, 8 experts, top-2; balanced routing, so "
              "2048 expert-output rows, splits [2048/W] * W and counts of 256 on every rank, as upstream's"),
)

TESTS = (
    Case("uneven_with_empty_rank", {"tokens": 9, "tokens_step": 5, "empty_rank": 1, "experts": 8, "top_k": 3,
                                    "hidden": 19}, note="rank 1 holds no tokens and gets nothing back",
         tags=("uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
    Case("skewed_hot_last_rank", {"tokens": 13, "experts": 16, "top_k": 2, "hidden": 7, "skew": True},
         note="the last rank's experts hold nearly every output, rank 0's none",
         tags=("skewed", "uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
)

BENCHMARKS = (
    Case("deepseek_v3_ep8", {"tokens": 4096, "experts": 256, "top_k": 8, "hidden": 7168}, world_sizes=(8,)),
    Case("qwen3_30b_a3b_ep4", {"tokens": 4096, "experts": 128, "top_k": 8, "hidden": 2048}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep8", {"tokens": 4096, "experts": 8, "top_k": 2, "hidden": 4096}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="moe_post_all2all", version=3, upstream_id=29, category="expert_parallel",
    source="VeOmni MoE tokens_post_all2all (sort chunks back, combine all-to-all, weighted unpermute)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
