"""Shared by the NeMo-RL vocab-parallel log-prob problems (upstream 82, 83, 84).

Semantics, per token row over the full vocabulary (the ranks' shards concatenated in rank order),
in fp32 on the bf16 logits (vLLM's ``apply_top_k_top_p``, which NeMo-RL reuses):
  top-k (top_k None or 0: off): keep every logit >= the k-th largest (ties at the k-th value kept).
  top-p (top_p 1.0: off): sort ascending (stable: among equal logits the lower vocab id first),
      softmax, cumulative sum; drop every position whose cumulative sum is <= 1 - top_p, except the
      last (the largest logit is always kept).
  log-prob of the target = log_softmax(kept logits)[target]; -inf when the target was dropped.
The vocab-parallel layout [B, S, V/W] is turned into a sequence-parallel one [B, S/W, V] with an
all-to-all (rank r takes tokens r*S/W ...), filtered there, and the [B, S/W] results all-gathered.

Inputs: the whole [B, S, V] logits are drawn from the shared generator and each rank keeps its own
vocab block (so every shard differs per rank). That lets make_inputs redraw the rows whose result
would hang on rounding: a top-k with a tie at the k-th value, a top-p cut with a cumulative sum
within 1e-3 of 1 - top_p, or a tie straddling the cut. Honest fp32 kernels (another summation
order, another tie order in the sort) then agree. A row still ambiguous after 16 redraws is kept;
when more than half the rows are ambiguous at the first draw (benchmark-sized vocabularies, whose
tail tokens are far denser than the margin), none is redrawn: benchmarks are timed, not checked. Targets are the
sampled tokens of RL: three in four drawn from the filtered distribution, the rest uniform (and
so often filtered out: -inf).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of

TOP_P_MARGIN = 1e-3
MAX_REDRAWS = 16
LOGIT_SCALE = 2.0


def top_k_on(top_k, vocab: int) -> bool:
    return top_k is not None and 0 < top_k < vocab


def top_p_on(top_p) -> bool:
    return top_p is not None and top_p < 1.0


def filter_top_k_top_p(x: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """fp32 logits [..., V] with the filtered positions set to -inf (the rules in the module docstring)."""
    if top_k_on(top_k, x.shape[-1]):
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p_on(top_p):
        sorted_x, order = x.sort(dim=-1, stable=True)
        cumulative = sorted_x.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def _ambiguous_rows(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Rows [N, V] (fp32 of the bf16 inputs) whose filtering an fp32 rounding or a tie order could change."""
    bad = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    x = logits
    if top_k_on(top_k, x.shape[-1]):
        top = x.topk(top_k + 1, dim=-1).values
        bad |= top[:, -1] == top[:, -2]
        x = x.masked_fill(x < top[:, -2:-1], float("-inf"))
    if top_p_on(top_p):
        sorted_x = x.double().sort(dim=-1, stable=True).values
        cumulative = sorted_x.softmax(-1).cumsum(-1)
        bad |= ((cumulative[:, :-1] - (1 - top_p)).abs() < TOP_P_MARGIN).any(-1)
        num_dropped = (cumulative[:, :-1] <= 1 - top_p).sum(-1)
        last_dropped = sorted_x.gather(-1, (num_dropped - 1).clamp_min(0)[:, None]).squeeze(-1)
        first_kept = sorted_x.gather(-1, num_dropped[:, None]).squeeze(-1)
        bad |= (num_dropped > 0) & (last_dropped == first_kept) & torch.isfinite(last_dropped)
    return bad


def make_logprob_inputs(case: Case, rank: int, world_size: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits block [B, S, V/W] (bf16) and the shared targets [B, S] (int64)."""
    b, s, vocab = case["batch"], case["seq"], case["vocab"]
    top_k, top_p, dtype = case.get("top_k"), case.get("top_p", 1.0), dtype_of(case)
    shared = gen.shared

    def draw(num_rows):
        values = torch.randn(num_rows, vocab, generator=shared, device=shared.device) * LOGIT_SCALE
        return values.to(dtype).float()

    logits = draw(b * s)
    pending = _ambiguous_rows(logits, top_k, top_p).nonzero().squeeze(-1)
    if pending.numel() * 2 > b * s:  # a vocabulary too large for the margin: timed, never checked
        pending = pending[:0]
    for _ in range(MAX_REDRAWS):
        if pending.numel() == 0:
            break
        logits[pending] = draw(pending.numel())
        pending = pending[_ambiguous_rows(logits[pending], top_k, top_p)]
    probs = filter_top_k_top_p(logits, top_k, top_p).softmax(-1)
    sampled = torch.multinomial(probs, 1, generator=shared).squeeze(-1)
    uniform = torch.randint(0, vocab, (b * s,), generator=shared, device=shared.device)
    from_policy = torch.rand(b * s, generator=shared, device=shared.device) < 0.75
    target = torch.where(from_policy, sampled, uniform).view(b, s)
    vocab_local = vocab // world_size
    block = logits.view(b, s, vocab)[..., rank * vocab_local:(rank + 1) * vocab_local]
    return block.to(dtype).contiguous(), target


def vocab_to_sequence_parallel(logits_local: torch.Tensor, group=None) -> torch.Tensor:
    """[B, S, V/W] vocab shards -> [B, S/W, V]: this rank's tokens over the whole vocab (all-to-all)."""
    world_size = dist.get_world_size(group)
    b, s, vocab_local = logits_local.shape
    send = logits_local.reshape(b, world_size, s // world_size, vocab_local).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # [W (source rank = vocab block), B, S/W, V/W]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3).reshape(b, s // world_size, world_size * vocab_local)


def sequence_to_vocab_parallel(full: torch.Tensor, group=None) -> torch.Tensor:
    """[B, S/W, V] -> [B, S, V/W]: the inverse all-to-all of ``vocab_to_sequence_parallel``."""
    world_size = dist.get_world_size(group)
    b, s_local, vocab = full.shape
    send = full.reshape(b, s_local, world_size, vocab // world_size).permute(2, 0, 1, 3).contiguous()
    recv = torch.empty_like(send)  # [W (source rank = token block), B, S/W, V/W]
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, world_size * s_local, vocab // world_size)


def my_tokens(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the sequence dimension (dim 1) of a [B, S, ...] tensor."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = tensor.shape[1] // world_size
    return tensor[:, rank * s_local:(rank + 1) * s_local]


def chunk_log_probs(logits_local, target, group, top_k, top_p) -> torch.Tensor:
    """Log-probs [B, S] of ``target`` for one chunk of the sequence (every rank gets all of them)."""
    full = vocab_to_sequence_parallel(logits_local, group).float()  # [B, S/W, V]
    log_probs = filter_top_k_top_p(full, top_k, top_p).log_softmax(-1)
    picked = log_probs.gather(-1, my_tokens(target, group)[..., None]).squeeze(-1)  # [B, S/W]
    return all_gather_cat(picked.contiguous(), dim=1, group=group)


def chunk_grad(logits_local, target, grad_output, group, top_k, top_p) -> torch.Tensor:
    """d(sum grad_output * log-prob)/d logits_local [B, S, V/W] fp32 for one chunk of the sequence.

    For a kept position j: g * (1[j == target] - p_j), p the softmax over the kept logits; 0 at the
    filtered positions (the target included when it was filtered).
    """
    full = vocab_to_sequence_parallel(logits_local, group).float()  # [B, S/W, V]
    filtered = filter_top_k_top_p(full, top_k, top_p)
    probs = filtered.softmax(-1)
    chosen = torch.zeros_like(probs).scatter_(-1, my_tokens(target, group)[..., None], 1.0)
    chosen = chosen * torch.isfinite(filtered)
    grad = (chosen - probs) * my_tokens(grad_output, group).float()[..., None]
    return sequence_to_vocab_parallel(grad, group)


def chunks(seq: int, chunk_size: int):
    """(start, end) of each chunk along the sequence; the last may be shorter."""
    return [(start, min(seq, start + chunk_size)) for start in range(0, seq, chunk_size)]


def logprob_cost_terms(case: Case, world_size: int) -> dict:
    """Sizes for the cost model: tokens, vocab shard, bytes of one logits block and of the log-probs."""
    tokens, vocab = case["batch"] * case["seq"], case["vocab"]
    return {"tokens": tokens, "vocab": vocab, "logit_bytes": tokens * vocab / world_size * dtype_of(case).itemsize}


def logprob_flops(case: Case, world_size: int) -> float:
    """Per rank, per token of its sequence block over the whole vocab: about 5 flops for the softmax
    and the log (max, subtract, exp, add, log), plus log2(V) compare-swaps per element when top-p sorts."""
    import math

    tokens, vocab = case["batch"] * case["seq"], case["vocab"]
    per_element = 5 + (math.log2(vocab) if top_p_on(case.get("top_p", 1.0)) else 0)
    return tokens / world_size * vocab * per_element


def forward_logprob_cost(case: Case, world_size: int, pattern: str) -> Cost:
    """The forward problems' cost (chunked or not): the all-to-all moves (W-1)/W of the logits block
    and the all-gather (W-1)/W of the fp32 log-probs; HBM reads the block and writes the log-probs."""
    terms = logprob_cost_terms(case, world_size)
    moved = terms["logit_bytes"] + terms["tokens"] * 4
    return Cost(link_bytes=(world_size - 1) / world_size * moved, flops=logprob_flops(case, world_size),
                hbm_bytes=moved, pattern=pattern)


def logprob_cases(chunked: bool):
    """Tests (sizes 8 divides into odd shares) and NeMo-RL-sized benchmarks."""
    def chunk(params, size):
        return {**params, "chunk_size": size} if chunked else params

    tests = [
        Case("topk_and_topp", chunk({"batch": 2, "seq": 24, "vocab": 40, "top_k": 10, "top_p": 0.9}, 16),
             note="3 tokens and 5 vocab ids per rank at W=8"),
        Case("topp_only", chunk({"batch": 1, "seq": 16, "vocab": 24, "top_k": None, "top_p": 0.7}, 8)),
        Case("topk_only", chunk({"batch": 3, "seq": 8, "vocab": 64, "top_k": 5, "top_p": 1.0}, 8)),
        Case("no_filter", chunk({"batch": 1, "seq": 8, "vocab": 256, "top_k": None, "top_p": 1.0}, 16)),
    ]
    benchmarks = [
        Case("qwen25_7b_seq4096_topk50_topp095",
             chunk({"batch": 1, "seq": 4096, "vocab": 152064, "top_k": 50, "top_p": 0.95}, 1024)),
        Case("llama3_8b_b2_seq2048_topp09",
             chunk({"batch": 2, "seq": 2048, "vocab": 128256, "top_k": None, "top_p": 0.9}, 512)),
    ]
    return tests, benchmarks
