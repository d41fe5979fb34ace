"""Inputs shared by the ZeRO-1 and ZeRO-2 step problems (upstream 41, 42).

Both train the ``_common`` MLP with replicated fp32 parameters; the Adam moments are sharded: the
flat parameter vector (W1, b1, W2, b2 flattened in order, P elements) is zero-padded to W*S with
S = ceil(P / W), and rank r owns elements [r*S, (r+1)*S) and their moments (zero in the padding,
as DeepSpeed allocates them).
"""

from __future__ import annotations

from pkb.problems.data_parallel._common import (adam_hyperparameters, dims, flat_padded, mlp_adam_states, mlp_batch,
                                                mlp_init, shard)


def make_inputs(case, rank, world_size, gen):
    x, y = mlp_batch(case, gen, world_size)
    params = mlp_init(gen.shared, gen.device, *dims(case))
    exp_avgs, exp_avg_sqs = mlp_adam_states(case, gen, world_size)
    exp_avg_part = shard(flat_padded(exp_avgs, world_size), rank, world_size)
    exp_avg_sq_part = shard(flat_padded(exp_avg_sqs, world_size), rank, world_size)
    return (x, y, *params, exp_avg_part, exp_avg_sq_part, *adam_hyperparameters(gen))
