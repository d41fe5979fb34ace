"""Roofline, hardware profiles, detection, calibrated-profile storage, and the baseline table's flag on a row
faster than its bound. ``pkb hardware / calibrate / baseline`` as a user runs them, and the calibration's
measurements: tests/integration/test_hardware_commands.py.

Every expected number is worked out by hand in the comment above it, not by the module's formula.
"""

from __future__ import annotations

import json

import pytest

from pkb.measure.calibrate import (Calibration, best_link_gbps, build_profile, calibrated_path, load_calibrated,
                                    save_calibration)
from pkb.hardware.detect import MachineInfo, choose_profile, parse_topo_matrix
from pkb.measure.probes import COPY, GEMM
from pkb.hardware.profiles import PROFILES, HardwareProfile, get_profile, profile_for_gpu
from pkb.hardware.roofline import BOUND_KINDS, roofline, roofline_fraction
from pkb.problem import Cost
from pkb.registry import all_problems, get_problem

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

# Measured on a 2 x H200 node (docs/results.md, "On GPUs"): copy 4260 GB/s, GEMM 680 TFLOP/s, peer copy 393 GB/s at
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


# -- the commands' help, and the baseline table's flag ----------------------------------------------


def test_the_commands_are_listed_in_pkb_help():
    from pkb.cli import build_parser

    text = build_parser().format_help()  # expands every subcommand's help (a stray '%' would raise here)
    assert all(name in text for name in ("hardware", "calibrate", "baseline"))


def test_baseline_table_flags_a_row_faster_than_its_bound():
    import io

    from pkb.measure.baseline import BaselineRow
    from pkb.measure.cli import _RowPrinter

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
