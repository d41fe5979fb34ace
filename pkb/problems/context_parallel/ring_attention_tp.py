"""Attention block with heads split over tensor parallelism and the sequence over a ring (ring-flash-attention
+ Megatron's tp-cp rank layout).

Mesh: tp = 2, cp = W/2, tensor-parallel ranks adjacent (rank = cp_index * 2 + tp_index). The
sequence is split contiguously over cp (cp rank c holds tokens [c*S_local, (c+1)*S_local)); each tp
rank holds num_heads/2 heads.
Per rank: hidden_states [B, S_local, E] (the same on both tp ranks of a cp index);
  w_qkv [3E/2, E] (column shard: rows q | k | v of this rank's heads), w_o [E, E/2] (row shard),
  both the same on every cp rank of a tp index  ->  [B, S_local, E], the same on both tp ranks.
  1. q, k, v = split(hidden_states @ w_qkv^T) (fp32 accumulate, bf16 result), num_heads/2 heads of D=E/num_heads.
  2. ring attention over cp_group (contiguous layout, causal skip of later blocks, LSE merge, fp32), bf16.
  3. partial = attn @ w_o^T in fp32; all-reduce over tp_group; rounded to bf16 once.
softmax_scale=None means D^-1/2.

Cost per rank (bf16): ring (cp-1) k+v blocks of this rank's heads: (cp-1) * 2*B*S_local*(E/2)*2 bytes;
the tp all-reduce 2*(tp-1)/tp * B*S_local*E*2 bytes. Flops: QKV 2*B*S_local*E*(3E/2), attention on the
busiest cp rank (see ring_attention) with num_heads/2 heads, output 2*B*S_local*(E/2)*E. HBM: read
hidden and the weight shards, write the output.

Upstream case: the benchmark's defaults, hidden [16, 16/cp, 512], 8 heads of 64 (w_qkv [768, 512],
w_o [512, 256]), causal. Benchmarks (B=1, causal, MHA as the upstream signature has one head count): a
Llama-2-7B layer (E=4096, 32 heads) at 32k tokens, and a 64-head E=8192 layer at 16k tokens.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (ATTENTION_LAYER_BENCHMARKS, attention_flops, dtype_of, mesh,
                                                   project_qkv, rand_normal, replica_generator,
                                                   ring_attention_fp32, upstream_attention_layer)
from pkb.problems.context_parallel.ring_attention import busiest_rank_pairs

TP = 2
LOGIT_STD = 2.0


def make_inputs(case, rank, world_size, gen):
    E, heads, dtype = case["hidden"], case["heads"], dtype_of(case)
    tp_group, cp_group, tp_index, cp_index = mesh(TP, rank, world_size)
    s_local = case["seq"] // (world_size // TP)
    sequence = [replica_generator(gen, c) for c in range(world_size // TP)][cp_index]
    hidden = rand_normal(sequence, case["batch"], s_local, E, dtype=dtype)
    shard = [replica_generator(gen, t) for t in range(TP)][tp_index]
    qk_scale = LOGIT_STD**0.5 / E**0.5
    w_qkv = torch.cat([rand_normal(shard, 2 * E // TP, E, scale=qk_scale),
                       rand_normal(shard, E // TP, E, scale=E**-0.5)]).to(dtype)
    w_o = rand_normal(shard, E, E // TP, dtype=dtype, scale=E**-0.5)
    return hidden, w_qkv, w_o, heads, case.get("softmax_scale"), case["causal"], tp_group, cp_group


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: hidden [16, 16/cp, 512] seeded by cp rank, w_qkv [768, 512] and w_o [512, 256] seeded by tp
    rank (N(0, 1) * 0.02), in the run's dtype; its seeds carry 56 (upstream's numbering)."""
    tp_group, cp_group, tp_index, cp_index = mesh(TP, rank, world_size)
    s_local = case["seq"] // (world_size // TP)
    hidden, w_qkv, w_o = upstream_attention_layer(
        case, s_local, case["heads"] // TP, hidden_seed=42 + 56 * 1000 + cp_index + trial * 1_000_003,
        weight_seed=42 + 56 * 1000 + 10000 + tp_index + trial * 1_000_003, device=device)
    return hidden, w_qkv, w_o, case["heads"], None, case["causal"], tp_group, cp_group


def reference(hidden_states, w_qkv, w_o, num_heads, softmax_scale=None, causal=False, tp_group=None,
              cp_group=None):
    local_heads = num_heads // dist.get_world_size(tp_group)
    q, k, v = project_qkv(hidden_states, w_qkv, local_heads)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, _ = ring_attention_fp32(q, k, v, scale, causal, cp_group)
    B, S_local = out.shape[:2]
    partial = torch.matmul(out.to(hidden_states.dtype).reshape(B, S_local, -1), w_o.t())  # input dtype
    dist.all_reduce(partial, group=tp_group)  # in the input dtype, as Megatron's row-parallel output does
    return partial


def cost(case, world_size):
    B, E, heads = case["batch"], case["hidden"], case["heads"]
    cp = world_size // TP
    s_local, head_dim = case["seq"] // cp, E // heads
    itemsize = dtype_of(case).itemsize
    kv_bytes = 2 * B * s_local * (E // TP) * itemsize
    out_bytes = B * s_local * E * itemsize
    flops = (2.0 * B * s_local * E * (3 * E // TP)
             + attention_flops(busiest_rank_pairs(B, s_local, cp, case["causal"]), heads // TP, head_dim)
             + 2.0 * B * s_local * (E // TP) * E)
    return Cost(link_bytes=(cp - 1) * kv_bytes + 2 * (TP - 1) / TP * out_bytes, flops=flops,
                hbm_bytes=2.0 * out_bytes + itemsize * 4 * E * E / TP, pattern="ring on cp + all_reduce on tp")


TESTS = (
    Case("causal_h4", {"batch": 2, "seq": 24, "hidden": 32, "heads": 4, "causal": True}, tags=("argument_value",)),
    Case("full_h8_scale", {"batch": 1, "seq": 36, "hidden": 48, "heads": 8, "causal": False, "softmax_scale": 0.3},
         tags=("argument_value", "odd_sizes")),
)

BENCHMARKS = ATTENTION_LAYER_BENCHMARKS

UPSTREAM = (
    Case("upstream", {"batch": 16, "seq": 16, "hidden": 512, "heads": 8, "causal": True},
         note="the upstream benchmark's inputs at M = N = 1024: B = 16, 16 tokens, E = 512, 8 heads"),
)

PROBLEM = Problem(
    name="ring_attention_tp", version=2, upstream_id=55, category="context_parallel",
    source="ring-flash-attention ring_flash_attn_func + Megatron-LM tp-cp layout (column/row-parallel projections)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, upstream=UPSTREAM, tolerance=None,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
