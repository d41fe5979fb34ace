"""FP8 gradient reduce-scatter (mean) with delayed scaling (Transformer Engine / torchao float8 recipe).

Per rank: flat_grads [W*N] bf16 (block d is rank d's shard; random, distinct per rank),
amax_history [L] bf16 (this rank's history of past amaxes)  ->
    grad_shard [N] bf16: mean over ranks s of decode_s(encode_s(flat_grads_s))[r*N:(r+1)*N]
    updated_amax_history [L] bf16: [history[1], ..., history[L-1], local amax]
Each rank quantizes with its OWN scale, from its own history and its own amax (the upstream recipe,
see _fp8.py; nothing but the gradients is reduced), so a block is only meaningful with the scale of
the rank that encoded it. The reference exchanges the 1-byte e4m3 codes with an all-to-all and the
W fp32 scales with an all-gather, decodes each received block with its sender's scale (rounded to
bf16, as upstream's round trip), sums the W values in fp32, divides by W and rounds once. Upstream
reduce-scatters the decoded bf16 values in bf16 and divides in bf16; that rounding is within the
tolerance, ``reduction_tolerance(bf16, W)`` on values of magnitude about 1.

Cost: each rank must receive the (W-1) remote codes of its shard, (W-1) * N bytes (the all-to-all of
the W*N codes), plus the other ranks' fp32 scales, (W-1) * 4 bytes.
HBM: read the W*N bf16 gradients, write N bf16 (codes staged through memory are not counted).
Flops: not counted (elementwise).

Cases: ``upstream`` is the upstream factory: flat_grads [4096*W] bf16, a history of 16.
Benchmarks: one expert's weights as a gradient bucket (gate, up and down: 3 * hidden * intermediate
from config.json): DeepSeek-V3 (7168 x 2048), Qwen3-235B-A22B (4096 x 1536), Mixtral 8x7B
(4096 x 14336), reduce-scattered over 8 ranks (N = total / 8; also W = 2, 4).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.expert_parallel._common import dtype_of
from pkb.problems.expert_parallel._fp8 import (FP8_DTYPE, decode, dequant_scale, encode, gather_scales,
                                               gaussian_amax, history_like, plant_settled_amax,
                                               updated_history, upstream_fp8_inputs)


def _total(case, world_size) -> int:
    """Elements of flat_grads on one rank: a benchmark's bucket size, or a test's shard times W."""
    return case["total"] if "total" in case.params else case["shard"] * world_size


def make_inputs(case, rank, world_size, gen):
    total = _total(case, world_size)
    flat_grads = plant_settled_amax(randn(gen, total, dtype=dtype_of(case)))  # see _fp8: a settled scale
    amax_history = history_like(gen, case["history"], gaussian_amax(total), torch.bfloat16)
    return flat_grads, amax_history


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: flat_grads [W*N] ~ N(0, 1) and a history of 1e-8 (_fp8.upstream_fp8_inputs)."""
    return upstream_fp8_inputs(case, _total(case, world_size), device)


def reference(flat_grads, amax_history):
    world_size = dist.get_world_size()
    history = updated_history(amax_history, flat_grads)
    scale = dequant_scale(history)
    codes = encode(flat_grads, scale).view(torch.uint8)              # block d goes to rank d
    received = torch.empty_like(codes)
    dist.all_to_all_single(received, codes)                          # [W*N]: block s from rank s
    scales = gather_scales(scale)                                    # [W]: rank s's scale
    decoded = decode(received.view(FP8_DTYPE).view(world_size, -1), scales[:, None], flat_grads.dtype)
    grad_shard = (decoded.float().sum(dim=0) / world_size).to(flat_grads.dtype)
    return grad_shard, history


def cost(case, world_size):
    total = _total(case, world_size)
    shard = total // world_size
    return Cost(link_bytes=(world_size - 1) * shard + (world_size - 1) * 4,
                hbm_bytes=(total + shard) * dtype_of(case).itemsize, pattern="reduce_scatter (fp8 codes)")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size)


UPSTREAM = (Case("upstream", {"shard": 4096, "history": 16},
                 note="the upstream factory: flat_grads [4096*W] bf16, amax_history [16] bf16"),)

TESTS = (
    Case("odd_shard37", {"shard": 37, "history": 16}, tags=("odd_sizes",)),
    Case("shard1_history3", {"shard": 1, "history": 3}, tags=("tiny", "odd_sizes")),
    Case("shard300_history16", {"shard": 300, "history": 16}, tags=("odd_sizes",)),
)

BENCHMARKS = (
    Case("deepseek_v3_expert_bucket", {"total": 3 * 7168 * 2048, "history": 16}),
    Case("qwen3_235b_a22b_expert_bucket", {"total": 3 * 4096 * 1536, "history": 16}),
    Case("mixtral_8x7b_expert_bucket", {"total": 3 * 4096 * 14336, "history": 16}),
)

PROBLEM = Problem(
    name="fp8_reduce_scatter_grads", version=3, upstream_id=52, category="expert_parallel",
    source="Transformer Engine / torchao float8 delayed scaling (amax history) + ZeRO gradient reduce-scatter",
    exact_dtype=None, exact_note="quantisation: each rank's e4m3 codes come from its fp32 delayed-scaling recipe; the "
                                 "mean of the decoded codes is compared with the reference's by the tolerance",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
