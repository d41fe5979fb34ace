"""Input-channel-parallel Conv3d + all-reduce (Open-Sora VAE, channel-chunked Conv3d under tensor
parallelism): each rank holds a slice of the input channels and the matching slice of the weight; the
partial convolutions are summed across ranks and the bias is added once.

Per rank: input [B, C_in/W, T, H, Wd] (this rank's input channels), weight [C_out, C_in/W, kT, kH, kW]
(the matching slice), bias [C_out] or None (the same on every rank; input, weight and bias in the run's
precision, bf16 by default), stride, padding, dilation (ints or 3-tuples), groups=1, group=None (the
default group)
  ->  [B, C_out, T', H', W'] on every rank = conv3d(full input, full weight, bias, ...) in the input's
      dtype, rounded as upstream's reference rounds: each rank's partial convolution accumulates in
      fp32 inside the convolution and is rounded to the input's dtype, the partials are all-reduced in
      that dtype, and the bias is added to the sum in that dtype. (Upstream splits a convolution of more
      than 2^31 elements into channel chunks summed in fp32; no case here is that large.)

Cost: the output is all-reduced: link = 2(W-1)/W * B*C_out*T'*H'*W'*b (nccl-tests). flops: the local
partial convolution, 2*B*C_out*(C_in/W)*kT*kH*kW*T'*H'*W'. HBM: read input and weight, write the
output.

Tolerance: the W partial sums may be added in any order and in bf16 (a ring all-reduce):
``reduction_tolerance(dtype, W)`` for outputs of size ~1 (weights are scaled by 1/sqrt(fan-in)), or the
dtype's default where that is larger (fp32: another summation order inside the convolution, and TF32,
cuDNN's default for fp32 convolutions on GPUs: 2^-8 absolute and relative).

Benchmarks: Open-Sora 1.2's VAE decoder runs 3x3x3 convolutions with 512 channels on 4x-compressed
time and 8x-compressed space: 17 latent frames at 64x64 (the catalog's 512x512 clip) and at 90x160
(720p), pre-padded by one in every direction (padding 0), batch 1. The ``upstream`` case is the
upstream factory's, the first of these at every W: x [1, 512/W, 19, 66, 66], weight [512, 512/W, 3, 3, 3]
(about 250 GFLOP per rank at W=4: minutes for a reference and a candidate on a CPU, so it is checked in
cuda mode only).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn, reduction_tolerance
from pkb.problems.beyond_llm._common import dtype_of


def _triple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value, value)


def output_shape(case):
    kernel, stride, padding, dilation = (_triple(case[k]) for k in ("kernel", "stride", "padding", "dilation"))
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, s, p, d in zip(case["frames_hw"], kernel, stride, padding, dilation))


def make_inputs(case, rank, world_size, gen):
    dtype = dtype_of(case)
    local_in = case["channels_in"] // world_size
    kernel = _triple(case["kernel"])
    fan_in = case["channels_in"] * kernel[0] * kernel[1] * kernel[2]
    x = randn(gen, case["batch"], local_in, *case["frames_hw"], dtype=dtype)
    weight = randn(gen, case["channels_out"], local_in, *kernel, dtype=dtype, scale=fan_in ** -0.5)
    bias = randn(gen.shared, case["channels_out"], dtype=dtype) if case.get("bias", True) else None
    return x, weight, bias, case["stride"], case["padding"], case["dilation"], 1, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): N(0, 1) input, then weight (not scaled by the fan-in), in the run's dtype;
    bias linspace(-0.1, 0.1)."""
    dtype, local_in, channels_out = dtype_of(case), case["channels_in"] // world_size, case["channels_out"]
    x = torch.randn((case["batch"], local_in, *case["frames_hw"]), dtype=dtype, device=device)
    weight = torch.randn((channels_out, local_in, *_triple(case["kernel"])), dtype=dtype, device=device)
    bias = torch.linspace(-0.1, 0.1, channels_out, dtype=dtype, device=device)
    return x, weight, bias, case["stride"], case["padding"], case["dilation"], 1, None


def reference(input, weight, bias, stride, padding, dilation, groups=1, group=None):
    out = F.conv3d(input, weight, None, _triple(stride), _triple(padding), _triple(dilation), groups)
    dist.all_reduce(out, group=group)  # in the input's dtype, as upstream
    if bias is not None:  # added once, after the sum
        out = out + bias.view(1, -1, 1, 1, 1)
    return out


def cost(case, world_size):
    itemsize = dtype_of(case).itemsize
    kernel = _triple(case["kernel"])
    out_elems = case["batch"] * case["channels_out"] * torch.Size(output_shape(case)).numel()
    local_in = case["channels_in"] // world_size
    flops = 2 * out_elems * local_in * kernel[0] * kernel[1] * kernel[2]
    in_elems = case["batch"] * local_in * torch.Size(case["frames_hw"]).numel()
    weight_elems = case["channels_out"] * local_in * kernel[0] * kernel[1] * kernel[2]
    return Cost(link_bytes=2 * (world_size - 1) / world_size * out_elems * itemsize, flops=flops,
                hbm_bytes=(in_elems + weight_elems + out_elems) * itemsize, pattern="all_reduce")


def tolerance(case, world_size):
    # The larger of the dtype's default (another summation order inside the convolution) and the
    # cross-rank reduction's allowance.
    summed, default = reduction_tolerance(dtype_of(case), world_size), default_tolerance(dtype_of(case))
    if dtype_of(case) == torch.float32:  # cuDNN runs fp32 convolutions in TF32 by default (10-bit mantissa):
        default = Tolerance(2.0**-8, 2.0**-8)  # measured 1.2e-3 off on outputs ~1 on an H200; a missing rank is ~1
    return Tolerance(max(summed.atol, default.atol), max(summed.rtol, default.rtol))


def _case(name, channels_in, channels_out, frames_hw, kernel=3, stride=1, padding=0, dilation=1, batch=1,
          note="", slow_on_cpu=False, tags=(), **extra):
    return Case(name, {"batch": batch, "channels_in": channels_in, "channels_out": channels_out,
                       "frames_hw": frames_hw, "kernel": kernel, "stride": stride, "padding": padding,
                       "dilation": dilation, **extra}, note=note, slow_on_cpu=slow_on_cpu, tags=tags)


PROBLEM = Problem(
    name="opensora_conv3d_allreduce", version=4, upstream_id=76, category="beyond_llm",
    source="Open-Sora VAE channel-chunked Conv3d with a tensor-parallel all-reduce", world_sizes=(2, 4, 8),
    upstream=[
        _case("upstream", 512, 512, (19, 66, 66), slow_on_cpu=True,
              note="the upstream factory at its defaults: 512 channels split over W, stride 1, padding 0"),
    ],
    tests=[
        _case("odd_volume_mixed_stride", 24, 5, (4, 7, 6), stride=(1, 2, 1), padding=(1, 0, 1),
              note="24 input channels split 12/6/3 per rank", tags=("odd_sizes", "argument_value")),
        _case("dilated_batch2", 16, 3, (5, 6, 5), kernel=(1, 3, 3), padding=1, dilation=(1, 2, 1), batch=2,
              tags=("argument_value", "odd_sizes", "shape_regime")),
        _case("no_bias_tuple_args", 8, 6, (3, 5, 4), kernel=(3, 1, 3), padding=(1, 0, 0), bias=False,
              tags=("argument_value", "odd_sizes")),
    ],
    benchmarks=[
        _case("opensora_vae_512ch_17x64x64", 512, 512, (19, 66, 66)),
        _case("opensora_vae_512ch_720p_17x90x160", 512, 512, (19, 92, 162)),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
