"""No-device tests: the problem contract, discovery, selection, and the collectives' cost formulas."""

from __future__ import annotations

import re

import pytest
import torch

from pkb.problem import Case, Cost, Problem, ProblemError, Tolerance, make_generator, reduction_tolerance
from pkb.registry import UnknownProblem, all_problems, get_problem, select, selection_text

COLLECTIVES = ["allreduce", "allgather", "broadcast", "reduce", "scatter", "gather", "reducescatter", "alltoall"]


def _problem(**overrides) -> Problem:
    def make_inputs(case, rank, world_size, gen):
        return (torch.randn(3, generator=gen),)

    fields = dict(name="toy", version=1, upstream_id=None, category="collectives", source="test",
                  world_sizes=(2,), tests=[Case("a", {"n": 3})], benchmarks=[], reference=lambda tensor: tensor,
                  make_inputs=make_inputs, cost=lambda case, world_size: Cost())
    fields.update(overrides)
    return Problem(**fields)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("name", "Bad Name", "lowercase slug"),
    ("version", 0, "version must be an int >= 1"),
    ("category", "misc", "is not one of"),
    ("world_sizes", (), "world_sizes must be positive"),
    ("tests", [], "at least one Case"),
    ("tests", [Case("a"), Case("a")], "case names must be unique"),
    ("make_inputs", lambda case, rank: (), "make_inputs must take (case, rank, world_size, gen)"),
    ("tolerance", 0.1, "tolerance must be"),
])
def test_contract_violations_name_the_problem_and_the_field(field, value, message):
    with pytest.raises(ProblemError, match=re.escape(message)) as info:
        _problem(**{field: value})
    assert "toy" in str(info.value) or field == "name"


def test_cost_and_tolerance_reject_negative_numbers():
    with pytest.raises(ProblemError, match="Cost.link_bytes"):
        Cost(link_bytes=-1)
    with pytest.raises(ProblemError, match="atol, rtol and accumulation must be >= 0, got atol=-0.001"):
        Tolerance(-1e-3, 0)
    with pytest.raises(ProblemError, match="accumulation=-1"):
        Tolerance(0.0, 0.0, accumulation=-1.0)


def test_case_parameters_are_read_only_and_missing_ones_are_named():
    case = Case("odd", {"shape": (3, 5)})
    assert case["shape"] == (3, 5)
    with pytest.raises(TypeError):
        case.params["shape"] = (1,)
    with pytest.raises(KeyError, match="has no parameter 'dtype'"):
        case["dtype"]


def test_suite_is_discovered_in_upstream_order_and_found_by_slug_or_number():
    problems = all_problems()
    assert list(problems)[:8] == COLLECTIVES
    assert get_problem("allgather") is get_problem(2) is get_problem("2")
    numbers = [p.upstream_id for p in problems.values() if p.upstream_id is not None]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    for problem in problems.values():
        assert problem.module.startswith("pkb.problems."), problem.name


def test_an_unknown_problem_suggests_the_closest_names_not_all_of_them():
    with pytest.raises(UnknownProblem) as raised:
        get_problem("allreduse")
    message = str(raised.value)
    assert message.startswith("unknown problem 'allreduse'; did you mean 1 allreduce") and "`pkb list`" in message
    assert len(message) < 300 and "ulysses" not in message  # a sentence, not the 95 names
    with pytest.raises(UnknownProblem, match=r"did you mean .*12 allgather_gemm"):
        get_problem("gemm")  # a word of a slug
    with pytest.raises(UnknownProblem, match=r"^unknown problem 'zzz'; `pkb list` shows all"):
        get_problem("zzz")


def test_selection_takes_ranges_numbers_slugs_and_categories():
    assert [p.name for p in select("1-3,8,gather")] == ["allreduce", "allgather", "broadcast", "gather", "alltoall"]
    assert [p.name for p in select("collectives")] == COLLECTIVES
    assert len(select(None)) == len(all_problems())
    with pytest.raises(UnknownProblem):
        select("1-3,nonexistent")


def test_a_selection_written_out_reads_back_as_the_same_problems():
    names = {"allreduce", "allgather", "broadcast", "gather", "gemm_allreduce", "hierarchical_allreduce"}
    assert selection_text(names) == "1-3,6,13,hierarchical_allreduce"
    assert {p.name for p in select(selection_text(names))} == names
    assert {p.name for p in select(selection_text(all_problems()))} == set(all_problems())


@pytest.mark.parametrize("problem", list(all_problems().values()), ids=lambda p: p.name)
def test_every_problem_has_rank_distinct_random_inputs_and_a_cost(problem):
    """Honest inputs: two ranks never get the same tensors, and no tensor is constant."""
    world_size = problem.world_sizes[0]
    case = problem.cases("tests", world_size)[0]
    by_rank = [problem.make_inputs(case, rank, world_size, make_generator(100 + rank, 7)) for rank in range(world_size)]
    floats = [[t.to_dense() if t.is_sparse else t  # a sparse argument (upstream's kind) is judged by its values
               for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1]
              for inputs in by_rank]
    for tensors in floats:
        for tensor in tensors:
            assert tensor.float().std() > 0, f"{problem.name}: a constant input tensor"
    if floats[0] and floats[1] and not problem.replicated_inputs:
        assert any(not torch.equal(a, b) for a, b in zip(floats[0], floats[1]) if a.shape == b.shape) or \
            any(a.shape != b.shape for a, b in zip(floats[0], floats[1])), f"{problem.name}: ranks 0 and 1 got the same inputs"
    for world_size in problem.world_sizes:
        for nodes in (n for n in problem.nodes if problem.runs_on(world_size, n)):
            for case in problem.cases("tests", world_size, nodes=nodes) + problem.cases("benchmarks", world_size, nodes=nodes):
                cost = problem.cost(case, world_size)
                assert isinstance(cost, Cost)
                if nodes > 1:  # across nodes something must cross the network, and the cost says how much
                    assert cost.network_bytes > 0, f"{problem.name} {case.name} W={world_size} on {nodes} nodes"


# nccl-tests PERFORMANCE.md: busbw = algbw * factor, algbw = S / t, with S the size it reports
# (all-gather and gather/scatter: the total across ranks; reduce-scatter: the per-rank input).
NCCL_TESTS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def nccl_tests_size(name: str, chunk_bytes: int, world_size: int) -> int:
    """The S nccl-tests reports for a case whose per-rank `shape` buffer has ``chunk_bytes``."""
    if name in ("allgather", "scatter", "gather", "reducescatter", "alltoall"):
        return chunk_bytes * world_size
    return chunk_bytes


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_link_bytes_follow_nccl_tests_bus_factors(name, world_size):
    problem = get_problem(name)
    for case in (c.at_precision("bf16") for c in problem.tests + problem.benchmarks):
        chunk_bytes = torch.Size(case["shape"]).numel() * getattr(torch, case["dtype"]).itemsize
        expected = NCCL_TESTS_FACTOR[name](world_size) * nccl_tests_size(name, chunk_bytes, world_size)
        assert problem.cost(case, world_size).link_bytes == pytest.approx(expected), case.name


def test_hand_derived_costs():
    # all-reduce of a 16 MiB bf16 buffer at W=8: 2 * 7/8 * 16 MiB = 28 MiB cross each rank's links
    assert get_problem("allreduce").cost(get_problem("allreduce").find_case("bf16_16MiB"), 8).link_bytes == 28 * 2**20
    # all-gather of 1 GiB per rank at W=4: each rank receives the other three ranks' GiB
    assert get_problem("allgather").cost(get_problem("allgather").find_case("bf16_1GiB"), 4).link_bytes == 3 * 2**30
    # reduce-scatter, odd case [3, 683] bf16 output at W=2: input 2*3*683*2 bytes, half of it crosses
    assert get_problem("reducescatter").cost(get_problem("reducescatter").find_case("odd"), 2).link_bytes == 3 * 683 * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_reduction_tolerance_accepts_any_summation_order_and_rejects_a_missing_rank(dtype, world_size):
    """An honest sum in the buffer's dtype, in ring order or reversed, passes against the reference's
    single rounding; the same sum without one rank's buffer does not."""
    gen = torch.Generator().manual_seed(world_size)
    buffers = [torch.randn(1 << 18, generator=gen).to(dtype) for _ in range(world_size)]
    exact = sum(b.double() for b in buffers).to(dtype)
    tolerance = reduction_tolerance(dtype, world_size)

    def within(got):
        return bool(((got.double() - exact.double()).abs() <= tolerance.atol + tolerance.rtol * exact.double().abs()).all())

    for order in (range(world_size), reversed(range(world_size))):
        order = list(order)
        acc = buffers[order[0]].clone()
        for i in order[1:]:
            acc = acc + buffers[i]
        assert within(acc)
    fp32_once = sum(b.float() for b in buffers).to(dtype)
    assert within(fp32_once)
    missing_one = sum(b.float() for b in buffers[1:]).to(dtype)
    assert not within(missing_one)


def test_the_docs_problem_table_is_the_generated_one():
    """docs/problems.md's table is generated by scripts/problem_table.py (versions and case counts included);
    regenerate it when the suite changes."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("problem_table", root / "scripts" / "problem_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = (root / "docs" / "problems.md").read_text()
    assert module.problem_table() in table, "run `python scripts/problem_table.py`"
