"""Tensor + sequence-parallel MLP: all-gather tokens, column-parallel GEMM, SiLU, row-parallel GEMM,
reduce-scatter tokens (Megatron-LM MLP with ``sequence_parallel=True``).

Per rank: x_local [M/W, H] (this rank's tokens), W1 [H, F/W] (this rank's column block of the first
weight), W2 [F/W, H] (its row block of the second)  ->  [M/W, H]:
    x = all_gather over tokens (rank order)       [M, H]
    partial_r = silu(x @ W1_r) @ W2_r             [M, H], a partial sum over the F shards
    out_r = rows r*M/W ... of sum over ranks of partial   (reduce-scatter)
fp32 throughout (GEMMs accumulate in fp32, the intermediate stays fp32), rounded once at the end.

Fixed from upstream: the upstream reference sharded the hidden dimension of x_local ([M', H/W]),
gave every rank full random weights, and computed only its own row block, so the reduce-scatter
summed one non-zero block with zeros (a copy). Here the layout is Megatron's: tokens sharded on
the way in and out, the FFN dimension sharded in between, and the reduce-scatter really sums W
partials. The argument list and the output shape [M/W, H] are the upstream ones.

Cost per rank: all-gather (W-1)/W * M*H*itemsize in, reduce-scatter (W-1)/W * M*H*itemsize (input
dtype, as NCCL would move it); flops 2 * 2*M*H*(F/W) for the two GEMMs (SiLU not counted);
HBM at least reads the gathered x and both weight blocks and writes the output:
(M*H + 2*H*F/W + M*H/W) * itemsize.

Tolerance: the sum over W ranks of partials of magnitude at most N(0, 1) (weights scaled by
1/sqrt(fan-in)), with one extra term's room for a bf16 intermediate: ``reduction_tolerance(dtype, W + 1)``.

Benchmarks: the Llama-3 MLP shapes (8B: H 4096, F 14336; 70B: H 8192, F 28672; SiLU in place of
SwiGLU, as upstream) on an 8192-token sequence, and a 70B decode step of 64 tokens.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, reduction_tolerance
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of, itemsize
from pkb.problems.tensor_parallel._gemm import DECODE_TOKENS, LLAMA3_70B, LLAMA3_8B, PREFILL_TOKENS, activations, weight


def make_inputs(case, rank, world_size, gen):
    m, h, f = case["m"], case["h"], case["f"]
    return (activations(case, gen, m // world_size, h), weight(case, gen, h, f // world_size, fan_in=h),
            weight(case, gen, f // world_size, h, fan_in=f // world_size))


def reference(x_local, W1, W2):
    world_size = dist.get_world_size()
    x = all_gather_cat(x_local, dim=0)  # [M, H]
    partial = torch.nn.functional.silu(x @ W1) @ W2  # [M, H], GEMMs in the input dtype (fp32 accumulation)
    out = torch.empty(partial.shape[0] // world_size, partial.shape[1], dtype=partial.dtype, device=partial.device)
    dist.reduce_scatter_tensor(out, partial, op=dist.ReduceOp.SUM)  # in the input dtype, as Megatron does
    return out


def cost(case, world_size):
    m, h, f = case["m"], case["h"], case["f"] / world_size
    size = itemsize(case)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * m * h * size, flops=2 * 2 * m * h * f,
                hbm_bytes=(m * h + 2 * h * f + m * h / world_size) * size, pattern="all_gather + gemm + reduce_scatter")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size + 1, scale=1.0)


PROBLEM = Problem(
    name="combined_sharded_gemms", version=1, upstream_id=15, category="tensor_parallel",
    source="Megatron-LM MLP with tensor + sequence parallelism (ColumnParallelLinear -> RowParallelLinear)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd", {"m": 24, "h": 37, "f": 40}, note="3 tokens and 5 FFN columns per rank at W=8"),
        Case("one_token_per_rank", {"m": 8, "h": 19, "f": 8}),
        Case("wide_ffn", {"m": 16, "h": 12, "f": 120}),
    ],
    benchmarks=[
        Case("llama3_8b_mlp_prefill", {"m": PREFILL_TOKENS, "h": LLAMA3_8B["hidden"], "f": LLAMA3_8B["ffn"]}),
        Case("llama3_70b_mlp_prefill", {"m": PREFILL_TOKENS, "h": LLAMA3_70B["hidden"], "f": LLAMA3_70B["ffn"]}),
        Case("llama3_70b_mlp_decode", {"m": DECODE_TOKENS, "h": LLAMA3_70B["hidden"], "f": LLAMA3_70B["ffn"]}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, cost=cost,
)
