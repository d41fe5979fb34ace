"""Routing, split sizes and chunk re-sorting shared by the expert-parallel problems.

Routing is drawn so that communication cannot be skipped and so that an honest kernel can match it
exactly:
- every rank's token-to-expert choice is drawn from ``gen.shared`` for *all* ranks, so each rank can
  derive split sizes that agree with what the other ranks will send (the upstream used synthetic
  uniform splits that did not follow the routing);
- ``skew=True`` gives the last (EP) rank's experts almost every token and rank 0's experts none,
  so one rank receives (nearly) everything and one receives nothing;
- a case may name an ``empty_rank`` that holds no tokens at all and so sends nothing;
- ``balanced=True`` gives every expert exactly T*k/E of each rank's tokens (the upstream cases of the
  dispatch and combine problems: upstream's split sizes and per-expert counts are equal on every rank,
  and here they are equal and also follow the routing).
"""

from __future__ import annotations

import math

import torch

SKEW_HOT_WEIGHT = 1000.0  # sampling weight of the hot rank's experts (others 1, the cold rank's 0)


def dtype_of(case) -> torch.dtype:
    return getattr(torch, case.get("dtype", "bfloat16"))


def tokens_per_rank(case, world_size: int) -> list[int]:
    """Tokens each rank holds: ``tokens`` (+ ``tokens_step`` * rank when uneven); ``empty_rank`` holds 0.

    Example: tokens=11, tokens_step=4, empty_rank=1 at W=4  ->  [11, 0, 19, 23].
    """
    counts = [case["tokens"] + case.get("tokens_step", 0) * rank for rank in range(world_size)]
    empty = case.get("empty_rank")
    if empty is not None:
        counts[empty % world_size] = 0
    return counts


def expert_sampling_weights(num_experts: int, ep_size: int, skew: bool, device) -> torch.Tensor:
    """Per-expert sampling weights: uniform, or hot last EP rank / cold EP rank 0 when ``skew``."""
    weights = torch.ones(num_experts, device=device)
    if skew:
        local = num_experts // ep_size
        weights[:local] = 0.0
        weights[num_experts - local:] = SKEW_HOT_WEIGHT
    return weights


def draw_selected_experts(gen_shared: torch.Generator, tokens: list[int], num_experts: int, top_k: int,
                          ep_size: int, skew: bool) -> list[torch.Tensor]:
    """``selected_experts`` [T_r, top_k] int64 for every rank r: distinct experts per token, random order."""
    weights = expert_sampling_weights(num_experts, ep_size, skew, gen_shared.device)
    if int((weights > 0).sum()) < top_k:
        raise ValueError(f"top_k={top_k} needs at least that many experts outside the cold rank")
    selected = []
    for num_tokens in tokens:
        if num_tokens == 0:
            selected.append(torch.empty(0, top_k, dtype=torch.int64, device=gen_shared.device))
        else:
            selected.append(torch.multinomial(weights.expand(num_tokens, -1), top_k, replacement=False,
                                              generator=gen_shared))
    return selected


def draw_balanced_experts(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """``selected_experts`` [T, k] int64 with k distinct experts per token and every expert chosen by exactly
    T*k/E tokens: a random arrangement of that multiset, then each repeated expert in a row swapped with
    a random slot of another row that takes it without a repeat on either side.

    Example: T=1024, k=2, E=8  ->  every expert holds 256 of the 2048 (token, choice) slots.
    """
    if (num_tokens * top_k) % num_experts or top_k > num_experts:
        raise ValueError(f"balanced routing needs E | T*k and k <= E, got T={num_tokens} k={top_k} E={num_experts}")
    device = gen.device
    slots = torch.arange(num_experts, device=device).repeat_interleave(num_tokens * top_k // num_experts)
    selected = slots[torch.randperm(slots.numel(), generator=gen, device=device)].view(num_tokens, top_k)
    ordered = selected.sort(dim=1).values
    repeating = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero().view(-1).tolist()
    for row in repeating:  # a swap below never gives the other row a repeat
        for col in range(1, top_k):
            expert = selected[row, col]
            if not bool((selected[row, :col] == expert).any()):
                continue
            # another row without this expert, and a slot there whose expert this row lacks
            fits = ~(selected == expert).any(dim=1, keepdim=True) & ~torch.isin(selected, selected[row])
            candidates = fits.view(-1).nonzero().view(-1)
            if candidates.numel() == 0:
                raise RuntimeError(f"no balanced routing found for T={num_tokens} k={top_k} E={num_experts}")
            pick = int(candidates[torch.randint(0, candidates.numel(), (1,), generator=gen, device=device)])
            other_row, other_col = divmod(pick, top_k)
            selected[row, col], selected[other_row, other_col] = selected[other_row, other_col].clone(), expert.clone()
    return selected


def token_counts(selected: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[W, E] int64: tokens rank s routes to expert e."""
    return torch.stack([torch.bincount(s.reshape(-1), minlength=num_experts) for s in selected])


def split_sizes(counts_WE: torch.Tensor, rank: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(input_splits, output_splits, num_global_tokens_per_local_expert [W, E_local]) of ``rank``.

    input_splits[d]: tokens ``rank`` sends to EP rank d; output_splits[s]: tokens it receives from s.
    """
    world_size, num_experts = counts_WE.shape
    local = num_experts // world_size
    input_splits = counts_WE[rank].view(world_size, local).sum(1).tolist()
    per_local = counts_WE[:, rank * local:(rank + 1) * local].contiguous()
    return input_splits, per_local.sum(1).tolist(), per_local


def sort_chunks_by_idxs(tokens: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor) -> torch.Tensor:
    """Split ``tokens`` along dim 0 into chunks of ``split_sizes`` and concatenate them in ``sorted_idxs`` order."""
    chunks = torch.split(tokens, [int(s) for s in split_sizes.tolist()], dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


def expected_remote_ranks(num_experts: int, top_k: int, ep_size: int) -> float:
    """Expected number of *other* EP ranks a token's ``top_k`` distinct experts live on (uniform routing).

    A rank holds E/ep of the E experts; it is missed with probability C(E - E/ep, k) / C(E, k).
    Example: E=8, k=2, ep=4: each of the 3 other ranks is hit with 1 - C(6,2)/C(8,2) = 13/28.
    """
    local = num_experts // ep_size
    miss = math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)
    return (ep_size - 1) * (1.0 - miss)


def permutation_mapping(routing_map_ET: torch.Tensor) -> torch.Tensor:
    """[T*k] int64 token indices grouped by expert (expert 0's tokens first, each group in token order)."""
    num_experts, num_tokens = routing_map_ET.shape
    token_indices = torch.arange(num_tokens, device=routing_map_ET.device).unsqueeze(0).expand(num_experts, -1)
    return token_indices.masked_select(routing_map_ET.bool())


def routed_case(case, rank: int, world_size: int, gen):
    """Routing of every rank for a dispatch/combine case: (tokens, selected_all, input_splits,
    output_splits, num_global_tokens_per_local_expert) with ``rank``'s split sizes."""
    tokens = tokens_per_rank(case, world_size)
    if case.get("balanced"):
        selected = [draw_balanced_experts(gen.shared, num_tokens, case["experts"], case["top_k"])
                    for num_tokens in tokens]
    else:
        selected = draw_selected_experts(gen.shared, tokens, case["experts"], case["top_k"], world_size,
                                         case.get("skew", False))
    input_splits, output_splits, per_local = split_sizes(token_counts(selected, case["experts"]), rank)
    return tokens, selected, input_splits, output_splits, per_local


# -- upstream's values (the paper's verdict) --------------------------------------------------------------


def upstream_routing(num_tokens: int, num_experts: int, top_k: int, device) -> torch.Tensor:
    """Upstream's routing draws (dispatch and combine): for each token in turn the first ``top_k`` of
    ``torch.randperm(num_experts)``; [T, k] int64 in draw order (k distinct experts per token)."""
    return torch.stack([torch.randperm(num_experts, device=device)[:top_k] for _ in range(num_tokens)])


def upstream_split_sizes(total: int, world_size: int) -> list[int]:
    """Upstream's synthetic split list: ``total // W`` rows to every rank, the remainder to the last one.

    Example: total=10, W=4  ->  [2, 2, 2, 4].
    """
    splits = [total // world_size] * world_size
    splits[-1] += total % world_size
    return splits


def upstream_tokens_per_local_expert(total: int, world_size: int, num_local_experts: int, device) -> torch.Tensor:
    """Upstream's synthetic counts [W, E/W] int64: ``total`` spread evenly over the W * E/W slots, the
    first ``total % (W * E/W)`` slots one more (they ignore the routing, as upstream's do)."""
    num_slots = world_size * num_local_experts
    flat = torch.full((num_slots,), total // num_slots, dtype=torch.long, device=device)
    flat[:total % num_slots] += 1
    return flat.view(world_size, num_local_experts)
