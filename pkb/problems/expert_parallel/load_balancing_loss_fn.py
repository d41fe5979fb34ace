"""MoE auxiliary load-balancing loss (Hugging Face Mixtral ``load_balancing_loss_func``), averaged over DP ranks.

Per rank: gate_logits [L*B*S, E] (the router logits of L layers concatenated, as Mixtral's
``output_router_logits`` gives them), num_experts E, top_k k, attention_mask [B, S] int64 or None
->  loss, a 0-d fp32 tensor, equal on every rank to the mean over ranks of each rank's loss:

    p = softmax(gate_logits, fp32);  chosen = top-k(p);  mask = one_hot(chosen, E)          [T, k, E]
    tokens_per_expert = mean over (unpadded) tokens of mask                                 [k, E]
    router_prob_per_expert = mean over (unpadded) tokens of p                               [E]
    loss_rank = E * sum(tokens_per_expert * router_prob_per_expert);  loss = all_reduce(loss_rank) / W

Padding tokens (attention_mask == 0) drop out of both means, as in Hugging Face. The softmax runs in
fp32; the upstream runs it, and the mean of the probabilities, in the logits' dtype, so for bf16 logits
each expert's mean probability carries up to two bf16 roundings: the tolerance allows 2 unit roundoffs
of the logits' dtype, relative. Tie rule: the logits of one token are distinct multiples of 1/64, so
top-k is unique (on logits, fp32 or bf16 probabilities alike: neighbours differ by e^(1/64), more
than a bf16 rounding can close). Each rank routes a different share of its tokens (0 to 60%) to one
favoured expert, so the ranks' losses differ by far more than the tolerance and a rank's own loss is
never the average.

Cost: the all-reduce of one fp32 scalar moves 2(W-1)/W * 4 bytes per rank (latency-bound).
HBM: read the logits once (T*E*bytes) and the mask (B*S*8 bytes). No matrix work; the elementwise
softmax and means are not counted as flops.

Benchmarks: a 4096-token sequence (B=1) through every MoE layer of Mixtral 8x7B (32 layers, 8
experts, top-2), Qwen3-30B-A3B (48 layers, 128 experts, top-8) and DeepSeek-V3 (58 MoE layers of 61,
256 routed experts, top-8; its sigmoid router is replaced by this softmax loss), from the models'
config.json files.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance
from pkb.problems.expert_parallel._common import dtype_of

LOGIT_GRID = 64  # logits are k / LOGIT_GRID for distinct integers k in [-256, 256): exact in bf16 and fp16


def distinct_logits(gen, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] logits, distinct within every row (so top-k has no ties), in [-4, 4)."""
    if cols > 512:
        raise ValueError(f"at most 512 distinct logits per row, asked for {cols}")
    keys = torch.rand(rows, 512, generator=gen, device=gen.device)
    picks = keys.topk(cols, dim=1).indices
    return ((picks - 256).to(torch.float32) / LOGIT_GRID).to(dtype)


def steer_(logits: torch.Tensor, fraction: float, expert: int, gen) -> torch.Tensor:
    """Swap each row's largest logit into column ``expert`` for a random ``fraction`` of the rows
    (the row's values stay distinct): a router that favours one expert on this rank's data."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    steered = torch.rand(logits.shape[0], generator=gen, device=gen.device) < fraction
    top = logits.argmax(dim=1)
    top_values, expert_values = logits[rows, top].clone(), logits[:, expert].clone()
    logits[rows[steered], top[steered]] = expert_values[steered]
    logits[steered, expert] = top_values[steered]
    return logits


def make_inputs(case, rank, world_size, gen):
    layers, batch = case.get("layers", 1), case.get("batch", 1)
    seq = case["seq"] + case.get("seq_step", 0) * rank
    gate_logits = distinct_logits(gen, layers * batch * seq, case["experts"], dtype_of(case))
    steer_(gate_logits, 0.6 * rank / max(world_size - 1, 1), rank % case["experts"], gen)
    attention_mask = None
    if case.get("padded"):  # right padding: every sequence keeps at least one real token
        lengths = torch.randint(1, seq + 1, (batch, 1), generator=gen, device=gen.device)
        attention_mask = (torch.arange(seq, device=gen.device) < lengths).to(torch.int64)
    return gate_logits, case["experts"], case["top_k"], attention_mask


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: gate_logits [T, E] ~ N(0, 1) in the run's dtype (ties possible), top-k, no mask."""
    gate_logits = torch.randn(case["seq"], case["experts"], dtype=dtype_of(case), device=device)
    return gate_logits, case["experts"], case["top_k"], None


def reference(gate_logits, num_experts, top_k=2, attention_mask=None):
    if isinstance(gate_logits, (tuple, list)):
        gate_logits = torch.cat(list(gate_logits), dim=0)
    routing_weights = torch.softmax(gate_logits.float(), dim=-1)                       # [T, E]
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts).float()                     # [T, k, E]
    if attention_mask is None:
        tokens_per_expert = expert_mask.mean(dim=0)
        router_prob_per_expert = routing_weights.mean(dim=0)
    else:
        batch, seq = attention_mask.shape
        layers = gate_logits.shape[0] // (batch * seq)
        token_mask = attention_mask.float()[None].expand(layers, batch, seq).reshape(-1)   # [T]
        tokens_per_expert = (expert_mask * token_mask[:, None, None]).sum(0) / token_mask.sum()
        router_prob_per_expert = (routing_weights * token_mask[:, None]).sum(0) / token_mask.sum()
    loss = (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * num_experts
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss / dist.get_world_size()


def tolerance(case, world_size, dtype):
    """The loss is fp32; bf16 / fp16 logits allow the upstream's two roundings of each expert's mean
    probability (2 unit roundoffs of the logits' dtype, relative) on top of the fp32 default."""
    fp32 = default_tolerance(torch.float32)
    rounding = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(dtype_of(case), 0.0)
    return Tolerance(atol=fp32.atol, rtol=fp32.rtol + 2 * rounding)


def cost(case, world_size):
    layers, batch, seq = case.get("layers", 1), case.get("batch", 1), case["seq"]
    logit_bytes = layers * batch * seq * case["experts"] * dtype_of(case).itemsize
    mask_bytes = batch * seq * 8 if case.get("padded") else 0
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 4, hbm_bytes=logit_bytes + mask_bytes,
                pattern="all_reduce (scalar)")


TESTS = (
    Case("uneven_tokens_top2", {"seq": 37, "seq_step": 6, "experts": 8, "top_k": 2},
         note="a different odd token count on every rank", tags=("uneven_sizes", "odd_sizes")),
    Case("padded_two_layers", {"layers": 2, "batch": 3, "seq": 7, "experts": 6, "top_k": 2, "padded": True},
         note="two layers' logits and right padding of random length", tags=("argument_value", "odd_sizes")),
    Case("top5_of_16", {"seq": 19, "experts": 16, "top_k": 5}, tags=("argument_value", "odd_sizes")),
)

BENCHMARKS = (
    Case("mixtral_8x7b_seq4096", {"layers": 32, "seq": 4096, "experts": 8, "top_k": 2}),
    Case("qwen3_30b_a3b_seq4096", {"layers": 48, "seq": 4096, "experts": 128, "top_k": 8}),
    Case("deepseek_v3_seq4096", {"layers": 58, "seq": 4096, "experts": 256, "top_k": 8}),
)

UPSTREAM = (
    Case("upstream", {"seq": 1024, "experts": 8, "top_k": 2}, note="gate_logits [1024, 8] bf16, top-2, no mask"),
)

PROBLEM = Problem(
    name="load_balancing_loss_fn", version=2, upstream_id=24, category="expert_parallel",
    source="Hugging Face transformers Mixtral load_balancing_loss_func, loss averaged over DP ranks",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
