"""Ring attention backward with data-parallel gradient averaging (ring-flash-attention
``ring_flash_attn_backward`` on a cp x dp mesh).

Mesh: cp = W/2, dp = 2, cp ranks adjacent (rank = dp_index * cp + cp_index). Each dp replica is its
own sequence, split contiguously over its cp ranks (cp rank c holds tokens [c*S_local, (c+1)*S_local)).
Per rank: dout, q, k, v, out [B, S_local, H, D] in the run's precision (bf16 by default) and
softmax_lse [B, H, S_local] fp32 in every precision (as many
key/value heads as query heads, as the upstream benchmark's function has); pkb passes the true forward
of ring attention over the replica's whole sequence as out and lse (upstream's factory passed the
local block's only, which matches no forward)  ->  (dq, dk, dv [B, S_local, H, D]) in q's dtype.
In cp ring steps a rank computes, for its queries and the k/v block it holds (fp32, the given lse,
delta = rowsum(dout * out)): dq += scale*dS K; the block's dk += scale*dS^T Q, dv += P^T dout, with
P = exp(scale*QK^T - lse), dS = P*(dout V^T - delta); causal skips later blocks and masks the
diagonal. k/v travel one ring, their fp32 dk/dv accumulators a second ring that ends at the block's
owner. dq, dk, dv are rounded to bf16, then averaged over dp_group (bf16 all-reduce, then / dp), as
the source does; dp_group None means no averaging.

Cost per rank: the k/v ring (cp-1) * 2*B*S_local*H*D*2 bytes, the dk/dv ring cp * 2*B*S_local*H*D*4
bytes (fp32 as ring-flash-attn sends them), the dp all-reduce 2*(dp-1)/dp * (dq+dk+dv) bf16 bytes.
Flops on the busiest rank: five matmuls per (query, key) pair (QK^T recomputed, dV, dP, dQ, dK):
2*pairs*H*5D (pairs as in ring_attention). HBM: read the six inputs and every k/v block, write 3 grads.

Upstream case: the benchmark's defaults, [16, 16/cp, 8, 64] bf16, not causal. Benchmarks (B=1, D=128,
causal, MHA): Llama-2-7B heads (32) at 32k tokens per replica, and 64 heads (an E=8192 layer) at 16k
tokens per replica.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.context_parallel._common import (attention_backward_fp32, attention_fp32, dtype_of, group_rank,
                                                   group_size, mesh, rand_normal, replica_generator, ring_shift,
                                                   upstream_randn)
from pkb.problems.context_parallel.ring_attention import QK_STD, busiest_rank_pairs

DP = 2


def make_inputs(case, rank, world_size, gen):
    B, H, D, dtype, cp = case["batch"], case["heads"], case["head_dim"], dtype_of(case), world_size // DP
    cp_group, dp_group, cp_index, dp_index = mesh(cp, rank, world_size)
    s_local = case["seq"] // cp
    shards = [replica_generator(gen, key) for key in range(world_size)][dp_index * cp: (dp_index + 1) * cp]
    qs, ks, vs = [], [], []
    for shard in shards:
        qs.append(rand_normal(shard, B, s_local, H, D, dtype=dtype, scale=QK_STD))
        ks.append(rand_normal(shard, B, s_local, H, D, dtype=dtype, scale=QK_STD))
        vs.append(rand_normal(shard, B, s_local, H, D, dtype=dtype))
    scale = case.get("softmax_scale") or D**-0.5
    q = qs[cp_index]
    out, lse = attention_fp32(q, torch.cat(ks, 1), torch.cat(vs, 1), scale, case["causal"],
                              q_start=cp_index * s_local)
    dout = rand_normal(gen, B, s_local, H, D, dtype=dtype)
    return (dout, q, ks[cp_index], vs[cp_index], out.to(dtype), lse, case.get("softmax_scale"), case["causal"],
            cp_group, dp_group)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: dout, q, k, v [16, 16/cp, 8, 64] N(0, 1) in the run's dtype (drawn q, k, v, dout, seeded by
    dp and cp rank with 58 as upstream numbers it), and out, lse of the local block alone (not causal)."""
    cp = world_size // DP
    cp_group, dp_group, cp_index, dp_index = mesh(cp, rank, world_size, outer_first=True)
    torch.manual_seed(42 + 58 * 1000 + dp_index * 100 + cp_index + trial * 1_000_003)
    shape = (case["batch"], case["seq"] // cp, case["heads"], case["head_dim"])
    q, k, v, dout = (upstream_randn(case, *shape, device=device) for _ in range(4))
    out, softmax_lse = local_block_forward(q, k, v, case["head_dim"] ** -0.5)
    return dout, q, k, v, out, softmax_lse, None, case["causal"], cp_group, dp_group


def local_block_forward(q, k, v, scale: float):
    """Upstream's out (q's dtype) and lse [B, H, S] (fp32) of q over its own k, v block, op for op as its factory
    computes them (fp32 matmuls, softmax, logsumexp)."""
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * scale
    softmax_lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2).contiguous()
    return out.to(q.dtype), softmax_lse


def reference(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, cp_group=None, dp_group=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    world, me = group_size(cp_group), group_rank(cp_group)
    S = q.shape[1]
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, H, S]
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
    grads = [dq.to(q.dtype), dkv[..., :head_dim].to(k.dtype), dkv[..., head_dim:].to(v.dtype)]
    if dp_group is None or group_size(dp_group) == 1:
        return tuple(grads)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=dp_group)  # in bf16: the source averages the rounded gradients
    flat.div_(group_size(dp_group))
    return tuple(part.view(g.shape) for part, g in zip(flat.split([g.numel() for g in grads]), grads))


def cost(case, world_size):
    B, D, H = case["batch"], case["head_dim"], case["heads"]
    cp = world_size // DP
    s_local = case["seq"] // cp
    kv_elems = 2 * B * s_local * H * D
    q_elems = B * s_local * H * D
    itemsize = dtype_of(case).itemsize
    link = (cp - 1) * kv_elems * itemsize + cp * kv_elems * 4 + 2 * (DP - 1) / DP * (q_elems + kv_elems) * itemsize
    flops = 2.0 * busiest_rank_pairs(B, s_local, cp, case["causal"]) * H * 5 * D
    hbm = (3 * q_elems + cp * kv_elems + kv_elems) * itemsize + B * H * s_local * 4 + (q_elems + kv_elems) * itemsize
    return Cost(link_bytes=link, flops=flops, hbm_bytes=hbm, pattern="two rings on cp + all_reduce on dp")


UPSTREAM = (
    Case("upstream", {"batch": 16, "seq": 16, "heads": 8, "head_dim": 64, "causal": False},
         note="the upstream benchmark's inputs at M = N = 1024: B = 16, 16 tokens per replica, 8 heads x 64"),
)

TESTS = (
    Case("causal_mha", {"batch": 2, "seq": 24, "heads": 4, "head_dim": 8, "causal": True}, tags=("argument_value",)),
    Case("full_mha_scale", {"batch": 1, "seq": 20, "heads": 3, "head_dim": 16, "causal": False,
                            "softmax_scale": 0.2}, tags=("argument_value", "odd_sizes")),
)

BENCHMARKS = (
    Case("llama2_7b_32k", {"batch": 1, "seq": 32768, "heads": 32, "head_dim": 128, "causal": True},
         note="Llama-2-7B heads, 32k tokens per replica"),
    Case("h64_d128_16k", {"batch": 1, "seq": 16384, "heads": 64, "head_dim": 128, "causal": True},
         note="64 heads x 128 (an E=8192 layer), 16k tokens per replica"),
)

PROBLEM = Problem(
    name="ring_attention_backward_dp", version=2, upstream_id=57, category="context_parallel",
    source="ring-flash-attention ring_flash_attn_backward + data-parallel gradient averaging",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, upstream=UPSTREAM,
    # A bf16 flash backward rounds P and dS to bf16 before its matmuls; room for that beyond the default.
    tolerance=Tolerance(atol=2.5e-2, rtol=2.5e-2),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
