"""Comparing a candidate's per-rank outputs with the reference's, in the parent process.

Structure (list/dict layout), then per tensor: shape, dtype, NaN and inf placement, then values:
integers and bools exactly, floats within ``|cand - ref| <= atol + rtol * |ref|``. A mismatch names
the output (``out[1]``), how many elements are off, the largest absolute and relative errors and
where they are, so a kernel author can see what went wrong without rerunning anything.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from pkb.problem import Tolerance
from pkb.protocol import UPSTREAM_ATOL, UPSTREAM_RTOL

CHUNK = 1 << 24  # elements compared at a time, to bound the parent's memory on GiB-sized outputs


@dataclass(frozen=True)
class Mismatch:
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
    against: str = "reference"  # what the values were judged against: the reference's, or the exact answer

    def describe(self) -> str:
        if not self.num_bad:
            return f"{self.path}: {self.reason}"
        if self.against == "exact":
            return (f"{self.path}: {self.reason}; the worst at {list(self.max_abs_at)} (exact {self.expected:.6g}, "
                    f"got {self.got:.6g})")
        return (f"{self.path}: {self.num_bad} of {self.numel} elements off (atol={self.atol:g}, rtol={self.rtol:g}); "
                f"largest abs error {self.max_abs_err:.4g} at {list(self.max_abs_at)} "
                f"(expected {self.expected:.6g}, got {self.got:.6g}); "
                f"largest rel error {self.max_rel_err:.4g} at {list(self.max_rel_at)}")

    def to_dict(self) -> dict:
        return asdict(self)


ToleranceFor = Callable[[torch.dtype], Tolerance]


def compare(expected: Any, got: Any, tolerance_for: ToleranceFor, path: str = "out", exact=None) -> Mismatch | None:
    """The first difference between ``got`` and ``expected`` (plain data from rank processes), or None.

    ``exact`` (a pkb.evaluate.accuracy.ExactAnswer at the same place): floating values that are not the reference's
    bit for bit are judged against the exact answer (pkb's accuracy rule) instead of against ``expected`` by the
    tolerance, which then only sets the element-wise allowance; values the tolerance wants exact stay exact."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return Mismatch(path, f"expected a tensor, got {_kind(got)}")
        return compare_tensors(expected, got, tolerance_for(expected.dtype), path, exact)
    if isinstance(expected, list):
        if not isinstance(got, list):
            return Mismatch(path, f"expected a sequence of {len(expected)}, got {_kind(got)}")
        if len(got) != len(expected):
            return Mismatch(path, f"expected {len(expected)} items, got {len(got)}")
        for index, (e, g) in enumerate(zip(expected, got)):
            found = compare(e, g, tolerance_for, f"{path}[{index}]", exact and exact.child(index))
            if found:
                return found
        return None
    if isinstance(expected, dict) and expected.get("__sampled__"):
        return _compare_sampled(expected, got, tolerance_for, path, exact)
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            keys = sorted(got) if isinstance(got, dict) else _kind(got)
            return Mismatch(path, f"expected keys {sorted(expected)}, got {keys}")
        for key in expected:
            found = compare(expected[key], got[key], tolerance_for, f"{path}[{key!r}]", exact and exact.child(key))
            if found:
                return found
        return None
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return compare_tensors(torch.tensor([expected], dtype=torch.float64), torch.tensor([float(got)], dtype=torch.float64),
                               tolerance_for(torch.float64), path, exact)
    if type(got) is not type(expected) or got != expected:
        return Mismatch(path, f"expected {expected!r}, got {got!r}")
    return None


def _compare_sampled(expected: dict, got: Any, tolerance_for: ToleranceFor, path: str, exact=None) -> Mismatch | None:
    """A large tensor sent as its values at parent-chosen places: compare those, report original indices."""
    if not (isinstance(got, dict) and got.get("__sampled__")):
        return Mismatch(path, f"expected a tensor of shape {expected['shape']}, got {_kind(got)}")
    if got["shape"] != expected["shape"]:
        return Mismatch(path, f"expected shape {expected['shape']}, got {got['shape']}")
    if not torch.equal(got["places"], expected["places"]):
        return Mismatch(path, "the sampled places differ from the ones the parent asked for")
    found = compare_tensors(expected["values"], got["values"], tolerance_for(expected["values"].dtype), path,
                            exact and exact.child("values"))
    if found is None or not found.num_bad:
        return found
    places = expected["places"]
    where = lambda at: _unravel(int(places[at[0]]), expected["shape"])  # noqa: E731
    return Mismatch(**{**found.to_dict(), "reason": found.reason + f" (checked {places.numel()} sampled elements)",
                       "max_abs_at": where(found.max_abs_at), "max_rel_at": where(found.max_rel_at)})


def compare_tensors(expected: torch.Tensor, got: torch.Tensor, tolerance: Tolerance, path: str,
                    exact=None) -> Mismatch | None:
    if got.shape != expected.shape:
        return Mismatch(path, f"expected shape {list(expected.shape)}, got {list(got.shape)}")
    if got.dtype != expected.dtype:
        return Mismatch(path, f"expected dtype {expected.dtype}, got {got.dtype}")
    if not (expected.is_floating_point() or expected.is_complex()):
        return _compare_exact(expected, got, path)
    if exact is None or tolerance.is_exact:
        return _compare_close(expected, got, tolerance, path)
    if _bit_equal(expected, got):  # the reference's own answer: nothing to judge, no exact answer needed
        return None
    return exact.judge(expected, got, tolerance, path)


def _bit_equal(expected: torch.Tensor, got: torch.Tensor) -> bool:
    if torch.equal(expected, got):
        return True
    e, g = _as_real_flat(expected), _as_real_flat(got)
    return bool(((e == g) | (torch.isnan(e) & torch.isnan(g))).all())


def _compare_exact(expected: torch.Tensor, got: torch.Tensor, path: str) -> Mismatch | None:
    bad = expected.reshape(-1) != got.reshape(-1)
    num_bad = int(bad.sum())
    if not num_bad:
        return None
    first = int(bad.nonzero()[0])
    at = _unravel(first, expected.shape)
    e, g = expected.reshape(-1)[first].item(), got.reshape(-1)[first].item()
    return Mismatch(path, "integer values differ", num_bad, expected.numel(), abs(float(e) - float(g)), at, 0.0, at,
                    float(e), float(g))


def _compare_close(expected: torch.Tensor, got: torch.Tensor, tolerance: Tolerance, path: str) -> Mismatch | None:
    """Float (and complex, per component) comparison in chunks; exact tolerance means bit-equal values."""
    if torch.equal(expected, got):  # the common case, at memory speed (NaNs never compare equal: checked below)
        return None
    flat_e, flat_g = _as_real_flat(expected), _as_real_flat(got)
    work = torch.float64 if flat_e.dtype == torch.float64 else torch.float32
    num_bad = 0
    worst_abs, worst_abs_at, worst_rel, worst_rel_at = -1.0, 0, -1.0, 0
    for start in range(0, flat_e.numel(), CHUNK):
        e = flat_e[start:start + CHUNK].to(work)
        g = flat_g[start:start + CHUNK].to(work)
        e_nan, g_nan = torch.isnan(e), torch.isnan(g)
        both_nan = e_nan & g_nan
        same_inf = torch.isinf(e) & (e == g)
        diff = torch.where(both_nan | same_inf, torch.zeros_like(e), (g - e).abs())
        diff = torch.where(e_nan ^ g_nan, torch.full_like(e, float("inf")), diff)
        bad = diff > tolerance.atol + tolerance.rtol * e.abs().nan_to_num(posinf=0.0)
        if tolerance.is_exact:
            bad = bad | ((e != g) & ~both_nan)
        num_bad += int(bad.sum())
        rel = diff / e.abs().clamp_min(max(tolerance.atol, torch.finfo(work).tiny))
        chunk_abs, chunk_abs_at = diff.max(0) if diff.numel() else (torch.tensor(0.0), torch.tensor(0))
        chunk_rel, chunk_rel_at = rel.max(0) if rel.numel() else (torch.tensor(0.0), torch.tensor(0))
        if float(chunk_abs) > worst_abs:
            worst_abs, worst_abs_at = float(chunk_abs), start + int(chunk_abs_at)
        if float(chunk_rel) > worst_rel:
            worst_rel, worst_rel_at = float(chunk_rel), start + int(chunk_rel_at)
    if not num_bad:
        return None
    shape = _real_shape(expected)
    reason = "values differ" + (" (NaN or inf placement differs)" if worst_abs == float("inf") else "")
    return Mismatch(path, reason, num_bad, flat_e.numel(), worst_abs, _unravel(worst_abs_at, shape), worst_rel,
                    _unravel(worst_rel_at, shape), float(flat_e[worst_abs_at]), float(flat_g[worst_abs_at]),
                    tolerance.atol, tolerance.rtol)


def _as_real_flat(tensor: torch.Tensor) -> torch.Tensor:
    """Complex tensors are compared on real and imaginary parts alike (a trailing dimension of 2)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    return tensor.reshape(-1)


def _real_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return (*tensor.shape, 2) if tensor.is_complex() else tuple(tensor.shape)


def _unravel(flat_index: int, shape) -> tuple[int, ...]:
    index = []
    for size in reversed(tuple(shape)):
        index.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(index))


def _kind(value: Any) -> str:
    if isinstance(value, dict) and "__unsupported__" in value:
        return f"an unsupported object ({value['__unsupported__']})"
    return type(value).__name__


# -- upstream's rule ----------------------------------------------------------------------------------



def upstream_compare(expected: Any, got: Any, path: str = "out") -> Mismatch | None:
    """The first difference under the upstream benchmark's verdict rule (``outputs_match_rank_outputs``
    in its ``utils/problem_id.py``), or None.

    Containers: tuples and lists alike (already lists here), dicts by their key sets. Tensors: the same
    shape, then ``torch.allclose(ref.float(), sol.float(), atol=1e-2, rtol=1e-2)``: dtypes are not
    compared, the relative term scales with the solution's value, any NaN fails, and ``.float()`` keeps
    only the real part of a complex tensor. Any other leaf: ``ref == sol``. Inputs after the call are not
    part of the rule.
    """
    if isinstance(expected, dict) and expected.get("__sampled__"):
        if not (isinstance(got, dict) and got.get("__sampled__")) or got["shape"] != expected["shape"]:
            return Mismatch(path, f"expected a tensor of shape {expected['shape']}, got {_kind(got)}")
        return _upstream_allclose(expected["values"], got["values"], path)
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        if got.shape != expected.shape:
            return Mismatch(path, f"expected shape {list(expected.shape)}, got {list(got.shape)}")
        return _upstream_allclose(expected, got, path)
    if isinstance(expected, dict) and isinstance(got, dict) and not got.get("__sampled__"):
        if set(got) != set(expected):
            return Mismatch(path, f"expected keys {sorted(expected)}, got {sorted(got)}")
        for key in sorted(expected):
            found = upstream_compare(expected[key], got[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(got, list):
        if len(got) != len(expected):
            return Mismatch(path, f"expected {len(expected)} items, got {len(got)}")
        for index, (e, g) in enumerate(zip(expected, got)):
            found = upstream_compare(e, g, f"{path}[{index}]")
            if found:
                return found
        return None
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        return Mismatch(path, f"expected {_kind(expected)}, got {_kind(got)}")
    try:
        if expected == got:
            return None
    except Exception:  # noqa: BLE001 - upstream's rule: a comparison that raises is a mismatch
        pass
    return Mismatch(path, f"expected {expected!r}, got {got!r}")


def _upstream_allclose(expected: torch.Tensor, got: torch.Tensor, path: str) -> Mismatch | None:
    if expected.dtype == got.dtype and expected.shape == got.shape and torch.equal(expected, got):
        return None  # equal values hold no NaN (NaN is never equal), so allclose passes: at memory speed
    with warnings.catch_warnings():  # .float() of a complex tensor warns that it drops the imaginary part
        warnings.simplefilter("ignore")
        e, g = expected.float().reshape(-1), got.float().reshape(-1)
    if torch.isnan(e).any() or torch.isnan(g).any():
        where = "the reference's" if torch.isnan(e).any() else "the solution's"
        return Mismatch(path, f"NaN in {where} output (upstream's rule: allclose fails on any NaN)")
    if torch.allclose(e, g, atol=UPSTREAM_ATOL, rtol=UPSTREAM_RTOL):
        return None
    same_inf = torch.isinf(e) & (e == g)
    diff = torch.where(same_inf, torch.zeros_like(e), (e - g).abs())
    bad = diff > UPSTREAM_ATOL + UPSTREAM_RTOL * g.abs()
    worst = int(diff.argmax())
    rel = diff / e.abs().clamp_min(UPSTREAM_ATOL)
    worst_rel = int(rel.argmax())
    shape = expected.shape
    return Mismatch(path, "values differ", int(bad.sum()), e.numel(), float(diff[worst]), _unravel(worst, shape),
                    float(rel[worst_rel]), _unravel(worst_rel, shape), float(e[worst]), float(g[worst]),
                    UPSTREAM_ATOL, UPSTREAM_RTOL)
