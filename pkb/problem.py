"""The contract every problem fills: Problem, Case, Cost, Tolerance.

One problem is one module under ``pkb/problems/`` that defines ``make_inputs``, ``reference``,
``cost`` and ``PROBLEM``. The dataclasses here are frozen and validated when the module is
loaded, so a broken problem fails at discovery with the module and the field named, not halfway
through a run.

Example (the whole of a problem, in miniature)::

    def make_inputs(case, rank, world_size, gen):
        return (torch.randn(case["shape"], generator=gen, device=gen.device),)

    def reference(tensor):
        out = tensor.clone(); dist.all_reduce(out); return out

    def cost(case, world_size):
        size = math.prod(case["shape"]) * 2
        return Cost(link_bytes=2 * (world_size - 1) / world_size * size, hbm_bytes=2 * size,
                    pattern="all_reduce")

    PROBLEM = Problem(name="allreduce", version=1, upstream_id=1, category="collectives", ...)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from pkb import protocol

CATEGORIES = (
    "collectives",
    "tensor_parallel",
    "expert_parallel",
    "context_parallel",
    "data_parallel",
    "beyond_llm",
    "inter_node",  # beyond upstream: W ranks on several nodes, NVLink inside a node, the network between (pkb.topology)
    "calibration",  # single-device probes that measure the machine (pkb.measure.probes), not in the suite
)

# The three kinds of case (docs/problem-format.md): the upstream benchmark's inputs, small awkward tests, model shapes.
CASE_KINDS = ("upstream", "tests", "benchmarks")

_SLUG = re.compile(r"^[a-z][a-z0-9_]*$")

# The run's precision (upstream's ``--dtype``; bf16 as in the paper). The harness sets ``case["dtype"]`` to
# its torch name on every case; ``make_inputs`` builds in it exactly the inputs that upstream's factory
# builds from its ``dtype`` argument. Dtypes that belong to the function (indices, fp32 master weights,
# scales) stay as the function has them, and a case never pins the precision itself.
PRECISIONS: Mapping[str, torch.dtype] = MappingProxyType(dict(zip(
    protocol.PRECISION_NAMES, (torch.bfloat16, torch.float16, torch.float32), strict=True)))
DEFAULT_PRECISION = protocol.DEFAULT_PRECISION

# What makes a tests case harder than the upstream inputs (issue: "say why a paper-correct sample fails
# strict cases"). Every tests case carries at least one; reports count failures under them.
CASE_TAGS: Mapping[str, str] = MappingProxyType({
    "uneven_sizes": "per-rank sizes, splits or counts differ between ranks",
    "empty_rank": "a rank holds no rows, tokens or splits",
    "odd_sizes": "sizes that are odd, prime or not a multiple of the vector width",
    "tiny": "a single element or a handful",
    "argument_value": "an argument value upstream never passes (another root, op, flag or option)",
    "skewed": "skewed data: hot experts or keys, imbalanced load",
    "layout": "a layout upstream never passes: non-contiguous, strided, another rank of tensor",
    "special_values": "values upstream's random inputs never hold: zeros, infinities, large magnitudes",
    "shape_regime": "another shape regime than upstream's (more heads, longer sequence, fewer rows than ranks)",
    "larger_world": "runs only at a world size larger than upstream's",
})


class ProblemError(ValueError):
    """A problem module breaks the contract; the message names the module and the field."""


@dataclass(frozen=True)
class Tolerance:
    """Elementwise closeness: ``|cand - ref| <= atol + rtol * |ref|``; NaNs must sit in the same places.

    ``Tolerance.exact()`` demands bit-equal values (data movement, integer outputs). Integer and bool
    outputs are always compared exactly, whatever the tolerance says. ``accumulation``: the RMS error an
    honest kernel's own order of a long local sum may reach in the run's arithmetic (a sequential fp32 loop
    over 1,024 rows; ``reduction_tolerance``'s ``local_terms``): pkb's accuracy rule allows an element
    ``ACCUMULATION_SIGMAS`` of it and an output's RMS error ``ACCUMULATION_RMS`` of it, however small the
    error of rounding the inputs (pkb.evaluate.accuracy). 0: no such sum. ``bias``: the relative bias, with its
    sign, an honest kernel in the run's arithmetic may carry because a term of that relative size, added on its
    own in the run's dtype, is lost (AdamW's decoupled weight decay, ``lr * wd`` below half an ulp of fp16 or
    bf16, leaves the parameter larger: +lr * wd; torch's clip coefficient max_norm / (norm + 1e-6) where the function
    divides by the norm alone); pkb's bias test allows a bias between 0 and it, and each element an error from 0 to
    that much of its value, on the values named in ``bias_on`` (pkb's paths: ``out[0]``, ``input[0]``, and the
    values inside them) or, where that is empty, on every value. 0: none.
    """

    atol: float
    rtol: float
    accumulation: float = 0.0
    bias: float = 0.0
    bias_on: tuple[str, ...] = ()

    def __post_init__(self):
        if self.atol < 0 or self.rtol < 0 or self.accumulation < 0:
            raise ProblemError(f"Tolerance: atol, rtol and accumulation must be >= 0, got atol={self.atol} "
                               f"rtol={self.rtol} accumulation={self.accumulation}")

    @staticmethod
    def exact() -> "Tolerance":
        return Tolerance(0.0, 0.0)

    @property
    def is_exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0


# Defaults by output dtype: room for the same math in fp32 with one rounding at the end and another
# reduction order. Problems whose error grows with the world size (reductions) pass a callable.
DEFAULT_TOLERANCES: Mapping[torch.dtype, Tolerance] = MappingProxyType({
    torch.float64: Tolerance(1e-9, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.float16: Tolerance(2e-3, 2e-3),
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2),
    torch.complex64: Tolerance(1e-4, 1e-4),
    torch.complex128: Tolerance(1e-9, 1e-7),
})

# fp8 types exist only on newer torch builds; add them where they do.
for _name, _tol in (("float8_e4m3fn", Tolerance(0.0, 0.0)), ("float8_e5m2", Tolerance(0.0, 0.0))):
    if hasattr(torch, _name):
        DEFAULT_TOLERANCES = MappingProxyType({**DEFAULT_TOLERANCES, getattr(torch, _name): _tol})


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    return DEFAULT_TOLERANCES.get(dtype, Tolerance.exact())


@dataclass(frozen=True)
class Case:
    """One named input configuration. ``params`` are read by ``make_inputs`` and ``cost``.

    ``world_sizes`` narrows the problem's world sizes for this case (``None``: all of them).
    ``slow_on_cpu``: the reference takes minutes on this case when it runs on the CPU: left out in ``cpu``
    mode, and the result says so; ``shared-gpu`` and ``cuda`` modes check it (their references run on
    the GPU; in shared-gpu mode the collectives are staged through host memory, pkb.runtime.gloo_bridge). For
    upstream cases whose defaults are that large, not a way around a slow reference.
    ``case["shape"]`` reads a parameter.
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    world_sizes: tuple[int, ...] | None = None
    note: str = ""
    slow_on_cpu: bool = False
    tags: tuple[str, ...] = ()
    kind: str = ""  # upstream, tests or benchmarks: set by the Problem that holds the case (CASE_KINDS)

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.\-]+$", self.name):
            raise ProblemError(f"Case name {self.name!r}: use letters, digits, '_', '-' and '.'")
        if "dtype" in self.params:
            raise ProblemError(f"Case {self.name!r}: the precision is the run's (--dtype; the harness sets "
                               "case['dtype']); a dtype that belongs to the function takes a parameter of its own")
        if "nodes" in self.params:
            raise ProblemError(f"Case {self.name!r}: the number of nodes is the run's (--nodes; the harness sets "
                               "case['nodes'] for a problem that runs on several)")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "tags", tuple(self.tags))
        unknown = [tag for tag in self.tags if tag not in CASE_TAGS]
        if unknown:
            raise ProblemError(f"Case {self.name!r}: unknown tags {unknown}; use those of pkb.problem.CASE_TAGS")
        if self.world_sizes is not None:
            object.__setattr__(self, "world_sizes", tuple(self.world_sizes))

    def __getitem__(self, key: str) -> Any:
        try:
            return self.params[key]
        except KeyError:
            raise KeyError(f"case {self.name!r} has no parameter {key!r} (has: {sorted(self.params)})") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    def runs_at(self, world_size: int) -> bool:
        return self.world_sizes is None or world_size in self.world_sizes

    def at_precision(self, precision: str, nodes: int | None = None) -> "Case":
        """This case with ``params["dtype"]`` set to the run's precision (a PRECISIONS key) and, where given,
        ``params["nodes"]`` to the run's number of nodes."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        run = {"dtype": str(PRECISIONS[precision]).removeprefix("torch."), **({"nodes": nodes} if nodes else {})}
        case = dataclasses.replace(self, params={k: v for k, v in self.params.items() if k not in run})
        object.__setattr__(case, "params", MappingProxyType({**case.params, **run}))
        return case


@dataclass(frozen=True)
class Cost:
    """What one call must do at least, per rank, for the roofline.

    link_bytes: bytes that must cross the interconnect into (or out of) each rank, counted the way
        nccl-tests counts bus bandwidth (all-reduce 2(W-1)/W of the buffer; all-gather,
        reduce-scatter, all-to-all (W-1)/W of the total; broadcast and reduce 1x the buffer); on
        several nodes, the NVLink part alone. busbw = link_bytes / time.
    network_bytes: bytes that must cross the network into (or out of) each rank, per direction, on a
        run of several nodes (pkb.topology): what goes between nodes, over the rank's NIC.
    flops: floating-point operations per rank (a multiply-add counts 2).
    hbm_bytes: device-memory bytes each rank must read and write at least.
    pattern: the communication pattern the byte count follows (documentation and reports).
    """

    link_bytes: float = 0.0
    network_bytes: float = 0.0
    flops: float = 0.0
    hbm_bytes: float = 0.0
    pattern: str = ""

    def __post_init__(self):
        for name in ("link_bytes", "network_bytes", "flops", "hbm_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ProblemError(f"Cost.{name} must be a number >= 0, got {value!r}")


ToleranceSpec = Tolerance | Callable[[Case, int], Tolerance] | None


@dataclass(frozen=True)
class Problem:
    """A workload: its reference, input generator, cost model, cases and tolerance.

    ``tolerance`` is a Tolerance for every output, a function ``(case, world_size) -> Tolerance`` or
    ``(case, world_size, dtype) -> Tolerance``, or ``None`` for the default of each output's dtype
    (``DEFAULT_TOLERANCES``).
    ``deterministic``: a second run on the same inputs must give bit-identical outputs.
    ``upstream``: the cases that reproduce the upstream benchmark's inputs at its defaults (its
    ``create_input_tensor`` at M = N = 1024, bf16: the same shapes, dtypes and argument kinds, with
    pkb's random rank-distinct values), so the paper's protocol can be rerun (``--cases upstream``).
    ``replicated_inputs``: every rank receives the same inputs because the workload replicates them
    (e.g. each rank decodes its own tiles of one latent); the suite then checks only that they are
    random, and that a local-only answer still fails.
    ``upstream_inputs``: ``(case, rank, world_size, trial, device) -> tuple``, the VALUES upstream's factory
    gives the ``upstream`` cases, bit for bit, for the paper's verdict (``upstream_values`` seeds the
    generators as upstream does first); ``make_inputs`` gives every case, the upstream ones included, pkb's
    secret random values.
    ``local_answer``: non-empty where the upstream function's answer needs no communication at all
    (say why): pkb keeps the upstream function, and the suite cannot require a local-only answer to
    fail. ``pkb show`` prints it, so users know a candidate may skip the collectives there.
    """

    name: str
    version: int
    upstream_id: int | None
    category: str
    source: str
    world_sizes: tuple[int, ...]
    tests: tuple[Case, ...]
    benchmarks: tuple[Case, ...]
    reference: Callable[..., Any]
    make_inputs: Callable[[Case, int, int, torch.Generator], tuple]
    cost: Callable[[Case, int], Cost]
    tolerance: ToleranceSpec = None
    upstream: tuple[Case, ...] = ()
    upstream_inputs: Callable[..., tuple] | None = None
    # the exact answer: the reference on the same inputs raised to fp64, in fp64 arithmetic throughout
    # (pkb.runtime.exact); None where a higher precision changes the answer's meaning (quantisation, ties, sampling):
    # the floating outputs are then judged against the reference's (pkb.evaluate.accuracy). ``exact_note`` says why.
    exact_dtype: torch.dtype | None = torch.float64
    exact_note: str = ""
    deterministic: bool = False
    # why the ranks may hold different values where the reference's hold the same (pkb.evaluate.agreement); "" (the
    # default): values the reference replicates on several ranks must be the candidate's bit for bit on them too
    replicas_may_differ: str = ""
    replicated_inputs: bool = False
    local_answer: str = ""
    # the run precisions upstream's reference runs in (PRECISIONS keys); another one is ``skipped``, with
    # ``precision_note`` as the reason
    precisions: tuple[str, ...] = tuple(PRECISIONS)
    precision_note: str = ""
    # why its inputs fill most of a GPU (e.g. upstream's 57 GB table): on GPUs, its evaluations run alone
    fills_a_gpu: str = ""
    # the numbers of nodes it runs on (--nodes; the first is the default): (1,) for a problem of one node;
    # a problem of several reads ``case["nodes"]`` (pkb.topology: W ranks on N nodes of W/N GPUs)
    nodes: tuple[int, ...] = (1,)
    module: str = ""  # filled in by discovery: the dotted module name

    def __post_init__(self):
        where = f"problem {self.name!r}"
        for kind in CASE_KINDS:  # each case knows which list holds it
            object.__setattr__(self, kind, tuple(dataclasses.replace(c, kind=kind) if isinstance(c, Case) else c
                                                 for c in getattr(self, kind)))
        object.__setattr__(self, "world_sizes", tuple(self.world_sizes))
        object.__setattr__(self, "precisions", tuple(self.precisions))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not isinstance(self.name, str) or not _SLUG.match(self.name):
            raise ProblemError(f"{where}: name must be a lowercase slug like 'allgather_gemm'")
        if not isinstance(self.version, int) or self.version < 1:
            raise ProblemError(f"{where}: version must be an int >= 1, got {self.version!r}")
        if self.upstream_id is not None and not (isinstance(self.upstream_id, int) and self.upstream_id > 0):
            raise ProblemError(f"{where}: upstream_id must be a positive int or None")
        if self.category not in CATEGORIES:
            raise ProblemError(f"{where}: category {self.category!r} is not one of {CATEGORIES}")
        if not self.world_sizes or any(not isinstance(w, int) or w < 1 for w in self.world_sizes):
            raise ProblemError(f"{where}: world_sizes must be positive ints, got {self.world_sizes!r}")
        if not self.tests:
            raise ProblemError(f"{where}: tests must hold at least one Case")
        if not self.nodes or any(not isinstance(n, int) or n < 1 for n in self.nodes):
            raise ProblemError(f"{where}: nodes must be positive ints, got {self.nodes!r}")
        if (self.category == "inter_node") != (min(self.nodes) > 1):
            raise ProblemError(f"{where}: a problem of category inter_node runs on 2 or more nodes, and only it does")
        if DEFAULT_PRECISION not in self.precisions or not set(self.precisions) <= set(PRECISIONS):
            raise ProblemError(f"{where}: precisions must include {DEFAULT_PRECISION!r} and name only {tuple(PRECISIONS)}")
        if set(self.precisions) != set(PRECISIONS) and not self.precision_note:
            raise ProblemError(f"{where}: say in precision_note why it does not run in every precision")
        for kind in CASE_KINDS:
            if any(not isinstance(c, Case) for c in getattr(self, kind)):
                raise ProblemError(f"{where}: {kind} must hold Case objects")
        names = [c.name for kind in CASE_KINDS for c in getattr(self, kind)]
        if len(set(names)) != len(names):
            raise ProblemError(f"{where}: case names must be unique across upstream, tests and benchmarks: {names}")
        for fn_name in ("reference", "make_inputs", "cost"):
            if not callable(getattr(self, fn_name)):
                raise ProblemError(f"{where}: {fn_name} must be callable")
        if self.exact_dtype not in (torch.float64, None):
            raise ProblemError(f"{where}: exact_dtype must be torch.float64 (the exact answer computes in fp64 "
                               "throughout: pkb.runtime.exact) or None (a problem whose meaning lies in its rounding)")
        if self.exact_dtype is not torch.float64 and not self.exact_note:
            raise ProblemError(f"{where}: say in exact_note why the exact answer is not computed in fp64")
        if self.upstream and self.upstream_inputs is None:
            raise ProblemError(f"{where}: upstream cases need upstream_inputs, upstream's own values of them (the paper's "
                               "verdict runs on those)")
        if self.upstream_inputs is not None:
            params = list(inspect.signature(self.upstream_inputs).parameters)
            if len(params) != 5:
                raise ProblemError(f"{where}: upstream_inputs must take (case, rank, world_size, trial, device), has {params}")
        params = list(inspect.signature(self.make_inputs).parameters)
        if len(params) != 4:
            raise ProblemError(f"{where}: make_inputs must take (case, rank, world_size, gen), has {params}")
        if not (self.tolerance is None or isinstance(self.tolerance, Tolerance) or callable(self.tolerance)):
            raise ProblemError(f"{where}: tolerance must be a Tolerance, a function or None")

    @property
    def argument_names(self) -> tuple[str, ...]:
        """The reference's (and so the candidate's) argument list, e.g. ('tensor', 'src')."""
        return tuple(inspect.signature(self.reference).parameters)

    def cases(self, kind: str, world_size: int, precision: str = DEFAULT_PRECISION,
              nodes: int | None = None) -> tuple[Case, ...]:
        """The ``upstream``, ``tests`` or ``benchmarks`` cases that run at ``world_size``, in ``precision``, on
        ``nodes`` nodes (None: the problem's default; a problem of one node ignores it)."""
        if kind not in CASE_KINDS:
            raise ValueError(f"kind must be one of {CASE_KINDS}, got {kind!r}")
        return tuple(c.at_precision(precision, self._run_nodes(nodes)) for c in getattr(self, kind) if c.runs_at(world_size))

    def _run_nodes(self, nodes: int | None) -> int | None:
        """What ``case["nodes"]`` holds for a run on ``nodes`` nodes: None (no such parameter) on one node."""
        return None if self.nodes == (1,) else nodes or self.nodes[0]

    def runs_on(self, world_size: int, nodes: int) -> bool:
        """Whether ``world_size`` ranks on ``nodes`` nodes is a topology this problem runs on."""
        return world_size in self.world_sizes and nodes in self.nodes and world_size % nodes == 0

    @property
    def all_cases(self) -> tuple[Case, ...]:
        """Every case, in the default precision (and on the problem's default number of nodes)."""
        return tuple(c.at_precision(DEFAULT_PRECISION, self._run_nodes(None)) for c in self.upstream + self.tests + self.benchmarks)

    def find_case(self, name: str, precision: str = DEFAULT_PRECISION, nodes: int | None = None) -> Case:
        for case in self.upstream + self.tests + self.benchmarks:
            if case.name == name:
                return case.at_precision(precision, self._run_nodes(nodes))
        names = [c.name for c in self.all_cases]
        raise KeyError(f"problem {self.name!r} has no case {name!r}; cases: {', '.join(names)}")

    def upstream_values(self, case: Case, rank: int, world_size: int, trial: int, device) -> tuple:
        """The inputs upstream's factory gives ``rank`` in ``trial`` of an upstream case (the paper's verdict):
        the generators seeded as upstream seeds them for most problems (``upstream_seed``; a problem whose
        factory branch seeds otherwise seeds again in its ``upstream_inputs``), then its draws."""
        if self.upstream_inputs is None or case.kind != "upstream":
            raise ValueError(f"{self.name}: no upstream values for case {case.name!r}")
        upstream_seed(self.upstream_id, rank, trial)
        inputs = self.upstream_inputs(case, rank, world_size, trial, device)
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def tolerance_for(self, case: Case, world_size: int, dtype: torch.dtype) -> Tolerance:
        """The tolerance for an output of ``dtype``; a tolerance function may take ``(case, world_size)``
        or ``(case, world_size, dtype)`` (one rule per output dtype, e.g. fp8 payload vs fp32 scales)."""
        if self.tolerance is None:
            return default_tolerance(dtype)
        if isinstance(self.tolerance, Tolerance):
            return self.tolerance
        if len(inspect.signature(self.tolerance).parameters) >= 3:
            return self.tolerance(case, world_size, dtype)
        return self.tolerance(case, world_size)


# The unit roundoff (half an ulp at 1.0) of each floating dtype.
# an element may be off by this many of an honest order's accumulation RMS error: a sequential loop's error is a sum
# of roundings of running sums that wander, heavier-tailed than a bell (400,000 simulated columns: 4e-5 to 9e-5 of
# them past 6, the worst at 9.4; a benchmark's 70,000 columns would see a few)
ACCUMULATION_SIGMAS = 10.0
ACCUMULATION_RMS = 2.0  # and an output's RMS error this many (an honest order's is about one)
_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def reduction_tolerance(dtype: torch.dtype, num_terms: int, scale: float = 1.0, local_terms: int = 1) -> Tolerance:
    """Tolerance for a sum of ``num_terms`` values of magnitude ``scale`` (e.g. one per rank) in ``dtype``, each
    itself a local sum of ``local_terms`` terms (a GEMM's K shard, a column's rows).

    An honest kernel may accumulate in ``dtype`` in any order (a ring rounds after each of the
    ``num_terms - 1`` additions) while the reference rounds once from fp32, or itself sums in ``dtype``
    in another order (references that round as upstream's do). Measured on 4M N(0,1) elements in bf16,
    the largest error beyond ``rtol * |ref|`` was 0.030 at 4 terms, 0.066 at 8 and 0.18 at 16 against a
    reference rounded once, and 0.031 at 4 and 0.086 at 8 between two bf16 orders; ``atol = u * n *
    (2 + sqrt(n)) * scale`` is about twice the first at each size, and a result missing even one term of
    magnitude ``scale`` is off by far more.

    The local sums may run in any order too, in fp32 (bf16 and fp16 runs) or in the run's own arithmetic (fp32 and
    fp64): a sequential loop rounds each running sum ``S_k`` once, a random walk to ``scale`` whose errors add up to
    an RMS of ``u_acc * scale * sqrt((local_terms + 1) / 6)`` per local sum (``sqrt(num_terms)`` times that over the
    ``num_terms``): ``Tolerance.accumulation``, and ``ACCUMULATION_SIGMAS`` of it are added to ``atol``. In fp32 at
    1,024 rows that is some 13 unit roundoffs of the sum's size, where torch's blocked sum errs by about 2.
    """
    u = _UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return Tolerance.exact()
    n = max(int(num_terms), 1)
    u_acc = min(u, _UNIT_ROUNDOFF[torch.float32])
    accumulation = u_acc * scale * math.sqrt(n * (local_terms + 1) / 6) if local_terms > 1 else 0.0
    return Tolerance(atol=u * n * (2.0 + n**0.5) * scale + ACCUMULATION_SIGMAS * accumulation, rtol=4.0 * u,
                     accumulation=accumulation)


# Dtypes a tensor of the inputs is raised from, to the exact answer's dtype (fp8 payloads, integers and bools stay).
_RAISED_FROM = (torch.bfloat16, torch.float16, torch.float32, torch.complex64)


def raised(value: Any, dtype: torch.dtype, memo: dict | None = None) -> Any:
    """``value`` (a call's inputs) with its floating tensors, modules and gradients raised to ``dtype`` (torch.float64
    or torch.float32; complex to the matching complex dtype) where they hold fewer bits: the inputs of the exact
    answer. The values are the same numbers (raising is exact); integers, bools, fp8, numbers, process groups and
    other objects are kept; a tensor that appears twice is raised once (``memo``), so aliases stay aliases.

        >>> raised((torch.ones(2, dtype=torch.bfloat16), 3), torch.float64)[0].dtype
        torch.float64
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = _raised_tensor(value, dtype)
        return memo[id(value)]
    if isinstance(value, torch.nn.Module):
        return value.to(dtype) if id(value) not in memo else memo[id(value)]
    if isinstance(value, (list, tuple)):
        items = [raised(item, dtype, memo) for item in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return type(value)((key, raised(item, dtype, memo)) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: raised(getattr(value, f.name), dtype, memo)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _raised_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    target = (torch.complex128 if dtype == torch.float64 else torch.complex64) if tensor.is_complex() else dtype
    if tensor.dtype not in _RAISED_FROM or tensor.dtype.itemsize >= target.itemsize:
        return tensor
    grad = tensor.grad
    out = tensor.detach().to(target)
    if isinstance(tensor, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:
        out.requires_grad_(True)
    if grad is not None:
        out.grad = _raised_tensor(grad, dtype)
    return out


# Upstream's factory (``create_input_tensor``) at the defaults of its launchers: base_shape = (M, N).
UPSTREAM_BASE_SHAPE = (1024, 1024)


def upstream_seed(problem_id: int, rank: int, trial: int) -> None:
    """Seed this process's generators (the CPU's and every GPU's) as upstream's factory does before it draws
    a problem's inputs: ``torch.manual_seed(42 + 1000 * problem_id + rank + 1_000_003 * trial)``. The draws
    that follow (``torch.randn(..., device=device)`` and the like, in upstream's order) then give upstream's
    very tensors: on the CPU the values its factory gives with ``device="cpu"``, on a GPU those it gives on
    any GPU (one Philox stream per seed, whichever device)."""
    torch.manual_seed(42 + 1000 * problem_id + rank + 1_000_003 * trial)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Normal random values on ``gen``'s device, drawn in fp32 and cast (so every dtype sees one stream)."""
    values = torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32)
    if scale != 1.0:
        values = values * scale
    return values.to(dtype)


class RankGenerator(torch.Generator):
    """The ``gen`` that ``make_inputs`` receives: seeded for this rank, this case and this trial.

    ``gen.shared`` is a second generator seeded the same on every rank, for data that the workload
    replicates (token ids every TP rank sees, weights every DP rank holds). Everything else is drawn
    from ``gen`` itself and so differs per rank. Both live on the rank's device (``gen.device``).
    """

    shared: torch.Generator


def make_generator(seed: int, shared_seed: int, device: torch.device | str = "cpu") -> RankGenerator:
    gen = RankGenerator(device=device)
    gen.manual_seed(seed)
    gen.shared = torch.Generator(device=device)
    gen.shared.manual_seed(shared_seed)
    return gen
