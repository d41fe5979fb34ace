"""The expert-parallel problems: cost() against hand-derived numbers, the routing and tie rules the
inputs promise, and the fp8 encoding. The router's inputs at hidden size 7168 (slow to draw) and the MoE
layer's reference against an independent dense implementation, run through the evaluator on CPU ranks:
tests/integration/test_expert_parallel_moe.py."""

from __future__ import annotations

import pytest
import torch

from pkb.problem import Case, make_generator
from pkb.problems.expert_parallel import _common, _fp8
from pkb.problems.expert_parallel.load_balancing_loss_fn import distinct_logits
from pkb.registry import get_problem


def cost_of(slug: str, case_name: str, world_size: int):
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case_name), world_size)


# -- cost(), one case per problem, numbers worked out by hand -------------------------------------------


def test_load_balancing_loss_cost():
    cost = cost_of("load_balancing_loss_fn", "mixtral_8x7b_seq4096", 8)
    assert cost.link_bytes == pytest.approx(2 * 7 / 8 * 4)          # one fp32 scalar all-reduced over 8 ranks
    assert cost.hbm_bytes == 32 * 4096 * 8 * 2                      # 32 layers x 4096 tokens x 8 logits, bf16


def test_moe_token_preprocess_cost():
    cost = cost_of("moe_token_preprocess", "deepseek_v3_ep8", 8)
    assert cost.link_bytes == 7 * 256 * 4                           # 7 other ranks' 256 fp32 counts
    assert cost.hbm_bytes == 256 * 8 * 4096 * 4                     # the [256, 8, 4096] fp32 mask


def test_all2all_primitive_cost_equal_and_skewed():
    cost = cost_of("moe_all2all_primitive", "deepseek_v3_dispatch_ep8", 8)
    assert cost.link_bytes == pytest.approx(7 / 8 * 32768 * 7168 * 2)
    assert cost.hbm_bytes == 2 * 32768 * 7168 * 2
    # Skewed at W=4 (9 rows of 17 bf16): rank 0 sends 9 rows to rank 3, rank 2 sends 9 to rank 3 and keeps 2,
    # rank 1 sends nothing, rank 3 keeps its 9. Rank 3 receives 18 remote rows: the busiest link.
    skewed = cost_of("moe_all2all_primitive", "skewed_one_sends_nothing_last_gets_all", 4)
    assert skewed.link_bytes == 18 * 17 * 2


def test_pre_all2all_cost():
    # Mixtral: 8 experts, top-2, one expert per rank at EP 8. A token misses a given other rank with
    # probability C(7,2)/C(8,2) = 21/28, so it reaches 7 * 7/28 = 1.75 other ranks on average.
    cost = cost_of("moe_pre_all2all", "mixtral_8x7b_ep8", 8)
    assert cost.link_bytes == pytest.approx(4096 * 4096 * 2 * 1.75)


def test_post_all2all_cost():
    # Qwen3-30B-A3B at EP 4: 128 experts, 32 per rank, top-8.
    miss = 1.0
    for i in range(8):
        miss *= (96 - i) / (128 - i)
    cost = cost_of("moe_post_all2all", "qwen3_30b_a3b_ep4", 4)
    assert cost.link_bytes == pytest.approx(4096 * 2048 * 2 * 3 * (1 - miss))
    assert cost.flops == 2 * 4096 * 8 * 2048


def test_lora_backward_cost():
    cost = cost_of("moe_epgroupgemm_lora_backward", "upstream_r8_h1024", 4)
    gradient_bytes = 3 * 8 * 1024 * 2                               # [8,1024] x 2 and [1024,8], bf16
    assert cost.link_bytes == pytest.approx(2 * 3 / 4 * gradient_bytes)


def test_fp8_reduce_scatter_cost():
    cost = cost_of("fp8_reduce_scatter_grads", "deepseek_v3_expert_bucket", 8)
    shard = 3 * 7168 * 2048 // 8                                    # 5,505,024 elements
    assert cost.link_bytes == pytest.approx(7 * shard * 1 + 7 * 4)  # 7 remote fp8 blocks + their senders' fp32 scales
    assert cost.hbm_bytes == (8 * shard + shard) * 2


def test_fp8_allgather_cost():
    cost = cost_of("fp8_allgather_params", "mixtral_8x7b_expert", 4)
    shard = 3 * 4096 * 14336 // 4
    assert cost.link_bytes == pytest.approx(3 * shard + 3 * 4)      # 3 remote fp8 shards + their fp32 scales
    assert cost.hbm_bytes == (shard + 4 * shard) * 2


def test_fused_moe_cost():
    cost = cost_of("fused_moe_fwd", "mixtral_8x7b_ep8_prefill", 8)
    assert cost.link_bytes == pytest.approx(2 * 4096 * 4096 * 2 * 1.75 + 7 * 8 * 8)
    router = 2 * 4096 * 4096 * 8
    experts = 4096 * 2 * 3 * 2 * 4096 * 14336                       # 8192 token-expert pairs, 3 GEMVs each
    combine = 2 * 4096 * 2 * 4096
    assert cost.flops == router + experts + combine
    mlp = 3 * 4096 * 14336 + 2 * 14336 + 4096                       # the rank's nn.Linear weights and biases
    assert cost.hbm_bytes == (mlp + 8 * 4097 + 2 * 4096 * 4096) * 2


def test_fused_moe_lora_cost_adds_the_adapters():
    lora = cost_of("fused_moe_fwd_lora", "mixtral_8x7b_ep8_lora16", 8)
    base = cost_of("fused_moe_fwd", "mixtral_8x7b_ep8_prefill", 8)
    per_pair = 2 * 16 * 4096 * 3 + 2 * 16 * 14336 * 3               # A and B of gate, up and down
    assert lora.flops - base.flops == 4096 * 2 * per_pair
    assert lora.hbm_bytes - base.hbm_bytes == (3 * 16 * 4096 + 3 * 16 * 14336) * 2


def test_balanced_wide_narrow_remote_ranks():
    # Balanced at W=4 (4 experts, top-2): a token misses another rank with probability C(3,2)/C(4,2) = 1/2.
    balanced = cost_of("moe_ep_balanced", "mixtral_8x7b_shape_4experts_ep4_prefill", 4)
    assert balanced.link_bytes == pytest.approx(2 * 4096 * 4096 * 2 * 3 * 0.5 + 3 * 4 * 8)
    # Wide at W=4 (8 experts, 2 per rank, top-2): misses with C(6,2)/C(8,2) = 15/28.
    wide = cost_of("moe_ep_wide", "mixtral_8x7b_ep4_prefill", 4)
    assert wide.link_bytes == pytest.approx(2 * 4096 * 4096 * 2 * 3 * 13 / 28 + 3 * 8 * 8)
    # Narrow at W=8 with 4 experts: EP groups of 4 ranks, one expert each, so the same as balanced at W=4.
    narrow = cost_of("moe_ep_narrow", "mixtral_shape_ep4_dp2_prefill", 8)
    assert narrow.link_bytes == pytest.approx(balanced.link_bytes)


# -- routing, split sizes and tie rules -----------------------------------------------------------------


def test_tokens_per_rank_example():
    case = Case("c", {"tokens": 11, "tokens_step": 4, "empty_rank": 1})
    assert _common.tokens_per_rank(case, 4) == [11, 0, 19, 23]


def test_split_sizes_agree_across_ranks_and_follow_the_routing():
    case = Case("c", {"tokens": 9, "tokens_step": 5, "empty_rank": 1, "experts": 8, "top_k": 3})
    world_size = 4
    per_rank = [_common.routed_case(case, r, world_size, make_generator(100 + r, 7)) for r in range(world_size)]
    for r, (tokens, selected, input_splits, output_splits, per_local) in enumerate(per_rank):
        assert output_splits == [per_rank[s][2][r] for s in range(world_size)]
        assert sum(input_splits) == tokens[r] * 3
        assert per_local.sum(1).tolist() == output_splits
        assert all(len(set(row.tolist())) == 3 for row in selected[r])  # distinct experts per token
    assert per_rank[1][2] == [0, 0, 0, 0]                             # the empty rank sends nothing


def test_skewed_routing_starves_rank0_and_floods_the_last_rank():
    selected = _common.draw_selected_experts(make_generator(0, 3).shared, [50, 50], 8, 2, 2, skew=True)
    counts = _common.token_counts(selected, 8)
    assert counts[:, :4].sum() == 0                                   # rank 0's experts get nothing
    assert counts[:, 4:].sum() == 2 * 50 * 2


def test_loss_logits_have_no_ties():
    logits = distinct_logits(make_generator(1, 2), 200, 16, torch.bfloat16)
    assert all(len(set(row.tolist())) == 16 for row in logits)
    assert torch.equal(logits.float() * 64, (logits.float() * 64).round())   # on the 1/64 grid: exact in bf16


def test_fp8_delayed_scaling_follows_the_upstream_recipe():
    history = torch.tensor([2.0, 0.5, 4.0], dtype=torch.bfloat16)
    x = torch.tensor([5.0, -9.0, 1.0], dtype=torch.bfloat16)
    updated = _fp8.updated_history(history, x)
    assert updated.tolist() == [0.5, 4.0, 9.0]                        # oldest out, this step's local amax last
    scale = _fp8.dequant_scale(updated)                               # the max includes this step's amax
    assert scale.item() == torch.tensor(9.0 / 448, dtype=torch.float32).item()
    codes = _fp8.encode(x, scale)
    assert codes.float().tolist() == [256.0, -448.0, 48.0]            # 248.9 and 49.8 rounded to e4m3
    assert _fp8.decode(codes, scale, torch.bfloat16).tolist() == [5.15625, -9.0, 0.96484375]
    tiny = _fp8.dequant_scale(torch.zeros(4, dtype=torch.bfloat16))  # an all-zero history: max clamped to 1e-12
    assert tiny.item() == (torch.tensor(1e-12, dtype=torch.bfloat16).float() / 448).item()


@pytest.mark.parametrize("slug", ["fp8_reduce_scatter_grads", "fp8_allgather_params"])
def test_fp8_scales_are_the_same_whether_a_device_divides_or_multiplies_by_the_reciprocal(slug):
    """A GPU computes `amax / 448` as `amax * fp32(1/448)`; the CPU rounds the quotient once. For about
    half of all bf16 amaxes the two differ by an ulp, enough to move an e4m3 code now and then (seen
    in shared-gpu mode: a GPU candidate against the CPU reference). Every amax that can set the
    scale, the history's and the planted largest |x|, is one where they agree."""
    recip = torch.tensor(1 / _fp8.FP8_MAX, dtype=torch.float32)
    agree = lambda v: bool(((v.double() / _fp8.FP8_MAX).float() == v * recip).all())  # noqa: E731
    amaxes = (torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 8).to(torch.bfloat16).float()
    assert not agree(amaxes)  # the knife edge is real for arbitrary amaxes
    problem = get_problem(slug)
    for case in problem.all_cases:
        for rank in range(2):
            values, history = problem.make_inputs(case, rank, 2, make_generator(rank, 7))
            if values.numel() > 2**22:
                continue  # the benchmark buckets: same code path, too big to draw in a unit test
            amax = values.float().abs().max().to(torch.bfloat16).float()
            assert agree(amax.reshape(1)) and agree(history.float()), case.name
            assert torch.equal(_fp8.settled(history.float()), history)  # settled values stay put
