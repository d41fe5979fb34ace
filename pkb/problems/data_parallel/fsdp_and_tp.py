"""2-D parallel SwiGLU MLP forward (torchtitan FSDP2 x tensor parallel): gather the FSDP shards of
the TP-local weights, run the MLP on this rank's batch, all-reduce the partial output over TP.

Mesh: W = n_fsdp x n_tp, rank = f * n_tp + t (TP ranks consecutive, as torchtitan lays out
["dp_shard", "tp"]). FSDP rank f holds batch rows chunk f of [B, D] (torch.chunk split; the TP ranks
of a row hold the same rows); TP rank t holds columns t of the column-parallel W1 (gate) and W2 (up)
[D, H] and rows t of the row-parallel W3 (down) [H, D]; FSDP then shards those TP-local weights.
Per rank, tensors in the run's precision (bf16 by default): x_local [B_f, D]; W1_shard, W2_shard
[D/n_fsdp, H/n_tp] (dim 0 sharded: FSDP rank f holds rows [f*D/n_fsdp, (f+1)*D/n_fsdp) of the
TP-local [D, H/n_tp]); W3_shard [H/n_tp, D/n_fsdp] (dim 1 sharded, the upstream layout: columns
[f*D/n_fsdp, (f+1)*D/n_fsdp) of the TP-local [H/n_tp, D]); n_tp, n_fsdp (ints).
Reference: all-gather each weight over the FSDP group (the TP and FSDP groups are built once per
process and cached; upstream built them on every call); then rounded as upstream's reference rounds
(and torchtitan runs it in bf16): every step in the inputs' dtype, the GEMMs accumulating in fp32 inside,
h = silu(x W1) * (x W2) with silu's output and the product each rounded, and the partial h W3
all-reduced (sum) over the TP group in the inputs' dtype.
Output: [B_f, D] in the inputs' dtype.
Tolerance: a sum over n_tp partials of magnitude ~1 in that dtype (``reduction_tolerance``), so a
kernel may all-reduce partials in the inputs' dtype as Megatron and torchtitan do, or keep h in fp32.

Cost per rank, B_f rows, b bytes per element: link bytes (n_fsdp-1)/n_fsdp * 3*D*H/n_tp*b (the three
weight all-gathers) + 2(n_tp-1)/n_tp * B_f*D*b (the output all-reduce); flops 3 * 2*B_f*D*H/n_tp
(three GEMMs) + 5*B_f*H/n_tp (SiLU and the gate product); HBM 3*D*H/n_tp*b (the gathered weights) +
2*B_f*D*b.

Upstream case (create_input_tensor at M = N = 1024): D = 256, H = 1024, 2048 rows split over the
FSDP groups, the upstream layout.
Benchmarks: the MLP of Llama-3-8B (D 4096, H 14336) and of Llama-3-70B (D 8192, H 28672) on 8192
tokens per FSDP group, with the upstream layout (n_tp = 2 for W >= 4, 1 at W = 2) and, at W = 8,
Llama-3-70B with n_tp = 4 x n_fsdp = 2.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance, upstream_seed
from pkb.problems.data_parallel._common import chunk_rows, dtype_of, mesh_partitions, subgroup


def layout(case, world_size: int) -> tuple[int, int]:
    """(n_tp, n_fsdp): "upstream" is n_tp = 2 for W >= 4 and 1 at W = 2; "world" is n_tp = W; or an int."""
    tp = case["tp"]
    n_tp = (2 if world_size >= 4 else 1) if tp == "upstream" else world_size if tp == "world" else int(tp)
    return n_tp, world_size // n_tp


def make_inputs(case, rank, world_size, gen):
    n_tp, n_fsdp = layout(case, world_size)
    fsdp_rank, tp_rank = divmod(rank, n_tp)
    batch, d_model, d_ffn, dtype = case["tokens"], case["d_model"], case["d_ffn"], dtype_of(case)
    x = randn(gen.shared, batch, d_model, dtype=dtype)
    w1 = randn(gen.shared, d_model, d_ffn, dtype=dtype, scale=d_model**-0.5)
    w2 = randn(gen.shared, d_model, d_ffn, dtype=dtype, scale=d_model**-0.5)
    w3 = randn(gen.shared, d_ffn, d_model, dtype=dtype, scale=d_ffn**-0.5)
    start, rows = chunk_rows(batch, fsdp_rank, n_fsdp)
    cols = slice(tp_rank * d_ffn // n_tp, (tp_rank + 1) * d_ffn // n_tp)
    dim = slice(fsdp_rank * d_model // n_fsdp, (fsdp_rank + 1) * d_model // n_fsdp)
    return (x[start:start + rows].clone(), w1[dim, cols].clone(), w2[dim, cols].clone(), w3[cols, dim].clone(),
            n_tp, n_fsdp)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values, seeded as rank 0 on every rank: x, W1, W2, W3 N(0, 1) (unscaled), cut as ``make_inputs``
    cuts them (upstream's sizes divide evenly)."""
    upstream_seed(PROBLEM.upstream_id, 0, trial)
    n_tp, n_fsdp = layout(case, world_size)
    fsdp_rank, tp_rank = divmod(rank, n_tp)
    tokens, d_model, d_ffn, dtype = case["tokens"], case["d_model"], case["d_ffn"], dtype_of(case)
    x = torch.randn(tokens, d_model, dtype=dtype, device=device)
    w1 = torch.randn(d_model, d_ffn, dtype=dtype, device=device)
    w2 = torch.randn(d_model, d_ffn, dtype=dtype, device=device)
    w3 = torch.randn(d_ffn, d_model, dtype=dtype, device=device)
    rows = tokens // n_fsdp
    cols = slice(tp_rank * d_ffn // n_tp, (tp_rank + 1) * d_ffn // n_tp)
    dim = slice(fsdp_rank * d_model // n_fsdp, (fsdp_rank + 1) * d_model // n_fsdp)
    return (x[fsdp_rank * rows:(fsdp_rank + 1) * rows].contiguous(), w1[dim, cols].contiguous(),
            w2[dim, cols].contiguous(), w3[cols, dim].contiguous(), n_tp, n_fsdp)


def _gather(shard: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """[group_size * rows, cols]: the group's shards stacked along dim 0."""
    if group is None:
        return shard
    out = torch.empty(group_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.reshape(-1), group=group)
    return out.view(group_size * shard.shape[0], *shard.shape[1:])


def reference(x_local, W1_shard, W2_shard, W3_shard, n_tp, n_fsdp):
    tp_groups, fsdp_groups = mesh_partitions(n_fsdp, n_tp)
    tp_group, fsdp_group = subgroup(tp_groups), subgroup(fsdp_groups)
    w1 = _gather(W1_shard, fsdp_group, n_fsdp)
    w2 = _gather(W2_shard, fsdp_group, n_fsdp)
    # W3 is sharded along dim 1: gather [n_fsdp, H/n_tp, D/n_fsdp] blocks, then lay them side by side.
    w3_blocks = _gather(W3_shard, fsdp_group, n_fsdp).view(n_fsdp, *W3_shard.shape)
    w3 = w3_blocks.permute(1, 0, 2).reshape(W3_shard.shape[0], n_fsdp * W3_shard.shape[1])
    h = torch.nn.functional.silu(x_local @ w1) * (x_local @ w2)  # in the inputs' dtype, as upstream
    out = h @ w3
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)  # in the inputs' dtype, as upstream
    return out


def cost(case, world_size):
    n_tp, n_fsdp = layout(case, world_size)
    rows = chunk_rows(case["tokens"], 0, n_fsdp)[1]
    d_model, d_ffn_local, itemsize = case["d_model"], case["d_ffn"] // n_tp, dtype_of(case).itemsize
    weight_bytes = 3 * d_model * d_ffn_local * itemsize
    return Cost(link_bytes=(n_fsdp - 1) / n_fsdp * weight_bytes + 2 * (n_tp - 1) / n_tp * rows * d_model * itemsize,
                flops=3 * 2 * rows * d_model * d_ffn_local + 5 * rows * d_ffn_local,
                hbm_bytes=weight_bytes + 2 * rows * d_model * itemsize, pattern="all_gather+all_reduce")


def tolerance(case, world_size, dtype):
    return reduction_tolerance(dtype, layout(case, world_size)[0])


PROBLEM = Problem(
    name="fsdp_and_tp", version=4, upstream_id=48, category="data_parallel",
    source="torchtitan FSDP2 x TP SwiGLU FeedForward (ColwiseParallel w1/w3, RowwiseParallel w2, fully_shard)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"tokens": 2048, "d_model": 256, "d_ffn": 1024, "tp": "upstream"},
             note="upstream create_input_tensor at M = N = 1024: D 256, D_ff 1024, 2048 rows"),
    ],
    tests=[
        Case("upstream_layout_uneven_rows", {"tokens": 7, "d_model": 24, "d_ffn": 40, "tp": "upstream"},
             tags=("uneven_sizes", "odd_sizes")),
        Case("all_tp", {"tokens": 5, "d_model": 16, "d_ffn": 24, "tp": "world"},
             tags=("odd_sizes", "argument_value")),  # n_tp = W, n_fsdp = 1: upstream's factor is never that
        Case("all_fsdp_empty_rows", {"tokens": 3, "d_model": 8, "d_ffn": 16, "tp": 1},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),  # n_tp = 1 at W = 4 and 8
    ],
    benchmarks=[
        Case("llama3_8b_mlp_8k_tokens", {"tokens": 8192, "d_model": 4096, "d_ffn": 14336, "tp": "upstream"}),
        Case("llama3_70b_mlp_8k_tokens", {"tokens": 8192, "d_model": 8192, "d_ffn": 28672, "tp": "upstream"}),
        Case("llama3_70b_mlp_tp4_fsdp2", {"tokens": 8192, "d_model": 8192, "d_ffn": 28672, "tp": 4},
             world_sizes=(8,)),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
