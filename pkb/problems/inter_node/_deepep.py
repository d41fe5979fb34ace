"""What moe_dispatch_internode and moe_combine_internode share: DeepEP's layout of a routed batch across
nodes, the routing drawn for a case, the two-hop moves, and the expected byte counts.

DeepEP's normal (training and prefill) kernels move a token between nodes once per destination node:
over RDMA to the rank with the token's local rank on that node, which forwards it over NVLink to the
ranks there that hold its experts (DeepSeek-V3 technical report, section 3.2.2; DeepSeek-V3 also limits a
token to experts on at most 4 nodes, which 2 or 4 nodes meet by construction). Experts are spread
evenly: rank r holds experts [r * E/W, (r+1) * E/W), so expert e lives on rank e // (E/W) and node
(e // (E/W)) // G, with G = W/N GPUs per node.

Routing of a case (``draw_routing``): each token picks ``top_k`` distinct experts at random (uniform,
or hot/cold with ``skew``), with fp32 weights softmax(N(0, 1)) over its k slots; ``drop`` turns each slot
into -1 ("no expert", as DeepEP's topk_idx allows) with that probability. Tokens per rank follow
``tokens`` + ``tokens_step`` * rank, and ``empty_rank`` holds none.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, randn

SKEW_HOT_WEIGHT = 1000.0  # sampling weight of the last rank's experts under skew (rank 0's: 0, others: 1)
KEY_SHIFT = 32  # (source node, token) packed as node << 32 | token in the combine's reduction keys

TESTS = (
    Case("uneven_empty_source", {"tokens": 9, "tokens_step": 4, "empty_rank": 1, "experts": 16, "top_k": 3,
                                 "hidden": 19},
         note="9 + 4r tokens on rank r, rank 1 none (it sends nothing); 16 experts, top-3, hidden 19",
         tags=("uneven_sizes", "empty_rank", "odd_sizes")),
    Case("skewed_cold_rank0", {"tokens": 13, "experts": 16, "top_k": 2, "hidden": 7, "skew": True},
         note="rank 0's experts are never chosen (it receives nothing), the last rank's are hot",
         tags=("skewed", "empty_rank", "odd_sizes")),
    Case("top1", {"tokens": 17, "experts": 8, "top_k": 1, "hidden": 33},
         note="top-1 of 8 experts (one expert a rank at W = 8): each token goes to one rank",
         tags=("argument_value", "odd_sizes")),
    Case("masked_slots", {"tokens": 12, "experts": 32, "top_k": 4, "hidden": 24, "drop": 0.4},
         note="each top-k slot is -1 (no expert) with probability 0.4: some tokens go nowhere",
         tags=("special_values", "argument_value")),
    Case("every_expert", {"tokens": 5, "experts": 8, "top_k": 8, "hidden": 16},
         note="top-8 of 8 experts: every token goes to every rank and every node",
         tags=("argument_value", "tiny")),
    Case("uneven_wide", {"tokens": 40, "tokens_step": 7, "experts": 64, "top_k": 6, "hidden": 96},
         note="40 + 7r tokens on rank r, 64 experts, top-6, hidden 96",
         tags=("uneven_sizes",)),
)

BENCHMARKS = (
    Case("deepseek_v3_prefill_4096", {"tokens": 4096, "experts": 256, "top_k": 8, "hidden": 7168},
         note="DeepSeek-V3/R1 MoE layer: 4096 tokens per rank, hidden 7168, top-8 of 256 routed experts "
              "(DeepEP's normal-kernel benchmark setting, a prefill or training batch), uniform routing"),
)


# -- routing --------------------------------------------------------------------------------------------


def tokens_per_rank(case, world_size: int) -> list[int]:
    """Tokens each rank holds: ``tokens`` + ``tokens_step`` * rank; ``empty_rank`` holds 0.

    Example: tokens=9, tokens_step=4, empty_rank=1 at W=4  ->  [9, 0, 17, 21].
    """
    counts = [case["tokens"] + case.get("tokens_step", 0) * rank for rank in range(world_size)]
    if case.get("empty_rank") is not None:
        counts[case["empty_rank"] % world_size] = 0
    return counts


def expert_sampling_weights(case, world_size: int, device) -> torch.Tensor:
    """[E] weights a token samples its experts with: uniform, or with ``skew`` rank 0's experts never and the
    last rank's SKEW_HOT_WEIGHT times as often as the others."""
    num_experts = case["experts"]
    weights = torch.ones(num_experts, device=device)
    if case.get("skew"):
        local = num_experts // world_size
        weights[:local] = 0.0
        weights[num_experts - local:] = SKEW_HOT_WEIGHT
    return weights


def draw_routing(gen: torch.Generator, num_tokens: int, case, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T, k] int64, topk_weights [T, k] fp32) of one rank's tokens, drawn from ``gen``.

    topk_idx: k distinct experts per token in random order, each slot -1 with probability ``drop``.
    topk_weights: softmax over the k slots of N(0, 1) scores (positive, each row sums to 1, masked slots
    included), as a router's top-k probabilities.
    """
    top_k, device = case["top_k"], gen.device
    weights = expert_sampling_weights(case, world_size, device)
    if num_tokens == 0:
        topk_idx = torch.empty(0, top_k, dtype=torch.int64, device=device)
    else:
        topk_idx = torch.multinomial(weights.expand(num_tokens, -1), top_k, replacement=False, generator=gen)
    drop = case.get("drop", 0.0)
    if drop:
        dropped = torch.rand(num_tokens, top_k, generator=gen, device=device) < drop
        topk_idx = topk_idx.masked_fill(dropped, -1)
    topk_weights = torch.softmax(randn(gen, num_tokens, top_k), dim=-1)
    return topk_idx, topk_weights


def token_in_rank(topk_idx: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """[T, W] bool: whether a token has an expert on each rank (DeepEP's ``is_token_in_rank``; -1 slots
    count for no rank)."""
    ranks = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1) + 1  # -1 slots land in column 0
    hit = torch.zeros(topk_idx.shape[0], world_size + 1, dtype=torch.bool, device=topk_idx.device)
    return hit.scatter_(1, ranks, True)[:, 1:]


def local_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int,
                  experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's received routing: expert ids made local to ``rank`` (e - rank * E/W), -1 for an expert of
    another rank (or a -1 slot); the weight kept where the id is local, 0.0 elsewhere."""
    first = rank * experts_per_rank
    local = (topk_idx >= first) & (topk_idx < first + experts_per_rank)
    return torch.where(local, topk_idx - first, -1), torch.where(local, topk_weights, 0.0)


def received_layout(routing: list[tuple[torch.Tensor, torch.Tensor]], rank: int, experts_per_rank: int) -> tuple:
    """What dispatch delivers to ``rank`` given every rank's (topk_idx, topk_weights): the tokens with an
    expert on ``rank``, ordered by source rank, then by token index. Returns (recv_topk_idx [R, k] int64
    local ids, recv_topk_weights [R, k] fp32, recv_src_idx [R] int32, num_recv_tokens_per_rank [W] int32)."""
    world_size = len(routing)
    idx, weights, src_idx, counts = [], [], [], []
    for topk_idx, topk_weights in routing:
        tokens = token_in_rank(topk_idx, experts_per_rank, world_size)[:, rank].nonzero().view(-1)
        local_idx, local_weights = local_routing(topk_idx[tokens], topk_weights[tokens], rank, experts_per_rank)
        idx.append(local_idx)
        weights.append(local_weights)
        src_idx.append(tokens.int())
        counts.append(tokens.numel())
    device = routing[0][0].device
    return (torch.cat(idx), torch.cat(weights), torch.cat(src_idx),
            torch.tensor(counts, dtype=torch.int32, device=device))


# -- moves ----------------------------------------------------------------------------------------------


def grid(intra_group, inter_group) -> tuple[int, int, int, int]:
    """(num_nodes N, gpus per node G, this rank's node, its local rank) from the two groups."""
    return (dist.get_world_size(inter_group), dist.get_world_size(intra_group),
            dist.get_rank(inter_group), dist.get_rank(intra_group))


def exchange_counts(send_counts: list[int], group, device) -> list[int]:
    """Rows each peer of ``group`` sends here, given the rows sent to each (a count all-to-all)."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """``rows`` (grouped by destination, ``send_counts`` each) all-to-all over ``group``: the rows received,
    grouped by source, ``recv_counts`` each."""
    received = rows.new_zeros((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return received


# -- cost -----------------------------------------------------------------------------------------------


def hit_probability(num_experts: int, top_k: int, group_experts: int, drop: float = 0.0) -> float:
    """Probability that a token's k distinct uniform experts, each slot kept with probability 1 - drop,
    include one of a given ``group_experts`` experts (one rank's, or one node's):
    1 - sum_j C(g, j) C(E-g, k-j) / C(E, k) * drop^j.

    Example: E=256, k=8: a rank of 32 experts (W=8) is hit with 0.662, a node of 128 (N=2) with 0.9965.
    """
    total = math.comb(num_experts, top_k)
    miss = sum(math.comb(group_experts, j) * math.comb(num_experts - group_experts, top_k - j) / total * drop**j
               for j in range(0, min(group_experts, top_k) + 1))
    return 1.0 - miss


def expected_traffic(case, world_size: int, num_nodes: int) -> dict[str, float]:
    """Expected rows per rank under uniform routing (tokens: the mean over ranks); see the problems'
    docstrings. rows_network: copies a rank sends to (and gets from) other nodes; rows_nvlink: copies
    it forwards to (and gets from) other ranks of its node; rows_received: tokens dispatched to a rank;
    pairs: (token, expert) pairs a rank's experts hold."""
    tokens = sum(tokens_per_rank(case, world_size)) / world_size
    experts, top_k, drop = case["experts"], case["top_k"], case.get("drop", 0.0)
    gpus = world_size // num_nodes
    p_rank = hit_probability(experts, top_k, experts // world_size, drop)
    p_node = hit_probability(experts, top_k, experts // num_nodes, drop)
    return {"tokens": tokens,
            "rows_network": tokens * (num_nodes - 1) * p_node,
            "rows_nvlink": tokens * num_nodes * (gpus - 1) * p_rank,
            "rows_received": tokens * world_size * p_rank,
            "pairs": tokens * top_k * (1.0 - drop)}
