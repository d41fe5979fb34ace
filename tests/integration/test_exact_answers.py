"""Every problem's exact answer keeps the function's meaning (issues 47 and 53): the reference, run again on the same
inputs raised to fp64 in fp64 arithmetic throughout (pkb.runtime.exact: no cast down anywhere in its path, so every
floating value of it is fp64), runs, and so do its perturbed runs (the sensitivity); it makes the same integer and
boolean choices as in the run's precision (top-k, sorts, routing, masks: the cases keep their values apart, so a more
precise computation cannot flip them), and the reference's own error against it stays within the problem's
tolerance (so the tolerance, the element-wise allowance of pkb's accuracy rule, holds the reference itself).

In cpu mode, every problem that has an exact answer, on its ``tests`` cases at W = 2, and under ``-m slow`` at W = 4 and
on its upstream case at W = 2 (upstream's sizes: the fp64 answer and its eight perturbed runs of the three largest took
over a minute each of a 2-core machine), one trial of pkb's secret inputs each. A problem that cannot keep these
must say so in ``exact_dtype`` and ``exact_note`` (docs/paper-protocol.md).
"""

from __future__ import annotations

import pytest
import torch

from pkb.evaluate.accuracy import PERTURBATIONS
from pkb.evaluate.session import Session
from pkb.registry import all_problems
from pkb.runtime.messages import ExactReply, RankFailure, RunReply, run_job
from pkb.runtime.modes import Mode

# (world size, the cases' tier): the first in the default tier, the others under ``-m slow``
RUNS = (2, "tests"), (4, "tests"), (2, "upstream")


def _params():
    return [pytest.param(problem.name, world_size, tier, id=f"{problem.name}-{world_size}-{tier}",
                         marks=[pytest.mark.slow] if (world_size, tier) != RUNS[0] else [])
            for world_size, tier in RUNS for problem in all_problems().values()
            if problem.exact_dtype is not None and world_size in problem.world_sizes and problem.nodes == (1,)]


@pytest.fixture(scope="module")
def reference_sessions():
    """One warm session of reference ranks per world size (no candidate ever runs here)."""
    sessions: dict[int, Session] = {}

    def get(world_size: int) -> Session:
        if world_size not in sessions:
            sessions[world_size] = Session(Mode.CPU, world_size, "off")
        return sessions[world_size]

    yield get
    for session in sessions.values():
        session.close()


def _leaves(value, path="out"):
    """(path, tensor) of every tensor in a reply's plain data (a float as a 1-element fp64 tensor)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, float):
        yield path, torch.tensor([value], dtype=torch.float64)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")


def _disagreements(problem, case, world_size, rank, expected: RunReply, exact: ExactReply) -> list[str]:
    found = []
    for part in ("outputs", "inputs_after"):
        exact_leaves = dict(_leaves(getattr(exact, part), part))
        for path, reference in _leaves(getattr(expected, part), part):
            answer = exact_leaves.get(path)
            where = f"rank {rank}, case {case.name}, {path}"
            if answer is None or answer.shape != reference.shape:
                found.append(f"{where}: the exact answer has another structure")
            elif (reference.is_floating_point() or reference.is_complex()) and answer.dtype not in (torch.float64,
                                                                                                 torch.complex128):
                found.append(f"{where}: the exact answer is {answer.dtype}: a cast down pkb's fp64 arithmetic missed")
            elif not (reference.is_floating_point() or reference.is_complex()):
                if not torch.equal(answer, reference):
                    found.append(f"{where}: {int((answer != reference).sum())} of {reference.numel()} integer values "
                                 "differ from the exact answer's: a choice that a higher precision flips")
            else:
                tolerance = problem.tolerance_for(case, world_size, reference.dtype)
                ref = torch.view_as_real(reference).double() if reference.is_complex() else reference.double()
                ex = torch.view_as_real(answer).double() if answer.is_complex() else answer.double()
                finite = torch.isfinite(ref) & torch.isfinite(ex)
                off = (ref - ex).abs() > tolerance.atol + tolerance.rtol * ex.abs()
                if bool((off & finite).any()):
                    worst = float(((ref - ex).abs() * finite).max())
                    found.append(f"{where}: the reference is {worst:.3g} off the exact answer in {int((off & finite).sum())} "
                                 f"of {ref.numel()} elements, outside its tolerance (atol={tolerance.atol:g}, "
                                 f"rtol={tolerance.rtol:g})")
    return found


@pytest.mark.parametrize("name,world_size,tier", _params())
def test_the_exact_answer_keeps_the_references_choices_and_its_tolerance_holds_the_reference(name, world_size, tier,
                                                                                           reference_sessions):
    problem = all_problems()[name]
    session = reference_sessions(world_size)
    group = session.reference_group(problem, 600.0)
    found = []
    for case in problem.cases(tier, world_size):
        if case.slow_on_cpu:
            continue
        jobs = [run_job(case.name, "bf16", None, (7919 * rank + 1, 104729)) for rank in range(world_size)]
        expected = group.request(jobs, 600.0, RunReply)
        exact = group.request([run_job(case.name, "bf16", None, (7919 * rank + 1, 104729), exact=True,
                                       perturbations=PERTURBATIONS, perturbation_seed=5) for rank in range(world_size)],
                              600.0, ExactReply)
        for rank in range(world_size):
            assert not isinstance(expected[rank], RankFailure), expected[rank]
            assert not isinstance(exact[rank], RankFailure), f"case {case.name}: the exact answer failed: {exact[rank]}"
            found += _disagreements(problem, case, world_size, rank, expected[rank], exact[rank])
    assert not found, f"{name} at W={world_size}:\n  " + "\n  ".join(found[:20])
