"""Two pipeline stages, each an attention block run with ring attention (ring-flash-attention + Megatron's
pp-cp rank layout).

Mesh: pp = 2 stages, cp = W/2 ranks per stage, stage-major (rank = stage * cp + cp_index). The
sequence is split contiguously over cp (cp rank c holds tokens [c*S_local, (c+1)*S_local)).
Each stage s has its own weights w_qkv [3E, E] (rows q | k | v) and w_o [E, E], the same on all
cp ranks of the stage. A stage computes
  q, k, v = split(x @ w_qkv^T) (fp32 accumulate, bf16), num_heads heads of D = E/num_heads;
  ring attention over cp_group (contiguous layout, causal skip, LSE merge, fp32), bf16;
  y = attn @ w_o^T (fp32 accumulate, bf16).
Stage 0 runs on its hidden_states and sends y to the stage-1 rank of the same cp index (a broadcast
over that rank pair's pp_group), which runs stage 1 on it. pp_group None (or of size 1) is one stage.
Per rank: hidden_states [B, S_local, E] (on stage 1 only the shape and dtype of the activation it
receives: its values are ignored, as upstream's are)  ->  this stage's own output y [B, S_local, E] bf16.

Cost: one stage per rank. A single call's latency is two stages end to end, but the harness times
back-to-back calls, in which stage 0 starts the next call while stage 1 finishes this one; so the bound
is one stage per rank (a bound on the sum of both stages would be beaten by the reference itself:
113 % of it on two H200s): flops QKV 2*B*S_local*E*3E + busiest-rank ring attention + output
2*B*S_local*E*E; link: the stage's ring, (cp-1) k+v blocks of 2*B*S_local*E*2 bytes, plus the hand-off
of B*S_local*E*2 bytes that stage 0 sends and stage 1 receives. HBM: each rank reads its weights and
hidden, writes its output.

Upstream case: the benchmark's defaults, hidden [16, 16/cp, 512], 8 heads of 64 (w_qkv [1536, 512],
w_o [512, 512] per stage), causal. Benchmarks (B=1, causal, MHA): a Llama-2-7B layer per stage (E=4096,
32 heads) at 32k tokens, and a 64-head E=8192 layer per stage at 16k tokens.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (attention_flops, dtype_of, group_rank, group_size, mesh,
                                                   project_qkv, rand_normal, replica_generator, ring_attention_fp32,
                                                   upstream_attention_layer)
from pkb.problems.context_parallel.ring_attention import busiest_rank_pairs

PP = 2
LOGIT_STD = 2.0


def make_inputs(case, rank, world_size, gen):
    E, dtype, cp = case["hidden"], dtype_of(case), world_size // PP
    cp_group, pp_group, cp_index, stage = mesh(cp, rank, world_size)
    hidden = rand_normal(gen, case["batch"], case["seq"] // cp, E, dtype=dtype)
    weights = [replica_generator(gen, s) for s in range(PP)][stage]
    qk_scale = LOGIT_STD**0.5 / E**0.5
    w_qkv = torch.cat([rand_normal(weights, 2 * E, E, scale=qk_scale),
                       rand_normal(weights, E, E, scale=E**-0.5)]).to(dtype)
    w_o = rand_normal(weights, E, E, dtype=dtype, scale=E**-0.5)
    return hidden, w_qkv, w_o, case["heads"], case.get("softmax_scale"), case["causal"], cp_group, pp_group


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: hidden [16, 16/cp, 512] seeded by cp rank, w_qkv [1536, 512] and w_o [512, 512] seeded by
    stage (N(0, 1) * 0.02), in the run's dtype; its seeds carry 57 (upstream's numbering)."""
    cp = world_size // PP
    cp_group, pp_group, cp_index, stage = mesh(cp, rank, world_size)
    hidden, w_qkv, w_o = upstream_attention_layer(
        case, case["seq"] // cp, case["heads"], hidden_seed=42 + 57 * 1000 + cp_index + trial * 1_000_003,
        weight_seed=42 + 57 * 1000 + 20000 + stage + trial * 1_000_003, device=device)
    return hidden, w_qkv, w_o, case["heads"], None, case["causal"], cp_group, pp_group


def attention_stage(x, w_qkv, w_o, num_heads, softmax_scale, causal, cp_group):
    q, k, v = project_qkv(x, w_qkv, num_heads)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, _ = ring_attention_fp32(q, k, v, scale, causal, cp_group)
    B, S_local = out.shape[:2]
    return torch.matmul(out.to(x.dtype).reshape(B, S_local, -1), w_o.t())  # input dtype, fp32 accumulation


def reference(hidden_states, w_qkv, w_o, num_heads, softmax_scale=None, causal=False, cp_group=None,
              pp_group=None):
    if pp_group is None or group_size(pp_group) == 1:
        return attention_stage(hidden_states, w_qkv, w_o, num_heads, softmax_scale, causal, cp_group)
    stage = group_rank(pp_group)
    if stage == 0:
        activation = attention_stage(hidden_states, w_qkv, w_o, num_heads, softmax_scale, causal, cp_group)
    else:
        activation = torch.zeros_like(hidden_states)
    dist.broadcast(activation, src=dist.get_global_rank(pp_group, 0), group=pp_group)  # stage 0 -> stage 1
    if stage == 0:
        return activation
    return attention_stage(activation, w_qkv, w_o, num_heads, softmax_scale, causal, cp_group)


def cost(case, world_size):
    B, E, heads = case["batch"], case["hidden"], case["heads"]
    cp = world_size // PP
    s_local, head_dim = case["seq"] // cp, E // heads
    itemsize = dtype_of(case).itemsize
    act_bytes = B * s_local * E * itemsize
    stage_flops = (2.0 * B * s_local * E * 3 * E + attention_flops(busiest_rank_pairs(B, s_local, cp, case["causal"]),
                                                                   heads, head_dim)
                   + 2.0 * B * s_local * E * E)
    return Cost(link_bytes=(cp - 1) * 2 * act_bytes + act_bytes, flops=stage_flops,
                hbm_bytes=2.0 * act_bytes + itemsize * 4 * E * E, pattern="ring on cp + stage hand-off")


TESTS = (
    Case("causal_h4", {"batch": 2, "seq": 24, "hidden": 32, "heads": 4, "causal": True}, tags=("argument_value",)),
    Case("full_h2_scale", {"batch": 1, "seq": 36, "hidden": 24, "heads": 2, "causal": False, "softmax_scale": 0.3},
         tags=("argument_value", "odd_sizes")),
)

UPSTREAM = (
    Case("upstream", {"batch": 16, "seq": 16, "hidden": 512, "heads": 8, "causal": True},
         note="the upstream benchmark's inputs at M = N = 1024: B = 16, 16 tokens, E = 512, 8 heads"),
)

BENCHMARKS = (
    Case("llama2_7b_32k_causal", {"batch": 1, "seq": 32768, "hidden": 4096, "heads": 32, "causal": True},
         note="a Llama-2-7B layer per stage, 32k tokens"),
    Case("h64_e8192_16k_causal", {"batch": 1, "seq": 16384, "hidden": 8192, "heads": 64, "causal": True},
         note="a 64-head E=8192 layer per stage, 16k tokens"),
)

PROBLEM = Problem(
    name="ring_attention_pp", version=3, upstream_id=56, category="context_parallel",
    source="ring-flash-attention ring_flash_attn_func + Megatron-LM pp-cp layout (stage hand-off)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, upstream=UPSTREAM, tolerance=None,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
