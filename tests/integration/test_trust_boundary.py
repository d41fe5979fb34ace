"""The trust boundary (issue 56; docs/threat-model.md, "The trust boundary"): nothing a candidate's process writes
decides its status or its time. Each attack below is a hostile candidate evaluated in cpu mode under the sandbox, at
W = 2 and 4: a forged reply on the rank's own reply channel at every job, words that name a missing GPU, outputs of
every odd dtype, a changed count of timed calls, skipped timed calls, a reply meant to exhaust the parent's memory,
a tensor subclass or a meta tensor as an output; each ends in a status counted as the candidate's failure (never
``harness_error`` or ``infra_error``; ``skipped`` only where its own code needs what the run lacks, and then
recorded as the candidate's: counted as not passed), or is timed as it really ran.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap

import pytest

from pathlib import Path

import torch

from pkb.evaluate import failures
from pkb.evaluate.candidate import Candidate, nvshmem_code
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.paper import _compared
from pkb.evaluate.verdicts import Verdict
from pkb.options import Status
from pkb.registry import get_problem
from pkb.report import metrics, records
from pkb.runtime.group import RankCrashed
from pkb.runtime.messages import RankFailure, RunReply, decode
from pkb.runtime.modes import Mode

ROOT = Path(__file__).resolve().parents[2]
NOT_THE_CANDIDATES = (Status.SKIPPED, Status.HARNESS_ERROR, Status.INFRA_ERROR, Status.OK)

# Finds the rank's reply channel (a local of pkb.runtime.worker.worker_main, reachable through the stack's frames)
# and writes a reply of its own on it, framed as the rank's channel frames one (torch.save bytes).
FORGER = '''
import io, sys
import torch
import torch.distributed as dist

def forge(reply):
    frame = sys._getframe()
    while frame is not None and "conn" not in frame.f_locals:
        frame = frame.f_back
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    frame.f_locals["conn"].send_bytes(buffer.getbuffer())
'''


def evaluate_source(tmp_path, sessions, body: str, world_size: int = 2, problem: str = "allreduce", **config):
    path = tmp_path / f"{problem}_hostile.py"
    path.write_text(textwrap.dedent(body))
    settings = dict(world_size=world_size, mode=Mode.CPU, trials=1, upstream_trials=1, timeout=60.0, cases="tests")
    return evaluate(get_problem(problem), Candidate.from_file(path), EvalConfig(**{**settings, **config}),
                    sessions(world_size))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("forged", ["skipped", "harness_error", "infra_error", "ok"])
@pytest.mark.parametrize("when", ["load", "run"])
def test_a_forged_reply_never_chooses_a_status_that_is_not_the_candidates_failure(forged, when, world_size, tmp_path,
                                                                                  sessions):
    """The parent takes a rank's word for what went wrong only where it is a failure of the candidate's anyway;
    ``skipped``, ``harness_error``, ``infra_error`` (or ``ok`` with an error) from a rank is a runtime error."""
    forge = f'forge({{"status": "{forged}", "error": "pkb failed, not the candidate (forged)"}})'
    body = FORGER + (f"{forge}\n\ndef solution(tensor):\n    return tensor.clone()\n" if when == "load" else
                     f"def solution(tensor):\n    {forge}\n    return tensor.clone()\n")
    result = evaluate_source(tmp_path, sessions, body, world_size)
    assert result.status not in NOT_THE_CANDIDATES, result.message
    assert result.status.is_verdict and result.upstream_ok in (False, None)


@pytest.mark.parametrize("field", ["error", "status", "collectives_used", "outputs"])
def test_a_reply_with_any_object_in_any_field_is_the_candidates_failure(field, tmp_path, sessions):
    """Handling a reply is total: a tensor where text belongs, or where a list belongs, gives the candidate's failure,
    never an exception inside pkb (``harness_error``)."""
    result = evaluate_source(tmp_path, sessions, FORGER + f"""
def solution(tensor):
    reply = {{"status": "ok", "outputs": [tensor], "inputs_after": [tensor]}}
    reply[{field!r}] = torch.zeros(3)
    forge(reply)
    return tensor.clone()
""")
    assert result.status not in NOT_THE_CANDIDATES, result.message


def test_words_that_name_a_missing_gpu_do_not_make_a_failure_skipped(tmp_path, sessions):
    """``skipped`` comes from facts the parent holds (the mode, what the source declares or holds), never from the
    text of an error: a pure-PyTorch file that raises "No CUDA GPUs are available" in cpu mode has failed."""
    result = evaluate_source(tmp_path, sessions, '''
        def solution(tensor):
            raise RuntimeError("No CUDA GPUs are available; CUDA out of memory. Tried to allocate 2.00 GiB")
    ''')
    assert result.status is Status.RUNTIME_ERROR, result.message
    declared = evaluate_source(tmp_path, sessions, '''
        REQUIRES = ("cuda",)
        def solution(tensor):
            return tensor.clone()
    ''')
    assert declared.status is Status.SKIPPED and "declares REQUIRES" in declared.message  # the candidate's word that counts


@pytest.mark.parametrize("dtype", ["bits8", "qint8", "uint16", "complex32", "float8_e5m2", "bool"])
def test_an_output_of_any_dtype_is_judged_by_both_verdicts(dtype, tmp_path, sessions):
    """A right-shaped output of an odd dtype is a mismatch on pkb's verdict and fails the paper's (upstream's
    ``.float()`` raises on some: the trial fails, as upstream's would), never pkb's own failure."""
    make = {"qint8": "torch.quantize_per_tensor(tensor.float(), 1.0, 0, torch.qint8)",
            "bits8": "torch.zeros(tensor.shape, dtype=torch.uint8).view(torch.bits8)"}.get(
        dtype, f"tensor.to(torch.{dtype})")
    result = evaluate_source(tmp_path, sessions, f'''
        import torch
        import torch.distributed as dist

        def solution(tensor):
            out = tensor.clone()
            dist.all_reduce(out)
            return {make}
    ''', cases="all")
    assert result.status is Status.MISMATCH and result.upstream_ok is False, result.message


def test_a_reply_meant_to_exhaust_the_parents_memory_is_refused_unread(tmp_path, sessions):
    """A reply far larger than the reference's (here 256 MiB for an output of kilobytes) is refused before it is
    decoded: the candidate's failure (``crash``), the parent's memory untouched."""
    result = evaluate_source(tmp_path, sessions, '''
        import torch

        def solution(tensor):
            return torch.zeros(64 << 20, dtype=torch.float32)
    ''')
    assert result.status is Status.CRASH and "pkb does not accept" in result.message, result.message


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_count_of_timed_calls_is_the_parents(world_size, tmp_path, sessions):
    """The attack of issue 56: an honest all-reduce that, found through the garbage collector, sets the timed loop's
    count of calls to 1 (the parent divided its clock by the count the rank reported). The count is now the parent's,
    sent with every repeat and held in no attribute the candidate can change: the attack times as the honest file."""
    honest = '''
        import torch
        import torch.distributed as dist

        def solution(tensor):
            out = tensor.clone()
            dist.all_reduce(out)
            return out
    '''
    attack = honest.replace("def solution(tensor):", '''import gc

        def solution(tensor):
            for loop in gc.get_objects():
                if type(loop).__name__ == "TimedLoop":
                    for name in ("num_iters", "num_calls", "calls"):
                        setattr(loop, name, 1)''')
    plain = evaluate_source(tmp_path, sessions, honest, world_size, perf=True)
    attacked = evaluate_source(tmp_path, sessions, attack, world_size, perf=True)
    assert plain.status is Status.OK, plain.message
    assert attacked.status in (Status.OK, Status.TAMPERED), attacked.message
    # ok means every timed call ran on its own inputs (the projections after every repeat: the next test), so the
    # parent's clock over the parent's count is the time per call; the rank's setattr changed nothing it uses
    assert all(timing.calls_per_repeat >= 2 for timing in attacked.timings)
    print(f"W = {world_size}: speedup {attacked.speedup:.2f}x with the attack, {plain.speedup:.2f}x without (cpu mode: "
          "not GPU performance; 2.1-4.2x with the attack before the fix)")


def test_a_timed_call_that_does_not_run_is_tampering(tmp_path, sessions):
    """Skipping the work of a timed call (returning the last answer computed for the same input tensor, a cache keyed
    on its address, only inside a timed repeat: every correctness trial is honest) leaves the copy's output on the
    previous repeat's values: the parent's projections, chosen after the repeat, find it."""
    result = evaluate_source(tmp_path, sessions, '''
        import sys

        import torch
        import torch.distributed as dist

        _answers = {}

        def _timed():
            frame = sys._getframe(2)
            while frame is not None:
                if frame.f_code.co_name == "repeat" and type(frame.f_locals.get("self")).__name__ == "TimedLoop":
                    return True
                frame = frame.f_back
            return False

        def solution(tensor):
            timed = _timed()
            key = tensor.data_ptr()
            if timed and key in _answers:
                return _answers[key]
            out = tensor.clone()
            dist.all_reduce(out)
            if timed:
                _answers[key] = out
            return out
    ''', perf=True)
    assert result.status is Status.TAMPERED, result.message
    assert "did not run" in result.message and "timed repeat 2" in result.message, result.message


def test_a_hang_costs_one_timeout_and_shows_where_it_hung(tmp_path, sessions):
    """A solution that never returns: found once (the paper's verdict's trial), both verdicts take it from there, and
    the message shows the hung ranks' own line."""
    result = evaluate_source(tmp_path, sessions, '''
        def solution(tensor):
            while True:
                tensor = tensor + 0
    ''', cases="all", timeout=5.0)
    assert result.status is Status.TIMEOUT and result.upstream_ok is False, result.message
    assert result.wall_s < 5.0 + 8.0, result.wall_s
    assert re.search(r"rank 0 was at allreduce_hostile\.py:[34] in solution", result.message), result.message
    assert result.details.stacks and all("solution" in stack for stack in result.details.stacks.values())


# -- a skip the candidate causes, a value pkb cannot judge (the red team's status holes) ----------------------------

WRONG = Path(__file__).resolve().parents[1] / "candidates" / "integrity" / "wrong"


def counted_as_not_passed(result) -> bool:
    """Whether the reports count ``result`` in pass@k's n and not passed (pkb.report.metrics) on pkb's protocol, and
    on the paper's too where its verdict is known (a run of the tests cases alone leaves it unknown)."""
    record = records.Record("1", 1, "set", "sample", "collectives", result, records.Code(None, "none"),
                            paper_status=records.paper_status(result, frozenset({"upstream"})))
    return all(metrics.counted(record, protocol) and record.verdict(protocol) is not Status.OK
               for protocol in records.PROTOCOLS if protocol == "pkb" or record.verdict(protocol) is not None)


def test_a_failure_that_code_needing_a_gpu_turns_into_skipped_counts_as_not_passed(tmp_path, sessions):
    """allreduce__skipped_by_dead_cuda_code: ``x.cuda()`` on a path a CPU tensor never takes, then a plain give-up.
    The parent still calls it ``skipped`` (its source needs a GPU: a fact it reads, not the error's words), but a skip
    the candidate's code causes is recorded as its own and counted as not passed; before, it left pass@k's n."""
    result = evaluate_source(tmp_path, sessions, (WRONG / "allreduce__skipped_by_dead_cuda_code.py").read_text())
    assert result.status is Status.SKIPPED and result.details.skipped_by == "candidate", result.message
    assert "counted as not passed" in result.message and counted_as_not_passed(result)


def test_nvshmem_named_in_a_comment_or_docstring_is_no_use_of_it(tmp_path, sessions):
    """hierarchical_allreduce__skipped_by_nvshmem_in_a_comment, at W = 2 on one node: the word in comments and
    docstrings made any runtime error ``skipped`` (a regex over the raw source). The parser reads code only: the
    failure is the runtime error it is."""
    result = evaluate_source(tmp_path, sessions, '''
        """Uses NVSHMEM (nvshmem_putmem, #include <nvshmem.h>): only words here."""
        # nvshmem_ptr(...) would go here

        def solution(tensor):
            """nvshmemx_barrier_all"""
            raise RuntimeError("gave up")
    ''')
    assert result.status is Status.RUNTIME_ERROR, result.message
    assert counted_as_not_passed(result)


def test_nvshmem_is_read_from_code_imports_names_and_cuda_source_in_strings():
    uses = {"import nvshmem.core\n": "imports nvshmem.core",
            "from torch.distributed import _symmetric_memory as sm\nsm.set_backend('NVSHMEM')\n": "'NVSHMEM'",
            "SRC = '#include <nvshmem.h>\\n__global__ void k(float* p) { nvshmem_float_p(p, 1.0f, 0); }'\n": "nvshmem",
            "def f(t):\n    return t.nvshmem_ptr\n": "names nvshmem_ptr"}
    for source, said in uses.items():
        assert said in (nvshmem_code(source) or ""), source
    for source in ("# nvshmem_putmem\nx = 1\n", '"""NVSHMEM: nvshmem_ptr, nvshmem.h"""\n',
                   "def f():\n    raise RuntimeError('no nvshmem here')\n"):
        assert nvshmem_code(source) is None, source


@pytest.mark.parametrize("full", ["GPU 0: 79.2 of 79.6 GiB used", ""])
def test_a_failure_while_the_shared_gpu_is_full_is_a_skip_the_candidate_caused(full, monkeypatch, tmp_path):
    """allreduce__skipped_by_filling_the_shared_gpu (shared-gpu mode, not run here: no GPU): a candidate that fills
    the GPU the ranks share and then fails. The parent reads the GPU's fill, not who filled it, so the failure is
    ``skipped`` (pkb's memory limit, rerun alone by the executor); it is recorded as the candidate's skip (it cannot
    be told to pass: counted as not passed, with what to run instead). With the GPU not full it is the failure it is.
    The decision, from the parent's facts, with the driver's answer stubbed."""
    path = tmp_path / "allreduce_fill.py"
    path.write_text((WRONG / "allreduce__skipped_by_filling_the_shared_gpu.py").read_text())
    facts = failures.Facts(Mode.SHARED_GPU, Candidate.from_file(path))
    monkeypatch.setattr(failures, "_full_gpus", lambda: full)
    with pytest.raises(Verdict) as raised:
        failures.raise_failure([RankFailure("runtime_error", "RuntimeError: cannot finish")] * 2, facts,
                               {"case": "odd", "trial": 0})
    with pytest.raises(Verdict) as crashed:
        with failures.candidate_failures("case odd", facts, case="odd", trial=0):
            raise RankCrashed("rank 1 died (signal 9)", rank=1)
    if full:
        for verdict in (raised.value, crashed.value):
            assert verdict.status is Status.SKIPPED and verdict.details["skipped_by"] == "candidate"
            assert "memory" in verdict.details["pkb_limits"] and "counted as not passed" in verdict.message
            assert "--mode cuda" in verdict.message
    else:
        assert (raised.value.status, crashed.value.status) == (Status.RUNTIME_ERROR, Status.CRASH)


def test_a_tensor_subclass_output_is_a_mismatch_that_says_to_return_a_plain_tensor(tmp_path, sessions):
    """allreduce__harness_error_by_meta_tensor_output: a subclass whose ``detach()`` hands the rank's ``to_plain`` an
    object that ends as a meta tensor, which reached the paper's comparison and made pkb fail (``harness_error``).
    The rank now sends a subclass as what it is, never asking it for its values: a mismatch on both verdicts."""
    source = (WRONG / "allreduce__harness_error_by_meta_tensor_output.py").read_text()
    result = evaluate_source(tmp_path, sessions, source, cases="all")
    assert result.status is Status.MISMATCH and result.upstream_ok is False, result.message
    assert "return a plain torch.Tensor (got _Lazy)" in result.message, result.message


def test_a_meta_tensor_output_is_a_mismatch_on_both_verdicts(tmp_path, sessions):
    result = evaluate_source(tmp_path, sessions, '''
        import torch

        def solution(tensor):
            return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    ''', cases="all")
    assert result.status is Status.MISMATCH and result.upstream_ok is False, result.message
    assert "got a meta tensor" in result.message, result.message


@pytest.mark.parametrize("when", ["run", "time_outputs"])
def test_a_reply_holding_a_tensor_that_is_not_plain_strided_cpu_is_refused(when, tmp_path, sessions):
    """The parent's side of the boundary (``messages.decode``): whatever the rank's ``to_plain`` did (here the
    candidate makes every ``clone`` give a meta tensor: in the checked run, or only while the timed outputs are sent,
    where ``check_timed_outputs`` met it outside any handler), a reply holding a tensor that is not a plain, strided
    cpu tensor is malformed: the candidate's failure, never a value a comparison meets."""
    result = evaluate_source(tmp_path, sessions, f'''
        import sys

        import torch
        import torch.distributed as dist

        _clone = torch.Tensor.clone

        def _sending():
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_name == "to_plain" and (
                        {when!r} == "run" or any(f.f_code.co_name == "time_outputs" for f in _stack(frame))):
                    return True
                frame = frame.f_back
            return False

        def _stack(frame):
            while frame is not None:
                yield frame
                frame = frame.f_back

        def _meta_when_sent(self, *args, **kwargs):
            if _sending():
                return torch.empty(self.shape, dtype=self.dtype, device="meta")
            return _clone(self, *args, **kwargs)

        torch.Tensor.clone = _meta_when_sent

        def solution(tensor):
            out = _clone(tensor)
            dist.all_reduce(out)
            return out
    ''', perf=when == "time_outputs")
    assert result.status not in NOT_THE_CANDIDATES, result.message
    assert result.status is Status.TAMPERED or "not a strided cpu tensor" in result.message, result.message
    print(f"{when}: {result.status.value}: {result.message[:300]}")


def test_to_plain_sends_a_subclass_as_what_it_is_without_asking_it_for_values():
    """The rank's side: a tensor subclass is never asked for its values (its ``detach`` is the candidate's code); an
    ``nn.Parameter`` (torch's own, what a training step returns) is sent as its values, a sparse tensor as its dense
    values."""
    from pkb.runtime.channel import to_plain

    asked = []

    class Lazy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            asked.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    lazy = torch.Tensor._make_subclass(Lazy, torch.ones(3))
    asked.clear()
    sent = to_plain({"out": [lazy, torch.nn.Parameter(torch.full((2,), 2.0)), torch.eye(2).to_sparse()]})
    assert sent["out"][0] == {"__unsupported__": "return a plain torch.Tensor (got Lazy)"} and not asked
    assert type(sent["out"][1]) is torch.Tensor and sent["out"][1].tolist() == [2.0, 2.0]
    assert type(sent["out"][2]) is torch.Tensor and sent["out"][2].layout == torch.strided
    assert to_plain(torch.empty(2, device="meta")) == {"__unsupported__": "return a tensor with values (got a meta tensor)"}
    # torch's AsyncCollectiveTensor (an unwaited functional collective; DTensor's to_local after RowwiseParallel, as
    # tests/candidates/integrity/honest/gemm_allreduce__dtensor_rowwise_parallel.py returns) is sent as its values,
    # unless what it holds is itself a subclass
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    assert to_plain(AsyncCollectiveTensor(torch.ones(2))).tolist() == [1.0, 1.0]
    holds_lazy = AsyncCollectiveTensor(lazy)
    asked.clear()
    assert to_plain(holds_lazy) == {"__unsupported__": "return a plain torch.Tensor (got AsyncCollectiveTensor)"}
    assert not asked


def test_decode_refuses_any_tensor_that_is_not_plain_strided_cpu():
    for bad in (torch.empty(2, device="meta"), torch.nn.Parameter(torch.ones(2)), torch.ones(2).to_sparse()):
        reply = decode({"status": "ok", "outputs": [{"x": (bad,)}], "inputs_after": []}, RunReply)
        assert isinstance(reply, RankFailure) and reply.said == "malformed", reply
    assert isinstance(decode({"status": "ok", "outputs": [torch.ones(2)], "inputs_after": []}, RunReply), RunReply)


def test_the_papers_comparison_turns_any_exception_into_the_candidates_mismatch():
    """``upstream_compare`` on a value that makes it raise (a meta tensor: no truth value) is the candidate's mismatch
    (``_paper_trial`` ran it outside any handler: ``harness_error``)."""
    mismatch = _compared(torch.ones(3), torch.empty(3, device="meta"))
    assert mismatch is not None and "could not judge" in mismatch.reason, mismatch


def test_a_reference_that_fails_beside_the_candidate_but_passes_alone_is_the_candidates_doing(tmp_path, sessions,
                                                                                                monkeypatch):
    """The candidate's processes share the machine with the reference's (in GPU modes the devices and their memory):
    a reference that fails while they run beside it runs again alone, in new processes. Passing alone, the first
    failure is the candidate's doing (never ``harness_error``, which a candidate could otherwise cause at will);
    failing alone too, it is pkb's."""
    from pkb.evaluate.session import ReferenceOutputs
    from pkb.runtime.group import RankGroup

    real_collect = RankGroup.collect
    failures_left = {"count": 1}

    def starved(group, *args, **kwargs):
        if group.role == "reference" and RunReply in args and failures_left["count"]:
            failures_left["count"] -= 1
            group.kill()
            raise RankCrashed("the reference's rank 0 died (out of memory, as if the candidate held it)", 0)
        return real_collect(group, *args, **kwargs)

    monkeypatch.setattr(RankGroup, "collect", starved)
    sessions(2).reference_outputs = ReferenceOutputs()  # nothing kept: the reference runs
    result = evaluate_source(tmp_path, sessions, '''
        import torch
        import torch.distributed as dist

        def solution(tensor):
            out = tensor.clone()
            dist.all_reduce(out)
            return out
    ''')
    assert result.status is Status.RUNTIME_ERROR and "passed alone" in result.message, result.message
    failures_left["count"] = 10**6  # now the reference fails alone too: pkb's own failure
    sessions(2).reference_outputs = ReferenceOutputs()
    again = evaluate_source(tmp_path, sessions, "def solution(tensor):\n    return tensor.clone()\n")
    assert again.status is Status.HARNESS_ERROR, again.message


def test_a_reference_whose_exact_answer_to_a_timed_call_fails_beside_the_candidate_is_run_alone(tmp_path, sessions,
                                                                                                monkeypatch):
    """The exact answer to a timed call is computed while the candidate's processes are alive (their timed outputs are
    judged before they end): the same rule as the trials', which that path lacked (a red-team of issue 56: a failure
    there was ``harness_error``, left out of n and evaluated again, so a candidate that holds a shared GPU's memory
    after its last repeat never got a verdict). Passing alone, the failure is the candidate's doing."""
    from pkb.runtime.group import RankGroup

    real_request = RankGroup.request
    failures_left = {"count": 1}

    def starved(group, jobs, *args, **kwargs):
        if group.role == "reference" and jobs and jobs[0].get("op") == "time_exact" and failures_left["count"]:
            failures_left["count"] -= 1
            return [RankFailure("runtime_error", "torch.OutOfMemoryError: CUDA out of memory (as if the candidate "
                                                 "held it)") for _ in jobs]
        return real_request(group, jobs, *args, **kwargs)

    monkeypatch.setattr(RankGroup, "request", starved)
    one_step_off = '''
        import torch
        import torch.distributed as dist

        def solution(tensor):  # an honest sum whose first value is one step off (another order's rounding): not
            out = tensor.clone()  # the reference's bit for bit, so its timed outputs are judged by the exact answer
            dist.all_reduce(out)
            flat = out.view(-1)
            if flat.numel():
                flat[:1].view(torch.int16 if out.element_size() == 2 else torch.int32).add_(1)
            return out
    '''
    result = evaluate_source(tmp_path, sessions, one_step_off, perf=True)
    assert failures_left["count"] == 0, "no exact answer to a timed call was asked for: the test tests nothing"
    assert result.status is Status.RUNTIME_ERROR and "passed alone" in result.message, result.message
    assert "timed call" in result.message, result.message


def test_an_idle_helper_thread_is_not_waited_for_and_an_honest_file_with_one_is_timed_as_it_runs(tmp_path, sessions):
    """An honest all-reduce with a helper thread that waits on a queue for jobs that never come (a common pattern,
    using no CPU): the end of its timing waited the whole minute for the thread, charged it to the candidate and then
    called the candidate ``tampered`` (its ranks' clock far below the parent's; a red-team of issue 56). A thread
    that uses no CPU is blocked, not working: the end no longer waits for it."""
    result = evaluate_source(tmp_path, sessions, '''
        import queue
        import threading

        import torch
        import torch.distributed as dist

        _jobs = queue.Queue()
        _helper = None

        def _serve():
            while True:
                _jobs.get()()

        def solution(tensor):
            global _helper
            if _helper is None:
                _helper = threading.Thread(target=_serve, daemon=True, name="helper")
                _helper.start()
            out = tensor.clone()
            dist.all_reduce(out)
            return out
    ''', perf=True)
    assert result.status is Status.OK, result.message
    assert result.wall_s < 60.0, result.wall_s
    assert all(0.2 < timing.speedup < 5.0 for timing in result.timings), [t.speedup for t in result.timings]


DEFERS_THE_TIMED_WORK = '''
    import sys
    import threading
    import time

    import torch
    import torch.distributed as dist

    _pending = []
    _installed = []

    def _drain():
        if not _pending:
            return
        outs = list(_pending)
        del _pending[:]
        flat = torch.cat([o.reshape(-1) for o in outs])
        dist.all_reduce(flat)  # every timed call's all-reduce at once, after the repeat
        at = 0
        for o in outs:
            o.view(-1).copy_(flat[at:at + o.numel()])
            at += o.numel()

    def _profile(frame, event, arg):
        if event == "call" and _pending and frame.f_code.co_name in ("summarise", "check", "outputs_of", "_call"):
            _drain()

    def _later():
        while True:
            time.sleep(0.002)
            if _pending:
                time.sleep(0.003)  # the repeat's reply has gone: the parent's clock has stopped
                _drain()

    def _in_timed_repeat():
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "repeat" and frame.f_code.co_filename.endswith("timed_loop.py"):
                return True
            frame = frame.f_back
        return False

    def solution(tensor):
        if not _installed:
            if ROUTE == "hook":
                sys.setprofile(_profile)
            else:
                threading.Thread(target=_later, daemon=True).start()
            _installed.append(1)
        out = tensor.clone()
        if _in_timed_repeat():
            _pending.append(out)  # returned before its all-reduce is done
        else:
            _drain()
            dist.all_reduce(out)
        return out
'''


# A red-team's fourth round: the sealed slots' all-reduce at once while the seal runs (a profile hook set on a repeat's
# last call reads the seal's draws as they are made), every other call's after the clock, the hook gone before the
# check: `ok` at 4.6x an honest file's speedup (cpu) until a hook set during the timed calls was refused at each call.
READS_THE_SEAL_AS_IT_IS_DRAWN = '''
import sys
import torch
import torch.distributed as dist

_pending = []      # outputs whose all-reduce is deferred
_state = {"armed": False}
_TL = "timed_loop.py"


def _reduce(outs):
    if not outs:
        return
    flat = torch.cat([o.reshape(-1) for o in outs])
    dist.all_reduce(flat)
    at = 0
    for o in outs:
        n = o.numel()
        o.view(-1).copy_(flat[at:at + n])
        at += n


def _drain():
    outs = list(_pending)
    del _pending[:]
    _reduce(outs)


def _seal_slots(keys, outputs):
    slots = sorted(sorted(range(len(outputs)), key=keys.__getitem__)[:8])
    mine = torch.full((8,), -1, dtype=torch.int64)
    mine[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    union = sorted({int(s) for g in got for s in g.tolist() if s >= 0})
    outs = [outputs[s] for s in union]
    ids = {id(o) for o in outs}
    _pending[:] = [o for o in _pending if id(o) not in ids]
    _reduce(outs)


def _profile(frame, event, arg):
    if event == "return" and _state["armed"] and frame.f_code.co_name == "_random_below" \\
            and frame.f_back is not None and frame.f_back.f_code.co_name == "_seal":
        _state["armed"] = False
        _seal_slots(arg, frame.f_back.f_locals["outputs"])
    elif event == "call" and frame.f_code.co_name in ("time_check", "outputs_of", "check", "time_finish",
                                                      "time_outputs", "time_refresh"):
        sys.setprofile(None)
        _drain()


def _repeat_frame():
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        if f.f_code.co_name == "repeat" and f.f_code.co_filename.endswith(_TL):
            return f
        f = f.f_back
    return None


def solution(tensor):
    out = tensor.clone()
    rf = _repeat_frame()
    if rf is not None:
        _pending.append(out)
        loc = rf.f_locals
        if loc.get("call") == loc.get("num_calls", -5) - 1:
            _state["armed"] = True
            sys.setprofile(_profile)
    else:
        _drain()
        dist.all_reduce(out)
    return out
'''


@pytest.mark.parametrize("route", ["hook", "thread", "seal"])
def test_work_done_after_a_timed_repeat_has_ended_is_tampering(route, tmp_path, sessions):
    """A red-team of issue 56 (helper, third round): each timed call returned its input's clone and a profile hook, set
    off when the harness began checking the repeat's outputs, ran every call's all-reduce at once (a thread after the
    repeat's reply does the same): correct outputs by the time they were read, the work after the parent's clock had
    stopped and within the check's allowance, 7.7x an honest file's speedup (cpu). Each repeat's outputs are now
    sealed at its end, at places drawn then, and a hook set during the calls is refused: ``tampered``."""
    source = (READS_THE_SEAL_AS_IT_IS_DRAWN if route == "seal"
              else textwrap.dedent(DEFERS_THE_TIMED_WORK).replace("ROUTE", repr(route)))
    result = evaluate_source(tmp_path, sessions, source, perf=True)
    if route == "thread" and result.status is Status.MISMATCH:  # the thread lost its race with the check: it read the
        assert "timed repeat" in result.message, result.message  # outputs before they were done, a failure as well
        return
    assert result.status is Status.TAMPERED, (result.status, result.message, [t.speedup for t in result.timings])
    assert "after its timed repeat had ended" in result.message or "hook was set" in result.message, result.message


def test_reading_a_file_leaves_no_access_time_for_another_evaluation(tmp_path, sessions):
    """A red-team of issue 56 (third round): with `relatime`, reading a file last read over a day ago sets its access
    time, which a later evaluation under another uid read back (one bit a file: evaluation 1 read chosen files of
    zoneinfo, evaluation 2 saw which). Under the mount namespace every mount of the sandbox is `noatime`."""
    result = evaluate_source(tmp_path, sessions, '''
        def solution(tensor):
            seen = [line.split()[4:6] for line in open("/proc/self/mountinfo").read().splitlines()]
            raise RuntimeError("MOUNTS " + repr(seen))
    ''', cases="tests")
    if "mount-namespace" not in (result.details.sandbox or {}).get("enforced", []):
        pytest.skip("no mount namespace here (pkb is not root)")
    said = next(line for line in result.details.error.splitlines() if "MOUNTS " in line)
    mounts = dict(ast.literal_eval(said[said.index("MOUNTS ") + 7:]))
    assert "noatime" in mounts["/"].split(","), mounts["/"]
    # the mounts a candidate reads from (where Python and pkb live): no read of theirs leaves a mark
    read_from = [point for point in mounts if any(Path(where).is_relative_to(point) for where in (sys.prefix, ROOT))]
    assert read_from and all("noatime" in mounts[point].split(",") for point in read_from), mounts
