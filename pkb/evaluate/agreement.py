"""Replicas agree: where the reference gives several ranks the same value, the candidate's ranks must give each other
the same bits.

An all-reduce's output, an all-gather's, a broadcast's, parameters replicated across data-parallel ranks after an
optimizer step: NCCL gives every rank the same bits, and replicas that drift apart are a training bug even where each
rank's copy is accurate. Which values are replicated is read off the reference's own replies to pkb's random inputs, value by value, and where
the candidate's ranks disagree on a value the reference's ranks share, the exact answers decide: the ranks whose exact
answers (fp64) agree too, within ``EXACT_AGREES`` (fp64 in another order is the same value), are replicas, and each
such class must agree within itself. Values equal by chance in the run's precision are not replicas (two ranks' own
bf16 losses of similar size fall on the same of its 256 values per octave often enough: upstream's SigLIP loss at
W = 4 did), an all-reduced scalar is, and so is a loss returned as a Python float. Without an exact answer (a recipe,
a case too large to raise) a tensor of ``MIN_REPLICA_ELEMENTS`` or more equal elements is a replica (that many cannot
be equal by chance) and a smaller one is not checked.
A problem whose ranks may legitimately differ there says so and why (``Problem.replicas_may_differ``). Equal means
equal values, NaN where NaN (+0 and -0 alike).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pkb.evaluate.accuracy import bit_equal
from pkb.evaluate.compare import Leaf, Mismatch, at, walk


def disagreement(expected: list[Any], got: list[Any], path: str,
                 exact: Callable[[], list[Any] | None] | None = None) -> Mismatch | None:
    """The first value that the reference's ranks share (``expected``: one reply part per rank) and the candidate's
    ranks (``got``, already judged one by one against the reference) do not, or None. ``exact`` fetches every rank's
    exact answer to the same part (None where there is none): it decides which of the ranks sharing a value are
    replicas."""
    first = expected[0]
    for leaf in walk(first, first, path):
        if not isinstance(leaf, Leaf) or not isinstance(_tensor(leaf.expected), torch.Tensor):
            continue
        for ranks in _replicated(expected, leaf.keys):
            values = [_tensor(at(got[rank], leaf.keys)) for rank in ranks]
            if all(_same(values[0], value) for value in values[1:]):
                continue
            for replicas, by_exact in _replicas(exact, ranks, leaf.keys, _tensor(leaf.expected).numel()):
                mine = [values[ranks.index(rank)] for rank in replicas]
                for rank, value in zip(replicas[1:], mine[1:]):
                    if not _same(mine[0], value):
                        return Mismatch(leaf.path, f"ranks {replicas[0]} and {rank} disagree in "
                                                   f"{_count(mine[0], value)} of {value.numel()} elements, where the "
                                                   f"reference's ranks {list(replicas)} all hold the same value"
                                                   + (" and so do their exact answers" if by_exact else "")
                                                   + ": replicas must agree bit for bit (a rank that sums in its own "
                                                   "order gives each rank another answer)")
    return None


MIN_REPLICA_ELEMENTS = 8  # without exact answers, fewer equal elements on two ranks may be chance (a scalar loss each rank computes)
EXACT_AGREES = 1e-12  # exact answers this close (relative) are one value: fp64 in another order, not another quantity


def _replicated(replies: list[Any], keys: tuple) -> list[tuple[int, ...]]:
    """The groups of two or more ranks whose reference replies hold equal tensors at ``keys`` (equal maybe by chance:
    ``_replicas`` asks the exact answers, or the size)."""
    values = [_tensor(at(reply, keys)) for reply in replies]
    held = [rank for rank, value in enumerate(values) if isinstance(value, torch.Tensor)]
    return _classes(held, [values[rank] for rank in held], _same)


def _replicas(exact: Callable[[], list[Any] | None] | None, ranks: tuple[int, ...], keys: tuple,
              numel: int) -> list[tuple[tuple[int, ...], bool]]:
    """The classes of ``ranks`` (which share a value in the reference's replies) that are replicas, each with whether
    the exact answers said so: the ranks whose exact answers agree (``EXACT_AGREES``), or without exact answers all of
    them if the value has ``MIN_REPLICA_ELEMENTS`` elements, else none."""
    answers = exact() if exact is not None else None
    values = [_tensor(at(answers[rank], keys)) for rank in ranks] if answers is not None else []
    if not values or not all(isinstance(value, torch.Tensor) for value in values):
        return [(ranks, False)] if numel >= MIN_REPLICA_ELEMENTS else []
    return [(group, True) for group in _classes(ranks, values, _agree)]


def _classes(ranks, values: list, same: Callable[[Any, Any], bool]) -> list[tuple[int, ...]]:
    """``ranks`` grouped by ``same`` on their ``values`` (each compared with its class's first): the classes of two or
    more."""
    classes: list[list[tuple[int, Any]]] = []
    for rank, value in zip(ranks, values):
        for group in classes:
            if same(group[0][1], value):
                group.append((rank, value))
                break
        else:
            classes.append([(rank, value)])
    return [tuple(rank for rank, _ in group) for group in classes if len(group) > 1]


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact answers that are one value: the same shape, NaN where NaN, within ``EXACT_AGREES`` of each other."""
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    close = (a == b) | ((a - b).abs() <= EXACT_AGREES * torch.maximum(a.abs(), b.abs()))
    return bool((close | both_nan).all())


def _tensor(value: Any) -> Any:
    """A float leaf (a loss returned with ``.item()``) as a 0-dim fp64 tensor; anything else as it is."""
    return torch.tensor(value, dtype=torch.float64) if isinstance(value, float) else value


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and bit_equal(a, b))


def _count(a: torch.Tensor, b: torch.Tensor) -> int:
    try:
        if a.is_floating_point() or a.is_complex():
            return int(((a != b) & ~(torch.isnan(a) & torch.isnan(b))).sum())
        return int((a != b).sum())
    except (RuntimeError, TypeError):
        return a.numel()
