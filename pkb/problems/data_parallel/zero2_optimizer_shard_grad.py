"""ZeRO stage 2 step (DeepSpeed ZeRO-2): reduce-scatter the gradients so each rank keeps only its
1/W, Adam on that partition with its sharded moments, all-gather the updated parameters.

Per rank: X_local [B, Din], y_local [B, Do] (this rank's batch, fp32); W1 [Dh, Din], b1 [Dh], W2 [Do, Dh],
b2 [Do] (fp32, replicated); exp_avg_part, exp_avg_sq_part [S] (fp32 Adam moments of this rank's
partition, S = ceil(P/W), layout in ``_zero``); lr, beta1, beta2, eps (floats), step (int >= 1).
Reference: forward and hand-written backward of the ``_common`` MLP on the local batch; reduce-scatter
(sum) the zero-padded flat gradient [W*S] and divide by W; torch.optim.Adam on this rank's partition
with the local moments (updated in place); all-gather the updated partitions and write the first P
elements back into W1..b2 in place.
Output: (W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part), also the inputs updated in place.

Cost per rank, P parameters (fp32), S = ceil(P/W): link bytes (W-1)/W * 4WS (reduce-scatter) +
(W-1)/W * 4WS (all-gather); flops 6*B*(Din*Dh + Dh*Do) + 10S; HBM 4B(Din + Do) + 4P + 28S.
Benchmarks: see ``_common.mlp_cases``.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.data_parallel import _zero
from pkb.problems.data_parallel._common import (ADAM_FLOPS_PER_ELEMENT, dims, flat_padded, mlp_cases, mlp_flops,
                                                mlp_grads, mlp_num_params, mlp_step_hbm_bytes, shard_numel)


def make_inputs(case, rank, world_size, gen):
    return _zero.make_inputs(case, rank, world_size, gen)


def reference(X_local, y_local, W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step):
    world_size = dist.get_world_size()
    params = [W1, b1, W2, b2]
    flat_grad = flat_padded(mlp_grads(X_local, y_local, *params), world_size)
    grad_part = torch.empty(exp_avg_part.numel(), dtype=flat_grad.dtype, device=flat_grad.device)
    dist.reduce_scatter_tensor(grad_part, flat_grad)
    grad_part /= world_size
    _zero.update_partition_and_gather(params, grad_part, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step)
    return W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part


def cost(case, world_size):
    num_params = mlp_num_params(*dims(case))
    part = shard_numel(num_params, world_size)
    return Cost(link_bytes=(world_size - 1) / world_size * 2 * 4 * world_size * part,
                flops=mlp_flops(*dims(case), case["batch_per_rank"]) + ADAM_FLOPS_PER_ELEMENT * part,
                hbm_bytes=mlp_step_hbm_bytes(case, part), pattern="reduce_scatter+all_gather")


_TESTS, _BENCHMARKS = mlp_cases()

PROBLEM = Problem(
    name="zero2_optimizer_shard_grad", version=1, upstream_id=42, category="data_parallel",
    source="DeepSpeed ZeRO stage 2 (DeepSpeedZeroOptimizer with partitioned gradients: reduce-scatter, "
           "partitioned Adam, all-gather)",
    world_sizes=(2, 4, 8), tests=_TESTS, benchmarks=_BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
