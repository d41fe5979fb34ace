"""The typed result of one evaluation: one verdict, and everything a result row stores."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pkb import __version__
from pkb.details import Details
from pkb.options import Status

SCHEMA_VERSION = 7  # bump with a migration in pkb.store.db when the row's fields change


@dataclass
class CaseTiming:
    """Seconds per call of one case: the median over repeats of the max over ranks."""

    case: str
    reference_s: float
    candidate_s: float
    reference_spread: float  # (max - min) / median over repeats
    candidate_spread: float
    speedup: float
    busbw_gbps: float | None = None  # the candidate's bus bandwidth, when the case moves link bytes
    timer_disagreement: bool = False  # CUDA events and the wall clock differ by more than 10 %
    roofline_fraction: float | None = None  # the profile's lower bound / the candidate's time
    roofline_fraction_calibrated: float | None = None  # the same against this machine's calibrated profile
    bound_by: str | None = None  # link, compute, memory or latency
    candidate_rank_clock_s: float | None = None  # the candidate ranks' own clock (a cross-check of candidate_s)
    calls_per_repeat: int | None = None  # the parent's count, each call on an input copy of its own


@dataclass
class EvalResult:
    problem: str
    problem_version: int
    solution: str
    solution_sha256: str
    status: Status
    # the solution set the result belongs to (pkb.store.db: a --solutions folder's name, a generation run,
    # "pkb shipped" or "reference"); "" until the caller names it
    solution_set: str = ""
    # the experiment the result belongs to (pkb.options: a user's `--experiment`, "default", "served", "rl"); "" until
    # the caller names it, and the store files an unnamed result under pkb.options.DEFAULT_EXPERIMENT
    experiment: str = ""
    message: str = ""
    details: Details = field(default_factory=Details)
    mode: str = "cpu"
    world_size: int = 0
    precision: str = "bf16"  # the run's precision (pkb.problem.PRECISIONS): the dtype of upstream's inputs
    nodes: int = 1  # the nodes the ranks were split into (pkb.topology)
    num_trials: int = 0
    cases: list[str] = field(default_factory=list)
    # ok on the upstream cases alone (the paper's protocol), whatever the stricter cases said; None when
    # no upstream case was checked (or no verdict was reached)
    upstream_ok: bool | None = None
    timings: list[CaseTiming] = field(default_factory=list)
    speedup: float | None = None
    roofline_fraction: float | None = None
    busbw_gbps: float | None = None
    times_are_gpu_performance: bool = False
    collectives_used: list[str] = field(default_factory=list)
    hardware: str = ""
    wall_s: float = 0.0
    pkb_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    created_at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["status"] = self.status.value
        row["details"] = self.details.to_dict()
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "EvalResult":
        row = dict(row)
        row["status"] = Status(row["status"])
        row["timings"] = [CaseTiming(**t) for t in row.get("timings") or []]
        row["details"] = row["details"] if isinstance(row.get("details"), Details) else Details.from_dict(row.get("details"))
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in row.items() if k in known})
