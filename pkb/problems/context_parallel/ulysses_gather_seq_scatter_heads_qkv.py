"""Ulysses all-to-all of a packed QKV projection (VeOmni ``gather_seq_scatter_heads_qkv``).

qkv_tensor [B, S_local, P] holds q, k and v side by side (P = 3 * H*D). It is viewed as
[B, S_local, 3, P/3], the last dim (heads x head_dim of each of q, k, v) is split into W chunks and
chunk d goes to rank d; the received pieces are concatenated on ``seq_dim`` in rank order. So rank r
ends with heads [r*H/W, (r+1)*H/W) of each of q, k and v for the whole sequence.

Per rank: qkv_tensor [B, S_local, P]  ->  [B, W*S_local, P/W] laid out as [q_r | k_r | v_r] when
``restore_shape``, else [B, W*S_local, 3, P/(3W)]; when ``unpadded_dim_size`` is given and not a
multiple of W the sequence is cut to it (bit-exact). S_local = ceil(seq / W); P/3 must divide by W.

Cost (all-to-all): with X the local bytes, link bytes (W-1)/W * X; HBM: read X, write X.

The upstream case fixes S_local instead (``local_seq``): upstream's qkv [16, 16, 1536] bf16 per rank,
seq_dim 1, unpadded_dim_size None, restore_shape True.

Benchmarks: fused QKV of Llama-3-8B without GQA expansion (32 heads x 128: P = 3*4096) at 128k
tokens, and of a 64-head x 128 model (P = 3*8192) at 64k tokens, B=1.
"""

from pkb.problem import Case, Problem, Tolerance
from pkb.problems.context_parallel._common import (all_to_all, all_to_all_cost, ceil_div, cut_padding, dtype_of,
                                                   rand_normal, upstream_randn)


def local_shape(case, world_size):
    s_local = case["local_seq"] if "local_seq" in case.params else ceil_div(case["seq"], world_size)
    return [case["batch"], s_local, 3 * case["proj"]]


def make_inputs(case, rank, world_size, gen):
    qkv = rand_normal(gen, *local_shape(case, world_size), dtype=dtype_of(case))
    unpadded = case["seq"] if case.get("pass_unpadded", True) else None
    return qkv, 1, None, unpadded, case.get("restore_shape", True)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: qkv [16, 16, 1536] N(0, 1) in the run's dtype; seq dim 1, no unpadded size, restore_shape."""
    return upstream_randn(case, *local_shape(case, world_size), device=device), 1, None, None, True


def reference(qkv_tensor, seq_dim, group=None, unpadded_dim_size=None, restore_shape=True):
    shape = list(qkv_tensor.shape)
    proj = shape[-1]
    split = qkv_tensor.view(*shape[:-1], 3, proj // 3)
    out = all_to_all(split, split.dim() - 1, seq_dim, group)
    if restore_shape:
        world = out.shape[seq_dim] // qkv_tensor.shape[seq_dim]
        out_shape = list(shape)
        out_shape[seq_dim] *= world
        out_shape[-1] = proj // world
        out = out.view(out_shape)
    return cut_padding(out, seq_dim, qkv_tensor.shape[seq_dim], unpadded_dim_size)


def cost(case, world_size):
    return all_to_all_cost(local_shape(case, world_size), dtype_of(case), world_size)


UPSTREAM = (
    Case("upstream", {"batch": 16, "local_seq": 16, "proj": 512, "pass_unpadded": False},
         note="upstream create_input_tensor at M = N = 1024: qkv [16, 16, 3*8*64] per rank"),
)

TESTS = (
    Case("padded_seq", {"batch": 2, "seq": 29, "proj": 40}, tags=("argument_value", "odd_sizes")),
    Case("no_restore", {"batch": 1, "seq": 24, "proj": 24, "restore_shape": False}, tags=("argument_value",)),
    Case("one_token_no_unpad", {"batch": 3, "seq": 8, "proj": 56, "pass_unpadded": False},
         tags=("shape_regime", "odd_sizes")),
)

BENCHMARKS = (
    Case("llama3_8b_qkv_128k", {"batch": 1, "seq": 131072, "proj": 4096},
         note="32 heads x 128 per projection, 128k tokens"),
    Case("h64_qkv_64k", {"batch": 1, "seq": 65536, "proj": 8192},
         note="64 heads x 128 per projection, 64k tokens"),
)

PROBLEM = Problem(
    name="ulysses_gather_seq_scatter_heads_qkv", version=3, upstream_id=38, category="context_parallel",
    source="VeOmni Ulysses gather_seq_scatter_heads_qkv", world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS,
    benchmarks=BENCHMARKS, tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
