"""Cases and helpers shared by the eight collective problems.

Every collective takes a per-rank tensor whose shape a case names, in the run's precision
(``case["dtype"]``, bf16 by default, as upstream's ``--dtype``). ``upstream`` is the upstream
benchmark's input: a [1024, 1024] buffer per rank (2 MiB in bf16); ``tests`` are small and awkward
(odd sizes, a single element, a 3-D buffer, a root on the last rank); ``benchmarks`` sweep the per-rank
message from 4 KiB to 1 GiB as rows of 1024 elements, the sizes nccl-tests reports (their names give
the bf16 size; fp32 doubles it).
"""

from __future__ import annotations

import math

import torch

from pkb.problem import DEFAULT_PRECISION, PRECISIONS, Case, randn

# Small and awkward: an odd 2-D buffer, a single element, an odd 3-D buffer, many short rows.
TEST_CASES = (
    Case("odd", {"shape": (3, 683)}, tags=("odd_sizes",)),
    Case("single", {"shape": (1,)}, tags=("tiny",)),
    Case("odd3d", {"shape": (5, 7, 11)}, tags=("odd_sizes", "layout")),
    Case("rows", {"shape": (129, 8)}, tags=("odd_sizes",)),
)

_SIZES = (("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20),
          ("256MiB", 256 << 20), ("1GiB", 1 << 30))
_ROW = 1024  # elements per row of a benchmark buffer

BENCHMARK_CASES = tuple(
    Case(f"bf16_{label}", {"shape": (size // (2 * _ROW), _ROW)}, note=f"{label} per rank in bf16")
    for label, size in _SIZES
)


def upstream_cases(**params) -> tuple[Case, ...]:
    """The upstream factory's input at its defaults: shape [1024, 1024] in the run's dtype (with pkb's
    random values).

    ``params`` name the root argument as upstream passes it: ``dst=0`` for an explicit int, or
    ``src="omitted"`` where upstream leaves the argument to the function's default (0).
    """
    return (Case("upstream", {"shape": (1024, 1024), **params},
                 note="upstream create_input_tensor at M = N = 1024"),)


def rooted_cases(root_param: str) -> tuple[Case, ...]:
    """The test cases plus one whose root is the last rank (``root_param`` is ``src`` or ``dst``)."""
    last = Case("odd_root_last", {"shape": (3, 683), root_param: "last"}, tags=("odd_sizes", "argument_value"))
    return TEST_CASES + (last,)


def dtype_of(case: Case) -> torch.dtype:
    """The run's precision (``case["dtype"]``, which the harness sets on every case; the default
    precision for a case read outside a run)."""
    name = case.get("dtype")
    return getattr(torch, name) if name else PRECISIONS[DEFAULT_PRECISION]


def message_bytes(case: Case) -> int:
    """Bytes of one rank's ``shape``-sized buffer."""
    return math.prod(case["shape"]) * dtype_of(case).itemsize


def root_of(case: Case, param: str, world_size: int) -> int:
    """The root rank a case names: 0 by default (or ``"omitted"``), ``"last"`` for world_size - 1."""
    root = case.get(param, 0)
    return world_size - 1 if root == "last" else 0 if root == "omitted" else int(root)


def root_arguments(case: Case, param: str, world_size: int) -> tuple[int, ...]:
    """The root argument as the case passes it: ``(root,)``, or ``()`` where the case omits it."""
    return () if case.get(param) == "omitted" else (root_of(case, param, world_size),)


def buffer(case: Case, gen: torch.Generator, *leading: int) -> torch.Tensor:
    """A random buffer of the case's shape and dtype, with optional leading dimensions."""
    return randn(gen, *leading, *case["shape"], dtype=dtype_of(case))


def constant(case: Case, value: float, device, *leading: int) -> torch.Tensor:
    """A buffer of the case's shape and dtype filled with ``value``: upstream's inputs for the collectives
    (``torch.full``; rank + 1 on each rank, so that every sum is exact in any order)."""
    return torch.full((*leading, *case["shape"]), float(value), dtype=dtype_of(case), device=device)


def sum_tolerance(case: Case, world_size: int):
    """Tolerance for a sum over ranks of N(0, 1) buffers in the case's dtype."""
    from pkb.problem import reduction_tolerance

    return reduction_tolerance(dtype_of(case), world_size)
