"""MAGI-1 context-shuffle-overlap (CSO) attention: Ulysses-style all-to-alls over shuffled clip
shards, with the per-clip query/output all-to-alls overlapped with attention in the source (Sand AI
MAGI-1 DiT, ``cp_shuffle_num`` clips).

Layout: the token sequence is cp_shuffle_num = N clips of c = clip_token_nums tokens. Each clip is
padded to P = W*p tokens, p = ceil(c/W), and cut into W pieces: rank r holds piece r (tokens
[r*p, (r+1)*p) of the clip) of every clip, clip after clip. clip_token_nums None means c = P.
Per rank: query [N*p, Hq, D]; key_value [N*p, Hkv, 2D] (k then v on the last dim); k_ranges [N, 2]
int64, the same on every rank: clip i's queries attend keys [start, end) of the unpadded key sequence
of N*c tokens (an empty range gives zeros). query and key_value are bf16 in a bf16 or fp16 run and
fp32 in an fp32 run, as upstream's factory makes them (``attention_dtype``).
  1. key_value all-to-all (scatter kv heads, gather tokens; kv heads repeated up to W first when
     Hkv < W), padding keys dropped: K, V [N*c, max(Hkv, W)/W, D].
  2. per clip i: query all-to-all (scatter q heads, gather tokens): all P queries of the clip, padding
     positions included, [P, Hq/W, D]; SDPA in the inputs' dtype (scale D^-1/2, GQA: local q head j
     reads local kv head j // (local q heads / local kv heads)) over keys k_ranges[i]; the output goes
     back by an all-to-all (scatter tokens, gather heads).
  ->  [N*p, Hq, D] in the query's dtype and layout (padding queries get their attention output too).
The source overlaps clip i's all-to-alls with clip i-1's attention; the result is the same.

Cost per rank (b bytes an element: 2 in bf16): all-to-alls of key_value, query and output: link
(W-1)/W * N*p*(2*max(Hkv, W)*D + 2*Hq*D)*b bytes. Flops: sum over clips of 2 * P * |range_i| * (Hq/W)
* 2D (random test ranges: expected length N*c/3). HBM: read query and key_value, write the output.

Upstream cases: the benchmark's inputs, N = 4 clips, D = 128, 8 kv heads; 24 query heads and 12,150-token
clips at W <= 4, 48 and 21,600 at W = 8; clip i attends its own clip's keys. Benchmarks (block-causal
ranges, clip i sees clips 0..i, N=4): MAGI-1 24B (48 query heads, 8 kv heads, head dim 128) with
21,600-token clips, and MAGI-1 4.5B (24 query heads, 8 kv heads) with 12,150-token clips.
"""

import torch
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (all_to_all, attention_flops, ceil_div, dtype_of, group_size,
                                                   rand_normal)


def ranges_for(case, gen=None) -> list[list[int]]:
    N, c = case["clips"], case["clip_tokens"]
    kind = case["ranges"]
    if kind == "diagonal":
        return [[i * c, (i + 1) * c] for i in range(N)]
    if kind == "block_causal":
        return [[0, (i + 1) * c] for i in range(N)]
    if kind == "sliding":
        return [[max(0, (i - 1) * c), (i + 1) * c] for i in range(N)]
    ranges = torch.randint(0, N * c + 1, (N, 2), generator=gen.shared, device=gen.device).sort(dim=1).values
    empty = int(torch.randint(0, N, (1,), generator=gen.shared, device=gen.device))
    ranges[empty, 1] = ranges[empty, 0]  # one clip sees no key: its output is zero
    return ranges.tolist()


def attention_dtype(case) -> torch.dtype:
    """Upstream's factory makes query and key_value bf16 when the run is bf16 or fp16, fp32 when it is fp32."""
    return torch.bfloat16 if dtype_of(case) in (torch.float16, torch.bfloat16) else dtype_of(case)


def make_inputs(case, rank, world_size, gen):
    N, c, D, dtype = case["clips"], case["clip_tokens"], case["head_dim"], attention_dtype(case)
    p = ceil_div(c, world_size)
    query = rand_normal(gen, N * p, case["q_heads"], D, dtype=dtype, scale=2.0**0.5)
    key_value = rand_normal(gen, N * p, case["kv_heads"], 2 * D)
    key_value[..., :D] *= 2.0**0.5
    k_ranges = torch.tensor(ranges_for(case, gen), dtype=torch.int64, device=gen.device)
    clip = c if case.get("pass_clip", True) else None
    return query, key_value.to(dtype), k_ranges, N, clip, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: query [4p, Hq, 128], then k and v [4p, 8, 128] (concatenated on the last dim), N(0, 1) in
    ``attention_dtype``; k_ranges clip i's own keys [i*c, (i+1)*c); 4 clips of c tokens."""
    N, c, D, dtype = case["clips"], case["clip_tokens"], case["head_dim"], attention_dtype(case)
    tokens = N * ceil_div(c, world_size)
    query = torch.randn((tokens, case["q_heads"], D), dtype=dtype, device=device)
    key = torch.randn((tokens, case["kv_heads"], D), dtype=dtype, device=device)
    key_value = torch.cat([key, torch.randn_like(key)], dim=-1)
    starts = torch.arange(N, dtype=torch.long, device=device) * c
    k_ranges = torch.stack([starts, starts + c], dim=1)
    return query, key_value, k_ranges, N, c, None


def clip_attention(q, k, v):
    """SDPA of q [Sq, Hq, D] over k, v [Sk, Hkv, D] in the input dtype (GQA by repeating kv heads)."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, S, D]
    if kh.shape[1] < qh.shape[1]:
        kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1)
        vh = vh.repeat_interleave(qh.shape[1] // vh.shape[1], dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh)[0].transpose(0, 1)


def reference(query, key_value, k_ranges, cp_shuffle_num, clip_token_nums=None, group=None):
    world = group_size(group)
    N = cp_shuffle_num
    p = query.shape[0] // N
    c = int(clip_token_nums or world * p)
    D = query.shape[-1]
    if key_value.shape[1] < world and world % key_value.shape[1] == 0:
        key_value = key_value.repeat_interleave(world // key_value.shape[1], dim=1)
    kv = all_to_all(key_value.view(N, p, *key_value.shape[1:]), scatter_dim=2, gather_dim=1, group=group)
    kv = kv[:, :c].reshape(N * c, -1, kv.shape[-1])  # [N*c, Hkv/W, 2D], padding keys dropped
    keys, values = kv[..., :D], kv[..., D:]
    ranges = k_ranges.tolist()
    outputs = []
    for i, q_piece in enumerate(query.view(N, p, *query.shape[1:]).unbind(0)):
        q_clip = all_to_all(q_piece, scatter_dim=1, gather_dim=0, group=group)  # [W*p, Hq/W, D]
        start, end = ranges[i]
        out = clip_attention(q_clip, keys[start:end], values[start:end])
        outputs.append(all_to_all(out, scatter_dim=0, gather_dim=1, group=group))  # [p, Hq, D]
    return torch.cat(outputs, dim=0)


def cost(case, world_size):
    N, c, D, hq, hkv = case["clips"], case["clip_tokens"], case["head_dim"], case["q_heads"], case["kv_heads"]
    p = ceil_div(c, world_size)
    moved = N * p * (2 * max(hkv, world_size) * D + 2 * hq * D) * attention_dtype(case).itemsize
    if case["ranges"] == "random":
        pairs = N * world_size * p * (N * c / 3)
    else:
        pairs = sum(world_size * p * (end - start) for start, end in ranges_for(case))
    return Cost(link_bytes=(world_size - 1) / world_size * moved, flops=attention_flops(pairs, hq // world_size, D),
                hbm_bytes=float(moved), pattern="all_to_all (kv, then per clip q and output)")


def upstream_case(world_size: int) -> Case:
    q_heads, clip_tokens = (24, 12150) if world_size <= 4 else (48, 21600)
    params = {"clips": 4, "clip_tokens": clip_tokens, "q_heads": q_heads, "kv_heads": 8, "head_dim": 128,
              "ranges": "diagonal"}
    return Case(f"upstream_w{world_size}", params, world_sizes=(world_size,), slow_on_cpu=True,  # ~1 min per head-clip
                note=f"the upstream benchmark's inputs at W={world_size}: 4 clips of {clip_tokens:,}, {q_heads} q heads")


UPSTREAM = tuple(upstream_case(w) for w in (2, 4, 8))

TESTS = (
    Case("block_causal_padded", {"clips": 4, "clip_tokens": 13, "q_heads": 16, "kv_heads": 8, "head_dim": 8,
                                 "ranges": "block_causal"}, tags=("argument_value", "odd_sizes")),
    Case("random_ranges_three_clips", {"clips": 3, "clip_tokens": 10, "q_heads": 8, "kv_heads": 8, "head_dim": 16,
                                       "ranges": "random"}, tags=("argument_value", "odd_sizes")),
    Case("sliding_no_clip", {"clips": 2, "clip_tokens": 16, "q_heads": 24, "kv_heads": 8, "head_dim": 8,
                             "ranges": "sliding", "pass_clip": False}, tags=("argument_value",)),
    Case("diagonal_two_kv_heads", {"clips": 3, "clip_tokens": 11, "q_heads": 8, "kv_heads": 2, "head_dim": 8,
                                   "ranges": "diagonal"}, tags=("shape_regime", "argument_value", "odd_sizes")),
)

BENCHMARKS = (
    Case("magi1_24b_4clips", {"clips": 4, "clip_tokens": 21600, "q_heads": 48, "kv_heads": 8, "head_dim": 128,
                              "ranges": "block_causal"}, note="MAGI-1 24B, 4 clips of 21,600"),
    Case("magi1_4p5b_4clips", {"clips": 4, "clip_tokens": 12150, "q_heads": 24, "kv_heads": 8, "head_dim": 128,
                               "ranges": "block_causal"}, note="MAGI-1 4.5B, 4 clips of 12,150"),
)

PROBLEM = Problem(
    name="magi1_cso_async_attention", version=3, upstream_id=77, category="context_parallel",
    source="MAGI-1 (Sand AI) DiT context-shuffle-overlap attention (cp_shuffle_num clips, Ulysses all-to-alls)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, upstream=UPSTREAM, tolerance=None,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
