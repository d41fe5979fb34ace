"""Token-weighted loss for gradient accumulation across data-parallel ranks, forward and backward
(VeOmni-style: normalise by the global number of valid tokens, not by per-rank means).

A step accumulates A micro-batches on each of W ranks; micro-batch (r, a) has n[r, a] valid tokens
and N = sum over all (r, a) of n[r, a]. For the current micro-batch, per rank:
  loss                   bf16 0-dim, this rank's mean loss over its n_r = local_valid_tokens tokens
  local_valid_tokens     int64 0-dim, n_r (may be 0: a rank whose micro-batch is all padding)
  global_valid_tokens    int64 0-dim, N (the same on every rank)
  grad_normalized_loss   bf16 0-dim, the upstream gradient of normalized_loss on this rank
  grad_loss_sum          bf16 0-dim or None (zero), the upstream gradient of loss_sum on this rank
Forward: loss_sum = sum over ranks of loss_r * n_r (the all-reduce), normalized_loss = loss_sum / N.
Backward (hand-written): both outputs on every rank depend on this rank's loss through the
all-reduce, so d/d loss_r = n_r * (sum_s grad_normalized_loss_s / N + sum_s grad_loss_sum_s).
Output: (normalized_loss, loss_sum, grad_loss), 0-dim in loss's dtype; fp32 math, one rounding.
The three sums travel in one all-reduce of an fp32 3-vector.

Cost per rank: link bytes 2(W-1)/W * 12 (the 3-vector); about 10 flops; HBM: 5 scalars read, 3
written. Pure latency: one small all-reduce, no host sync.

Benchmarks (the sizes are token counts, the work is the same scalar step): Llama-3-8B pre-training
micro-batches of 2 x 8192 tokens with 8 accumulation steps, and SFT micro-batches of 4 x 4096
padded tokens with 16 accumulation steps (many padded positions, so counts vary widely).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.data_parallel._common import dtype_of


def make_inputs(case, rank, world_size, gen):
    dtype = dtype_of(case)
    low, high = case["valid_tokens"]
    counts = torch.randint(low, high + 1, (world_size, case["accumulation_steps"]), generator=gen.shared,
                           device=gen.device)
    counts[-1, -1] += 1  # at least one valid token in the step
    loss = (1.5 + 2 * torch.rand((), generator=gen, device=gen.device)).to(dtype)
    grad_normalized_loss = (0.5 + torch.rand((), generator=gen, device=gen.device)).to(dtype)
    grad_loss_sum = None
    if case["grad_loss_sum"]:
        grad_loss_sum = (1e-4 * torch.randn((), generator=gen, device=gen.device)).to(dtype)
    return loss, counts[rank, 0].clone(), counts.sum(), grad_normalized_loss, grad_loss_sum


def reference(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    local_valid = local_valid_tokens.float()
    upstream_sum = grad_loss_sum.float() if grad_loss_sum is not None else torch.zeros_like(local_valid)
    sums = torch.stack([loss.float() * local_valid, grad_normalized_loss.float(), upstream_sum])
    dist.all_reduce(sums)
    loss_sum = sums[0]
    normalized_loss = loss_sum / global_valid_tokens.float()
    grad_loss = local_valid * (sums[1] / global_valid_tokens.float() + sums[2])
    return normalized_loss.to(loss.dtype), loss_sum.to(loss.dtype), grad_loss.to(loss.dtype)


def cost(case, world_size):
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 3 * 4, flops=10, hbm_bytes=8 * 4,
                pattern="all_reduce")


PROBLEM = Problem(
    name="grad_acc_loss", version=1, upstream_id=23, category="data_parallel",
    source="VeOmni-style token-weighted gradient-accumulation loss (global valid-token normalisation)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("few_tokens_some_empty", {"valid_tokens": (0, 3), "accumulation_steps": 1, "grad_loss_sum": True,
                                       "dtype": "bfloat16"}),
        Case("accum3_no_sum_grad", {"valid_tokens": (1, 1000), "accumulation_steps": 3, "grad_loss_sum": False,
                                    "dtype": "bfloat16"}),
        Case("accum5_fp32", {"valid_tokens": (7, 70000), "accumulation_steps": 5, "grad_loss_sum": True,
                             "dtype": "float32"}),
    ],
    benchmarks=[
        Case("llama3_8b_pretrain_2x8k_accum8", {"valid_tokens": (16000, 16384), "accumulation_steps": 8,
                                                "grad_loss_sum": False, "dtype": "bfloat16"}),
        Case("sft_4x4k_padded_accum16", {"valid_tokens": (2000, 16384), "accumulation_steps": 16,
                                         "grad_loss_sum": True, "dtype": "bfloat16"}),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
