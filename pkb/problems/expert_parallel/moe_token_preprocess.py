"""EP split sizes from the routing mask (VeOmni MoE ``preprocess``).

Per rank r: expert_mask [E, k, T] fp32 (in every precision, as upstream's factory makes it), the
one-hot of each token's k experts as VeOmni's ``one_hot(selected_experts, E).permute(2, 1, 0)`` gives
it: a permuted, non-contiguous view (strides (1, E, k*E)), as upstream passes it; num_experts E
(E % W == 0; rank r holds experts [r*E/W, (r+1)*E/W)); group None  ->  on rank r, four CPU tensors:
    input_splits            [W]       int64: tokens r sends to rank d (its counts for d's experts)
    output_splits           [W]       int64: tokens r receives from rank s
    tokens_per_local_expert [W, E/W]  mask dtype: tokens rank s routes to each of r's experts
    sum_per_local_expert    [E/W]     mask dtype: tokens each of r's experts receives in all
The counts are the mask's sums in its own dtype (fp32 sums of 0/1 are exact integers), all-gathered
as such; the split lists are int64, and all four are copied to the host as the upstream does (its
callers turn the splits into Python lists). All outputs are checked exactly.

Inputs: every rank's routing is drawn from ``gen.shared`` (k distinct experts per token). Tests
include a rank with no tokens (it sends nothing) and skewed routing where the last rank's experts
receive nearly every token and rank 0's experts none. The upstream case: 1024 tokens, 8 experts, top-2.

Cost: all-gather of E counts (4 bytes each in fp32) per rank: each rank receives (W-1) * E * 4 bytes.
HBM: read the mask (E*k*T*4 bytes). No flops worth counting (a reduction of the mask).

Benchmarks: 4096 tokens per rank routed the way Mixtral 8x7B (8 experts, top-2), Qwen3-30B-A3B
(128, top-8) and DeepSeek-V3 (256, top-8) route them (config.json), at EP 4 and 8.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.expert_parallel._common import draw_selected_experts, tokens_per_rank


def make_inputs(case, rank, world_size, gen):
    tokens = tokens_per_rank(case, world_size)
    selected = draw_selected_experts(gen.shared, tokens, case["experts"], case["top_k"], world_size,
                                     case.get("skew", False))[rank]
    expert_mask = F.one_hot(selected, case["experts"]).to(torch.float32).permute(2, 1, 0)  # a view, as upstream's
    return expert_mask, case["experts"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: each token's k experts drawn independently with ``randint`` (a token may pick one expert
    twice), then the same permuted fp32 one-hot view."""
    selected = torch.randint(0, case["experts"], (case["tokens"], case["top_k"]), device=device)
    return F.one_hot(selected, case["experts"]).float().permute(2, 1, 0), case["experts"], None


def reference(expert_mask, num_experts, group=None):
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    num_local_experts = num_experts // world_size
    tokens_per_expert = expert_mask.sum(dim=(1, 2))                                          # [E], mask dtype
    input_splits = tokens_per_expert.view(world_size, num_local_experts).sum(dim=1)
    gathered = tokens_per_expert.new_empty(world_size * num_experts)
    dist.all_gather_into_tensor(gathered, tokens_per_expert.contiguous(), group=group)
    tokens_per_local_expert = gathered.view(world_size, num_experts)[
        :, rank * num_local_experts:(rank + 1) * num_local_experts].contiguous()                 # [W, E/W]
    output_splits = tokens_per_local_expert.sum(dim=1)
    host = torch.device("cpu")
    return (input_splits.to(host, torch.int64), output_splits.to(host, torch.int64),
            tokens_per_local_expert.to(host),
            tokens_per_local_expert.sum(dim=0).to(host))


def cost(case, world_size):
    mask_bytes = case["experts"] * case["top_k"] * case["tokens"] * 4
    return Cost(link_bytes=(world_size - 1) * case["experts"] * 4, hbm_bytes=mask_bytes, pattern="all_gather")


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": 8, "top_k": 2},
         note="the upstream factory's defaults: M = 1024 tokens, 8 experts, top-2, a permuted fp32 mask view"),
)

TESTS = (
    Case("uneven_with_empty_rank", {"tokens": 13, "tokens_step": 4, "empty_rank": 1, "experts": 8, "top_k": 3},
         note="rank 1 holds no tokens and sends nothing",
         tags=("uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
    Case("skewed_hot_last_rank", {"tokens": 29, "experts": 16, "top_k": 2, "skew": True},
         note="the last rank's experts get nearly all tokens, rank 0's experts none",
         tags=("skewed", "uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),
)

BENCHMARKS = (
    Case("mixtral_8x7b_ep8", {"tokens": 4096, "experts": 8, "top_k": 2}, world_sizes=(8,)),
    Case("qwen3_30b_a3b_ep4", {"tokens": 4096, "experts": 128, "top_k": 8}, world_sizes=(4,)),
    Case("deepseek_v3_ep8", {"tokens": 4096, "experts": 256, "top_k": 8}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="moe_token_preprocess", version=3, upstream_id=26, category="expert_parallel",
    source="VeOmni MoE preprocess (EP split sizes)", world_sizes=(2, 4, 8),
    upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
