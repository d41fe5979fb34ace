"""Honest (ordinary optimizer code): the DDP step done by hand with an fp32 master model of nn.Parameters and
torch.optim.Adam (grads all-reduced and averaged, Adam in fp32), returning the parameters and optimizer state
tensors themselves where they already have the inputs' dtype (in an fp32 run the nn.Parameter objects, requires_grad
and all) -- returning a model's parameters is what every training step's caller gets."""

import torch
import torch.distributed as dist


def _bcast(ts):
    flat = torch.cat([t.reshape(-1) for t in ts])
    dist.broadcast(flat, 0)
    out, i = [], 0
    for t in ts:
        out.append(flat[i:i + t.numel()].view(t.shape).clone())
        i += t.numel()
    return out


def solution(X_local, y_local, W1, b1, W2, b2, exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2, exp_avg_sq_W1,
             exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2, lr, beta1, beta2, eps, step):
    dtype = X_local.dtype
    world = dist.get_world_size()
    params = [torch.nn.Parameter(t.float()) for t in _bcast([W1, b1, W2, b2])]
    m = _bcast([exp_avg_W1, exp_avg_b1, exp_avg_W2, exp_avg_b2])
    v = _bcast([exp_avg_sq_W1, exp_avg_sq_b1, exp_avg_sq_W2, exp_avg_sq_b2])
    w1, bb1, w2, bb2 = params
    with torch.autocast(X_local.device.type, dtype=dtype, enabled=dtype != torch.float32):
        z = torch.nn.functional.linear(X_local, w1, bb1)
        out = torch.nn.functional.linear(torch.relu(z), w2, bb2)
    loss = torch.nn.functional.mse_loss(out.float(), y_local.float())
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    i = 0
    for p in params:
        p.grad.copy_(flat[i:i + p.numel()].view(p.shape))
        i += p.numel()
    opt = torch.optim.Adam(params, lr=lr, betas=(beta1, beta2), eps=eps, foreach=False)
    for p, mm, vv in zip(params, m, v):
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": mm.float(), "exp_avg_sq": vv.float()}
    opt.step()
    conv = lambda t: t if t.dtype == dtype else t.detach().to(dtype)  # noqa: E731
    return (*[conv(p) for p in params], *[conv(opt.state[p]["exp_avg"]) for p in params],
            *[conv(opt.state[p]["exp_avg_sq"]) for p in params])
