"""One DistributedDataParallel training step with Adam (PyTorch DDP semantics) on a two-layer MLP.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch); W1 [Dh, Din], b1 [Dh], W2 [Do, Dh],
b2 [Do] and their Adam moments exp_avg_* and exp_avg_sq_* (distinct per rank: rank 0's are the
model and optimizer state); all in one dtype (the run's precision, bf16 by default); lr, beta1,
beta2, eps (floats), step (int, the step being taken, >= 1).
Reference (MLP and Adam in ``_common``): broadcast the parameters, the exp_avg and the exp_avg_sq
from rank 0, each flattened into one buffer (DDP's module sync; the upstream syncs the moments too);
forward and hand-written backward of mean((relu(X W1^T + b1) W2^T + b2 - y)^2) on the local batch;
all-reduce (sum) the flat gradient and divide by W (DDP's gradient average); one torch.optim.Adam
step (no weight decay) on every parameter. Gradients and Adam in fp32, each output rounded once.
Output: 12 new tensors in the inputs' dtype (W1, b1, W2, b2, the four exp_avg, the four exp_avg_sq):
rank 0's model and moments after the step, the same on every rank. Inputs are left unchanged.
Tolerance: relative (``_common.mlp_tolerance``): no output is near zero, moments and parameters
differ in scale by orders of magnitude.

Cost per rank, P parameters of b bytes: link bytes 3*P*b (three broadcasts, nccl-tests counts each
buffer once) + 2(W-1)/W * P*b (gradient all-reduce; the reference reduces in fp32, a kernel may
reduce in the parameters' dtype as the upstream does); flops 6*B*(Din*Dh + Dh*Do) (forward and
backward GEMMs) + 10P (Adam); HBM b*(B(Din + Do) + P + 7P) (batch, weights, Adam's reads and writes).
Upstream case: 256 -> 512 -> 256 (P = 262,912), 1024/W rows per rank, step 1 to 7. Benchmarks: ``_common.mlp_cases``.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, adam_step, batch_rows, broadcast_flat, dims,
                                                mlp_adam_states, mlp_batch, mlp_cases, mlp_dtype, mlp_flops, mlp_grads,
                                                mlp_hyperparameters, mlp_init, mlp_num_params, mlp_step_hbm_bytes,
                                                mlp_tolerance, unflatten, upstream_adam_hyperparameters,
                                                upstream_mlp_draws)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen, gen.device, *dims(case), dtype=mlp_dtype(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen, gen.device, world_size)
    return (x, y, *params, *exp_avgs, *exp_avg_sqs, *mlp_hyperparameters(case, gen))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: ``upstream_mlp_draws`` (rank 0's model, zeros elsewhere), all eight Adam moments zero,
    step 1 + trial % 7."""
    x, y, params = upstream_mlp_draws(case, PROBLEM.upstream_id, rank, world_size, trial, device)
    moments = [torch.zeros_like(param) for _ in ("exp_avg", "exp_avg_sq") for param in params]
    return (x, y, *params, *moments, *upstream_adam_hyperparameters(trial))


def reference(X_local, y_local, W1, b1, W2, b2, exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2, exp_avg_sq_W1,
              exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2, lr, beta1, beta2, eps, step):
    shapes = [p.shape for p in (W1, b1, W2, b2)]
    flat_params = broadcast_flat([W1, b1, W2, b2])
    flat_exp_avg = broadcast_flat([exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2])
    flat_exp_avg_sq = broadcast_flat([exp_avg_sq_W1, exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2])
    grads = mlp_grads(X_local, y_local, *unflatten(flat_params, shapes))
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat_grad)
    flat_grad /= dist.get_world_size()
    updated = adam_step(flat_params, flat_grad, flat_exp_avg, flat_exp_avg_sq, lr, beta1, beta2, eps, step)
    return tuple(view for flat in updated for view in unflatten(flat, shapes))


def cost(case, world_size):
    num_params = mlp_num_params(*dims(case))
    param_bytes = num_params * mlp_dtype(case).itemsize
    return Cost(link_bytes=3 * param_bytes + 2 * (world_size - 1) / world_size * param_bytes,
                flops=mlp_flops(*dims(case), batch_rows(case, world_size)) + ADAM_FLOPS_PER_ELEMENT * num_params,
                hbm_bytes=mlp_step_hbm_bytes(case, world_size, num_params), pattern="broadcast+all_reduce")


_UPSTREAM, _TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="ddp", version=3, upstream_id=40, category="data_parallel",
    source="PyTorch DistributedDataParallel step (rank-0 parameter broadcast, bucketed gradient all-reduce "
           "average) + torch.optim.Adam",
    world_sizes=(2, 4, 8), upstream=_UPSTREAM, tests=_TESTS, benchmarks=_BENCHMARKS, tolerance=mlp_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
