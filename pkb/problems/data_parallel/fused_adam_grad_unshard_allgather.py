"""Sharded mixed-precision Adam step then parameter all-gather (DeepSpeed ZeRO bf16 optimizer /
FSDP sharded optimizer): each rank updates its fp32 master shard with its (already reduced) bf16
gradient shard, casts it to bf16 and all-gathers the model's full bf16 parameter vector.

Per rank: grad_shard [S] bf16 (this rank's averaged gradient partition), master_shard [S] fp32 (its
fp32 master parameters), exp_avg, exp_avg_sq [S] fp32 (its Adam moments), lr, beta1, beta2, eps
(floats), step (int >= 1). Rank r owns elements [r*S, (r+1)*S) of the flat parameter vector.
Reference: torch.optim.Adam on the shard in fp32 (master and moments updated in place), master cast
to bf16, all-gather of the W bf16 shards.
Output: (params [W*S] bf16, master_shard, exp_avg, exp_avg_sq). Upstream returned only the gathered
parameters; the fp32 master and the moments are the optimizer's real outputs and are checked too.

Cost per rank: link bytes (W-1)/W * 2WS (bf16 all-gather); flops 10S (Adam) + S (cast); HBM 2S
(gradient) + 28S (Adam's fp32 reads and writes) + 2S (own bf16 shard) + 2WS (the gathered vector).

Benchmarks: the parameters of one Llama-3-70B decoder layer (855,654,400) and of one Llama-3-8B
decoder layer (218,112,000), sharded over W (DeepSpeed steps and gathers per parameter group), and
the whole Llama-3-8B model (8,030,261,248 parameters) at W = 8.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.data_parallel._common import (ADAM_BYTES_PER_ELEMENT, ADAM_FLOPS_PER_ELEMENT, adam_hyperparameters,
                                                adam_states, adam_step_, shard_numel)

GRAD_SCALE = 1e-3


def make_inputs(case, rank, world_size, gen):
    part = shard_numel(case["num_params"], world_size)
    grad_shard = randn(gen, part, dtype=torch.bfloat16, scale=GRAD_SCALE)
    master_shard = randn(gen, part)
    exp_avg, exp_avg_sq = adam_states(gen, GRAD_SCALE, part)
    return (grad_shard, master_shard, exp_avg, exp_avg_sq, *adam_hyperparameters(gen))


def reference(grad_shard, master_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step):
    adam_step_(master_shard, grad_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step)
    shard_bf16 = master_shard.to(torch.bfloat16)
    params = torch.empty(dist.get_world_size() * shard_bf16.numel(), dtype=torch.bfloat16, device=shard_bf16.device)
    dist.all_gather_into_tensor(params, shard_bf16)
    return params, master_shard, exp_avg, exp_avg_sq


def cost(case, world_size):
    part = shard_numel(case["num_params"], world_size)
    return Cost(link_bytes=(world_size - 1) / world_size * 2 * world_size * part,
                flops=(ADAM_FLOPS_PER_ELEMENT + 1) * part,
                hbm_bytes=(2 + ADAM_BYTES_PER_ELEMENT + 2) * part + 2 * world_size * part, pattern="all_gather")


PROBLEM = Problem(
    name="fused_adam_grad_unshard_allgather", version=1, upstream_id=43, category="data_parallel",
    source="DeepSpeed ZeRO bf16 optimizer / FSDP: fused Adam on the fp32 master partition, bf16 parameter all-gather",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_1001_params", {"num_params": 1001}),
        Case("one_element_shards", {"num_params": 3}),
        Case("shard_4099", {"num_params": 4099 * 8}),
    ],
    benchmarks=[
        Case("llama3_70b_layer", {"num_params": 855_654_400}),
        Case("llama3_8b_layer", {"num_params": 218_112_000}),
        Case("llama3_8b_full_model", {"num_params": 8_030_261_248}, world_sizes=(8,)),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
