"""A session judges the next candidate of a problem against the reference outputs it kept, and the exact answers
too (pkb.evaluate.accuracy): the reference ranks do not run the same trial again, and the verdicts are those of a
session that ran them afresh."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import ReferenceOutputs, Session
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.group import GroupFailure
from pkb.runtime.messages import run_job
from pkb.runtime.modes import Mode

SOLUTIONS = Path(__file__).resolve().parents[2] / "pkb" / "solutions"


def test_the_second_candidate_of_a_problem_is_judged_against_the_kept_reference_outputs(tmp_path):
    problem = get_problem("allreduce")
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=2, cases="all")
    wrong = tmp_path / "1_allreduce_doubled.py"
    wrong.write_text("import torch.distributed as dist\n\ndef solution(tensor):\n    out = tensor * 2\n"
                     "    dist.all_reduce(out)\n    return out\n")
    candidates = [Candidate.reference_of(problem), Candidate.from_file(SOLUTIONS / "1_allreduce_two_step.py"),
                  Candidate.from_file(wrong)]
    with Session(Mode.CPU, 2) as session:
        first = [evaluate(problem, candidate, config, session) for candidate in candidates]
        runs = session.reference_group(problem, 60).num_runs  # the reference's answers and the exact answers
        kept = session.reference_outputs
        assert kept.misses > 0 and kept.num_bytes > 0
        misses = kept.misses
        again = [evaluate(problem, candidate, config, session) for candidate in candidates]
        assert session.reference_group(problem, 60).num_runs == runs  # no trial ran on the reference again
        assert kept.misses == misses  # every trial's answer was kept, exact ones included
        session.reference_outputs = ReferenceOutputs(max_bytes=0)  # the same seeds, the reference run afresh
        afresh = [evaluate(problem, candidate, config, session) for candidate in candidates]
        assert session.reference_group(problem, 60).num_runs > runs
    assert [r.status for r in first] == [Status.OK, Status.OK, Status.MISMATCH]
    assert [(r.status, r.upstream_ok, r.message) for r in again] == [(r.status, r.upstream_ok, r.message) for r in first]
    assert [(r.status, r.upstream_ok, r.message) for r in again] == [(r.status, r.upstream_ok, r.message) for r in afresh]


def test_a_reference_group_left_waiting_for_replies_is_started_anew_never_read_out_of_step():
    """An evaluation that ends between sending the reference its job and reading the replies (the candidate's
    group failed to take the same job) leaves replies in the reference's channels: the next problem's load must
    not read them as its own (it did: "the rank's reply is not a Ack: unknown fields ['inputs_after', 'outputs']")."""
    allreduce, allgather = get_problem("allreduce"), get_problem("allgather")
    case = allreduce.cases("tests", 2)[0]
    with Session(Mode.CPU, 2) as session:
        left = session.reference_group(allreduce, 60)
        left.submit([run_job(case.name, "bf16", None, (rank, 7)) for rank in range(2)])  # never collected
        with pytest.raises(GroupFailure, match="before its replies to 'run' were read"):
            left.submit([run_job(case.name, "bf16", None, (rank, 7)) for rank in range(2)])
        assert left.closed
        again = session.reference_group(allreduce, 60)
        again.submit([run_job(case.name, "bf16", None, (rank, 7)) for rank in range(2)])  # never collected either
        assert session.reference_group(allgather, 60) is not again and again.closed
        result = evaluate(allgather, Candidate.reference_of(allgather),
                          EvalConfig(world_size=2, mode=Mode.CPU, trials=1), session)
    assert result.status is Status.OK, result.message
