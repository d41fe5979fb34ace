"""One evaluation's settings (``EvalConfig``), the one way options become them (``config_from_options``), and
how long its timing runs (``TimingProtocol``).

The options and their defaults, choices and bounds are pkb.options's; an ``EvalConfig`` is what they resolve to
once the mode and the world size are known. Every entry point (``pkb eval``, ``run``, ``generate``, ``agent``,
``pkb serve``'s requests, ``pkb calibrate``, ``pkb baseline``) builds its config with ``config_from_options``.
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
    """One evaluation's settings, as the options (pkb.options) resolve them for a mode and world size."""

    world_size: int
    mode: Mode
    nodes: int = 0  # the nodes the ranks are split into (pkb.topology); 0: the problem's default (Problem.nodes)
    num_trials: int = default("trials")
    timeout_s: float = default("timeout")  # bounds every step of the evaluation, loading the candidate included
    build_allowance_s: float = BUILD_ALLOWANCE_S  # more time a step gets while what its ranks started compiles
    perf: bool = False
    cuda_graph: bool = False
    policy: str = default("policy")  # a POLICIES entry; forbid-collectives: stock collectives on the hot path are `forbidden`
    cases: str = default("cases")  # a key of CASE_SELECTIONS
    sandbox: str = default("sandbox")  # a SANDBOX_LEVELS entry: what candidate processes run under (pkb.runtime.sandbox)
    precision: str = DEFAULT_PRECISION  # a PRECISIONS key: the dtype of the inputs upstream's factory builds
    upstream_trials: int = UPSTREAM_TRIALS  # the upstream cases run max(num_trials, this) trials (the paper's 5)

    def __post_init__(self):
        if self.nodes < 0 or (self.nodes and self.world_size % self.nodes):
            raise ValueError(f"{self.world_size} ranks do not split into {self.nodes} nodes of equal size: pick "
                             "`nodes` (--nodes) that divides `world_size` (--world-size)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
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
        keep compiling: ``timeout_s`` plus the build allowance (``RankGroup.collect``'s ``compile_limit``). A
        step that compiles nothing, a hang, gets ``timeout_s``."""
        return self.timeout_s + self.build_allowance_s

    @property
    def timing(self) -> TimingProtocol:
        return TimingProtocol.for_mode(self.mode, self.cuda_graph)


class OptionError(ValueError):
    """Options no evaluation can run with (one out of its range, or two that disagree); the message names them."""


# pkb.options's name of each setting -> EvalConfig's field (``mode`` and ``world_size`` come resolved)
_FIELD_OF_OPTION = {"nodes": "nodes", "trials": "num_trials", "timeout": "timeout_s", "perf": "perf",
                    "cuda_graph": "cuda_graph", "policy": "policy", "cases": "cases", "sandbox": "sandbox",
                    "dtype": "precision", "upstream_trials": "upstream_trials"}


def config_from_options(options: Mapping[str, Any], world_size: int, mode: Mode) -> EvalConfig:
    """The settings of one evaluation from its options, by pkb.options's names (``trials``, ``timeout``, ``dtype``,
    ...; one left out or None takes its default). ``world_size`` and ``mode`` come resolved (the problem's
    default world size, ``--mode auto`` decided by pkb.runtime.modes.choose_mode); ``options["mode"]`` and
    ``options["world_size"]``, where given, are what they were resolved from. Every value is checked against its
    row of pkb.options (``Option.check``) and ``nodes`` must divide ``world_size``; OptionError says what to
    change. The build allowance is pkb's (``BUILD_ALLOWANCE_S``).

        config_from_options({"trials": 1, "timeout": 20}, 2, Mode.CPU).timeout_s == 20.0
    """
    unknown = sorted(set(options) - set(_FIELD_OF_OPTION) - {"mode", "world_size"})
    if unknown:
        raise OptionError(f"unknown options {unknown}; an evaluation takes {', '.join(_FIELD_OF_OPTION)}")
    chosen = {name: value for name, value in options.items() if value is not None}
    fields = {_FIELD_OF_OPTION[name]: value for name, value in chosen.items() if name in _FIELD_OF_OPTION}
    try:
        for name, value in {**chosen, "world_size": world_size}.items():
            OPTIONS[name].check(value)
        return EvalConfig(world_size=world_size, mode=mode, **{**fields, "nodes": chosen.get("nodes", 0)},
                          build_allowance_s=BUILD_ALLOWANCE_S)  # which refuses nodes that do not divide world_size
    except ValueError as exc:
        raise OptionError(str(exc)) from None
