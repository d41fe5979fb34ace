"""Inputs and the step's last half, shared by the ZeRO-1 and ZeRO-2 problems (upstream 41, 42).

Both train the ``_common`` MLP. Every rank passes its own W1, b1, W2, b2 (random, distinct per rank:
the step broadcasts rank 0's, as the upstream does). The Adam moments are sharded: the flat parameter
vector (W1, b1, W2, b2 flattened in order, P elements, P a multiple of W as the upstream asserts) is
split into W contiguous partitions of S = P/W elements; rank r owns elements [r*S, (r+1)*S) and
their moments exp_avg_part, exp_avg_sq_part [S].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problems.data_parallel._common import (adam_step, dims, mlp_adam_states, mlp_batch, mlp_dtype,
                                                mlp_hyperparameters, mlp_init, mlp_num_params, shard, unflatten,
                                                upstream_adam_hyperparameters, upstream_mlp_draws)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen, gen.device, *dims(case), dtype=mlp_dtype(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen.shared, gen.device, world_size)
    flat_exp_avg = torch.cat([t.reshape(-1) for t in exp_avgs])
    flat_exp_avg_sq = torch.cat([t.reshape(-1) for t in exp_avg_sqs])
    return (x, y, *params, shard(flat_exp_avg, rank, world_size), shard(flat_exp_avg_sq, rank, world_size),
            *mlp_hyperparameters(case, gen))


def upstream_inputs(case, upstream_id, rank, world_size, trial, device):
    """Upstream's values for ZeRO-1 and ZeRO-2: ``upstream_mlp_draws`` (rank 0's model, zeros elsewhere), zero
    moment partitions [P/W], step 1 + trial % 7."""
    x, y, params = upstream_mlp_draws(case, upstream_id, rank, world_size, trial, device)
    part = mlp_num_params(*dims(case)) // world_size
    moments = [torch.zeros(part, dtype=mlp_dtype(case), device=device) for _ in range(2)]
    return (x, y, *params, *moments, *upstream_adam_hyperparameters(trial))


def update_partition_and_gather(flat_params, grad_part, exp_avg_part, exp_avg_sq_part, shapes, lr, beta1, beta2, eps,
                                step):
    """Adam (fp32, out of place) on this rank's partition of ``flat_params`` (rank 0's parameters, [P])
    with its averaged gradient partition and moments; all-gather the W updated partitions in the
    parameters' dtype. The stages differ only in how ``grad_part`` is made.

    Returns (W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part): new tensors, the inputs are left unchanged.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    part = exp_avg_part.numel()
    param_part, exp_avg_part, exp_avg_sq_part = adam_step(flat_params[rank * part:(rank + 1) * part], grad_part,
                                                          exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step)
    gathered = torch.empty(world_size * part, dtype=flat_params.dtype, device=flat_params.device)
    dist.all_gather_into_tensor(gathered, param_part)
    return (*unflatten(gathered, shapes), exp_avg_part, exp_avg_sq_part)
