"""Runs on several nodes (issue 37), without a process: the topology model, the node count through the
options, the problem contract, the configuration and the results' keys, the roofline's network term, the
prompt's topology, NVSHMEM's requirement, and how reports count problems of pkb's own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pkb.commands import add_eval_options, served_options
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.hardware.profiles import PROFILES, get_profile
from pkb.hardware.roofline import roofline
from pkb.loop import evaluation_key
from pkb.options import EvaluationRequest, Status
from pkb.problem import Case, Cost, Problem, ProblemError
from pkb.registry import all_problems, get_problem
from pkb.report import metrics, records
from pkb.runtime.modes import Mode
from pkb.topology import Topology

INTER_NODE = [p for p in all_problems().values() if p.category == "inter_node"]


def test_ranks_sit_on_nodes_in_torchruns_order():
    topology = Topology(world_size=8, num_nodes=2)
    assert topology.gpus_per_node == 4
    assert [topology.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topology.intra_node_ranks(1) == [4, 5, 6, 7] and topology.inter_node_ranks(2) == [2, 6]
    assert topology.same_node([4, 7]) and not topology.same_node([3, 4])
    assert Topology.from_env({"PKB_TOPOLOGY": topology.to_env()}) == topology
    assert Topology.from_env({}) is None
    with pytest.raises(ValueError, match="--nodes must divide --world-size"):
        Topology(world_size=8, num_nodes=3)


def test_the_description_says_where_nvlink_stops():
    text = Topology(8, 2).describe(nvlink_gbps=450)
    assert "2 nodes of 4" in text and "r // 4" in text and "400 Gb/s" in text and "refused" in text
    assert Topology(4, 1).describe() == "4 GPUs on one node."


def test_the_inter_node_category_has_at_least_eight_problems_each_from_a_codebase_it_names():
    assert len(INTER_NODE) >= 8
    for problem in INTER_NODE:
        assert min(problem.nodes) >= 2 and problem.upstream_id is None and not problem.upstream and problem.source
        module_doc = __import__(problem.module, fromlist=["_"]).__doc__
        assert module_doc and len(module_doc) > 200, problem.name


def test_the_run_sets_a_cases_nodes_and_a_case_may_not():
    problem = get_problem("hierarchical_allreduce")
    assert [c["nodes"] for c in problem.cases("tests", 8)] == [2] * len(problem.tests)
    assert {c["nodes"] for c in problem.cases("tests", 8, nodes=4)} == {4}
    assert problem.find_case("odd", nodes=4)["nodes"] == 4
    assert "nodes" not in get_problem("allreduce").cases("tests", 8)[0].params  # a problem of one node
    assert problem.runs_on(8, 4) and problem.runs_on(4, 4) and not problem.runs_on(8, 3) and not problem.runs_on(2, 2)
    with pytest.raises(ProblemError, match="number of nodes is the run's"):
        Case("x", {"nodes": 2})


def test_only_the_inter_node_category_runs_on_several_nodes():
    base = dict(version=1, upstream_id=None, source="s", world_sizes=(4,), tests=[Case("a", tags=("tiny",))],
                benchmarks=[], reference=lambda tensor: tensor, make_inputs=lambda c, r, w, g: (), cost=lambda c, w: Cost())
    Problem(name="fine", category="inter_node", nodes=(2,), **base)
    with pytest.raises(ProblemError, match="inter_node"):
        Problem(name="single", category="inter_node", **base)
    with pytest.raises(ProblemError, match="inter_node"):
        Problem(name="spread", category="collectives", nodes=(2,), **base)


def test_the_node_count_is_an_option_of_every_evaluating_command_and_of_a_request():
    parser = argparse.ArgumentParser()
    add_eval_options(parser, None)
    args = parser.parse_args(["--nodes", "2", "--world-size", "8"])
    assert args.nodes == 2 and served_options(args)["nodes"] == 2
    assert "nodes" not in served_options(parser.parse_args([]))  # unset: the problem's default
    assert EvaluationRequest.from_json({"problem": "hierarchical_allreduce", "source": "x", "nodes": 4}).nodes == 4
    with pytest.raises(ValueError, match="nodes"):
        EvaluationRequest.from_json({"problem": "x", "source": "x", "nodes": 0})


def test_a_configuration_takes_the_problems_default_nodes_and_its_key_keeps_them_apart():
    config = EvalConfig(world_size=8, mode=Mode.CPU)
    problem = get_problem("hierarchical_allreduce")
    assert config.on(problem).nodes == 2 and config.on(get_problem("allreduce")).nodes == 1
    with pytest.raises(ValueError, match="do not split"):
        EvalConfig(world_size=8, mode=Mode.CPU, nodes=3)
    candidate = Candidate.reference_of(problem)
    assert evaluation_key(problem, candidate, config) == evaluation_key(problem, candidate, dataclasses.replace(config, nodes=2))
    assert evaluation_key(problem, candidate, config) != evaluation_key(problem, candidate, dataclasses.replace(config, nodes=4))


def test_the_roofline_counts_nvlink_and_the_network_apart():
    h200 = get_profile("h200_sxm_x8")
    assert all(profile.network_gbps > 0 for profile in PROFILES.values())
    nvlink_only = roofline(Cost(link_bytes=450e6), h200, 8)
    assert nvlink_only.bound_by == "link" and nvlink_only.network_s == 0
    both = roofline(Cost(link_bytes=450e6, network_bytes=100e6), h200, 8)  # 1 ms over NVLink, 2 ms over the NIC
    assert both.bound_by == "network" and both.network_s == pytest.approx(2e-3) and both.link_s == pytest.approx(1e-3)
    assert both.bound_s == pytest.approx(2e-3 + h200.latency_us * 1e-6)
    case = get_problem("hierarchical_allreduce").find_case("bf16_1GiB", nodes=2)
    cost = get_problem("hierarchical_allreduce").cost(case, 8)
    assert cost.link_bytes == 2 * 3 / 4 * 2**30 and cost.network_bytes == 2 * 1 / 2 * 2**30 / 4


@pytest.mark.parametrize("problem", INTER_NODE, ids=lambda p: p.name)
def test_the_prompt_describes_the_topology(problem):
    from pkb.generate.prompt import build_prompt

    # a tests case: the benchmark inputs of the MoE combine depend on its routing and take half a minute
    prompt = build_prompt(problem, "cuda", get_profile("h200_sxm_x8"), case=problem.tests[0], world_size=8, nodes=2)
    assert "## Topology: 2 nodes" in prompt.user and "8 GPUs on 2 nodes of 4" in prompt.user
    assert "over the network between nodes" in prompt.user
    plain = build_prompt(get_problem("allreduce"), "cuda", get_profile("h200_sxm_x8"), world_size=8)
    assert "## Topology" not in plain.user


def test_the_prompt_says_what_crosses_nodes_without_contradicting_itself():
    """One node: the kernels move everything. Several: the kernels inside a node, torch.distributed between nodes,
    and where nothing crosses NVLink (kv_cache_transfer), torch.distributed carries all of it."""
    from pkb.generate import templates
    from pkb.generate.prompt import build_prompt

    h200 = get_profile("h200_sxm_x8")
    one = build_prompt(get_problem("allreduce"), "cuda", h200, world_size=8).user
    assert templates.COMMUNICATION in one and "Between nodes" not in one
    for name in ("hierarchical_allreduce", "pipeline_internode", "dp_reduce_scatter_tp"):
        problem = get_problem(name)
        text = build_prompt(problem, "cuda", h200, case=problem.tests[0], world_size=8, nodes=2).user
        assert templates.COMMUNICATION_NODES in text and templates.COMMUNICATION not in text, name
        assert templates.NO_NVLINK_LEG not in text, name  # these have an NVLink leg
    problem = get_problem("kv_cache_transfer")
    text = build_prompt(problem, "cuda", h200, case=problem.tests[0], world_size=8, nodes=2).user
    assert templates.NO_NVLINK_LEG in text and templates.COMMUNICATION not in text


def test_forbid_collectives_forbids_what_moves_inside_a_node_and_lets_the_network_leg_through():
    from pkb.runtime.guards import moved_inside_a_node

    labels = ["dist.barrier", "dist.isend@network", "ProcessGroup.allreduce@network", "dist.all_reduce@mixed",
              "dist.reduce_scatter_tensor", "reference", "symm_mem.one_shot_all_reduce", "functional.all_reduce@network"]
    assert moved_inside_a_node(labels) == ["dist.all_reduce@mixed", "dist.reduce_scatter_tensor", "reference",
                                           "symm_mem.one_shot_all_reduce"]


def test_nvshmem_is_skipped_where_it_cannot_run_faithfully():
    wants = dataclasses.replace(Candidate.reference_of(get_problem("allreduce")), requires=("cuda", "nvshmem"))
    assert wants.missing_in(Mode.CUDA, nodes=1) is None
    assert "virtual" in wants.missing_in(Mode.CUDA, nodes=2)
    assert "shared-gpu" in wants.missing_in(Mode.SHARED_GPU, nodes=1)


def test_a_problem_of_pkbs_own_counts_on_pkbs_protocol_and_the_levels_still_nest():
    from pkb.evaluate.result import EvalResult

    def row(problem, status, upstream_ok=None, cases=("odd",)):
        return EvalResult(problem=problem, problem_version=1, solution=f"set/{problem}", solution_set="set",
                          solution_sha256=problem, status=status, cases=list(cases), upstream_ok=upstream_ok,
                          world_size=8, mode="cpu")

    rows = [row("hierarchical_allreduce", Status.OK), row("allreduce", Status.OK, True, ("upstream",)),
            row("allgather", Status.MISMATCH, False, ("upstream",))]
    selection = {"hierarchical_allreduce": "inter_node", "allreduce": "collectives", "allgather": "collectives"}
    report = metrics.build_report(records.from_results(rows, categories=selection), selection, "set", (1,), case_tags={})
    assert report.overall["set"].pass_at_k[1] == pytest.approx(2 / 3)  # pkb's: its own problem counts
    assert report.paper["set"].pass_at_k[1] == pytest.approx(1 / 2)  # the paper's: only upstream's problems
