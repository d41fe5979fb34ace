"""Ring attention backward with data-parallel gradient averaging (ring-flash-attention
``ring_flash_attn_backward`` on a cp x dp mesh).

Mesh: cp = W/2, dp = 2, cp ranks adjacent (rank = dp_index * cp + cp_index). Each dp replica is its
own sequence, split contiguously over its cp ranks (cp rank c holds tokens [c*S_local, (c+1)*S_local)).
Per rank: dout, q [B, S_local, Hq, D]; k, v [B, S_local, Hkv, D]; out [B, S_local, Hq, D] (bf16) and
softmax_lse [B, Hq, S_local] (fp32): the true forward of ring attention over the whole sequence
(fixed from upstream, whose out and lse came from the local block only and so matched no forward).
  ->  (dq [B, S_local, Hq, D], dk, dv [B, S_local, Hkv, D]) bf16.
In W/2 ring steps a rank computes, for its queries and the k/v block it holds (fp32, global lse,
delta = rowsum(dout * out)): dq += scale*dS K; the block's dk += scale*dS^T Q, dv += P^T dout, with
P = exp(scale*QK^T - lse), dS = P*(dout V^T - delta); causal skips later blocks and masks the
diagonal. k/v travel one ring, their fp32 dk/dv accumulators a second ring that ends at the block's
owner. Then dq, dk, dv are averaged over dp_group (fp32 all-reduce / dp) and rounded to bf16.

Cost per rank: the k/v ring (cp-1) * 2*B*S_local*Hkv*D*2 bytes, the dk/dv ring cp * 2*B*S_local*Hkv*D*4
bytes (fp32 as ring-flash-attn sends them), the dp all-reduce 2*(dp-1)/dp * (dq+dk+dv) bf16 bytes.
Flops on the busiest rank: five matmuls per (query, key) pair (QK^T recomputed, dV, dP, dQ, dK):
2*pairs*Hq*5D (pairs as in ring_attention). HBM: read the six inputs and every k/v block, write 3 grads.

Benchmarks (B=1, D=128, causal): Llama-3-8B heads (32 q, 8 kv) at 32k tokens per replica, and
Llama-3-70B heads (64 q, 8 kv) at 16k tokens per replica.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.context_parallel._common import (attention_backward_fp32, attention_fp32, dtype_of, group_rank,
                                                   group_size, mesh, rand_normal, replica_generator, ring_shift)
from pkb.problems.context_parallel.ring_attention import QK_STD, busiest_rank_pairs

DP = 2


def make_inputs(case, rank, world_size, gen):
    B, D, dtype, cp = case["batch"], case["head_dim"], dtype_of(case), world_size // DP
    cp_group, dp_group, cp_index, dp_index = mesh(cp, rank, world_size)
    s_local, hq, hkv = case["seq"] // cp, case["q_heads"], case["kv_heads"]
    shards = [replica_generator(gen, key) for key in range(world_size)][dp_index * cp: (dp_index + 1) * cp]
    qs, ks, vs = [], [], []
    for shard in shards:
        qs.append(rand_normal(shard, B, s_local, hq, D, dtype=dtype, scale=QK_STD))
        ks.append(rand_normal(shard, B, s_local, hkv, D, dtype=dtype, scale=QK_STD))
        vs.append(rand_normal(shard, B, s_local, hkv, D, dtype=dtype))
    scale = case.get("softmax_scale") or D**-0.5
    q = qs[cp_index]
    out, lse = attention_fp32(q, torch.cat(ks, 1), torch.cat(vs, 1), scale, case["causal"],
                              q_start=cp_index * s_local)
    dout = rand_normal(gen, B, s_local, hq, D, dtype=dtype)
    return (dout, q, ks[cp_index], vs[cp_index], out.to(dtype), lse, case.get("softmax_scale"), case["causal"],
            cp_group, dp_group)


def reference(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, cp_group=None, dp_group=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    world, me = group_size(cp_group), group_rank(cp_group)
    S = q.shape[1]
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, Hq, S]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    head_dim = k.shape[-1]
    for step in range(world):
        source = (me - step) % world
        if not causal or source <= me:
            block_dq, block_dk, block_dv = attention_backward_fp32(
                dout, q, kv[..., :head_dim], kv[..., head_dim:], delta, softmax_lse, scale, causal,
                q_start=me * S, k_start=source * S)
            dq += block_dq
            dkv += torch.cat([block_dk, block_dv], dim=-1)
        if step + 1 < world:
            kv = ring_shift(kv, cp_group)
        dkv = ring_shift(dkv, cp_group)  # after the last step this brings each block's grads home
    grads = torch.cat([dq.flatten(), dkv.flatten()])
    dist.all_reduce(grads, group=dp_group)
    grads /= group_size(dp_group)
    dq, dkv = grads[: dq.numel()].view(dq.shape), grads[dq.numel():].view(dkv.shape)
    return dq.to(q.dtype), dkv[..., :head_dim].to(k.dtype), dkv[..., head_dim:].to(v.dtype)


def cost(case, world_size):
    B, D, hq, hkv = case["batch"], case["head_dim"], case["q_heads"], case["kv_heads"]
    cp = world_size // DP
    s_local = case["seq"] // cp
    kv_elems = 2 * B * s_local * hkv * D
    q_elems = B * s_local * hq * D
    link = (cp - 1) * kv_elems * 2 + cp * kv_elems * 4 + 2 * (DP - 1) / DP * (q_elems + kv_elems) * 2
    flops = 2.0 * busiest_rank_pairs(B, s_local, cp, case["causal"]) * hq * 5 * D
    hbm = (3 * q_elems + cp * kv_elems + kv_elems) * 2 + B * hq * s_local * 4 + (q_elems + kv_elems) * 2
    return Cost(link_bytes=link, flops=flops, hbm_bytes=hbm, pattern="two rings on cp + all_reduce on dp")


TESTS = (
    Case("causal_gqa", {"batch": 2, "seq": 24, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "causal": True,
                        "dtype": "bfloat16"}),
    Case("full_mha_scale", {"batch": 1, "seq": 20, "q_heads": 3, "kv_heads": 3, "head_dim": 16, "causal": False,
                            "softmax_scale": 0.2, "dtype": "bfloat16"}),
)

BENCHMARKS = (
    Case("llama3_8b_32k", {"batch": 1, "seq": 32768, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True,
                           "dtype": "bfloat16"}, note="Llama-3-8B heads, 32k tokens per replica"),
    Case("llama3_70b_16k", {"batch": 1, "seq": 16384, "q_heads": 64, "kv_heads": 8, "head_dim": 128,
                            "causal": True, "dtype": "bfloat16"}, note="Llama-3-70B heads, 16k tokens per replica"),
)

PROBLEM = Problem(
    name="ring_attention_backward_dp", version=1, upstream_id=57, category="context_parallel",
    source="ring-flash-attention ring_flash_attn_backward + data-parallel gradient averaging",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS,
    # A bf16 flash backward rounds P and dS to bf16 before its matmuls; room for that beyond the default.
    tolerance=Tolerance(atol=2.5e-2, rtol=2.5e-2),
    reference=reference, make_inputs=make_inputs, cost=cost,
)
