"""Every problem of the suite, on CPU over gloo: its reference passes against itself, and known-wrong
candidates get the right verdict.

The known-wrong candidates are templates in tests/candidates/ that wrap the problem's own reference
(``{module}`` is replaced by the problem's module): the reference with every collective made
local-only, zeroed outputs, a rank that raises, hangs or exits, an input scribbled on, a wrong
signature, a syntax error. Local-only is the one that proves a problem tests communication at all.

World size 2 runs by default; 4 and 8 are marked slow (``pytest -m slow``): at W = 4 the self-check and the
local-only answer took 17 minutes of a 2-core machine's 90-minute CI. World size 4 stays in the default tier where
it is the subject: the upstream corpus (tests/integration/test_upstream_corpus.py), the accuracy rule's world sizes
and the integrity corpus's ``--world-size 4`` rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.problem import make_generator
from pkb.registry import all_problems
from pkb.runtime.modes import Mode

TEMPLATES = Path(__file__).resolve().parents[1] / "candidates"
PROBLEMS = list(all_problems().values())
WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]


def candidate_from(template: str, problem, tmp_path: Path) -> Candidate:
    source = (TEMPLATES / f"{template}.py.tmpl").read_text().replace("{module}", problem.module)
    path = tmp_path / f"{problem.name}_{template}.py"
    path.write_text(source)
    return Candidate.from_file(path)


def config(world_size: int, **overrides) -> EvalConfig:
    """The known-wrong candidates, local-only among them, run on the test cases (one failing case is their verdict;
    with the upstream cases too, local-only took 5x as long: the paper's five trials on upstream's sizes first); the
    self-check runs on every case (``cases="all"``: the upstream cases too)."""
    return EvalConfig(**{"world_size": world_size, "mode": Mode.CPU, "trials": 2, "timeout": 120.0,
                         "cases": "tests", **overrides})


def session_for(sessions, problem, world_size: int):
    """The run's warm session for ``problem`` at ``world_size``, on the problem's default nodes."""
    return sessions(world_size, nodes=problem.nodes[0])


def smallest_world_size(problem) -> int:
    return min(w for w in problem.world_sizes if w >= 2 and problem.cases("tests", w))


def supported(problem, world_size: int) -> bool:
    return world_size in problem.world_sizes and bool(problem.cases("tests", world_size))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def first_case_inputs(problem, world_size: int):
    case = problem.cases("tests", world_size)[0]
    return problem.make_inputs(case, 0, world_size, make_generator(0, 1))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_reference_passes_against_itself(problem, world_size, sessions):
    if not supported(problem, world_size):
        pytest.skip(f"{problem.name} does not run at world size {world_size}")
    result = evaluate(problem, Candidate.reference_of(problem), config(world_size, cases="all"),
                      session_for(sessions, problem, world_size))
    assert result.status is Status.OK, result.message


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_local_only_answer_is_rejected(problem, world_size, sessions, tmp_path):
    if not supported(problem, world_size):
        pytest.skip(f"{problem.name} does not run at world size {world_size}")
    if problem.local_answer:
        pytest.skip(f"{problem.name}: the upstream function's answer is local: {problem.local_answer}")
    result = evaluate(problem, candidate_from("local_only", problem, tmp_path), config(world_size),
                      session_for(sessions, problem, world_size))
    assert result.status is Status.MISMATCH, result.message
    # a rank's own tensor, an aggregate test over every rank's tensors pooled, or ranks that disagree (no one rank)
    assert (result.details.rank in range(world_size) or "of all ranks and trials pooled" in result.message
            or "replicas must agree" in result.message), result.message


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_zeroed_outputs_are_rejected(problem, sessions, tmp_path):
    world_size = smallest_world_size(problem)
    result = evaluate(problem, candidate_from("zeros", problem, tmp_path), config(world_size),
                      session_for(sessions, problem, world_size))
    assert result.status is Status.MISMATCH, result.message
    assert "elements off" in result.message


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_scribbling_on_an_input_is_rejected(problem, sessions, tmp_path):
    world_size = smallest_world_size(problem)
    if not any((t.is_floating_point() or t.is_complex()) and t.numel()
               for t in _tensors(first_case_inputs(problem, world_size))):
        pytest.skip("no floating-point or complex input to scribble on")
    result = evaluate(problem, candidate_from("mutates_input", problem, tmp_path), config(world_size),
                      session_for(sessions, problem, world_size))
    assert result.status is Status.MISMATCH, result.message
    # Caught on the input itself, or on an output that is the input (optimizer steps and clipping
    # return the tensors they update in place), which the parent compares first.
    assert "input `" in result.message or result.details.mismatch["path"].startswith("out"), result.message


@pytest.mark.parametrize(("template", "status"), [
    ("raises", Status.RUNTIME_ERROR),
    ("exits", Status.CRASH),
    ("wrong_signature", Status.SIGNATURE_ERROR),
    ("syntax_error", Status.COMPILE_ERROR),
])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_broken_candidates_get_their_verdict(problem, template, status, sessions, tmp_path):
    world_size = smallest_world_size(problem)
    result = evaluate(problem, candidate_from(template, problem, tmp_path), config(world_size),
                      session_for(sessions, problem, world_size))
    assert result.status is status, result.message


@pytest.mark.parametrize("problem", PROBLEMS[:1] + [p for p in PROBLEMS if 2 in p.world_sizes][-1:], ids=lambda p: p.name)
def test_a_hang_times_out_and_the_session_goes_on(problem, sessions, tmp_path):
    session = sessions(2)
    hung = evaluate(problem, candidate_from("hangs", problem, tmp_path), config(2, timeout=3.0), session)
    assert hung.status is Status.TIMEOUT, hung.message
    assert "did not finish within 3 s" in hung.message
    after = evaluate(problem, Candidate.reference_of(problem), config(2), session)
    assert after.status is Status.OK, after.message
