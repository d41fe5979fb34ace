"""How pkb's accuracy rule (pkb/evaluate/accuracy.py) judges honest and dishonest answers, measured on many
random inputs: the share of trials each candidate passes, at W = 2, 4 and 8.

The all-reduce of W ranks' N(0, 1) bf16 buffers (the shapes of problem 1's cases), and the row-parallel GEMM +
all-reduce (problem 13's shape family, K = 64 per rank), simulated in one process: the exact answer is the fp64
sum, the reference sums as NCCL and gloo do (a bf16 ring, rounding after each addition) or rounds once from fp32
(``--reference once``), and each candidate is one way to compute the answer. Only the parent's judgement is
measured here (``judge``: the rule that decides pkb's verdict on a tensor), not the ranks.

    python benchmarks/accuracy_rule.py --trials 200 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pkb.evaluate.accuracy import judge
from pkb.problem import reduction_tolerance

SHAPES = ((3, 683), (5, 7, 11), (129, 8), (256, 256))  # problem 1's tests cases and a 64K-element buffer


def ring(parts: list[torch.Tensor], dtype=torch.bfloat16) -> torch.Tensor:
    """Rank by rank, rounding to ``dtype`` after each addition (NCCL's and gloo's bf16 ring)."""
    out = parts[0].to(dtype)
    for part in parts[1:]:
        out = (out.float() + part.float()).to(dtype)
    return out


def tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise, rounding to bf16 after each level (a tree all-reduce)."""
    while len(parts) > 1:
        parts = [ring(parts[i:i + 2]) for i in range(0, len(parts), 2)]
    return parts[0].bfloat16()


def truncated(values: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16 by dropping the low 16 bits (round toward zero, as some hand-written kernels convert)."""
    return (values.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


def lose_largest(values: torch.Tensor) -> torch.Tensor:
    out = values.clone().reshape(-1)
    out[int(out.float().abs().argmax())] = 0
    return out.reshape(values.shape)


def drop_one_term(values: torch.Tensor, parts: list[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """One random element misses the last rank's contribution (a race that lost one write)."""
    out = values.clone().reshape(-1)
    index = int(torch.randint(out.numel(), (1,), generator=gen))
    out[index] = (out[index].float() - parts[-1].reshape(-1)[index].float()).bfloat16()
    return out.reshape(values.shape)


CANDIDATES = {  # name -> (honest, make(parts, exact, gen))
    "fp64 rounded once": (True, lambda p, e, g: e.bfloat16()),
    "fp32 sum rounded once": (True, lambda p, e, g: sum(x.float() for x in p).bfloat16()),
    "bf16 ring, same order": (True, lambda p, e, g: ring(p)),
    "bf16 ring, reversed": (True, lambda p, e, g: ring(p[::-1])),
    "bf16 tree": (True, lambda p, e, g: tree(p)),
    "fp32 sum, truncated to bf16": (True, lambda p, e, g: truncated(sum(x.float() for x in p))),
    "biased +0.8%": (False, lambda p, e, g: (e * 1.008).bfloat16()),
    "biased +0.5%": (False, lambda p, e, g: (e * 1.005).bfloat16()),
    "fp8 e4m3 on the wire": (False, lambda p, e, g: sum(x.float().to(torch.float8_e4m3fn).float() for x in p).bfloat16()),
    "fp8 e5m2 on the wire": (False, lambda p, e, g: sum(x.float().to(torch.float8_e5m2).float() for x in p).bfloat16()),
    "largest element lost": (False, lambda p, e, g: lose_largest(e.bfloat16())),
    "one element misses a rank": (False, lambda p, e, g: drop_one_term(ring(p), p, g)),
}


def measure(world_size: int, trials: int, reference_kind: str, seed: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(seed)
    tolerance = reduction_tolerance(torch.bfloat16, world_size)
    passed = {name: 0 for name in CANDIDATES}
    worst = {name: 0.0 for name in CANDIDATES}
    count = 0
    for trial in range(trials):
        shape = SHAPES[trial % len(SHAPES)]
        parts = [torch.randn(*shape, generator=gen).bfloat16() for _ in range(world_size)]
        exact = sum(x.double() for x in parts)
        reference = ring(parts) if reference_kind == "ring" else sum(x.float() for x in parts).bfloat16()
        count += 1
        for name, (_, make) in CANDIDATES.items():
            candidate = make(parts, exact, gen)
            failure, accuracy = judge(reference, candidate, exact, tolerance, torch.bfloat16, "out")
            passed[name] += failure is None
            worst[name] = max(worst[name], accuracy.rms_ratio)
    return {name: {"honest": CANDIDATES[name][0], "passed": passed[name], "trials": count,
                   "worst_rms_ratio": round(worst[name], 3)} for name in CANDIDATES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="random inputs per world size (default 200)")
    parser.add_argument("--reference", choices=("ring", "once"), default="ring",
                        help="how the reference sums: a bf16 ring (NCCL, gloo) or fp32 rounded once")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.monotonic()
    table = {w: measure(w, args.trials, args.reference, args.seed + w) for w in (2, 4, 8)}
    print(f"pkb's accuracy rule on the all-reduce, reference summed as a {args.reference}; {args.trials} random inputs "
          f"per world size (shapes {', '.join('x'.join(map(str, s)) for s in SHAPES)}), {time.monotonic() - began:.0f} s")
    print(f"{'candidate':32} {'honest':6}  " + "  ".join(f"W={w}: passed (worst RMS ratio)" for w in table))
    for name in CANDIDATES:
        cells = "  ".join(f"{table[w][name]['passed']:>4}/{table[w][name]['trials']:<4} ({table[w][name]['worst_rms_ratio']:>7.2f})"
                          f"{'':8}" for w in table)
        print(f"{name:32} {'yes' if CANDIDATES[name][0] else 'no':6}  {cells}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"reference": args.reference, "trials": args.trials, "table": table}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
