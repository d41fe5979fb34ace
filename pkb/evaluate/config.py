"""One evaluation's settings (``EvalConfig``), the one way options become them (``resolve``), and how long its
timing runs (``TimingProtocol``).

The options and their defaults, choices and bounds are pkb.options's; an ``EvalConfig`` holds them under the same
names once the mode and the world size are decided. Every entry point (``pkb eval``, ``run``, ``generate``,
``agent``, ``pkb serve``'s requests, Ray's evaluations, ``pkb calibrate``, ``pkb baseline``) builds its config with
``resolve``, the only place a mode is chosen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pkb.options import BUILD_ALLOWANCE_S, CASE_SELECTIONS, OPTIONS, POLICIES, SANDBOX_LEVELS, Mode, default
from pkb.problem import DEFAULT_PRECISION, PRECISIONS
from pkb.protocol import UPSTREAM_TRIALS


@dataclass(frozen=True)
class TimingProtocol:
    """How long to time (docs/timing.md): calls per repeat are chosen so a repeat lasts ``min_repeat_s``."""

    num_warmup: int
    warmup_s: float
    num_repeats: int
    min_repeat_s: float
    min_iters: int
    max_iters: int
    cuda_graph: bool = False

    @classmethod
    def for_mode(cls, mode: Mode, cuda_graph: bool = False) -> "TimingProtocol":
        if mode is Mode.CUDA:
            return cls(num_warmup=5, warmup_s=0.5, num_repeats=7, min_repeat_s=0.1, min_iters=3, max_iters=5000,
                       cuda_graph=cuda_graph)
        # cpu / shared-gpu: finishes in seconds; the times are labelled as not GPU performance
        return cls(num_warmup=2, warmup_s=0.0, num_repeats=5, min_repeat_s=0.02, min_iters=2, max_iters=200)


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation's settings: the options (pkb.options), by their names, as ``resolve`` resolves them for a
    problem on a machine (the mode decided, the world size chosen)."""

    world_size: int
    mode: Mode
    nodes: int = 0  # the nodes the ranks are split into (pkb.topology); 0: the problem's default (Problem.nodes)
    trials: int = default("trials")
    timeout: float = default("timeout")  # seconds: bounds every step of the evaluation, loading the candidate included
    perf: bool = False
    cuda_graph: bool = False
    policy: str = default("policy")  # a POLICIES entry; forbid-collectives: stock collectives on the hot path are `forbidden`
    cases: str = default("cases")  # a key of CASE_SELECTIONS
    sandbox: str = default("sandbox")  # a SANDBOX_LEVELS entry: what candidate processes run under (pkb.runtime.sandbox)
    dtype: str = DEFAULT_PRECISION  # the run's precision (a PRECISIONS key): the dtype of the inputs upstream's factory builds
    upstream_trials: int = UPSTREAM_TRIALS  # the upstream cases run max(trials, this) trials (the paper's 5)
    build_allowance_s: float = BUILD_ALLOWANCE_S  # pkb's, not an option: more time a step gets while its ranks compile

    def __post_init__(self):
        if self.nodes < 0 or (self.nodes and self.world_size % self.nodes):
            raise ValueError(f"{self.world_size} ranks do not split into {self.nodes} nodes of equal size: pick "
                             "`nodes` (--nodes) that divides `world_size` (--world-size)")
        if self.dtype not in PRECISIONS:
            raise ValueError(f"dtype must be one of {tuple(PRECISIONS)}, got {self.dtype!r}")
        if self.sandbox not in SANDBOX_LEVELS:
            raise ValueError(f"sandbox must be one of {SANDBOX_LEVELS}, got {self.sandbox!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cases not in CASE_SELECTIONS:
            raise ValueError(f"cases must be one of {tuple(CASE_SELECTIONS)}, got {self.cases!r}")

    def on(self, problem) -> "EvalConfig":
        """These settings for ``problem``: the number of nodes resolved to its default where not chosen."""
        return self if self.nodes else dataclasses.replace(self, nodes=problem.nodes[0])

    @property
    def compile_limit_s(self) -> float:
        """The most one step (loading the candidate, its first call) may take while processes its ranks started
        keep compiling: ``timeout`` plus the build allowance (``RankGroup.collect``'s ``compile_limit``). A
        step that compiles nothing, a hang, gets ``timeout``."""
        return self.timeout + self.build_allowance_s

    @property
    def timing(self) -> TimingProtocol:
        return TimingProtocol.for_mode(self.mode, self.cuda_graph)


class OptionError(ValueError):
    """Options no evaluation can run with (one out of its range, two that disagree, a mode or a sandbox this machine
    cannot give, a world size the problem does not run at); the message names them and says what to change."""


# The options an EvalConfig holds, each under its own name; ``mode`` and ``world_size`` are resolved first.
_CONFIG_OPTIONS = tuple(f.name for f in dataclasses.fields(EvalConfig)
                        if f.name in OPTIONS and f.name not in ("mode", "world_size"))


@dataclass(frozen=True)
class Resolved:
    """Options resolved for a problem on a machine: the settings, and in words why this mode (``mode_reason``) and what
    the sandbox gives candidates here (``sandbox_text``), for the line a command says on stderr."""

    config: EvalConfig
    mode_reason: str
    sandbox_text: str


def resolve(options: Mapping[str, Any], problem=None, num_gpus: int | None = None, on_ray: bool = False) -> Resolved:
    """The one place options become an evaluation's settings: ``pkb eval``, ``run``, ``generate`` and ``agent``,
    ``pkb serve``'s requests (and through it the RL environments), Ray's evaluations and ``pkb baseline`` and
    ``calibrate`` all come here. ``options`` are by pkb.options's names (one left out or None takes its default);
    ``problem`` (a pkb.problem.Problem; None for a run over many) gives the default world size, its smallest, and
    the sizes it takes; ``num_gpus``: the GPUs of the machine the evaluations run on (a Ray cluster's largest
    node; None: this machine's). Here alone ``--mode auto`` is decided, every value is checked against its row of
    pkb.options, and ``--sandbox required`` is refused where this machine lacks a protection (a Ray cluster's
    nodes each check for themselves). OptionError says what to change.

        resolve({"trials": 1, "timeout": 20, "mode": "cpu", "world_size": 2}).config.timeout == 20.0
    """
    from pkb.runtime.modes import ModeUnavailable, choose_mode  # this module stays light: the machine is asked here

    unknown = sorted(set(options) - set(_CONFIG_OPTIONS) - {"mode", "world_size"})
    if unknown:
        raise OptionError(f"unknown options {unknown}; an evaluation takes mode, world_size, {', '.join(_CONFIG_OPTIONS)}")
    chosen = {name: value for name, value in options.items() if value is not None}
    world_size = chosen.get("world_size", problem.world_sizes[0] if problem is not None else None)
    if world_size is None:
        raise OptionError("give `world_size` (--world-size): a run over many problems has no default of its own")
    try:
        for name, value in {**chosen, "world_size": world_size}.items():
            OPTIONS[name].check(value)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if problem is not None and world_size not in problem.world_sizes:
        raise OptionError(f"{problem.name} runs at world sizes {list(problem.world_sizes)}, not {world_size}; pick one "
                          "with --world-size")
    try:
        choice = choose_mode(chosen.get("mode", default("mode")), world_size, num_gpus=num_gpus)
    except ModeUnavailable as exc:
        raise OptionError(str(exc) + (" (GPUs counted on the largest node of the Ray cluster)" if on_ray else "")) from None
    level = chosen.get("sandbox", default("sandbox"))
    try:
        config = EvalConfig(world_size=world_size, mode=choice.mode,
                            **{name: chosen[name] for name in _CONFIG_OPTIONS if name in chosen})
    except ValueError as exc:  # e.g. nodes that do not divide the world size
        raise OptionError(str(exc)) from None
    return Resolved(config, choice.reason, _sandbox_text(level, choice.mode, on_ray))


def _sandbox_text(level: str, mode: Mode, on_ray: bool) -> str:
    """What ``--sandbox level`` gives candidates here, e.g. ``auto (full: landlock-fs, ...)``; OptionError where
    ``required`` cannot be honoured on this machine (on a Ray cluster each node checks for itself, and one that
    cannot ends its evaluations as ``infra_error``)."""
    from pkb.runtime.sandbox import SandboxStatus, SandboxUnavailable, check_sandbox

    if level == "off":
        return SandboxStatus.off().describe()
    if on_ray:
        return f"{level} (checked on each node of the Ray cluster)"
    try:
        return check_sandbox(level, mode).describe()
    except SandboxUnavailable as exc:
        raise OptionError(str(exc)) from None
