"""Single-device probes timed by the harness itself: a bf16 GEMM and a device-to-device copy.

They measure the machine (and check the timing protocol against an independent timer) rather than
test a kernel, so they live outside the suite. Each is a Problem, run at any world size with no
communication, so the same rank groups, input rotation and timers as real problems time them.

GEMM: a [M, K] @ b [K, N] in bf16 with fp32 accumulation; 2*M*N*K flops, reads (M*K + K*N) and
writes M*N elements. COPY: out = x.clone() of a bf16 buffer; reads and writes its bytes once each.
"""

from __future__ import annotations

from pkb.problem import Case, Cost, Problem, randn


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
    reference=gemm, make_inputs=gemm_inputs, cost=gemm_cost, module="pkb.hardware.probes:GEMM",
)

COPY = Problem(
    name="probe_copy", version=1, upstream_id=None, category="calibration", source="Tensor.clone (device copy)",
    world_sizes=(1, 2, 4, 8), tests=[Case("tiny", {"numel": 4099})],
    benchmarks=[Case("copy_1GiB", {"numel": 1 << 29}, note="1 GiB of bf16 read, 1 GiB written")],
    reference=copy, make_inputs=copy_inputs, cost=copy_cost, module="pkb.hardware.probes:COPY",
)
