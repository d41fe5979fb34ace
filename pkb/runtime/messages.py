"""Every message between the parent and a rank process, declared once.

The parent's side is pkb.evaluate.ranks (and pkb.evaluate.session, which loads the reference); the rank's side is
pkb.runtime.worker; pkb.runtime.group carries them. Jobs travel to a rank pickled (the rank trusts its parent);
replies come back as plain data (pkb.runtime.channel: tensors, numbers, strings, lists and dicts, never objects),
so both are typed dicts: a TypedDict is a plain dict at run time, and the constructors below are the one place a
job is spelt.

    job = run_job(case="odd", precision="bf16", nodes=1, seeds=(11, 12), sample_seed=13)
    job["op"] == "run"
"""

from __future__ import annotations

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
    reference on the inputs raised to the problem's exact_dtype (the exact answer). ``sample_seed`` picks the places
    of the elements a large output is sent as."""

    op: Literal["run"]
    case: str
    precision: str
    nodes: int | None
    seeds: tuple[int, int]
    sample_seed: int | None
    trial: int
    exact: bool


class TimePrepareJob(TypedDict):
    """Build input copies from ``seeds`` (one pair per copy), warm up, pick the calls per repeat
    (pkb.runtime.timed_loop.TimedLoop.prepare, ``protocol`` its keyword arguments)."""

    op: Literal["time_prepare"]
    case: str
    precision: str
    nodes: int | None
    seeds: list[tuple[int, int]]
    protocol: dict[str, Any]


class TimeRefreshJob(TypedDict):
    op: Literal["time_refresh"]
    round: int


class TimeStepJob(TypedDict):
    """One timed repeat, or the end of timing (synchronize, join the candidate's threads)."""

    op: Literal["time_repeat", "time_finish"]


class TimeOutputsJob(TypedDict):
    op: Literal["time_outputs"]
    sample_seed: int


class BuiltAnswer(TypedDict, total=False):
    """The build broker's answer to a rank's ``BuildRequest``: the built library's path, or why not."""

    op: Literal["built"]
    path: str
    error: str
    limit: str


class ExitJob(TypedDict):
    op: Literal["exit"]


Job = LoadJob | RunJob | TimePrepareJob | TimeRefreshJob | TimeStepJob | TimeOutputsJob | ExitJob


def load_job(problem: str, candidate: str | None = None, source: str | None = None) -> LoadJob:
    return LoadJob(op="load", problem=problem, candidate=candidate, source=source)


def run_job(case: str, precision: str, nodes: int | None, seeds: tuple[int, int], sample_seed: int | None = None,
            trial: int | None = None, exact: bool = False) -> RunJob:
    job = RunJob(op="run", case=case, precision=precision, nodes=nodes, seeds=seeds, sample_seed=sample_seed)
    if trial is not None:
        job["trial"] = trial
    if exact:
        job["exact"] = True
    return job


def time_prepare_job(case: str, precision: str, nodes: int | None, seeds: list[tuple[int, int]],
                     protocol: dict[str, Any]) -> TimePrepareJob:
    return TimePrepareJob(op="time_prepare", case=case, precision=precision, nodes=nodes, seeds=seeds,
                          protocol=protocol)


def time_refresh_job(round_index: int) -> TimeRefreshJob:
    return TimeRefreshJob(op="time_refresh", round=round_index)


def time_step_job(op: Literal["time_repeat", "time_finish"]) -> TimeStepJob:
    return TimeStepJob(op=op)


def time_outputs_job(sample_seed: int) -> TimeOutputsJob:
    return TimeOutputsJob(op="time_outputs", sample_seed=sample_seed)


def exit_job() -> ExitJob:
    return ExitJob(op="exit")


# -- rank -> parent ----------------------------------------------------------------------------------------------


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


class Reply(TypedDict, total=False):
    """A rank's answer to a job. ``status``: ``ok``, or what the rank saw (``runtime_error``, ``tampered``,
    ``forbidden``, ``skipped``; the parent decides the verdict), with ``error`` and ``traceback``; ``stuck``: the
    parent cut it short while it waited for a rank that failed (pkb.runtime.group). A run's ``outputs`` and
    ``inputs_after`` (plain data, pkb.runtime.channel.to_plain), ``collectives_used`` (the stock calls a candidate
    made), ``exact_unavailable`` (why no exact answer); timing's ``num_iters``, ``num_copies``, ``per_call_s``,
    ``cuda_graph``, ``wall_s``, ``event_s``, ``threads_left_running``."""

    status: str
    error: str
    traceback: str
    stuck: bool
    outputs: Any
    inputs_after: Any
    collectives_used: list[str]
    exact_unavailable: str
    num_iters: int
    num_copies: int
    per_call_s: float
    cuda_graph: bool
    wall_s: float
    event_s: float | None
    threads_left_running: int
