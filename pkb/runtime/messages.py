"""Every message between the parent and a rank process, declared once: the jobs the parent sends, and the replies it
accepts back.

The parent's side is pkb.evaluate.ranks (and pkb.evaluate.session, which loads the reference); the rank's side is
pkb.runtime.worker; pkb.runtime.group carries them. Jobs travel to a rank pickled (the rank trusts its parent): they are
typed dicts, and the constructors below are the one place a job is spelt. Replies come back as plain data
(pkb.runtime.channel: tensors, numbers, strings, lists and dicts, never objects) written by a process that runs
candidate code, so they are the candidate's word: ``decode`` turns each into a frozen record of the kind its job
expects, checking every field's type and range (every tensor a plain, strided cpu ``torch.Tensor``), and anything
else into a ``RankFailure`` that says what was wrong.
A reply carries data (outputs, inputs after the call, a rank's own clock, what its code said went wrong), never a
verdict: the parent decides every status from what it observes itself (pkb.evaluate.failures).

    job = run_job(case="odd", precision="bf16", nodes=1, seeds=(11, 12))
    reply = decode({"status": "ok", "outputs": [...], "inputs_after": [...]}, RunReply)   # a RunReply
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal, TypedDict


# -- parent -> rank ----------------------------------------------------------------------------------------------


class LoadJob(TypedDict):
    """Import the problem (``module`` or ``module:ATTR``), and in a candidate group the candidate (None: the
    reference itself, run as a candidate); ``source``: the file's text, written into the rank's scratch."""

    op: Literal["load"]
    problem: str
    candidate: str | None
    source: str | None


class RunJob(TypedDict, total=False):
    """Build the case's inputs, call, send back the outputs and the inputs after the call.

    Inputs: pkb's values from ``seeds`` (this rank's seed, the seed all ranks share), or, with ``trial``, upstream's
    own values of an upstream case in that trial (the paper's verdict). ``exact``: a reference rank runs the
    reference on the inputs raised to fp64 with fp64 arithmetic throughout (the exact answer), and again on
    ``perturbations`` copies of them perturbed at the rounding level of each input's dtype, seeded by
    ``perturbation_seed`` (how far each output moves: its sensitivity; pkb.evaluate.accuracy)."""

    op: Literal["run"]
    case: str
    precision: str
    nodes: int | None
    seeds: tuple[int, int]
    trial: int
    exact: bool
    perturbations: int
    perturbation_seed: int


class TimePrepareJob(TypedDict):
    """Build the first input copies from ``seeds`` (one pair per copy; the rest come with ``time_copies``), warm up and
    estimate one call's time (pkb.runtime.timed_loop.TimedLoop.prepare, ``protocol`` its keyword arguments)."""

    op: Literal["time_prepare"]
    case: str
    precision: str
    nodes: int | None
    seeds: list[tuple[int, int]]
    protocol: dict[str, Any]


class TimeCopiesJob(TypedDict):
    """Build ``num_copies`` input slots in all (each with its donor): each timed repeat calls every slot once, in
    order."""

    op: Literal["time_copies"]
    num_copies: int


class TimeRefreshJob(TypedDict):
    """New values in every slot and its donor for refresh round ``round``, from ``entropy`` (the parent's, sent with
    this job alone: nothing in the rank's memory before it determines the values)."""

    op: Literal["time_refresh"]
    round: int
    entropy: int


class TimeRepeatJob(TypedDict):
    """One timed repeat: ``num_calls`` calls, each on its own input slot (the parent's count, never the rank's), each
    slot changed from its donor just before its call at rows ``entropy`` chooses (pkb.runtime.timed_loop.change_block)."""

    op: Literal["time_repeat"]
    num_calls: int
    entropy: int


class TimeCheckJob(TypedDict):
    """Summaries of every copy's last output (``num_projections`` random projections seeded by ``seed``, chosen after
    the repeat), for the parent to check that every timed call of the repeat ran on its own values."""

    op: Literal["time_check"]
    seed: int
    num_projections: int
    full: list[int]  # the slots whose last outputs come back in full, for the accuracy rule (the parent's choice)


class TimeStepJob(TypedDict):
    """The end of timing (synchronize, join the candidate's threads), or the outputs of the last repeat's calls."""

    op: Literal["time_finish", "time_outputs"]


class TimeExactJob(TypedDict):
    """The exact answer (a reference rank only; as ``run`` with ``exact``) to one timed call: the inputs of the slot
    whose seeds are ``seeds`` in refresh round ``round`` (that round's refresh ``entropy``), changed from its donor as
    call ``call`` of a repeat with ``repeat_entropy`` changes them."""

    op: Literal["time_exact"]
    case: str
    precision: str
    nodes: int | None
    seeds: tuple[int, int]
    round: int
    entropy: int
    repeat_entropy: int
    call: int
    perturbations: int
    perturbation_seed: int


class BuiltAnswer(TypedDict, total=False):
    """The build broker's answer to a rank's ``BuildRequest``: the built library's path, or why not."""

    op: Literal["built"]
    path: str
    error: str
    limit: str


class ExitJob(TypedDict):
    op: Literal["exit"]


Job = (LoadJob | RunJob | TimePrepareJob | TimeCopiesJob | TimeRefreshJob | TimeRepeatJob | TimeCheckJob
       | TimeStepJob | TimeExactJob | ExitJob)


def load_job(problem: str, candidate: str | None = None, source: str | None = None) -> LoadJob:
    return LoadJob(op="load", problem=problem, candidate=candidate, source=source)


def run_job(case: str, precision: str, nodes: int | None, seeds: tuple[int, int], trial: int | None = None,
            exact: bool = False, perturbations: int = 0, perturbation_seed: int = 0) -> RunJob:
    job = RunJob(op="run", case=case, precision=precision, nodes=nodes, seeds=seeds)
    if trial is not None:
        job["trial"] = trial
    if exact:
        job.update(exact=True, perturbations=perturbations, perturbation_seed=perturbation_seed)
    return job


def time_prepare_job(case: str, precision: str, nodes: int | None, seeds: list[tuple[int, int]],
                     protocol: dict[str, Any]) -> TimePrepareJob:
    return TimePrepareJob(op="time_prepare", case=case, precision=precision, nodes=nodes, seeds=seeds,
                          protocol=protocol)


def time_copies_job(num_copies: int) -> TimeCopiesJob:
    return TimeCopiesJob(op="time_copies", num_copies=num_copies)


def time_refresh_job(round_index: int, entropy: int) -> TimeRefreshJob:
    return TimeRefreshJob(op="time_refresh", round=round_index, entropy=entropy)


def time_repeat_job(num_calls: int, entropy: int) -> TimeRepeatJob:
    return TimeRepeatJob(op="time_repeat", num_calls=num_calls, entropy=entropy)


def time_check_job(seed: int, num_projections: int, full: list[int] = ()) -> TimeCheckJob:
    return TimeCheckJob(op="time_check", seed=seed, num_projections=num_projections, full=list(full))


def time_exact_job(case: str, precision: str, nodes: int | None, seeds: tuple[int, int], round_index: int,
                   entropy: int, repeat_entropy: int, call: int, perturbations: int,
                   perturbation_seed: int) -> TimeExactJob:
    return TimeExactJob(op="time_exact", case=case, precision=precision, nodes=nodes, seeds=seeds, round=round_index,
                        entropy=entropy, repeat_entropy=repeat_entropy, call=call, perturbations=perturbations,
                        perturbation_seed=perturbation_seed)


def time_step_job(op: Literal["time_finish", "time_outputs"]) -> TimeStepJob:
    return TimeStepJob(op=op)


def exit_job() -> ExitJob:
    return ExitJob(op="exit")


# -- rank -> parent: what a rank sends (the worker's side) --------------------------------------------------------

# What a rank says of a job that did not go as asked (the worker's ``status``): its word, which the parent weighs
# (pkb.evaluate.failures) and never takes as a verdict.
RANK_STATUSES = ("ok", "runtime_error", "import_error", "compile_error", "signature_error", "tampered", "forbidden",
                 "unavailable")


class Ready(TypedDict, total=False):
    """A rank's first message: up and in its process group (``ready``), or why not (``error``)."""

    ready: bool
    device: str
    pid: int
    sandbox: dict | None
    error: str


class BuildRequest(TypedDict):
    """A sandboxed rank asks the parent's build broker for a CUDA extension (pkb.runtime.build_client)."""

    build: dict


class StockCallNote(TypedDict):
    """A candidate rank says, in the middle of a job, that its code has just taken a stock route for the first
    time (pkb.runtime.guards.StockCallRecorder's ``sink``, before the call runs): the parent keeps every label it gets
    (``stock_calls_of``), whatever the rank's replies say later."""

    stock_calls: list[str]


def stock_calls_of(raw: Any) -> list[str] | None:
    """The labels of a ``StockCallNote`` (each cut to 200 characters; anything but strings becomes a label of its
    own, which no policy allows), or None where ``raw`` is not one."""
    if not (isinstance(raw, dict) and len(raw) == 1 and "stock_calls" in raw):
        return None
    labels = raw["stock_calls"]
    if not isinstance(labels, (list, tuple)) or not all(isinstance(label, str) for label in labels):
        return ["pkb.malformed_stock_call_note"]
    return [label[:200] for label in labels[:MAX_LABELS]]


# -- rank -> parent: what the parent accepts (decoded, typed) ----------------------------------------------------

MAX_TEXT = 64 << 10  # characters of an error or traceback kept from a rank (its end: where the error is)
MAX_LABELS = 4096  # stock-call labels one reply may carry


@dataclass(frozen=True)
class RankFailure:
    """A rank that did not do its job: what it said (``said``: one of RANK_STATUSES, or ``malformed`` where its reply
    was not a well-formed message of the kind asked for, or ``stuck`` where the parent cut it short while it waited for
    a rank that failed first) and its error text. Its word only: pkb.evaluate.failures decides what it earns."""

    said: str
    error: str
    traceback: str = ""

    @property
    def stuck(self) -> bool:
        return self.said == "stuck"


@dataclass(frozen=True)
class Ack:
    """A job done that returns nothing but what the candidate's code called (load, refresh, copies)."""

    collectives_used: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunReply:
    """A run's outputs and inputs after the call (plain data, pkb.runtime.channel.to_plain), and the stock calls the
    candidate's code made (candidate groups)."""

    outputs: Any
    inputs_after: Any
    collectives_used: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExactReply:
    """The exact answer (the reference in fp64 arithmetic): its outputs and inputs after the call, and the
    ``sensitivity`` of each floating value (the same structure: each floating tensor's RMS change over the perturbed
    runs, or None where a perturbation changed its shape); ``unavailable`` says why there is none (too large)."""

    outputs: Any = None
    inputs_after: Any = None
    sensitivity: Any = None
    unavailable: str | None = None


@dataclass(frozen=True)
class PrepareReply:
    """The rank's estimate of one call's time (the slowest rank's) and of one input copy's bytes with its outputs:
    what the parent sizes the timed repeats by (the candidate's word: a wrong estimate only makes repeats shorter or
    longer, never a call faster)."""

    per_call_s: float
    copy_bytes: int


@dataclass(frozen=True)
class RepeatReply:
    """The rank's own clock over one repeat, and its CUDA events (cross-checks of the parent's clock)."""

    wall_s: float
    event_s: float | None


@dataclass(frozen=True)
class CheckReply:
    """Per input slot, per value of its last output: a summary (pkb.runtime.timed_loop.summarise); and the last
    outputs of the slots the job named, in full (plain data)."""

    summaries: list
    outputs: list = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class FinishReply:
    threads_left_running: int
    collectives_used: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutputsReply:
    """The last output computed on each input copy, and the stock calls made while timed."""

    outputs: list
    collectives_used: tuple[str, ...] = ()


Reply = Ack | RunReply | ExactReply | PrepareReply | RepeatReply | CheckReply | FinishReply | OutputsReply


class _Malformed(ValueError):
    pass


def decode(raw: Any, kind: type) -> Reply | RankFailure:
    """``raw`` (a reply as the channel decoded it: any plain data) as a reply of ``kind``, or the RankFailure it is: the
    rank's own report of an error, or ``malformed`` naming what is wrong with it. Total: never raises."""
    try:
        if not isinstance(raw, dict):
            raise _Malformed(f"a {type(raw).__name__}, not a message")
        said = raw.get("status", "ok")
        if not isinstance(said, str):
            raise _Malformed(f"its status is a {type(said).__name__}")
        if said != "ok" or "error" in raw:
            return RankFailure(said if said in RANK_STATUSES and said != "ok" else "runtime_error",
                               _text(raw.get("error", "no error given")), _text(raw.get("traceback", "")))
        fields = {f.name: f for f in dataclasses.fields(kind)}
        unknown = sorted(set(raw) - set(fields) - {"status"})
        if unknown:
            raise _Malformed(f"unknown fields {unknown[:5]}")
        return kind(**{name: _field(kind, name, raw[name]) for name in fields if name in raw})
    except (_Malformed, TypeError) as exc:  # TypeError: a required field missing
        return RankFailure("malformed", f"the rank's reply is not a {kind.__name__}: {exc}")


_FLOATS = {"per_call_s", "wall_s", "event_s"}
_INTS = {"copy_bytes", "threads_left_running"}
_LISTS = {("CheckReply", "summaries"), ("CheckReply", "outputs"), ("OutputsReply", "outputs")}


def _field(kind: type, name: str, value: Any) -> Any:
    if name == "collectives_used":
        if not isinstance(value, (list, tuple)) or len(value) > MAX_LABELS or not all(isinstance(v, str) for v in value):
            raise _Malformed(f"collectives_used must be a list of at most {MAX_LABELS} strings")
        return tuple(value)
    if name == "unavailable":
        return None if value is None else _text(value)
    if name in _FLOATS:
        if value is None and name == "event_s":
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise _Malformed(f"{name} must be a finite number >= 0, got {_shown(value)}")
        return float(value)
    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Malformed(f"{name} must be an integer >= 0, got {_shown(value)}")
        return value
    if (kind.__name__, name) in _LISTS and not isinstance(value, list):
        raise _Malformed(f"{name} must be a list, got {_shown(value)}")
    _only_plain_tensors(value, name)
    return value  # outputs, inputs after the call, sensitivities: plain data, judged value by value


def _only_plain_tensors(value: Any, name: str) -> None:
    """Refuse (``_Malformed``) a tensor anywhere in ``value`` that is not a plain, strided cpu ``torch.Tensor``: what
    every rank's ``to_plain`` sends (pkb.runtime.channel), so anything else (a meta tensor, a subclass
    ``torch.load`` rebuilt, a sparse one) is a reply pkb does not accept, never a value a comparison meets. The walk
    keeps its own stack: a reply nested deeper than Python's recursion limit is refused the same way."""
    torch = sys.modules.get("torch")
    if torch is None:  # torch never loaded: no tensor can be in a reply
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if type(item) is not torch.Tensor:
                raise _Malformed(f"{name} holds a {type(item).__qualname__}, not a plain torch.Tensor")
            if item.layout != torch.strided or item.device.type != "cpu":
                raise _Malformed(f"{name} holds a tensor on {item.device.type} with layout {item.layout}, not a "
                                 "strided cpu tensor")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"an error text that is a {type(value).__name__}")
    return value[-MAX_TEXT:]


def _shown(value: Any) -> str:
    return type(value).__name__ if not isinstance(value, (int, float, str, type(None))) else repr(value)[:40]
