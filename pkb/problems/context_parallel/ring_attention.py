"""Ring attention forward (zhuzilin ring-flash-attention ``ring_flash_attn_func``: RingComm + LSE merge).

Contiguous layout: rank r holds tokens [r*S_local, (r+1)*S_local) of q, k and v. In W steps, each
rank attends its queries to the key/value block it holds, merges the partial result with the
running one by log-sum-exp, and passes the block to the next rank. With ``causal`` the block of a
later rank is skipped and the diagonal block is causal (query i sees keys <= i globally).

Per rank: q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D] (GQA: Hq % Hkv == 0), bf16
  ->  (out [B, S_local, Hq, D] bf16, softmax_lse [B, Hq, S_local] fp32, natural log).
Each block is flash attention in the input dtype with fp32 softmax statistics, and the blocks merge in
fp32 (ring-flash-attn keeps out and lse in fp32 across steps); out is rounded once at the end. softmax_scale=None means D^-1/2. pkb also returns softmax_lse (ring_flash_attn_forward
produces it for the backward pass); upstream checked only out.

Cost per rank: W-1 ring steps each bring one k+v block: link (W-1) * 2*B*S_local*Hkv*D*2 bytes.
Flops on the busiest rank (the last one when causal: W-1 full blocks and the causal diagonal):
2*pairs*Hq*2D with pairs = B*((W-1)*S_local^2 + S_local(S_local+1)/2), or B*W*S_local^2 unmasked.
HBM: read q, every k+v block once, write out and lse.

Benchmarks (B=1, D=128, causal): Llama-3-8B (32 query heads, 8 kv heads) at 32k and 64k tokens,
and Llama-3-70B (64 query heads, 8 kv heads) at 32k tokens (config.json head counts).
"""

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (attention_flops, causal_pairs, dtype_of, rand_normal,
                                                   ring_attention_fp32)

QK_STD = 2.0**0.5  # q, k ~ N(0, 2): logits q.k/sqrt(D) have std 2 (a peaked softmax, as in trained models)


def make_inputs(case, rank, world_size, gen):
    B, S_local, D, dtype = case["batch"], case["seq"] // world_size, case["head_dim"], dtype_of(case)
    q = rand_normal(gen, B, S_local, case["q_heads"], D, dtype=dtype, scale=QK_STD)
    k = rand_normal(gen, B, S_local, case["kv_heads"], D, dtype=dtype, scale=QK_STD)
    v = rand_normal(gen, B, S_local, case["kv_heads"], D, dtype=dtype)
    return q, k, v, case.get("softmax_scale"), case["causal"], None


def reference(q, k, v, softmax_scale=None, causal=False, group=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = ring_attention_fp32(q, k, v, scale, causal, group)
    return out.to(q.dtype), lse


def busiest_rank_pairs(batch: int, s_local: int, world_size: int, causal: bool) -> int:
    if causal:
        return batch * ((world_size - 1) * s_local * s_local + causal_pairs(s_local))
    return batch * world_size * s_local * s_local


def cost(case, world_size):
    B, S_local, D = case["batch"], case["seq"] // world_size, case["head_dim"]
    itemsize = dtype_of(case).itemsize
    q_bytes = B * S_local * case["q_heads"] * D * itemsize
    kv_bytes = 2 * B * S_local * case["kv_heads"] * D * itemsize
    lse_bytes = B * case["q_heads"] * S_local * 4
    flops = attention_flops(busiest_rank_pairs(B, S_local, world_size, case["causal"]), case["q_heads"], D)
    return Cost(link_bytes=(world_size - 1) * kv_bytes, flops=flops,
                hbm_bytes=2 * q_bytes + world_size * kv_bytes + lse_bytes, pattern="ring (W-1 steps)")


TESTS = (
    Case("causal_gqa", {"batch": 2, "seq": 24, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "causal": True,
                        "dtype": "bfloat16"}),
    Case("full_mha_scale", {"batch": 1, "seq": 40, "q_heads": 3, "kv_heads": 3, "head_dim": 16, "causal": False,
                            "softmax_scale": 0.2, "dtype": "bfloat16"}),
    Case("causal_one_token_per_rank", {"batch": 1, "seq": 8, "q_heads": 2, "kv_heads": 1, "head_dim": 16,
                                       "causal": True, "dtype": "bfloat16"}, world_sizes=(8,)),
)

BENCHMARKS = (
    Case("llama3_8b_32k", {"batch": 1, "seq": 32768, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True,
                           "dtype": "bfloat16"}, note="Llama-3-8B heads, 32k tokens"),
    Case("llama3_8b_64k", {"batch": 1, "seq": 65536, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True,
                           "dtype": "bfloat16"}, note="Llama-3-8B heads, 64k tokens"),
    Case("llama3_70b_32k", {"batch": 1, "seq": 32768, "q_heads": 64, "kv_heads": 8, "head_dim": 128,
                            "causal": True, "dtype": "bfloat16"}, note="Llama-3-70B heads, 32k tokens"),
)

PROBLEM = Problem(
    name="ring_attention", version=1, upstream_id=54, category="context_parallel",
    source="zhuzilin ring-flash-attention ring_flash_attn_func (RingComm, LSE merge)", world_sizes=(2, 4, 8),
    tests=TESTS, benchmarks=BENCHMARKS, tolerance=None, reference=reference, make_inputs=make_inputs, cost=cost,
)
