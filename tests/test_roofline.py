"""Roofline, hardware profiles, detection, calibrated-profile storage and ``pkb hardware / calibrate /
baseline`` on a machine without GPUs (GPU parts of calibration are marked ``gpu``).

Every expected number is worked out by hand in the comment above it, not by the module's formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pkb.hardware.calibrate import (Calibration, best_link_gbps, build_profile, calibrated_path, load_calibrated,
                                    save_calibration)
from pkb.hardware.detect import MachineInfo, choose_profile, parse_topo_matrix
from pkb.hardware.probes import COPY, GEMM
from pkb.hardware.profiles import PROFILES, HardwareProfile, get_profile, profile_for_gpu
from pkb.hardware.roofline import BOUND_KINDS, roofline, roofline_fraction
from pkb.problem import Cost
from pkb.registry import all_problems, get_problem

REPO = Path(__file__).resolve().parents[1]
H200 = get_profile("h200_sxm_x8")
GiB = 1 << 30


def case_cost(slug: str, case: str, world_size: int) -> Cost:
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case), world_size)


# -- the roofline, one case of each pattern ---------------------------------------------------------

# (problem, case, W, link bytes by nccl-tests' factor, expected bound in seconds on h200_sxm_x8, bound_by)
PATTERNS = [
    # all-reduce 2(W-1)/W: 2 * 7/8 * 1 GiB = 1879048192 B; / 450e9 = 4.175662649e-3 s, + 5 us latency
    ("allreduce", "bf16_1GiB", 8, 1879048192, 4.175662649e-3 + 5e-6, "link"),
    # all-gather (W-1)/W of the total: 4 ranks x 1 GiB gathered, 3 GiB arrive = 3221225472 B; / 450e9
    ("allgather", "bf16_1GiB", 4, 3221225472, 7.158278827e-3 + 5e-6, "link"),
    # reduce-scatter (W-1)/W of each rank's W x 256 MiB input: 7/8 * 2 GiB = 1879048192 B
    ("reducescatter", "bf16_256MiB", 8, 1879048192, 4.175662649e-3 + 5e-6, "link"),
    # all-to-all (W-1)/W of each rank's W x 16 MiB: 1/2 * 32 MiB = 16777216 B; / 450e9 = 37.28 us
    ("alltoall", "bf16_16MiB", 2, 16777216, 37.28270222e-6 + 5e-6, "link"),
    # broadcast 1x the buffer: 256 MiB = 268435456 B / 450e9 = 596.52 us
    ("broadcast", "bf16_256MiB", 8, 268435456, 596.5232356e-6 + 5e-6, "link"),
    # a 4 KiB all-reduce: 2 * 7/8 * 4096 = 7168 B take 15.9 ns, far under the 5 us floor
    ("allreduce", "bf16_4KiB", 8, 7168, 5e-6 + 7168 / 450e9, "latency"),
]


@pytest.mark.parametrize(("slug", "case", "world_size", "link_bytes", "bound_s", "bound_by"), PATTERNS,
                         ids=[f"{p[0]}-{p[1]}-W{p[2]}" for p in PATTERNS])
def test_collective_roofline_matches_nccl_tests_factors(slug, case, world_size, link_bytes, bound_s, bound_by):
    cost = case_cost(slug, case, world_size)
    assert cost.link_bytes == pytest.approx(link_bytes)
    result = roofline(cost, H200, world_size)
    assert result.bound_s == pytest.approx(bound_s, rel=1e-6)
    assert result.bound_by == bound_by
    assert result.latency_s == pytest.approx(5e-6)


def test_gemm_is_compute_bound():
    # 8192^3 bf16: 2 * 8192^3 = 1099511627776 flop / 989.4e12 = 1.111291e-3 s; its 3 * 8192^2 * 2 B =
    # 402653184 B of HBM take 83.9 us at 4.8 TB/s; one GPU: no link term, no latency
    result = roofline(GEMM.cost(GEMM.benchmarks[0], 1), H200, 1)
    assert result.bound_by == "compute"
    assert result.bound_s == pytest.approx(1.111291e-3, rel=1e-5)
    assert result.memory_s == pytest.approx(83.886e-6, rel=1e-4)
    assert result.link_s == result.latency_s == 0.0


def test_copy_is_memory_bound():
    # 1 GiB read + 1 GiB written = 2147483648 B / 4.8e12 = 447.39 us on an H200, 641.0 us on an H100
    cost = COPY.cost(COPY.benchmarks[0], 1)
    assert roofline(cost, H200, 1).bound_s == pytest.approx(447.392e-6, rel=1e-5)
    assert roofline(cost, get_profile("h100_sxm_x8"), 1).bound_s == pytest.approx(641.040e-6, rel=1e-5)
    assert roofline(cost, H200, 1).bound_by == "memory"


def test_overlappable_terms_take_the_max_and_latency_only_adds_to_the_link():
    # link 450 MB -> 1 ms (+5 us); flops 1.9788e12 -> 2 ms; HBM 4.8 GB -> 1 ms: compute bounds at 2 ms
    cost = Cost(link_bytes=450e6, flops=2 * 989.4e9, hbm_bytes=4.8e9)
    result = roofline(cost, H200, 8)
    assert (result.bound_by, result.bound_s) == ("compute", pytest.approx(2e-3))
    assert result.link_s == pytest.approx(1e-3) and result.memory_s == pytest.approx(1e-3)
    # one rank moves nothing over the link, whatever the cost says
    assert roofline(Cost(link_bytes=1e6), H200, 1).bound_s == 0.0


def test_roofline_fraction_is_bound_over_measured():
    assert roofline_fraction(1e-3, 4e-3) == pytest.approx(0.25)
    assert roofline_fraction(2e-3, 2e-3) == 1.0
    with pytest.raises(ValueError):
        roofline_fraction(1e-3, 0.0)


def test_every_benchmark_case_of_the_suite_has_a_positive_bound_at_every_world_size():
    checked, zero = 0, []
    for problem in all_problems().values():
        for world_size in problem.world_sizes:
            for case in problem.cases("benchmarks", world_size):
                result = roofline(problem.cost(case, world_size), H200, world_size)
                assert result.bound_by in BOUND_KINDS
                checked += 1
                if not result.bound_s > 0:
                    zero.append(f"{problem.name}/{case.name}@W{world_size}")
    assert checked > 0
    assert not zero, f"cost() gives a zero roofline bound for: {', '.join(zero)}"


# -- profiles ---------------------------------------------------------------------------------------


def test_profiles_hold_the_datasheet_numbers_and_cite_sources():
    for name in ("h100_sxm_x8", "h200_sxm_x8", "b200_x8", "gb200_nvl72", "pcie_gen4_x8", "pcie_gen5_x8", "cpu"):
        profile = PROFILES[name]
        assert profile.sources and not profile.calibrated
        assert profile.link_gbps < profile.hbm_gbps  # an interconnect is never faster than the GPU's own memory
        assert profile.fp8_tflops in (0.0, pytest.approx(2 * profile.bf16_tflops, rel=0.01))
    # NVLink4: 18 links x 25 GB/s = 450 GB/s per direction; NVLink5 doubles it
    assert PROFILES["h100_sxm_x8"].link_gbps == PROFILES["h200_sxm_x8"].link_gbps == 450.0
    assert PROFILES["b200_x8"].link_gbps == PROFILES["gb200_nvl72"].link_gbps == 900.0
    assert (PROFILES["h200_sxm_x8"].hbm_gbps, PROFILES["h100_sxm_x8"].hbm_gbps) == (4800.0, 3350.0)
    assert PROFILES["h200_sxm_x8"].hbm_bytes == 141 * 10**9 and PROFILES["h100_sxm_x8"].l2_bytes == 50 << 20
    assert PROFILES["gb200_nvl72"].num_gpus == 72
    assert [p.name for p in PROFILES.values() if p.nvls] == ["h100_sxm_x8", "h200_sxm_x8", "b200_x8", "gb200_nvl72"]
    assert PROFILES["pcie_gen5_x8"].link_gbps == 2 * PROFILES["pcie_gen4_x8"].link_gbps


def test_unknown_profile_error_lists_the_valid_names():
    with pytest.raises(KeyError) as error:
        get_profile("h300")
    assert "h200_sxm_x8" in str(error.value) and "pcie_gen4_x8" in str(error.value)


@pytest.mark.parametrize(("device_name", "profile"), [
    ("NVIDIA H100 80GB HBM3", "h100_sxm_x8"), ("NVIDIA H200", "h200_sxm_x8"), ("NVIDIA B200", "b200_x8"),
    ("NVIDIA GB200", "gb200_nvl72"), ("NVIDIA H100 PCIe", "pcie_gen5_x8"), ("NVIDIA A100 80GB PCIe", "pcie_gen4_x8"),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_their_datasheet_profile(device_name, profile):
    found = profile_for_gpu(device_name)
    assert (found.name if found else None) == profile


def test_profile_round_trips_through_a_dict():
    assert HardwareProfile.from_dict(json.loads(json.dumps(H200.to_dict()))) == H200


# -- detection --------------------------------------------------------------------------------------

TOPO = ("\t\x1b[4mGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\tSYS\t0-47\t0\t\tN/A\n"
        "GPU2\tSYS\tSYS\t X \tSYS\t48-95\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n")


def test_nvidia_smi_topology_is_parsed_into_links_per_peer():
    assert parse_topo_matrix(TOPO) == ((None, 18, 0), (18, None, 0), (0, 0, None))
    assert parse_topo_matrix("No devices were found") is None


def test_choose_profile_prefers_calibrated_then_datasheet_then_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PKB_CACHE_DIR", str(tmp_path))
    machine = MachineInfo(gpu_model="NVIDIA H200", num_gpus=2)
    assert choose_profile(machine).name == "h200_sxm_x8"
    assert choose_profile(MachineInfo(gpu_model=None, num_gpus=0)).name == "cpu"
    assert choose_profile(MachineInfo(gpu_model="NVIDIA GeForce RTX 4090", num_gpus=1)).name == "cpu"
    assert not MachineInfo(None, 0, nvls_env={"NCCL_NVLS_ENABLE": None}).nvls_disabled_by_env
    assert MachineInfo(None, 0, nvls_env={"NCCL_NVLS_ENABLE": "0"}).nvls_disabled_by_env


# -- calibrated profiles ----------------------------------------------------------------------------

# Measured on a 2 x H200 node (DESIGN.md): copy 4260 GB/s, GEMM 680 TFLOP/s, peer copy 393 GB/s at
# 1 GiB, NCCL all-reduce busbw 331 GB/s at 1 GiB, all-reduce 51 us at 4 KiB.
MEASURED = {
    "hbm": {"gbps": 4260.0}, "gemm": {"tflops": 680.0}, "l2_bytes": 52428800, "hbm_bytes": 150 * 10**9,
    "copy_engine": [{"src": 0, "dst": 1, "bytes": GiB, "gbps": 393.0}, {"src": 1, "dst": 0, "bytes": 256 << 20,
                                                                        "gbps": 380.0},
                    {"src": 0, "dst": 1, "bytes": 4096, "gbps": 0.5}],
    "sm_peer": [{"src": 1, "dst": 0, "bytes": 256 << 20, "gbps": 360.0}],
    "all_reduce": [{"bytes": 4096, "seconds": 51e-6, "busbw_gbps": 0.08}, {"bytes": GiB, "seconds": 3.24e-3,
                                                                          "busbw_gbps": 331.0}],
    "all_gather": [{"bytes": GiB, "seconds": 3.8e-3, "busbw_gbps": 283.0}],
    "barrier_us": 9.5,
}


def test_calibrated_profile_takes_the_measured_peaks_and_keeps_the_rest():
    profile = build_profile(H200, "NVIDIA H200", 2, MEASURED)
    assert (profile.hbm_gbps, profile.bf16_tflops) == (4260.0, 680.0)
    # per ordered pair the best large copy: 0->1 393, 1->0 380 (the SM read 360 is slower); median 386.5,
    # above the best NCCL busbw 331
    assert profile.link_gbps == pytest.approx(386.5)
    assert profile.latency_us == 9.5  # the barrier beat the 51 us all-reduce
    assert (profile.fp8_tflops, profile.nvls, profile.num_gpus) == (H200.fp8_tflops, True, 2)
    assert profile.calibrated and profile.based_on == "h200_sxm_x8"
    assert "fp8_tflops" in profile.sources[1]
    assert best_link_gbps({"all_gather": [{"busbw_gbps": 283.0}]}) == 283.0
    assert best_link_gbps({}) is None


def test_calibration_is_stored_where_choose_profile_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PKB_CACHE_DIR", str(tmp_path / "cache"))
    machine = MachineInfo(gpu_model="NVIDIA H200", num_gpus=2)
    calibration = Calibration(profile=build_profile(H200, "NVIDIA H200", 2, MEASURED), datasheet=H200,
                              machine=machine.to_dict(), measurements=MEASURED)
    stored = save_calibration(calibration, tmp_path / "copy.json")
    assert stored == tmp_path / "cache" / "hardware" / "nvidia_h200_x2.json" == calibrated_path("NVIDIA H200", 2)
    assert json.loads((tmp_path / "copy.json").read_text())["profile"]["hbm_gbps"] == 4260.0
    chosen = choose_profile(machine)
    assert chosen == calibration.profile and chosen.calibrated
    assert choose_profile(machine, calibrated=False).name == "h200_sxm_x8"
    # keyed by model and count: four H200s have not been calibrated
    assert choose_profile(MachineInfo(gpu_model="NVIDIA H200", num_gpus=4)).name == "h200_sxm_x8"
    stored.write_text("{not json")
    with pytest.warns(UserWarning, match="rerun `pkb calibrate`"):
        assert load_calibrated("NVIDIA H200", 2) is None
    with pytest.warns(UserWarning):  # an unreadable file falls back to the datasheet, saying so
        assert choose_profile(machine).name == "h200_sxm_x8"


def test_cache_dir_follows_xdg_without_pkb_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("PKB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibrated_path("NVIDIA B200", 8) == tmp_path / "pkb" / "hardware" / "nvidia_b200_x8.json"


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
    expected_cases = {(slug, case.name) for slug in ("allreduce", "allgather")
                      for case in get_problem(slug).cases("tests", 2)}
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
    from pkb.hardware.calibrate import measure_single_gpu

    measured = measure_single_gpu(print)
    datasheet = choose_profile(MachineInfo(gpu_model=__import__("torch").cuda.get_device_name(0), num_gpus=1),
                               calibrated=False)
    assert 0.3 * datasheet.hbm_gbps < measured["hbm"]["gbps"] < 1.05 * datasheet.hbm_gbps
    assert 0.3 * datasheet.bf16_tflops < measured["gemm"]["tflops"] < 1.05 * datasheet.bf16_tflops


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 2, reason="needs two CUDA GPUs")
def test_multi_gpu_sweeps_measure_every_pair_and_both_collectives():
    from pkb.hardware.calibrate import PAIR_BYTES, measure_multi_gpu

    measured = measure_multi_gpu(2, print)
    assert not measured.get("errors"), measured.get("errors")
    for kind in ("copy_engine", "sm_peer"):
        pairs = {(row["src"], row["dst"]) for row in measured[kind] if row["bytes"] >= PAIR_BYTES}
        assert pairs == {(0, 1), (1, 0)}
    assert len(measured["all_reduce"]) == len(get_problem("allreduce").cases("benchmarks", 2))
    assert max(row["busbw_gbps"] for row in measured["all_reduce"]) > 10
    assert 0 < measured["barrier_us"] < 1000


def test_the_commands_are_listed_in_pkb_help():
    from pkb.cli import build_parser

    text = build_parser().format_help()  # expands every subcommand's help (a stray '%' would raise here)
    assert all(name in text for name in ("hardware", "calibrate", "baseline"))


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
    from pkb.evaluate.evaluator import EvalConfig, Session, evaluate, time_reference
    from pkb.hardware.probes import NCCL_PROBES
    from pkb.problem import Status
    from pkb.runtime.modes import Mode

    config = EvalConfig(world_size=2, mode=Mode.CPU, num_trials=2, perf=True)
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


def test_baseline_table_flags_a_row_faster_than_its_bound():
    import io

    from pkb.hardware.baseline import BaselineRow
    from pkb.hardware.cli import _RowPrinter

    def row(case, fraction):
        return BaselineRow(problem="allreduce", case=case, world_size=2, mode="cuda", profile="calibrated_x",
                           time_us=100.0, spread=0.01, busbw=10.0, bound_us=100.0 * fraction,
                           roofline_fraction=fraction, bound_by="link", datasheet_roofline_fraction=fraction / 2)

    stream = io.StringIO()
    printer = _RowPrinter(stream, [get_problem("allreduce")], 2, datasheet_column=True)
    printer.row(row("bf16_4KiB", 0.5))
    printer.row(row("bf16_64KiB", 1.01))  # within the noise of the calibration that measured the peak
    printer.row(row("bf16_1GiB", 1.2))
    header, _, under, noise, over = stream.getvalue().splitlines()
    assert "% datasheet" in header and "spread" in header
    assert "faster than its bound" not in under and "50.0%" in under and "25.0%" in under
    assert "faster than its bound" not in noise and "101.0%" in noise
    assert "faster than its bound" in over and "120.0%" in over

    stream = io.StringIO()  # against a datasheet profile any excess is flagged
    _RowPrinter(stream, [get_problem("allreduce")], 2).row(row("bf16_64KiB", 1.01))
    assert "faster than its bound" in stream.getvalue() and "% datasheet" not in stream.getvalue()
