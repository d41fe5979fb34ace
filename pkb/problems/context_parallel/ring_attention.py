"""Ring attention forward (zhuzilin ring-flash-attention ``ring_flash_attn_func``: RingComm + LSE merge).

Contiguous layout: rank r holds tokens [r*S_local, (r+1)*S_local) of q, k and v. In W steps, each
rank attends its queries to the key/value block it holds, merges the partial result with the
running one by log-sum-exp, and passes the block to the next rank. With ``causal`` the block of a
later rank is skipped and the diagonal block is causal (query i sees keys <= i globally).

Per rank: q, k, v [B, S_local, H, D] in the run's precision, bf16 by default (as many key/value heads
as query heads: the upstream benchmark's function multiplies q by k^T head for head); softmax_scale;
causal; group None  ->  out [B, S_local, H, D] in q's dtype.
Each block is attention in fp32 (q, k, v upcast), the blocks merge in fp32 and out is rounded once at
the end. softmax_scale=None means D^-1/2; group=None means the whole world.

Cost per rank: W-1 ring steps each bring one k+v block: link (W-1) * 2*B*S_local*H*D*2 bytes.
Flops on the busiest rank (the last one when causal: W-1 full blocks and the causal diagonal):
2*pairs*H*2D with pairs = B*((W-1)*S_local^2 + S_local(S_local+1)/2), or B*W*S_local^2 unmasked.
HBM: read q, every k+v block once, write out.

Upstream case: the benchmark's defaults, q, k, v [16, 16/W, 8, 64] bf16, causal. Benchmarks (B=1,
D=128, causal, MHA): Llama-2-7B (32 heads) at 32k and 64k tokens, and 64 heads (an E=8192 layer) at
32k tokens.
"""

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (attention_flops, causal_pairs, dtype_of, rand_normal,
                                                   ring_attention_fp32, upstream_randn)

QK_STD = 2.0**0.5  # q, k ~ N(0, 2): logits q.k/sqrt(D) have std 2 (a peaked softmax, as in trained models)


def make_inputs(case, rank, world_size, gen):
    B, S_local, H, D, dtype = case["batch"], case["seq"] // world_size, case["heads"], case["head_dim"], dtype_of(case)
    q = rand_normal(gen, B, S_local, H, D, dtype=dtype, scale=QK_STD)
    k = rand_normal(gen, B, S_local, H, D, dtype=dtype, scale=QK_STD)
    v = rand_normal(gen, B, S_local, H, D, dtype=dtype)
    return q, k, v, case.get("softmax_scale"), case["causal"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: q, k, v [16, 16/W, 8, 64] N(0, 1) in the run's dtype (unscaled), causal."""
    shape = (case["batch"], case["seq"] // world_size, case["heads"], case["head_dim"])
    q, k, v = (upstream_randn(case, *shape, device=device) for _ in range(3))
    return q, k, v, None, case["causal"], None


def reference(q, k, v, softmax_scale=None, causal=False, group=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, _ = ring_attention_fp32(q, k, v, scale, causal, group)
    return out.to(q.dtype)


def busiest_rank_pairs(batch: int, s_local: int, world_size: int, causal: bool) -> int:
    if causal:
        return batch * ((world_size - 1) * s_local * s_local + causal_pairs(s_local))
    return batch * world_size * s_local * s_local


def cost(case, world_size):
    B, S_local, H, D = case["batch"], case["seq"] // world_size, case["heads"], case["head_dim"]
    block_bytes = B * S_local * H * D * dtype_of(case).itemsize
    flops = attention_flops(busiest_rank_pairs(B, S_local, world_size, case["causal"]), H, D)
    return Cost(link_bytes=(world_size - 1) * 2 * block_bytes, flops=flops,
                hbm_bytes=2 * block_bytes + world_size * 2 * block_bytes, pattern="ring (W-1 steps)")


UPSTREAM = (
    Case("upstream", {"batch": 16, "seq": 16, "heads": 8, "head_dim": 64, "causal": True},
         note="the upstream benchmark's inputs at M = N = 1024: B = 16, 16 tokens, 8 heads x 64"),
)

TESTS = (
    Case("causal_mha", {"batch": 2, "seq": 24, "heads": 4, "head_dim": 8, "causal": True}, tags=("odd_sizes",)),
    Case("full_mha_scale", {"batch": 1, "seq": 40, "heads": 3, "head_dim": 16, "causal": False,
                            "softmax_scale": 0.2}, tags=("argument_value", "odd_sizes")),
    Case("causal_one_token_per_rank", {"batch": 1, "seq": 8, "heads": 2, "head_dim": 16, "causal": True},
         world_sizes=(8,),
         tags=("shape_regime", "tiny")),
)

BENCHMARKS = (
    Case("llama2_7b_32k", {"batch": 1, "seq": 32768, "heads": 32, "head_dim": 128, "causal": True},
         note="Llama-2-7B heads, 32k tokens"),
    Case("llama2_7b_64k", {"batch": 1, "seq": 65536, "heads": 32, "head_dim": 128, "causal": True},
         note="Llama-2-7B heads, 64k tokens"),
    Case("h64_d128_32k", {"batch": 1, "seq": 32768, "heads": 64, "head_dim": 128, "causal": True},
         note="64 heads x 128 (an E=8192 layer), 32k tokens"),
)

PROBLEM = Problem(
    name="ring_attention", version=2, upstream_id=54, category="context_parallel",
    source="zhuzilin ring-flash-attention ring_flash_attn_func (RingComm, LSE merge)", world_sizes=(2, 4, 8),
    tests=TESTS, benchmarks=BENCHMARKS, upstream=UPSTREAM, tolerance=None, reference=reference,
    make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
