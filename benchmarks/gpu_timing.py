"""Timing fidelity and harness overhead on GPUs. Prints measured numbers; asserts nothing.

1. W=1, cuda mode: the harness's time for a large bf16 GEMM (8192^3) and a 1 GiB device copy,
   measured five times, against ``triton.testing.do_bench`` on the same op (agreement and spread).
2. The fixed overhead of one evaluation in cuda mode (a tiny case, one trial, no timed iterations),
   in a warm session.
3. ``pkb.kernels.load_cuda`` of one small kernel in fresh processes: a first build into an empty
   extension cache, then three loads of the same source from the cache.
4. With two or more GPUs: a whole 5-trial evaluation of the all-reduce reference at W=2 (with and
   without --perf), wall time including process start-up.

    python benchmarks/gpu_timing.py [fidelity] [overhead] [build] [whole]   (default: all four)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.evaluate.timing import spread, time_reference
from pkb.measure.probes import COPY, GEMM
from pkb.options import Status
from pkb.runtime.modes import Mode


def do_bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=100, rep=2000, return_mode="median")


def fidelity(session: Session, config: EvalConfig) -> None:
    device = torch.device("cuda", 0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    x = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)
    independent = {"probe_gemm": do_bench_ms(lambda: a @ b) / 1e3, "probe_copy": do_bench_ms(lambda: x.clone()) / 1e3}
    del a, b, x
    torch.cuda.empty_cache()
    for problem in (GEMM, COPY):
        case = problem.benchmarks[0]
        runs = [time_reference(session, problem, case, config) for _ in range(5)]
        medians = [r.per_call_s() for r in runs]
        median = statistics.median(medians)
        reference = independent[problem.name]
        cost = problem.cost(case, 1)
        rate = (f"{cost.flops / median / 1e12:.0f} TFLOP/s" if cost.flops else f"{cost.hbm_bytes / median / 1e9:.0f} GB/s")
        print(f"{problem.name} {case.name}: harness {median * 1e6:.1f} us ({rate}) over 5 measurements "
              f"[{', '.join(f'{m * 1e6:.1f}' for m in medians)}], spread {spread(medians) * 100:.2f}%; "
              f"do_bench {reference * 1e6:.1f} us; harness/do_bench = {median / reference:.4f}; "
              f"ranks' own clock {statistics.median(r.rank_clock_s for r in runs) * 1e6:.1f} us, CUDA events "
              f"{statistics.median(r.event_s for r in runs) * 1e6:.1f} us; "
              f"timer disagreement flagged: {any(r.timer_disagreement for r in runs)}")


def overhead(session: Session, config: EvalConfig) -> None:
    candidate = Candidate.reference_of(GEMM)
    one_trial = EvalConfig(world_size=1, mode=Mode.CUDA, trials=1)
    evaluate(GEMM, candidate, one_trial, session)
    walls = []
    for _ in range(5):
        result = evaluate(GEMM, candidate, one_trial, session)
        assert result.status is Status.OK, result.message
        walls.append(result.wall_s)
    print(f"fixed overhead of one evaluation (cuda mode, W=1, tiny GEMM case, 1 trial, no timing), warm session: "
          f"median {statistics.median(walls) * 1e3:.0f} ms of 5 [{', '.join(f'{w * 1e3:.0f}' for w in walls)}]")


BUILD_ONE = """
import time
import torch, torch.utils.cpp_extension
began = time.perf_counter()
from pkb.kernels import load_cuda
ext = load_cuda("pkb_cache_probe", "__global__ void twice(float* x) { x[threadIdx.x] *= 2; }\\n"
                "void run(long p) { twice<<<1, 32>>>((float*) p); }", cpp_sources="void run(long p);", functions=["run"])
print(time.perf_counter() - began)
"""


def build_cache() -> None:
    with tempfile.TemporaryDirectory(prefix="pkb-ext-") as folder:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": folder}
        times = []
        for _ in range(4):
            out = subprocess.run([sys.executable, "-c", BUILD_ONE], capture_output=True, text=True, env=env)
            if out.returncode:
                print(f"load_cuda failed: {out.stderr.strip()[-2000:]}")
                return
            times.append(float(out.stdout.split()[-1]))
    print(f"load_cuda of one kernel in a fresh process (import of pkb.kernels and torch's loader included, "
          f"python start-up and `import torch` excluded): first build {times[0]:.2f} s; "
          f"from the cache: {', '.join(f'{t:.3f}' for t in times[1:])} s")


def whole_evaluation() -> None:
    for extra in ([], ["--perf"]):
        command = [sys.executable, "-m", "pkb.cli", "eval", "allreduce", "reference", "--mode", "cuda",
                   "--world-size", "2", "--trials", "5", *extra]
        started = time.monotonic()
        out = subprocess.run(command, capture_output=True, text=True)
        wall = time.monotonic() - started
        print(f"`pkb eval allreduce reference --mode cuda --world-size 2 --trials 5 {' '.join(extra)}`: "
              f"{wall:.1f} s wall, exit {out.returncode}")
        print("    " + out.stdout.strip().replace("\n", "\n    "))


PARTS = ("fidelity", "overhead", "build", "whole")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)} (default: all four)")
    args = parser.parse_args()
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: use any of {', '.join(PARTS)}")
    parts = args.parts or PARTS
    if not torch.cuda.is_available():
        raise SystemExit("gpu_timing.py times cuda mode and needs a GPU; this machine has none")
    print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    config = EvalConfig(world_size=1, mode=Mode.CUDA, trials=1)
    if "fidelity" in parts or "overhead" in parts:
        with Session(Mode.CUDA, 1) as session:
            if "fidelity" in parts:
                fidelity(session, config)
            if "overhead" in parts:
                overhead(session, config)
    if "build" in parts:
        build_cache()
    if "whole" in parts and torch.cuda.device_count() >= 2:
        whole_evaluation()


if __name__ == "__main__":
    main()
