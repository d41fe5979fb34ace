"""The evaluation options and the verdicts, declared once, importable without torch.

Every way of asking for an evaluation reads them from here: ``pkb eval`` and ``pkb run`` (their flags are
made from ``EVAL_OPTIONS``), the evaluation service (``EvaluationRequest``: a request's JSON), the client
(``pkb.client``) and the RL environments; ``pkb.evaluate.config.EvalConfig`` takes its defaults and
choices from here. Each option has one name (``world_size``: ``--world-size`` on the command line,
``world_size`` in JSON), one default, its choices or its range, and one line of help.

    >>> EvaluationRequest.from_json({"problem": "allgather", "source": text, "trials": 1}).trials
    1
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from pkb.protocol import DEFAULT_PRECISION, PRECISION_NAMES, UPSTREAM_TRIALS


class Status(str, enum.Enum):
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

    def __str__(self) -> str:
        return self.value

    @property
    def is_verdict(self) -> bool:
        """False for pkb's own failures and the machine's (no verdict on the candidate: a rerun retries)."""
        return self not in (Status.HARNESS_ERROR, Status.INFRA_ERROR)


MODES = ("auto", "cpu", "cuda", "shared-gpu")
# What `--cases` selects for the correctness trials. `all` is the upstream cases and the tests; the
# benchmark shapes are checked after they are timed (--perf), or on their own with `benchmarks`.
CASE_SELECTIONS = {"all": ("upstream", "tests"), "upstream": ("upstream",), "tests": ("tests",),
                   "benchmarks": ("benchmarks",)}
POLICIES = ("report", "forbid-collectives")
SANDBOX_LEVELS = ("auto", "required", "off")
EXECUTORS = ("local", "ray")
DEFAULT_TRIALS = 3


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

    def check(self, value: Any) -> None:
        """ValueError naming the option where ``value`` is not one it takes."""
        if value is None and self.default is None:
            return
        kinds = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, kinds) or (self.kind is not bool and isinstance(value, bool)):
            raise ValueError(f"`{self.name}` has the wrong type ({type(value).__name__}; it takes {self.kind.__name__})")
        if self.choices and value not in self.choices:
            raise ValueError(f"`{self.name}` must be one of {list(self.choices)}, got {value!r}")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise ValueError(f"`{self.name}` must be in [{self.low:g}, {self.high:g}], got {value!r}")


EVAL_OPTIONS: tuple[Option, ...] = (
    Option("world_size", None, int, "ranks (default: the problem's smallest world size)", low=1, high=1024),
    Option("nodes", None, int, "nodes the ranks are split into, W/N GPUs each: NVLink inside a node, the network "
                               "between (default: the problem's; on one machine the nodes are virtual, docs/topology.md)",
           low=1, high=64),
    Option("mode", "auto", str, "auto picks cuda with W GPUs, shared-gpu with fewer, else cpu", choices=MODES),
    Option("trials", DEFAULT_TRIALS, int, "correctness trials, each with fresh secret seeds", low=1, high=100),
    Option("timeout", 120.0, float, "seconds one job may take before its ranks are killed", low=0.001, high=3600),
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
OPTIONS = {option.name: option for option in EVAL_OPTIONS}


SERVED_OPTIONS = tuple(option.name for option in EVAL_OPTIONS if option.served)


def default(name: str) -> Any:
    return OPTIONS[name].default


SERVED_SET = "served"  # the solution set of a request that names none
MAX_SOURCE_BYTES = 1 << 20


@dataclass(frozen=True)
class EvaluationRequest:
    """One evaluation as a client asks ``pkb serve`` for it: the served options of ``EVAL_OPTIONS``, and the
    candidate as text (``source``) or the problem's reference against itself (``reference``)."""

    problem: str | int
    source: str = ""
    reference: bool = False
    name: str = "candidate"
    solution_set: str = SERVED_SET
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
                           ("solution_set", str)):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"`{name}` has the wrong type ({type(value).__name__})")
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
    and ``name`` and ``solution_set``."""
    chosen = {name: value for name, value in options.items() if value is not None}
    for name, value in chosen.items():
        if name in ("name", "solution_set"):
            if not isinstance(value, str):
                raise ValueError(f"`{name}` must be a string, got {value!r}")
        elif name in SERVED_OPTIONS:
            OPTIONS[name].check(value)
        else:
            raise ValueError(f"unknown option {name!r}; a request takes {', '.join(SERVED_OPTIONS)}, name, solution_set")
    return chosen
