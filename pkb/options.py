"""The evaluation options and the verdicts, declared once, importable without torch.

Every way of asking for an evaluation reads them from here: ``pkb eval`` and ``pkb run`` (their flags are
made from ``EVAL_OPTIONS``), the evaluation service (``EvaluationRequest``: a request's JSON), the client
(``pkb.client``) and the RL environments; ``pkb.evaluate.config.resolve`` turns them into an
``EvalConfig``. Each option has one name (``world_size``: ``--world-size`` on the command line,
``world_size`` in JSON), one default, its choices or its range, and one line of help; its bounds are checked
where it is parsed (``Option.check``: the command line, a request's JSON, the client), in this one table. The
numbers single commands take (``--parallel``, ``--samples``, ``--port``, ...) are rows here too
(``COMMAND_OPTIONS``).

    >>> EvaluationRequest.from_json({"problem": "allgather", "source": text, "trials": 1}).trials
    1
"""

from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass, fields
from typing import Any

from pkb.protocol import DEFAULT_PRECISION, PRECISION_NAMES, UPSTREAM_TRIALS


class _Named(str, enum.Enum):
    """An enum whose members are their names as the options and result rows spell them (``str(Mode.CPU) == "cpu"``)."""

    def __str__(self) -> str:
        return self.value


class Status(_Named):
    """The verdict of one evaluation (docs/architecture.md, "Verdicts")."""

    OK = "ok"
    MISMATCH = "mismatch"
    COMPILE_ERROR = "compile_error"
    IMPORT_ERROR = "import_error"
    SIGNATURE_ERROR = "signature_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    CRASH = "crash"
    TAMPERED = "tampered"
    FORBIDDEN = "forbidden"
    SKIPPED = "skipped"
    # pkb itself failed (its reference raised, rank processes would not start, a pkb bug): no verdict on
    # the candidate. Left out of pass@k and fast_p; a rerun evaluates it again.
    HARNESS_ERROR = "harness_error"
    # The machine under the evaluation failed (a cluster node lost, its worker killed) and the retries
    # ran out (pkb.executor): no verdict on the candidate either, left out and evaluated again the same way.
    INFRA_ERROR = "infra_error"

    @property
    def is_verdict(self) -> bool:
        """False for pkb's own failures and the machine's (no verdict on the candidate: a rerun retries)."""
        return self not in (Status.HARNESS_ERROR, Status.INFRA_ERROR)


# The statuses that are no failure, so exit status 0 from `pkb eval`, `pkb run` and `pkb generate`: `ok`, and
# `skipped`, which is no verdict on the candidate (this run lacks what it needs: a GPU in cpu mode, more ranks) and
# no success either (pass@k leaves it out; `status` says which it was).
NO_FAILURE = (Status.OK, Status.SKIPPED)


class Mode(_Named):
    """Where the ranks run (pkb.runtime.modes: how ``auto`` picks one): gloo on the CPU, NCCL with a GPU per rank, or
    gloo and symmetric memory with the ranks sharing one GPU. Times outside ``cuda`` are not GPU performance."""

    CPU = "cpu"
    CUDA = "cuda"
    SHARED_GPU = "shared-gpu"

    @property
    def backend(self) -> str:
        return "nccl" if self is Mode.CUDA else "gloo"

    @property
    def uses_gpu(self) -> bool:
        return self is not Mode.CPU

    @property
    def times_are_gpu_performance(self) -> bool:
        return self is Mode.CUDA


MODES = ("auto", *(mode.value for mode in Mode))  # what --mode takes: auto decides (pkb.runtime.modes.choose_mode)
# What `--cases` selects for the correctness trials. `all` is the upstream cases and the tests; the
# benchmark shapes are checked after they are timed (--perf), or on their own with `benchmarks`.
CASE_SELECTIONS = {"all": ("upstream", "tests"), "upstream": ("upstream",), "tests": ("tests",),
                   "benchmarks": ("benchmarks",)}
POLICIES = ("report", "forbid-collectives")
SANDBOX_LEVELS = ("auto", "required", "off")
EXECUTORS = ("local", "ray")
DEFAULT_TRIALS = 3
DEFAULT_TIMEOUT_S = 120.0
# How much longer than --timeout one step of an evaluation (loading the candidate, its first call) may run while
# processes its ranks started keep compiling (a first build, torch.compile); a hang compiles nothing and gets none
# of it. Time queued for pkb's build broker is pkb's and never counted (pkb.runtime.builds has its own limit).
BUILD_ALLOWANCE_S = 900.0


@dataclass(frozen=True)
class Option:
    """One evaluation option: its name (``--world-size`` / ``world_size``), default, type, choices or
    range, and help; ``served``: a request to ``pkb serve`` may set it (else the server decides it)."""

    name: str
    default: Any
    kind: type
    help: str
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    served: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def complaint(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this option, as the end of a sentence that names it (e.g. ``must be
        at least 1, got 0``), or None where it is one the option takes."""
        if value is None and self.default is None:
            return None
        kinds = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, kinds) or (self.kind is not bool and isinstance(value, bool)):
            return f"has the wrong type ({type(value).__name__}; it takes {self.kind.__name__})"
        if self.choices and value not in self.choices:
            return f"must be one of {list(self.choices)}, got {value!r}"
        if self.kind is float and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            shown = f"{value:g}" if isinstance(value, float) else repr(value)  # 0, not 0.0, for `--timeout 0`
            return f"must be {self.bounds}, got {shown}"
        return None

    @property
    def bounds(self) -> str:
        """The range it takes in words, e.g. ``from 1 to 1024`` or ``at least 0``."""
        def number(value: float) -> str:
            return str(int(value)) if value == int(value) else f"{value:g}"

        if self.low is not None and self.high is not None:
            return f"from {number(self.low)} to {number(self.high)}"
        return f"at least {number(self.low)}" if self.low is not None else f"at most {number(self.high)}"

    def check(self, value: Any) -> None:
        """ValueError naming the option where ``value`` is not one it takes."""
        complaint = self.complaint(value)
        if complaint:
            raise ValueError(f"`{self.name}` {complaint}")


EVAL_OPTIONS: tuple[Option, ...] = (
    Option("world_size", None, int, "ranks (default: the problem's smallest world size)", low=1, high=1024),
    Option("nodes", None, int, "nodes the ranks are split into, W/N GPUs each: NVLink inside a node, the network "
                               "between (default: the problem's; on one machine the nodes are virtual, docs/topology.md)",
           low=1, high=64),
    Option("mode", "auto", str, "auto picks cuda with W GPUs, shared-gpu with fewer, else cpu", choices=MODES),
    Option("trials", DEFAULT_TRIALS, int, "correctness trials, each with fresh secret seeds", low=1, high=100),
    Option("timeout", DEFAULT_TIMEOUT_S, float,
           "seconds any one step of an evaluation may take before its ranks are killed and the verdict is `timeout`, "
           "loading the candidate included (an import that hangs); a step whose ranks are compiling gets up to "
           f"{BUILD_ALLOWANCE_S:g} s more (pkb's build allowance), and time queued for pkb's build broker is not "
           "counted", low=1, high=3600),
    Option("perf", False, bool, "also time reference and candidate (speedup)"),
    Option("cuda_graph", False, bool, "with --perf in cuda mode: time CUDA-graph replays (for microsecond-scale "
                                      "problems)", served=False),
    Option("policy", "report", str, "forbid-collectives: a solution that calls torch.distributed, functional "
                                    "collectives, symm_mem fused ops or the reference on the hot path is `forbidden`",
           choices=POLICIES),
    Option("cases", "all", str, "which cases the correctness trials run: all (upstream + tests), upstream (the "
                                "upstream benchmark's inputs: the paper's protocol), tests, or benchmarks",
           choices=tuple(CASE_SELECTIONS)),
    Option("dtype", DEFAULT_PRECISION, str, f"the run's precision, as upstream's --dtype (default {DEFAULT_PRECISION}, "
                                            "the paper's): the inputs upstream builds from it follow it in every case; "
                                            "indices, scales and other dtypes of the function stay",
           choices=PRECISION_NAMES),
    Option("upstream_trials", UPSTREAM_TRIALS, int, f"trials of the upstream cases, which also decide the paper's verdict "
                                                    f"by upstream's rule (default {UPSTREAM_TRIALS}, upstream's; the run's "
                                                    "--trials where that is more)", low=1, high=100),
    Option("sandbox", "auto", str, "how candidate processes are confined (Landlock, namespaces, uid drop): auto (the "
                                   "default) applies every protection this machine offers and says which are missing; "
                                   "required refuses to run (exit 2) unless all are available; off runs candidates "
                                   "unconfined, for debugging only (its results are stored apart and reports flag them)",
           choices=SANDBOX_LEVELS, served=False),
)
# The numbers single commands take (not evaluation settings), declared here too so that every option of every
# command is checked the same way where it is parsed (pkb.commands.add_option).
COMMAND_OPTIONS: tuple[Option, ...] = (
    Option("parallel", None, int, "at most this many evaluations at once (default: as many as this machine holds, by "
                                  "its cores, memory and GPU memory at the run's world size; on Ray, as many as the "
                                  "cluster's nodes hold). Timed evaluations (--perf) always run alone, after the "
                                  "untimed ones", low=1, high=1024),
    Option("max_queue", 64, int, "evaluations queued or running at most; more are answered 429 busy (default 64)",
           low=1, high=1_000_000),
    Option("port", 0, int, "default: one the system picks, printed at start", low=0, high=65535),
    Option("samples", 1, int, "samples per problem (k of pass@k)", low=1, high=10_000),
    Option("concurrency", 4, int, "model calls in flight at once", low=1, high=1024),
    Option("steps", 10, int, "model turns at most (default 10)", low=1, high=10_000),
    Option("max_tokens", 16384, int, "most tokens in one answer", low=1, high=10_000_000),
    Option("request_timeout", 600.0, float, "seconds one model request may take", low=0.1, high=86_400),
    Option("retries", 5, int, "retries of a rate-limited, failed or timed-out request", low=0, high=100),
    Option("temperature", None, float, "default: the provider's", low=0, high=2),
)
OPTIONS = {option.name: option for option in EVAL_OPTIONS + COMMAND_OPTIONS}


SERVED_OPTIONS = tuple(option.name for option in EVAL_OPTIONS if option.served)


def default(name: str) -> Any:
    return OPTIONS[name].default


SERVED_SET = "served"  # the solution set of a request that names none
MAX_SOURCE_BYTES = 1 << 20

# Experiments (docs/reports.md, "Experiments"): every stored result belongs to one, and a report shows one experiment
# or compares several, never another's rows unasked. The user names one (`--experiment NAME`), else pkb does:
DEFAULT_EXPERIMENT = "default"  # `pkb run`, `pkb generate`, `pkb agent` (and rows from before experiments)
SERVED_EXPERIMENT = "served"  # a request to `pkb serve` that names none (service traffic; `pkb serve --experiment`)
RL_EXPERIMENT = "rl"  # the RL environments' judged turns (pkb.rl.common.judge): `rl`, or `rl:NAME`
TRAFFIC_EXPERIMENTS = {SERVED_EXPERIMENT: "service traffic", RL_EXPERIMENT: "RL traffic"}


def experiment_complaint(name: Any) -> str | None:
    """What is wrong with ``name`` as an experiment's name, or None: a non-empty string without a comma (a report
    takes a comma list of them)."""
    if not isinstance(name, str) or not name.strip():
        return f"an experiment needs a name, e.g. gpt5-sweep (got {name!r})"
    if "," in name:
        return f"an experiment's name has no comma (a report takes a comma list of them): {name!r}"
    return None


def is_rl_experiment(name: str) -> bool:
    """Whether ``name`` marks RL traffic: ``rl`` or ``rl:NAME``."""
    return name == RL_EXPERIMENT or name.startswith(RL_EXPERIMENT + ":")


def rl_experiment(name: str | None = None) -> str:
    """The experiment an RL environment's turns are stored under: ``rl``, or ``rl:NAME`` for an experiment a trainer
    names (``rl_experiment("week2") == "rl:week2"``; a name already marked so stays as it is)."""
    if not name:
        return RL_EXPERIMENT
    return name if is_rl_experiment(name) else f"{RL_EXPERIMENT}:{name}"


def traffic_kind(experiment: str) -> str | None:
    """``service traffic`` or ``RL traffic`` for an experiment of pkb's own naming (``served``, ``rl``, ``rl:NAME``),
    else None (a user's experiment)."""
    return TRAFFIC_EXPERIMENTS.get(RL_EXPERIMENT if is_rl_experiment(experiment) else experiment)


@dataclass(frozen=True)
class EvaluationRequest:
    """One evaluation as a client asks ``pkb serve`` for it: the served options of ``EVAL_OPTIONS``, and the
    candidate as text (``source``) or the problem's reference against itself (``reference``)."""

    problem: str | int
    source: str = ""
    reference: bool = False
    name: str = "candidate"
    solution_set: str = SERVED_SET
    experiment: str = ""  # "": the service's default (SERVED_EXPERIMENT unless `pkb serve --experiment` names one)
    world_size: int | None = default("world_size")
    nodes: int | None = default("nodes")
    mode: str = default("mode")
    cases: str = default("cases")
    trials: int = default("trials")
    upstream_trials: int = default("upstream_trials")
    dtype: str = default("dtype")
    perf: bool = default("perf")
    policy: str = default("policy")
    timeout: float = default("timeout")

    @classmethod
    def from_json(cls, body: Any) -> "EvaluationRequest":
        """The request a JSON body asks for; ValueError saying what to change."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object with at least `problem` and `source`")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}; known: {sorted(known)}")
        if body.get("reference") is True and "source" in body:
            raise ValueError("give `source` (a candidate file's text) or `reference: true` (the problem's reference "
                             "against itself), not both")
        missing = [name for name in ("problem", "source") if name not in body]
        if missing and not (missing == ["source"] and body.get("reference") is True):
            raise ValueError(f"missing {missing}: `problem` (slug or number) and `source` (the candidate file's text, "
                             "or `reference: true` for the problem's reference against itself)")
        request = cls(**body)
        request.check()
        return request

    def check(self) -> None:
        for name, kind in (("problem", (str, int)), ("source", str), ("reference", bool), ("name", str),
                           ("solution_set", str), ("experiment", str)):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"`{name}` has the wrong type ({type(value).__name__})")
        if self.experiment and experiment_complaint(self.experiment):
            raise ValueError(f"`experiment`: {experiment_complaint(self.experiment)}")
        if len(self.source.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"`source` is over {MAX_SOURCE_BYTES} bytes")
        for name in SERVED_OPTIONS:
            OPTIONS[name].check(getattr(self, name))

    def options(self) -> dict[str, Any]:
        """The served options as set, by name."""
        return {name: getattr(self, name) for name in SERVED_OPTIONS}


def request_options(**options: Any) -> dict[str, Any]:
    """``options`` as a request to ``pkb serve`` carries them: those given as None left out (the server's
    default), the rest checked (ValueError naming the option): the served options of ``EVAL_OPTIONS``,
    and ``name``, ``solution_set`` and ``experiment``."""
    chosen = {name: value for name, value in options.items() if value is not None}
    for name, value in chosen.items():
        if name in ("name", "solution_set"):
            if not isinstance(value, str):
                raise ValueError(f"`{name}` must be a string, got {value!r}")
        elif name == "experiment":
            if experiment_complaint(value):
                raise ValueError(f"`experiment`: {experiment_complaint(value)}")
        elif name in SERVED_OPTIONS:
            OPTIONS[name].check(value)
        else:
            takes = [*SERVED_OPTIONS, "name", "solution_set", "experiment"]
            close = difflib.get_close_matches(name, takes, n=1, cutoff=0.6)
            raise ValueError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                             + f" (a request takes {', '.join(takes)})")
    return chosen
