"""Shared pieces of the two clip-grad-norm problems (upstream 21, 22): FSDP-sharded gradients,
the local norm term, and the clipping rule of ``torch.nn.utils.clip_grad_norm_``.

A norm of order p over gradients spread across ranks is (sum over ranks of sum_i |g_i|^p)^(1/p)
(p = inf: the max over ranks of max |g_i|). Clipping multiplies every gradient by
min(1, max_norm / (total_norm + 1e-6)), computed in fp32 and rounded once to the gradient dtype.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problem import randn
from pkb.problems.data_parallel._common import chunk_rows

GRAD_SCALE = 1e-2  # gradients of a trained model are small; the norm scales with them


def llama_layer_shapes(hidden: int, kv_dim: int, ffn: int) -> list[list[int]]:
    """One Llama decoder layer's parameters: q, k, v, o, gate, up, down projections and two RMSNorms."""
    return [[hidden, hidden], [kv_dim, hidden], [kv_dim, hidden], [hidden, hidden], [ffn, hidden], [ffn, hidden],
            [hidden, ffn], [hidden], [hidden]]


def sharded_grads(shapes, rank: int, world_size: int, gen, dtype) -> list[torch.Tensor]:
    """This rank's FSDP2 ``Shard(0)`` piece of each full gradient shape (possibly zero rows)."""
    grads = []
    for shape in shapes:
        _, rows = chunk_rows(shape[0], rank, world_size)
        grads.append(randn(gen, rows, *shape[1:], dtype=dtype, scale=GRAD_SCALE))
    return grads


def local_norm_term(grads, norm_type: float, device) -> torch.Tensor:
    """fp32 0-dim: sum_i |g_i|^p over this rank's gradients (p = inf: max |g_i|; 0 with no elements)."""
    term = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        if grad.numel() == 0:
            continue
        norm = torch.linalg.vector_norm(grad.float(), norm_type)
        term = torch.maximum(term, norm) if math.isinf(norm_type) else term + norm**norm_type
    return term


def reduce_op(norm_type: float):
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM


def finish_norm(term: torch.Tensor, norm_type: float) -> torch.Tensor:
    return term if math.isinf(norm_type) else term ** (1.0 / norm_type)


def clip_(grads, max_norm: float, total_norm: torch.Tensor) -> None:
    """g <- dtype(float(g) * min(1, max_norm / (total_norm + 1e-6))), in place; no host sync."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.copy_(grad.float() * coef)


def norm_cost_terms(numel: int, itemsize: int) -> tuple[int, int]:
    """(flops, hbm bytes) of norm + clip over ``numel`` local elements: a read for the norm (2 flops
    per element: square and add) and a read-modify-write for the clip (1 flop)."""
    return 3 * numel, 3 * numel * itemsize
