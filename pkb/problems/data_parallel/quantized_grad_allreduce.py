"""Block-int8 quantized gradient averaging (DeepSpeed ZeRO++ qgZ-style): every rank quantizes its
gradient to int8 per block, and all ranks end with the mean of the dequantized gradients.

Per rank: flat_grad [n] (the run's precision, bf16 by default; this rank's gradient, random and
distinct per rank), block_size (int).
Quantization of one rank's gradient, in fp32: blocks of block_size consecutive elements (the last one
may be shorter); scale = max |g| over the block / 127; q = clamp(round_half_to_even(g / scale),
-127, 127) as int8 (q = 0 in an all-zero block, whose scale is 0); dequantized value q * scale.
Output: [n] in flat_grad's dtype = (sum over ranks of the dequantized fp32 values) / W, rounded once.
The reference all-reduces the dequantized fp32 values; a kernel may instead ship the int8 codes and
fp32 scales (that is qgZ's point) as long as it reproduces this rounding. A test case holds an
all-zero block. Gradients are N(0, 1) (quantization is scale-invariant, and unit values keep the
tolerance readable), with no knife edge in the rounding: in every block the largest magnitude is set
to 127 * 2^k (k the smallest that keeps it the largest), so the scale is exactly 2^k and g / scale is
exact however a kernel computes it (division or reciprocal), and an element whose quotient lands
exactly on a half-integer moves to its neighbour toward zero in flat_grad's dtype. Tolerance: rtol
2^-m for a dtype of m mantissa bits (2^-7 bf16, 2^-10 fp16, 2^-23 fp32: one rounding that falls the
other way after another fp32 summation order) and atol 1e-5 (fp32 cancellation near zero); a code
off by one moves an element by max|g|/127/W (about 0.01 at W = 2), more than that allows for all but
the largest bf16 elements.

Cost per rank (what a compressed kernel must move, not the reference's fp32 traffic): a reduce-scatter
of the codes and scales, (W-1)/W * (n + 4*ceil(n/block_size)) bytes, then an all-gather of the result
(b bytes per element), (W-1)/W * bn; flops about 5n (absmax, divide, round, multiply, accumulate); HBM
bn read + bn written.

Benchmarks: the gradients of one Llama-3-70B decoder layer (855,654,400 elements) and of one
Llama-3-8B decoder layer (218,112,000), block 128 (the upstream setting) and 2048 (a coarser grouping).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.data_parallel._common import dtype_of

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def without_rounding_ties(flat_grad: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] in flat_grad's dtype: each block's largest |g| raised to 127 * 2^k (a power-of-two scale, so every
    quotient g / scale is exact), and quotients on exactly x.5 moved to the neighbour toward zero."""
    dtype = flat_grad.dtype
    numel = flat_grad.numel()
    blocks = torch.nn.functional.pad(flat_grad.float(), (0, -numel % block_size)).view(-1, block_size)
    amax, where = blocks.abs().max(dim=1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / 127.0)))
    peak = torch.where(blocks.gather(1, where) < 0, -127.0, 127.0) * scale
    blocks = blocks.scatter(1, where, torch.where(amax > 0, peak, 0.0)).to(dtype)
    quotient = blocks.float() / scale
    tie = (quotient - quotient.trunc()).abs() == 0.5
    toward_zero = torch.nextafter(blocks, torch.zeros_like(blocks))
    return torch.where(tie, toward_zero, blocks).reshape(-1)[:numel]


def make_inputs(case, rank, world_size, gen):
    flat_grad = randn(gen, case["numel"], dtype=dtype_of(case))
    zero_block = case.get("zero_block")
    if zero_block is not None:
        block = case["block_size"]
        flat_grad[zero_block * block:(zero_block + 1) * block] = 0
    return without_rounding_ties(flat_grad, case["block_size"]).contiguous(), case["block_size"]


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: an N(0, 1) flat gradient (rounding ties left in), block 128."""
    return torch.randn(case["numel"], dtype=dtype_of(case), device=device), case["block_size"]


def dequantized(flat_grad: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 [n]: each block's int8 codes times its scale (see the module docstring)."""
    values = flat_grad.float()
    numel = values.numel()
    padded = torch.nn.functional.pad(values, (0, -numel % block_size)).view(-1, block_size)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127.0
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(padded / safe_scale), -127, 127).to(torch.int8)
    return (codes.float() * scale).view(-1)[:numel]


def reference(flat_grad, block_size):
    total = dequantized(flat_grad, block_size)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).to(flat_grad.dtype)


def cost(case, world_size):
    numel = case["numel"]
    num_blocks = -(-numel // case["block_size"])
    fraction = (world_size - 1) / world_size
    itemsize = dtype_of(case).itemsize
    return Cost(link_bytes=fraction * (numel + 4 * num_blocks) + fraction * itemsize * numel, flops=5 * numel,
                hbm_bytes=2 * itemsize * numel, pattern="reduce_scatter+all_gather")


def tolerance(case, world_size, dtype):
    return Tolerance(atol=1e-5, rtol=2.0**-MANTISSA_BITS.get(dtype, 52))  # float64: Python scalars


PROBLEM = Problem(
    name="quantized_grad_allreduce", version=3, upstream_id=44, category="data_parallel",
    source="DeepSpeed ZeRO++ qgZ (block-wise int8 quantized gradient reduction)",
    exact_dtype=None, exact_note="quantisation: the int8 codes are those of the fp32 recipe; the answer is the mean "
                                 "of the dequantized codes, compared with the reference's by the tolerance (an exact "
                                 "mean of the gradients is not what the function computes)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"numel": 1024 * 1024, "block_size": 128}, note="a 1M-element bf16 gradient, block 128"),
    ],
    tests=[
        Case("partial_last_block", {"numel": 1000, "block_size": 128}, tags=("odd_sizes",)),
        Case("tiny_blocks_with_zero_block", {"numel": 29, "block_size": 4, "zero_block": 2},
             tags=("odd_sizes", "argument_value", "special_values")),  # block 4 (upstream: 128), an all-zero block
        Case("one_short_block", {"numel": 5, "block_size": 128}, tags=("tiny", "odd_sizes")),
    ],
    benchmarks=[
        Case("llama3_70b_layer_grads_block128", {"numel": 855_654_400, "block_size": 128}),
        Case("llama3_8b_layer_grads_block128", {"numel": 218_112_000, "block_size": 128}),
        Case("llama3_8b_layer_grads_block2048", {"numel": 218_112_000, "block_size": 2048}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
