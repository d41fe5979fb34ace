"""One FSDP training step end to end on a flat parameter (PyTorch FSDP ``FlatParameter``, FULL_SHARD):
all-gather the parameter shards, forward and backward, reduce-scatter the gradients, AdamW on the shard.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch); flat_param_shard [S] (this rank's 1/W
of the flat parameter: W1 [Dh, Din], b1 [Dh], W2 [Do, Dh], b2 [Do] flattened in order, P elements,
P a multiple of W as the upstream asserts, S = P/W); param_shapes (the four shapes, a tuple of
tuples, in that order); exp_avg_shard, exp_avg_sq_shard [S] (AdamW moments of the shard); all in one
dtype (the run's precision, bf16 by default); lr, beta1, beta2, eps, weight_decay (floats), step (int >= 1).
Reference: all-gather the shards into the flat [P] and view W1..b2 in it; forward and hand-written
backward of the ``_common`` MLP (ReLU, mean-squared error) on the local batch; reduce-scatter (sum)
the flat gradient and divide by W (FSDP's gradient average); torch.optim.AdamW (decoupled weight
decay: theta - lr*wd*theta - lr*m_hat/(sqrt(v_hat) + eps)) on the shard. Gradients and AdamW in
fp32, each output rounded once.
Output: (flat_param_shard, exp_avg_shard, exp_avg_sq_shard) after the step: new tensors in the
inputs' dtype; the inputs are left unchanged. Upstream drew the parameters on rank 0 only, so most
shards were zero; here every shard is a random slice of one model (the same model on every rank).
Tolerance: relative (``_common.mlp_tolerance``), and the weight decay's relative size lr*wd (1e-5) as a bias of the
parameters, between 0 and +1e-5 (``Tolerance.bias``), where it is below half an ulp of the dtype (fp16, bf16): upstream's own
``theta.add_(flat_param_shard, alpha=-lr * weight_decay)`` in fp16 leaves theta as it was, a +1e-5 bias on every
parameter that pkb's bias test saw at 9.7 standard errors in fp16 (pkb's reference applies it in fp32).

Cost per rank, P parameters of b bytes, S = P/W: link bytes (W-1)/W * P*b (all-gather) + (W-1)/W *
P*b (reduce-scatter; the reference reduces in fp32, a kernel may reduce in the parameters' dtype as
the upstream does); flops 6*B*(Din*Dh + Dh*Do) + 10S (+2S weight decay); HBM b*(B(Din + Do) + P + 7S).
Upstream case: 256 -> 512 -> 256 (P = 262,912), 1024/W rows per rank, step 1 to 7, weight decay 0.01.
Benchmarks: ``_common.mlp_cases``.
"""

import dataclasses

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, adam_step, batch_rows, dims, mlp_adam_states,
                                                mlp_batch, mlp_cases, mlp_dtype, mlp_flops, mlp_grads,
                                                mlp_hyperparameters, mlp_init, mlp_num_params, mlp_shapes,
                                                mlp_step_hbm_bytes, mlp_tolerance, shard, unflatten,
                                                upstream_adam_hyperparameters, upstream_mlp_draws)

WEIGHT_DECAY = 0.01  # upstream's factory's, and every case's


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen.shared, gen.device, *dims(case), dtype=mlp_dtype(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen.shared, gen.device, world_size)
    lr, beta1, beta2, eps, step = mlp_hyperparameters(case, gen)
    flat = [torch.cat([t.reshape(-1) for t in tensors]) for tensors in (params, exp_avgs, exp_avg_sqs)]
    param_shard, exp_avg_shard, exp_avg_sq_shard = (shard(f, rank, world_size) for f in flat)
    return (x, y, param_shard, mlp_shapes(*dims(case)), exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2, eps,
            WEIGHT_DECAY, step)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: this rank's 1/W of the flat ``upstream_mlp_draws`` model (rank 0's parameters, zeros
    elsewhere), zero moments, weight decay 0.01, step 1 + trial % 7."""
    x, y, params = upstream_mlp_draws(case, PROBLEM.upstream_id, rank, world_size, trial, device)
    flat = torch.cat([param.reshape(-1) for param in params])
    part = flat.numel() // world_size
    lr, beta1, beta2, eps, step = upstream_adam_hyperparameters(trial)
    return (x, y, shard(flat, rank, world_size), mlp_shapes(*dims(case)), flat.new_zeros(part), flat.new_zeros(part),
            lr, beta1, beta2, eps, WEIGHT_DECAY, step)


def reference(X_local, y_local, flat_param_shard, param_shapes, exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2,
              eps, weight_decay, step):
    world_size = dist.get_world_size()
    part = flat_param_shard.numel()
    flat_param = torch.empty(world_size * part, dtype=flat_param_shard.dtype, device=flat_param_shard.device)
    dist.all_gather_into_tensor(flat_param, flat_param_shard)
    grads = mlp_grads(X_local, y_local, *unflatten(flat_param, param_shapes))
    grad_shard = torch.empty(part, dtype=torch.float32, device=flat_param_shard.device)
    dist.reduce_scatter_tensor(grad_shard, torch.cat([g.reshape(-1) for g in grads]))
    grad_shard /= world_size
    return adam_step(flat_param_shard, grad_shard, exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2, eps, step,
                     weight_decay=weight_decay)


def cost(case, world_size):
    num_params = mlp_num_params(*dims(case))
    part = num_params // world_size
    return Cost(link_bytes=(world_size - 1) / world_size * 2 * num_params * mlp_dtype(case).itemsize,
                flops=mlp_flops(*dims(case), batch_rows(case, world_size)) + (ADAM_FLOPS_PER_ELEMENT + 2) * part,
                hbm_bytes=mlp_step_hbm_bytes(case, world_size, part), pattern="all_gather+reduce_scatter")


def tolerance(case, world_size, dtype):
    """``mlp_tolerance``, with the weight decay as a declared bias of the parameters where an add in ``dtype`` loses it
    (it leaves them larger: +lr * wd)."""
    lr = upstream_adam_hyperparameters(0)[0]  # every case's lr (``mlp_hyperparameters``: upstream's 1e-3)
    decay = lr * WEIGHT_DECAY
    lost = decay < torch.finfo(dtype).eps / 2
    return dataclasses.replace(mlp_tolerance(case, world_size, dtype), bias=decay if lost else 0.0,
                               bias_on=("out[0]",))  # the parameters: the moments have no decay to lose


_UPSTREAM, _TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="fsdp_step_e2e", version=4, upstream_id=47, category="data_parallel",
    source="PyTorch FSDP FlatParameter FULL_SHARD step (all-gather, backward, reduce-scatter average) + "
           "torch.optim.AdamW",
    world_sizes=(2, 4, 8), upstream=_UPSTREAM, tests=_TESTS, benchmarks=_BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
