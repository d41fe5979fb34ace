"""The expert-parallel MoE layer shared by fused_moe_fwd, fused_moe_fwd_lora and moe_ep_{balanced,wide,narrow}.

One forward (VeOmni MoE layer, the upstream benchmark's layout): router -> split sizes
(moe_token_preprocess) -> dispatch (moe_pre_all2all) -> SwiGLU MLP -> combine (moe_post_all2all).

    logits = hidden @ gate_weight.T + gate_bias                        [T, E]
    routing_weights, selected_experts = top-k(softmax(logits))         not renormalised
    y(x) = down_proj( silu(gate_proj(x)) * up_proj(x) )                this rank's MLP (nn.Linear, with bias)
    out[t] = sum_j routing_weights[t, j] * y_{rank of expert selected_experts[t, j]}(hidden[t])   [T, H]

Precision: hidden_states, the router, the modules and the adapters are in the run's precision (bf16
by default), as upstream's factory builds them; the output has the tokens' dtype.

Argument kinds follow the upstream (the argument list ends with group=None, as upstream passes it):
gate_proj, up_proj [I <- H] and down_proj [H <- I] are ``nn.Linear`` modules, one set per rank that
all of the rank's local experts share (so an expert's output depends on the rank holding it, not on
which of its local experts it is); with LoRA, six adapter tensors (gate/up A [r, H], B [I, r]; down A [r, I], B [H, r]) added to the three
projections, likewise shared. Every rank's modules and adapters are drawn from its own generator, so
a token sent to the wrong rank gets a different answer.

Precision: the router runs in fp32 (its inputs make the logits exact, below), the softmax weights
stay fp32, the MLP runs in the tokens' dtype as the modules run it (fp32 accumulation inside the
GEMM), and the weighted combine sums in fp32 and rounds once. The upstream ran the router and the
combine in bf16; both agree with this within the dtype's tolerance, and choose the same experts.

Tie rule (top-k is a discrete choice): hidden is a multiple of 1/4 in [-1, 1], gate_weight a
multiple of 2^-s and gate_bias of 1/16, so the logits are exact in fp32 in any summation order and
a bf16 router rounds each of them once. Every token's k-th and (k+1)-th largest logits are at
least 8 bf16 ulps of the row's largest magnitude apart (tokens closer than that are redrawn), so a
router in fp32 or bf16, on logits or on softmax probabilities, picks the same k experts.

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
BIAS_STEP = 1.0 / 16  # gate_bias is a multiple of 1/16 in [-1/2, 1/2]
SKEW_LOGIT = 8.0
GAP_ULPS = 8  # the k-th and (k+1)-th logits of a token are at least this many bf16 ulps apart
MAX_REDRAWS = 10_000


def router_weight_step(hidden: int) -> float:
    """Grid step of gate_weight: 2^-ceil(log2(sqrt(H))), so the logits' spread is about 1 at any H."""
    return 2.0 ** -math.ceil(math.log2(math.sqrt(hidden)))


# -- inputs ---------------------------------------------------------------------------------------------


def _grid(gen, shape, low: int, high: int, step: float) -> torch.Tensor:
    """fp32 integers in [low, high] times ``step`` (exact in bf16 for small integers and power-of-two steps)."""
    return torch.randint(low, high + 1, shape, generator=gen, device=gen.device).float() * step


def _too_close(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] bool: rows whose k-th and (k+1)-th largest logits are under GAP_ULPS bf16 ulps apart."""
    if top_k >= logits.shape[1] or logits.shape[0] == 0:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    top = logits.topk(top_k + 1, dim=1).values
    magnitude = logits.abs().amax(dim=1).clamp_min(1.0)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - 7)  # bf16 spacing at the row's largest logit
    return top[:, top_k - 1] - top[:, top_k] < GAP_ULPS * ulp


def router_inputs(case, num_tokens: int, num_experts: int, top_k: int, ep_size: int, gen):
    """(hidden_states [T, H], gate_weight [E, H], gate_bias [E]): hidden per rank, router replicated.

    Rows whose top-k choice is close to a tie are redrawn (see the module docstring)."""
    hidden, dtype = case["hidden"], dtype_of(case)
    gate_weight = _grid(gen.shared, (num_experts, hidden), -3, 3, router_weight_step(hidden))
    gate_bias = _grid(gen.shared, (num_experts,), -8, 8, BIAS_STEP)
    skew = case.get("skew", False)
    if skew:
        local = num_experts // ep_size
        gate_weight[:, 0] = 0.0
        gate_weight[num_experts - local:, 0] = SKEW_LOGIT
        gate_weight[:local, 0] = -SKEW_LOGIT
    hidden_states = _grid(gen, (num_tokens, hidden), -4, 4, HIDDEN_STEP)
    weight64, bias64 = gate_weight.double(), gate_bias.double()
    redraw = torch.arange(num_tokens, device=gen.device)
    for _ in range(MAX_REDRAWS):
        if skew:
            hidden_states[redraw, 0] = 1.0
        logits = hidden_states[redraw].double() @ weight64.T + bias64
        redraw = redraw[_too_close(logits, top_k)]
        if redraw.numel() == 0:
            break
        hidden_states[redraw] = _grid(gen, (redraw.numel(), hidden), -4, 4, HIDDEN_STEP)
    else:
        raise RuntimeError(f"no well-separated routing after {MAX_REDRAWS} redraws ({redraw.numel()} tokens left)")
    return hidden_states.to(dtype), gate_weight.to(dtype), gate_bias.to(dtype)


def linear_module(gen, in_features: int, out_features: int, dtype, scale: float) -> torch.nn.Linear:
    """An ``nn.Linear`` on ``gen``'s device with weight ~ N(0, scale^2) and bias ~ N(0, (scale/4)^2)."""
    layer = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, device=gen.device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(randn(gen, out_features, in_features, scale=scale))
        layer.bias.copy_(randn(gen, out_features, scale=scale / 4))
    return layer


def expert_inputs(case, gen, lora_rank: int = 0) -> tuple:
    """This rank's MLP: (gate_proj, up_proj, down_proj) as nn.Linear and, with ``lora_rank``, then
    (lora_gate_A [r, H], lora_gate_B [I, r], lora_up_A [r, H], lora_up_B [I, r], lora_down_A [r, I],
    lora_down_B [H, r]). Scaled so the layer's output has a spread of about 0.15 (a bf16 combine like
    the upstream's then rounds well inside the dtype's default tolerance) and each LoRA path adds
    about half its base projection."""
    hidden, inter, dtype = case["hidden"], case["intermediate"], dtype_of(case)
    modules = (linear_module(gen, hidden, inter, dtype, 2.0 * hidden ** -0.5),        # gate
               linear_module(gen, hidden, inter, dtype, 2.0 * hidden ** -0.5),        # up
               linear_module(gen, inter, hidden, dtype, 0.25 * inter ** -0.5))        # down
    if not lora_rank:
        return modules
    r = lora_rank
    scales = (hidden ** -0.5, r ** -0.5, hidden ** -0.5, r ** -0.5, inter ** -0.5, 0.125 * r ** -0.5)
    return modules + tuple(randn(gen, *shape, dtype=dtype, scale=scale)
                           for shape, scale in zip(lora_shapes(hidden, inter, r), scales))


def lora_shapes(hidden: int, inter: int, lora_rank: int) -> tuple:
    """Shapes of the six adapters: gate A [r, H], B [I, r]; up A [r, H], B [I, r]; down A [r, I], B [H, r]."""
    r = lora_rank
    return (r, hidden), (inter, r), (r, hidden), (inter, r), (r, inter), (hidden, r)


def layer_inputs(case, rank: int, world_size: int, gen, num_experts: int, top_k: int, ep_size: int,
                 lora_rank: int = 0) -> tuple:
    """The whole argument list of the layer for ``rank`` (its EP group has ``ep_size`` ranks), ending with
    group=None as upstream passes it."""
    num_tokens = tokens_per_rank(case, world_size)[rank]
    hidden_states, gate_weight, gate_bias = router_inputs(case, num_tokens, num_experts, top_k, ep_size, gen)
    return (hidden_states, gate_weight, gate_bias, *expert_inputs(case, gen, lora_rank), num_experts, top_k, None)


def upstream_layer_inputs(case, device, num_experts: int, top_k: int, lora_rank: int = 0) -> tuple:
    """Upstream's draws, in its order: hidden, gate_weight, gate_bias ~ N(0, 1) in the run's dtype (ties in the
    router possible); gate, up, down ``nn.Linear`` with torch's default init (built in fp32 on the CPU, then
    moved and cast); with ``lora_rank`` the six adapters ~ N(0, 1). The argument list ends with group=None."""
    hidden, inter, dtype = case["hidden"], case["intermediate"], dtype_of(case)
    hidden_states = torch.randn(case["tokens"], hidden, dtype=dtype, device=device)
    gate_weight = torch.randn(num_experts, hidden, dtype=dtype, device=device)
    gate_bias = torch.randn(num_experts, dtype=dtype, device=device)
    modules = tuple(torch.nn.Linear(features_in, features_out).to(device=device, dtype=dtype)
                    for features_in, features_out in ((hidden, inter), (hidden, inter), (inter, hidden)))
    adapters = tuple(torch.randn(shape, dtype=dtype, device=device)
                     for shape in (lora_shapes(hidden, inter, lora_rank) if lora_rank else ()))
    return (hidden_states, gate_weight, gate_bias, *modules, *adapters, num_experts, top_k, None)


# -- the forward ----------------------------------------------------------------------------------------


def _mlp(x, gate_proj, up_proj, down_proj, lora):
    """The rank's SwiGLU MLP over every dispatched row, in the rows' dtype as the modules run it."""
    gate, up = gate_proj(x), up_proj(x)
    if lora is not None:
        gate_A, gate_B, up_A, up_B, down_A, down_B = lora
        gate = gate + F.linear(F.linear(x, gate_A), gate_B)
        up = up + F.linear(F.linear(x, up_A), up_B)
    act = F.silu(gate) * up
    out = down_proj(act)
    if lora is not None:
        out = out + F.linear(F.linear(act, down_A), down_B)
    return out


def moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                group=None, lora=None):
    """[T, H] output of the EP MoE layer on this rank (see the module docstring)."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = tokens.float() @ gate_weight.float().T
    if gate_bias is not None:
        logits = logits + gate_bias.float()
    routing_weights, selected_experts = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts).permute(2, 1, 0)               # [E, k, T] int64
    input_splits, output_splits, per_local, _ = preprocess(expert_mask, num_experts, group)
    input_splits, output_splits = input_splits.tolist(), output_splits.tolist()
    dispatched, routing_map, mapping, shape = token_pre_all2all(tokens, expert_mask, num_experts, input_splits,
                                                               output_splits, per_local, group)
    expert_out = _mlp(dispatched, gate_proj, up_proj, down_proj, lora)
    combined = tokens_post_all2all(expert_out, routing_weights, selected_experts, num_experts, input_splits,
                                   output_splits, per_local, routing_map, mapping, shape, group)
    return combined.to(hidden_states.dtype)


# -- cost -----------------------------------------------------------------------------------------------


def moe_cost(case, num_experts: int, top_k: int, ep_size: int, lora_rank: int = 0) -> Cost:
    """Per-rank cost of one forward with ``case["tokens"]`` tokens per rank and uniform routing.

    link: dispatch and combine each move a token's row once per other EP rank holding one of its
          experts (expected_remote_ranks), 2 * T * H * bytes * R, plus the all-gather of E int64
          counts, (ep-1) * E * 8.
    flops: router 2*T*H*E; on average T*k dispatched rows per rank (balanced), each 3 GEMVs of
          H x I (2*3*H*I) plus, with LoRA rank r, 2*r*(3H + 3I); the weighted combine 2*T*k*H.
    hbm: the rank's MLP (3 H x I weights and 2I + H biases, one set for all its local experts) and
          adapters, and the router, read once; hidden in and out.
    """
    tokens, hidden, inter = case["tokens"], case["hidden"], case["intermediate"]
    item = dtype_of(case).itemsize
    remote = expected_remote_ranks(num_experts, top_k, ep_size)
    link = 2 * tokens * hidden * item * remote + (ep_size - 1) * num_experts * 8
    pairs = tokens * top_k
    per_row = 6 * hidden * inter + 2 * lora_rank * (3 * hidden + 3 * inter)
    flops = 2 * tokens * hidden * num_experts + pairs * per_row + 2 * pairs * hidden
    weights = 3 * hidden * inter + 2 * inter + hidden + num_experts * (hidden + 1)
    if lora_rank:
        weights += 3 * lora_rank * hidden + 3 * lora_rank * inter
    return Cost(link_bytes=link, flops=flops, hbm_bytes=(weights + 2 * tokens * hidden) * item,
                pattern="all_gather + all_to_all x2 (dispatch, combine)")
