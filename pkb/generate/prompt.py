"""The prompt for one problem, and the feedback the agent loop sends after each evaluation.

Built from objects only: the problem (its module's source, a case's per-rank shapes and dtypes,
its cost and tolerance), a hardware profile (``pkb.hardware.profiles``), the helpers in
``pkb.kernels`` (their docstring and signatures) and one shipped solution as a worked example.
The wording lives in ``pkb.generate.templates``.

    >>> prompt = build_prompt(get_problem("allgather"), backend="cuda", profile=get_profile("h200_sxm_x8"))
    >>> print(prompt.system, prompt.user)
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pkb import syntax
from pkb.generate import templates

if TYPE_CHECKING:  # importing pkb.problem means torch: not needed to build the CLI's parser
    from pkb.problem import Case, Problem

BACKENDS = tuple(templates.BACKEND_GOALS)
DEFAULT_HARDWARE = "h200_sxm_x8"
SOLUTIONS_DIR = Path(__file__).resolve().parents[1] / "solutions"
COMMON_MODULE = "pkb.solutions._cuda_common"

# Worked examples per backend, in order of preference: (problem slug, shipped solution file). The
# first whose problem is not the one asked about is used, so no prompt contains its own answer.
EXAMPLES = {
    "cuda": (("allreduce", "1_allreduce_cuda_peer.py"), ("allgather", "2_allgather_cuda_peer.py")),
    "triton": (("reducescatter", "7_reducescatter_triton.py"), ("allreduce", "1_allreduce_cuda_peer.py")),
}


class PromptError(Exception):
    """The prompt cannot be built as asked (unknown backend, hardware profile unavailable)."""


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    problem: str
    case: str
    world_size: int
    backend: str
    hardware: str
    kind: str = "pkb"  # pkb's own prompt, or the upstream benchmark's (pkb.generate.upstream_prompt)
    precision: str = "bf16"  # the run's precision (pkb.problem.PRECISIONS), which the prompt states

    def __str__(self) -> str:
        return f"{self.system}\n\n{self.user}"


def load_profile(name: str | None = None):
    """The hardware profile ``name`` (default h200_sxm_x8) from ``pkb.hardware.profiles``."""
    try:
        from pkb.hardware.profiles import get_profile
    except ImportError as exc:
        raise PromptError(f"hardware profiles are not available in this pkb ({exc}); prompts describe the machine "
                          "from pkb.hardware.profiles") from None
    try:
        return get_profile(name or DEFAULT_HARDWARE)
    except (KeyError, ValueError) as exc:
        raise PromptError(str(exc.args[0] if exc.args else exc)) from None


def build_prompt(problem: Problem, backend: str, profile, case: Case | None = None,
                 world_size: int | None = None, precision: str | None = None, nodes: int | None = None) -> Prompt:
    """The prompt for ``problem`` at ``world_size`` (default: the profile's GPU count if the problem runs
    at it, else its largest world size) on ``nodes`` nodes (default: the problem's) in ``precision``, showing
    ``case`` (default: the first benchmark at that size, else the first test; precision: the default, bf16)."""
    from pkb.problem import DEFAULT_PRECISION, PRECISIONS

    precision = precision or DEFAULT_PRECISION
    if backend not in BACKENDS:
        raise PromptError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if precision not in problem.precisions:
        raise PromptError(f"{problem.name} runs in {', '.join(problem.precisions)}, not {precision}: "
                          f"{problem.precision_note}")
    world_size = world_size or default_world_size(problem, profile)
    nodes = nodes or problem.nodes[0]
    if not problem.runs_on(world_size, nodes):
        raise PromptError(f"{problem.name} runs on {' or '.join(map(str, problem.nodes))} node(s) that divide the "
                          f"world size, not {nodes} at W = {world_size}")
    case = problem.find_case((case or default_case(problem, world_size)).name, precision, nodes)
    sections = [
        templates.TASK.format(name=problem.name, source=problem.source, arguments=_arguments(problem),
                              world_size=world_size, world_sizes=", ".join(map(str, problem.world_sizes)),
                              backend_goal=templates.BACKEND_GOALS[backend],
                              communication=communication_text(problem, case, world_size, nodes)),
        templates.PRECISION.format(precision=precision, dtype=PRECISIONS[precision]),
        hardware_section(profile),
        *([topology_section(world_size, nodes, profile)] if nodes > 1 else []),
        reference_section(problem),
        case_section(problem, case, world_size, profile),
        tolerance_section(problem, case, world_size),
        helpers_section(),
        example_section(problem, backend),
        templates.ANSWER_FORMAT.format(arguments=_arguments(problem)),
    ]
    return Prompt(templates.SYSTEM, "\n".join(sections), problem.name, case.name, world_size, backend, profile.name,
                  precision=precision)


def default_world_size(problem: Problem, profile) -> int:
    num_gpus = getattr(profile, "num_gpus", None)
    return num_gpus if num_gpus in problem.world_sizes else max(problem.world_sizes)


def default_case(problem: Problem, world_size: int) -> Case:
    cases = problem.cases("benchmarks", world_size) or problem.cases("tests", world_size)
    if not cases:
        raise PromptError(f"{problem.name} has no case at world size {world_size}; "
                          f"it runs at {list(problem.world_sizes)}")
    return cases[0]


# -- sections -------------------------------------------------------------------------------------------


def hardware_section(profile) -> str:
    return templates.HARDWARE.format(
        name=profile.name, description=profile.description, num_gpus=profile.num_gpus, gpu_model=profile.gpu_model,
        interconnect=profile.interconnect, link_gbps=_number(profile.link_gbps), latency_us=_number(profile.latency_us),
        nvls=templates.NVLS_YES if profile.nvls else templates.NVLS_NO, hbm=_bytes(profile.hbm_bytes),
        hbm_gbps=_number(profile.hbm_gbps), l2=_bytes(profile.l2_bytes), bf16_tflops=_number(profile.bf16_tflops),
        fp8_tflops=_number(profile.fp8_tflops))


def communication_text(problem: Problem, case: Case, world_size: int, nodes: int) -> str:
    """Where the file's own kernels move the data and where torch.distributed does: on one node all of it in
    its kernels; on several, its kernels inside a node and torch.distributed between nodes (and, for a problem
    that moves nothing over NVLink, torch.distributed for all of it)."""
    if nodes == 1:
        return templates.COMMUNICATION
    if not problem.cost(case, world_size).link_bytes:
        return templates.COMMUNICATION_NODES + "\n" + templates.NO_NVLINK_LEG
    return templates.COMMUNICATION_NODES


def topology_section(world_size: int, nodes: int, profile) -> str:
    from pkb.topology import Topology

    topology = Topology(world_size, nodes, network_gbps=profile.network_gbps)
    return templates.TOPOLOGY.format(num_nodes=nodes, description=topology.describe(nvlink_gbps=profile.link_gbps))


def reference_section(problem: Problem) -> str:
    module = sys.modules[problem.reference.__module__]
    parts = [templates.REFERENCE.format(module=module.__name__, source=inspect.getsource(module).rstrip())]
    for helper in _helper_modules(module):
        parts.append(templates.HELPER_MODULE.format(module=helper.__name__, source=inspect.getsource(helper).rstrip()))
    return "\n".join(parts)


def case_section(problem: Problem, case: Case, world_size: int, profile) -> str:
    from pkb.describe import describe, human_bytes, shapes_of_inputs

    ranks = []
    for rank in range(world_size):
        inputs = shapes_of_inputs(problem, case, rank, world_size)
        ranks.append(f"  rank {rank}: " + ", ".join(f"{name}={describe(value)}"
                                                   for name, value in zip(problem.argument_names, inputs)))
    cost = problem.cost(case, world_size)
    network = f"{human_bytes(cost.network_bytes)} over the network between nodes, " if cost.network_bytes else ""
    cost_text = (f"{human_bytes(cost.link_bytes)} over the interconnect, {network}{cost.flops:.3g} flop, "
                 f"{human_bytes(cost.hbm_bytes)} of HBM traffic" + (f" ({cost.pattern})" if cost.pattern else ""))
    tests = "; ".join(f"`{c.name}` {dict(c.params)}" for c in problem.cases("tests", world_size, nodes=case.get("nodes")))
    benchmarks = problem.cases("benchmarks", world_size)
    timed = ("the benchmark cases " + ", ".join(f"`{c.name}`" for c in benchmarks)) if benchmarks else "the test cases"
    return templates.CASE.format(case=case.name, world_size=world_size, note=f" ({case.note})" if case.note else "",
                                 params=dict(case.params), ranks="\n".join(ranks), tests=tests, timed=timed,
                                 cost=cost_text, roofline=_roofline_text(cost, profile, world_size))


def _roofline_text(cost, profile, world_size: int) -> str:
    try:
        from pkb.hardware.roofline import roofline
    except ImportError:  # a pkb without the roofline module: the prompt still has the cost and the hardware
        return ""
    bound = roofline(cost, profile, world_size)
    return templates.ROOFLINE.format(bound_us=bound.bound_s * 1e6, bound_by=bound.bound_by, link_us=bound.link_s * 1e6,
                                     network=f"network {bound.network_s * 1e6:.3g} us, " if bound.network_s else "",
                                     latency_us=bound.latency_s * 1e6, compute_us=bound.compute_s * 1e6,
                                     memory_us=bound.memory_s * 1e6)


def tolerance_section(problem: Problem, case: Case, world_size: int) -> str:
    import torch

    from pkb.describe import shapes_of_inputs
    from pkb.evaluate.accuracy import FACTOR

    dtypes = sorted({t.dtype for t in _tensors(shapes_of_inputs(problem, case, 0, world_size))
                     if t.dtype.is_floating_point or t.dtype.is_complex}, key=str) or [torch.float32]
    tolerances = ", ".join(f"{str(d).replace('torch.', '')}: atol={tol.atol:.3g}, rtol={tol.rtol:.3g}"
                           for d in dtypes for tol in [problem.tolerance_for(case, world_size, d)])
    if problem.exact_dtype is None:
        floats = templates.FLOATS_TOLERANCE.format(tolerances=tolerances, note=problem.exact_note)
    else:
        floats = templates.FLOATS_EXACT.format(exact=str(problem.exact_dtype).removeprefix("torch."),
                                               factor=FACTOR, tolerances=tolerances)
    return templates.TOLERANCE.format(floats=floats)


def helpers_section() -> str:
    import pkb.kernels as kernels

    names = ("load_cuda", "compile_cuda_extension", "symmetric_buffer")
    signatures = [f"  {name}{inspect.signature(getattr(kernels, name))}" for name in names]
    buffer = kernels.SymmetricBuffer
    members = [f"  SymmetricBuffer.{n}" + ("" if isinstance(getattr(buffer, n), property)
                                           else str(inspect.signature(getattr(buffer, n))))
               for n in ("local", "buffer_ptrs", "buffer_ptrs_dev", "signal_pad_ptrs_dev", "peer", "barrier")
               if hasattr(buffer, n)]
    return templates.HELPERS.format(doc=inspect.cleandoc(kernels.__doc__ or ""), signatures="\n".join(signatures + members))


def example_section(problem: Problem, backend: str) -> str:
    from pkb.registry import get_problem

    slug, filename = next((s, f) for s, f in EXAMPLES[backend] if s != problem.name)
    example = get_problem(slug)
    common = importlib.import_module(COMMON_MODULE)
    return templates.EXAMPLE.format(
        name=slug, reference=_reference_with_docstring(example).rstrip(), solution_file=filename,
        solution=(SOLUTIONS_DIR / filename).read_text().rstrip(), common_module=COMMON_MODULE,
        common=inspect.getsource(common).rstrip())


# -- agent feedback -----------------------------------------------------------------------------------------

DETAIL_CHARS = 6000  # of a traceback, compiler output or rank log shown to the model


def feedback(problem: Problem, step: int, result=None) -> str:
    """What the model sees after its file of ``step`` was judged: ``result`` is the EvalResult, or
    None when the answer held no code."""
    if result is None:
        status, body = "no_code", templates.FEEDBACK_NO_CODE
    elif result.ok:
        status, body = "ok", _feedback_ok(result)
    else:
        status, body = result.status.value, templates.FEEDBACK_FAILED.format(message=result.message,
                                                                           details=_failure_details(result))
    return templates.FEEDBACK.format(step=step, status=status, body=body.strip(), arguments=_arguments(problem))


def _feedback_ok(result) -> str:
    timings = "".join(templates.FEEDBACK_TIMING.format(case=t.case, reference_us=t.reference_s * 1e6,
                                                       candidate_us=t.candidate_s * 1e6, speedup=t.speedup)
                      for t in result.timings)
    if result.speedup is not None:
        timings += f"Overall speedup (geometric mean): {result.speedup:.2f}x\n"
    if result.timings and not result.times_are_gpu_performance:
        timings += templates.FEEDBACK_NOT_GPU.format(mode=result.mode)
    roofline = (f"{100 * result.roofline_fraction:.1f}% of the hardware roofline.\n"
                if result.roofline_fraction is not None else "")
    return templates.FEEDBACK_OK.format(message=result.message, timings=timings, roofline=roofline)


def _failure_details(result) -> str:
    parts: list[str] = []  # a mismatch is described in full by the message: rank, case, output, worst elements
    for key in ("error", "traceback", "log_tail"):
        text = str(getattr(result.details, key) or "").strip()
        if text and not any(text in p for p in parts):
            label = {"error": "Error", "traceback": "Traceback", "log_tail": "Rank output (tail)"}[key]
            parts.append(f"{label}:\n```\n{text[-DETAIL_CHARS:]}\n```")
    return "\n".join(parts)


# -- pieces ------------------------------------------------------------------------------------------------


def _arguments(problem: Problem) -> str:
    return ", ".join(problem.argument_names)


def _reference_with_docstring(problem: Problem) -> str:
    module = sys.modules[problem.reference.__module__]
    return f'"""{inspect.cleandoc(module.__doc__ or "")}"""\n\n' + inspect.getsource(problem.reference)


def _helper_modules(module) -> list:
    """The suite's private modules (``pkb.problems.*._name``) that a problem module imports from."""
    found = []
    for node in syntax.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("pkb.problems"):
            helper = importlib.import_module(node.module)
            if helper.__name__.rsplit(".", 1)[-1].startswith("_") and helper not in found:
                found.append(helper)
    return found


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _number(value) -> str:
    return "unknown" if value is None else f"{value:g}"


def _bytes(value) -> str:
    from pkb.describe import human_bytes

    return "unknown" if value is None else human_bytes(value)
