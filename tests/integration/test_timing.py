"""The timing protocol (docs/timing.md): the rank side (pkb.runtime.timed_loop.TimedLoop) in a real two-process group,
and whole evaluations with ``--perf`` of candidates that try to look faster than they are (each must fail, never pass
with a speedup it did not earn) and of an honest one (which must pass)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.timing import Draws, GroupTiming, _judged, _same_summaries, check_every_call
from pkb.evaluate.verdicts import Verdict
from pkb.options import Status
from pkb.problem import Case
from pkb.registry import get_problem
from pkb.runtime.modes import Mode
from pkb.runtime.timed_loop import (CHANGE_SHARE, CPU_CACHE_BYTES, OutputRefused, TimedLoop, apply_change,
                                    change_block, donor_pair, instance_seeds)

WRONG = Path(__file__).parents[1] / "candidates" / "integrity" / "wrong"
HONEST_ALLREDUCE = '''
import torch
import torch.distributed as dist

def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
'''


def _run_ranks(target, tmp_path, world_size: int = 2, limit_s: float = 90.0) -> list[dict]:
    context = mp.start_processes(target, args=(str(tmp_path),), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"the ranks did not finish within {limit_s:g} s (a hang: they disagree)"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads(Path(tmp_path, f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _join(folder: str, rank: int) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)


def _all_reduce(x):
    out = x.clone()
    dist.all_reduce(out)
    return out


def _scatter_like_rank(rank: int, folder: str) -> None:
    """Rank 0 holds 2 buffers, rank 1 one: their inputs differ in size, and every rank must make the same calls."""
    _join(folder, rank)
    numel = CPU_CACHE_BYTES // 4 // 8  # 4 MiB of fp32 per buffer

    def make_inputs(seeds):
        gen = torch.Generator().manual_seed(seeds[0])
        return (torch.randn(2 if rank == 0 else 1, numel, generator=gen),)

    loop = TimedLoop(lambda x: _all_reduce(x[0]), make_inputs, [(rank, k) for k in range(8)], torch.device("cpu"))
    prepared = loop.prepare(num_warmup=2, warmup_s=0.0)
    loop.make_copies(4)
    loop.refresh(0, 12345)
    repeat = loop.repeat(4, 678)
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"slots": len(loop.copies), **prepared, **repeat}))
    dist.destroy_process_group()


def test_ranks_with_inputs_of_different_sizes_agree_on_the_estimates(tmp_path):
    replies = _run_ranks(_scatter_like_rank, tmp_path)
    assert replies[0]["per_call_s"] == replies[1]["per_call_s"]  # the slowest rank's, on every rank
    # the largest slot: rank 0's 8 MiB inputs, its donor's 8 MiB largest tensor, its 4 MiB output
    assert replies[0]["copy_bytes"] == replies[1]["copy_bytes"] == 20 * (CPU_CACHE_BYTES // 32)
    assert replies[0]["slots"] == replies[1]["slots"] == 4


def _loop_rank(rank: int, folder: str) -> None:
    """A loop whose calls record what they see: every slot's values at each call, and the inputs of each call."""
    _join(folder, rank)

    def make_inputs(seeds):
        gen = torch.Generator().manual_seed((31 * seeds[0] + seeds[1]) % 2**63)
        return (torch.randn(16, 4, generator=gen), torch.arange(3) + seeds[1] % 7)

    seen: list = []
    loop = None

    def fn(x, ints):
        seen.append([[float(slot[0].sum()) for slot in loop.copies], float(x.sum()), x.clone()])
        return _all_reduce(x)

    seeds = [(rank * 100 + k, k) for k in range(4)]
    loop = TimedLoop(fn, make_inputs, seeds, torch.device("cpu"))
    loop.prepare(num_warmup=2, warmup_s=0.0)
    loop.make_copies(4)
    results: dict = {}
    loop.refresh(3, 111)
    first = [slot[0].clone() for slot in loop.copies]
    loop.refresh(3, 222)
    results["entropy_changes_values"] = all(not torch.equal(a, b[0]) for a, b in zip(first, loop.copies))
    loop.refresh(3, 111)
    results["same_entropy_same_values"] = all(torch.equal(a, b[0]) for a, b in zip(first, loop.copies))
    refreshed = [float(slot[0].sum()) for slot in loop.copies]
    seen.clear()
    loop.repeat(4, 999)
    # before call k, slots k.. still hold their refreshed values (nothing made them ready ahead); call k's slot changed
    results["later_slots_unchanged"] = all(seen[k][0][j] == refreshed[j] for k in range(4) for j in range(k, 4)
                                           if j > k)
    results["own_slot_changed"] = all(seen[k][1] != refreshed[k] for k in range(4))
    # the parent's exact answer rebuilds each call's inputs from the same numbers (pkb.runtime.worker.time_exact)
    rebuilt = []
    for k in range(4):
        inputs = make_inputs(instance_seeds(seeds[k], 3, 111, 0))
        donor = make_inputs(instance_seeds(seeds[k], -1, 0, 1))
        apply_change(donor_pair(inputs, donor), 999, k)
        rebuilt.append(torch.equal(inputs[0], seen[k][2]))
    results["rebuilt_inputs_equal"] = all(rebuilt)

    def subclass(x, ints):
        return torch.Tensor._make_subclass(type("Lazy", (torch.Tensor,), {}), _all_reduce(x))

    loop.fn = subclass
    try:
        loop.repeat(4, 5)
        results["subclass"] = "accepted"
    except OutputRefused as exc:
        results["subclass"] = str(exc)
    loop.fn = lambda x, ints: [_all_reduce(x), {"n": 3, "t": torch.nn.Parameter(x.clone())}, (1.5, None, "s")]
    loop.repeat(4, 6)
    results["plain_structure"] = "accepted"

    class LeftOn(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    modes = []

    def leaves_a_mode(x, ints):
        if not modes:
            modes.append(LeftOn())
            modes[0].__enter__()
        return _all_reduce(x)

    loop.fn = leaves_a_mode
    try:
        loop.repeat(4, 7)
        results["mode"] = "accepted"
    except OutputRefused as exc:
        results["mode"] = str(exc)
    modes[0].__exit__(None, None, None)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_the_loop_changes_each_slot_just_before_its_call_and_refuses_outputs_that_are_not_plain(tmp_path):
    """Each repeat's values follow the parent's refresh entropy alone (the same entropy gives the same values, another
    gives others); before call k no later slot holds its final values, and call k's inputs are its refreshed values
    changed from its donor, which the parent's exact answer rebuilds bit for bit; a tensor subclass or a torch mode
    left active after a timed call is refused (OutputRefused: ``tampered``), plain nested outputs are not."""
    for result in _run_ranks(_loop_rank, tmp_path):
        assert result["entropy_changes_values"] and result["same_entropy_same_values"], result
        assert result["later_slots_unchanged"] and result["own_slot_changed"], result
        assert result["rebuilt_inputs_equal"], result
        assert "timed call 0" in result["subclass"] and "subclass of torch.Tensor" in result["subclass"], result
        assert result["plain_structure"] == "accepted"
        assert "mode active" in result["mode"] and "1 and 0 after" in result["mode"], result


def test_a_change_block_is_an_eighth_of_the_rows_the_same_on_every_rank():
    blocks = {change_block((4096, 8), 77, call) for call in range(64)}
    assert all(dim == 0 and length == 4096 // CHANGE_SHARE and 0 <= start <= 4096 - length
               for dim, start, length in blocks)
    assert len({start for _, start, _ in blocks}) > 32  # drawn per call
    assert change_block((4096, 8), 77, 5) == change_block((4096, 8), 77, 5)  # no rank-local draw
    assert change_block((3, 683), 1, 0)[0] == 1 and change_block((), 1, 0) == (-1, 0, 1)
    assert change_block((0, 8), 1, 0) is None


def test_malformed_check_replies_are_the_candidates_mismatch_never_pkbs_failure():
    """What a candidate's rank sends in its checks is its word: summaries of any shape or type are a mismatch."""
    case = Case(name="odd")
    expected = GroupTiming(2, Draws(None, "allreduce", "odd"), summaries=[[[[[1.0, 0, 0.5], ["int", 3, 2]], [None]]]])
    for forged in ([["x", "y"], [None]], [[[float("nan"), 0, 0.5], ["int", 3, 2]], [None]], "text", [1], [[{}], [{}]]):
        got = GroupTiming(2, expected.draws, summaries=[[forged]])
        with pytest.raises(Verdict) as raised:
            _judged(lambda: check_every_call(expected, got, case), case)
        assert raised.value.status is Status.MISMATCH, raised.value.message
    assert not _same_summaries([[1.0, 0, 0.5]], [[float("inf"), 0, 0.5]])


def test_deferred_check_time_counts_beyond_the_reference_s():
    reference = GroupTiming(10, None, repeat_s=[1e-3] * 5, refresh_s=[0.01] * 5, check_s=[0.02] * 5, outputs_s=0.01)
    honest = GroupTiming(10, None, repeat_s=[1e-3] * 5, refresh_s=[0.01] * 5, check_s=[0.02] * 5, outputs_s=0.01)
    deferring = GroupTiming(10, None, repeat_s=[1e-4] * 5, refresh_s=[0.01] * 5, check_s=[0.05] * 5, outputs_s=0.01)
    assert honest.per_call_s(reference) == pytest.approx(1e-3)
    # 30 ms more per check than the reference's, less the allowance (1.2x its 20 ms and 2 ms), over 10 calls a repeat
    assert deferring.per_call_s(reference) == pytest.approx(1e-4 + (0.05 - 0.026) / 10)
    assert deferring.per_call_s(reference) > honest.per_call_s(reference)


# -- whole evaluations ------------------------------------------------------------------------------------------------


def _evaluate(sessions, path: Path, world_size: int = 2, cases: str = "tests"):
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, trials=1, upstream_trials=1, timeout=60.0, cases=cases,
                        perf=True)
    return evaluate(get_problem(path.name.split("__")[0]), Candidate.from_file(path), config, sessions(world_size))


@pytest.mark.parametrize("name, statuses, cases", [
    # hole 1: refresh values derived from seeds in the rank's memory, computed ahead in an untimed call
    ("allreduce__timing_precomputed_from_harness_seeds", (Status.MISMATCH, Status.TAMPERED), "tests"),
    # hole 2: every copy's all-reduce batched into the first call of a repeat
    ("allreduce__timing_batches_every_copy_in_first_call", (Status.MISMATCH, Status.TAMPERED), "tests"),
    # hole 3: a lazy tensor subclass (on buffers of 64 Ki elements and more: the upstream case; refused in the trials
    # too), or a subclass or a mode left active only while timed
    ("allreduce__timing_lazy_subclass_computed_at_check", (Status.MISMATCH, Status.TAMPERED), "upstream"),
    ("allreduce__timing_lazy_subclass_only_while_timed", (Status.TAMPERED,), "tests"),
    ("allreduce__timing_mode_left_active_while_timed", (Status.TAMPERED,), "tests"),
    # hole 4: lossy only while timed (in every repeat, or all but the last)
    ("allreduce__lossy_int8_only_while_timed", (Status.MISMATCH,), "tests"),
    ("allreduce__lossy_int8_while_timed_but_the_last_repeat", (Status.MISMATCH,), "tests"),
])
def test_a_candidate_that_looks_faster_only_while_timed_fails(name, statuses, cases, sessions):
    result = _evaluate(sessions, WRONG / f"{name}.py", cases=cases)
    assert result.status in statuses, (result.status, result.message)
    assert not result.timings  # no speedup is reported for it


def test_turning_the_output_check_off_is_tampering(tmp_path, sessions):
    """The check of each timed output is the loop's module function ``refusal``: a candidate that finds it through a
    frame's globals and replaces it (to return a lazy subclass unseen) has changed the harness (pkb.runtime.guards)."""
    path = tmp_path / "allreduce__turns_the_check_off.py"
    path.write_text(HONEST_ALLREDUCE.replace("def solution(tensor):", """import sys

def solution(tensor):
    frame = sys._getframe(1)
    while frame is not None and "refusal" not in frame.f_globals:
        frame = frame.f_back
    if frame is not None and frame.f_code.co_name == "repeat":
        frame.f_globals["refusal"] = lambda *args, **kwargs: None
        frame.f_globals["_described"] = lambda *args, **kwargs: None"""))
    result = _evaluate(sessions, path)
    assert result.status is Status.TAMPERED and "timing.refusal" in result.message, result.message


def test_an_honest_candidate_passes_with_every_case_timed(tmp_path, sessions):
    path = tmp_path / "allreduce__honest.py"
    path.write_text(HONEST_ALLREDUCE)
    result = _evaluate(sessions, path)
    assert result.status is Status.OK, result.message
    assert len(result.timings) == len(result.cases) and all(t.calls_per_repeat >= 2 for t in result.timings)
    assert all(0 < t.speedup < float("inf") for t in result.timings)


def test_the_change_before_each_call_writes_data_never_a_mask_other_inputs_agree_with(sessions):
    """moe_pre_all2all's inputs: hidden states (bf16) and an expert mask (fp32, one-hot) its split sizes agree with.
    The change took rows of the largest floating tensor, the mask, from another input set: the reference failed on
    the changed inputs ("Split sizes doesn't match") and every timing of the problem was pkb's failure
    (``harness_error``; found running upstream's files with --perf). A tensor of zeros and ones is left alone."""
    mask = torch.nn.functional.one_hot(torch.arange(60) % 3, 3).float()  # the larger tensor
    hidden = torch.randn(4, 5, dtype=torch.bfloat16)
    pair = donor_pair((hidden, mask, 3), (torch.randn(4, 5, dtype=torch.bfloat16), mask.flip(0), 3))
    assert pair is not None and pair[0].dtype == torch.bfloat16
    assert donor_pair((mask,), (mask.flip(0),)) is None  # nothing but a mask: nothing changes
    sparse = torch.randn(80, 3).to_sparse()  # torchharmonics' convolution: no rows to narrow (pkb's failure too)
    assert donor_pair((sparse, hidden), (sparse, torch.randn(4, 5, dtype=torch.bfloat16)))[0].dtype == torch.bfloat16
    problem = get_problem("moe_pre_all2all")
    result = evaluate(problem, Candidate.reference_of(problem), EvalConfig(world_size=2, mode=Mode.CPU, trials=1,
                                                                            perf=True, cases="tests"), sessions(2))
    assert result.status is Status.OK, result.message
