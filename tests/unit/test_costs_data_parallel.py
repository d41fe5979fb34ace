"""Cost models of the data-parallel problems against hand-derived numbers, and the pieces their
references share (shard split, cached sub-groups, Adam, the MLP backward, int8 rounding).

Each cost test writes the arithmetic out from the workload (bytes per element, shard sizes,
nccl-tests factors), not a call to the formula it checks.
"""

from __future__ import annotations

import pytest
import torch

from pkb.registry import get_problem
from pkb.problems.data_parallel import _common


def cost_of(slug: str, case_name: str, world_size: int, precision: str = "bf16"):
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case_name, precision), world_size)


# -- costs -------------------------------------------------------------------------------------------

def test_clip_grad_norm_no_ep_cost_llama3_8b_layer_w8():
    # 1/8 of the rows of each Llama-3-8B layer gradient: q, o 512x4096; k, v 128x4096; gate, up 1792x4096;
    # down 512x14336; two norms 512.
    local = 2 * 512 * 4096 + 2 * 128 * 4096 + 2 * 1792 * 4096 + 512 * 14336 + 2 * 512
    assert local == 218_112_000 // 8
    cost = cost_of("clip_grad_norm_no_ep", "llama3_8b_layer_fsdp", 8)
    assert cost.link_bytes == pytest.approx(2 * 7 / 8 * 4)  # one fp32 scalar all-reduced
    assert cost.flops == 3 * local
    assert cost.hbm_bytes == 3 * local * 2  # bf16: norm read + clip read and write


def test_clip_grad_norm_no_ep_cost_uneven_shards_w4():
    # ceil(37/4) = 10 rows of 19, ceil(5/4) = 2, ceil(3/4) = 1 row of 7x11 on rank 0 (the L1 case is another).
    cost = cost_of("clip_grad_norm_no_ep", "odd_shards_l2_clipped", 4)
    assert cost.flops == 3 * (10 * 19 + 2 + 77)


def test_clip_grad_norm_costs_of_the_upstream_cases_w4():
    # Three [1024, 1024] bf16 gradients on every rank (not sharded); EP: one dense and one expert tensor,
    # ep = 2 at W = 4, so the expert term is also rescaled (one more flop per expert element).
    no_ep = cost_of("clip_grad_norm_no_ep", "upstream", 4)
    assert no_ep.flops == 3 * 3 * 1024 * 1024 and no_ep.hbm_bytes == 3 * 3 * 1024 * 1024 * 2
    ep = cost_of("clip_grad_norm_ep", "upstream", 4)
    assert ep.flops == 3 * 2 * 1024 * 1024 + 1024 * 1024
    assert cost_of("clip_grad_norm_ep", "upstream", 2).flops == 3 * 2 * 1024 * 1024  # ep = 1: no rescale


def test_clip_grad_norm_ep_cost_qwen3_30b_w8():
    # W=8: ep 4 x ep_fsdp 2. Dense 1/8 rows: q 512x2048, k, v 64x2048, o 256x4096, router 16x2048,
    # norms 256, 256, 16, 16. Experts: 128/4 = 32 per EP rank, 16 per FSDP shard, 3 x 768 x 2048 each.
    dense = 512 * 2048 + 2 * 64 * 2048 + 256 * 4096 + 16 * 2048 + 256 + 256 + 16 + 16
    experts = 16 * 3 * 768 * 2048
    cost = cost_of("clip_grad_norm_ep", "qwen3_30b_a3b_moe_layer", 8)
    assert cost.link_bytes == pytest.approx(2 * 7 / 8 * 8)  # two fp32 partial terms in one all-reduce
    assert cost.flops == 3 * (dense + experts) + experts
    assert cost.hbm_bytes == 3 * (dense + experts) * 2


def test_grad_acc_loss_cost_w4():
    cost = cost_of("grad_acc_loss", "accum3_no_sum_grad", 4)
    assert cost.link_bytes == pytest.approx(2 * 3 / 4 * 4)  # one fp32 loss sum all-reduced


def test_importance_sampling_loss_cost_llama3_w2():
    cost = cost_of("importance_sampling_loss", "llama3_1_8b_grpo_4k_tokens", 2)
    assert cost.flops == 2 * 4096 * 128256 * 4096 + 4 * 4096 * 128256
    assert cost.link_bytes == pytest.approx(2 * 1 / 2 * (4 + 4 * 2 + 2 * 2))  # n fp32; SUM of 4 bf16, MAX of 2 bf16
    assert cost.hbm_bytes == 2 * 4096 * 4096 + 2 * 128256 * 4096 + 4096 * 16  # labels 8 B, 4 bf16 vectors


def test_ddp_cost_odd_mlp_w2():
    # 5 -> 13 -> 3 MLP: 65 + 13 + 39 + 3 = 120 parameters, fp32 in an fp32 run; 3 rows per rank.
    cost = cost_of("ddp", "odd_mlp_3_rows", 2, "fp32")
    assert cost.link_bytes == pytest.approx(3 * 120 * 4 + 2 * 1 / 2 * 120 * 4)  # 3 broadcasts + all-reduce
    assert cost.flops == 6 * 3 * (5 * 13 + 13 * 3) + 10 * 120
    assert cost.hbm_bytes == 4 * 3 * (5 + 3) + 4 * 120 + 7 * 4 * 120


def test_ddp_cost_upstream_w4():
    # 256 -> 512 -> 256: 131072 + 512 + 131072 + 256 = 262912 bf16 parameters; 1024 / 4 = 256 rows per rank.
    cost = cost_of("ddp", "upstream", 4)
    assert cost.link_bytes == pytest.approx(3 * 262912 * 2 + 2 * 3 / 4 * 262912 * 2)
    assert cost.flops == 6 * 256 * (256 * 512 + 512 * 256) + 10 * 262912
    assert cost.hbm_bytes == 2 * 256 * (256 + 256) + 2 * 262912 + 7 * 2 * 262912


def test_zero1_cost_odd_mlp_w4():
    # 120 parameters: 30 per rank.
    cost = cost_of("zero1_optimizer_shard", "odd_mlp_3_rows", 4, "fp32")
    # broadcast + all-reduce + all-gather
    assert cost.link_bytes == pytest.approx(120 * 4 + 2 * 3 / 4 * 120 * 4 + 3 / 4 * 120 * 4)
    assert cost.flops == 6 * 3 * 104 + 10 * 30
    assert cost.hbm_bytes == 96 + 480 + 28 * 30


def test_zero2_cost_odd_mlp_w4():
    cost = cost_of("zero2_optimizer_shard_grad", "odd_mlp_3_rows", 4, "fp32")
    # broadcast + reduce-scatter + all-gather
    assert cost.link_bytes == pytest.approx(120 * 4 + 3 / 4 * 120 * 4 + 3 / 4 * 120 * 4)


def test_fsdp_step_cost_odd_mlp_w8():
    # 120 parameters: 15 per rank.
    cost = cost_of("fsdp_step_e2e", "odd_mlp_3_rows", 8, "fp32")
    assert cost.link_bytes == pytest.approx(7 / 8 * 120 * 4 * 2)
    assert cost.flops == 6 * 3 * 104 + 12 * 15


def test_fused_adam_cost_llama3_70b_layer_w8():
    shard = 855_654_400 // 8
    cost = cost_of("fused_adam_grad_unshard_allgather", "llama3_70b_layer", 8, "fp32")
    assert cost.link_bytes == pytest.approx(7 / 8 * 855_654_400 * 4)  # fp32 parameters gathered
    assert cost.flops == 10 * shard
    # read the gradient, master and moments (fp32 in an fp32 run); write the gathered fp32 vector
    assert cost.hbm_bytes == 4 * 4 * shard + 4 * 855_654_400


def test_fused_adam_cost_upstream_bf16_w4():
    cost = cost_of("fused_adam_grad_unshard_allgather", "upstream", 4)
    assert cost.link_bytes == pytest.approx(3 / 4 * 4 * 4096 * 2)  # 4096 bf16 parameters from each rank
    assert cost.hbm_bytes == 4 * 2 * 4096 + 2 * 4 * 4096  # gradient, master and moments read, all bf16


def test_quantized_grad_allreduce_cost_w2():
    # 1000 elements in 8 blocks of 128: int8 codes + fp32 scales reduce-scattered, bf16 result gathered.
    cost = cost_of("quantized_grad_allreduce", "partial_last_block", 2)
    assert cost.link_bytes == pytest.approx(1 / 2 * (1000 + 8 * 4) + 1 / 2 * 1000 * 2)
    assert cost.hbm_bytes == 1000 * 2 * 2


def test_costs_follow_the_run_precision():
    # The gathered result is in the gradient's dtype: 4 bytes an element in fp32 against 2 in bf16; the
    # int8 codes and fp32 scales are the same in both. The SigLIP texts: 2 bytes in fp16, 4 in fp32.
    fp32 = cost_of("quantized_grad_allreduce", "partial_last_block", 2, "fp32")
    assert fp32.link_bytes == pytest.approx(1 / 2 * (1000 + 8 * 4) + 1 / 2 * 1000 * 4)
    fp16 = cost_of("openclip_contrastive_loss", "siglip_so400m_batch32k", 8, "fp16")
    assert fp16.link_bytes * 2 == pytest.approx(cost_of("openclip_contrastive_loss", "siglip_so400m_batch32k", 8,
                                                        "fp32").link_bytes)


def test_fsdp_and_tp_cost_llama3_8b_w8():
    # W=8 upstream layout: n_tp 2 x n_fsdp 4; 8192 / 4 = 2048 rows; TP-local FFN 14336 / 2 = 7168.
    cost = cost_of("fsdp_and_tp", "llama3_8b_mlp_8k_tokens", 8)
    weights = 3 * 4096 * 7168 * 2
    assert cost.link_bytes == pytest.approx(3 / 4 * weights + 2 * 1 / 2 * 2048 * 4096 * 2)
    assert cost.flops == 3 * 2 * 2048 * 4096 * 7168 + 5 * 2048 * 7168


def test_fsdp_and_tp_layouts():
    from pkb.problems.data_parallel.fsdp_and_tp import layout

    case = get_problem("fsdp_and_tp").find_case
    assert layout(case("upstream_layout_uneven_rows"), 2) == (1, 2)
    assert layout(case("upstream_layout_uneven_rows"), 8) == (2, 4)
    assert layout(case("all_tp"), 8) == (8, 1)
    assert layout(case("all_fsdp_empty_rows"), 4) == (1, 4)


def test_openclip_cost_so400m_w8():
    cost = cost_of("openclip_contrastive_loss", "siglip_so400m_batch32k", 8)
    assert cost.link_bytes == pytest.approx(7 / 8 * 32768 * 1152 * 2)  # the other ranks' bf16 texts
    assert cost.flops == 2 * 4096 * 32768 * 1152 + 6 * 4096 * 32768


def test_deepmd_cost_uneven_blocks_w2():
    cost = cost_of("deepmd_kalman_filter_optimizer", "uneven_blocks", 2)
    assert cost.link_bytes == pytest.approx(2 * 1 / 2 * 8 + 1 / 2 * 2 * 21 * 8)  # scalar + fp64 weights
    assert cost.flops == 5 * (49 + 9 + 121) + 6 * 21
    assert cost.hbm_bytes == 3 * 8 * (49 + 9 + 121)


def test_dinov2_cost_vitl14_w2():
    # rank 0 has the most rows, 4915; three iterations of 65536 fp32 row sums plus B and the total.
    cost = cost_of("dinov2_distributed_sinkhorn_knopp", "dinov2_vitl14_ibot_65536", 2)
    assert cost.link_bytes == pytest.approx(2 * 1 / 2 * (8 + 4 + 3 * 65536 * 4))
    assert cost.hbm_bytes == 5 * 4915 * 65536 * 4


# -- shared pieces -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 9, 37])
def test_chunk_rows_splits_like_torch_chunk(rows, world_size):
    expected = [len(c) for c in torch.arange(rows).chunk(world_size)] if rows else []
    expected += [0] * (world_size - len(expected))
    got = [_common.chunk_rows(rows, rank, world_size) for rank in range(world_size)]
    assert [length for _, length in got] == expected
    assert [start for start, _ in got] == [min(sum(expected[:r]), rows) for r in range(world_size)]


def test_mesh_partitions_put_the_inner_dimension_on_consecutive_ranks():
    inner, outer = _common.mesh_partitions(2, 4)
    assert inner == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert outer == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_subgroup_builds_each_partition_once(monkeypatch):
    made = []
    monkeypatch.setattr(_common, "_PARTITIONS", {})
    monkeypatch.setattr(_common.dist, "new_group", lambda ranks: made.append(tuple(ranks)) or f"group{ranks}")
    monkeypatch.setattr(_common.dist, "get_rank", lambda: 5)
    first = _common.subgroup([[0, 4], [1, 5], [2, 6], [3, 7]])
    again = _common.subgroup([[0, 4], [1, 5], [2, 6], [3, 7]])
    assert first == again == "group[1, 5]"
    assert made == [(0, 4), (1, 5), (2, 6), (3, 7)]  # every group, on every rank, once
    assert _common.subgroup([[5], [0, 1, 2, 3, 4, 6, 7]]) is None  # a one-rank group is no group


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_step_matches_torch_optim(weight_decay):
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(37, generator=gen)
    grad = torch.randn(37, generator=gen) * 1e-3
    exp_avg = torch.randn(37, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(37, generator=gen) * 1e-6
    step = 17
    ours = param.clone()
    ours_m, ours_v = exp_avg.clone(), exp_avg_sq.clone()
    _common.adam_step_(ours, grad, ours_m, ours_v, 1e-3, 0.9, 0.999, 1e-8, step, weight_decay=weight_decay)

    theirs = torch.nn.Parameter(param.clone())
    theirs.grad = grad.clone()
    kind = torch.optim.AdamW if weight_decay else torch.optim.Adam
    optimizer = kind([theirs], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, foreach=False)
    optimizer.state[theirs] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(),
                               "exp_avg_sq": exp_avg_sq.clone()}
    optimizer.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours_m, optimizer.state[theirs]["exp_avg"])
    torch.testing.assert_close(ours_v, optimizer.state[theirs]["exp_avg_sq"])
    assert not torch.equal(ours, param)


def test_mlp_grads_match_autograd():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    params = [p.requires_grad_() for p in _common.mlp_init(gen, "cpu", 5, 7, 3)]
    w1, b1, w2, b2 = params
    out = torch.nn.functional.relu(x @ w1.T + b1) @ w2.T + b2
    torch.nn.functional.mse_loss(out, y).backward()
    ours = _common.mlp_grads(x, y, *[p.detach() for p in params])
    for got, param in zip(ours, params):
        torch.testing.assert_close(got, param.grad)


def test_int8_quantization_rounds_half_to_even_and_keeps_zero_blocks():
    from pkb.problems.data_parallel.quantized_grad_allreduce import dequantized

    # block 1: absmax 127 so scale is 1: 62.5 -> 62, -0.5 -> -0, 3.5 -> 4. block 2 all zero. block 3 short.
    grad = torch.tensor([127.0, 62.5, -0.5, 3.5, 0.0, 0.0, 0.0, 0.0, 2.0], dtype=torch.bfloat16)
    got = dequantized(grad, 4)
    assert got.tolist() == [127.0, 62.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 2.0]
