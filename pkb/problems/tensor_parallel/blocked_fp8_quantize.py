"""Block-wise FP8 quantization of activations, then an all-gather of payload and scales
(DeepSeek-V3 inference ``act_quant``: one fp32 scale per 128 consecutive elements of a row).

Per rank: local_tensor [M, N] (bf16; any leading dims, as upstream; N divisible by block_size, the
reference raises otherwise), block_size (int, default 128)  ->  (y [W*M, N] float8_e4m3fn,
s [W*M, N/block_size] float32) on every rank, rank blocks in rank order (gathered along dim 0):
    amax = max(|x|) over each block (x in fp32),  s = amax / 448,
    y = x / s, rounded to e4m3fn (an all-zero block, s = 0, divides by 1 instead: y = 0, as upstream)
The reference divides in IEEE fp32 (round to nearest even) and rounds to nearest-even e4m3fn
(torch's cast; PTX ``cvt.rn.satfinite.e4m3x2.f32`` agrees, since |x / s| <= 448 up to rounding).
block_size must be a power of two (upstream's Triton kernel needs one).

Tolerance: upstream's Triton kernel divides with ``div.full.f32`` (approximate, up to 2 ulp), so
its y can land one e4m3 step off the IEEE quotient's: on an H200, 12 of 147M payload values did
(scales were bit-equal). So y may be one e4m3 step off (rtol 2^-3, atol 2^-9, the subnormal
step) and s a couple of fp32 ulps (rtol 2^-22); a missing or misscaled block is off by far more.

The payload is gathered as bytes (uint8 view): gloo, and NCCL before 2.24, have no fp8 type.

Cost per rank: the all-gathers bring (W-1)/W of the gathered payload and scales in:
(W-1) * M * (N + 4*N/block_size) bytes; about 3 flops per element (abs-max, divide, convert);
HBM reads x and writes the gathered outputs: 2*M*N + W*M*(N + 4*N/block_size).

Inputs: N(0, 1) values times a power of two per row (2^-6 ... 2^6), so blocks' scales span a
wide range. Cases: ``upstream`` is the upstream factory: local_tensor [1024, 1024] bf16, block
128; ``zero_block`` zeroes one block per rank. Benchmarks: DeepSeek-V3 activations gathered before
a TP GEMM: hidden 7168 on 4096 prefill tokens and 128 decode tokens per rank, and the MoE/MLP
intermediate 18432 at prefill.
"""

import torch

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of, upstream_randn

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def make_inputs(case, rank, world_size, gen):
    m, n = case["m"], case["n"]
    row_scale = 2.0 ** torch.randint(-6, 7, (m, 1), generator=gen, device=gen.device).float()
    x = randn(gen, m, n) * row_scale
    if case.get("zero_block"):
        block = case.get("block_size", 128)
        row = int(torch.randint(0, m, (), generator=gen, device=gen.device))
        col = int(torch.randint(0, n // block, (), generator=gen, device=gen.device)) * block
        x[row, col:col + block] = 0.0
    return x.to(dtype_of(case)), case.get("block_size", 128)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): local_tensor [1024, 1024] N(0, 1) (no per-row scale); block 128."""
    return (*upstream_randn(case, device, (case["m"], case["n"])), case.get("block_size", 128))


def reference(local_tensor, block_size=128):
    *leading, n = local_tensor.shape
    if n % block_size:
        raise ValueError(f"the last dimension ({n}) must divide by block_size ({block_size})")
    blocks = local_tensor.float().reshape(-1, block_size)
    s = blocks.abs().amax(-1) / FP8_MAX  # one scale per block
    y = (blocks / torch.where(s == 0, 1.0, s)[:, None]).to(torch.float8_e4m3fn).view(local_tensor.shape)
    y_all = all_gather_cat(y.view(torch.uint8), dim=0).view(torch.float8_e4m3fn)
    return y_all, all_gather_cat(s.view(*leading, n // block_size), dim=0)


def tolerance(case, world_size, dtype):
    if dtype == torch.float8_e4m3fn:
        return Tolerance(atol=2.0**-9, rtol=2.0**-3)  # one e4m3 step
    return Tolerance(atol=0.0, rtol=2.0**-22)


def cost(case, world_size):
    m, n, block = case["m"], case["n"], case.get("block_size", 128)
    gathered_per_rank = m * (n + 4 * n / block)
    return Cost(link_bytes=(world_size - 1) * gathered_per_rank, flops=3 * m * n,
                hbm_bytes=2 * m * n + world_size * gathered_per_rank, pattern="all_gather")


PROBLEM = Problem(
    name="blocked_fp8_quantize", version=2, upstream_id=19, category="tensor_parallel",
    source="DeepSeek-V3 inference kernel.py act_quant (1x128 e4m3 blocks) + all-gather",
    # quantisation: the answer is the fp32 recipe's codes and scales, which an exact answer would not be
    exact_dtype=None, exact_note="quantisation: the e4m3 codes are those of the fp32 scale amax / 448, and a more "
                                 "precise quotient lands some codes one step over or under; codes and scales are "
                                 "compared with the reference's by the tolerance",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": 1024, "n": 1024},
                   note="the upstream factory: local_tensor [1024, 1024], block_size 128")],
    tests=[
        Case("odd_rows_block16", {"m": 5, "n": 48, "block_size": 16}, tags=("odd_sizes", "argument_value")),
        Case("one_row_block128", {"m": 1, "n": 384, "block_size": 128}, tags=("shape_regime",)),
        Case("small_blocks", {"m": 7, "n": 40, "block_size": 8}, tags=("odd_sizes", "argument_value")),
        Case("zero_block", {"m": 3, "n": 64, "block_size": 32, "zero_block": True},
             note="one all-zero block per rank: s = 0 and y = 0 there",
             tags=("special_values", "argument_value", "odd_sizes")),
    ],
    benchmarks=[
        Case("deepseek_v3_hidden_prefill", {"m": 4096, "n": 7168}),
        Case("deepseek_v3_hidden_decode", {"m": 128, "n": 7168}),
        Case("deepseek_v3_intermediate_prefill", {"m": 4096, "n": 18432}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
