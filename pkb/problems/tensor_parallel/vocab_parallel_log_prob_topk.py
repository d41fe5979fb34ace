"""Token log-probs after top-k / top-p filtering over vocab-sharded logits (NeMo-RL distributed
log-probs with sampling parameters, ``nemo_rl/distributed/model_utils.py``).

Top-k/top-p need the whole vocabulary of a token, so the vocab-parallel logits are re-sharded by
sequence with an all-to-all, filtered and normalised per token, and the target log-probs are
all-gathered (the exact filtering and tie rules are in ``_logprob``'s docstring).

Per rank: vocab_parallel_logits [B, S, V/W] (bf16, vocab block r), target [B, S] int64 (the same on
every rank), tp_group (None: the default group), top_k (int or None), top_p (float)  ->
[B, S] fp32 log-probs on every rank (-inf where the target was filtered out). S divides by W.

Cost per rank: the all-to-all moves (W-1)/W of the logits block (B*S*V/W*itemsize), the all-gather
(W-1)/W of the [B, S] fp32 result; flops ``_logprob.logprob_flops`` (softmax ~5 per element, plus
log2(V) per element for the top-p sort); HBM reads the logits block and writes the result:
B*S*V/W*itemsize + B*S*4.

Tests: the filtering variants (top-k and top-p, each alone, none) at odd per-rank sizes.
Benchmarks: a Qwen2.5-7B GRPO micro-batch (4096 tokens, vocab 152064, top-k 50, top-p 0.95) and a
Llama-3 8B one (2 x 2048 tokens, vocab 128256, top-p 0.9).
"""

from pkb.problem import Problem
from pkb.problems.tensor_parallel._logprob import (
    chunk_log_probs, forward_logprob_cost, logprob_cases, make_logprob_inputs)

TESTS, BENCHMARKS = logprob_cases(chunked=False)


def make_inputs(case, rank, world_size, gen):
    logits, target = make_logprob_inputs(case, rank, world_size, gen)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0)


def reference(vocab_parallel_logits, target, tp_group=None, top_k=None, top_p=1.0):
    return chunk_log_probs(vocab_parallel_logits, target, tp_group, top_k, top_p)


def cost(case, world_size):
    return forward_logprob_cost(case, world_size, "all_to_all + all_gather")


PROBLEM = Problem(
    name="vocab_parallel_log_prob_topk", version=1, upstream_id=82, category="tensor_parallel",
    source="NeMo-RL nemo_rl/distributed/model_utils.py: distributed log-probs with top-k/top-p "
           "(vLLM apply_top_k_top_p)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
