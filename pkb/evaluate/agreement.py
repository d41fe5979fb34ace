"""Replicas agree: where the reference gives several ranks the same value, the candidate's ranks must give each other
the same bits.

An all-reduce's output, an all-gather's, a broadcast's, parameters replicated across data-parallel ranks after an
optimizer step: NCCL gives every rank the same bits, and replicas that drift apart are a training bug even where each
rank's copy is accurate. Which values are replicated is read off the reference's own replies to pkb's random inputs, value by value, and where
the candidate's ranks disagree on a value the reference's ranks share, the exact answers decide: it is a replica if
the ranks' exact answers (fp64) are equal too. Values equal by chance in the run's precision are not (two ranks' own
bf16 losses of similar size fall on the same of its 256 values per octave often enough: upstream's SigLIP loss at
W = 4 did), an all-reduced scalar is. Without an exact answer (a recipe, a case too large to raise) a tensor of
``MIN_REPLICA_ELEMENTS`` or more equal elements is a replica (that many cannot be equal by chance) and a smaller one is
not checked.
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
    exact answer to the same part (None where there is none): it decides whether a shared value is a replica."""
    first = expected[0]
    for leaf in walk(first, first, path):
        if not isinstance(leaf, Leaf) or not isinstance(leaf.expected, torch.Tensor):
            continue
        for ranks in _replicated(expected, leaf.keys):
            values = [at(got[rank], leaf.keys) for rank in ranks]
            for rank, value in zip(ranks[1:], values[1:]):
                if _same(values[0], value):
                    continue
                replica = _replicated_exactly(exact, (ranks[0], rank), leaf.keys)
                if not (replica if replica is not None else leaf.expected.numel() >= MIN_REPLICA_ELEMENTS):
                    continue
                return Mismatch(leaf.path, f"ranks {ranks[0]} and {rank} disagree in {_count(values[0], value)} of "
                                           f"{value.numel()} elements, where the reference's ranks {list(ranks)} all "
                                           "hold the same value" + (" and so do their exact answers" if replica else "")
                                           + ": replicas must agree bit for bit (a rank that sums in its own order "
                                           "gives each rank another answer)")
    return None


MIN_REPLICA_ELEMENTS = 8  # without exact answers, fewer equal elements on two ranks may be chance (a scalar loss each rank computes)


def _replicated(replies: list[Any], keys: tuple) -> list[tuple[int, ...]]:
    """The groups of two or more ranks whose reference replies hold equal tensors at ``keys`` (equal maybe by chance:
    ``disagreement`` asks the exact answers, or the size)."""
    values = [at(reply, keys) for reply in replies]
    groups: list[list[int]] = []
    for rank, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            continue
        for group in groups:
            if _same(values[group[0]], value):
                group.append(rank)
                break
        else:
            groups.append([rank])
    return [tuple(group) for group in groups if len(group) > 1]


def _replicated_exactly(exact: Callable[[], list[Any] | None] | None, ranks: tuple[int, ...],
                        keys: tuple) -> bool | None:
    """Whether ``ranks``' exact answers at ``keys`` are equal (a value equal by construction, not by chance); None
    where there are none to ask."""
    answers = exact() if exact is not None else None
    if answers is None:
        return None
    values = [at(answers[rank], keys) for rank in ranks]
    if not all(isinstance(value, torch.Tensor) for value in values):
        return None
    return all(_same(values[0], value) for value in values[1:])


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
