"""Shared by the NeMo-RL vocab-parallel log-prob problems (upstream 82, 83, 84).

Layout (as upstream): the B*S tokens are taken flat, in (batch, sequence) order. The vocab-parallel
logits [T, V/W] (one chunk of T tokens; the whole batch when unchunked) are re-sharded by token with
an all-to-all: rank r gets the T/W tokens r*T/W ... over the whole vocabulary (the ranks' vocab
blocks concatenated in rank order). T must divide by W; the chunked problems take chunks of
B*chunk_size flat tokens (the last may be shorter), and B*chunk_size must divide by W too.

Filtering, per token row over the whole vocabulary, in the logits' dtype (the run's precision; bf16
by default, the case the roundings below describe), as upstream (vLLM's ``apply_top_k_top_p``, which
NeMo-RL reuses):
  top-k (top_k None or <= 0: off; min(top_k, V)): keep every logit >= the k-th largest (ties kept).
  top-p (top_p None or >= 1: off): sort ascending (with top-k also on, the positions below the k-th
      largest are set to -inf first), softmax and cumulative sum IN THE LOGITS' DTYPE (each
      probability and each partial sum rounded to bf16), keep the positions whose cumulative sum is
      > 1 - top_p (that threshold rounded to bf16 too, as torch compares a bf16 tensor with a
      Python float), and always the last (largest) one.
  log-prob of the target = log_softmax(fp32 of the kept logits)[target]; -inf when it was dropped.
The sort is stable here (among equal logits the lower vocab id comes first); upstream's is not, so
the inputs never put a tie across the cut.

Inputs: the whole [B*S, V] logits are drawn from the shared generator and each rank keeps its own
vocab block (so every shard differs per rank). That lets make_inputs redraw the rows whose result
would hang on rounding: a top-k with a tie at the k-th value, a top-p cut with a cumulative sum
within ``top_p_margin`` of 1 - top_p (room for the bf16 roundings above, or their absence in a
kernel that sums in fp32), or a tie straddling the cut. A row still ambiguous after 16 redraws is
kept; when more than half the rows are ambiguous at the first draw (benchmark-sized vocabularies,
whose tail tokens are far denser than the margin), none is redrawn: benchmarks are timed, not
checked. Targets are the sampled tokens of RL: three in four drawn from the filtered distribution,
the rest uniform (and so often filtered out: -inf).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost
from pkb.problems.tensor_parallel._common import all_gather_cat, dtype_of, upstream_targets

MAX_REDRAWS = 16
LOGIT_SCALE = 2.0


def top_k_on(top_k) -> bool:
    return top_k is not None and top_k > 0


def top_p_on(top_p) -> bool:
    return top_p is not None and top_p < 1.0


def top_p_margin(top_p: float) -> float:
    """How far every cumulative sum must stay from 1 - top_p: 1e-3 plus 2^-6 of it (about 2.5 times
    the three bf16 roundings of 2^-9 each: the probabilities, the partial sums, the threshold)."""
    return 1e-3 + (1.0 - top_p) * 2.0**-6


def filter_top_k_top_p(x: torch.Tensor, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [N, V] with the filtered positions set to -inf (same dtype) and the keep mask [N, V]
    (None when nothing filters). The rules are in the module docstring."""
    need_k, need_p = top_k_on(top_k), top_p_on(top_p)
    if not (need_k or need_p):
        return x, None
    vocab = x.shape[-1]
    if not need_p:
        kth = x.topk(min(int(top_k), vocab), dim=-1).values[..., -1:]
        keep = x >= kth
        return x.masked_fill(~keep, float("-inf")), keep
    sorted_x, order = x.sort(dim=-1, stable=True)  # ascending
    keep_sorted = torch.ones_like(sorted_x, dtype=torch.bool)
    if need_k:
        first = vocab - min(int(top_k), vocab)
        keep_sorted = sorted_x >= sorted_x[..., first:first + 1]
        sorted_x = sorted_x.masked_fill(~keep_sorted, float("-inf"))
    cumulative = sorted_x.softmax(-1).cumsum(-1)  # in x's dtype, as upstream
    above = cumulative > 1 - top_p
    above[..., -1] = True
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted & above)
    return x.masked_fill(~keep, float("-inf")), keep


def _ambiguous_rows(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Rows [N, V] (fp32 of the bf16 inputs) whose filtering a rounding or a tie order could change."""
    bad = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    x = logits
    if top_k_on(top_k) and top_k < x.shape[-1]:
        top = x.topk(top_k + 1, dim=-1).values
        bad |= top[:, -1] == top[:, -2]
        x = x.masked_fill(x < top[:, -2:-1], float("-inf"))
    if top_p_on(top_p):
        sorted_x = x.double().sort(dim=-1, stable=True).values
        cumulative = sorted_x.softmax(-1).cumsum(-1)
        bad |= ((cumulative[:, :-1] - (1 - top_p)).abs() < top_p_margin(top_p)).any(-1)
        num_dropped = (cumulative[:, :-1] <= 1 - top_p).sum(-1)
        last_dropped = sorted_x.gather(-1, (num_dropped - 1).clamp_min(0)[:, None]).squeeze(-1)
        first_kept = sorted_x.gather(-1, num_dropped[:, None]).squeeze(-1)
        bad |= (num_dropped > 0) & (last_dropped == first_kept) & torch.isfinite(last_dropped)
    return bad


def make_logprob_inputs(case: Case, rank: int, world_size: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits block [B, S, V/W] (the run's dtype) and the shared targets [B, S] (int64)."""
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
    probs = filter_top_k_top_p(logits.to(dtype), top_k, top_p)[0].float().softmax(-1)
    sampled = torch.multinomial(probs, 1, generator=shared).squeeze(-1)
    uniform = torch.randint(0, vocab, (b * s,), generator=shared, device=shared.device)
    from_policy = torch.rand(b * s, generator=shared, device=shared.device) < 0.75
    target = torch.where(from_policy, sampled, uniform).view(b, s)
    vocab_local = vocab // world_size
    block = logits.view(b, s, vocab)[..., rank * vocab_local:(rank + 1) * vocab_local]
    return block.to(dtype).contiguous(), target


def upstream_logprob_inputs(case: Case, rank: int, world_size: int, trial: int, device,
                            step: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's logits and targets for 82-84 (after its seed): logits [B, S, V/W] N(0, 1), targets fixed
    (``_common.upstream_targets`` with the problem's ``step`` and ``offset``), 8 added to each target's logit."""
    b, s, vocab = case["batch"], case["seq"], case["vocab"]
    vocab_local, dtype = vocab // world_size, dtype_of(case)
    logits = torch.randn((b, s, vocab_local), dtype=dtype, device=device)
    target = upstream_targets(b, s, vocab, step, offset, trial, device)
    global_vocab = rank * vocab_local + torch.arange(vocab_local, dtype=torch.long, device=device)
    target_mask = global_vocab.view(1, 1, vocab_local) == target.unsqueeze(-1)
    return logits + target_mask.to(dtype=dtype) * 8.0, target


def token_chunks(num_tokens: int, chunk_tokens: int, world_size: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of the flat tokens (the last may be shorter); raises, as upstream,
    when the tokens or a chunk do not divide by W."""
    if num_tokens % world_size or chunk_tokens % world_size:
        raise ValueError(f"B*S={num_tokens} and the chunk's B*chunk_size={chunk_tokens} must divide by W={world_size}")
    return [(start, min(num_tokens, start + chunk_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def chunk_tokens_of(batch: int, seq: int, chunk_size) -> int:
    """Flat tokens per chunk: B*chunk_size (chunk_size at least 1), or B*S when unchunked (None)."""
    return batch * (seq if chunk_size is None else max(1, int(chunk_size)))


def vocab_to_token_parallel(logits_local: torch.Tensor, group=None) -> torch.Tensor:
    """[T, V/W] vocab shards -> [T/W, V]: this rank's block of tokens over the whole vocab (all-to-all)."""
    world_size = dist.get_world_size(group)
    tokens, vocab_local = logits_local.shape
    send = logits_local.contiguous()  # row block d (tokens d*T/W ...) goes to rank d
    recv = torch.empty_like(send)     # [W (source rank = vocab block) * T/W, V/W]
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(world_size, tokens // world_size, vocab_local).transpose(0, 1).reshape(
        tokens // world_size, world_size * vocab_local)


def token_to_vocab_parallel(full: torch.Tensor, group=None) -> torch.Tensor:
    """[T/W, V] -> [T, V/W]: the inverse all-to-all of ``vocab_to_token_parallel``."""
    world_size = dist.get_world_size(group)
    tokens_local, vocab = full.shape
    send = full.view(tokens_local, world_size, vocab // world_size).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # [W (source rank = token block), T/W, V/W]
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(world_size * tokens_local, vocab // world_size)


def my_tokens(flat: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of a chunk's flat tokens [T, ...] -> [T/W, ...]."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = flat.shape[0] // world_size
    return flat[rank * per_rank:(rank + 1) * per_rank]


def chunk_log_probs(logits_local, target, group, top_k, top_p) -> torch.Tensor:
    """Log-probs [T] fp32 of ``target`` [T] for one chunk of flat tokens [T, V/W] (every rank gets all)."""
    filtered, _ = filter_top_k_top_p(vocab_to_token_parallel(logits_local, group), top_k, top_p)  # [T/W, V]
    log_probs = filtered.float().log_softmax(-1)
    picked = log_probs.gather(-1, my_tokens(target, group)[:, None]).squeeze(-1)  # [T/W]
    return all_gather_cat(picked.contiguous(), dim=0, group=group)


def chunk_grad(logits_local, target, grad_output, group, top_k, top_p) -> torch.Tensor:
    """d(sum grad_output * log-prob)/d logits_local [T, V/W] fp32 for one chunk of flat tokens.

    For a kept position j: g * (1[j == target] - p_j), p the softmax over the kept logits; 0 at the
    filtered positions (the target included when it was filtered).
    """
    filtered, keep = filter_top_k_top_p(vocab_to_token_parallel(logits_local, group), top_k, top_p)
    probs = filtered.float().softmax(-1)  # [T/W, V]
    chosen = torch.zeros_like(probs).scatter_(-1, my_tokens(target, group)[:, None], 1.0)
    grad = (chosen - probs) * my_tokens(grad_output, group).float()[:, None]
    if keep is not None:
        grad = grad * keep
    return token_to_vocab_parallel(grad, group)


def logprob_cost_terms(case: Case, world_size: int) -> dict:
    """Sizes for the cost model: tokens, vocab shard, bytes of one logits block and of the log-probs."""
    tokens, vocab = case["batch"] * case["seq"], case["vocab"]
    return {"tokens": tokens, "vocab": vocab, "logit_bytes": tokens * vocab / world_size * dtype_of(case).itemsize}


def logprob_flops(case: Case, world_size: int) -> float:
    """Per rank, per token of its block over the whole vocab: about 5 flops for the softmax and the
    log (max, subtract, exp, add, log), plus log2(V) compare-swaps per element when top-p sorts."""
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


UPSTREAM_PARAMS = {"batch": 2, "seq": 8, "vocab": 256, "top_k": 10, "top_p": 0.9}


def logprob_cases(chunked: bool):
    """The upstream factory's case(s), tests (sizes 8 divides into odd shares) and NeMo-RL-sized
    benchmarks. Upstream's chunk_size is W (B = 2, S = 8), so the chunked problems have one
    upstream case per world size."""
    def chunk(params, size):
        return {**params, "chunk_size": size} if chunked else params

    if chunked:
        upstream = [Case(f"upstream_w{w}", chunk(UPSTREAM_PARAMS, w), world_sizes=(w,),
                         note=f"the upstream factory at W={w}: logits [2, 8, 256/W], top-k 10, "
                              f"top-p 0.9, chunk_size {w}") for w in (2, 4, 8)]
    else:
        upstream = [Case("upstream", UPSTREAM_PARAMS,
                         note="the upstream factory: logits [2, 8, 256/W], top-k 10, top-p 0.9")]

    def tags(*names):  # every chunked test passes a chunk_size other than upstream's (W)
        return names + (("argument_value",) if chunked and "argument_value" not in names else ())

    tests = [
        Case("topk_and_topp", chunk({"batch": 2, "seq": 24, "vocab": 40, "top_k": 10, "top_p": 0.9}, 16),
             note="6 tokens and 5 vocab ids per rank at W=8", tags=tags("odd_sizes")),
        Case("topp_only", chunk({"batch": 1, "seq": 16, "vocab": 24, "top_k": None, "top_p": 0.7}, 8),
             tags=tags("argument_value", "odd_sizes")),
        Case("topk_only", chunk({"batch": 3, "seq": 8, "vocab": 64, "top_k": 5, "top_p": 1.0}, 8),
             tags=tags("argument_value", "odd_sizes")),
        Case("no_filter", chunk({"batch": 1, "seq": 8, "vocab": 256, "top_k": None, "top_p": 1.0}, 16),
             tags=tags("argument_value")),
        Case("tokens_across_rows", chunk({"batch": 4, "seq": 6, "vocab": 32, "top_k": 6, "top_p": 0.85}, 4),
             note="S = 6 does not divide by 4 or 8, B*S = 24 does: a rank's tokens span two rows",
             tags=tags("odd_sizes", "argument_value")),
    ]
    benchmarks = [
        Case("qwen25_7b_seq4096_topk50_topp095",
             chunk({"batch": 1, "seq": 4096, "vocab": 152064, "top_k": 50, "top_p": 0.95}, 1024)),
        Case("llama3_8b_b2_seq2048_topp09",
             chunk({"batch": 2, "seq": 2048, "vocab": 128256, "top_k": None, "top_p": 0.9}, 512)),
    ]
    return upstream, tests, benchmarks
