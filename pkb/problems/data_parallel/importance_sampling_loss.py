"""Importance-sampling policy-gradient loss with globally reduced metrics (NeMo-RL / verl GRPO-style
token-level policy loss over data-parallel ranks).

Per rank, floats in the run's precision (bf16 by default): hidden_states [T_r, H] (this rank's tokens;
T_r differs by rank in the tests), weight [V, H] (the LM head, replicated: the same on every rank),
labels [T_r] int64 (ignore_index marks prompt and padding positions), old_logprobs [T_r] (the
behaviour policy's log-probabilities of the labels), advantages [T_r], ignore_index (int).
Reference, in the inputs' dtype ("dtype" below) as upstream (elementwise in that dtype; torch's bf16
and fp16 reductions accumulate in fp32 and round once):
    logits = hidden @ weight^T (dtype);  ce = cross_entropy(logits, labels) per token (dtype, 0 where
    ignored);  logprob = -ce;  delta = clamp(logprob - old_logprob, -20, 20) (0 where ignored);
    ratio = exp(delta);  per-token loss = -(ratio * advantage) (0 where ignored).
With n the number of valid tokens over ALL ranks (an fp32 SUM all-reduce), the sums (dtype) over this
rank's valid tokens of the per-token loss, of ratio, of (ratio - delta - 1) (the k3 KL estimate)
and of ce are SUM all-reduced in dtype, max ratio and -min ratio MAX all-reduced in dtype, then:
    loss    = sum(per-token loss) / max(n, 1)  (fp32; upstream adds and subtracts the local
              surrogate sum(ratio * advantage * ce) / max(n, 1), which moves it by an fp32 rounding)
    metrics = [mean ratio, min ratio, max ratio, mean k3, mean ce (the entropy proxy)]  (fp32)
Output: (loss fp32 0-dim, None, per_token_logprobs [T_r] dtype, per_token_loss [T_r] dtype, metrics [5]
fp32). The None is the upstream layout's unused slot. Every rank has a valid token: upstream's
min/max take an fp32 infinity on a rank without one, which the dtype all-reduce of the other ranks
cannot meet, so such a case is outside its domain.

Inputs: sampled tokens as RL gives them (log-probs between about -3 and 0, so bf16 holds them to
2^-8): the LM head's first column is -(1 + U(0, 1)/4), hidden_states' first column about log(V),
which pushes every logit about log(V) below zero; each token's hidden state also gets the head row
of its sampled token times a gain that lifts that one logit back to U(-1, 1). The old log-probs are
the resulting log-prob estimated without the GEMM plus N(0, 0.2) noise: ratios e^(+-1) or so, far
from the clamp at +-20. Upstream drew a different LM head on every rank; here it is replicated as
in real data parallelism.
Tolerance: rtol 2^-5 for every output, atol 2^-6 (bf16) and 8e-3 (fp16, fp32). A kernel that keeps fp32
between upstream's bf16 roundings (the logits, up to 2^-8 of |logit| <= 3, torch's bf16 log-softmax
intermediates, delta, ratio, product) moves a log-prob by up to about 0.011 (seen on the upstream
case: 1024 tokens, V = 32000) and a ratio by about 2%; its mean k3 (upstream's is a difference of
bf16 values near 1: rounding noise of up to 8e-3 per token) stays within atol. A missing rank's
share moves the mean ratio and the mean ce by 1/W, and a rank that does not hold the global
extreme ratios sees other ones.

Cost per rank, b bytes per element of dtype: link bytes 2(W-1)/W * (4 + 4b + 2b) (n in fp32; four
sums and two extremes in dtype); flops 2*T*V*H (the LM-head GEMM) + 4*T*V (max, exp, sum and the
label gather on the logits); HBM: hidden states and LM head read once, b*(T*H + V*H) bytes (a fused
kernel never writes the logits), plus the per-token vectors: T*(8 + 4b).

Cases: ``upstream`` is the upstream factory: 1024 tokens per rank, H 1024, V 32000, every token
valid (a CPU evaluation takes seconds: the LM-head GEMM is 67 GFLOP per rank).
Benchmarks: GRPO micro-batches of 4096 tokens on Llama-3.1-8B (H 4096, V 128256) and of 8192
tokens on Qwen2.5-7B (H 3584, V 152064), a third of the positions masked (prompt tokens).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.data_parallel._common import dtype_of

LOGIT_STD = 0.5       # spread of the logits the head's other columns give
OLD_LOGPROB_STD = 0.2


def tokens_of(case, rank: int) -> int:
    low, high = case["tokens"]
    return low + (rank * 7919) % (high - low + 1)  # a fixed, rank-dependent count in [low, high]


def _lm_head(gen, vocab: int, hidden: int) -> torch.Tensor:
    """[V, H] fp32: column 0 is -(1 + U(0,1)/4) (every logit's offset), the rest N(0, LOGIT_STD^2 / (H-1))."""
    offset = -(1.0 + 0.25 * torch.rand(vocab, 1, generator=gen, device=gen.device))
    return torch.cat([offset, randn(gen, vocab, hidden - 1, scale=LOGIT_STD / math.sqrt(hidden - 1))], dim=1)


def make_inputs(case, rank, world_size, gen):
    tokens, hidden, vocab = tokens_of(case, rank), case["hidden"], case["vocab"]
    head = _lm_head(gen.shared, vocab, hidden)
    depth = math.log(vocab)  # how far below zero the offset column pushes the logits
    sampled = torch.randint(0, vocab, (tokens,), generator=gen, device=gen.device)
    level = 2.0 * torch.rand(tokens, generator=gen, device=gen.device) - 1.0  # the sampled token's logit
    shift = depth * (1.0 + 0.05 * randn(gen, tokens))
    noise = randn(gen, tokens, hidden - 1)
    row = head[sampled, 1:]
    gain = (shift * -head[sampled, 0] + level) / row.pow(2).sum(-1)  # lifts the sampled logit to `level`
    dtype = dtype_of(case)
    hidden_states = torch.cat([shift[:, None], noise + gain[:, None] * row], dim=1).to(dtype)
    weight = head.to(dtype)

    # log-prob estimate without the GEMM: the sampled logit against the expected mass of the others
    # (their offsets' mean exp taken over the first 1024 vocab rows)
    sampled_logit = level + (noise * row).sum(-1)
    offsets = (shift[:, None] * head[None, :1024, 0]).exp().mean(-1)
    others_log_mass = math.log(vocab) + LOGIT_STD**2 / 2 + offsets.log()
    estimate = sampled_logit - torch.logaddexp(sampled_logit, others_log_mass)
    old_logprobs = (estimate + randn(gen, tokens, scale=OLD_LOGPROB_STD)).to(dtype)

    ignored = torch.rand(tokens, generator=gen, device=gen.device) < case["ignored_fraction"]
    ignored[0] = False  # every rank has a valid token (see the docstring)
    labels = torch.where(ignored, -100, sampled)
    advantages = randn(gen, tokens, dtype=dtype)
    return hidden_states, weight, labels, old_logprobs, advantages, -100


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: hidden states and an LM head N(0, 1) (the head distinct per rank), uniform labels (all
    valid), old log-probs and advantages N(0, 1)."""
    tokens, hidden, vocab, dtype = tokens_of(case, rank), case["hidden"], case["vocab"], dtype_of(case)
    hidden_states = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device)
    labels = torch.randint(0, vocab, (tokens,), dtype=torch.long, device=device)
    old_logprobs = torch.randn(tokens, dtype=dtype, device=device)
    return hidden_states, weight, labels, old_logprobs, torch.randn(tokens, dtype=dtype, device=device), -100


def reference(hidden_states, weight, labels, old_logprobs, advantages, ignore_index=-100):
    logits = F.linear(hidden_states, weight)                             # [T, V] bf16, fp32 accumulation
    labels, old_logprobs, advantages = labels.view(-1), old_logprobs.view(-1), advantages.view(-1)
    valid = labels != ignore_index
    ce = F.cross_entropy(logits.view(labels.numel(), -1), labels, ignore_index=ignore_index, reduction="none")
    delta = (-ce - old_logprobs).masked_fill(~valid, 0.0).clamp(-20.0, 20.0)
    ratio = delta.exp()
    weighted = (ratio * advantages).masked_fill(~valid, 0.0)
    per_token_loss = -weighted

    num_valid = valid.sum().float().reshape(1)
    dist.all_reduce(num_valid)                                            # fp32, 4 bytes
    denominator = num_valid.clamp(min=1.0)[0]
    sums = torch.stack([per_token_loss.sum(), ratio.masked_fill(~valid, 0.0).sum(),
                        (ratio - delta - 1.0).masked_fill(~valid, 0.0).sum(), ce.masked_fill(~valid, 0.0).sum()])
    dist.all_reduce(sums)                                                 # bf16 [4]
    extremes = torch.stack([ratio.masked_fill(~valid, -math.inf).max(), (-ratio).masked_fill(~valid, -math.inf).max()])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)                       # bf16 [max, -min]

    surrogate = (weighted * ce).sum() / denominator                      # local, as upstream
    loss = (sums[0] / denominator + surrogate) - surrogate
    metrics = torch.stack([sums[1] / denominator, -extremes[1].float(), extremes[0].float(),
                           sums[2] / denominator, sums[3] / denominator])
    return loss, None, (-ce).view_as(labels), per_token_loss.view_as(labels), metrics


def cost(case, world_size):
    tokens = max(tokens_of(case, rank) for rank in range(world_size))
    hidden, vocab, itemsize = case["hidden"], case["vocab"], dtype_of(case).itemsize
    return Cost(link_bytes=2 * (world_size - 1) / world_size * (4 + 4 * itemsize + 2 * itemsize),
                flops=2 * tokens * vocab * hidden + 4 * tokens * vocab,
                hbm_bytes=itemsize * (tokens * hidden + vocab * hidden) + tokens * (8 + 4 * itemsize),
                pattern="all_reduce")


def tolerance(case, world_size, dtype):
    return Tolerance(atol=2.0**-6 if dtype == torch.bfloat16 else 8e-3, rtol=2.0**-5)


PROBLEM = Problem(
    name="importance_sampling_loss", version=3, upstream_id=25, category="data_parallel",
    source="NeMo-RL ClippedPGLossFn / verl policy loss style: token-level importance-sampled PG loss over DP",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"tokens": (1024, 1024), "hidden": 1024, "vocab": 32000, "ignored_fraction": 0.0},
                   slow_on_cpu=True,  # a 67 GFLOP LM-head GEMM per rank: about a minute on one CPU thread
                   note="the upstream factory: hidden [1024, 1024], weight [32000, 1024], 1024 labels")],
    # "argument_value": labels at ignore_index (every upstream label is valid)
    tests=[
        Case("odd_tokens_small_vocab", {"tokens": (5, 13), "hidden": 48, "vocab": 37, "ignored_fraction": 0.3},
             tags=("uneven_sizes", "odd_sizes", "argument_value")),
        Case("mostly_ignored", {"tokens": (3, 9), "hidden": 32, "vocab": 50, "ignored_fraction": 0.8},
             note="most ranks keep only one or two valid tokens", tags=("uneven_sizes", "odd_sizes", "argument_value")),
        Case("one_token_per_rank", {"tokens": (1, 1), "hidden": 40, "vocab": 129, "ignored_fraction": 0.0},
             tags=("tiny", "odd_sizes")),
    ],
    benchmarks=[
        Case("llama3_1_8b_grpo_4k_tokens", {"tokens": (4096, 4096), "hidden": 4096, "vocab": 128256,
                                            "ignored_fraction": 0.33}),
        Case("qwen2_5_7b_grpo_8k_tokens", {"tokens": (8192, 8192), "hidden": 3584, "vocab": 152064,
                                           "ignored_fraction": 0.33}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
