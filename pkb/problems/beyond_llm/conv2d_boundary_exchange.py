"""Patch-parallel Conv2d with a halo exchange (DistriFusion / distrifuser ``PatchConv2d``, exact
variant): the image is split into horizontal bands, one per rank, and a 3x3 convolution needs the
``padding`` rows next to each band from the neighbouring ranks.

Per rank: x [B, C_in, h_r, Wd] (band r of the rows, top to bottom; bands may differ in height, each at
least ``padding`` rows), weight [C_out, C_in, k, k] with k = 2*padding + 1, bias [C_out] or None (the
same on every rank; x, weight and bias in the run's precision, bf16 by default), stride = 1, padding,
group=None (the default group)
  ->  [B, C_out, h_r, Wd] = band r of conv2d(full image, weight, bias, padding=padding), with zero padding
      only at the image's outer edges. fp32 accumulation, one rounding to x's dtype.

Another stride convolves each rank's haloed band with that stride on its own (rows are not realigned
across bands; only stride 1 equals the convolution of the full image); padding 0 needs no exchange.

Tolerance: the dtype's default; in fp32 2^-8 absolute and relative (cuDNN runs fp32 convolutions in TF32
by default on GPUs, as in the Conv3d problem: outputs are ~1, a missing halo row is off by ~1).

Cost: each rank needs ``padding`` rows from each neighbour: link = 2 * padding*B*C_in*Wd*b per inner
rank (the busiest), i.e. a neighbour exchange, not an all-gather. flops: 2*B*C_out*C_in*k*k*h*Wd for
the band. HBM: read x and weight, write the output.

Benchmarks: SDXL's UNet at 1024x1024 works on a 128x128 latent; its 3x3 convolutions run with 320
channels at 128x128, 640 at 64x64 and 1280 at 32x32 (``sdxl_1024_*``), batch 2 (classifier-free
guidance). ``catalog_c1280_128x128`` keeps the upstream catalog's 1280 channels at 128x128. The
``upstream`` case is the upstream factory's: 1280 channels, a 256 x 128 image (128 rows per W/2 ranks,
so 256/W rows per rank), about 480/W GFLOP per rank: minutes on a CPU, so it is checked in cuda mode only.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn
from pkb.problems.beyond_llm._common import dtype_of


def band_rows(case, world_size, rank):
    """Rows of band ``rank``: the case's height split like ``torch.tensor_split`` (uneven when it does not divide)."""
    height = case["height"]
    return height // world_size + (1 if rank < height % world_size else 0)


def make_inputs(case, rank, world_size, gen):
    dtype, channels = dtype_of(case), case["channels"]
    padding = case.get("padding", 1)
    kernel = 2 * padding + 1
    x = randn(gen, case["batch"], channels, band_rows(case, world_size, rank), case["width"], dtype=dtype)
    weight = randn(gen.shared, case.get("channels_out", channels), channels, kernel, kernel, dtype=dtype,
                   scale=(channels * kernel * kernel) ** -0.5)
    bias = randn(gen.shared, case.get("channels_out", channels), dtype=dtype) if case.get("bias", True) else None
    return x, weight, bias, 1, padding, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) x, weight (not scaled by the fan-in), then bias, in the run's dtype."""
    dtype, channels, padding = dtype_of(case), case["channels"], case.get("padding", 1)
    kernel = 2 * padding + 1
    x = torch.randn((case["batch"], channels, band_rows(case, world_size, rank), case["width"]), dtype=dtype,
                    device=device)
    weight = torch.randn((channels, channels, kernel, kernel), dtype=dtype, device=device)
    return x, weight, torch.randn((channels,), dtype=dtype, device=device), 1, padding, None


def reference(x, weight, bias, stride=1, padding=1, group=None):
    bias = bias.float() if bias is not None else None
    if padding == 0:  # no halo
        return F.conv2d(x.float(), weight.float(), bias, stride=stride).to(x.dtype)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    # Every rank's top and bottom `padding` rows, gathered flat (gloo) then picked by neighbour.
    edges = torch.cat([x[:, :, :padding], x[:, :, x.shape[2] - padding:]], dim=2).contiguous()
    gathered = edges.new_empty(world_size * edges.numel())
    dist.all_gather_into_tensor(gathered, edges.reshape(-1), group=group)
    gathered = gathered.view(world_size, *edges.shape)
    zeros = torch.zeros_like(x[:, :, :padding])
    above = gathered[rank - 1][:, :, padding:] if rank > 0 else zeros
    below = gathered[rank + 1][:, :, :padding] if rank < world_size - 1 else zeros
    band = torch.cat([above, x, below], dim=2).float()
    out = F.conv2d(band, weight.float(), bias, stride=stride, padding=(0, padding))
    return out.to(x.dtype)


def tolerance(case, world_size, dtype):
    if dtype == torch.float32:  # TF32, cuDNN's default for fp32 convolutions
        return Tolerance(2.0**-8, 2.0**-8)
    return default_tolerance(dtype)


def cost(case, world_size):
    itemsize = dtype_of(case).itemsize
    padding = case.get("padding", 1)
    kernel = 2 * padding + 1
    batch, channels, width = case["batch"], case["channels"], case["width"]
    channels_out = case.get("channels_out", channels)
    rows = band_rows(case, world_size, 0)
    halo = 2 * padding * batch * channels * width * itemsize
    flops = 2 * batch * channels_out * channels * kernel * kernel * rows * width
    hbm = (batch * channels * rows * width + channels_out * channels * kernel * kernel
           + batch * channels_out * rows * width) * itemsize
    return Cost(link_bytes=halo, flops=flops, hbm_bytes=hbm, pattern="neighbour_exchange")


PROBLEM = Problem(
    name="conv2d_boundary_exchange", version=3, upstream_id=87, category="beyond_llm",
    source="DistriFusion (distrifuser) PatchConv2d halo exchange, exact (no stale activations)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"batch": 1, "channels": 1280, "height": 256, "width": 128}, slow_on_cpu=True,
             note="the upstream factory at its defaults: 256/W rows of 1280 x 128 per rank"),
    ],
    tests=[
        Case("uneven_bands", {"batch": 1, "channels": 3, "channels_out": 5, "height": 21, "width": 7},
             note="21 rows: bands of 11/10, 6/5, 3/2 rows", tags=("uneven_sizes", "odd_sizes")),
        Case("padding2", {"batch": 2, "channels": 4, "height": 19, "width": 5, "padding": 2},
             note="5x5 kernel: two halo rows from each neighbour",
             tags=("argument_value", "uneven_sizes", "odd_sizes")),
        Case("no_bias", {"batch": 1, "channels": 6, "channels_out": 4, "height": 26, "width": 9, "bias": False},
             tags=("argument_value", "uneven_sizes", "odd_sizes")),
    ],
    benchmarks=[
        Case("sdxl_1024_c320_128x128", {"batch": 2, "channels": 320, "height": 128, "width": 128}),
        Case("sdxl_1024_c640_64x64", {"batch": 2, "channels": 640, "height": 64, "width": 64}),
        Case("sdxl_1024_c1280_32x32", {"batch": 2, "channels": 1280, "height": 32, "width": 32}),
        Case("catalog_c1280_128x128", {"batch": 1, "channels": 1280, "height": 128, "width": 128}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
