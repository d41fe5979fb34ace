"""Block-wise FP8 dequantization, then an all-to-all of the dequantized chunks (DeepSeek-V3
inference ``weight_dequant`` arithmetic: one scale per block of block_size consecutive elements).

Per rank: local_y [W, M, N] (the payload, chunk d for rank d; bf16 as upstream, holding e4m3 values),
local_s [W, M*N/block_size] (one scale per block of block_size consecutive elements of a chunk, in
the payload's dtype), block_size (int, default 128)  ->  [W, M, N] fp32, chunk s = rank s's chunk
for this rank, dequantized:
    x[i] = float(y[i]) * float(s[i // block_size])     (flat element i of the [W, M, N] payload)
Blocks run over the flat chunk, so a block may straddle rows when block_size does not divide N;
M*N must divide by block_size (the reference raises otherwise, as upstream) and block_size be a
power of two (upstream's Triton kernel needs one). A bf16 * bf16 product is exact in fp32, so the
output is compared exactly (upstream's kernel was bit-equal on an H200).

As upstream, the "fp8" payload is plain bf16 (its values are e4m3-representable here, as a real
payload's would be) and the scales are bf16 of shape [W, M*N/block_size].

Cost per rank: a kernel may exchange payload and scales and dequantize on arrival, so what must
cross is (W-1)/W of the W*M*(N + N/block_size) payload and scale elements at itemsize bytes; one
multiply per element, W*M*N flops; HBM reads payload and scales and writes the fp32 output:
W*M*(N + N/block_size)*itemsize + 4*W*M*N.

Cases: ``upstream`` is the upstream factory: local_y [W, 1024, 1024] and local_s [W, 8192] bf16,
block 128. Benchmarks: DeepSeek-V3 hidden (7168) activations exchanged as in expert-parallel
dispatch, 512 and 64 tokens per destination rank.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.tensor_parallel._common import dtype_of, itemsize, upstream_randn

FP8_MAX = 448.0


def make_inputs(case, rank, world_size, gen):
    m, n, block, dtype = case["m"], case["n"], case.get("block_size", 128), dtype_of(case)
    y = (randn(gen, world_size, m, n) * 64.0).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.exp(randn(gen, world_size, m * n // block)) / FP8_MAX
    return y.to(dtype), s.to(dtype), block


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): local_y [W, 1024, 1024], then local_s [W, 8192], both N(0, 1) in the
    run's dtype (the payload not e4m3-rounded, the scales not positive); block 128."""
    m, n, block = case["m"], case["n"], case.get("block_size", 128)
    return (*upstream_randn(case, device, (world_size, m, n), (world_size, m * n // block)), block)


def reference(local_y, local_s, block_size=128):
    world_size = dist.get_world_size()
    if (local_y.numel() // world_size) % block_size:
        raise ValueError(f"a chunk of {local_y.numel() // world_size} elements is not a whole number of "
                         f"{block_size}-element blocks")
    blocks = local_y.float().reshape(-1, block_size)             # [W*M*N/block, block]
    dequantized = (blocks * local_s.float().reshape(-1, 1)).view(local_y.shape)
    out = torch.empty_like(dequantized)
    dist.all_to_all_single(out, dequantized)
    return out


def cost(case, world_size):
    m, n, block, size = case["m"], case["n"], case.get("block_size", 128), itemsize(case)
    payload = world_size * m * (n + n / block) * size
    return Cost(link_bytes=(world_size - 1) / world_size * payload, flops=world_size * m * n,
                hbm_bytes=payload + 4 * world_size * m * n, pattern="all_to_all")


PROBLEM = Problem(
    name="blocked_fp8_dequantize", version=2, upstream_id=20, category="tensor_parallel",
    source="DeepSeek-V3 inference kernel.py weight_dequant arithmetic (1x128 blocks) + all-to-all",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": 1024, "n": 1024},
                   note="the upstream factory: local_y [W, 1024, 1024], local_s [W, 8192], block 128")],
    tests=[
        Case("odd_rows_block16", {"m": 3, "n": 32, "block_size": 16}, tags=("odd_sizes", "argument_value")),
        Case("small_blocks", {"m": 5, "n": 24, "block_size": 8}, tags=("odd_sizes", "argument_value")),
        Case("one_row_block128", {"m": 1, "n": 256, "block_size": 128}, tags=("shape_regime",)),
        Case("blocks_straddle_rows", {"m": 4, "n": 20, "block_size": 16},
             note="80 elements per chunk in 5 blocks of 16: blocks cross row ends",
             tags=("odd_sizes", "argument_value")),
    ],
    benchmarks=[
        Case("deepseek_v3_dispatch_512_tokens", {"m": 512, "n": 7168}),
        Case("deepseek_v3_dispatch_64_tokens", {"m": 64, "n": 7168}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
