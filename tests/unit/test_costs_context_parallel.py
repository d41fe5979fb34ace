"""Cost models of the context-parallel problems against hand-derived numbers, and the math helpers
their references rest on (chunked delta rule, attention backward, zigzag order, variable lengths)."""

from __future__ import annotations

import math

import pytest
import torch

from pkb.problem import make_generator
from pkb.problems.context_parallel import _common as cp
from pkb.registry import get_problem


def cost_of(slug: str, case_name: str, world_size: int):
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case_name), world_size)


# Each row: problem, case, W, link bytes, flops (None: not checked) -- arithmetic written out by hand.
COSTS = [
    # local [24, 40/4] bf16 = 480 B; all-to-all keeps 1/4
    ("ulysses_all_to_all_tensor_primitive", "rows_to_cols", 4, 3 / 4 * 24 * 10 * 2, None),
    # 5 x 33 bf16 = 330 B; receive the 3 other shards
    ("ulysses_all_gather_into_tensor_primitive", "odd_rows", 4, 3 * 330, None),
    # mean 6.5 rows of 4 bf16 = 52 B per shard, plus an 8-byte size from each of 3 peers
    ("ulysses_all_gather_variable_primitive", "last_dim", 4, 3 * (52 + 8), None),
    # [2, ceil(29/4)=8, 8, 5] bf16 = 1280 B
    ("ulysses_gather_seq_scatter_heads", "padded_seq", 4, 3 / 4 * 1280, None),
    # padded [2, 32, 8/4, 5] bf16 = 1280 B
    ("ulysses_gather_heads_scatter_seq", "padded_seq", 4, 3 / 4 * 1280, None),
    # [2, 8, 3*40] bf16 = 3840 B
    ("ulysses_gather_seq_scatter_heads_qkv", "padded_seq", 4, 3 / 4 * 3840, None),
    # q,k,v,out of [2, 6, 64] bf16 = 4 * 1536 B; qkv GEMM 2*12*64*192 + attention over the 2 local heads of
    # each of the 2*24 tokens, causal: 3 head pairs * 2*(8+8) + out GEMM 2*12*64*64
    ("ulysses_attention_e2e", "causal_h8", 4, 3 / 4 * 6144, 294912 + 48 * 3 * 32 + 98304),
    # 3 ring steps of k+v [2, 6, 4, 8] bf16 = 1536 B; last rank: 3 full 6x6 blocks + 21 diagonal pairs, B=2,
    # 4 heads, 2*(8+8) flops a pair
    ("ring_attention", "causal_mha", 4, 3 * 1536, 2 * (3 * 36 + 21) * 4 * 32),
    # cp=2: one k+v block [2,12,16] x2 bf16 = 1536 B; tp all-reduce 2*(1/2)*[2,12,32] bf16 = 1536 B
    # flops: qkv 2*24*32*48, attention 444 pairs * 2 heads * 32, out 2*24*16*32
    ("ring_attention_tp", "causal_h4", 4, 1536 + 1536, 73728 + 444 * 2 * 32 + 24576),
    # one stage per rank (back-to-back calls overlap the stages): its k+v block (2*1536 B) plus the 1536-B
    # hand-off; one stage's flops
    ("ring_attention_pp", "causal_h4", 4, 2 * 1536 + 1536, 147456 + 444 * 4 * 32 + 49152),
    # kv ring 1536 el * 2 B, dkv ring 2 steps * 1536 el * 4 B, dp all-reduce (768 + 1536) el * 2 B;
    # 444 pairs * 4 heads * 5 matmuls * 2*8
    ("ring_attention_backward_dp", "causal_mha", 4, 3072 + 12288 + 4608, 444 * 4 * 5 * 16),
    # two halos of 5 channels x 6 tokens bf16; 2 flops * 5 ch * 24 tokens * 7 taps
    ("hyena_conv1d_boundary_exchange", "k7_short_chunks", 4, 2 * 5 * 6 * 2, 2 * 5 * 24 * 7),
    # four all-to-alls of [1, 16, 12] bf16 = 384 B; 3 FFTs of 96 points on 4 channels + 6 flops x 4 ch x 48
    ("hyena_forward_cp", "zigzag_grouped", 4, 4 * 3 / 4 * 384, 3 * 2.5 * 96 * math.log2(96) * 4 + 6 * 4 * 48),
    # cp=2: one shard of [2,20,2,(8+8+16+8+1)] bf16 = 6560 B; tp all-reduce of [2,20,2,16] bf16 = 2560 B
    # delta rule: 2*(3*8*16 + 64*(16+32)) = 6912 a token and head, 40 tokens, 2 heads, batch 2
    ("fla_kimi_delta_attention_cp_tp", "k8_v16_b2", 4, 6560 + 2560, 6912 * 40 * 2 * 2),
    # [2,20,6,(16+16+8+1+1)] in + [2,20,6,8] out bf16 = 24000 B; 3 local heads, 40 tokens, batch 2
    ("fla_gated_deltanet_cp", "k16_b2_short", 2, 1 / 2 * 24000, 6912 * 40 * 3 * 2),
    # p=4 tokens of 4 clips: kv 8 heads x 16 + q and out 16 heads x 8 each, bf16; all 16 (padded) queries per
    # clip see 13, 26, 39, 52 keys with 4 local heads, 2*(8+8) flops a pair
    ("magi1_cso_async_attention", "block_causal_padded", 4, 3 / 4 * 16 * (128 + 256) * 2, 16 * 130 * 4 * 32),
]


@pytest.mark.parametrize(("slug", "case_name", "world_size", "link_bytes", "flops"), COSTS, ids=lambda v: str(v))
def test_cost_matches_the_hand_derivation(slug, case_name, world_size, link_bytes, flops):
    cost = cost_of(slug, case_name, world_size)
    assert cost.link_bytes == pytest.approx(link_bytes)
    if flops is not None:
        assert cost.flops == pytest.approx(flops)
    assert cost.hbm_bytes > 0


def test_every_context_parallel_problem_has_a_cost_row():
    from pkb.registry import all_problems

    slugs = {p.name for p in all_problems().values() if p.category == "context_parallel"}
    assert slugs == {row[0] for row in COSTS}


def test_chunked_delta_rule_matches_the_token_by_token_recurrence():
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 75, 3, 8, 5  # crosses two chunk boundaries at chunk 32
    q = cp.l2_normalize(torch.randn(B, T, H, K, generator=gen))
    k = cp.l2_normalize(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    log_decay = -torch.rand(B, T, H, K, generator=gen)  # per-channel gates (KDA)
    beta = torch.rand(B, T, H, generator=gen)
    chunked = cp.delta_rule_chunked(q, k, v, log_decay, beta, K**-0.5, chunk_size=32)
    recurrent = cp.delta_rule_recurrent(q, k, v, log_decay, beta, K**-0.5)
    assert torch.allclose(chunked, recurrent, atol=1e-5, rtol=1e-4)
    assert recurrent.abs().max() > 0.1


def test_attention_backward_matches_autograd_with_gqa_causal_offsets():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 5, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 7, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 7, 2, 8, generator=gen, requires_grad=True)
    dout = torch.randn(1, 5, 4, 8, generator=gen)
    scale, q_start, k_start = 0.4, 6, 2  # query i (global 6+i) sees keys j with 2+j <= 6+i
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * scale
    mask = (torch.arange(7)[None, :] + k_start) > (torch.arange(5)[:, None] + q_start)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(2, 2))
    out.backward(dout)
    delta = (dout * out.detach()).sum(-1).transpose(1, 2)
    dq, dk, dv = cp.attention_backward_fp32(dout, q.detach(), k.detach(), v.detach(), delta,
                                            scores.logsumexp(-1).detach(), scale, True, q_start, k_start)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(mine, theirs, atol=1e-5)
    forward, lse = cp.attention_fp32(q.detach(), k.detach(), v.detach(), scale, True, q_start, k_start)
    assert torch.allclose(forward, out.detach(), atol=1e-5)
    assert torch.allclose(lse, scores.logsumexp(-1).detach(), atol=1e-5)


def test_lse_merge_of_two_key_halves_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=gen) for _ in range(3))
    whole, whole_lse = cp.attention_fp32(q, k, v, 0.3)
    first = cp.attention_fp32(q, k[:, :1], v[:, :1], 0.3)
    second = cp.attention_fp32(q, k[:, 1:], v[:, 1:], 0.3)
    merged, merged_lse = cp.merge_attention(*first, *second)
    assert torch.allclose(merged, whole, atol=1e-6) and torch.allclose(merged_lse, whole_lse, atol=1e-6)


def test_zigzag_order_puts_chunks_back_in_sequence_order():
    from pkb.problems.context_parallel.hyena_forward_cp import zigzag_to_natural

    # W=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; gathered order [0, 3, 1, 2]
    assert zigzag_to_natural(2) == [0, 2, 3, 1]
    gathered = [0, 7, 1, 6, 2, 5, 3, 4]  # W=4, chunk ids in rank order
    assert [gathered[i] for i in zigzag_to_natural(4)] == list(range(8))


def test_variable_gather_lengths_include_an_empty_and_a_full_shard():
    problem = get_problem("ulysses_all_gather_variable_primitive")
    case = problem.find_case("rows_with_empty")
    for seed in range(5):
        lengths = [problem.make_inputs(case, r, 4, make_generator(seed * 10 + r, seed))[0].shape[0] for r in range(4)]
        assert 0 in lengths and case["max_len"] in lengths


def test_magi_random_ranges_have_one_empty_clip_within_bounds():
    from pkb.problems.context_parallel.magi1_cso_async_attention import ranges_for

    case = get_problem("magi1_cso_async_attention").find_case("random_ranges_three_clips")
    ranges = ranges_for(case, make_generator(1, 2))
    total = case["clips"] * case["clip_tokens"]
    assert all(0 <= start <= end <= total for start, end in ranges)
    assert any(start == end for start, end in ranges)
