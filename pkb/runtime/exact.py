"""The exact answer, the rank's side: the reference run in fp64 arithmetic throughout, and how far each output moves
when the inputs move by a rounding (its sensitivity).

``exact_arithmetic`` is a context in which every floating dtype narrower than fp64 that the reference asks for (a cast
``.float()``, ``.to(torch.float32)``, ``.bfloat16()``, ``dtype=torch.float32`` of a factory, the default dtype of
``torch.empty(n)``) is fp64 instead: a reference that accumulates in an fp32 buffer, or narrows its result to the
input's dtype, computes in fp64 here, so that its answer is more precise than the reference's in every precision the
run may have, fp32 included. Integers, bools and fp8 stay what they are (a quantisation's meaning lies in its
rounding: those problems have no exact answer, ``Problem.exact_dtype`` None).

``perturbed`` gives the inputs again with each floating element moved by a relative ``u * eta`` (``u`` the unit
roundoff of the coarser of the element's dtype and the run's precision, ``eta`` of mean 0 and variance 1): what
rounding each input once costs. The reference run on several such copies tells, element by element, how far an
honest computation may land from the exact answer without any of it being wrong (pkb.evaluate.accuracy). ``eta`` is
a hash of the element's value, its place in the inputs and a seed: an input that several ranks hold (replicated
weights, routing scores) moves the same way on each, so that ranks that must agree on a discrete choice (a routing,
a split size) still agree, while inputs that differ move independently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode

from pkb.problem import PRECISIONS, raised

# Each floating dtype narrower than fp64 (complex: than complex128), and what the exact answer computes in instead.
WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float64, torch.float16: torch.float64,
         torch.complex64: torch.complex128, torch.complex32: torch.complex128}
NARROW_FLOATS = tuple(WIDER)
_CASTS = ("float", "half", "bfloat16", "cfloat", "chalf")  # tensor methods that cast to a narrow dtype
_COPYING = ("to", "type", *_CASTS)  # casts that copy in the run (bf16 -> fp32): they must copy here too


class _Fp64Arithmetic(TorchFunctionMode):
    """Every narrower floating dtype a torch function or tensor method is asked for becomes fp64 (complex128). A cast
    copies, as the cast of the run's narrower inputs does (``x.float()`` of a bf16 tensor is a new tensor; of an fp64
    one it would be the same tensor, and a reference that writes into its copy would write into its input)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _CASTS and args and isinstance(args[0], torch.Tensor) and not kwargs:
            source = args[0]
            return source.to(torch.complex128 if source.is_complex() or name in ("cfloat", "chalf") else torch.float64,
                             copy=True)
        if kwargs.get("dtype") in NARROW_FLOATS:
            kwargs = {**kwargs, "dtype": WIDER[kwargs["dtype"]]}
        if any(isinstance(arg, torch.dtype) and arg in NARROW_FLOATS for arg in args):
            args = tuple(WIDER[arg] if isinstance(arg, torch.dtype) and arg in NARROW_FLOATS else arg for arg in args)
            if name in _COPYING and "copy" not in kwargs:
                kwargs = {**kwargs, "copy": True}
        return func(*args, **kwargs)


@contextlib.contextmanager
def exact_arithmetic():
    """Run the code inside in fp64 arithmetic wherever it asks for a narrower floating dtype (the module's docstring)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Fp64Arithmetic():
            yield
    finally:
        torch.set_default_dtype(default)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype``'s numbers at 1.0 (2^-8 for bf16, 2^-24 for fp32)."""
    return float(torch.finfo(dtype).eps) / 2


def perturbed(inputs: tuple, precision: str, seed: int) -> tuple:
    """``inputs`` raised to fp64 (pkb.problem.raised), each floating element ``x`` of what was a floating tensor (or a
    module's parameter or gradient) replaced by ``x * (1 + u * eta)``: ``u`` the unit roundoff of the coarser of its
    dtype and the run's ``precision``, ``eta`` a hash of its value, its place and ``seed`` (mean 0, variance 1).

        >>> a = perturbed((torch.ones(3, dtype=torch.bfloat16),), "bf16", 7)[0]
        >>> bool(((a - 1).abs() <= 2 ** -8 * 3 ** 0.5).all()), a.dtype
        (True, torch.float64)
    """
    run_u = unit_roundoff(PRECISIONS[precision])
    ordinal = iter(range(1, 1 << 30))
    memo: dict[int, Any] = {}

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = _moved(value, run_u, seed, next(ordinal))
            return memo[id(value)]
        if isinstance(value, torch.nn.Module):
            module = raised(value, torch.float64)
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter.copy_(_moved(parameter.detach(), run_u, seed, next(ordinal)))
            return module
        if isinstance(value, (list, tuple)):
            items = [move(item) for item in value]
            return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
        if isinstance(value, dict):
            return type(value)((key, move(item)) for key, item in value.items())
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: move(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        return value

    return move(inputs)


def _moved(tensor: torch.Tensor, run_u: float, seed: int, ordinal: int) -> torch.Tensor:
    high = raised(tensor, torch.float64)
    if tensor.dtype not in (*NARROW_FLOATS, torch.float64, torch.complex128) or tensor.layout != torch.strided:
        return high
    u = max(run_u, unit_roundoff(tensor.real.dtype if tensor.is_complex() else tensor.dtype))
    values = torch.view_as_real(high.detach()) if high.is_complex() else high.detach()
    moved = values * (1 + u * _eta(values, seed, ordinal))
    moved = torch.view_as_complex(moved) if high.is_complex() else moved
    if isinstance(high, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=high.requires_grad)
    return moved.requires_grad_(high.requires_grad) if high.requires_grad else moved


_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's constants, as int64


def _eta(values: torch.Tensor, seed: int, ordinal: int) -> torch.Tensor:
    """A uniform value of mean 0 and variance 1 per element, a function of the element's bits, its flat place, the
    tensor's ordinal in the inputs and ``seed`` (int64 arithmetic wraps, as a hash wants)."""
    flat = values.reshape(-1)
    key = flat.view(torch.int64) ^ (torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * _MIX[0])
    key = key ^ ((seed * 1_000_003 + ordinal) * _MIX[1] & 0x7FFFFFFFFFFFFFFF)
    for constant, shift in ((_MIX[1], 31), (_MIX[2], 29)):
        key = (key ^ (key >> shift)) * constant
    key = key ^ (key >> 32)
    unit = ((key >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
    return ((unit - 0.5) * math.sqrt(12.0)).reshape(values.shape)


def sensitivity(exact: Any, moved_runs: Iterable[Any]) -> Any:
    """Per floating tensor of ``exact`` (plain data), the RMS over ``moved_runs`` (the same structure) of how far each
    element moved, summed in fp64 and given in fp32 (0 where the value is not finite); None for a tensor whose shape a
    perturbation changed (a discrete choice flipped: its sensitivity is unbounded there) and for values that are not
    floating tensors, and
    None where there was no run. ``moved_runs`` may be a generator: each run is folded in and dropped before the next
    is made, so that a large case holds one perturbed answer at a time, not all of them."""
    squares, count = None, 0
    for run in moved_runs:
        squares = _fold(exact, run, squares)
        count += 1
    return _finish(squares, count) if count else None


_CHANGED = object()  # a tensor whose shape a perturbation changed, or that a run lacks


def _fold(exact: Any, run: Any, squares: Any) -> Any:
    """``squares`` (None before the first run) with ``run``'s squared moves from ``exact`` added, tensor by tensor."""
    if isinstance(exact, torch.Tensor):
        if not (exact.is_floating_point() or exact.is_complex()):
            return None
        if squares is _CHANGED or not isinstance(run, torch.Tensor):
            return _CHANGED
        base, moved = _real64(exact), _real64(run)
        if moved.shape != base.shape:
            return _CHANGED
        step = torch.where(torch.isfinite(moved) & torch.isfinite(base), moved - base, 0.0).square()
        return step if squares is None else squares.add_(step)
    if isinstance(exact, (list, tuple)):
        return [_fold(item, _child(run, index), None if squares is None else squares[index])
                for index, item in enumerate(exact)]
    if isinstance(exact, dict):
        return {key: _fold(item, _child(run, key), None if squares is None else squares[key])
                for key, item in exact.items()}
    return None


def _finish(squares: Any, count: int) -> Any:
    if isinstance(squares, torch.Tensor):  # in fp32: an estimate from a few runs needs no more, and a kept answer
        return (squares / count).sqrt().float()  # of a large case is a quarter smaller
    if isinstance(squares, list):
        return [_finish(item, count) for item in squares]
    if isinstance(squares, dict):
        return {key: _finish(item, count) for key, item in squares.items()}
    return None


def _real64(tensor: torch.Tensor) -> torch.Tensor:
    tensor = torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor
    return tensor.to(torch.float64)


def _child(value: Any, key) -> Any:
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        return None
