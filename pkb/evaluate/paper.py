"""The paper's verdict (``upstream_ok``): upstream's own inputs and upstream's own rule, exactly, errors included.

``upstream_compare`` is the upstream benchmark's rule (``outputs_match_rank_outputs`` in its
``utils/problem_id.py``): containers by their layout, tensors by shape then ``torch.allclose(ref.float(),
sol.float(), atol=1e-2, rtol=1e-2)``, anything else by ``==``; an exception in the comparison fails the trial, as it
fails upstream's run (the candidate's mismatch, never pkb's failure: ``_compared``). ``judge_paper`` runs upstream's
values of the upstream cases (``Problem.upstream_values``) for ``config.upstream_trials`` trials and stops at the
first that fails, as upstream does. It reproduces the paper: it is never patched, may fail an answer more accurate
than the reference and pass a wrong one (docs/paper-protocol.md), and its message says so in numbers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from pkb.evaluate.compare import Mismatch, kind, unravel
from pkb.evaluate.ranks import Ranks
from pkb.evaluate.verdicts import Verdict
from pkb.options import Status
from pkb.problem import Case
from pkb.protocol import UPSTREAM_ATOL, UPSTREAM_RTOL

UPSTREAM_RULE = f"allclose atol={UPSTREAM_ATOL:g} rtol={UPSTREAM_RTOL:g} against the reference's outputs"


@dataclass
class PaperVerdict:
    """The paper's verdict on one candidate: ``ok`` (None where no upstream case was checked), the trial that failed
    and why, and a ``timeout`` that pkb's verdict takes as its own (a hang is found once per evaluation)."""

    ok: bool | None = None
    trials: int = 0
    trials_in_new_processes: int = 0
    failed: dict | None = None
    timeout: Verdict | None = None

    def to_dict(self) -> dict:
        found = {"rule": f"upstream's outputs_match_rank_outputs: {UPSTREAM_RULE}",
                 "inputs": "upstream's (its constants and seeds)", "trials": self.trials,
                 "trials_in_new_processes": self.trials_in_new_processes}
        return {**found, "failed": self.failed} if self.failed else found


def judge_paper(ranks: Ranks, cases: tuple[Case, ...]) -> PaperVerdict:
    """The paper's verdict on the upstream ``cases``: upstream's values (its constants, its seeds, its draws) for
    ``config.upstream_trials`` trials, every rank's outputs against the reference's by upstream's rule; the first
    trial that fails decides, as upstream stops at it. Never raises for the candidate: a crash or an error fails this
    verdict alone, and pkb's goes on in new processes; a timeout is kept (``PaperVerdict.timeout``) for pkb's.

    Upstream runs each trial in new processes. Here the trials share the candidate's processes, so a trial that
    fails after the processes' first call is run again in new ones (the same inputs), and that run decides, as it
    would upstream (a timeout is not run again: it would cost another)."""
    verdict = PaperVerdict(trials=ranks.config.upstream_trials)
    for trial in range(ranks.config.upstream_trials):
        for case in cases:
            fresh = ranks.fresh
            failure = _paper_trial(ranks, case, trial)
            if failure is not None and not fresh and failure.status is not Status.TIMEOUT:
                verdict.trials_in_new_processes += 1
                failure = _paper_trial(ranks, case, trial, renew=True)
            if failure is not None:
                verdict.ok = False
                verdict.failed = {"case": case.name, "trial": trial, "status": failure.status.value,
                                  "reason": failure.message}
                verdict.timeout = failure if failure.status is Status.TIMEOUT else None
                return verdict
    verdict.ok = True
    return verdict


def _paper_trial(ranks: Ranks, case: Case, trial: int, renew: bool = False) -> Verdict | None:
    """Why one trial of an upstream case fails upstream's rule (a mismatch, or what the candidate's processes
    earned), or None. ``renew``: in new processes."""
    try:
        if renew:
            ranks.renew()
        replies = ranks.run_upstream(case, trial)
    except Verdict as verdict:
        ranks.close()  # its processes may be dead or stuck: the next step starts new ones
        return verdict
    for rank in range(ranks.config.world_size):
        mismatch = _compared(replies.expected[rank].outputs, replies.got[rank].outputs)
        if mismatch is not None:
            return Verdict(Status.MISMATCH, f"upstream's inputs, trial {trial}: rank {rank}, case {case.name}: "
                                            f"{mismatch.describe()}", rank=rank, mismatch=mismatch.to_dict())
    return None


def _compared(expected: Any, got: Any) -> Mismatch | None:
    """``upstream_compare``, where any exception the candidate's data raises in it is that data's mismatch (as it
    fails upstream's run), never pkb's failure (``harness_error``): e.g. a value no comparison can read."""
    try:
        return upstream_compare(expected, got)
    except Exception as exc:  # noqa: BLE001 - the candidate's data made the comparison fail: its failure
        return Mismatch("out", f"an output pkb could not judge by upstream's rule ({type(exc).__name__}: "
                               f"{str(exc)[:200]})")


def upstream_compare(expected: Any, got: Any, path: str = "out") -> Mismatch | None:
    """The first difference under the upstream benchmark's verdict rule, or None.

    Containers: tuples and lists alike (already lists here), dicts by their key sets. Tensors: the same
    shape, then ``torch.allclose(ref.float(), sol.float(), atol=1e-2, rtol=1e-2)``: dtypes are not
    compared, the relative term scales with the solution's value, any NaN fails, and ``.float()`` keeps
    only the real part of a complex tensor. Any other leaf: ``ref == sol``. Inputs after the call are not
    part of the rule. Where upstream's comparison would raise (a dtype ``.float()`` refuses, a comparison that
    fails), the trial fails, as upstream's run does.
    """
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        if got.shape != expected.shape:
            return Mismatch(path, f"expected shape {list(expected.shape)}, got {list(got.shape)}")
        return _upstream_allclose(expected, got, path)
    if isinstance(expected, dict) and isinstance(got, dict):
        if set(got) != set(expected):
            return Mismatch(path, f"expected keys {sorted(expected)}, got {sorted(map(str, got))}")
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
        return Mismatch(path, f"expected {kind(expected)}, got {kind(got)}")
    try:
        if bool(expected == got):
            return None
    except Exception:  # noqa: BLE001 - upstream's rule: a comparison that raises is a mismatch
        pass
    return Mismatch(path, f"expected {expected!r:.80}, got {got!r:.80}")


def _upstream_allclose(expected: torch.Tensor, got: torch.Tensor, path: str) -> Mismatch | None:
    try:
        if expected.dtype == got.dtype and torch.equal(expected, got):
            return None  # equal values hold no NaN (NaN is never equal), so allclose passes: at memory speed
    except RuntimeError:  # a dtype without equality: upstream's .float() below decides
        pass
    try:
        with warnings.catch_warnings():  # .float() of a complex tensor warns that it drops the imaginary part
            warnings.simplefilter("ignore")
            e, g = expected.float().reshape(-1), got.float().reshape(-1)
    except Exception as exc:  # noqa: BLE001 - a dtype .float() refuses: upstream's comparison raises, the trial fails
        return Mismatch(path, f"upstream's rule cannot compare a {got.dtype} tensor ({type(exc).__name__}: "
                              f"{str(exc)[:120]})")
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
    return Mismatch(path, f"{int(bad.sum())} of {e.numel()} elements off (atol={UPSTREAM_ATOL:g}, "
                          f"rtol={UPSTREAM_RTOL:g}); largest abs error {float(diff[worst]):.4g}",
                    int(bad.sum()), e.numel(), float(diff[worst]), unravel(worst, shape), float(rel[worst_rel]),
                    unravel(worst_rel, shape), float(e[worst]), float(g[worst]), UPSTREAM_ATOL, UPSTREAM_RTOL)
