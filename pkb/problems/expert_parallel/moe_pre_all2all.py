"""MoE dispatch: permute tokens by expert, all-to-all them to the experts' ranks, regroup by local expert
(VeOmni MoE ``token_pre_all2all``).

Per rank r (E experts, rank r holds experts [r*E/W, (r+1)*E/W)):
  hidden_states [T, H] (the run's precision, bf16 by default); expert_mask [E, k, T] fp32 one-hot of
  each token's k distinct experts; num_experts E; input_splits [W] / output_splits [W] (Python ints:
  rows sent to / received from each rank); num_global_tokens_per_local_expert [W, E/W] int64 (tokens
  rank s routes to r's experts); group None
->  (global_permuted [sum(output_splits), H]  the received tokens grouped by local expert, then by
                                             source rank, each chunk in the source's token order,
     routing_map [E, T] fp32                 expert_mask summed over k (1 where a token chose an expert),
     permutation_mapping [T*k] int64         the token index of every locally permuted row (expert-major),
     org_hidden_states_shape                 torch.Size([T, H]))
All outputs are data movement and checked exactly.

The split sizes and counts follow the routing: all ranks' routing is drawn from ``gen.shared``, so
every rank knows what the others send. The upstream case has upstream's structure: every expert gets
exactly T*k/E tokens of every rank, so the splits are [T*k/W] * W and every count T*k/E on every rank,
as upstream's synthetic uniform splits are (which ignored the mask; here the routing is balanced to
match them). Tests include a rank with no tokens and skewed routing (the last rank's experts get
nearly every token, rank 0's experts none).

Cost: a token must reach each other rank that holds one of its experts at least once (the receiver
may copy it to several local experts): link bytes T * H * bytes * R, with R the expected number of
other ranks among a token's k experts under uniform routing, R = (W-1)(1 - C(E-E/W, k)/C(E, k)).
HBM: read hidden (T*H) and the mask (E*k*T*4), write global_permuted (T*k*H on average),
routing_map (E*T*4) and the mapping (T*k*8).

Benchmarks: 4096 tokens per rank with DeepSeek-V3 routing (256 experts, top-8, hidden 7168) at EP 8,
Qwen3-30B-A3B (128, top-8, hidden 2048) at EP 4, Mixtral 8x7B (8, top-2, hidden 4096) at EP 8.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.expert_parallel._common import (dtype_of, expected_remote_ranks, permutation_mapping,
                                                  routed_case, sort_chunks_by_idxs, upstream_routing,
                                                  upstream_split_sizes, upstream_tokens_per_local_expert)


def make_inputs(case, rank, world_size, gen):
    tokens, selected, input_splits, output_splits, per_local = routed_case(case, rank, world_size, gen)
    hidden_states = randn(gen, tokens[rank], case["hidden"], dtype=dtype_of(case))
    expert_mask = F.one_hot(selected[rank], case["experts"]).permute(2, 1, 0).to(torch.float32).contiguous()
    return hidden_states, expert_mask, case["experts"], input_splits, output_splits, per_local, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: hidden ~ N(0, 1), then each token's k experts from ``randperm``; its splits and counts
    are even shares of the T*k routed rows, the same on every rank (they ignore the routing)."""
    num_experts = case["experts"]
    hidden_states = torch.randn(case["tokens"], case["hidden"], dtype=dtype_of(case), device=device)
    selected = upstream_routing(case["tokens"], num_experts, case["top_k"], device)
    expert_mask = F.one_hot(selected, num_experts).permute(2, 1, 0).float().contiguous()         # [E, k, T]
    total = int((expert_mask.sum(dim=1) > 0).sum())
    splits = upstream_split_sizes(total, world_size)
    per_local = upstream_tokens_per_local_expert(total, world_size, num_experts // world_size, device)
    return hidden_states, expert_mask, num_experts, splits, list(splits), per_local, None


def reference(hidden_states, expert_mask, num_experts, input_splits, output_splits,
              num_global_tokens_per_local_expert, group=None):
    world_size = dist.get_world_size(group)
    num_local_experts = num_experts // world_size
    hidden_dim = hidden_states.size(-1)
    hidden_states = hidden_states.reshape(-1, hidden_dim)
    org_hidden_states_shape = hidden_states.shape
    routing_map = expert_mask.sum(dim=1)                                                   # [E, T]
    local_permutation_mapping = permutation_mapping(routing_map)                           # [T*k]
    local_permuted = hidden_states.index_select(0, local_permutation_mapping)
    global_permuted = hidden_states.new_empty((sum(output_splits), hidden_dim))
    dist.all_to_all_single(global_permuted, local_permuted, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    # Received chunks are ordered (source rank, local expert); regroup them as (local expert, source rank).
    by_local_expert = torch.arange(world_size * num_local_experts).view(world_size, num_local_experts).T.ravel()
    global_permuted = sort_chunks_by_idxs(global_permuted, num_global_tokens_per_local_expert.ravel(), by_local_expert)
    return global_permuted, routing_map, local_permutation_mapping, org_hidden_states_shape


def cost(case, world_size):
    tokens, hidden, experts, top_k = case["tokens"], case["hidden"], case["experts"], case["top_k"]
    item = dtype_of(case).itemsize
    remote = expected_remote_ranks(experts, top_k, world_size)
    hbm = (tokens * hidden + tokens * top_k * hidden) * item + experts * top_k * tokens * 4 \
        + experts * tokens * 4 + tokens * top_k * 8
    return Cost(link_bytes=tokens * hidden * item * remote, hbm_bytes=hbm, pattern="all_to_all (dispatch)")


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": 8, "top_k": 2, "hidden": 1024, "balanced": True},
         note="the upstream factory's defaults: hidden [1024, 1024], mask [8, 2, 1024] fp32, 8 experts, top-2; "
              "balanced routing, so splits [2048/W] * W and counts of 256, as upstream's"),
)

TESTS = (
    Case("uneven_with_empty_rank", {"tokens": 9, "tokens_step": 5, "empty_rank": 1, "experts": 8, "top_k": 3,
                                    "hidden": 19}, note="rank 1 holds no tokens and sends nothing",
         tags=("uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
    Case("skewed_hot_last_rank", {"tokens": 13, "experts": 16, "top_k": 2, "hidden": 7, "skew": True},
         note="the last rank's experts get nearly every token, rank 0's none",
         tags=("skewed", "uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
)

BENCHMARKS = (
    Case("deepseek_v3_ep8", {"tokens": 4096, "experts": 256, "top_k": 8, "hidden": 7168}, world_sizes=(8,)),
    Case("qwen3_30b_a3b_ep4", {"tokens": 4096, "experts": 128, "top_k": 8, "hidden": 2048}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep8", {"tokens": 4096, "experts": 8, "top_k": 2, "hidden": 4096}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="moe_pre_all2all", version=3, upstream_id=28, category="expert_parallel",
    source="VeOmni MoE token_pre_all2all (permute, dispatch all-to-all, sort chunks by local expert)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
