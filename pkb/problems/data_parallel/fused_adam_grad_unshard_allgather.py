"""Sharded Adam step then parameter all-gather (DeepSpeed ZeRO / FSDP sharded optimizer): each rank
runs Adam on its shard of the master parameters with its (already reduced) gradient shard and
all-gathers the model's full updated parameter vector.

Per rank, tensors in the run's precision (bf16 by default), as upstream's factory makes them:
grad_shard [S] (this rank's averaged gradient partition), master_shard [S] (its master parameters),
exp_avg, exp_avg_sq [S] (its Adam moments), lr, beta1, beta2, eps (floats), step (int >= 1; upstream
passes 1 + trial % 7, the upstream case draws it in [1, 7], the tests up to 2000). Rank r owns
elements [r*S, (r+1)*S) of the flat parameter vector; S >= 1.
Reference: torch.optim.Adam's update on copies of the shard in fp32,
m = beta1*m + (1-beta1)*g, v = beta2*v + (1-beta2)*g^2,
w' = w - lr * (m / (1-beta1^t)) / (sqrt(v / (1-beta2^t)) + eps), rounded once to master's dtype, then
all-gathered. The inputs are left untouched (the upstream updates clones and returns only the gather).
Output: params [W*S] in master's dtype.

Cost per rank, b bytes per element: link bytes (W-1)/W * bWS (the all-gather); flops 10S (Adam);
HBM 4bS (read gradient, master and both moments) + bWS (write the gathered vector).

Benchmarks: the parameters of one Llama-3-70B decoder layer (855,654,400) and of one Llama-3-8B
decoder layer (218,112,000), sharded over W (DeepSpeed steps and gathers per parameter group), and
the whole Llama-3-8B model (8,030,261,248 parameters) at W = 8.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn, upstream_seed
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, adam_hyperparameters, adam_states,
                                                adam_step_, dtype_of, shard, shard_numel,
                                                upstream_adam_hyperparameters)

GRAD_SCALE = 1e-2  # keeps the second moment (~1e-4) inside fp16's normal range
MASTER_SCALE = 0.02  # weights at their usual init std; a bf16 master then still shows Adam's ~lr-sized step


def shard_size(case, world_size: int) -> int:
    return case["shard"] if "shard" in case.params else shard_numel(case["num_params"], world_size)


def make_inputs(case, rank, world_size, gen):
    part, dtype = shard_size(case, world_size), dtype_of(case)
    grad_shard = randn(gen, part, dtype=dtype, scale=GRAD_SCALE)
    master_shard = randn(gen, part, dtype=dtype, scale=MASTER_SCALE)
    exp_avg, exp_avg_sq = adam_states(gen, GRAD_SCALE, part)
    return (grad_shard, master_shard, exp_avg.to(dtype), exp_avg_sq.to(dtype),
            *adam_hyperparameters(gen, case.get("max_step", 2000)))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values, seeded as rank 0 on every rank: this rank's 1/W of an N(0, 1) gradient and of an N(0, 1)
    master vector [W*S], zero moments, step 1 + trial % 7."""
    upstream_seed(PROBLEM.upstream_id, 0, trial)
    part, dtype = shard_size(case, world_size), dtype_of(case)
    full_grad = torch.randn(part * world_size, dtype=dtype, device=device)
    full_master = torch.randn(part * world_size, dtype=dtype, device=device)
    return (shard(full_grad, rank, world_size), shard(full_master, rank, world_size),
            full_grad.new_zeros(part), full_grad.new_zeros(part), *upstream_adam_hyperparameters(trial))


def reference(grad_shard, master_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step):
    master, moment1, moment2 = (t.to(torch.float32, copy=True) for t in (master_shard, exp_avg, exp_avg_sq))
    adam_step_(master, grad_shard, moment1, moment2, lr, beta1, beta2, eps, step)
    shard = master.to(master_shard.dtype)
    params = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(params, shard)
    return params


def tolerance(case, world_size, dtype):
    """bf16 parameters: the upstream's Adam runs in bf16, so its update differs from the fp32 one by a
    few percent and the rounded parameter by one ulp (2^-7 relative) plus that: measured under
    1.2e-5 (updates ~2.5e-4, lr 1e-3). atol 5e-5 keeps a skipped or wrong update visible. fp16 the same
    way: one ulp (at most 2^-10 relative) plus an update a few fp16 roundings off (~1e-6); fp16's
    default atol (2e-3) would accept a skipped update."""
    if dtype == torch.bfloat16:
        return Tolerance(atol=5e-5, rtol=2.0**-7)
    if dtype == torch.float16:
        return Tolerance(atol=5e-6, rtol=2.0**-10)
    return default_tolerance(dtype)


def cost(case, world_size):
    part, itemsize = shard_size(case, world_size), dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * itemsize * world_size * part,
                flops=ADAM_FLOPS_PER_ELEMENT * part,
                hbm_bytes=4 * itemsize * part + itemsize * world_size * part,
                pattern="all_gather")


PROBLEM = Problem(
    name="fused_adam_grad_unshard_allgather", version=3, upstream_id=43, category="data_parallel",
    source="DeepSpeed ZeRO / FSDP sharded optimizer: Adam on the master partition, parameter all-gather",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"shard": 4096, "max_step": 7}, note="4096-element shards of everything, step 1 to 7"),
    ],
    # "argument_value": Adam steps up to 2000 (upstream passes 1 to 7)
    tests=[
        Case("odd_1001_params", {"num_params": 1001}, tags=("odd_sizes", "argument_value")),
        Case("one_element_shards", {"num_params": 3}, tags=("tiny", "argument_value")),
        Case("shard_4099", {"num_params": 4099 * 8}, tags=("odd_sizes", "argument_value")),
        Case("shard_333", {"shard": 333}, tags=("odd_sizes", "argument_value")),
    ],
    benchmarks=[
        Case("llama3_70b_layer", {"num_params": 855_654_400}),
        Case("llama3_8b_layer", {"num_params": 218_112_000}),
        Case("llama3_8b_full_model", {"num_params": 8_030_261_248}, world_sizes=(8,)),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
