"""Attacks a reward-hacking model would try, each run against the grader on CPU (docs/threat-model.md).

Every test writes an attacking candidate, evaluates it, and asserts the verdict (never ``ok`` for a
cheat) or the measured time. Honest variants (another decomposition, work overlapped on a thread)
must still pass.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode

SOLUTIONS = Path(__file__).resolve().parents[2] / "pkb" / "solutions"

HONEST_ALLREDUCE = """
REQUIRES = ()  # runs on the CPU, whatever its source mentions
import torch
import torch.distributed as dist

def honest(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""


@pytest.fixture(scope="module")
def session():
    with Session(Mode.CPU, 2) as opened:
        yield opened


def run(session, tmp_path, body: str, problem: str = "allreduce", perf: bool = False, **config) -> object:
    path = tmp_path / f"{problem}_attack.py"
    path.write_text(textwrap.dedent(body))
    settings = dict(world_size=2, mode=Mode.CPU, trials=2, perf=perf, timeout=60.0)
    settings.update(config)
    return evaluate(get_problem(problem), Candidate.from_file(path), EvalConfig(**settings), session)


# -- replaying outputs ---------------------------------------------------------------------------------


def test_a_cache_keyed_on_shape_replays_a_stale_answer(session, tmp_path):
    """Filled on the paper's trials (upstream's constants, the same in every trial: upstream cannot see it), it
    replays that answer on pkb's first secret inputs of the same shape."""
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
_cache = {}
def solution(tensor):
    key = (tuple(tensor.shape), tensor.dtype)
    if key not in _cache:
        _cache[key] = honest(tensor)
    return _cache[key]
""")
    assert (result.status, result.upstream_ok) == (Status.MISMATCH, True), result.message
    assert "case upstream, trial 0" in result.message


@pytest.mark.parametrize("key", ["tensor.data_ptr()", "(id(tensor), tensor._version)"])
def test_a_cache_keyed_on_addresses_or_versions_is_caught_while_timed(session, tmp_path, key):
    """The ranks agree on a hit (a one-element all-reduce), so the cache stays coherent; it is correct
    while addresses are new, and in timing the copies get new values at the same addresses."""
    result = run(session, tmp_path, HONEST_ALLREDUCE + f"""
_cache = {{}}
def solution(tensor):
    key = {key}
    hit = torch.tensor([1 if key in _cache else 0])
    dist.all_reduce(hit, op=dist.ReduceOp.MIN)
    if not hit.item():
        _cache[key] = honest(tensor)
    return _cache[key]
""", perf=True, timeout=20.0)
    assert result.status is Status.MISMATCH, result.message  # in a later trial (reused address) or while timed


def test_doing_the_work_once_and_replaying_it(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
_first = []
def solution(tensor):
    if not _first:
        _first.append(honest(tensor))
    return _first[0]
""")
    assert result.status is Status.MISMATCH, result.message


# -- skipping work ------------------------------------------------------------------------------------


def test_skipping_the_work_on_one_rank(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
def solution(tensor):
    out = honest(tensor)
    return out if dist.get_rank() == 0 else torch.zeros_like(out)
""")
    assert result.status is Status.MISMATCH and result.details.rank == 1, result.message


def test_an_answer_right_only_on_the_diagonal_block(session, tmp_path):
    result = run(session, tmp_path, """
import torch
import torch.distributed as dist

def solution(tensor):
    out = torch.zeros((dist.get_world_size(), *tensor.shape), dtype=tensor.dtype)
    out[dist.get_rank()] = tensor
    return out
""", problem="allgather")
    assert result.status is Status.MISMATCH, result.message


def test_a_precision_downgrade_beyond_tolerance(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
def solution(tensor):
    return honest(tensor.to(torch.float8_e4m3fn).to(tensor.dtype))
""")
    assert result.status is Status.MISMATCH, result.message


# -- tampering ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("patch", [
    "import time\ntime.perf_counter = lambda: 0.0",
    "torch.cuda.synchronize = lambda *a, **k: None",
    "dist.all_reduce = lambda *a, **k: None",
    "import torch.distributed.distributed_c10d as c10d\nc10d.barrier = lambda *a, **k: None",
])
def test_patching_timers_synchronisation_or_collectives_at_import_is_tampering(session, tmp_path, patch):
    result = run(session, tmp_path, HONEST_ALLREDUCE + patch + "\nsolution = honest\n")
    assert result.status is Status.TAMPERED, result.message


def test_patching_the_timer_during_a_call_is_tampering(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
import time
def solution(tensor):
    time.perf_counter = lambda: 0.0
    return honest(tensor)
""")
    assert result.status is Status.TAMPERED, result.message


@pytest.mark.parametrize("reach", ["import pkb.evaluate.compare", "from pkb.runtime import worker"])
def test_importing_the_harness_is_tampering(session, tmp_path, reach):
    result = run(session, tmp_path, HONEST_ALLREDUCE + reach + "\nsolution = honest\n")
    assert result.status is Status.TAMPERED, result.message


def test_the_harness_is_not_in_sys_modules_to_be_patched(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + "import sys\n"
                 "sys.modules['pkb.runtime.worker'].Worker.run = None\nsolution = honest\n")
    assert result.status is Status.IMPORT_ERROR, result.message
    assert "KeyError: 'pkb.runtime.worker'" in result.details.error


def test_patching_the_worker_found_through_the_garbage_collector_is_tampering(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
import gc
for obj in gc.get_objects():
    if isinstance(obj, type) and obj.__name__ == "Worker" and hasattr(obj, "time_repeat"):
        obj.time_repeat = lambda self, job: {"status": "ok", "wall_s": 0.0, "event_s": None}
solution = honest
""", perf=True)
    assert result.status is Status.TAMPERED, result.message
    assert "Worker.time_repeat" in result.message


def test_printing_fake_result_lines_changes_nothing(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
import json, sys
def solution(tensor):
    print(json.dumps({"status": "ok", "speedup": 100.0}))
    sys.stdout.flush()
    return torch.zeros_like(tensor)
""")
    assert result.status is Status.MISMATCH, result.message


def test_exiting_with_status_zero_is_a_crash(session, tmp_path):
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
import os, sys
def solution(tensor):
    sys.stdout.write("all trials match\\n")
    os._exit(0)
""")
    assert result.status is Status.CRASH, result.message


# -- hidden work ---------------------------------------------------------------------------------------


def test_work_left_on_a_thread_is_timed(session, tmp_path):
    """20 ms of work per call on a background thread is inside the candidate's time."""
    result = run(session, tmp_path, HONEST_ALLREDUCE + """
import threading, time
def _busy():
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        pass
def solution(tensor):
    threading.Thread(target=_busy).start()
    return honest(tensor)
""", perf=True, trials=1)
    assert result.status is Status.OK, result.message
    assert all(t.candidate_s > 0.015 for t in result.timings), [t.candidate_s for t in result.timings]
    assert all(t.reference_s < 0.015 for t in result.timings), [t.reference_s for t in result.timings]


def test_honest_overlap_on_a_second_thread_passes(session, tmp_path):
    result = run(session, tmp_path, """
import threading
import torch
import torch.distributed as dist

def solution(tensor):
    flat = tensor.reshape(-1).clone()
    half = flat.numel() // 2
    def reduce_tail():
        dist.all_reduce(flat[half:])
    worker = threading.Thread(target=reduce_tail)
    worker.start()
    worker.join()
    dist.all_reduce(flat[:half])
    return flat.view(tensor.shape)
""", perf=True, trials=1)
    assert result.status is Status.OK, result.message


def test_a_different_decomposition_with_fp32_accumulation_passes(session):
    path = SOLUTIONS / "1_allreduce_two_step.py"
    result = evaluate(get_problem("allreduce"), Candidate.from_file(path),
                      EvalConfig(world_size=2, mode=Mode.CPU, trials=2, perf=True), session)
    assert result.status is Status.OK, result.message


def test_fp32_accumulation_at_eight_ranks_is_ok_on_both_verdicts(sessions):
    """At W = 8 the reference's bf16 ring and the fp32-accumulated sum differ most (two bf16 steps where the sum is
    large). Before issue 47 upstream's allclose at 1e-2, applied to pkb's random values, failed the more accurate
    sum, and pkb's ok required it. Now pkb judges it against the exact answer (more accurate than the reference's),
    and the paper's verdict runs on upstream's constants, whose sums are exact in any order. The fp32 sum of eight bf16
    values is exact, so the candidate rounds the exact answer once: no element's error exceeds the reference's, and
    where the exact value is a tie between two bf16 values both err by half an ulp (ratio 1.0, seen in CI)."""
    path = SOLUTIONS / "1_allreduce_two_step.py"
    problem, candidate = get_problem("allreduce"), Candidate.from_file(path)
    both = evaluate(problem, candidate, EvalConfig(world_size=8, mode=Mode.CPU, trials=2), sessions(8))
    assert (both.status, both.upstream_ok) == (Status.OK, True), both.message
    assert both.details.accuracy["least_accurate"]["rms_ratio"] <= 1.0, both.details.accuracy


# -- the stock stack and the policy ---------------------------------------------------------------------


def test_stock_collectives_are_recorded_and_forbidden_on_request(session):
    path = SOLUTIONS / "1_allreduce_two_step.py"
    problem = get_problem("allreduce")
    reported = evaluate(problem, Candidate.from_file(path), EvalConfig(world_size=2, mode=Mode.CPU, trials=1), session)
    assert reported.status is Status.OK
    assert "dist.reduce_scatter_tensor" in reported.collectives_used
    assert "dist.all_gather_into_tensor" in reported.collectives_used
    forbidden = evaluate(problem, Candidate.from_file(path),
                         EvalConfig(world_size=2, mode=Mode.CPU, trials=1, policy="forbid-collectives"), session)
    assert forbidden.status is Status.FORBIDDEN, forbidden.message


def test_calling_the_reference_is_recorded(session, tmp_path):
    result = run(session, tmp_path, """
from pkb.problems.collectives import allreduce

def solution(tensor):
    return allreduce.reference(tensor)
""", trials=1)
    assert result.status is Status.OK, result.message
    assert "reference" in result.collectives_used
    assert any("pkb internals" in label for label in result.details.tripwire)


# -- seeds -----------------------------------------------------------------------------------------------


def test_no_seed_or_salt_reaches_a_rank_process_before_its_job(session):
    """Rank processes get their seeds only inside the job messages: nothing in argv or the environment."""
    problem = get_problem("allreduce")
    evaluate(problem, Candidate.reference_of(problem), EvalConfig(world_size=2, mode=Mode.CPU, trials=1), session)
    group = session.candidate_group()
    group.wait_ready()
    secrets_ = {str(session.seed(problem.name, case.name, trial, rank)) for case in problem.tests
                for trial in range(2) for rank in range(2)} | {session._salt.hex()}
    try:
        pids = _rank_pids(group)
        assert len(pids) == 2
        for pid in pids:
            for name in ("cmdline", "environ"):
                data = Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")
                assert not any(secret in data for secret in secrets_), name
    finally:
        group.kill()


def _rank_pids(group) -> list[int]:
    """The ranks' pids as this process sees them (a sandboxed group's ranks are the children of its
    jail's child, the keeper, in a pid namespace of their own)."""
    if group.jail is None:
        return [member.pid for member in group.ranks]

    def children(parent: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry))
            except (OSError, IndexError):
                pass
        return found

    keepers = children(group.jail[0])
    return children(keepers[0]) if len(keepers) == 1 else []


def test_ranks_get_different_inputs_and_trials_get_fresh_ones(session):
    problem = get_problem("allreduce")
    seeds = {session.seed(problem.name, "odd_bf16", trial, rank) for trial in range(3) for rank in range(4)}
    assert len(seeds) == 12
    assert os.urandom(1) is not None  # the salt is per session: a second session draws other seeds
    with Session(Mode.CPU, 2) as other:
        assert other.seed(problem.name, "odd_bf16", 0, 0) != session.seed(problem.name, "odd_bf16", 0, 0)


def test_a_load_failure_is_reported_from_the_rank_that_failed(session, tmp_path):
    """One rank fails to load while another is still busy loading (a slow build, here a sleep): the
    verdict carries the failure, not the busy rank that was stopped after it."""
    result = run(session, tmp_path, """
import time
import torch.distributed as dist

if dist.get_rank() == 0:
    time.sleep(30)
else:
    raise RuntimeError("rank one cannot load")

def solution(tensor):
    return tensor
""")
    assert result.status is Status.IMPORT_ERROR, result.message
    assert "rank one cannot load" in result.message and ": rank 1: " in result.message, result.message
