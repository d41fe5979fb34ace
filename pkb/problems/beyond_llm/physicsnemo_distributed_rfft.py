"""Distributed 2-D real FFT (PhysicsNeMo ``DistributedRFFT2``, pencil decomposition): the field is split
over the ranks along the second FFT axis; an FFT along the first (whole) axis, a pencil transpose (an
all-to-all), and an FFT along the second axis leave each rank a slab of the half spectrum.

Per rank: x [..., n0, n1/W] fp32 (in every run precision, as upstream's factory makes it; dims ``dim`` =
(d0, d1), x split along d1 in rank order), s = (s0, s1) (output sizes along d0 and d1; s0 divisible by
W), dim, norm, group=None (the default group)
  ->  complex64 [..., s0/W, s1//2 + 1]: rows [r*s0/W, (r+1)*s0/W) along d0 of
      torch.fft.rfftn(global x, s=s, dim=dim, norm=norm). Both real and imaginary parts are checked.

Cost: a rank must at least exchange its share of the field once (the cheapest plan transposes the real
input, then runs rfft and fft): link = (W-1)/W * (prod of the other dims)*n0*(n1/W)*4 bytes.
flops: 2.5 * N * log2(n0*n1) per rank for a real 2-D FFT of N/W points (N = the global field size,
5 N log2 N for a complex one). HBM: read the input, write the output.

Cases: ``upstream`` is the upstream benchmark's input (x [16, 1024, 1024/W] fp32, s = (1024, 1024),
dim = (1, 2), 'ortho'). Benchmarks: FourCastNet (AFNO) works on ERA5 at 0.25 degrees, 720x1440 (the
721st latitude row dropped), 20 variables, batch 1 (``fourcastnet_era5_20x720x1440``);
``catalog_16x1024x1024`` is the upstream catalog's field.
"""

import math

import torch

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.beyond_llm._fft import rank_slab, transpose, upstream_field


def make_inputs(case, rank, world_size, gen):
    *lead, n0, n1 = case["global_shape"]
    x = randn(gen, *lead, n0, n1 // world_size)  # this rank's slab of the global field (slabs in rank order)
    dim = tuple(case["dim"])
    if dim != (-2, -1):
        x = x.movedim((-2, -1), dim).contiguous()
    return x, tuple(case["s"]), dim, case.get("norm", "ortho"), None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: slab ``rank`` along d1 of one N(0, 1) fp32 field, drawn whole on every rank after seeding
    as rank 0."""
    field = upstream_field(PROBLEM.upstream_id, case["global_shape"], trial, device)
    dim = tuple(case["dim"])
    return rank_slab(field, dim[1], rank, world_size), tuple(case["s"]), dim, case.get("norm", "ortho"), None


def reference(x, s, dim, norm="ortho", group=None):
    d0, d1 = (d % x.dim() for d in dim)
    field = torch.fft.fft(x.float(), n=s[0], dim=d0, norm=norm)
    field = transpose(field, split_dim=d0, gather_dim=d1, group=group)
    return torch.fft.fft(field, n=s[1], dim=d1, norm=norm).narrow(d1, 0, s[1] // 2 + 1).contiguous()


def cost(case, world_size):
    *lead, n0, n1 = case["global_shape"]
    points = math.prod(lead) * n0 * n1
    s0, s1 = case["s"]
    out_bytes = math.prod(lead) * (s0 // world_size) * (s1 // 2 + 1) * 8
    return Cost(link_bytes=(world_size - 1) / world_size * points / world_size * 4,
                flops=2.5 * points / world_size * math.log2(s0 * s1),
                hbm_bytes=points / world_size * 4 + out_bytes, pattern="all_to_all")


def _case(name, global_shape, s, dim=(-2, -1), note="", tags=(), **extra):
    return Case(name, {"global_shape": global_shape, "s": s, "dim": dim, **extra}, note=note, tags=tags)


PROBLEM = Problem(
    name="physicsnemo_distributed_rfft", version=2, upstream_id=59, category="beyond_llm",
    source="NVIDIA PhysicsNeMo distributed FFT (DistributedRFFT2: fft, pencil all-to-all, fft)",
    world_sizes=(2, 4, 8),
    upstream=[_case("upstream", (16, 1024, 1024), (1024, 1024), dim=(1, 2))],
    tests=[
        _case("odd_rows_dims12", (3, 24, 40), (24, 40), dim=(1, 2), tags=("odd_sizes",)),
        _case("padded_s_4d", (2, 3, 16, 24), (24, 30), note="s pads d0 (16 -> 24) and crops d1 (24 -> 30 pads too)",
              tags=("argument_value", "layout")),
        _case("norm_backward", (5, 8, 16), (8, 16), norm="backward", tags=("argument_value",)),
    ],
    benchmarks=[
        _case("fourcastnet_era5_20x720x1440", (20, 720, 1440), (720, 1440)),
        _case("catalog_16x1024x1024", (16, 1024, 1024), (1024, 1024), dim=(1, 2)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
