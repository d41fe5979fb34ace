"""One DistributedDataParallel training step with Adam (PyTorch DDP semantics) on a two-layer MLP.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch, fp32); W1 [Dh, Din], b1 [Dh], W2 [Do, Dh],
b2 [Do] (fp32; distinct on every rank: DDP makes them rank 0's); exp_avg_* and exp_avg_sq_* (the Adam
moments of each parameter, fp32, the same on every rank as DDP keeps them); lr, beta1, beta2, eps
(floats), step (int, the step being taken, >= 1).
Reference (MLP and Adam in ``_common``): broadcast the parameters from rank 0 (DDP's module sync) into
W1..b2 in place; forward and hand-written backward of mean((gelu(X W1^T + b1) W2^T + b2 - y)^2) on the
local batch; all-reduce the flat gradient bucket and divide by W (DDP's gradient average); one
torch.optim.Adam step on every parameter, in place.
Output: the 12 updated tensors (W1, b1, W2, b2, the four exp_avg, the four exp_avg_sq), which are
also the inputs updated in place. Upstream drew the parameters on rank 0 only (zeros elsewhere) and
zero moments; here every tensor is random and the moments are those of a run in progress, so the
update is not a sign function of the gradient.

Cost per rank, P parameters (fp32): link bytes 4P (broadcast, nccl-tests counts the buffer once) +
2(W-1)/W * 4P (gradient all-reduce); flops 6*B*(Din*Dh + Dh*Do) (forward and backward GEMMs) + 10P
(Adam); HBM 4B(Din + Do) + 4P + 28P (batch, weights, Adam's reads and writes).
Benchmarks: see ``_common.mlp_cases``.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, adam_hyperparameters, adam_step_, dims,
                                                mlp_adam_states, mlp_batch, mlp_cases, mlp_flops, mlp_grads, mlp_init,
                                                mlp_num_params, mlp_step_hbm_bytes, unflatten)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen, gen.device, *dims(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen, world_size)
    return (x, y, *params, *exp_avgs, *exp_avg_sqs, *adam_hyperparameters(gen))


def reference(X_local, y_local, W1, b1, W2, b2, exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2, exp_avg_sq_W1,
              exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2, lr, beta1, beta2, eps, step):
    params = [W1, b1, W2, b2]
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    for param, synced in zip(params, unflatten(flat, [p.shape for p in params])):
        param.copy_(synced)
    grads = mlp_grads(X_local, y_local, *params)
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat_grad)
    flat_grad /= dist.get_world_size()
    exp_avgs = [exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2]
    exp_avg_sqs = [exp_avg_sq_W1, exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2]
    for param, grad, exp_avg, exp_avg_sq in zip(params, unflatten(flat_grad, [p.shape for p in params]), exp_avgs,
                                                exp_avg_sqs):
        adam_step_(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step)
    return (*params, *exp_avgs, *exp_avg_sqs)


def cost(case, world_size):
    num_params = mlp_num_params(*dims(case))
    return Cost(link_bytes=4 * num_params + 2 * (world_size - 1) / world_size * 4 * num_params,
                flops=mlp_flops(*dims(case), case["batch_per_rank"]) + ADAM_FLOPS_PER_ELEMENT * num_params,
                hbm_bytes=mlp_step_hbm_bytes(case, num_params), pattern="broadcast+all_reduce")


_TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="ddp", version=1, upstream_id=40, category="data_parallel",
    source="PyTorch DistributedDataParallel step (rank-0 parameter broadcast, bucketed gradient all-reduce "
           "average) + torch.optim.Adam",
    world_sizes=(2, 4, 8), tests=_TESTS, benchmarks=_BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
