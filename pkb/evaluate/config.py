"""One evaluation's settings (``EvalConfig``) and how long its timing runs (``TimingProtocol``).

The options and their defaults and choices are pkb.options's; this is what they resolve to once the mode
and the world size are known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pkb.options import CASE_SELECTIONS, POLICIES, SANDBOX_LEVELS, default
from pkb.problem import DEFAULT_PRECISION, PRECISIONS
from pkb.protocol import UPSTREAM_TRIALS
from pkb.runtime.modes import Mode


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
    timeout_s: float = default("timeout")
    load_timeout_s: float = 900.0  # a first CUDA build can take minutes
    perf: bool = False
    cuda_graph: bool = False
    policy: str = default("policy")  # a POLICIES entry; forbid-collectives: stock collectives on the hot path are `forbidden`
    cases: str = default("cases")  # a key of CASE_SELECTIONS
    sandbox: str = default("sandbox")  # a SANDBOX_LEVELS entry: what candidate processes run under (pkb.runtime.sandbox)
    precision: str = DEFAULT_PRECISION  # a PRECISIONS key: the dtype of the inputs upstream's factory builds
    upstream_trials: int = UPSTREAM_TRIALS  # the upstream cases run max(num_trials, this) trials (the paper's 5)

    def __post_init__(self):
        if self.nodes < 0 or (self.nodes and self.world_size % self.nodes):
            raise ValueError(f"{self.world_size} ranks do not split into {self.nodes} nodes of equal size")
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
    def timing(self) -> TimingProtocol:
        return TimingProtocol.for_mode(self.mode, self.cuda_graph)
