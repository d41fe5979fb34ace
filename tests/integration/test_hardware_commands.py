"""``pkb hardware / calibrate / baseline`` as a user runs them (a process each) on a machine without GPUs,
the NCCL probes evaluated on CPU ranks, and the calibration's measurements on GPUs (marked ``gpu``).
Roofline, profiles, detection and calibrated-profile storage: tests/unit/test_roofline.py.

Every expected number is worked out by hand in the comment above it, not by the module's formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pkb.hardware.detect import MachineInfo, choose_profile
from pkb.hardware.profiles import PROFILES, get_profile
from pkb.hardware.roofline import roofline
from pkb.problem import Cost
from pkb.registry import get_problem

REPO = Path(__file__).resolve().parents[2]


def case_cost(slug: str, case: str, world_size: int) -> Cost:
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case), world_size)


# -- the commands, on a machine without GPUs --------------------------------------------------------


def pkb(*args: str, cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PKB_CACHE_DIR": str(cache)}
    # The `pkb` entry point's way in (not `-m pkb.cli`, which would load a second copy of pkb.cli as __main__)
    command = [sys.executable, "-c", "import sys; from pkb.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env)


def test_hardware_without_gpus_says_so_and_lists_every_profile(tmp_path):
    out = pkb("hardware", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "no GPU visible" in out.stdout
    for name, profile in PROFILES.items():
        line = next(line for line in out.stdout.splitlines() if line.startswith(name + " "))
        assert f"{profile.link_gbps:g}" in line and f"{profile.hbm_gbps:g}" in line
    data = json.loads(pkb("hardware", "--json", cache=tmp_path).stdout)
    assert data["machine"]["num_gpus"] == 0 and data["profile"]["name"] == "cpu"
    assert {p["name"] for p in data["profiles"]} == set(PROFILES)
    assert all({"link_gbps", "hbm_gbps", "bf16_tflops", "nvls", "sources"} <= set(p) for p in data["profiles"])


def test_calibrate_without_gpus_is_a_usage_error(tmp_path):
    out = pkb("calibrate", cache=tmp_path)
    assert out.returncode == 2
    assert "none visible" in out.stderr and "cpu" in out.stderr
    assert not (tmp_path / "hardware").exists()


def test_baseline_json_rows_for_two_collectives_at_two_ranks(tmp_path):
    out = pkb("baseline", "--problems", "1-2", "--world-size", "2", "--json", "--out", str(tmp_path / "rows.json"),
              cache=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert json.loads((tmp_path / "rows.json").read_text()) == data  # --out keeps the same report in a file
    assert "allreduce" in out.stderr and "% roofline" in out.stderr  # the table goes to stderr with --json
    rows = data["rows"]
    expected_cases = {(slug, case.name) for slug in ("allreduce", "allgather") for kind in ("upstream", "tests")
                      for case in get_problem(slug).cases(kind, 2)}  # cpu mode times the checked cases (--cases all)
    assert {(row["problem"], row["case"]) for row in rows} == expected_cases
    cpu = get_profile("cpu")
    for row in rows:
        assert row["mode"] == "cpu" and row["profile"] == "cpu" and not row["times_are_gpu_performance"]
        assert row["time_us"] > 0 and not row["error"]
        cost = case_cost(row["problem"], row["case"], 2)
        bound = roofline(cost, cpu, 2)
        assert row["bound_by"] == bound.bound_by
        assert row["roofline_fraction"] == pytest.approx(bound.bound_s / (row["time_us"] * 1e-6))
        assert row["busbw"] == pytest.approx(cost.link_bytes / (row["time_us"] * 1e-6) / 1e9)


def test_baseline_table_labels_cpu_times_and_refuses_an_unsupported_world_size(tmp_path):
    out = pkb("baseline", "--problems", "allreduce", "--world-size", "3", "--mode", "cpu", cache=tmp_path)
    assert out.returncode == 2
    assert "world size 3" in out.stderr and "skipped allreduce" in out.stdout


# -- GPU: the calibration measurements themselves ---------------------------------------------------


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 1, reason="needs a CUDA GPU")
def test_single_gpu_calibration_measures_plausible_peaks():
    from pkb.measure.calibrate import measure_single_gpu

    measured = measure_single_gpu(print)
    datasheet = choose_profile(MachineInfo(gpu_model=__import__("torch").cuda.get_device_name(0), num_gpus=1),
                               calibrated=False)
    assert 0.3 * datasheet.hbm_gbps < measured["hbm"]["gbps"] < 1.05 * datasheet.hbm_gbps
    assert 0.3 * datasheet.bf16_tflops < measured["gemm"]["tflops"] < 1.05 * datasheet.bf16_tflops


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 2, reason="needs two CUDA GPUs")
def test_multi_gpu_sweeps_measure_every_pair_and_both_collectives():
    from pkb.measure.calibrate import PAIR_BYTES, measure_multi_gpu

    measured = measure_multi_gpu(2, print)
    assert not measured.get("errors"), measured.get("errors")
    for kind in ("copy_engine", "sm_peer"):
        pairs = {(row["src"], row["dst"]) for row in measured[kind] if row["bytes"] >= PAIR_BYTES}
        assert pairs == {(0, 1), (1, 0)}
    assert len(measured["all_reduce"]) == len(get_problem("allreduce").cases("benchmarks", 2))
    assert max(row["busbw_gbps"] for row in measured["all_reduce"]) > 10
    assert 0 < measured["barrier_us"] < 1000


def test_baseline_at_one_device_times_the_machine_probes():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pkb", "baseline", "--world-size", "1", "--problems", "1", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {row["problem"] for row in report["rows"]} == {"probe_gemm", "probe_copy"}
    assert all(row["time_us"] > 0 and row["bound_by"] in ("compute", "memory") for row in report["rows"])
    assert [item["problem"] for item in report["skipped"]] == ["allreduce"]


def test_the_nccl_probes_pass_on_cpu_and_cost_what_the_suite_problems_cost():
    """The probes behind `nccl_fidelity.py` and calibrate's plain loop: correct calls, the suite's costs."""
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.config import EvalConfig
    from pkb.evaluate.evaluator import evaluate
    from pkb.evaluate.session import Session
    from pkb.evaluate.timing import time_reference
    from pkb.measure.probes import NCCL_PROBES
    from pkb.options import Status
    from pkb.runtime.modes import Mode

    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=2, perf=True)
    with Session(Mode.CPU, 2) as session:
        for kind, probe in NCCL_PROBES.items():
            result = evaluate(probe, Candidate.reference_of(probe), config, session)
            assert result.status is Status.OK, result.message
            assert time_reference(session, probe, probe.tests[0], config).per_call_s() > 0
    one_gib = NCCL_PROBES["all_reduce"].benchmarks[-1]
    assert [case.name for case in NCCL_PROBES["all_reduce"].benchmarks] == ["bf16_64MiB", "bf16_256MiB", "bf16_1GiB"]
    # nccl-tests' factors at W = 4 on 1 GiB per rank: all-reduce 2(W-1)/W of it, all-gather (W-1) times it
    assert NCCL_PROBES["all_reduce"].cost(one_gib, 4).link_bytes == 1.5 * 2**30
    assert NCCL_PROBES["all_gather"].cost(one_gib, 4).link_bytes == 3 * 2**30
