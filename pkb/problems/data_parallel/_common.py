"""Helpers shared by the data-parallel problems: dtypes, FSDP row shards, cached sub-groups, Adam,
and the two-layer MLP that the DDP / ZeRO / FSDP training-step problems train.

The MLP (upstream 40-42, 47): ``out = relu(X @ W1.T + b1) @ W2.T + b2``, loss = mean((out - y)^2)
over the rank's local batch (``F.mse_loss``); parameters are kept in the flat order (W1 [Dh, Din],
b1 [Dh], W2 [Do, Dh], b2 [Do]). Parameters, Adam moments and the batch share one dtype (the run's
precision, upstream's ``dtype``: bf16 by default); the references reduce gradients and run Adam in fp32
and round each output once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problem import DEFAULT_PRECISION, PRECISIONS, Tolerance, default_tolerance, randn, upstream_seed


def dtype_of(case) -> torch.dtype:
    """The run's precision (``case["dtype"]``, which the harness sets on every case it hands out; the
    default precision for a bare case read outside a run, e.g. its cost listed)."""
    name = case.get("dtype")
    return getattr(torch, name) if name else PRECISIONS[DEFAULT_PRECISION]


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


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, weight_decay=0.0):
    """``adam_step_`` out of place: fp32 copies updated, returned as (param, exp_avg, exp_avg_sq) in the
    inputs' dtypes (one rounding each); the inputs are left unchanged."""
    param_fp32, exp_avg_fp32, exp_avg_sq_fp32 = (t.to(torch.float32, copy=True) for t in (param, exp_avg, exp_avg_sq))
    adam_step_(param_fp32, grad, exp_avg_fp32, exp_avg_sq_fp32, lr, beta1, beta2, eps, step, weight_decay)
    return param_fp32.to(param.dtype), exp_avg_fp32.to(exp_avg.dtype), exp_avg_sq_fp32.to(exp_avg_sq.dtype)


ADAM_FLOPS_PER_ELEMENT = 10  # lerp 2, second moment 3, sqrt/scale/eps 3, addcdiv 2
ADAM_BYTES_PER_ELEMENT = 7 * 4  # read p, g, m, v and write p, m, v, all fp32


def adam_hyperparameters(gen, max_step: int = 2000) -> tuple[float, float, float, float, int]:
    """(lr, beta1, beta2, eps, step) as training uses them; the step count is drawn in [1, ``max_step``], the
    same on every rank (bias corrections vary; upstream's factory passes 1 + trial % 7, so its cases use 7)."""
    step = int(torch.randint(1, max_step + 1, (1,), generator=gen.shared, device=gen.device))
    return 1e-3, 0.9, 0.999, 1e-8, step


def adam_states(gen, scale: torch.Tensor | float, numel: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam moments of a run in progress for gradients of typical size ``scale``: m ~ N(0, (scale/2)^2),
    v ~ scale^2 * U(0.5, 1.5), so one new gradient moves both by a visible amount."""
    generator = generator or gen
    exp_avg = randn(generator, numel) * (0.5 * scale)
    uniform = torch.rand(numel, generator=generator, device=gen.device)
    exp_avg_sq = (uniform + 0.5) * torch.as_tensor(scale, device=gen.device) ** 2
    return exp_avg, exp_avg_sq


def upstream_adam_hyperparameters(trial: int) -> tuple[float, float, float, float, int]:
    """Upstream's factory's (lr, beta1, beta2, eps, step): torch.optim.Adam's defaults, the step 1 + trial % 7."""
    return 1e-3, 0.9, 0.999, 1e-8, 1 + trial % 7


# -- the two-layer MLP -------------------------------------------------------------------------------

def mlp_shapes(d_in: int, d_hidden: int, d_out: int) -> tuple[tuple[int, ...], ...]:
    return ((d_hidden, d_in), (d_hidden,), (d_out, d_hidden), (d_out,))


def mlp_num_params(d_in: int, d_hidden: int, d_out: int) -> int:
    return sum(math.prod(shape) for shape in mlp_shapes(d_in, d_hidden, d_out))


def away_from_zero(generator, device, shape, scale: float, low: float = 0.5, high: float = 1.5) -> torch.Tensor:
    """fp32 values of random sign and magnitude U(low, high) * scale: none near zero, so a relative
    tolerance holds on every element (a bf16 rounding of a value near zero is not a relative error)."""
    magnitude = torch.rand(shape, generator=generator, device=device) * (high - low) + low
    sign = torch.randint(0, 2, shape, generator=generator, device=device) * 2 - 1
    return sign * magnitude * scale


def mlp_init(generator, device, d_in: int, d_hidden: int, d_out: int, dtype=torch.float32) -> list[torch.Tensor]:
    """W1, b1, W2, b2 with |W1| ~ 1/sqrt(Din), |W2| ~ 1/sqrt(Dh), |b| ~ 0.1 (``away_from_zero``), in ``dtype``."""
    scales = (d_in**-0.5, 0.1, d_hidden**-0.5, 0.1)
    return [away_from_zero(generator, device, shape, scale).to(dtype)
            for shape, scale in zip(mlp_shapes(d_in, d_hidden, d_out), scales)]


def mlp_grad_scales(d_in: int, d_hidden: int, d_out: int, batch: int, world_size: int) -> list[float]:
    """Typical |gradient| of W1, b1, W2, b2 averaged over ``world_size`` ranks of ``batch`` rows each, for
    ``mlp_init`` weights and N(0,1) data (within a factor ~2).

    dL/dout = a * (out - y), a = 2/(B*Do); out - y has a part that varies by row (rms ~1.3) and a
    part shared by the rows (rms ~0.5: relu(z) has mean ~0.4, and b2); the first sums like a random
    walk over the W*B rows, the second adds up coherently. h = relu(z): mean square ~0.55, mean ~0.4;
    relu' has mean 0.5; a row of d_z has rms ~0.7 * a * sqrt(Do/Dh) times the residual's.
    """
    batch = max(batch, 1)
    a = 2 / (batch * d_out)
    row, shared = 1.3**2 / world_size, 0.5**2  # residual: per-row variance (averaged over ranks), shared part
    to_hidden = 0.7 * math.sqrt(d_out / d_hidden)
    return [a * to_hidden * math.sqrt(batch * (row + shared / world_size)),
            a * to_hidden * math.sqrt(batch * row + batch**2 * shared * 0.25),
            a * math.sqrt(batch * row * 0.55 + batch**2 * shared * 0.17),
            a * math.sqrt(batch * row + batch**2 * shared)]


def mlp_grads(x, y, w1, b1, w2, b2) -> list[torch.Tensor]:
    """Gradients of mean((relu(x W1^T + b1) W2^T + b2 - y)^2) w.r.t. (W1, b1, W2, b2), returned in fp32.

    Written out by hand (what autograd computes), so the backward a kernel must match is in plain view.
    The GEMMs run in the inputs' dtype (bf16 GEMMs accumulate in fp32 and round their outputs, as
    autograd's do); the loss gradient and the bias sums are fp32.
    """
    dtype = x.dtype
    z = torch.addmm(b1, x, w1.T)
    h = torch.relu(z)
    out = torch.addmm(b2, h, w2.T)
    d_out = 2.0 * (out.float() - y.float()) / out.numel()
    d_w2 = d_out.to(dtype).T @ h
    d_z = (d_out.to(dtype) @ w2) * (z > 0)
    return [(d_z.T @ x).float(), d_z.float().sum(0), d_w2.float(), d_out.sum(0)]


def mlp_flops(d_in: int, d_hidden: int, d_out: int, batch: int) -> int:
    """Forward 2*B*(Din*Dh + Dh*Do), backward twice that (weight and input gradients)."""
    return 6 * batch * (d_in * d_hidden + d_hidden * d_out)


def mlp_dtype(case) -> torch.dtype:
    """The dtype of the batch, the parameters and the Adam moments: the run's precision (upstream's ``dtype``)."""
    return dtype_of(case)


def batch_rows(case, world_size: int) -> int:
    """Rows of this rank's batch: ``batch_per_rank``, or ``batch_total`` split evenly over the ranks."""
    if "batch_per_rank" in case.params:
        return case["batch_per_rank"]
    return case["batch_total"] // world_size


def mlp_batch(case, gen, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch X [B_local, Din], y [B_local, Do] (N(0, 1), the case's dtype, distinct per rank)."""
    batch, dtype = batch_rows(case, world_size), mlp_dtype(case)
    return randn(gen, batch, case["d_in"], dtype=dtype), randn(gen, batch, case["d_out"], dtype=dtype)


def dims(case) -> tuple[int, int, int]:
    return case["d_in"], case["d_hidden"], case["d_out"]


def mlp_adam_states(case, generator, device, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Adam moments (exp_avgs, exp_avg_sqs) of W1, b1, W2, b2 in the case's dtype, drawn from ``generator``,
    for gradients of typical size g averaged over ``world_size`` ranks: |m| in [2g, 3g] (``away_from_zero``:
    one new gradient moves m by ~5% and cannot cancel it), v in [6g^2, 12g^2]."""
    d_in, d_hidden, d_out = dims(case)
    scales = mlp_grad_scales(d_in, d_hidden, d_out, batch_rows(case, world_size), world_size)
    exp_avgs, exp_avg_sqs = [], []
    for shape, grad in zip(mlp_shapes(d_in, d_hidden, d_out), scales):
        exp_avgs.append(away_from_zero(generator, device, shape, grad, 2.0, 3.0).to(mlp_dtype(case)))
        uniform = torch.rand(shape, generator=generator, device=device)
        exp_avg_sqs.append(((uniform * 6 + 6) * grad**2).to(mlp_dtype(case)))
    return exp_avgs, exp_avg_sqs


def mlp_hyperparameters(case, gen) -> tuple[float, float, float, float, int]:
    """(lr, beta1, beta2, eps, step): upstream's values, the step drawn in [1, ``max_step``] (default 2000)."""
    return adam_hyperparameters(gen, case.get("max_step", 2000))


def mlp_tolerance(case, world_size, dtype):
    """Relative: no output of the step is near zero (``away_from_zero``), and gradients, moments and
    parameters differ in scale by orders of magnitude. rtol is the dtype's default: two roundings of a
    bf16 parameter, or fp32 summation orders; a rank's missing gradient share moves m by more. fp16
    adds an atol of two of its smallest subnormals (2^-24 each): second moments of small gradients
    (~1e-5) lie below its normal range (6.1e-5), where it holds 2^-24 absolute, not 2^-11 relative."""
    return Tolerance(2.0**-23 if dtype == torch.float16 else 0.0, default_tolerance(dtype).rtol)


def shard_numel(num_params: int, world_size: int) -> int:
    """Elements per rank of a flat buffer of ``num_params`` padded to a multiple of W (ZeRO / FSDP)."""
    return -(-num_params // world_size)


def shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/W of a flat buffer whose length is a multiple of W (a copy)."""
    return flat.view(world_size, -1)[rank].clone()


def unflatten(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes, in order (padding at the end ignored)."""
    views, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat[offset:offset + numel].view(*shape))
        offset += numel
    return views


def broadcast_flat(tensors, src: int = 0) -> torch.Tensor:
    """The tensors flattened into one new buffer (their dtype) and broadcast from ``src``; inputs untouched."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, src=src)
    return flat


def mlp_cases() -> tuple[list, list, list]:
    """(upstream, tests, benchmarks) shared by the DDP / ZeRO / FSDP step problems; all in the run's precision.

    Upstream (create_input_tensor at M = N = 1024): a 256 -> 512 -> 256 MLP (P = 262,912, a multiple
    of 8), 1024 rows split evenly over the ranks, step in [1, 7] (upstream: 1 + trial % 7).
    Tests: P is a multiple of 8, as upstream's ZeRO / FSDP references assert (P = W * shard), with odd
    widths so the shard boundaries fall inside the tensors, a few rows per rank, and steps up to 2000.
    Benchmarks: a two-layer MLP with the hidden and FFN widths of Llama-3-8B (4096 -> 14336 -> 4096,
    117M parameters) and Llama-3-70B (8192 -> 28672 -> 8192, 470M), 4096 and 2048 tokens per rank.
    """
    from pkb.problem import Case

    upstream = [
        Case("upstream", {"d_in": 256, "d_hidden": 512, "d_out": 256, "batch_total": 1024, "max_step": 7},
             note="upstream create_input_tensor at M = N = 1024"),
    ]
    late_step = ("argument_value",)  # Adam steps up to 2000: upstream passes 1 to 7
    tests = [
        Case("odd_mlp_3_rows", {"d_in": 5, "d_hidden": 13, "d_out": 3, "batch_per_rank": 3},  # P = 120
             tags=("odd_sizes", *late_step)),
        Case("one_row_per_rank", {"d_in": 15, "d_hidden": 31, "d_out": 9, "batch_per_rank": 1},  # P = 784
             tags=("odd_sizes", "tiny", *late_step)),
        Case("mlp_5_rows", {"d_in": 24, "d_hidden": 16, "d_out": 8, "batch_per_rank": 5},  # P = 536
             tags=("odd_sizes", *late_step)),
    ]
    benchmarks = [
        Case("llama3_8b_mlp_widths_4k_tokens", {"d_in": 4096, "d_hidden": 14336, "d_out": 4096,
                                                "batch_per_rank": 4096}),
        Case("llama3_70b_mlp_widths_2k_tokens", {"d_in": 8192, "d_hidden": 28672, "d_out": 8192,
                                                 "batch_per_rank": 2048}),
    ]
    return upstream, tests, benchmarks


def mlp_step_hbm_bytes(case, world_size: int, adam_numel: int) -> int:
    """HBM lower bound of a step, in the case's dtype: the batch read once, the weights read once for
    the forward, and the Adam update of ``adam_numel`` elements (read p, g, m, v; write p, m, v)."""
    d_in, d_hidden, d_out = dims(case)
    itemsize = mlp_dtype(case).itemsize
    batch = batch_rows(case, world_size)
    return itemsize * (batch * (d_in + d_out) + mlp_num_params(d_in, d_hidden, d_out) + 7 * adam_numel)


def upstream_mlp_draws(case, upstream_id: int, rank: int, world_size: int, trial: int, device):
    """Upstream's batch and model for the MLP step problems (40-42, 47), seeded as rank 0 on every rank: X, y
    N(0, 1) over all ``batch_total`` rows, this rank's 1/W kept; W1, b1, W2, b2 N(0, 1) on rank 0, zeros elsewhere.

    Returns (X_local, y_local, [W1, b1, W2, b2]) in the case's dtype on ``device``.
    """
    upstream_seed(upstream_id, 0, trial)
    d_in, d_hidden, d_out = dims(case)
    dtype, rows = mlp_dtype(case), batch_rows(case, world_size)
    full_x = torch.randn(case["batch_total"], d_in, dtype=dtype, device=device)
    full_y = torch.randn(case["batch_total"], d_out, dtype=dtype, device=device)
    own_rows = slice(rank * rows, (rank + 1) * rows)
    fill = torch.randn if rank == 0 else torch.zeros
    params = [fill(shape, dtype=dtype, device=device) for shape in mlp_shapes(d_in, d_hidden, d_out)]
    return full_x[own_rows].contiguous(), full_y[own_rows].contiguous(), params
