"""Ulysses attention block end to end (VeOmni / verl Ulysses attention): QKV GEMM, all-to-all to
head-parallel, softmax attention over the whole sequence, all-to-all back, output GEMM.

Per rank (contiguous sequence shards, rank r holds tokens [r*S_local, (r+1)*S_local)):
  hidden_states [B, S_local, E]; w_qkv [3E, E] (rows: q | k | v); w_o [E, E]  ->  [B, S_local, E]
  1. qkv = hidden_states @ w_qkv^T (fp32 accumulate, bf16 result as the source's linear layer);
     q, k, v = split into num_heads heads of D = E / num_heads.
  2. all-to-all (scatter heads, gather sequence): [B, S, num_heads/W, D] each.
  3. attention in fp32 (scale D^-1/2, causal mask on global positions if ``causal``), bf16 result.
  4. all-to-all back (scatter sequence, gather heads): [B, S_local, E]; out = attn @ w_o^T (fp32, bf16).
Fixed from upstream: the weights are replicated (drawn from the shared generator: one layer, the same
on every sequence-parallel rank); upstream drew them per rank, mixing different layers' heads.

Cost per rank (bf16, 2 bytes): all-to-all of q, k, v and of the output: link (W-1)/W * 2*B*S_local*4E.
Flops: QKV 2*B*S_local*E*3E, attention 2*pairs*(num_heads/W)*2D with pairs = B*S^2 (B*S(S+1)/2
causal), output 2*B*S_local*E*E. HBM: read hidden and both weights, write the output.

Benchmarks: a Llama-2-7B layer (E=4096, 32 heads, MHA) at 32k tokens, causal; and a 64-head E=8192
layer (Llama-2-70B width without GQA) at 16k tokens.
"""

import torch

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (ATTENTION_LAYER_BENCHMARKS, all_to_all, attention_flops,
                                                   block_attention, causal_pairs, dtype_of, project_qkv,
                                                   rand_normal)

LOGIT_STD = 2.0  # q and k weights are scaled so that attention logits have about this std (a peaked softmax)


def make_inputs(case, rank, world_size, gen):
    E, heads, dtype = case["hidden"], case["heads"], dtype_of(case)
    s_local = case["seq"] // world_size
    hidden = rand_normal(gen, case["batch"], s_local, E, dtype=dtype)
    qk_scale = LOGIT_STD**0.5 / E**0.5
    w_qkv = torch.cat([rand_normal(gen.shared, 2 * E, E, scale=qk_scale),
                       rand_normal(gen.shared, E, E, scale=E**-0.5)]).to(dtype)
    w_o = rand_normal(gen.shared, E, E, dtype=dtype, scale=E**-0.5)
    return hidden, w_qkv, w_o, None, heads, case["causal"]


def reference(hidden_states, w_qkv, w_o, group=None, num_heads=8, causal=False):
    q, k, v = project_qkv(hidden_states, w_qkv, num_heads)
    qkv = all_to_all(torch.stack([q, k, v], dim=2), scatter_dim=3, gather_dim=1, group=group)  # [B, S, 3, h, D]
    q, k, v = qkv.unbind(2)
    out, _ = block_attention(q, k, v, q.shape[-1] ** -0.5, causal=causal)
    out = all_to_all(out.to(hidden_states.dtype), scatter_dim=1, gather_dim=2, group=group)  # [B, S_local, H, D]
    B, S_local = out.shape[:2]
    return torch.matmul(out.reshape(B, S_local, -1), w_o.t())  # input dtype, fp32 accumulation


def cost(case, world_size):
    B, S, E, heads = case["batch"], case["seq"], case["hidden"], case["heads"]
    s_local, head_dim = S // world_size, E // heads
    pairs = B * (causal_pairs(S) if case["causal"] else S * S)
    flops = (2.0 * B * s_local * E * 3 * E + attention_flops(pairs, heads // world_size, head_dim)
             + 2.0 * B * s_local * E * E)
    moved = 2 * B * s_local * 4 * E
    return Cost(link_bytes=(world_size - 1) / world_size * moved, flops=flops,
                hbm_bytes=2.0 * (2 * B * s_local * E + 4 * E * E), pattern="all_to_all x2 + attention")


TESTS = (
    Case("causal_h8", {"batch": 2, "seq": 24, "hidden": 64, "heads": 8, "causal": True, "dtype": "bfloat16"}),
    Case("full_h16_d4", {"batch": 1, "seq": 40, "hidden": 64, "heads": 16, "causal": False, "dtype": "bfloat16"}),
)

BENCHMARKS = ATTENTION_LAYER_BENCHMARKS

PROBLEM = Problem(
    name="ulysses_attention_e2e", version=1, upstream_id=39, category="context_parallel",
    source="VeOmni / verl Ulysses attention (gather_seq_scatter_heads / gather_heads_scatter_seq)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, tolerance=None,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
