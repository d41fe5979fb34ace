"""Probes timed by the harness itself: a bf16 GEMM, a device-to-device copy, and the bare NCCL
all-reduce and all-gather.

They measure the machine (and check the timing protocol against an independent timer) rather than
test a kernel, so they live outside the suite. Each is a Problem, so the same rank groups, input
rotation and timers as real problems time them.

GEMM: a [M, K] @ b [K, N] in bf16 with fp32 accumulation; 2*M*N*K flops, reads (M*K + K*N) and
writes M*N elements. COPY: out = x.clone() of a bf16 buffer; reads and writes its bytes once each.
Both run at any world size with no communication.

ALL_REDUCE: ``dist.all_reduce(x)`` in place, nothing else (the suite's allreduce also clones its
input, which it must leave unchanged); repeated calls keep summing into the same buffer, so its
values grow, and nothing checks them: a probe times calls, it grades nothing. ALL_GATHER: the
suite's allgather reference (``dist.all_gather_into_tensor`` into a new buffer). Inputs, costs and
busbw are the suite problems' (nccl-tests' factors); the plain CUDA-event loop of ``pkb calibrate``
makes the same calls, which ``benchmarks/nccl_fidelity.py`` compares with the harness's time.
"""

from __future__ import annotations

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.collectives import allgather, allreduce
from pkb.problems.collectives._common import sum_tolerance


def gemm_inputs(case, rank, world_size, gen):
    m, n, k = case["m"], case["n"], case["k"]
    return randn(gen, m, k, dtype=_bf16()), randn(gen, k, n, dtype=_bf16())


def gemm(a, b):
    return a @ b


def gemm_cost(case, world_size):
    m, n, k = case["m"], case["n"], case["k"]
    return Cost(flops=2.0 * m * n * k, hbm_bytes=2.0 * (m * k + k * n + m * n), pattern="gemm")


def copy_inputs(case, rank, world_size, gen):
    return (randn(gen, case["numel"], dtype=_bf16()),)


def copy(x):
    return x.clone()


def copy_cost(case, world_size):
    return Cost(hbm_bytes=2.0 * 2 * case["numel"], pattern="copy")


def _bf16():
    import torch

    return torch.bfloat16


GEMM = Problem(
    name="probe_gemm", version=1, upstream_id=None, category="calibration", source="torch.matmul (cuBLAS)",
    world_sizes=(1, 2, 4, 8), tests=[Case("tiny", {"m": 64, "n": 48, "k": 32})],
    benchmarks=[Case("gemm_8192", {"m": 8192, "n": 8192, "k": 8192}, note="8192^3 bf16, 1.1 TFLOP")],
    reference=gemm, make_inputs=gemm_inputs, cost=gemm_cost, module="pkb.measure.probes:GEMM",
)

COPY = Problem(
    name="probe_copy", version=1, upstream_id=None, category="calibration", source="Tensor.clone (device copy)",
    world_sizes=(1, 2, 4, 8), tests=[Case("tiny", {"numel": 4099})],
    benchmarks=[Case("copy_1GiB", {"numel": 1 << 29}, note="1 GiB of bf16 read, 1 GiB written")],
    reference=copy, make_inputs=copy_inputs, cost=copy_cost, module="pkb.measure.probes:COPY",
)


def all_reduce(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)
    return tensor


# 64 MiB to 1 GiB per rank, the sizes where busbw is compared with a plain loop; rows of 1024 elements.
_COLLECTIVE_BENCHMARKS = [Case(f"bf16_{label}", {"shape": (size // 2048, 1024)}, note=f"{label} per rank, bf16")
                          for label, size in (("64MiB", 64 << 20), ("256MiB", 256 << 20), ("1GiB", 1 << 30))]
_COLLECTIVE_TESTS = [Case("tiny", {"shape": (3, 683)}, tags=("tiny", "odd_sizes"))]  # bf16, the run's default

ALL_REDUCE = Problem(
    name="probe_all_reduce", version=1, upstream_id=None, category="calibration",
    source="NCCL all_reduce (SUM), in place", world_sizes=(2, 4, 8), tests=_COLLECTIVE_TESTS,
    benchmarks=_COLLECTIVE_BENCHMARKS, tolerance=sum_tolerance,
    reference=all_reduce, make_inputs=allreduce.make_inputs, cost=allreduce.cost, module="pkb.measure.probes:ALL_REDUCE",
)

ALL_GATHER = Problem(
    name="probe_all_gather", version=1, upstream_id=None, category="calibration",
    source="NCCL all_gather_into_tensor", world_sizes=(2, 4, 8), tests=_COLLECTIVE_TESTS,
    benchmarks=_COLLECTIVE_BENCHMARKS, tolerance=Tolerance.exact(),
    reference=allgather.reference, make_inputs=allgather.make_inputs, cost=allgather.cost,
    module="pkb.measure.probes:ALL_GATHER",
)

NCCL_PROBES = {"all_reduce": ALL_REDUCE, "all_gather": ALL_GATHER}
