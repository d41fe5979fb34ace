"""Cross entropy over vocab-sharded logits (Megatron-LM ``vocab_parallel_cross_entropy``).

Per rank: vocab_parallel_logits [B, S, V/W] (this rank's vocab block: ids r*V/W ... (r+1)*V/W - 1),
target [B, S] int64 global vocab ids (the same on every rank), group (None: the default group)
->  loss [B, S] on every rank, in the logits' dtype:
    m = max over the whole vocab (all-reduce MAX)
    vocab_parallel_logits -= m     IN PLACE, in the logits' dtype (as upstream and Megatron): z
    predicted = z[target] on the rank that owns the target, 0 elsewhere (all-reduce SUM)
    sum_exp = sum over the vocab of exp(z) (all-reduce SUM)
    loss = log(sum_exp) - predicted
The shifted logits z are part of the result: they are compared after the call like an output.
From z on the reference works in fp32 and rounds the loss once; upstream stays in the logits' dtype
(exp, sums, log and the all-reduces in bf16), which the bf16 default tolerance covers.

Cost per rank: three all-reduces of B*S values in the logits' dtype (as upstream):
3 * 2(W-1)/W * B*S*itemsize bytes; about 4 flops per local logit (max, subtract, exp, add); HBM
reads the logit shard, writes it back shifted, and writes the loss: 2*B*S*V/W*itemsize + B*S*(8 + itemsize).

Cases: ``upstream`` is the upstream factory: logits [8, 1024, 512/W] bf16 (vocab 512), targets the
same on every rank, group None.

Benchmarks: Llama-3 8B (vocab 128256) on an 8192-token sequence, Qwen2.5 (vocab 152064) on a
4x4096-token batch, at the world sizes that divide the vocab.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.tensor_parallel._common import divides_all, dtype_of, itemsize, upstream_targets


def make_inputs(case, rank, world_size, gen):
    b, s, vocab = case["batch"], case["seq"], case["vocab"]
    logits = randn(gen, b, s, vocab // world_size, dtype=dtype_of(case), scale=2.0)
    target = torch.randint(0, vocab, (b, s), generator=gen.shared, device=gen.device, dtype=torch.int64)
    return logits, target, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): logits [8, 1024, 512/W] N(0, 1); the targets are not drawn but fixed,
    (13 t + 7 + trial) % 512 for flat token t; group None."""
    b, s, vocab = case["batch"], case["seq"], case["vocab"]
    logits = torch.randn((b, s, vocab // world_size), dtype=dtype_of(case), device=device)
    target = upstream_targets(b, s, vocab, step=13, offset=7, trial=trial, device=device)
    return logits, target, None


def reference(vocab_parallel_logits, target, group=None):
    rank, vocab_local = dist.get_rank(group), vocab_parallel_logits.shape[-1]
    logits_max = vocab_parallel_logits.amax(-1)  # [B, S], exact in the logits' dtype
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    vocab_parallel_logits.sub_(logits_max[..., None])
    shifted = vocab_parallel_logits.float()

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
    return Cost(link_bytes=3 * 2 * (world_size - 1) / world_size * tokens * size, flops=4 * tokens * vocab_local,
                hbm_bytes=2 * tokens * vocab_local * size + tokens * (8 + size), pattern="3x all_reduce")


LLAMA3_VOCAB, QWEN25_VOCAB = 128256, 152064

PROBLEM = Problem(
    name="vocab_parallel_cross_entropy_loss", version=2, upstream_id=73, category="tensor_parallel",
    source="Megatron-LM core.tensor_parallel.cross_entropy (_VocabParallelCrossEntropy.forward)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"batch": 8, "seq": 1024, "vocab": 512},
                   note="the upstream factory: logits [8, 1024, 512/W], target [8, 1024]")],
    tests=[
        Case("odd", {"batch": 2, "seq": 7, "vocab": 40}, note="5 vocab ids per rank at W=8", tags=("odd_sizes",)),
        Case("one_id_per_rank", {"batch": 3, "seq": 5, "vocab": 8}, tags=("tiny", "odd_sizes")),
        Case("wider_vocab", {"batch": 1, "seq": 13, "vocab": 1000}, tags=("odd_sizes", "shape_regime")),
    ],
    benchmarks=[
        Case("llama3_8b_seq8192", {"batch": 1, "seq": 8192, "vocab": LLAMA3_VOCAB},
             world_sizes=divides_all(LLAMA3_VOCAB)),
        Case("qwen25_b4_seq4096", {"batch": 4, "seq": 4096, "vocab": QWEN25_VOCAB},
             world_sizes=divides_all(QWEN25_VOCAB)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
