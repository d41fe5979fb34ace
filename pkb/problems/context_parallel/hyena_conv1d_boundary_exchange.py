"""Causal depthwise conv1d under zigzag context parallelism, with halo exchange (Savanna / Evo 2 Hyena
short convolution with context parallelism).

Zigzag layout: the sequence of length L is cut into 2W chunks of n = L/(2W) tokens; rank r holds
chunks r and 2W-1-r side by side. A causal depthwise convolution with kernel size K (output t reads
inputs t-K+1 .. t of its channel) needs the K-1 tokens before each chunk:
  - before chunk r: the tail of chunk r-1, the first chunk of rank r-1 (zeros for rank 0);
  - before chunk 2W-1-r: the tail of chunk 2W-2-r, the second chunk of rank r+1, or for the last rank
    its own first chunk W-1 (the two chunks of rank W-1 are adjacent in the sequence).
The reference gathers every rank's two tails (K-1 tokens each), prepends the right halo to each
chunk, and convolves each chunk in fp32 (F.conv1d with groups=C); the result is rounded once.

Per rank: x [B, C, 2n] (chunk r then chunk 2W-1-r); weight [C, 1, K]  ->  [B, C, 2n] in the same layout.
n >= K-1. No bias (the short convolution in Savanna's hyena filter has none).

Cost: a rank needs two halos of B*C*(K-1) elements: link bytes 2*B*C*(K-1)*itemsize (the reference's
all-gather moves more; the bound is what the convolution needs). Flops 2*B*C*2n*K. HBM: read x and
weight, write the output.

The upstream case fixes the chunk length instead (``chunk``): upstream's x [1, 1024, 2*1024] and
weight [1024, 1, 7] bf16 per rank.

Benchmarks: Evo 2 7B (hidden 4096, short filter K=7) and Evo 2 40B (hidden 8192) at 128k tokens
(Evo 2 trains to 1M context with context parallelism; 128k is its mid-training length).
"""

import torch
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (all_gather, dtype_of, group_rank, group_size, rand_normal,
                                                   upstream_randn)


def chunk_len(case, world_size):
    return case["chunk"] if "chunk" in case.params else case["seq"] // (2 * world_size)


def make_inputs(case, rank, world_size, gen):
    chunk = chunk_len(case, world_size)
    x = rand_normal(gen, case["batch"], case["channels"], 2 * chunk, dtype=dtype_of(case))
    weight = rand_normal(gen.shared, case["channels"], 1, case["kernel"], dtype=dtype_of(case),
                         scale=case["kernel"] ** -0.5)
    return x, weight, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [1, 1024, 2048] then weight [1024, 1, 7], both N(0, 1) in the run's dtype (per rank)."""
    x = upstream_randn(case, case["batch"], case["channels"], 2 * chunk_len(case, world_size), device=device)
    return x, upstream_randn(case, case["channels"], 1, case["kernel"], device=device), None


def reference(x, weight, group=None):
    world, me = group_size(group), group_rank(group)
    halo = weight.shape[-1] - 1
    chunk = x.shape[-1] // 2
    first, second = x[..., :chunk], x[..., chunk:]
    tails = torch.stack([first[..., chunk - halo:], second[..., chunk - halo:]])  # [2, B, C, K-1]
    every = all_gather(tails.unsqueeze(0), 0, group)  # [W, 2, B, C, K-1]
    before_first = every[me - 1, 0] if me > 0 else torch.zeros_like(tails[0])
    before_second = every[me + 1, 1] if me + 1 < world else tails[0]
    w = weight.float()
    channels = x.shape[1]
    outs = [F.conv1d(torch.cat([h, c], dim=-1).float(), w, groups=channels)
            for h, c in ((before_first, first), (before_second, second))]
    return torch.cat(outs, dim=-1).to(x.dtype)


def cost(case, world_size):
    B, C, K = case["batch"], case["channels"], case["kernel"]
    local = 2 * chunk_len(case, world_size)
    itemsize = dtype_of(case).itemsize
    return Cost(link_bytes=2.0 * B * C * (K - 1) * itemsize, flops=2.0 * B * C * local * K,
                hbm_bytes=(2.0 * B * C * local + C * K) * itemsize, pattern="halo exchange")


UPSTREAM = (
    Case("upstream", {"batch": 1, "channels": 1024, "chunk": 1024, "kernel": 7},
         note="upstream create_input_tensor: x [1, 1024, 2048] (two chunks of 1024), weight [1024, 1, 7]"),
)

TESTS = (
    Case("k7_short_chunks", {"batch": 1, "channels": 5, "seq": 96, "kernel": 7}, tags=("odd_sizes",)),
    Case("k3_batch2", {"batch": 2, "channels": 3, "seq": 176, "kernel": 3}, tags=("shape_regime", "odd_sizes")),
    Case("k4", {"batch": 1, "channels": 4, "seq": 112, "kernel": 4}, tags=("shape_regime",)),
)

BENCHMARKS = (
    Case("evo2_7b_128k", {"batch": 1, "channels": 4096, "seq": 131072, "kernel": 7},
         note="Evo 2 7B hidden 4096, 128k tokens"),
    Case("evo2_40b_128k", {"batch": 1, "channels": 8192, "seq": 131072, "kernel": 7},
         note="Evo 2 40B hidden 8192, 128k tokens"),
)

PROBLEM = Problem(
    name="hyena_conv1d_boundary_exchange", version=3, upstream_id=71, category="context_parallel",
    source="Savanna / Evo 2 Hyena short depthwise conv1d with zigzag context parallelism (halo exchange)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=None,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
