"""Honest (real library code): torch.distributed.fsdp.FullyShardedDataParallel (FSDP1, FULL_SHARD, FlatParameter,
use_orig_params=False) wrapping an fp32 copy of the MLP whose parameters are the all-gathered flat shards; forward
under autocast in the inputs' dtype (bf16 GEMMs, as the reference's), MSE loss, backward (FSDP all-gathers the flat
parameter and reduce-scatters and averages the fp32 gradient), then torch.optim.AdamW on the local flat shard with
the given moments. FSDP's flat shard of rank r is elements [r*S, (r+1)*S) of the concatenated parameters, the
problem's layout. Outputs rounded once to the inputs' dtype."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy


def solution(X_local, y_local, flat_param_shard, param_shapes, exp_avg_shard, exp_avg_sq_shard, lr, beta1, beta2,
             eps, weight_decay, step):
    world = dist.get_world_size()
    dtype = flat_param_shard.dtype
    part = flat_param_shard.numel()
    flat = torch.empty(world * part, dtype=dtype)
    dist.all_gather_into_tensor(flat, flat_param_shard)
    (h, d_in), (h2,), (d_out, h3), (d_out2,) = [tuple(s) for s in param_shapes]
    model = torch.nn.Sequential(torch.nn.Linear(d_in, h), torch.nn.ReLU(), torch.nn.Linear(h, d_out))
    with torch.no_grad():
        i = 0
        for p in model.parameters():
            p.copy_(flat[i:i + p.numel()].view(p.shape).float())
            i += p.numel()
    fsdp = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=False,
                device_id=torch.device("cpu") if X_local.device.type == "cpu" else None)
    (flat_param,) = list(fsdp.parameters())
    opt = torch.optim.AdamW([flat_param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                            foreach=False)
    n = flat_param.numel()
    opt.state[flat_param] = {"step": torch.tensor(float(step - 1)),
                             "exp_avg": exp_avg_shard.float()[:n].clone(),
                             "exp_avg_sq": exp_avg_sq_shard.float()[:n].clone()}
    with torch.autocast(X_local.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = fsdp(X_local)
    loss = torch.nn.functional.mse_loss(out.float(), y_local.float())
    loss.backward()
    opt.step()
    st = opt.state[flat_param]
    return (flat_param.detach()[:part].to(dtype), st["exp_avg"][:part].to(exp_avg_shard.dtype),
            st["exp_avg_sq"][:part].to(exp_avg_sq_shard.dtype))
