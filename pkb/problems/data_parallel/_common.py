"""Helpers shared by the data-parallel problems: dtypes, FSDP row shards, cached sub-groups, Adam,
and the two-layer MLP that the DDP / ZeRO / FSDP training-step problems train.

The MLP (upstream 40-42, 47): ``out = gelu(X @ W1.T + b1) @ W2.T + b2`` (exact erf GELU), loss =
mean((out - y)^2) over the rank's local batch; parameters are kept in the flat order
(W1 [Dh, Din], b1 [Dh], W2 [Do, Dh], b2 [Do]). Parameters, gradients and Adam states are fp32 (the
fp32 master weights and optimizer states that DDP, DeepSpeed ZeRO and FSDP mixed precision keep).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problem import randn


def dtype_of(case, key: str = "dtype") -> torch.dtype:
    return getattr(torch, case[key])


def chunk_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s part of ``rows`` split like ``torch.chunk`` / FSDP2 ``Shard(0)``.

    Every rank but the last ones gets ceil(rows / W); trailing ranks may get fewer or none
    (rows=3, W=4: 1, 1, 1, 0).
    """
    per_rank = -(-rows // world_size)
    start = min(rank * per_rank, rows)
    return start, min(per_rank, rows - start)


# -- process groups -----------------------------------------------------------------------------------

_PARTITIONS: dict[tuple[tuple[int, ...], ...], dict[tuple[int, ...], object]] = {}


def subgroup(partition: list[list[int]]):
    """This rank's group of ``partition`` (a split of all ranks into disjoint lists), built once.

    ``dist.new_group`` is collective over the whole world, so every group of the partition is
    created on every rank in the same order; later calls with the same partition return the cached
    group. A group of one rank is ``None``: the workloads skip communication over it.
    """
    key = tuple(tuple(ranks) for ranks in partition)
    if key not in _PARTITIONS:
        _PARTITIONS[key] = {ranks: dist.new_group(list(ranks)) if len(ranks) > 1 else None for ranks in key}
    rank = dist.get_rank()
    return next(group for ranks, group in _PARTITIONS[key].items() if rank in ranks)


def mesh_partitions(outer: int, inner: int) -> tuple[list[list[int]], list[list[int]]]:
    """A 2-D mesh [outer, inner] of ``outer * inner`` ranks, rank = outer_index * inner + inner_index.

    Returns (inner groups: consecutive ranks, outer groups: ranks ``inner`` apart).
    """
    inner_groups = [[o * inner + i for i in range(inner)] for o in range(outer)]
    outer_groups = [[o * inner + i for o in range(outer)] for i in range(inner)]
    return inner_groups, outer_groups


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


# -- Adam -------------------------------------------------------------------------------------------

def adam_step_(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, weight_decay=0.0):
    """One torch.optim.Adam (``weight_decay`` > 0: AdamW, decoupled) step, in place, in fp32.

    m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g^2;
    p = p*(1 - lr*wd) - lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps).
    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32 tensors updated in place; ``grad`` any float.
    """
    grad = grad.float()
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    return param


ADAM_FLOPS_PER_ELEMENT = 10  # lerp 2, second moment 3, sqrt/scale/eps 3, addcdiv 2
ADAM_BYTES_PER_ELEMENT = 7 * 4  # read p, g, m, v and write p, m, v, all fp32


def adam_hyperparameters(gen) -> tuple[float, float, float, float, int]:
    """(lr, beta1, beta2, eps, step) as training uses them; the step count is drawn (bias corrections vary)."""
    step = int(torch.randint(1, 2000, (1,), generator=gen.shared, device=gen.device))
    return 1e-3, 0.9, 0.999, 1e-8, step


def adam_states(gen, scale: torch.Tensor | float, numel: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam moments of a run in progress for gradients of typical size ``scale``: m ~ N(0, (scale/2)^2),
    v ~ scale^2 * U(0.5, 1.5), so one new gradient moves both by a visible amount."""
    generator = generator or gen
    exp_avg = randn(generator, numel) * (0.5 * scale)
    uniform = torch.rand(numel, generator=generator, device=gen.device)
    exp_avg_sq = (uniform + 0.5) * torch.as_tensor(scale, device=gen.device) ** 2
    return exp_avg, exp_avg_sq


# -- the two-layer MLP -------------------------------------------------------------------------------

def mlp_shapes(d_in: int, d_hidden: int, d_out: int) -> list[tuple[int, ...]]:
    return [(d_hidden, d_in), (d_hidden,), (d_out, d_hidden), (d_out,)]


def mlp_num_params(d_in: int, d_hidden: int, d_out: int) -> int:
    return sum(math.prod(shape) for shape in mlp_shapes(d_in, d_hidden, d_out))


def mlp_init(generator, device, d_in: int, d_hidden: int, d_out: int) -> list[torch.Tensor]:
    """W1 ~ N(0, 1/Din), b1 ~ N(0, 0.01), W2 ~ N(0, 1/Dh), b2 ~ N(0, 0.01), fp32."""
    scales = (d_in**-0.5, 0.1, d_hidden**-0.5, 0.1)
    return [torch.randn(shape, generator=generator, device=device) * scale
            for shape, scale in zip(mlp_shapes(d_in, d_hidden, d_out), scales)]


def mlp_grad_scales(d_in: int, d_hidden: int, d_out: int, batch: int) -> list[float]:
    """Typical |gradient| of W1, b1, W2, b2 for ``mlp_init`` weights and N(0,1) data (within a factor ~3).

    residual r = out - y has std ~1.2; dL/dout = 2r/(B*Do); h = gelu(z) has rms ~0.65, gelu' rms ~0.65.
    """
    batch = max(batch, 1)
    d_out_grad = 2 * 1.2 / (batch * d_out)
    d_z = d_out_grad * math.sqrt(d_out / d_hidden) * 0.65
    return [math.sqrt(batch) * d_z, math.sqrt(batch) * d_z, math.sqrt(batch) * d_out_grad * 0.65,
            math.sqrt(batch) * d_out_grad]


def mlp_grads(x, y, w1, b1, w2, b2) -> list[torch.Tensor]:
    """Gradients of mean((gelu(x W1^T + b1) W2^T + b2 - y)^2) w.r.t. (W1, b1, W2, b2), in fp32.

    Written out by hand (what autograd computes), so the backward a kernel must match is in plain view.
    """
    x, y = x.float(), y.float()
    z = x @ w1.T + b1
    h = torch.nn.functional.gelu(z)
    out = h @ w2.T + b2
    d_out = 2.0 * (out - y) / out.numel()
    d_w2 = d_out.T @ h
    d_b2 = d_out.sum(0)
    d_h = d_out @ w2
    gelu_grad = 0.5 * (1.0 + torch.erf(z * 2**-0.5)) + z * torch.exp(-0.5 * z * z) * (2 * math.pi) ** -0.5
    d_z = d_h * gelu_grad
    return [d_z.T @ x, d_z.sum(0), d_w2, d_b2]


def mlp_flops(d_in: int, d_hidden: int, d_out: int, batch: int) -> int:
    """Forward 2*B*(Din*Dh + Dh*Do), backward twice that (weight and input gradients)."""
    return 6 * batch * (d_in * d_hidden + d_hidden * d_out)


def mlp_batch(case, gen, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch X [B_local, Din], y [B_local, Do] (fp32, distinct per rank)."""
    batch = case["batch_per_rank"]
    return randn(gen, batch, case["d_in"]), randn(gen, batch, case["d_out"])


def dims(case) -> tuple[int, int, int]:
    return case["d_in"], case["d_hidden"], case["d_out"]


def mlp_adam_states(case, gen, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Adam moments (exp_avgs, exp_avg_sqs) of W1, b1, W2, b2, replicated (drawn from ``gen.shared``),
    sized for the gradients a step of this case averages over ``world_size`` ranks."""
    d_in, d_hidden, d_out = dims(case)
    scales = mlp_grad_scales(d_in, d_hidden, d_out, case["batch_per_rank"])
    exp_avgs, exp_avg_sqs = [], []
    for shape, scale in zip(mlp_shapes(d_in, d_hidden, d_out), scales):
        exp_avg, exp_avg_sq = adam_states(gen, scale / math.sqrt(world_size), math.prod(shape), generator=gen.shared)
        exp_avgs.append(exp_avg.view(shape))
        exp_avg_sqs.append(exp_avg_sq.view(shape))
    return exp_avgs, exp_avg_sqs


def shard_numel(num_params: int, world_size: int) -> int:
    """Elements per rank of a flat buffer of ``num_params`` padded to a multiple of W (ZeRO / FSDP)."""
    return -(-num_params // world_size)


def flat_padded(tensors, world_size: int) -> torch.Tensor:
    """The tensors flattened and concatenated in order, zero-padded to W * shard_numel (fp32)."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    padding = shard_numel(flat.numel(), world_size) * world_size - flat.numel()
    return torch.nn.functional.pad(flat, (0, padding))


def shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/W of a padded flat buffer (a copy)."""
    return flat.view(world_size, -1)[rank].clone()


def unflatten(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes, in order (padding at the end ignored)."""
    views, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat[offset:offset + numel].view(*shape))
        offset += numel
    return views


def mlp_cases() -> tuple[list, list]:
    """(tests, benchmarks) shared by the DDP / ZeRO / FSDP step problems.

    Benchmarks: a two-layer MLP with the hidden and FFN widths of Llama-3-8B (4096 -> 14336 -> 4096,
    117M parameters) and Llama-3-70B (8192 -> 28672 -> 8192, 470M), 4096 and 2048 tokens per rank.
    """
    from pkb.problem import Case

    tests = [
        Case("odd_mlp_3_rows", {"d_in": 5, "d_hidden": 7, "d_out": 3, "batch_per_rank": 3}),
        Case("one_row_per_rank", {"d_in": 16, "d_hidden": 33, "d_out": 9, "batch_per_rank": 1}),
    ]
    benchmarks = [
        Case("llama3_8b_mlp_widths_4k_tokens", {"d_in": 4096, "d_hidden": 14336, "d_out": 4096,
                                                "batch_per_rank": 4096}),
        Case("llama3_70b_mlp_widths_2k_tokens", {"d_in": 8192, "d_hidden": 28672, "d_out": 8192,
                                                 "batch_per_rank": 2048}),
    ]
    return tests, benchmarks


def mlp_step_hbm_bytes(case, adam_numel: int) -> int:
    """HBM lower bound of a step: the batch read once, the weights read once for the forward, and the
    Adam update of ``adam_numel`` elements (ADAM_BYTES_PER_ELEMENT each)."""
    d_in, d_hidden, d_out = dims(case)
    batch = case["batch_per_rank"]
    return 4 * batch * (d_in + d_out) + 4 * mlp_num_params(d_in, d_hidden, d_out) + ADAM_BYTES_PER_ELEMENT * adam_numel
