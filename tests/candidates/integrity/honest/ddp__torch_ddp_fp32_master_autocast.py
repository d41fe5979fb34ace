"""Honest (real library code): torch.nn.parallel.DistributedDataParallel on an fp32 master copy of the MLP
(DDP's constructor broadcasts rank 0's parameters; the moments are broadcast by hand, as the problem's DDP does),
forward under CPU/GPU autocast in the run's dtype (the GEMMs in the inputs' dtype, as the reference's), MSE loss,
backward -- DDP all-reduces and averages the fp32 gradients in its buckets -- then torch.optim.Adam in fp32 with
the broadcast moments, each output rounded once to the inputs' dtype."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _bcast(ts):
    flat = torch.cat([t.reshape(-1) for t in ts])
    dist.broadcast(flat, 0)
    out, i = [], 0
    for t in ts:
        out.append(flat[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


def solution(X_local, y_local, W1, b1, W2, b2, exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2, exp_avg_sq_W1,
             exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2, lr, beta1, beta2, eps, step):
    dtype = X_local.dtype
    d_hidden, d_in = W1.shape
    d_out = W2.shape[0]
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(), torch.nn.Linear(d_hidden, d_out))
    with torch.no_grad():
        for p, src in zip(model.parameters(), (W1, b1, W2, b2)):
            p.copy_(src.float())
    ddp = DDP(model)  # broadcasts rank 0's parameters
    m = _bcast([exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2])
    v = _bcast([exp_avg_sq_W1, exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2])
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr, betas=(beta1, beta2), eps=eps, foreach=False)
    for p, mm, vv in zip(params, m, v):
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": mm.float().clone(),
                        "exp_avg_sq": vv.float().clone()}
    device_type = X_local.device.type
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        out = ddp(X_local)
    loss = torch.nn.functional.mse_loss(out.float(), y_local.float())
    loss.backward()
    opt.step()
    news = [p.detach().to(dtype) for p in params]
    ms = [opt.state[p]["exp_avg"].to(dtype) for p in params]
    vs = [opt.state[p]["exp_avg_sq"].to(dtype) for p in params]
    return (*news, *ms, *vs)
