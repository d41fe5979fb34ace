"""Block-wise FP8 quantization of activations, then an all-gather of payload and scales
(DeepSeek-V3 inference ``act_quant``: one fp32 scale per 128 consecutive elements of a row).

Per rank: local_tensor [M, N] (bf16; N divisible by block_size), block_size (int, default 128)  ->
(y [W*M, N] float8_e4m3fn, s [W*M, N/block_size] float32) on every rank, rank blocks in rank order:
    amax = max(|x|) over each block (x in fp32),  s = amax / 448,  y = x / s  (rounded to e4m3fn)
The rounding is fully specified, so both outputs are compared exactly: ``s`` is the IEEE fp32
quotient amax / 448 (round to nearest even) and ``y`` is the IEEE fp32 quotient x / s rounded to
nearest-even e4m3fn (torch's cast; PTX ``cvt.rn.satfinite.e4m3x2.f32`` agrees, since |x / s| <= 448
up to rounding). A kernel that multiplies by a reciprocal (x * (448 / amax)) differs on ties and
is wrong under this rule. Blocks are never all zero (random inputs), so s > 0.

The payload is gathered as bytes (uint8 view): gloo, and NCCL before 2.24, have no fp8 type.

Cost per rank: the all-gathers bring (W-1)/W of the gathered payload and scales in:
(W-1) * M * (N + 4*N/block_size) bytes; about 3 flops per element (abs-max, divide, convert);
HBM reads x and writes the gathered outputs: 2*M*N + W*M*(N + 4*N/block_size).

Inputs: N(0, 1) values times a power of two per row (2^-6 ... 2^6), so blocks' scales span a
wide range. Benchmarks: DeepSeek-V3 activations gathered before a TP GEMM: hidden 7168 on 4096
prefill tokens and 128 decode tokens per rank, and the MoE/MLP intermediate 18432 at prefill.
"""

import torch

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def make_inputs(case, rank, world_size, gen):
    m, n = case["m"], case["n"]
    row_scale = 2.0 ** torch.randint(-6, 7, (m, 1), generator=gen, device=gen.device).float()
    return (randn(gen, m, n) * row_scale).to(dtype_of(case)), case.get("block_size", 128)


def reference(local_tensor, block_size=128):
    m, n = local_tensor.shape
    blocks = local_tensor.float().view(m, n // block_size, block_size)
    s = blocks.abs().amax(-1) / FP8_MAX  # [M, N/block_size]
    y = (blocks / s[..., None]).view(m, n).to(torch.float8_e4m3fn)
    y_all = all_gather_cat(y.view(torch.uint8), dim=0).view(torch.float8_e4m3fn)
    return y_all, all_gather_cat(s, dim=0)


def cost(case, world_size):
    m, n, block = case["m"], case["n"], case.get("block_size", 128)
    gathered_per_rank = m * (n + 4 * n / block)
    return Cost(link_bytes=(world_size - 1) * gathered_per_rank, flops=3 * m * n,
                hbm_bytes=2 * m * n + world_size * gathered_per_rank, pattern="all_gather")


PROBLEM = Problem(
    name="blocked_fp8_quantize", version=1, upstream_id=19, category="tensor_parallel",
    source="DeepSeek-V3 inference kernel.py act_quant (1x128 e4m3 blocks) + all-gather",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_rows_block16", {"m": 5, "n": 48, "block_size": 16}),
        Case("one_row_block128", {"m": 1, "n": 384, "block_size": 128}),
        Case("small_blocks", {"m": 7, "n": 40, "block_size": 8}),
    ],
    benchmarks=[
        Case("deepseek_v3_hidden_prefill", {"m": 4096, "n": 7168}),
        Case("deepseek_v3_hidden_decode", {"m": 128, "n": 7168}),
        Case("deepseek_v3_intermediate_prefill", {"m": 4096, "n": 18432}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, cost=cost,
)
