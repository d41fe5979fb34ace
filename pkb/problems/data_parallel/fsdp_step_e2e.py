"""One FSDP training step end to end on a flat parameter (PyTorch FSDP ``FlatParameter``, FULL_SHARD):
all-gather the parameter shards, forward and backward, reduce-scatter the gradients, AdamW on the shard.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch, fp32); flat_param_shard [S] (fp32, this
rank's 1/W of the flat parameter: W1 [Dh, Din], b1 [Dh], W2 [Do, Dh], b2 [Do] flattened in order, P
elements, zero-padded to W*S, S = ceil(P/W)); param_shapes (the four shapes, in that order);
exp_avg_shard, exp_avg_sq_shard [S] (fp32 AdamW moments of the shard, zero in the padding); lr, beta1,
beta2, eps, weight_decay (floats), step (int >= 1).
Reference: all-gather the shards into the padded flat [W*S] and view W1..b2 in it; forward and
hand-written backward of the ``_common`` MLP on the local batch; reduce-scatter (sum) the zero-padded
flat gradient and divide by W (FSDP's gradient average); torch.optim.AdamW (decoupled weight decay)
on the shard, in place.
Output: (flat_param_shard, exp_avg_shard, exp_avg_sq_shard), also the inputs updated in place.
Upstream drew the parameters on rank 0 only, so most shards were zero; here every shard is a random
slice of one model (the same model on every rank).

Cost per rank, P parameters (fp32), S = ceil(P/W): link bytes (W-1)/W * 4WS (all-gather) +
(W-1)/W * 4WS (reduce-scatter); flops 6*B*(Din*Dh + Dh*Do) + 10S (+2S weight decay); HBM
4B(Din + Do) + 4P + 28S. Benchmarks: see ``_common.mlp_cases``.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, adam_hyperparameters, adam_step_, dims,
                                                flat_padded, mlp_adam_states, mlp_batch, mlp_cases, mlp_flops,
                                                mlp_grads, mlp_init, mlp_shapes, mlp_step_hbm_bytes, shard,
                                                shard_numel, mlp_num_params, unflatten)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen.shared, gen.device, *dims(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen, world_size)
    lr, beta1, beta2, eps, step = adam_hyperparameters(gen)
    return (x, y, shard(flat_padded(params, world_size), rank, world_size), mlp_shapes(*dims(case)),
            shard(flat_padded(exp_avgs, world_size), rank, world_size),
            shard(flat_padded(exp_avg_sqs, world_size), rank, world_size), lr, beta1, beta2, eps, 0.01, step)


def reference(X_local, y_local, flat_param_shard, param_shapes, exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2,
              eps, weight_decay, step):
    world_size = dist.get_world_size()
    part = flat_param_shard.numel()
    flat_param = torch.empty(world_size * part, dtype=flat_param_shard.dtype, device=flat_param_shard.device)
    dist.all_gather_into_tensor(flat_param, flat_param_shard)
    grads = mlp_grads(X_local, y_local, *unflatten(flat_param, param_shapes))
    grad_shard = torch.empty_like(flat_param_shard)
    dist.reduce_scatter_tensor(grad_shard, flat_padded(grads, world_size))
    grad_shard /= world_size
    adam_step_(flat_param_shard, grad_shard, exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2, eps, step,
               weight_decay=weight_decay)
    return flat_param_shard, exp_avg_shard, exp_avg_sq_shard


def cost(case, world_size):
    part = shard_numel(mlp_num_params(*dims(case)), world_size)
    return Cost(link_bytes=(world_size - 1) / world_size * 2 * 4 * world_size * part,
                flops=mlp_flops(*dims(case), case["batch_per_rank"]) + (ADAM_FLOPS_PER_ELEMENT + 2) * part,
                hbm_bytes=mlp_step_hbm_bytes(case, part), pattern="all_gather+reduce_scatter")


_TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="fsdp_step_e2e", version=1, upstream_id=47, category="data_parallel",
    source="PyTorch FSDP FlatParameter FULL_SHARD step (all-gather, backward, reduce-scatter average) + "
           "torch.optim.AdamW",
    world_sizes=(2, 4, 8), tests=_TESTS, benchmarks=_BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
