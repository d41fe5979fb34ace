"""Two sharded GEMMs around a SiLU: gather the hidden shards of the tokens, run an MLP on this rank's
own block of tokens, reduce-scatter the blocks (the upstream benchmark's tensor + sequence-parallel
MLP exercise; its layout is not Megatron's, see below).

Per rank: x_local [M, H/W] (every token, this rank's block of hidden columns), W1 [H, F] and
W2 [F, H] (this rank's own weights, different per rank)  ->  [M/W, H]:
    x = all_gather over ranks, concatenated along the hidden dim     [M, H]
    block_r = silu(x[r*M/W ... (r+1)*M/W - 1] @ W1) @ W2             [M/W, H]
    out_r = block_r   (upstream places block_r in an [M, H] zero buffer at its rows and
                       reduce-scatters it, so the other ranks add zeros)
Each GEMM accumulates in fp32 and rounds to the input dtype, and the SiLU runs in the input dtype,
as upstream. M and H must be multiples of W (the upstream factory rounds them up to one).

Cost per rank: only this rank's row block of x is used, so what must cross is that block of every
other rank's hidden shard: (W-1)/W * (M/W)*H*itemsize (the reference moves more: a whole all-gather
and a reduce-scatter of zeros). Flops 2 * 2*(M/W)*H*F for the two GEMMs (SiLU not counted). HBM
reads the local shard x_local and both weights and writes the output:
(M*H/W + 2*H*F + M/W*H) * itemsize.

Tolerance: the dtype default; nothing is summed across ranks (the reduce-scatter adds zeros).

Cases: ``upstream`` is the upstream factory: x_local [1024, 256/W], W1 [256, 512], W2 [512, 256] bf16.
Benchmarks: the Llama-3 MLP shapes (8B: H 4096, F 14336; 70B: H 8192, F 28672; SiLU in place of
SwiGLU, as upstream) on an 8192-token sequence, and a 70B decode step of 64 tokens.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.tensor_parallel._common import all_gather_cat, divides_all, itemsize, upstream_randn
from pkb.problems.tensor_parallel._gemm import DECODE_TOKENS, LLAMA3_70B, LLAMA3_8B, PREFILL_TOKENS, activations, weight


def make_inputs(case, rank, world_size, gen):
    m, h, f = case["m"], case["h"], case["f"]
    return (activations(case, gen, m, h // world_size), weight(case, gen, h, f, fan_in=h),
            weight(case, gen, f, h, fan_in=f))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): x_local [1024, 256/W], then W1 [256, 512] and W2 [512, 256], all
    N(0, 1) (unscaled). Its M and H rounded up to multiples of W are 1024 and 256 at every W."""
    m, h, f = case["m"], case["h"], case["f"]
    return upstream_randn(case, device, (m, h // world_size), (h, f), (f, h))


def reference(x_local, W1, W2):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = x_local.shape[0] // world_size
    x = all_gather_cat(x_local, dim=1)  # [M, H]
    block = torch.nn.functional.silu(x[rank * rows:(rank + 1) * rows] @ W1) @ W2  # [M/W, H]
    padded = torch.zeros(x.shape[0], block.shape[1], dtype=block.dtype, device=block.device)
    padded[rank * rows:(rank + 1) * rows] = block
    out = torch.empty_like(block)
    dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM)  # as upstream: the others add zeros
    return out


def cost(case, world_size):
    m, h, f = case["m"], case["h"], case["f"]
    rows, size = m / world_size, itemsize(case)
    return Cost(link_bytes=(world_size - 1) / world_size * rows * h * size, flops=2 * 2 * rows * h * f,
                hbm_bytes=(m * h / world_size + 2 * h * f + rows * h) * size,
                pattern="all_gather + gemm + reduce_scatter")


PROBLEM = Problem(
    name="combined_sharded_gemms", version=2, upstream_id=15, category="tensor_parallel",
    source="Megatron-LM-style TP + SP MLP in the upstream benchmark's layout (all-gather, GEMM, SiLU, GEMM, reduce-scatter)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": 1024, "h": 256, "f": 512},
                   note="the upstream factory: x_local [1024, 256/W], W1 [256, 512], W2 [512, 256]")],
    tests=[
        Case("odd", {"m": 24, "h": 40, "f": 37}, note="3 tokens and 5 hidden columns per rank at W=8; odd FFN",
             tags=("odd_sizes",)),
        Case("one_row_per_rank", {"m": 8, "h": 8, "f": 19}, note="one token and one hidden column per rank at W=8",
             tags=("tiny", "odd_sizes")),
        Case("wide_ffn", {"m": 16, "h": 24, "f": 120}, tags=("odd_sizes",)),
        Case("odd_shares", {"m": 12, "h": 20, "f": 7}, world_sizes=divides_all(12, 20),
             note="3 tokens and 5 hidden columns per rank at W=4", tags=("odd_sizes",)),
    ],
    benchmarks=[
        Case("llama3_8b_mlp_prefill", {"m": PREFILL_TOKENS, "h": LLAMA3_8B["hidden"], "f": LLAMA3_8B["ffn"]}),
        Case("llama3_70b_mlp_prefill", {"m": PREFILL_TOKENS, "h": LLAMA3_70B["hidden"], "f": LLAMA3_70B["ffn"]}),
        Case("llama3_70b_mlp_decode", {"m": DECODE_TOKENS, "h": LLAMA3_70B["hidden"], "f": LLAMA3_70B["ffn"]}),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
