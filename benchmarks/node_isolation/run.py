"""Virtual nodes on one machine behave like real ones (issue 48): every channel between nodes fails, the same
channel inside a node works, honest inter-node candidates are ``ok`` (also under ``--policy forbid-collectives``).

    python benchmarks/node_isolation/run.py --mode shared-gpu --topology 4x2 --out DIR [--budget-s 170] [--inside cuda]

Runs, at W ranks on N nodes, the candidates of tests/candidates/node_attacks (each channel across nodes, then
inside a node) and tests/candidates/inter_node (under both policies), and prints one line per (candidate, how,
W, nodes): the verdict, what it must be, PASS or FAIL. Nothing is left out silently: a run cut by its time
budget prints ``NOT RUN (budget)`` for each evaluation it did not reach, and the run's last line counts them.
Each result also goes to DIR/node_isolation_<mode>_w<W>n<N>.jsonl, with the sandbox the candidate ran in.
The CUDA channels (legacy IPC handles, torch's own rendezvous reached around the fence) need a GPU mode; in cpu
mode they are ``skipped``, and the line says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.node_attacks import CUDA_CHANNELS, FENCE_BYPASSES, HONEST, HOST_CHANNELS, node_attack, problem_of  # noqa: E402
from pkb.evaluate.candidate import Candidate  # noqa: E402
from pkb.evaluate.config import EvalConfig  # noqa: E402
from pkb.evaluate.evaluator import evaluate  # noqa: E402
from pkb.evaluate.session import Session  # noqa: E402
from pkb.registry import get_problem  # noqa: E402
from pkb.runtime.modes import Mode  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FAILED = ("runtime_error", "mismatch", "timeout", "crash", "forbidden")  # a channel across nodes must end in one


INSIDE = {"all": (*CUDA_CHANNELS, *FENCE_BYPASSES, *HOST_CHANNELS), "cuda": CUDA_CHANNELS, "none": ()}


def plan(inside: str) -> list[tuple[str, str, str, str]]:
    """(candidate, how, problem, expected) in the order they run, what only a GPU can show first: the CUDA
    channels, the honest candidates (both policies), the fence's channels, the host's (which cpu mode in CI
    covers too); each channel across nodes, and those of ``INSIDE[inside]`` inside a node too."""
    runs = []
    for name in CUDA_CHANNELS:
        runs += _channel(name, inside)
    for name in HONEST:
        for policy in ("report", "forbid-collectives"):
            runs.append((name, f"policy={policy}", problem_of(name), "ok"))
    for name in (*FENCE_BYPASSES, *HOST_CHANNELS):
        runs += _channel(name, inside)
    return runs


def _channel(name: str, inside: str) -> list[tuple[str, str, str, str]]:
    across = (name, "across-nodes", "hierarchical_allreduce", "forbidden" if name in FENCE_BYPASSES else "fails")
    return [across, *([(name, "inside-a-node", "hierarchical_allreduce", "ok")] if name in INSIDE[inside] else [])]


def judged(status: str, expected: str, mode: Mode, name: str) -> str:
    if status == "skipped" and mode is Mode.CPU and name in CUDA_CHANNELS:
        return "SKIPPED (needs a GPU mode)"
    if expected == "fails":
        return "PASS" if status in FAILED else "FAIL"
    return "PASS" if status == expected else "FAIL"


def run(mode: Mode, world_size: int, nodes: int, out: Path, budget_s: float, inside: str, timeout_s: float) -> int:
    began = time.monotonic()
    runs = plan(inside)
    failures = not_run = 0
    log = out / f"node_isolation_{mode.value}_w{world_size}n{nodes}.jsonl"
    with Session(mode, world_size, nodes=nodes) as session, tempfile.TemporaryDirectory() as folder, \
            log.open("w") as records:
        for index, (name, how, problem, expected) in enumerate(runs):
            if time.monotonic() - began > budget_s:
                for rest_name, rest_how, _, rest_expected in runs[index:]:
                    print(f"W={world_size} nodes={nodes}  {rest_name:36s} {rest_how:30s} NOT RUN (budget of "
                          f"{budget_s:.0f} s spent)  expected {rest_expected}", flush=True)
                not_run = len(runs) - index
                break
            if how.startswith("policy="):
                path, policy = HONEST[name], how.split("=", 1)[1]
            else:
                path, policy = node_attack(name, "world" if how == "across-nodes" else "node", Path(folder)), "report"
            config = EvalConfig(world_size=world_size, nodes=nodes, mode=mode, trials=1, upstream_trials=1,
                                timeout=timeout_s, policy=policy)
            started = time.monotonic()
            result = evaluate(get_problem(problem), Candidate.from_file(path), config, session)
            status = result.status.value
            verdict = judged(status, expected, mode, name)
            failures += verdict == "FAIL"
            reason = " ".join(str(result.details.error or result.message).split())[:200]
            print(f"W={world_size} nodes={nodes}  {name:36s} {how:30s} {status:14s} expected {expected:10s} {verdict:5s} "
                  f"{time.monotonic() - started:5.1f} s  {reason}", flush=True)
            records.write(json.dumps({"candidate": name, "how": how, "world_size": world_size, "nodes": nodes,
                                      "mode": mode.value, "status": status, "expected": expected, "verdict": verdict,
                                      "seconds": round(time.monotonic() - started, 2), "message": result.message[:2000],
                                      "collectives_used": result.collectives_used,
                                      "sandbox": result.details.sandbox}) + "\n")
    print(f"W={world_size} nodes={nodes}: {len(runs) - not_run} run, {failures} FAIL, {not_run} not run "
          f"({time.monotonic() - began:.0f} s)", flush=True)
    return 1 if failures or not_run else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="shared-gpu", choices=[m.value for m in Mode])
    parser.add_argument("--topology", default="4x2", help="W x nodes, e.g. 4x2, 8x2, 8x4")
    parser.add_argument("--out", default=".", type=Path)
    parser.add_argument("--budget-s", default=170.0, type=float, help="stop starting evaluations after this long")
    parser.add_argument("--timeout-s", default=90.0, type=float, help="one evaluation's job timeout")
    parser.add_argument("--inside", default="all", choices=sorted(INSIDE),
                        help="the channels also run inside a node (every channel runs across nodes)")
    args = parser.parse_args()
    wrong = {key: os.environ.get(key) for key, value in MULTICAST_OFF.items() if os.environ.get(key) != value}
    if wrong:
        print(f"refusing to run: NVLink multicast must stay off ({MULTICAST_OFF}); here {wrong}", file=sys.stderr)
        return 2
    world_size, nodes = (int(part) for part in args.topology.split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    return run(Mode(args.mode), world_size, nodes, args.out, args.budget_s, args.inside, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
