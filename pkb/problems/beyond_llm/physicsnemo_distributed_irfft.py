"""Distributed 2-D inverse real FFT (PhysicsNeMo ``DistributedIRFFT2``, pencil decomposition): the half
spectrum is split over the ranks along the first FFT axis; the output field comes back split along
the second.

Per rank: x complex64 [..., s0/W, F] (in every run precision, as upstream's factory makes it; rows
[r*s0/W, (r+1)*s0/W) along d0 of the half spectrum; F = s1//2 + 1 frequencies along d1), s = (s0, s1)
(output sizes; both divisible by W), dim = (d0, d1), norm, group=None (the default group)
  ->  fp32 [..., s0, s1/W]: columns [r*s1/W, (r+1)*s1/W) along d1 of
      torch.fft.irfftn(global x, s=s, dim=dim, norm=norm).

The spectrum is Hermitian where it must be (its zero-frequency and Nyquist columns along d0), so every
inverse-FFT plan agrees on the field; PhysicsNeMo's plan (and the upstream reference) takes the real
part of a complex inverse FFT of the conjugate-padded spectrum, which is the same field. The reference
runs three pencil transposes: to column chunks (whole along d0) for the inverse FFT along d0, back to
row slabs for the inverse real FFT along d1, and to column slabs of the output. (PhysicsNeMo instead
all-gathers the conjugate rows it needs for padding; any plan that gives the same field is fine.)

Cost: at least one transpose of the data: link = (W-1)/W * (prod of the other dims)*s0*(s1/W)*4 (the
output slab, the smaller of input and output). flops: 2.5 * N/W * log2(s0*s1) with N the global
output size. HBM: read the input, write the output.

Cases: ``upstream`` is the upstream benchmark's input (x complex64 [2, 10, 720/W, 721], s = (720, 1440),
dim = (-2, -1), 'ortho'). Benchmarks: FourCastNet's 720x1440 ERA5 grid with 20 variables
(``fourcastnet_era5_20x720x1440``) and the upstream catalog's [2, 10] batch of 720x1440 spectra
(``catalog_2x10x720x1440``).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.beyond_llm._fft import rank_slab, transpose, upstream_field


def _hermitian(values: torch.Tensor) -> torch.Tensor:
    """``values`` [..., n] complex made conjugate-symmetric along the last axis: v[-k] = conj(v[k])."""
    mirrored = torch.roll(values.flip(-1), 1, dims=-1).conj()  # mirrored[k] = conj(values[-k])
    return (values + mirrored) / 2


def make_inputs(case, rank, world_size, gen):
    """This rank's row slab of a random half spectrum. Free columns are drawn per rank; the zero-frequency
    and (even s1) Nyquist columns must be Hermitian along d0 for the field to be real, so they are drawn
    whole from ``gen.shared`` and sliced (then every inverse-FFT plan agrees on the field)."""
    *lead, s0, s1 = case["global_shape"]
    num_freq, rows = s1 // 2 + 1, s0 // world_size
    x = torch.complex(randn(gen, *lead, rows, num_freq), randn(gen, *lead, rows, num_freq))
    constrained = [0] + ([num_freq - 1] if s1 % 2 == 0 else [])
    for column in constrained:
        whole = torch.complex(randn(gen.shared, *lead, s0), randn(gen.shared, *lead, s0))
        x[..., column] = _hermitian(whole)[..., rank * rows:(rank + 1) * rows]
    dim = tuple(case["dim"])
    if dim != (-2, -1):
        x = x.movedim((-2, -1), dim).contiguous()
    return x, (s0, s1), dim, case.get("norm", "ortho"), None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: row slab ``rank`` along d0 of ``torch.fft.rfft2`` of one N(0, 1) fp32 field, drawn whole on
    every rank after seeding as rank 0 (so the spectrum is Hermitian where it must be)."""
    *_, s0, s1 = case["global_shape"]
    dim, norm = tuple(case["dim"]), case.get("norm", "ortho")
    field = upstream_field(PROBLEM.upstream_id, case["global_shape"], trial, device)
    spectrum = torch.fft.rfft2(field, s=(s0, s1), dim=dim, norm=norm)
    return rank_slab(spectrum, dim[0], rank, world_size), (s0, s1), dim, norm, None


def reference(x, s, dim, norm="ortho", group=None):
    world_size = dist.get_world_size(group)
    d0, d1 = (d % x.dim() for d in dim)
    num_freq = x.shape[d1]
    chunk = -(-num_freq // world_size)
    pad = [0, 0] * (x.dim() - 1 - d1) + [0, chunk * world_size - num_freq]
    spectrum = torch.nn.functional.pad(x.to(torch.complex64), pad)
    columns = transpose(spectrum, split_dim=d1, gather_dim=d0, group=group)  # whole along d0
    columns = torch.fft.ifft(columns, n=s[0], dim=d0, norm=norm)
    rows = transpose(columns, split_dim=d0, gather_dim=d1, group=group).narrow(d1, 0, num_freq)
    field = torch.fft.irfft(rows, n=s[1], dim=d1, norm=norm)
    return transpose(field, split_dim=d1, gather_dim=d0, group=group).contiguous()


def cost(case, world_size):
    *lead, s0, s1 = case["global_shape"]
    points = math.prod(lead) * s0 * s1
    in_bytes = math.prod(lead) * (s0 // world_size) * (s1 // 2 + 1) * 8
    return Cost(link_bytes=(world_size - 1) / world_size * points / world_size * 4,
                flops=2.5 * points / world_size * math.log2(s0 * s1),
                hbm_bytes=in_bytes + points / world_size * 4, pattern="all_to_all")


def _case(name, global_shape, dim=(-2, -1), note="", tags=(), slow_on_cpu=False, **extra):
    return Case(name, {"global_shape": global_shape, "dim": dim, **extra}, note=note, tags=tags, slow_on_cpu=slow_on_cpu)


PROBLEM = Problem(
    name="physicsnemo_distributed_irfft", version=3, upstream_id=60, category="beyond_llm",
    source="NVIDIA PhysicsNeMo distributed FFT (DistributedIRFFT2)",
    world_sizes=(2, 4, 8),
    # 20.7M fp32 outputs per rank: judged against the exact answer (fp64, 8 perturbed runs) it takes several GB in the
    # ranks and the parent at once, which took a 24 GiB 2-core test machine out of memory beside other evaluations
    upstream=[_case("upstream", (2, 10, 720, 1440), slow_on_cpu=True)],
    tests=[
        _case("odd_freqs_4d", (2, 3, 16, 24), note="13 frequencies: column chunks are padded",
              tags=("odd_sizes", "layout")),
        _case("dims12_backward", (3, 8, 40), dim=(1, 2), norm="backward", tags=("argument_value",)),
    ],
    benchmarks=[
        _case("fourcastnet_era5_20x720x1440", (20, 720, 1440)),
        _case("catalog_2x10x720x1440", (2, 10, 720, 1440)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
