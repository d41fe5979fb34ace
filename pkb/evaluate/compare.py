"""Walking a candidate's reply beside the reference's: structure first, then one leaf at a time.

``walk`` goes through the reference's outputs (plain data from rank processes: lists, dicts, tensors, numbers,
strings) and the candidate's side by side, with the exact answer's (the same structure, or None) and its sensitivity
alongside, and yields each pair of leaves (``Leaf``) or the first structural difference (``Mismatch``): a container of
another kind or length, other keys, a tensor where the reference has none, another shape or dtype. Which rule then
judges a leaf's values is pkb.evaluate.accuracy's alone; this module walks and never judges values. ``Mismatch`` is
the one description of a difference, for structure and values alike.

Every input is the candidate's word and may be anything plain data can be (any dtype torch has, a subclass, a huge
container): the walk is total and compares metadata before it touches values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class Mismatch:
    """Where and how a reply differs: the path of the value (``out[1]``, ``input `x` after the call``), why in words,
    and for values, how many elements are off, the largest errors and where they are, and what was compared with what
    (``against``: the reference's output, or the exact answer)."""

    path: str
    reason: str
    num_bad: int = 0
    numel: int = 0
    max_abs_err: float = 0.0
    max_abs_at: tuple[int, ...] = ()
    max_rel_err: float = 0.0
    max_rel_at: tuple[int, ...] = ()
    expected: float | None = None
    got: float | None = None
    atol: float = 0.0
    rtol: float = 0.0
    against: str = "reference"

    def describe(self) -> str:
        if not self.num_bad:
            return f"{self.path}: {self.reason}"
        worst = (f"; the worst at {list(self.max_abs_at)} ({'exact' if self.against == 'exact' else 'expected'} "
                 f"{self.expected:.6g}, got {self.got:.6g})" if self.expected is not None and self.got is not None else "")
        return f"{self.path}: {self.reason}{worst}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Leaf:
    """One value of the reply, beside the reference's at the same path: a tensor of the same shape and dtype (checked),
    or any other leaf (a number, a string, None). ``keys``: how to reach it from the top (``at``), so that the exact
    answer's value at the same place can be found."""

    path: str
    keys: tuple
    expected: Any
    got: Any


def walk(expected: Any, got: Any, path: str = "out", keys: tuple = ()) -> Iterator[Leaf | Mismatch]:
    """Every leaf of ``expected`` beside ``got``'s, or the structural difference where ``got`` departs from
    ``expected``'s structure; a caller stops at the first Mismatch it wants to."""
    if isinstance(expected, torch.Tensor):
        found = tensor_metadata(expected, got, path)
        yield found if found is not None else Leaf(path, keys, expected, got)
        return
    if isinstance(expected, list):
        if not isinstance(got, list):
            yield Mismatch(path, f"expected a sequence of {len(expected)}, got {kind(got)}")
            return
        if len(got) != len(expected):
            yield Mismatch(path, f"expected {len(expected)} items, got {len(got)}")
            return
        for index, (e, g) in enumerate(zip(expected, got)):
            yield from walk(e, g, f"{path}[{index}]", (*keys, index))
        return
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            found = sorted(map(str, got)) if isinstance(got, dict) else kind(got)
            yield Mismatch(path, f"expected keys {sorted(expected)}, got {found}")
            return
        for key in expected:
            yield from walk(expected[key], got[key], f"{path}[{key!r}]", (*keys, key))
        return
    if isinstance(got, (list, dict, torch.Tensor)):
        yield Mismatch(path, f"expected {expected!r:.80}, got {kind(got)}")
        return
    yield Leaf(path, keys, expected, got)


def at(tree: Any, keys: tuple) -> Any:
    """The value of ``tree`` (plain data) at ``keys``, or None where there is none."""
    for key in keys:
        if isinstance(tree, list) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        elif isinstance(tree, dict) and key in tree:
            tree = tree[key]
        else:
            return None
    return tree


def tensor_metadata(expected: torch.Tensor, got: Any, path: str) -> Mismatch | None:
    """Where ``got`` is not a plain tensor of ``expected``'s shape and dtype, why; None where it is."""
    if not isinstance(got, torch.Tensor):
        return Mismatch(path, f"expected a tensor, got {kind(got)}")
    if type(got) is not torch.Tensor or got.layout != torch.strided:
        return Mismatch(path, f"expected a plain tensor, got {kind(got)}")
    if got.dtype != expected.dtype:
        return Mismatch(path, f"expected dtype {expected.dtype}, got {got.dtype}")
    if got.shape != expected.shape:
        return Mismatch(path, f"expected shape {list(expected.shape)}, got {list(got.shape)}")
    return None


def kind(value: Any) -> str:
    """A value's kind in words, for a message (``a tensor of dtype torch.qint8``, ``an unsupported object (Foo)``)."""
    if isinstance(value, dict) and "__unsupported__" in value:
        return f"an unsupported object ({str(value['__unsupported__'])[:80]})"
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of dtype {value.dtype}, layout {value.layout}"
    return type(value).__name__


def unravel(flat_index: int, shape) -> tuple[int, ...]:
    """The index in ``shape`` of the ``flat_index``-th element in row-major order."""
    index = []
    for size in reversed(tuple(shape)):
        index.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(index))


def real_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's shape as its values are compared: a complex tensor's with a trailing 2 (real, imaginary)."""
    return (*tensor.shape, 2) if tensor.is_complex() else tuple(tensor.shape)


