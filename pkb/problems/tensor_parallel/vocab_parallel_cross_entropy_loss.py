"""Cross entropy over vocab-sharded logits (Megatron-LM ``vocab_parallel_cross_entropy``).

Per rank: vocab_parallel_logits [B, S, V/W] (this rank's vocab block: ids r*V/W ... (r+1)*V/W - 1),
target [B, S] int64 global vocab ids (the same on every rank), group (None: the default group)
->  loss [B, S] on every rank, in the logits' dtype:
    m = max over the whole vocab (all-reduce MAX),  z = logits - m
    predicted = z[target] on the rank that owns the target, 0 elsewhere (all-reduce SUM)
    sum_exp = sum over the vocab of exp(z) (all-reduce SUM)
    loss = log(sum_exp) - predicted
fp32 throughout (Megatron casts the logits up), rounded once. Unlike upstream (and Megatron, which
subtracts the max in place), the logits are left unchanged.

Cost per rank: three all-reduces of B*S fp32 values: 3 * 2(W-1)/W * B*S*4 bytes; about 4 flops per
local logit (max, subtract, exp, add); HBM reads the logit shard once and writes the loss:
B*S*V/W*itemsize + B*S*(8 + itemsize).

Benchmarks: Llama-3 8B (vocab 128256) on an 8192-token sequence, Qwen2.5 (vocab 152064) on a
4x4096-token batch, at the world sizes that divide the vocab.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.tensor_parallel._common import divides_all, dtype_of, itemsize


def make_inputs(case, rank, world_size, gen):
    b, s, vocab = case["batch"], case["seq"], case["vocab"]
    logits = randn(gen, b, s, vocab // world_size, dtype=dtype_of(case), scale=2.0)
    target = torch.randint(0, vocab, (b, s), generator=gen.shared, device=gen.device, dtype=torch.int64)
    return logits, target, None


def reference(vocab_parallel_logits, target, group=None):
    rank, vocab_local = dist.get_rank(group), vocab_parallel_logits.shape[-1]
    logits = vocab_parallel_logits.float()
    logits_max = logits.amax(-1)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - logits_max[..., None]

    local_target = target - rank * vocab_local
    owned = (local_target >= 0) & (local_target < vocab_local)
    picked = shifted.gather(-1, local_target.clamp(0, vocab_local - 1)[..., None]).squeeze(-1)
    predicted = torch.where(owned, picked, torch.zeros_like(picked))
    dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)

    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return (sum_exp.log() - predicted).to(vocab_parallel_logits.dtype)


def cost(case, world_size):
    tokens, vocab_local, size = case["batch"] * case["seq"], case["vocab"] / world_size, itemsize(case)
    return Cost(link_bytes=3 * 2 * (world_size - 1) / world_size * tokens * 4, flops=4 * tokens * vocab_local,
                hbm_bytes=tokens * vocab_local * size + tokens * (8 + size), pattern="3x all_reduce")


LLAMA3_VOCAB, QWEN25_VOCAB = 128256, 152064

PROBLEM = Problem(
    name="vocab_parallel_cross_entropy_loss", version=1, upstream_id=73, category="tensor_parallel",
    source="Megatron-LM core.tensor_parallel.cross_entropy (_VocabParallelCrossEntropy.forward)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd", {"batch": 2, "seq": 7, "vocab": 40}, note="5 vocab ids per rank at W=8"),
        Case("one_id_per_rank", {"batch": 3, "seq": 5, "vocab": 8}),
        Case("wider_vocab", {"batch": 1, "seq": 13, "vocab": 1000}),
    ],
    benchmarks=[
        Case("llama3_8b_seq8192", {"batch": 1, "seq": 8192, "vocab": LLAMA3_VOCAB},
             world_sizes=divides_all(LLAMA3_VOCAB)),
        Case("qwen25_b4_seq4096", {"batch": 4, "seq": 4096, "vocab": QWEN25_VOCAB},
             world_sizes=divides_all(QWEN25_VOCAB)),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
