"""Chunked token log-probs after top-k / top-p filtering over vocab-sharded logits (NeMo-RL
``ChunkedDistributedLogprob`` with sampling parameters).

The same result as vocab_parallel_log_prob_topk, computed chunk_size tokens of the sequence at a
time (chunk [c, min(S, c + chunk_size)) at a time: its own all-to-all, filtering and all-gather), which
bounds the memory of the sequence-parallel full-vocab logits. Filtering and tie rules: ``_logprob``.

Per rank: vocab_parallel_logits [B, S, V/W] (bf16), target [B, S] int64 (the same on every rank),
tp_group (None: default group), top_k, top_p, chunk_size (int; S and chunk_size divide by W; the
last chunk may be shorter)  ->  [B, S] fp32 log-probs on every rank (-inf where filtered).

Cost per rank: as the unchunked problem (chunking adds messages, not bytes): the all-to-alls move
(W-1)/W of the logits block, the all-gathers (W-1)/W of the [B, S] fp32 result; flops
``_logprob.logprob_flops``; HBM B*S*V/W*itemsize + B*S*4.

Tests: the filtering variants with chunks that leave a shorter last chunk (24 tokens in chunks of
16: 16 + 8) and with one chunk. Benchmarks: as upstream 82, in chunks of 1024 / 512 tokens.
"""

import torch

from pkb.problem import Problem
from pkb.problems.tensor_parallel._logprob import (
    chunk_log_probs, chunks, forward_logprob_cost, logprob_cases, make_logprob_inputs)

TESTS, BENCHMARKS = logprob_cases(chunked=True)


def make_inputs(case, rank, world_size, gen):
    logits, target = make_logprob_inputs(case, rank, world_size, gen)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0), case["chunk_size"]


def reference(vocab_parallel_logits, target, tp_group=None, top_k=None, top_p=1.0, chunk_size=1):
    parts = [chunk_log_probs(vocab_parallel_logits[:, start:end], target[:, start:end], tp_group, top_k, top_p)
             for start, end in chunks(vocab_parallel_logits.shape[1], chunk_size)]
    return torch.cat(parts, dim=1)


def cost(case, world_size):
    return forward_logprob_cost(case, world_size, "all_to_all + all_gather (per chunk)")


PROBLEM = Problem(
    name="vocab_parallel_log_prob_topk_chunked", version=1, upstream_id=83, category="tensor_parallel",
    source="NeMo-RL nemo_rl/distributed/model_utils.py ChunkedDistributedLogprob with top-k/top-p",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
