"""MAGI-1 context-shuffle-overlap (CSO) attention: Ulysses-style all-to-alls over shuffled clip
shards, with the per-clip query/output all-to-alls overlapped with attention in the source (Sand AI
MAGI-1 DiT, ``cp_shuffle_num`` clips).

Layout: the token sequence is cp_shuffle_num = N clips of c = clip_token_nums tokens. Each clip is
padded to P = W*p tokens, p = ceil(c/W), and cut into W pieces: rank r holds piece r (tokens
[r*p, (r+1)*p) of the clip) of every clip, clip after clip. Padding tokens (clip position >= c) are
zero in the inputs and zero in the output. clip_token_nums None means c = P (no padding).
Per rank: query [N*p, Hq, D]; key_value [N*p, Hkv, 2D] (k then v on the last dim); k_ranges [N, 2]
int32, the same on every rank: clip i's queries attend keys [start, end) of the unpadded sequence
of N*c tokens (an empty range gives zeros)
  1. key_value all-to-all (scatter kv heads, gather tokens), padding dropped: K, V [N*c, Hkv/W, D].
  2. per clip i: query all-to-all (scatter q heads, gather tokens), padding dropped: [c, Hq/W, D];
     attention in fp32 (scale D^-1/2, GQA: local q head j reads local kv head j // (Hq/Hkv)) over
     keys k_ranges[i]; output padded to P and sent back by an all-to-all (scatter tokens, gather heads).
  ->  [N*p, Hq, D] bf16 in the query's layout.
The source overlaps clip i's all-to-alls with clip i-1's attention; the result is the same.

Cost per rank (bf16): all-to-alls of key_value, query and output: link (W-1)/W * N*p*(2*Hkv*D + 2*Hq*D)*2
bytes. Flops: sum over clips of 2 * c * |range_i| * (Hq/W) * 2D (random test ranges: expected length N*c/3).
HBM: read query and key_value, write the output.

Benchmarks (block-causal ranges, clip i sees clips 0..i, N=4): MAGI-1 24B (48 query heads, 8 kv heads,
head dim 128) with 21,600-token clips, and MAGI-1 4.5B (24 query heads, 8 kv heads) with 12,150-token clips.
"""

import torch

from pkb.problem import Case, Cost, Problem
from pkb.problems.context_parallel._common import (all_to_all, attention_flops, attention_fp32, ceil_div, dtype_of,
                                                   group_size, rand_normal)


def ranges_for(case, gen=None) -> list[list[int]]:
    N, c = case["clips"], case["clip_tokens"]
    kind = case["ranges"]
    if kind == "block_causal":
        return [[0, (i + 1) * c] for i in range(N)]
    if kind == "sliding":
        return [[max(0, (i - 1) * c), (i + 1) * c] for i in range(N)]
    ranges = torch.randint(0, N * c + 1, (N, 2), generator=gen.shared, device=gen.device).sort(dim=1).values
    empty = int(torch.randint(0, N, (1,), generator=gen.shared, device=gen.device))
    ranges[empty, 1] = ranges[empty, 0]  # one clip sees no key: its output is zero
    return ranges.tolist()


def make_inputs(case, rank, world_size, gen):
    N, c, D, dtype = case["clips"], case["clip_tokens"], case["head_dim"], dtype_of(case)
    p = ceil_div(c, world_size)
    query = rand_normal(gen, N, p, case["q_heads"], D, scale=2.0**0.5)
    key_value = rand_normal(gen, N, p, case["kv_heads"], 2 * D)
    key_value[..., :D] *= 2.0**0.5
    padding = torch.arange(rank * p, (rank + 1) * p, device=gen.device) >= c
    query[:, padding] = 0
    key_value[:, padding] = 0
    k_ranges = torch.tensor(ranges_for(case, gen), dtype=torch.int32, device=gen.device)
    clip = c if case.get("pass_clip", True) else None
    query = query.reshape(N * p, case["q_heads"], D).to(dtype)
    key_value = key_value.reshape(N * p, case["kv_heads"], 2 * D).to(dtype)
    return query, key_value, k_ranges, N, clip, None


def reference(query, key_value, k_ranges, cp_shuffle_num, clip_token_nums=None, group=None):
    world = group_size(group)
    N = cp_shuffle_num
    p = query.shape[0] // N
    c = world * p if clip_token_nums is None else clip_token_nums
    D = query.shape[-1]
    kv = all_to_all(key_value.view(N, p, *key_value.shape[1:]), scatter_dim=2, gather_dim=1, group=group)
    kv = kv[:, :c].reshape(N * c, -1, 2 * D)  # [N*c, Hkv/W, 2D], padding dropped
    keys, values = kv[..., :D], kv[..., D:]
    ranges = k_ranges.tolist()
    outputs = []
    for i, q_piece in enumerate(query.view(N, p, *query.shape[1:]).unbind(0)):
        q_clip = all_to_all(q_piece, scatter_dim=1, gather_dim=0, group=group)[:c]  # [c, Hq/W, D]
        start, end = ranges[i]
        out, _ = attention_fp32(q_clip.unsqueeze(0), keys[start:end].unsqueeze(0), values[start:end].unsqueeze(0),
                                D**-0.5)
        padded = torch.zeros(world * p, *out.shape[2:], dtype=query.dtype, device=query.device)
        padded[:c] = out[0].to(query.dtype)
        outputs.append(all_to_all(padded, scatter_dim=0, gather_dim=1, group=group))  # [p, Hq, D]
    return torch.cat(outputs, dim=0)


def cost(case, world_size):
    N, c, D, hq, hkv = case["clips"], case["clip_tokens"], case["head_dim"], case["q_heads"], case["kv_heads"]
    p = ceil_div(c, world_size)
    moved = N * p * (2 * hkv * D + 2 * hq * D) * 2
    if case["ranges"] == "random":
        pairs = N * c * (N * c / 3)
    else:
        pairs = sum(c * (end - start) for start, end in ranges_for(case))
    return Cost(link_bytes=(world_size - 1) / world_size * moved, flops=attention_flops(pairs, hq // world_size, D),
                hbm_bytes=float(moved), pattern="all_to_all (kv, then per clip q and output)")


TESTS = (
    Case("block_causal_padded", {"clips": 4, "clip_tokens": 13, "q_heads": 16, "kv_heads": 8, "head_dim": 8,
                                 "ranges": "block_causal", "dtype": "bfloat16"}),
    Case("random_ranges_three_clips", {"clips": 3, "clip_tokens": 10, "q_heads": 8, "kv_heads": 8, "head_dim": 16,
                                       "ranges": "random", "dtype": "bfloat16"}),
    Case("sliding_no_clip", {"clips": 2, "clip_tokens": 16, "q_heads": 24, "kv_heads": 8, "head_dim": 8,
                             "ranges": "sliding", "pass_clip": False, "dtype": "bfloat16"}),
)

BENCHMARKS = (
    Case("magi1_24b_4clips", {"clips": 4, "clip_tokens": 21600, "q_heads": 48, "kv_heads": 8, "head_dim": 128,
                              "ranges": "block_causal", "dtype": "bfloat16"}, note="MAGI-1 24B, 4 clips of 21,600"),
    Case("magi1_4p5b_4clips", {"clips": 4, "clip_tokens": 12150, "q_heads": 24, "kv_heads": 8, "head_dim": 128,
                               "ranges": "block_causal", "dtype": "bfloat16"}, note="MAGI-1 4.5B, 4 clips of 12,150"),
)

PROBLEM = Problem(
    name="magi1_cso_async_attention", version=1, upstream_id=77, category="context_parallel",
    source="MAGI-1 (Sand AI) DiT context-shuffle-overlap attention (cp_shuffle_num clips, Ulysses all-to-alls)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS, tolerance=None,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
