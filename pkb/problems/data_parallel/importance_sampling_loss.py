"""Importance-sampling policy-gradient loss with globally reduced metrics (NeMo-RL / verl GRPO-style
token-level policy loss over data-parallel ranks).

Per rank: hidden_states [T_r, H] bf16 (this rank's tokens; T_r differs by rank), weight [V, H] bf16
(the LM head, replicated: the same on every rank), labels [T_r] int64 (ignore_index marks prompt and
padding positions; a rank may have no valid token), old_logprobs [T_r] fp32 (the behaviour policy's
log-probabilities of the labels), advantages [T_r] fp32, ignore_index (int).
Reference: logits = hidden @ weight^T as the policy model emits them (bf16 GEMM: fp32 accumulation,
rounded to bf16), then fp32 throughout: logprob_t = logits[t, label_t] - logsumexp(logits[t]);
log_ratio = logprob - old_logprob; ratio = exp(log_ratio); per-token loss = -advantage * ratio
(0 where ignored, as is the logprob). With n the number of valid tokens over ALL ranks:
loss = (sum over all ranks' valid tokens of the per-token loss) / max(n, 1) (token-level mean);
metrics = [mean ratio, min ratio, max ratio, mean approx KL ((ratio - 1) - log_ratio), n], all over
every rank's valid tokens. Sums travel in one SUM all-reduce of 4 fp32, min and max in one MAX
all-reduce of 2 (max ratio, -min ratio).
Output: (loss fp32 0-dim, None, per_token_logprobs [T_r] bf16, per_token_loss [T_r] bf16, metrics [5]
fp32). The None is the upstream layout's unused slot, kept so upstream solutions return the same tuple.
Upstream drew a different LM head on every rank; here it is replicated as in real data parallelism.
Tolerance: atol 1e-4, rtol 1e-2 for every output. A kernel summing the GEMM in another order may
round a label's logit (|logit| < 2) to the neighbouring bf16 value, moving that token's ratio by up
to 0.8%, which the fp32 min/max metrics would otherwise reject; a missing rank's tokens change the
global count n (and the means) by far more.

Cost per rank: link bytes 2(W-1)/W * (16 + 8); flops 2*T*V*H (the LM-head GEMM) + 4*T*V (max,
exp, sum and the label gather on the logits); HBM: hidden states and LM head read once, 2*(T*H + V*H)
bytes (a fused kernel never writes the fp32 logits), plus the per-token vectors.

Benchmarks: GRPO micro-batches of 4096 tokens on Llama-3.1-8B (H 4096, V 128256) and of 8192
tokens on Qwen2.5-7B (H 3584, V 152064), a third of the positions masked (prompt tokens).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn

LOGIT_STD = 0.5  # logits ~ N(0, 0.25): importance ratios spread over roughly e^-2 .. e^2


def tokens_of(case, rank: int) -> int:
    low, high = case["tokens"]
    return low + (rank * 7919) % (high - low + 1)  # a fixed, rank-dependent count in [low, high]


def make_inputs(case, rank, world_size, gen):
    tokens, hidden, vocab = tokens_of(case, rank), case["hidden"], case["vocab"]
    hidden_states = randn(gen, tokens, hidden, dtype=torch.bfloat16)
    weight = randn(gen.shared, vocab, hidden, dtype=torch.bfloat16, scale=LOGIT_STD / math.sqrt(hidden))
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=gen.device)
    ignored = torch.rand(tokens, generator=gen, device=gen.device) < case["ignored_fraction"]
    if rank in case.get("all_ignored_ranks", ()):
        ignored[:] = True
    else:
        ignored[0] = False  # every other rank has a valid token, so the global metrics are finite
    labels[ignored] = -100
    expected_logprob = -math.log(vocab) - LOGIT_STD**2 / 2
    old_logprobs = expected_logprob + randn(gen, tokens, scale=0.5 * LOGIT_STD)
    advantages = randn(gen, tokens)
    return hidden_states, weight, labels, old_logprobs, advantages, -100


def reference(hidden_states, weight, labels, old_logprobs, advantages, ignore_index=-100):
    logits = (hidden_states @ weight.T).float()
    valid = labels != ignore_index
    label_logits = logits.gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    logprobs = torch.where(valid, label_logits - torch.logsumexp(logits, dim=-1), 0.0)
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    per_token_loss = torch.where(valid, -advantages * ratio, 0.0)
    kl = torch.where(valid, ratio - 1 - log_ratio, 0.0)
    sums = torch.stack([valid.sum().float(), per_token_loss.sum(), torch.where(valid, ratio, 0.0).sum(), kl.sum()])
    inf = torch.tensor(math.inf, device=ratio.device)
    extremes = torch.stack([torch.where(valid, ratio, -inf).max() if valid.numel() else -inf,
                            torch.where(valid, -ratio, -inf).max() if valid.numel() else -inf])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    num_valid = sums[0]
    denominator = num_valid.clamp_min(1.0)
    loss = sums[1] / denominator
    metrics = torch.stack([sums[2] / denominator, -extremes[1], extremes[0], sums[3] / denominator, num_valid])
    return loss, None, logprobs.to(torch.bfloat16), per_token_loss.to(torch.bfloat16), metrics


def cost(case, world_size):
    tokens = max(tokens_of(case, rank) for rank in range(world_size))
    hidden, vocab = case["hidden"], case["vocab"]
    return Cost(link_bytes=2 * (world_size - 1) / world_size * (16 + 8),
                flops=2 * tokens * vocab * hidden + 4 * tokens * vocab,
                hbm_bytes=2 * (tokens * hidden + vocab * hidden) + tokens * (8 + 4 + 4 + 2 + 2),
                pattern="all_reduce")


PROBLEM = Problem(
    name="importance_sampling_loss", version=1, upstream_id=25, category="data_parallel",
    source="NeMo-RL ClippedPGLossFn / verl policy loss style: token-level importance-sampled PG loss over DP",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_tokens_small_vocab", {"tokens": (5, 13), "hidden": 16, "vocab": 37, "ignored_fraction": 0.3}),
        Case("rank0_all_ignored", {"tokens": (3, 6), "hidden": 8, "vocab": 50, "ignored_fraction": 0.2,
                                   "all_ignored_ranks": (0,)}),
        Case("one_token_per_rank", {"tokens": (1, 1), "hidden": 24, "vocab": 129, "ignored_fraction": 0.0}),
    ],
    benchmarks=[
        Case("llama3_1_8b_grpo_4k_tokens", {"tokens": (4096, 4096), "hidden": 4096, "vocab": 128256,
                                            "ignored_fraction": 0.33}),
        Case("qwen2_5_7b_grpo_8k_tokens", {"tokens": (8192, 8192), "hidden": 3584, "vocab": 152064,
                                           "ignored_fraction": 0.33}),
    ],
    tolerance=Tolerance(atol=1e-4, rtol=1e-2), reference=reference, make_inputs=make_inputs, cost=cost,
)
