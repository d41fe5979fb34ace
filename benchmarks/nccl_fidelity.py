"""Timing fidelity on several GPUs: the harness's busbw for NCCL all-reduce and all-gather against a
plain CUDA-event loop over the same calls. Prints measured numbers; asserts nothing.

For each NCCL probe of ``pkb.measure.probes`` (in-place ``dist.all_reduce``; ``all_gather_into_tensor``
into a new buffer) and each size from 64 MiB to 1 GiB per rank, in cuda mode on ``--world-size`` GPUs:

- the harness: ``time_reference`` (parent clock, rotating fresh inputs, aligned starts; the protocol
  every result uses), measured ``--measurements`` times in one session: median and spread;
- a plain loop: ``pkb.measure.calibrate.time_collectives_plainly``, a spawned group calling the same
  function on one buffer between two CUDA events, warm-up first; per repeat the slowest rank, the
  median of 7 repeats as one measurement;
- harness busbw / plain-loop busbw (1.0 = the same).

    python benchmarks/nccl_fidelity.py [--world-size 2] [--measurements 5]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from pkb.evaluate.config import EvalConfig
from pkb.evaluate.session import Session
from pkb.evaluate.timing import spread, time_reference
from pkb.measure.calibrate import time_collectives_plainly
from pkb.measure.probes import NCCL_PROBES
from pkb.runtime.modes import Mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--measurements", type=int, default=5)
    args = parser.parse_args()
    W = args.world_size
    if torch.cuda.device_count() < W:
        raise SystemExit(f"needs {W} GPUs, this machine has {torch.cuda.device_count()}")
    print(f"{W} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    config = EvalConfig(world_size=W, mode=Mode.CUDA, perf=True, timeout=300.0)
    harness: dict[str, list[float]] = {}
    with Session(Mode.CUDA, W) as session:
        for _ in range(args.measurements):  # interleaved, so a drift in the machine shows as spread
            for kind, probe in NCCL_PROBES.items():
                for case in probe.benchmarks:
                    harness.setdefault(f"{kind}/{case.name}", []).append(
                        time_reference(session, probe, case, config).per_call_s())
    sizes = [(kind, case.name, math.prod(case["shape"])) for kind, probe in NCCL_PROBES.items()
             for case in probe.benchmarks]
    # One spawned group; its repeats split into ``measurements`` runs of 7.
    repeats = time_collectives_plainly(W, sizes, num_repeats=7 * args.measurements)
    plain = {key: [statistics.median(times[i:i + 7]) for i in range(0, len(times), 7)] for key, times in repeats.items()}
    print(f"{'call':<26} {'harness us':>11} {'spread':>7} {'busbw':>7} {'plain us':>10} {'spread':>7} {'busbw':>7} "
          f"{'harness/plain busbw':>20}")
    for kind, probe in NCCL_PROBES.items():
        for case in probe.benchmarks:
            key = f"{kind}/{case.name}"
            link_bytes = probe.cost(case, W).link_bytes
            h, p = statistics.median(harness[key]), statistics.median(plain[key])
            print(f"{key:<26} {h * 1e6:>11.1f} {spread(harness[key]) * 100:>6.2f}% {link_bytes / h / 1e9:>7.1f} "
                  f"{p * 1e6:>10.1f} {spread(plain[key]) * 100:>6.2f}% {link_bytes / p / 1e9:>7.1f} {p / h:>20.4f}")
    print(f"(busbw in GB/s; {args.measurements} measurements each: harness = time_reference's per-call time, "
          f"plain = median of 7 repeats of a CUDA-event loop; spread = (max - min) / median)")
    for key in harness:
        print(f"  {key}: harness [{', '.join(f'{v * 1e6:.1f}' for v in harness[key])}] "
              f"plain [{', '.join(f'{v * 1e6:.1f}' for v in plain[key])}]")


if __name__ == "__main__":
    main()
