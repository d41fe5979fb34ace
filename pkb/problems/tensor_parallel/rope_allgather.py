"""Rotary position embedding on a sequence shard, then an all-gather of q and k along the sequence
(sequence / context parallelism, HF ``apply_rotary_pos_emb`` with ``rotate_half``).

Per rank: q_local [B, T/W, Hq, D], k_local [B, T/W, Hkv, D] (this rank's block of the sequence),
cos_local, sin_local [B, T/W, D] (the rotary tables at this block's positions)  ->
(q [B, T, Hq, D], k [B, T, Hkv, D]) on every rank, sequence blocks in rank order, where
    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
with cos/sin broadcast over the heads. Computed in the input dtype, each product and the sum
rounded, as upstream (HF's apply_rotary_pos_emb does the same).

Inputs: cos/sin are real rotary tables cat(freqs, freqs) with freqs = pos * theta^(-2i/D),
theta = 500000 (Llama-3), at random position ids (packed sequences), so they differ per rank.

Cost per rank: the two all-gathers bring (W-1)/W of the full q and k in:
(W-1)/W * B*T*(Hq + Hkv)*D*itemsize; 3 flops per element of the local q and k (two multiplies,
one add); HBM reads q, k, cos, sin locally and writes the gathered q, k:
B*(T/W)*((Hq + Hkv)*D + 2*D)*itemsize + B*T*(Hq + Hkv)*D*itemsize.

Tolerance: where x*cos and rotate_half(x)*sin nearly cancel, rounding each product (the reference)
or not (an fp32 kernel) differs by up to u*(|x_i| + |x_j|) with u the dtype's unit roundoff and
|cos|, |sin| <= 1; for N(0,1) q and k that stays under 8u (0.031 in bf16), so atol = max(8u, the
dtype default). A missing rank's block of the sequence is off by O(1).

Cases: ``upstream`` is the upstream factory: B 16, T 16 (16/W per rank), 8 q and 8 k heads of 64.
Benchmarks: Llama-3 8B attention (32 q heads, 8 kv heads, head dim 128) on an 8192-token
sequence and Llama-3 70B (64 q heads, 8 kv heads) on a 32768-token sequence, batch 1.
"""

import torch

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of, itemsize, upstream_randn

ROPE_THETA = 500000.0
MAX_POSITION = 131072


def make_inputs(case, rank, world_size, gen):
    b, t, d = case["batch"], case["seq"] // world_size, case["head_dim"]
    dtype = dtype_of(case)
    q = randn(gen, b, t, case["q_heads"], d, dtype=dtype)
    k = randn(gen, b, t, case["kv_heads"], d, dtype=dtype)
    positions = torch.randint(0, MAX_POSITION, (b, t), generator=gen, device=gen.device).double()
    inv_freq = ROPE_THETA ** (-torch.arange(0, d, 2, device=gen.device, dtype=torch.float64) / d)
    freqs = positions[..., None] * inv_freq  # [B, T/W, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): q, k [16, 16/W, 8, 64], then cos and sin [16, 16/W, 64], all N(0, 1)
    (its cos and sin are not rotary tables)."""
    b, t, d = case["batch"], max(1, case["seq"] // world_size), case["head_dim"]
    return upstream_randn(case, device, (b, t, case["q_heads"], d), (b, t, case["kv_heads"], d), (b, t, d), (b, t, d))


def _rope(x, cos, sin):
    """x [B, T, heads, D], cos/sin [B, T, D] broadcast over the heads; in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def reference(q_local, k_local, cos_local, sin_local):
    q = _rope(q_local, cos_local, sin_local)
    k = _rope(k_local, cos_local, sin_local)
    return all_gather_cat(q, dim=1), all_gather_cat(k, dim=1)


def cost(case, world_size):
    b, t, d = case["batch"], case["seq"], case["head_dim"]
    heads, size = case["q_heads"] + case["kv_heads"], itemsize(case)
    local = b * (t / world_size)
    return Cost(link_bytes=(world_size - 1) / world_size * b * t * heads * d * size, flops=3 * local * heads * d,
                hbm_bytes=local * (heads * d + 2 * d) * size + b * t * heads * d * size, pattern="all_gather")


def tolerance(case, world_size, dtype):
    default = default_tolerance(dtype)
    return Tolerance(atol=max(default.atol, 8 * torch.finfo(dtype).eps / 2), rtol=default.rtol)


PROBLEM = Problem(
    name="rope_allgather", version=2, upstream_id=17, category="tensor_parallel",
    source="HF transformers apply_rotary_pos_emb (rotate_half) + sequence-parallel all-gather",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"batch": 16, "seq": 16, "q_heads": 8, "kv_heads": 8, "head_dim": 64},
                   note="the upstream factory: q, k [16, 16/W, 8, 64], cos, sin [16, 16/W, 64]")],
    tests=[
        Case("odd_gqa", {"batch": 2, "seq": 24, "q_heads": 3, "kv_heads": 1, "head_dim": 10},
             note="3 tokens per rank at W=8; head dim 10 (halves of 5)", tags=("odd_sizes", "shape_regime")),
        Case("one_token_per_rank", {"batch": 3, "seq": 8, "q_heads": 4, "kv_heads": 2, "head_dim": 6},
             tags=("tiny", "odd_sizes", "shape_regime")),
        Case("llama_head_dim", {"batch": 1, "seq": 16, "q_heads": 2, "kv_heads": 2, "head_dim": 128},
             tags=("shape_regime",)),
    ],
    benchmarks=[
        Case("llama3_8b_seq8192", {"batch": 1, "seq": 8192, "q_heads": 32, "kv_heads": 8, "head_dim": 128}),
        Case("llama3_70b_seq32768", {"batch": 1, "seq": 32768, "q_heads": 64, "kv_heads": 8, "head_dim": 128}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
