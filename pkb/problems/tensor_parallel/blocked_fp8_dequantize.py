"""Block-wise FP8 dequantization, then an all-to-all of the dequantized chunks (DeepSeek-V3
inference ``weight_dequant`` arithmetic on 1x128 activation blocks, as ``act_quant`` makes them).

Per rank: local_y [W, M, N] (e4m3fn payload, held as its bytes in uint8; chunk d is for rank d),
local_s [W, M, N/block_size] fp32 (one scale per block of block_size consecutive elements of a row),
block_size (int, default 128)  ->  [W, M, N] fp32, chunk s = rank s's chunk for this rank,
dequantized: y.float() * s (one IEEE fp32 multiply per element, so the result is exact).

Fixed from upstream: upstream passed the "fp8" payload and the scales as plain bf16 and the
scales flattened to [W, M*N/128]. Here the payload is real e4m3fn and the scales fp32 with their
[M, N/block_size] shape. The payload travels as uint8 bytes because the suite's input checks
(and gloo) do not handle float8 tensors; ``local_y.view(torch.float8_e4m3fn)`` reads it.

Cost per rank: only the fp8 payload and the scales must cross the link (a kernel may exchange them
and dequantize on arrival): (W-1)/W * W*M*(N + 4*N/block_size) bytes; one multiply per element,
W*M*N flops; HBM reads payload and scales and writes the fp32 output:
W*M*(N + 4*N/block_size) + 4*W*M*N.

Benchmarks: DeepSeek-V3 hidden (7168) activations exchanged as in expert-parallel dispatch, 512
and 64 tokens per destination rank.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn

FP8_MAX = 448.0


def make_inputs(case, rank, world_size, gen):
    m, n, block = case["m"], case["n"], case.get("block_size", 128)
    y = (randn(gen, world_size, m, n) * 64.0).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.exp(randn(gen, world_size, m, n // block)) / FP8_MAX
    return y.view(torch.uint8), s, block


def reference(local_y, local_s, block_size=128):
    world_size, m, n = local_y.shape
    y = local_y.view(torch.float8_e4m3fn).float().view(world_size, m, n // block_size, block_size)
    dequantized = (y * local_s[..., None]).view(world_size, m, n)
    out = torch.empty_like(dequantized)
    dist.all_to_all_single(out, dequantized)
    return out


def cost(case, world_size):
    m, n, block = case["m"], case["n"], case.get("block_size", 128)
    payload = world_size * m * (n + 4 * n / block)
    return Cost(link_bytes=(world_size - 1) / world_size * payload, flops=world_size * m * n,
                hbm_bytes=payload + 4 * world_size * m * n, pattern="all_to_all")


PROBLEM = Problem(
    name="blocked_fp8_dequantize", version=1, upstream_id=20, category="tensor_parallel",
    source="DeepSeek-V3 inference kernel.py weight_dequant arithmetic (1x128 blocks) + all-to-all",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_rows_block16", {"m": 3, "n": 32, "block_size": 16}),
        Case("small_blocks", {"m": 5, "n": 24, "block_size": 8}),
        Case("one_row_block128", {"m": 1, "n": 256, "block_size": 128}),
    ],
    benchmarks=[
        Case("deepseek_v3_dispatch_512_tokens", {"m": 512, "n": 7168}),
        Case("deepseek_v3_dispatch_64_tokens", {"m": 64, "n": 7168}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, cost=cost,
)
