"""Token log-probs after top-k / top-p filtering over vocab-sharded logits (NeMo-RL distributed
log-probs with sampling parameters, ``nemo_rl/distributed/model_utils.py``).

Top-k/top-p need the whole vocabulary of a token, so the vocab-parallel logits are re-sharded by
token with an all-to-all (rank r takes the flat tokens r*B*S/W ...), filtered and normalised per
token, and the target log-probs are all-gathered (the layout, filtering and tie rules are in
``_logprob``'s docstring; the top-p cut is decided in bf16, as upstream).

Per rank: vocab_parallel_logits [B, S, V/W] (bf16, vocab block r), target [B, S] int64 (the same on
every rank), tp_group (None: the default group), top_k (int or None), top_p (float)  ->
[B, S] fp32 log-probs on every rank (-inf where the target was filtered out). B*S divides by W
(the reference raises otherwise, as upstream).

Cost per rank: the all-to-all moves (W-1)/W of the logits block (B*S*V/W*itemsize), the all-gather
(W-1)/W of the [B, S] fp32 result; flops ``_logprob.logprob_flops`` (softmax ~5 per element, plus
log2(V) per element for the top-p sort); HBM reads the logits block and writes the result:
B*S*V/W*itemsize + B*S*4.

Cases: ``upstream`` is the upstream factory: logits [2, 8, 256/W] bf16, top-k 10, top-p 0.9.
Tests: the filtering variants (top-k and top-p, each alone, none) at odd per-rank sizes, and a
batch whose rows do not divide by W (only B*S does). Benchmarks: a Qwen2.5-7B GRPO micro-batch
(4096 tokens, vocab 152064, top-k 50, top-p 0.95) and a Llama-3 8B one (2 x 2048 tokens, vocab
128256, top-p 0.9).
"""

import torch.distributed as dist

from pkb.problem import Problem
from pkb.problems.tensor_parallel._logprob import (
    chunk_log_probs, forward_logprob_cost, logprob_cases, make_logprob_inputs, token_chunks, upstream_logprob_inputs)

UPSTREAM, TESTS, BENCHMARKS = logprob_cases(chunked=False)


def make_inputs(case, rank, world_size, gen):
    logits, target = make_logprob_inputs(case, rank, world_size, gen)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: logits [2, 8, 256/W] N(0, 1) plus 8 at each target, targets (17 t + 3 + trial) % 256
    for flat token t (not drawn); group None, top-k 10, top-p 0.9."""
    logits, target = upstream_logprob_inputs(case, rank, world_size, trial, device, step=17, offset=3)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0)


def reference(vocab_parallel_logits, target, tp_group=None, top_k=None, top_p=1.0):
    batch, seq, vocab_local = vocab_parallel_logits.shape
    token_chunks(batch * seq, batch * seq, dist.get_world_size(tp_group))  # raises unless W divides B*S
    log_probs = chunk_log_probs(vocab_parallel_logits.reshape(batch * seq, vocab_local), target.reshape(-1),
                                tp_group, top_k, top_p)
    return log_probs.view(batch, seq)


def cost(case, world_size):
    return forward_logprob_cost(case, world_size, "all_to_all + all_gather")


PROBLEM = Problem(
    name="vocab_parallel_log_prob_topk", version=2, upstream_id=82, category="tensor_parallel",
    source="NeMo-RL nemo_rl/distributed/model_utils.py: distributed log-probs with top-k/top-p "
           "(vLLM apply_top_k_top_p)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
