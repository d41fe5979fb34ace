"""Token-weighted loss for gradient accumulation across data-parallel ranks, forward and backward
(VeOmni-style: normalise by the global number of valid tokens, not by per-rank means).

A step accumulates A micro-batches on each of W ranks; micro-batch (r, a) has n[r, a] valid tokens
and N = sum over all (r, a) of n[r, a]. For the current micro-batch, per rank:
  loss                   0-dim (the run's precision), this rank's mean loss over its n_r = local_valid_tokens tokens
                         (NaN when n_r = 0: a mean over no tokens)
  local_valid_tokens     int64 0-dim, n_r (may be 0: a rank whose micro-batch is all padding)
  global_valid_tokens    int64 0-dim, N (the same on every rank)
  grad_normalized_loss   0-dim, the upstream gradient of normalized_loss on this rank
  grad_loss_sum          0-dim or None (zero), the upstream gradient of loss_sum on this rank
Forward: a rank with n_r = 0 contributes 0 (its loss goes through nan_to_num first);
loss_sum = sum over ranks of loss_r * n_r (the all-reduce), normalized_loss = loss_sum / N.
Backward (hand-written, local to the rank as in the upstream; no communication):
grad_loss = grad_normalized_loss * n_r / N + grad_loss_sum * n_r.
Output: (normalized_loss, loss_sum, grad_loss), 0-dim in the inputs' dtype; fp32 math, one rounding
(the upstream multiplies, all-reduces and divides in the inputs' dtype; the tolerance covers that).
Precisions: bf16 and fp32. Not fp16: loss_sum, the loss times the 1024 x 1024 valid tokens of each
rank in the upstream inputs, is far beyond fp16's largest value (65504), so upstream's reference
returns inf there.

Cost per rank: link bytes 2(W-1)/W * 4 (one fp32 scalar all-reduced); about 6 flops; HBM: 5
scalars read, 3 written (counted as 8 x 4 bytes). Pure latency: one scalar all-reduce.

Benchmarks (the sizes are token counts, the work is the same scalar step): Llama-3-8B pre-training
micro-batches of 2 x 8192 tokens with 8 accumulation steps, and SFT micro-batches of 4 x 4096
padded tokens with 16 accumulation steps (many padded positions, so counts vary widely).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance
from pkb.problems.data_parallel._common import dtype_of


def make_inputs(case, rank, world_size, gen):
    dtype = dtype_of(case)
    low, high = case["valid_tokens"]
    counts = torch.randint(low, high + 1, (world_size, case["accumulation_steps"]), generator=gen.shared,
                           device=gen.device)
    if int(counts.sum()) == 0:
        counts[-1, -1] = 1  # at least one valid token in the step
    local_valid = counts[rank, 0].clone()
    loss = (1.5 + 2 * torch.rand((), generator=gen, device=gen.device)).to(dtype)
    if int(local_valid) == 0:
        loss = torch.full_like(loss, float("nan"))
    grad_normalized_loss = (0.5 + torch.rand((), generator=gen, device=gen.device)).to(dtype)
    grad_loss_sum = None
    if case["grad_loss_sum"]:  # positive like grad_normalized_loss: the two backward terms never cancel
        grad_loss_sum = (1e-4 * (0.5 + torch.rand((), generator=gen, device=gen.device))).to(dtype)
    return loss, local_valid, counts.sum(), grad_normalized_loss, grad_loss_sum


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: an N(0, 1) loss, M * N valid tokens on every rank (W * M * N in all), upstream gradients
    1 (normalized loss) and 0 (loss sum)."""
    dtype, tokens = dtype_of(case), case["valid_tokens"][0]
    loss = torch.randn((), dtype=dtype, device=device)
    return (loss, torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(world_size * tokens, dtype=torch.long, device=device),
            torch.ones((), dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device))


def reference(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    local_valid, global_valid = local_valid_tokens.float(), global_valid_tokens.float()
    loss = torch.where(local_valid_tokens == 0, torch.nan_to_num(loss), loss)
    loss_sum = loss.float() * local_valid
    dist.all_reduce(loss_sum)
    normalized_loss = loss_sum / global_valid
    grad_sum = grad_loss_sum.float() if grad_loss_sum is not None else 0.0
    grad_loss = grad_normalized_loss.float() * local_valid / global_valid + grad_sum * local_valid
    return normalized_loss.to(loss.dtype), loss_sum.to(loss.dtype), grad_loss.to(grad_normalized_loss.dtype)


def tolerance(case, world_size, dtype):
    """bf16: the upstream rounds the product, each of the W - 1 additions of its bf16 all-reduce and
    the division (the counts too, on CUDA); all terms are positive, so that is at most (W + 4) unit
    roundoffs relative. A missing rank's share (1/W of the sum for even shares) is several times more."""
    if dtype != torch.bfloat16:
        return default_tolerance(dtype)
    return Tolerance(atol=0.0, rtol=max(default_tolerance(dtype).rtol, (world_size + 4) * 2.0**-8))


def cost(case, world_size):
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 4, flops=6, hbm_bytes=8 * 4, pattern="all_reduce")


PROBLEM = Problem(
    name="grad_acc_loss", version=3, upstream_id=23, category="data_parallel",
    source="VeOmni-style token-weighted gradient-accumulation loss (global valid-token normalisation)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"valid_tokens": (1 << 20, 1 << 20), "accumulation_steps": 1, "grad_loss_sum": True},
             note="1024 x 1024 valid tokens on every rank, as upstream's factory passes"),
    ],
    tests=[
        Case("few_tokens_some_empty", {"valid_tokens": (0, 3), "accumulation_steps": 1, "grad_loss_sum": True},
             tags=("uneven_sizes", "empty_rank", "tiny", "special_values")),  # NaN loss where a rank has none
        Case("accum3_no_sum_grad", {"valid_tokens": (1, 1000), "accumulation_steps": 3, "grad_loss_sum": False},
             tags=("uneven_sizes", "argument_value")),  # grad_loss_sum None; N counts other micro-batches
        Case("accum5", {"valid_tokens": (7, 70000), "accumulation_steps": 5, "grad_loss_sum": True},
             tags=("uneven_sizes", "argument_value")),  # N counts other micro-batches
    ],
    benchmarks=[
        Case("llama3_8b_pretrain_2x8k_accum8", {"valid_tokens": (16000, 16384), "accumulation_steps": 8,
                                                "grad_loss_sum": False}),
        Case("sft_4x4k_padded_accum16", {"valid_tokens": (2000, 16384), "accumulation_steps": 16,
                                         "grad_loss_sum": True}),
    ],
    precisions=("bf16", "fp32"),
    precision_note="at upstream's inputs loss_sum (the loss times 1024 x 1024 tokens per rank) overflows fp16 "
                   "(largest value 65504): upstream's reference returns inf",
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
