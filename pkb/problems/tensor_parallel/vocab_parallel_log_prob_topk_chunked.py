"""Chunked token log-probs after top-k / top-p filtering over vocab-sharded logits (NeMo-RL
``ChunkedDistributedLogprob`` with sampling parameters).

The same result as vocab_parallel_log_prob_topk, computed B*chunk_size flat tokens at a time (as
upstream: the chunks cut the flat (batch, sequence) tokens, not the sequence of each row; each
chunk has its own all-to-all, filtering and all-gather), which bounds the memory of the
token-parallel full-vocab logits. Layout, filtering and tie rules: ``_logprob``.

Per rank: vocab_parallel_logits [B, S, V/W] (bf16), target [B, S] int64 (the same on every rank),
tp_group (None: default group), top_k, top_p, chunk_size (int; B*S and B*chunk_size divide by W, the
reference raises otherwise, as upstream; the last chunk may be shorter)  ->  [B, S] fp32 log-probs
on every rank (-inf where filtered).

Cost per rank: as the unchunked problem (chunking adds messages, not bytes): the all-to-alls move
(W-1)/W of the logits block, the all-gathers (W-1)/W of the [B, S] fp32 result; flops
``_logprob.logprob_flops``; HBM B*S*V/W*itemsize + B*S*4.

Cases: ``upstream_w{2,4,8}`` are the upstream factory: logits [2, 8, 256/W] bf16, top-k 10, top-p
0.9, chunk_size W. Tests: the filtering variants with chunks that leave a shorter last chunk (48
tokens in chunks of 32: 32 + 16), with one chunk, and with rows that W does not divide.
Benchmarks: as vocab_parallel_log_prob_topk, in chunks of 1024 / 512 positions.
"""

import torch
import torch.distributed as dist

from pkb.problem import Problem
from pkb.problems.tensor_parallel._logprob import (
    chunk_log_probs, chunk_tokens_of, forward_logprob_cost, logprob_cases, make_logprob_inputs, token_chunks,
    upstream_logprob_inputs)

UPSTREAM, TESTS, BENCHMARKS = logprob_cases(chunked=True)


def make_inputs(case, rank, world_size, gen):
    logits, target = make_logprob_inputs(case, rank, world_size, gen)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0), case["chunk_size"]


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: logits [2, 8, 256/W] N(0, 1) plus 8 at each target, targets (19 t + 5 + trial) % 256
    for flat token t (not drawn); group None, top-k 10, top-p 0.9, chunk_size W."""
    logits, target = upstream_logprob_inputs(case, rank, world_size, trial, device, step=19, offset=5)
    return logits, target, None, case.get("top_k"), case.get("top_p", 1.0), case["chunk_size"]


def reference(vocab_parallel_logits, target, tp_group=None, top_k=None, top_p=1.0, chunk_size=1):
    batch, seq, vocab_local = vocab_parallel_logits.shape
    logits, target = vocab_parallel_logits.reshape(batch * seq, vocab_local), target.reshape(-1)
    spans = token_chunks(batch * seq, chunk_tokens_of(batch, seq, chunk_size), dist.get_world_size(tp_group))
    parts = [chunk_log_probs(logits[start:end], target[start:end], tp_group, top_k, top_p) for start, end in spans]
    return torch.cat(parts).view(batch, seq)


def cost(case, world_size):
    return forward_logprob_cost(case, world_size, "all_to_all + all_gather (per chunk)")


PROBLEM = Problem(
    name="vocab_parallel_log_prob_topk_chunked", version=2, upstream_id=83, category="tensor_parallel",
    source="NeMo-RL nemo_rl/distributed/model_utils.py ChunkedDistributedLogprob with top-k/top-p",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
