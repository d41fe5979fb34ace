"""Shared pieces of the two clip-grad-norm problems (upstream 21, 22): FSDP-sharded gradients,
the local norm term, and VeOmni's clipping rule.

A norm of order p over gradients spread across ranks is (sum over ranks of sum_t ||g_t||_p^p)^(1/p),
each tensor's norm taken in fp32. VeOmni (and so the upstream benchmark) computes it the same way for
every p, so p = inf is not the max norm there (||g||^inf is 0 or inf); the cases use finite p.
Clipping: when total_norm > max_norm (a host branch), every gradient is multiplied in place by the
fp32 0-dim coefficient max_norm / total_norm (``grad.mul_(coef)``: one rounding to the gradient dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problem import randn
from pkb.problems.data_parallel._common import chunk_rows

GRAD_SCALE = 1e-2  # gradients of a trained model are small; the norm scales with them


def llama_layer_shapes(hidden: int, kv_dim: int, ffn: int) -> list[list[int]]:
    """One Llama decoder layer's parameters: q, k, v, o, gate, up, down projections and two RMSNorms."""
    return [[hidden, hidden], [kv_dim, hidden], [kv_dim, hidden], [hidden, hidden], [ffn, hidden], [ffn, hidden],
            [hidden, ffn], [hidden], [hidden]]


def local_shapes(shapes, rank: int, world_size: int, sharded: bool = True) -> list[list[int]]:
    """This rank's shape of each gradient: its FSDP2 ``Shard(0)`` piece of the full shape (possibly
    zero rows), or, with ``sharded=False``, the shape itself (every rank holds its own tensor of it)."""
    if not sharded:
        return [list(shape) for shape in shapes]
    return [[chunk_rows(shape[0], rank, world_size)[1], *shape[1:]] for shape in shapes]


def sharded_grads(shapes, rank: int, world_size: int, gen, dtype, sharded: bool = True) -> list[torch.Tensor]:
    """This rank's gradients of ``local_shapes(shapes, ...)``, random with std GRAD_SCALE."""
    return [randn(gen, *shape, dtype=dtype, scale=GRAD_SCALE)
            for shape in local_shapes(shapes, rank, world_size, sharded)]


def upstream_grads(shapes, dtype, device) -> list[torch.Tensor]:
    """Upstream's gradients: N(0, 1) tensors of ``shapes`` (unscaled, unsharded), drawn in ``dtype`` in order."""
    return [torch.randn(shape, dtype=dtype, device=device) for shape in shapes]


def local_norm_term(grads, norm_type: float, device) -> torch.Tensor:
    """fp32 0-dim: sum_t ||g_t||_p^p over this rank's gradients (each norm in fp32; 0 with none)."""
    term = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        term = term + torch.linalg.vector_norm(grad.detach().float(), norm_type) ** norm_type
    return term


def reduce_op(norm_type: float):
    """The reduction of the local terms: a sum for every p (as VeOmni does, p = inf included)."""
    return dist.ReduceOp.SUM


def finish_norm(term: torch.Tensor, norm_type: float) -> torch.Tensor:
    return term ** (1.0 / norm_type)


def clip_(grads, max_norm: float, total_norm: torch.Tensor) -> None:
    """If total_norm > max_norm: g *= max_norm / total_norm (fp32 0-dim coefficient), in place."""
    if total_norm > max_norm:
        coef = max_norm / total_norm
        for grad in grads:
            grad.mul_(coef.to(grad.device))


def norm_cost_terms(numel: int, itemsize: int) -> tuple[int, int]:
    """(flops, hbm bytes) of norm + clip over ``numel`` local elements: a read for the norm (2 flops
    per element: square and add) and a read-modify-write for the clip (1 flop)."""
    return 3 * numel, 3 * numel * itemsize
