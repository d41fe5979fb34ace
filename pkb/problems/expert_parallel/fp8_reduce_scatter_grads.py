"""FP8 gradient reduce-scatter (mean) with delayed scaling (Transformer Engine / torchao float8 recipe).

Per rank: flat_grads [W*N] bf16 (block d is rank d's shard; random, distinct per rank),
amax_history [L] bf16 (replicated: the same on every rank, as Transformer Engine keeps it after
its amax reduction)  ->
    grad_shard [N] bf16: mean over ranks s of decode(encode(flat_grads_s))[r*N:(r+1)*N]
    updated_amax_history [L] bf16: [global amax of this step, history[0], ..., history[L-2]]
Every rank encodes with the same delayed scale, 448 / max(history) (see _fp8.py), so e4m3 codes can
be summed after decoding; the sum of W decoded e4m3 values is exact in fp32, then divided by
W * scale and rounded once. The global amax is max |flat_grads| over all ranks (the upstream used
only the local amax, so ranks disagreed on the next scale). The reference exchanges the 1-byte codes
with an all-to-all and sums at the receiver, which is what an fp8 reduce-scatter is.

Cost: each rank must receive the (W-1) remote codes of its shard, (W-1) * N bytes (the all-to-all of
the W*N codes), plus the MAX all-reduce of one fp32 amax (2(W-1)/W * 4 bytes).
HBM: read the W*N bf16 gradients, write N bf16 (codes staged through memory are not counted).
Flops: not counted (elementwise).

Benchmarks: one expert's weights as a gradient bucket (gate, up and down: 3 * hidden * intermediate
from config.json): DeepSeek-V3 (7168 x 2048), Qwen3-235B-A22B (4096 x 1536), Mixtral 8x7B
(4096 x 14336), reduce-scattered over 8 ranks (N = total / 8; also W = 2, 4).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.expert_parallel._common import dtype_of
from pkb.problems.expert_parallel._fp8 import (FP8_DTYPE, delayed_scale, gaussian_amax, history_like, quantize,
                                               updated_history)


def _total(case, world_size) -> int:
    """Elements of flat_grads on one rank: a benchmark's bucket size, or a test's shard times W."""
    return case["total"] if "total" in case.params else case["shard"] * world_size


def make_inputs(case, rank, world_size, gen):
    total = _total(case, world_size)
    flat_grads = randn(gen, total, dtype=dtype_of(case))
    amax_history = history_like(gen.shared, case["history"], gaussian_amax(total * world_size), torch.bfloat16)
    return flat_grads, amax_history


def reference(flat_grads, amax_history):
    world_size = dist.get_world_size()
    scale = delayed_scale(amax_history)
    codes = quantize(flat_grads, scale).view(torch.uint8)            # block d goes to rank d
    received = torch.empty_like(codes)
    dist.all_to_all_single(received, codes)
    summed = received.view(FP8_DTYPE).float().view(world_size, -1).sum(dim=0)   # exact in fp32
    grad_shard = (summed / (scale * world_size)).to(flat_grads.dtype)
    return grad_shard, updated_history(amax_history, flat_grads)


def cost(case, world_size):
    total = _total(case, world_size)
    shard = total // world_size
    return Cost(link_bytes=(world_size - 1) * shard + 2 * (world_size - 1) / world_size * 4,
                hbm_bytes=(total + shard) * dtype_of(case).itemsize, pattern="reduce_scatter (fp8 codes)")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size)


TESTS = (
    Case("odd_shard37", {"shard": 37, "history": 16}),
    Case("shard1_history3", {"shard": 1, "history": 3}),
    Case("shard300_history16", {"shard": 300, "history": 16}),
)

BENCHMARKS = (
    Case("deepseek_v3_expert_bucket", {"total": 3 * 7168 * 2048, "history": 16}),
    Case("qwen3_235b_a22b_expert_bucket", {"total": 3 * 4096 * 1536, "history": 16}),
    Case("mixtral_8x7b_expert_bucket", {"total": 3 * 4096 * 14336, "history": 16}),
)

PROBLEM = Problem(
    name="fp8_reduce_scatter_grads", version=1, upstream_id=52, category="expert_parallel",
    source="Transformer Engine / torchao float8 delayed scaling (amax history) + ZeRO gradient reduce-scatter",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
