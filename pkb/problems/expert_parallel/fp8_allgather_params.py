"""FP8 parameter all-gather with delayed scaling (Transformer Engine / torchao float8 FSDP recipe).

Per rank: flat_param_shard [N] bf16 (rank r's shard; random, distinct per rank), amax_history [L] bf16
(this rank's history of past amaxes)  ->
    full [W*N] bf16: decode_s(encode_s(shard_s)) of every rank s, in rank order (identical on every rank)
    updated_amax_history [L] bf16: [history[1], ..., history[L-1], local amax]
Each rank quantizes its shard with its OWN scale, from its own history and its own amax (the
upstream recipe, see _fp8.py). The reference all-gathers the 1-byte e4m3 codes and the W fp32
scales and decodes each rank's block with that rank's scale (code * scale in fp32, rounded to bf16:
bit-equal to upstream, which gathers the decoded bf16 values).

Tolerance: relative 2^-7 (one bf16 ulp), room for a decode that rounds differently; skipping the fp8
round trip is off by up to 2^-4 relative and fails.

Cost: the all-gather of the codes brings (W-1) * N bytes into each rank, plus the other ranks' fp32
scales, (W-1) * 4 bytes. HBM: read N bf16, write W*N bf16.

Cases: ``upstream`` is the upstream factory: flat_param_shard [4096] bf16, a history of 16.
Benchmarks: one expert's weights (gate, up and down: 3 * hidden * intermediate, config.json) sharded
over the ranks: DeepSeek-V3 (7168 x 2048), Qwen3-235B-A22B (4096 x 1536), Mixtral 8x7B (4096 x 14336).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.expert_parallel._common import dtype_of
from pkb.problems.expert_parallel._fp8 import (FP8_DTYPE, decode, dequant_scale, encode, gather_scales,
                                               gaussian_amax, history_like, plant_settled_amax,
                                               updated_history, upstream_fp8_inputs)


def _shard(case, world_size) -> int:
    return case["total"] // world_size if "total" in case.params else case["shard"]


def make_inputs(case, rank, world_size, gen):
    shard = _shard(case, world_size)
    flat_param_shard = plant_settled_amax(randn(gen, shard, dtype=dtype_of(case)))  # see _fp8: a settled scale
    amax_history = history_like(gen, case["history"], gaussian_amax(shard), torch.bfloat16)
    return flat_param_shard, amax_history


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: flat_param_shard [N] ~ N(0, 1) and a history of 1e-8 (_fp8.upstream_fp8_inputs)."""
    return upstream_fp8_inputs(case, _shard(case, world_size), device)


def reference(flat_param_shard, amax_history):
    world_size = dist.get_world_size()
    history = updated_history(amax_history, flat_param_shard)
    scale = dequant_scale(history)
    codes = encode(flat_param_shard, scale).view(torch.uint8)
    gathered = torch.empty(world_size * codes.numel(), dtype=torch.uint8, device=codes.device)
    dist.all_gather_into_tensor(gathered, codes)
    scales = gather_scales(scale)                                    # [W]: rank s's scale
    full = decode(gathered.view(FP8_DTYPE).view(world_size, -1), scales[:, None], flat_param_shard.dtype)
    return full.view(-1), history


def cost(case, world_size):
    shard = _shard(case, world_size)
    return Cost(link_bytes=(world_size - 1) * shard + (world_size - 1) * 4,
                hbm_bytes=(shard + world_size * shard) * dtype_of(case).itemsize, pattern="all_gather (fp8 codes)")


UPSTREAM = (Case("upstream", {"shard": 4096, "history": 16},
                 note="the upstream factory: flat_param_shard [4096] bf16, amax_history [16] bf16"),)

TESTS = (
    Case("odd_shard37", {"shard": 37, "history": 16}, tags=("odd_sizes",)),
    Case("shard1_history3", {"shard": 1, "history": 3}, tags=("tiny", "odd_sizes")),
    Case("shard500_history16", {"shard": 500, "history": 16}, tags=("odd_sizes",)),
)

BENCHMARKS = (
    Case("deepseek_v3_expert", {"total": 3 * 7168 * 2048, "history": 16}),
    Case("qwen3_235b_a22b_expert", {"total": 3 * 4096 * 1536, "history": 16}),
    Case("mixtral_8x7b_expert", {"total": 3 * 4096 * 14336, "history": 16}),
)

PROBLEM = Problem(
    name="fp8_allgather_params", version=3, upstream_id=53, category="expert_parallel",
    source="Transformer Engine / torchao float8 delayed scaling + FSDP parameter all-gather",
    exact_dtype=None, exact_note="quantisation: the decoded e4m3 codes of each rank's fp32 delayed-scaling recipe are "
                                 "the answer; compared with the reference's by the tolerance",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    tolerance=Tolerance(atol=0.0, rtol=2.0**-7),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
