"""How pkb's accuracy rule (pkb/evaluate/accuracy.py) judges honest and dishonest answers, measured on many random
inputs: the share of whole evaluations each candidate passes, at W = 2, 4 and 8, in bf16 and fp32.

Each scenario is a small workload simulated in one process, judged as an evaluation judges it: every case of the
scenario, three trials each, every rank's output through ``pkb.evaluate.accuracy.Judge`` (element-wise per tensor,
then the aggregate tests pooled per output over ranks and trials). The exact answer is the workload in fp64 and its
sensitivity comes from the workload run on inputs perturbed by pkb.runtime.exact, as a reference rank computes them.
Only the parent's judgement is measured here, not the ranks (tests/integration/test_verdict_integrity.py runs
candidates through rank processes).

Scenarios:
- ``allreduce``: W ranks' bf16 (fp32) buffers summed; the reference rounds after each addition as NCCL's and gloo's
  rings do.
- ``colsum``: the column sums of a 1,024-row matrix in fp32 (layernorm backward's dgamma): the reference is torch's
  blocked ``sum``; an honest kernel sums the rows one after the other.
- ``rmsnorm``: rows normalised by their RMS in fp32; the reference is torch's; an honest kernel sums each row's squares
  sequentially.

    python benchmarks/accuracy_rule.py --evaluations 100 --out results.json
    python benchmarks/accuracy_rule.py --world-sizes 8 --dtypes bf16 --evaluations 25 --seed 1 --out part1.json  # a part
    python benchmarks/accuracy_rule.py --merge part*.json --out results.json  # the parts summed
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pkb.evaluate.accuracy import PERTURBATIONS, Exact, Judge, Where
from pkb.problem import Tolerance, reduction_tolerance
from pkb.runtime.exact import perturbed, sensitivity

TRIALS = 3  # pkb's default trials per case


def ring(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rank by rank, rounding to ``dtype`` after each addition (NCCL's and gloo's ring)."""
    out = parts[0].to(dtype)
    for part in parts[1:]:
        out = (out.float() + part.float()).to(dtype)
    return out


def tree(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    while len(parts) > 1:
        parts = [ring(parts[i:i + 2], dtype) for i in range(0, len(parts), 2)]
    return parts[0].to(dtype)


def truncated(values: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16 by dropping the low 16 bits (round toward zero: the classic fast-cast bug)."""
    return (values.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


def away_from_zero(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounded to ``dtype`` away from zero (a hand-written conversion that rounds magnitudes up)."""
    nearest = values.to(dtype)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    larger = (nearest.view(bits) + 1).view(dtype)  # the next magnitude up: sign and magnitude bits
    return torch.where(nearest.double().abs() < values.double().abs(), larger, nearest)


def sparsified(parts: list[torch.Tensor], threshold: float, dtype: torch.dtype) -> torch.Tensor:
    return sum(torch.where(p.abs() < threshold, 0.0, p.float()) for p in parts).to(dtype)


def one_rank_dropped(parts: list[torch.Tensor], share: float, dtype: torch.dtype) -> torch.Tensor:
    first = parts[0].float()
    threshold = float(first.abs().reshape(-1).kthvalue(max(1, int(share * first.numel()))).values)
    return (torch.where(first.abs() <= threshold, 0.0, first) + sum(p.float() for p in parts[1:])).to(dtype)


@dataclass(frozen=True)
class Scenario:
    name: str
    shapes: tuple  # one per case
    make: Callable  # (shape, world_size, dtype, generator) -> inputs (a list)
    exact: Callable  # inputs raised to fp64 -> the exact output (fp64)
    reference: Callable  # inputs -> the reference's output
    tolerance: Callable  # (world_size, dtype) -> Tolerance
    candidates: dict  # name -> (honest, (inputs, dtype, generator) -> output)


def _allreduce_inputs(shape, world_size, dtype, gen):
    return [torch.randn(*shape, generator=gen).to(dtype) for _ in range(world_size)]


ALLREDUCE = Scenario(
    "allreduce", ((3, 683), (5, 7, 11), (129, 8), (256, 256), (4, 4)), _allreduce_inputs,
    exact=lambda parts: sum(parts), reference=lambda parts: ring(parts, parts[0].dtype),
    tolerance=lambda world_size, dtype: reduction_tolerance(dtype, world_size),
    candidates={
        "fp64 rounded once": (True, lambda p, d, g: sum(x.double() for x in p).to(d)),
        "fp32 sum rounded once": (True, lambda p, d, g: sum(x.float() for x in p).to(d)),
        "ring, same order": (True, lambda p, d, g: ring(p, d)),
        "ring, reversed": (True, lambda p, d, g: ring(p[::-1], d)),
        "tree": (True, lambda p, d, g: tree(p, d)),
        "fp32 sum truncated to bf16": (False, lambda p, d, g: truncated(sum(x.float() for x in p)) if d == torch.bfloat16
                                       else None),
        # in bf16 only: in fp32 its bias (about half a unit roundoff) is under what one fp32 scalar's rounding gives an
        # honest kernel (x * (1 / W)), the rule's floor there
        "exact sum rounded away from zero": (False, lambda p, d, g: away_from_zero(sum(x.double() for x in p), d)
                                             if d == torch.bfloat16 else None),
        "gain +0.28%": (False, lambda p, d, g: (sum(x.double() for x in p) * 1.0028).to(d)),
        "offset +0.003 W": (False, lambda p, d, g: (sum(x.double() for x in p) + 0.003 * len(p)).to(d)),
        "every rank drops |v| < 0.04": (False, lambda p, d, g: sparsified(p, 0.04, d)),
        "one rank drops its smallest 5%": (False, lambda p, d, g: one_rank_dropped(p, 0.05, d)),
        "fp8 e4m3 on the wire": (False, lambda p, d, g: sum(x.float().to(torch.float8_e4m3fn).float() for x in p).to(d)),
        "largest element lost": (False, lambda p, d, g: _lose_largest(sum(x.float() for x in p).to(d))),
        "0.8% of elements off by 0.6 T": (False, lambda p, d, g: _off_by_tolerance(p, d, 125, 0.6)),
        "gain +0.3% under slab gains": (False, lambda p, d, g: _slab_gains(p, d, g)),
        "offset 0.9 atol on small tensors": (False, lambda p, d, g: _offset_when_small(p, d)),
    })


def _off_by_tolerance(parts: list[torch.Tensor], dtype: torch.dtype, every: int, share: float, gen=None,
                      ulps: bool = False) -> torch.Tensor:
    """The exact sum with one element in ``every`` off by ``share`` of the tolerance, with a sign drawn from its place
    (a corrupted lane; red team's ``garbage_on_0p8_percent``); ``ulps``: every element also moved one or two ulps at
    random (``median_inflation``)."""
    exact = sum(x.double() for x in parts).reshape(-1)
    tolerance = reduction_tolerance(dtype, len(parts))
    place = torch.arange(exact.numel())
    sign = torch.where((place * 2654435761 % 97) % 2 == 0, 1.0, -1.0).double()
    moved = torch.where(place % every == 7 % every, exact + sign * share * (tolerance.atol + tolerance.rtol * exact.abs()),
                        exact).to(dtype)
    if ulps:
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        steps = torch.randint(-2, 3, moved.shape, generator=gen).to(bits)
        moved = (moved.view(bits) + steps).view(dtype)
    return moved.reshape(parts[0].shape)


def _slab_gains(parts: list[torch.Tensor], dtype: torch.dtype, gen) -> torch.Tensor:
    """A +0.3 % gain hidden under a random gain (sd 0.7 %) per slab of rows, 32 slabs (red team's
    ``gain_0p3pct_hidden_by_slab_noise``: the clusters the rule once used)."""
    exact = sum(x.double() for x in parts)
    size = exact.shape[0]
    slab = torch.arange(size) * min(32, size) // size
    gains = (torch.rand(min(32, size), generator=gen, dtype=torch.float64) * 2 - 1) * 3 ** 0.5
    return (exact * (1.003 + 0.007 * gains[slab]).view(-1, *[1] * (exact.dim() - 1))).to(dtype)


def _offset_when_small(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """0.9 of the tolerance's atol added to every element of a tensor under 256 elements (red team's
    ``offset_on_small_tensors``: the aggregate tests once skipped outputs that small)."""
    exact = sum(x.double() for x in parts)
    return (exact + (0.9 * reduction_tolerance(dtype, len(parts)).atol if exact.numel() < 256 else 0.0)).to(dtype)


def _lose_largest(values: torch.Tensor) -> torch.Tensor:
    out = values.clone().reshape(-1)
    out[int(out.float().abs().argmax())] = 0
    return out.reshape(values.shape)


def _colsum_inputs(shape, world_size, dtype, gen):
    return [torch.randn(*shape, generator=gen).to(dtype)]


def _sequential_colsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[1], dtype=x.dtype)
    for row in x:
        out = out + row
    return out


COLSUM = Scenario(
    "colsum", ((1024, 64), (1024, 96), (1024, 33)), _colsum_inputs,
    exact=lambda inputs: inputs[0].sum(0), reference=lambda inputs: inputs[0].sum(0),
    tolerance=lambda world_size, dtype: Tolerance(1e-4, 1e-4),
    candidates={
        "sequential row loop": (True, lambda p, d, g: _sequential_colsum(p[0])),
        "fp64 rounded once": (True, lambda p, d, g: p[0].double().sum(0).to(d)),
        "gain +5e-5": (False, lambda p, d, g: (p[0].double().sum(0) * (1 + 5e-5)).to(d)),
        "one row of 1024 lost": (False, lambda p, d, g: p[0][1:].sum(0)),
    })


def _rmsnorm(x: torch.Tensor, sum_of_squares=None) -> torch.Tensor:
    squares = (x * x).sum(-1, keepdim=True) if sum_of_squares is None else sum_of_squares(x)
    return x * torch.rsqrt(squares / x.shape[-1] + 1e-6)


def _sequential_squares(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], 1, dtype=x.dtype)
    for column in range(x.shape[1]):
        out = out + x[:, column:column + 1] * x[:, column:column + 1]
    return out


RMSNORM = Scenario(
    "rmsnorm", ((64, 1024), (33, 4096)), _colsum_inputs,
    exact=lambda inputs: _rmsnorm(inputs[0]), reference=lambda inputs: _rmsnorm(inputs[0]),
    tolerance=lambda world_size, dtype: Tolerance(1e-4, 1e-4),
    candidates={
        "per-row sequential sum of squares": (True, lambda p, d, g: _rmsnorm(p[0], _sequential_squares)),
        "gain +5e-5": (False, lambda p, d, g: (_rmsnorm(p[0].double()) * (1 + 5e-5)).to(d)),
        "eps 1e-3 instead of 1e-6": (False, lambda p, d, g: p[0] * torch.rsqrt((p[0] * p[0]).mean(-1, keepdim=True) + 1e-3)),
    })

SCENARIOS = {s.name: s for s in (ALLREDUCE, COLSUM, RMSNORM)}


def evaluation(scenario: Scenario, candidate: Callable, world_size: int, dtype: torch.dtype, gen) -> bool | None:
    """One evaluation of one candidate: every case x TRIALS trials judged and pooled; whether it passed (None where
    the candidate does not apply to ``dtype``)."""
    judge = Judge(dtype)
    tolerance = scenario.tolerance(world_size, dtype)
    for trial in range(TRIALS):
        for case, shape in enumerate(scenario.shapes):
            inputs = scenario.make(shape, world_size, dtype, gen)
            got = candidate(inputs, dtype, gen)
            if got is None:
                return None
            reference = scenario.reference(inputs)
            exact = scenario.exact([x.double() for x in inputs])
            moved = [scenario.exact(list(perturbed(tuple(inputs), _precision(dtype), 1000 * trial + k)))
                     for k in range(PERTURBATIONS)]
            answer = Exact([exact], None, [sensitivity([exact], [[m] for m in moved]), None])
            for rank in range(world_size if scenario is ALLREDUCE else 1):
                found = judge.reply(Where(rank, str(case), trial), "outputs", [reference], [got],
                                    lambda _: tolerance, lambda: answer, "out")
                if found is not None:
                    return False
    return judge.pooled() is None


def _precision(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def measure(scenario: Scenario, world_size: int, dtype: torch.dtype, evaluations: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    table = {}
    for name, (honest, make) in scenario.candidates.items():
        outcomes = [evaluation(scenario, make, world_size, dtype, gen) for _ in range(evaluations)]
        if None in outcomes:
            continue
        table[name] = {"honest": honest, "passed": sum(outcomes), "evaluations": evaluations}
    return table


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _line(row: dict) -> str:
    fine = row["passed"] == row["evaluations"] if row["honest"] else row["passed"] == 0
    return (f"{row['scenario']:9} W={row['world_size']} {row['dtype']:8} {'honest' if row['honest'] else 'wrong':6} "
            f"{row['candidate']:36} passed {row['passed']:>4}/{row['evaluations']:<4} {'ok' if fine else 'WRONG'}")


def merged(paths: list[str]) -> list[dict]:
    """The rows of several runs' JSON (parts of one measurement, other seeds) summed per scenario, W, dtype and
    candidate."""
    table: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as handle:
            for row in json.load(handle)["rows"]:
                key = (row["scenario"], row["world_size"], row["dtype"], row["candidate"])
                into = table.setdefault(key, {**row, "passed": 0, "evaluations": 0})
                into["passed"] += row["passed"]
                into["evaluations"] += row["evaluations"]
    return list(table.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evaluations", type=int, default=100, help="evaluations per candidate and setting")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of " + ", ".join(SCENARIOS))
    parser.add_argument("--world-sizes", default="2,4,8", help="the all-reduce's world sizes (comma list)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="the all-reduce's dtypes (comma list of bf16, fp32)")
    parser.add_argument("--seed", type=int, default=53, help="a part run with another seed draws other inputs")
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no measurement: sum these runs' tables (parts with other seeds) and print (and --out) it")
    args = parser.parse_args()
    if args.merge:
        results = merged(args.merge)
        for row in results:
            print(_line(row))
    else:
        torch.set_num_threads(1)
        results, began = [], time.monotonic()
        for name in args.scenarios.split(","):
            scenario = SCENARIOS[name]
            settings = [(w, DTYPES[d]) for w in (map(int, args.world_sizes.split(",")) if scenario is ALLREDUCE else (1,))
                        for d in (args.dtypes.split(",") if scenario is ALLREDUCE else ("fp32",))]
            for world_size, dtype in settings:
                table = measure(scenario, world_size, dtype, args.evaluations, args.seed + world_size)
                for candidate, row in table.items():
                    results.append({"scenario": name, "world_size": world_size, "dtype": str(dtype)[6:],
                                    "candidate": candidate, **row})
                    print(_line(results[-1]), flush=True)
        print(f"{time.monotonic() - began:.0f} s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"trials": TRIALS, "rows": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
