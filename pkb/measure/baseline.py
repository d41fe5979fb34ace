"""``pkb baseline``: how far the PyTorch + NCCL references are from the roofline.

Every selected problem's reference is timed by the harness (``time_reference``: the same protocol
as every result) on its benchmark cases in cuda mode, or its small test cases in cpu and shared-gpu
modes (labelled: not GPU performance), and each case gets a row: time, busbw (link bytes / time),
the roofline bound on the chosen profile, bound / time and which term bounds it.

    config = resolve({"mode": "cpu", "world_size": 2, "perf": True}).config
    rows = run_baseline(select("1-2"), config, profile=get_profile("cpu"))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from pkb.hardware.profiles import HardwareProfile, get_profile
from pkb.hardware.roofline import busbw_gbps, roofline, roofline_fraction


@dataclass(frozen=True)
class BaselineRow:
    problem: str
    case: str
    world_size: int
    mode: str
    profile: str
    time_us: float | None  # None when the reference could not be timed (see error)
    spread: float | None
    busbw: float | None  # GB/s; None when the case moves no link bytes
    bound_us: float
    roofline_fraction: float | None
    bound_by: str
    datasheet_roofline_fraction: float | None = None  # against the datasheet, when ``profile`` is calibrated
    timer_disagreement: bool = False
    times_are_gpu_performance: bool = False
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Skipped:
    problem: str
    reason: str


def run_baseline(problems: Iterable, config, profile: HardwareProfile,
                 on_row: Callable[[BaselineRow], None] = lambda row: None) -> tuple[list[BaselineRow], list[Skipped]]:
    """Time each problem's reference with ``config`` (pkb.evaluate.config.EvalConfig, ``perf`` on: its world size,
    mode and timeout); rows in suite order, and what was skipped."""
    from pkb.evaluate.session import Session
    from pkb.evaluate.timing import perf_cases, time_reference
    from pkb.evaluate.verdicts import HarnessError
    from pkb.runtime.group import GroupFailure

    world_size, mode = config.world_size, config.mode
    datasheet = get_profile(profile.based_on) if profile.calibrated and profile.based_on else None
    rows: list[BaselineRow] = []
    skipped: list[Skipped] = []
    with Session(mode, world_size) as session:
        for problem in problems:
            cases = perf_cases(problem, config) if world_size in problem.world_sizes else ()
            if not cases:
                skipped.append(Skipped(problem.name, f"runs at world sizes {list(problem.world_sizes)}"
                                       if world_size not in problem.world_sizes else
                                       f"no case runs at world size {world_size}"))
                continue
            for case in cases:
                try:
                    timing = time_reference(session, problem, case, config)
                    seconds, spread, disagreement = timing.per_call_s(), timing.spread, timing.timer_disagreement
                    error = ""
                except (HarnessError, GroupFailure) as exc:
                    seconds, spread, disagreement, error = None, None, False, str(exc).strip().splitlines()[0]
                row = make_row(problem, case, config, profile, datasheet, seconds, spread, disagreement, error)
                rows.append(row)
                on_row(row)
    return rows, skipped


def make_row(problem, case, config, profile: HardwareProfile, datasheet: HardwareProfile | None,
             seconds: float | None, spread: float | None, disagreement: bool, error: str = "") -> BaselineRow:
    cost = problem.cost(case, config.world_size)
    bound = roofline(cost, profile, config.world_size)
    timed = seconds is not None and seconds > 0
    against_datasheet = None
    if timed and datasheet is not None:
        against_datasheet = roofline_fraction(roofline(cost, datasheet, config.world_size).bound_s, seconds)
    return BaselineRow(
        problem=problem.name, case=case.name, world_size=config.world_size, mode=config.mode.value,
        profile=profile.name, time_us=seconds * 1e6 if timed else None, spread=spread,
        busbw=busbw_gbps(cost, seconds) if timed else None, bound_us=bound.bound_s * 1e6,
        roofline_fraction=roofline_fraction(bound.bound_s, seconds) if timed else None, bound_by=bound.bound_by,
        datasheet_roofline_fraction=against_datasheet, timer_disagreement=disagreement,
        times_are_gpu_performance=config.mode.times_are_gpu_performance, error=error)
