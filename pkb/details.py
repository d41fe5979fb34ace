"""What a result says beyond its verdict (``Details``): one typed record, each thing under one name, importable
without torch (the client reads it from a served verdict's JSON: pkb.client.result_view)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Details:
    """What a result says beyond its verdict, each under one name (stored as JSON; a stored row's keys that are none of
    these, from an older pkb, are left out when it is read back)."""

    # the evaluation (pkb.evaluate.evaluator)
    solution_path: str | None = None  # the candidate's file (None: the reference, or a served request's scratch copy)
    sandbox: dict | None = None  # what its processes ran under (pkb.runtime.sandbox.SandboxStatus.to_dict)
    tripwire: list[str] = field(default_factory=list)  # suspicious constructs in its source: labels, not verdicts
    cases_left_out: dict[str, str] = field(default_factory=dict)  # case -> why it was not checked in this mode
    phase_s: dict[str, float] = field(default_factory=dict)  # where the wall time went: start, load, check, time
    upstream: dict | None = None  # the paper's verdict (pkb.evaluate.paper.PaperVerdict.to_dict)
    rules: dict | None = None  # {"pkb": passed|failed, "upstream": passed|failed|not checked}
    accuracy: dict | None = None  # how every value was judged (pkb.evaluate.accuracy.Judge.summary)
    faster_than_roofline: list[str] = field(default_factory=list)  # timed cases faster than the machine allows
    # what a failure was: where, and what the ranks said (their word: pkb.evaluate.failures)
    rank: int | None = None
    case: str | None = None
    trial: Any = None  # a trial's number, "repeat", "timing", "after-timing"
    mismatch: dict | None = None  # pkb.evaluate.compare.Mismatch.to_dict
    error: str | None = None
    traceback: str | None = None
    log_tail: str | None = None  # the end of the failing rank's output
    stacks: dict | None = None  # rank -> its Python stack when it hung (a timeout)
    rank_clock_s: float | None = None  # a rank clock that disagreed with the parent's (tampered timing)
    parent_clock_s: float | None = None
    pkb_limits: list[str] = field(default_factory=list)  # pkb's own limits that bore on it ("memory", build bounds)
    # who caused a ``skipped`` (pkb.evaluate.failures.SKIP_CAUSES): "run" (the problem does not run so, for every
    # candidate alike: out of pass@k's n) or "candidate" (what its code needs, or did: counted as not passed)
    skipped_by: str | None = None
    # the loop and the executors
    verdict_of: int | None = None  # the stored row whose verdict this one repeats (pkb.loop)
    rerun_alone: dict | None = None  # why it was judged again alone, and what the first run ended in
    gpu_memory_peak_gib: dict | None = None  # device -> the most its processes held
    node: str | None = None  # the Ray node it ran on
    attempts: int | None = None  # evaluations it took on Ray (nodes lost before)
    infra_errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The fields set (not at their defaults), as JSON stores them."""
        defaults = Details()
        return {f.name: value for f in dataclasses.fields(self)
                if (value := getattr(self, f.name)) != getattr(defaults, f.name)}

    @classmethod
    def from_dict(cls, found: dict[str, Any] | None) -> "Details":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in (found or {}).items() if key in known})
