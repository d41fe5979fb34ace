"""The expert-parallel MoE layer shared by fused_moe_fwd, fused_moe_fwd_lora and moe_ep_{balanced,wide,narrow}.

One forward (VeOmni MoE layer): router -> split sizes (moe_token_preprocess) -> dispatch
(moe_pre_all2all) -> SwiGLU experts -> combine (moe_post_all2all), all in fp32 after the bf16 inputs,
the output rounded once to bf16.

    logits = hidden @ gate_weight.T + gate_bias                      [T, E] fp32
    routing_weights, selected_experts = top-k(softmax(logits)); routing_weights /= their sum
    y_e(x) = down_e( silu(gate_e(x)) * up_e(x) )                     expert e's SwiGLU MLP
    out[t] = sum_j routing_weights[t, j] * y_{selected_experts[t, j]}(hidden[t])

Expert weights per local expert (VeOmni's fused layout): gate_proj, up_proj [E_local, I, H],
down_proj [E_local, H, I], no biases; every expert's weights are distinct (the upstream shared one
nn.Linear set among all local experts, so every expert computed the same function). With LoRA, the
factors on the hidden side are shared by all experts (gate/up A [r, H], down B [H, r]; these are the
gradients moe_epgroupgemm_lora_backward all-reduces) and those on the intermediate side are per
expert (gate/up B [E_local, I, r], down A [E_local, r, I]):
    gate_e(x) = x W_g[e].T + (x A_g.T) B_g[e].T, and so on; the LoRA scale is folded into B.

Tie rule: router inputs lie on grids that make every logit exact in fp32 in any summation order:
hidden is a multiple of 1/4 in [-1, 1], gate_weight a multiple of 2^-s, and gate_bias adds a distinct
multiple of 2^-(s+10) per expert (j / 256 of a grid step, j a permutation of the experts). So the
logits of one token are distinct and exact, top-k is unique, and a kernel that takes top-k of the
logits or of the fp32 softmax picks the same experts as the reference.

Skewed cases add a constant feature hidden[:, 0] = 1 whose router weights are +8 for the last EP
rank's experts and -8 for EP rank 0's: the last rank receives (nearly) every token, rank 0 none.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pkb.problem import Cost, randn
from pkb.problems.expert_parallel._common import dtype_of, expected_remote_ranks, tokens_per_rank
from pkb.problems.expert_parallel.moe_post_all2all import reference as tokens_post_all2all
from pkb.problems.expert_parallel.moe_pre_all2all import reference as token_pre_all2all
from pkb.problems.expert_parallel.moe_token_preprocess import reference as preprocess

HIDDEN_STEP = 0.25  # hidden_states are multiples of 1/4 in [-1, 1]
SKEW_LOGIT = 8.0


def router_weight_step(hidden: int) -> float:
    """Grid step of gate_weight: 2^-ceil(log2(sqrt(H))), so the logits' spread is about 1 at any H."""
    return 2.0 ** -math.ceil(math.log2(math.sqrt(hidden)))


# -- inputs ---------------------------------------------------------------------------------------------


def _grid(gen, shape, low: int, high: int, step: float, dtype) -> torch.Tensor:
    """Integers in [low, high] times ``step`` (exact in bf16 for small integers and power-of-two steps)."""
    return (torch.randint(low, high + 1, shape, generator=gen, device=gen.device).float() * step).to(dtype)


def router_inputs(case, rank: int, num_tokens: int, num_experts: int, ep_size: int, gen):
    """(hidden_states [T, H], gate_weight [E, H], gate_bias [E]): hidden per rank, router replicated."""
    hidden, dtype = case["hidden"], dtype_of(case)
    step = router_weight_step(hidden)
    hidden_states = _grid(gen, (num_tokens, hidden), -4, 4, HIDDEN_STEP, dtype)
    gate_weight = _grid(gen.shared, (num_experts, hidden), -3, 3, step, dtype)
    order = torch.randperm(num_experts, generator=gen.shared, device=gen.device)
    gate_bias = (order.float() * (HIDDEN_STEP * step / 256)).to(dtype)
    if case.get("skew"):
        local = num_experts // ep_size
        hidden_states[:, 0] = 1.0
        gate_weight[:, 0] = 0.0
        gate_weight[num_experts - local:, 0] = SKEW_LOGIT
        gate_weight[:local, 0] = -SKEW_LOGIT
    return hidden_states, gate_weight, gate_bias


def _expert_generator(base_seed: int, expert: int, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((base_seed + 1_000_003 * expert) % (2**63 - 1))
    return gen


def expert_inputs(case, ep_rank: int, num_experts: int, ep_size: int, gen, lora_rank: int = 0) -> tuple:
    """Weights of EP rank ``ep_rank``'s experts, drawn per global expert id from a seed shared by all ranks
    (so EP replicas of one expert hold the same weights and different experts never do).

    Returns (gate_proj, up_proj, down_proj) and, with ``lora_rank``, then
    (lora_gate_A, lora_gate_B, lora_up_A, lora_up_B, lora_down_A, lora_down_B).
    """
    hidden, inter, dtype = case["hidden"], case["intermediate"], dtype_of(case)
    local = num_experts // ep_size
    base_seed = int(torch.randint(0, 2**62, (1,), generator=gen.shared, device=gen.device))
    lora_shared = [randn(gen.shared, lora_rank, hidden, dtype=dtype, scale=hidden ** -0.5),   # gate A
                   randn(gen.shared, lora_rank, hidden, dtype=dtype, scale=hidden ** -0.5),   # up A
                   randn(gen.shared, hidden, lora_rank, dtype=dtype, scale=0.5 * max(lora_rank, 1) ** -0.5)]  # down B
    per_expert = []
    for expert in range(ep_rank * local, (ep_rank + 1) * local):
        g = _expert_generator(base_seed, expert, gen.device)
        weights = [randn(g, inter, hidden, dtype=dtype, scale=hidden ** -0.5),              # gate
                   randn(g, inter, hidden, dtype=dtype, scale=hidden ** -0.5),              # up
                   randn(g, hidden, inter, dtype=dtype, scale=2.0 * inter ** -0.5)]         # down
        if lora_rank:
            weights += [randn(g, inter, lora_rank, dtype=dtype, scale=0.5 * lora_rank ** -0.5),  # gate B
                        randn(g, inter, lora_rank, dtype=dtype, scale=0.5 * lora_rank ** -0.5),  # up B
                        randn(g, lora_rank, inter, dtype=dtype, scale=inter ** -0.5)]            # down A
        per_expert.append(weights)
    stacked = [torch.stack([w[i] for w in per_expert]) for i in range(len(per_expert[0]))]
    base = tuple(stacked[:3])
    if not lora_rank:
        return base
    gate_B, up_B, down_A = stacked[3:]
    return base + (lora_shared[0], gate_B, lora_shared[1], up_B, down_A, lora_shared[2])


def layer_inputs(case, rank: int, world_size: int, gen, num_experts: int, top_k: int, ep_size: int,
                 lora_rank: int = 0) -> tuple:
    """The whole argument list of the layer for ``rank`` (EP rank = rank % ep_size)."""
    num_tokens = tokens_per_rank(case, world_size)[rank]
    ep_rank = rank % ep_size
    hidden_states, gate_weight, gate_bias = router_inputs(case, ep_rank, num_tokens, num_experts, ep_size, gen)
    experts = expert_inputs(case, ep_rank, num_experts, ep_size, gen, lora_rank)
    return (hidden_states, gate_weight, gate_bias, *experts, num_experts, top_k)


# -- the forward ----------------------------------------------------------------------------------------


def _linear(x, weight):
    return x @ weight.to(x.dtype).T


def _experts(tokens, tokens_per_expert, gate_proj, up_proj, down_proj, lora):
    """SwiGLU of each local expert over its contiguous block of ``tokens``, in the tokens' dtype as
    grouped-GEMM MoE kernels run it (fp32 accumulation inside the GEMM library); the combine that
    follows weights and sums in fp32."""
    out = torch.empty(tokens.shape[0], down_proj.shape[1], dtype=tokens.dtype, device=tokens.device)
    start = 0
    for expert, count in enumerate(int(c) for c in tokens_per_expert.tolist()):
        x = tokens[start:start + count]
        gate, up = _linear(x, gate_proj[expert]), _linear(x, up_proj[expert])
        if lora is not None:
            gate_A, gate_B, up_A, up_B, down_A, down_B = lora
            gate = gate + _linear(_linear(x, gate_A), gate_B[expert])
            up = up + _linear(_linear(x, up_A), up_B[expert])
        act = F.silu(gate) * up
        y = _linear(act, down_proj[expert])
        if lora is not None:
            y = y + _linear(_linear(act, down_A[expert]), down_B)
        out[start:start + count] = y
        start += count
    return out


def moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                group=None, lora=None):
    """[T, H] output of the EP MoE layer on this rank (see the module docstring)."""
    hidden_dim = hidden_states.shape[-1]
    tokens = hidden_states.reshape(-1, hidden_dim)
    logits = tokens.float() @ gate_weight.float().T + gate_bias.float()
    routing_weights, selected_experts = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    expert_mask = F.one_hot(selected_experts, num_experts).permute(2, 1, 0)               # [E, k, T]
    input_splits, output_splits, per_local, sum_per_local = preprocess(expert_mask, num_experts, group)
    input_splits, output_splits = input_splits.tolist(), output_splits.tolist()
    dispatched, routing_map, mapping, shape = token_pre_all2all(tokens, expert_mask, num_experts, input_splits,
                                                               output_splits, per_local, group)
    expert_out = _experts(dispatched, sum_per_local, gate_proj, up_proj, down_proj, lora)
    combined = tokens_post_all2all(expert_out, routing_weights, selected_experts, num_experts, input_splits,
                                   output_splits, per_local, routing_map, mapping, shape, group)
    return combined.to(hidden_states.dtype).reshape(hidden_states.shape)


# -- cost -----------------------------------------------------------------------------------------------


def moe_cost(case, num_experts: int, top_k: int, ep_size: int, lora_rank: int = 0) -> Cost:
    """Per-rank cost of one forward with ``case["tokens"]`` tokens per rank and uniform routing.

    link: dispatch and combine each move a token's row once per other EP rank holding one of its
          experts (expected_remote_ranks), 2 * T * H * bytes * R, plus the all-gather of E int64
          counts, (ep-1) * E * 8.
    flops: router 2*T*H*E; on average T*k token-expert pairs per rank (balanced), each 3 GEMVs of
          H x I (2*3*H*I) plus, with LoRA rank r, 2*r*(3H + 3I); the weighted combine 2*T*k*H.
    hbm: the local experts' weights and the router, read once; hidden in and out.
    """
    tokens, hidden, inter = case["tokens"], case["hidden"], case["intermediate"]
    item = dtype_of(case).itemsize
    local = num_experts // ep_size
    remote = expected_remote_ranks(num_experts, top_k, ep_size)
    link = 2 * tokens * hidden * item * remote + (ep_size - 1) * num_experts * 8
    pairs = tokens * top_k
    flops = 2 * tokens * hidden * num_experts + pairs * (6 * hidden * inter + 2 * lora_rank * (3 * hidden + 3 * inter)) \
        + 2 * pairs * hidden
    weights = local * 3 * hidden * inter + num_experts * (hidden + 1)
    if lora_rank:
        weights += 3 * lora_rank * hidden + local * 3 * lora_rank * inter
    return Cost(link_bytes=link, flops=flops, hbm_bytes=(weights + 2 * tokens * hidden) * item,
                pattern="all_gather + all_to_all x2 (dispatch, combine)")
