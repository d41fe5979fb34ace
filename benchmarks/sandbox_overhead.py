"""What the candidate sandbox costs. Prints measured numbers; asserts nothing.

1. Evaluations side by side in one run: the same candidates (the references of the selected problems
   and the shipped solutions that this mode can run), alternately in a session with the sandbox
   (``auto``) and one without (``off``), round after round; the median wall time of each evaluation
   in each, and the overhead.
2. Compile time of a C++ extension (``--build``; a CUDA one with ``--cuda-build`` on a GPU machine):
   without the sandbox (built in place in torch's extension cache), with it (the broker's sandboxed
   build on a cold cache), and the same source again with it (a cache hit).

    python benchmarks/sandbox_overhead.py [--mode cpu] [--world-size 2] [--problems 1-8] [--rounds 5] [--build]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from pkb.solution_files import plan
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.registry import select
from pkb.runtime.modes import Mode
from pkb.runtime.sandbox import offered

BUILD_CANDIDATE = """
import time
import torch.distributed as dist
from pkb.kernels import load_cuda

_began = time.monotonic()
_module = load_cuda("pkb_overhead_probe", {cuda!r}, cpp_sources={cpp!r}, functions={functions!r}, with_cuda={with_cuda})
BUILD_S = time.monotonic() - _began

def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""
CPP_SOURCE = "int add_one(int x) {{ return x + 1; }} // {salt}"
CUDA_SOURCE = """
#include <torch/extension.h>
__global__ void add_one_kernel(float* x, int n) {{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }}
void add_one(torch::Tensor x) {{ add_one_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), x.numel()); }}
// {salt}
"""


def side_by_side(mode: Mode, world_size: int, problems: str, rounds: int, trials: int) -> dict:
    jobs = [job for job in plan(select(problems), solutions_dir=None, include_reference=True)
            if not job.candidate.missing_in(mode)]  # a candidate this mode skips unrun costs nothing to compare
    config = {level: EvalConfig(world_size=world_size, mode=mode, trials=trials, sandbox=level)
              for level in ("auto", "off")}
    times: dict[str, dict[str, list[float]]] = {"auto": {}, "off": {}}
    statuses: dict[str, set] = {}
    with Session(mode, world_size, "auto") as boxed, Session(mode, world_size, "off") as unboxed:
        sessions = {"auto": boxed, "off": unboxed}
        began = time.monotonic()
        for job in jobs:  # an untimed round first: rank processes started, extensions built, modules imported
            for level in sessions:
                evaluate(job.problem, job.candidate, config[level], sessions[level])
        print(f"  warm-up round (untimed: builds, first imports): {time.monotonic() - began:.1f} s", flush=True)
        for round_index in range(rounds):
            order = ("auto", "off") if round_index % 2 == 0 else ("off", "auto")
            for job in jobs:
                label = f"{job.problem.name}/{job.candidate.name}"
                for level in order:
                    result = evaluate(job.problem, job.candidate, config[level], sessions[level])
                    times[level].setdefault(label, []).append(result.wall_s)
                    statuses.setdefault(label, set()).add(f"{level}:{result.status.value}")
                    print(f"  round {round_index}: {label} sandbox {level}: {result.wall_s:.3f} s, "
                          f"{result.status.value}", flush=True)
    rows = []
    for label in times["auto"]:
        on, off = statistics.median(times["auto"][label]), statistics.median(times["off"][label])
        rows.append({"evaluation": label, "sandbox_s": on, "no_sandbox_s": off, "overhead": on / off - 1,
                     "statuses": sorted(statuses[label])})
    total_on = sum(r["sandbox_s"] for r in rows)
    total_off = sum(r["no_sandbox_s"] for r in rows)
    print(f"## evaluations side by side: mode {mode}, W = {world_size}, {len(rows)} evaluations x {rounds} rounds "
          f"(medians; times in {mode} mode are not GPU performance)")
    print(f"{'evaluation':<44} {'sandbox s':>10} {'off s':>8} {'overhead':>9}  statuses")
    for r in rows:
        print(f"{r['evaluation']:<44} {r['sandbox_s']:>10.3f} {r['no_sandbox_s']:>8.3f} {r['overhead']:>8.1%}  "
              f"{', '.join(r['statuses'])}")
    print(f"{'all (sum of medians)':<44} {total_on:>10.3f} {total_off:>8.3f} {total_on / total_off - 1:>8.1%}")
    return {"mode": mode.value, "world_size": world_size, "rounds": rounds, "rows": rows,
            "total_sandbox_s": total_on, "total_no_sandbox_s": total_off, "overhead": total_on / total_off - 1}


def build_times(mode: Mode, world_size: int, cuda: bool) -> dict:
    """A fresh source each run (a salt in a comment), so the first build of each arrangement is cold."""
    salt = f"{os.getpid()}-{time.time()}"
    if cuda:
        sources = dict(cuda=CUDA_SOURCE.format(salt=salt), cpp="void add_one(torch::Tensor x);",
                       functions=["add_one"], with_cuda=True)
    else:
        sources = dict(cuda="", cpp=CPP_SOURCE.format(salt=salt), functions=["add_one"], with_cuda=False)
    measured = {}
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCH_EXTENSIONS_DIR"] = tmp  # a cold cache, shared by both arrangements (apart)
        path = Path(tmp, "overhead_probe.py")
        path.write_text(textwrap.dedent(BUILD_CANDIDATE.format(**sources)))
        from pkb.evaluate.candidate import Candidate
        from pkb.registry import get_problem

        problem = get_problem("allreduce")
        for label, level in (("no sandbox, cold", "off"), ("sandbox, cold", "auto"), ("sandbox, cached", "auto")):
            config = EvalConfig(world_size=world_size, mode=mode, trials=1, cases="upstream", sandbox=level)
            result = evaluate(problem, Candidate.from_file(path), config)
            measured[label] = {"wall_s": result.wall_s, "status": result.status.value}
            print(f"build ({'CUDA' if cuda else 'C++'}), {label}: evaluation {result.wall_s:.1f} s, {result.status.value}"
                  + (f" ({result.message[:200]})" if result.status is not Status.OK else ""), flush=True)
    if before is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR")
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = before
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="cpu", choices=["cpu", "shared-gpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--problems", default="1-8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--build", action="store_true", help="also time a C++ extension's build")
    parser.add_argument("--cuda-build", action="store_true", help="also time a CUDA extension's build")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    mode = Mode(args.mode)
    print(f"sandbox: {offered('auto').describe()}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores")
    report = {"sandbox": offered("auto").to_dict()}
    if args.build or args.cuda_build:
        report["build"] = build_times(mode, args.world_size, cuda=args.cuda_build)
    report["side_by_side"] = side_by_side(mode, args.world_size, args.problems, args.rounds, args.trials)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
