"""Backward of the chunked top-k / top-p token log-probs over vocab-sharded logits (NeMo-RL
``ChunkedDistributedLogprob.backward`` with sampling parameters).

Per chunk of B*chunk_size flat tokens (as vocab_parallel_log_prob_topk_chunked): all-to-all the
logits to token-parallel [c/W, V], filter (rules in ``_logprob``; the cut decided in bf16, as
upstream), p = softmax over the kept logits (fp32), and for each token with upstream gradient g:
    grad_j = g * (1[j == target] - p_j) at kept positions j,   0 at filtered positions
(the target's own term is dropped when the target was filtered: the gradient autograd gives for
masked_fill -> log_softmax -> gather); then the inverse all-to-all back to the vocab shards.

Per rank: vocab_parallel_logits [B, S, V/W] (the run's dtype, bf16 by default), target [B, S] int64
and grad_output [B, S] bf16 (both the same on every rank; grad_output is bf16 in every precision, as
upstream's factory makes it), tp_group (None), top_k, top_p, chunk_size (B*S and B*chunk_size divide
by W)  ->  [B, S, V/W] fp32, the gradient with respect to this rank's logits block.

Cost per rank: the forward all-to-all moves (W-1)/W of the bf16 logits block, the backward one
(W-1)/W of the fp32 gradient block: (W-1)/W * B*S*V/W * (itemsize + 4); flops
``_logprob.logprob_flops`` plus 2 per element for the gradient; HBM reads the logits block and
writes the fp32 gradient: B*S*V/W*(itemsize + 4) + B*S*(8 + 2) (targets and bf16 grad_output).

Cases: ``upstream_w{2,4,8}`` are the upstream factory (as the chunked forward's, plus grad_output
[2, 8] bf16). Tests and benchmarks: as vocab_parallel_log_prob_topk_chunked.
"""

import torch

import torch.distributed as dist

from pkb.problem import Cost, Problem, randn
from pkb.problems.tensor_parallel._common import dtype_of
from pkb.problems.tensor_parallel._logprob import (
    chunk_grad, chunk_tokens_of, logprob_cases, logprob_cost_terms, logprob_flops, make_logprob_inputs, token_chunks,
    upstream_logprob_inputs)

UPSTREAM, TESTS, BENCHMARKS = logprob_cases(chunked=True)


def make_inputs(case, rank, world_size, gen):
    logits, target = make_logprob_inputs(case, rank, world_size, gen)
    grad_output = randn(gen.shared, case["batch"], case["seq"], dtype=torch.bfloat16)  # bf16 in every precision, as upstream
    return logits, target, grad_output, None, case.get("top_k"), case.get("top_p", 1.0), case["chunk_size"]


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: the chunked forward's logits and targets, then grad_output [2, 8] bf16 evenly spaced
    from -1 to 1 (linspace, not drawn); group None, top-k 10, top-p 0.9, chunk_size W."""
    b, s = case["batch"], case["seq"]
    logits, target = upstream_logprob_inputs(case, rank, world_size, trial, device, step=19, offset=5)
    grad_output = torch.linspace(-1.0, 1.0, b * s, dtype=torch.bfloat16, device=device).reshape(b, s)
    return logits, target, grad_output, None, case.get("top_k"), case.get("top_p", 1.0), case["chunk_size"]


def reference(vocab_parallel_logits, target, grad_output, tp_group=None, top_k=None, top_p=1.0, chunk_size=1):
    batch, seq, vocab_local = vocab_parallel_logits.shape
    logits = vocab_parallel_logits.reshape(batch * seq, vocab_local)
    target, grad_output = target.reshape(-1), grad_output.reshape(-1)
    spans = token_chunks(batch * seq, chunk_tokens_of(batch, seq, chunk_size), dist.get_world_size(tp_group))
    parts = [chunk_grad(logits[start:end], target[start:end], grad_output[start:end], tp_group, top_k, top_p)
             for start, end in spans]
    return torch.cat(parts).view(batch, seq, vocab_local)


def cost(case, world_size):
    terms = logprob_cost_terms(case, world_size)
    size = dtype_of(case).itemsize
    local_elements = terms["logit_bytes"] / size
    return Cost(link_bytes=(world_size - 1) / world_size * local_elements * (size + 4),
                flops=logprob_flops(case, world_size) + 2 * local_elements,
                hbm_bytes=local_elements * (size + 4) + terms["tokens"] * (8 + 2),
                pattern="2x all_to_all (per chunk)")


PROBLEM = Problem(
    name="vocab_parallel_log_prob_topk_chunked_backward", version=2, upstream_id=84, category="tensor_parallel",
    source="NeMo-RL nemo_rl/distributed/model_utils.py ChunkedDistributedLogprob.backward with top-k/top-p",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
