"""ZeRO stage 1 step (DeepSpeed ZeRO-1): broadcast rank 0's parameters, all-reduce the gradients,
Adam on this rank's 1/W of the flat parameters with its sharded moments, all-gather the parameters.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch); W1 [Dh, Din], b1 [Dh], W2 [Do, Dh],
b2 [Do] (distinct per rank: rank 0's are the model); exp_avg_part, exp_avg_sq_part [S] (Adam moments
of this rank's partition, S = P/W, layout in ``_zero``); all in one dtype (the run's precision, bf16 by default);
lr, beta1, beta2, eps (floats), step (int >= 1).
Reference: broadcast the flat parameters [P] from rank 0; forward and hand-written backward of the
``_common`` MLP (ReLU, mean-squared error) on the local batch; all-reduce (sum) the flat gradient
and divide by W; Adam (torch.optim.Adam, no weight decay) on elements [r*S, (r+1)*S) with the local
moments; all-gather the W updated partitions. Gradients and Adam in fp32, each output rounded once.
Output: (W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part), new tensors in the inputs' dtype: the
updated model (the same on every rank) and this rank's updated moments. Inputs are left unchanged.
Tolerance: relative (``_common.mlp_tolerance``).

Cost per rank, P parameters of b bytes, S = P/W: link bytes P*b (broadcast, counted once as
nccl-tests does) + 2(W-1)/W * P*b (all-reduce) + (W-1)/W * P*b (all-gather); flops
6*B*(Din*Dh + Dh*Do) + 10S; HBM b*(B(Din + Do) + P + 7S). The reference reduces in fp32; a kernel
may reduce in the parameters' dtype, as the upstream does.
Upstream case: 256 -> 512 -> 256 (P = 262,912), 1024/W rows per rank, step 1 to 7. Benchmarks: ``_common.mlp_cases``.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel import _zero
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, batch_rows, broadcast_flat, dims, mlp_cases,
                                                mlp_dtype, mlp_flops, mlp_grads, mlp_num_params, mlp_step_hbm_bytes,
                                                mlp_tolerance, unflatten)


def make_inputs(case, rank, world_size, gen):
    return _zero.make_inputs(case, rank, world_size, gen)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: rank 0's N(0, 1) model (zeros elsewhere), zero moment partitions (``_zero``)."""
    return _zero.upstream_inputs(case, PROBLEM.upstream_id, rank, world_size, trial, device)


def reference(X_local, y_local, W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    shapes = [p.shape for p in (W1, b1, W2, b2)]
    flat_params = broadcast_flat([W1, b1, W2, b2])
    grads = mlp_grads(X_local, y_local, *unflatten(flat_params, shapes))
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat_grad)
    flat_grad /= world_size
    part = exp_avg_part.numel()
    return _zero.update_partition_and_gather(flat_params, flat_grad[rank * part:(rank + 1) * part], exp_avg_part,
                                             exp_avg_sq_part, shapes, lr, beta1, beta2, eps, step)


def cost(case, world_size):
    num_params = mlp_num_params(*dims(case))
    param_bytes = num_params * mlp_dtype(case).itemsize
    part = num_params // world_size
    return Cost(link_bytes=param_bytes + (world_size - 1) / world_size * 3 * param_bytes,
                flops=mlp_flops(*dims(case), batch_rows(case, world_size)) + ADAM_FLOPS_PER_ELEMENT * part,
                hbm_bytes=mlp_step_hbm_bytes(case, world_size, part), pattern="broadcast+all_reduce+all_gather")


_UPSTREAM, _TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="zero1_optimizer_shard", version=3, upstream_id=41, category="data_parallel",
    source="DeepSpeed ZeRO stage 1 (DeepSpeedZeroOptimizer: averaged all-reduce, partitioned Adam, all-gather)",
    world_sizes=(2, 4, 8), upstream=_UPSTREAM, tests=_TESTS, benchmarks=_BENCHMARKS, tolerance=mlp_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
