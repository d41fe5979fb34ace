"""Inputs and the step's last half, shared by the ZeRO-1 and ZeRO-2 problems (upstream 41, 42).

Both train the ``_common`` MLP with replicated fp32 parameters; the Adam moments are sharded: the
flat parameter vector (W1, b1, W2, b2 flattened in order, P elements) is zero-padded to W*S with
S = ceil(P / W), and rank r owns elements [r*S, (r+1)*S) and their moments (zero in the padding,
as DeepSpeed allocates them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problems.data_parallel._common import (adam_hyperparameters, adam_step_, dims, flat_padded, mlp_adam_states,
                                                mlp_batch, mlp_init, shard, unflatten)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen.shared, gen.device, *dims(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen, world_size)
    exp_avg_part = shard(flat_padded(exp_avgs, world_size), rank, world_size)
    exp_avg_sq_part = shard(flat_padded(exp_avg_sqs, world_size), rank, world_size)
    return (x, y, *params, exp_avg_part, exp_avg_sq_part, *adam_hyperparameters(gen))


def update_partition_and_gather(params, grad_part, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step):
    """Adam on this rank's partition of the padded flat parameters with its moments (updated in place),
    then all-gather the W updated partitions and write the first P elements back into ``params``.
    The stages differ only in how ``grad_part`` (this rank's averaged gradient partition) is made."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    part = exp_avg_part.numel()
    param_part = flat_padded(params, world_size)[rank * part:(rank + 1) * part].clone()
    adam_step_(param_part, grad_part, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step)
    gathered = torch.empty(world_size * part, dtype=param_part.dtype, device=param_part.device)
    dist.all_gather_into_tensor(gathered, param_part)
    for param, updated in zip(params, unflatten(gathered, [p.shape for p in params])):
        param.copy_(updated)
