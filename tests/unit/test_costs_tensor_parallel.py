"""Cost models of the tensor-parallel problems against hand-derived numbers, and the behaviour the
references promise (tie rules, fp8 rounding, gradients), checked on a one-rank gloo group.

Every expected number below is worked out by hand from the case's shape, not by the module's formula.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from pkb.registry import get_problem


def cost_of(name: str, case: str, world_size: int):
    problem = get_problem(name)
    return problem.cost(problem.find_case(case), world_size)


# (problem, case, W, link_bytes, flops, hbm_bytes), each derived in the comment above it.
HAND_DERIVED = [
    # grads 2*12288 bf16 = 49152 B, all-reduce 2*7/8 of it; 256 rows per rank: 3*256*12288 flops;
    # read 2*256*12288 bf16 + write 2*12288 bf16.
    ("layernorm_backward", "gpt3_175b_seq2048", 8, 86016, 9437184, 12632064),
    # 8192 ids, 7/8 leave: 7/8*8192*(8 + 4096*2) + 8*8 counts; read ids + rows, write rows.
    ("embedding_lookup", "llama3_8b_token_embedding", 8, 58777664, 0, 65536 + 134217728),
    # A is 8192x8192 bf16 = 134217728 B, 7/8 gathered; n/W = 10240/8 = 1280: 2*8192*1280*8192 flops;
    # (8192*8192 + 8192*1280 + 8192*1280) * 2 bytes.
    ("allgather_gemm_at", "llama3_70b_qkv_prefill", 8, 117440512, 171798691840, 176160768),
    ("allgather_gemm", "llama3_70b_qkv_prefill", 8, 117440512, 171798691840, 176160768),
    # output 8192x8192 bf16 = 134217728 B, all-reduce 2*7/8; k/W = 1024: 2*8192*8192*1024;
    # (8192*1024 + 1024*8192 + 8192*8192) * 2.
    ("gemm_allreduce", "llama3_70b_o_proj_prefill", 8, 234881024, 137438953472, 167772160),
    # the same partial reduce-scattered: 7/8 of 134217728; writes only 1024 rows: (2*8388608 + 8388608) * 2.
    ("gemm_reducescatter", "llama3_70b_o_proj_prefill", 8, 117440512, 137438953472, 50331648),
    # logits 64x128256 bf16 gathered, 7/8 of 16416768 B; 16032 columns per rank: 2*64*16032*4096;
    # (64*4096 + 4096*16032 + 64*128256) * 2.
    ("gemm_allgather", "llama3_8b_lm_head_decode", 8, 14364672, 8405385216, 148275200),
    # only the own 2048-row block is used: 3 other ranks' 2048x1024 bf16 hidden shards of it,
    # 3*2048*1024*2; 2 GEMMs of 2*2048*4096*14336; (8192*1024 + 2*4096*14336 + 2048*4096) * 2.
    ("combined_sharded_gemms", "llama3_8b_mlp_prefill", 4, 12582912, 481036337152, 268435456),
    # q+k: 40 heads * 128 * 8192 tokens * 2 B = 83886080, 7/8 gathered; 1024 local tokens:
    # 3*1024*40*128 flops; read 1024*(40*128 + 2*128)*2, write 83886080.
    ("rope_allgather", "llama3_8b_seq8192", 8, 73400320, 15728640, 11010048 + 83886080),
    # 8192 fp32 row sums all-reduced: 2*7/8*32768; 1024 columns: 4*8192*1024; (2*8192*1024 + 1024) * 2.
    ("tp_rms_norm", "hidden8192_prefill", 8, 57344, 33554432, 33556480),
    # per rank 4096 rows * (7168 fp8 + 56 fp32 scales = 7392 B) = 30277632 B, 7 other ranks' copies in;
    # 3*4096*7168 flops; read 4096*7168 bf16, write 8 * 30277632.
    ("blocked_fp8_quantize", "deepseek_v3_hidden_prefill", 8, 211943424, 88080384, 58720256 + 242221056),
    # bf16 payload and scales (as upstream): 8 chunks * 512 rows * (7168 + 56) * 2 B = 59179008, 7/8
    # crosses; 8*512*7168 multiplies; read payload and scales, write 8*512*7168 fp32.
    ("blocked_fp8_dequantize", "deepseek_v3_dispatch_512_tokens", 8, 51781632, 29360128, 59179008 + 117440512),
    # input 8192*8192 bf16 = 134217728 B, 7/8 reduce-scattered; 1024 rows: (7 adds + 5) * 1024*8192;
    # (8192*8192 + 8192 + 1024*8192) * 2.
    ("reducescatter_fused_rmsnorm", "llama3_70b_prefill", 8, 117440512, 100663296, 151011328),
    # logits 1x128256 bf16, 7/8 gathered; 16032 vocab rows: 2*4096*16032 + 16032 bias adds;
    # (16032*4096 + 16032 + 4096 + 128256) * 2.
    ("gemv_decode", "llama3_8b_decode_b1", 8, 224448, 131350176, 131630912),
    # three all-reduces of 8192 bf16 (as upstream): 3*2*7/8*16384; 4 flops * 8192 * 16032; read
    # 8192*16032 bf16 and write them back shifted in place, write 8192 losses (2 B) after reading
    # 8192 targets (8 B).
    ("vocab_parallel_cross_entropy_loss", "llama3_8b_seq8192", 8, 86016, 525336576, 2 * 262668288 + 81920),
    # 8 tokens, 128 vocab ids per rank: logits block 8*128*2 = 2048 B and 8 fp32 results, half cross;
    # no top-p sort: 5 flops * 4 tokens * 256 ids; read 2048 + write 32.
    ("vocab_parallel_log_prob_topk", "no_filter", 2, 1040, 5120, 2080),
    ("vocab_parallel_log_prob_topk_chunked", "no_filter", 2, 1040, 5120, 2080),
    # 1024 local elements go out as bf16 and come back as fp32 gradients, half of them crossing:
    # 0.5*1024*6; 5120 + 2 per element; read 2048 + write 4096, plus 8 targets and 8 grad_outputs.
    ("vocab_parallel_log_prob_topk_chunked_backward", "no_filter", 2, 3072, 7168, 6144 + 80),
    # Gram over n = 4096, 512 local rows: all-reduces of one fp32 scalar and 5 [4096, 4096] fp32,
    # 2*7/8 of (4 + 5*67108864); per step 2*4096^2*512 twice + 2*4096^3 + 2*4096*512, plus
    # 3*4096*512 for the norm; read and write 4096*512 bf16, and 4 passes over each fp32 Gram.
    ("tp_muon_orthogonalization", "llama3_8b_q_proj", 8, 587202567, 5 * 171802886144 + 6291456,
     8388608 + 1342177280),
]


@pytest.mark.parametrize(("name", "case", "world_size", "link_bytes", "flops", "hbm_bytes"), HAND_DERIVED,
                         ids=[row[0] for row in HAND_DERIVED])
def test_cost_matches_the_hand_derivation(name, case, world_size, link_bytes, flops, hbm_bytes):
    cost = cost_of(name, case, world_size)
    assert cost.link_bytes == pytest.approx(link_bytes)
    assert cost.flops == pytest.approx(flops)
    assert cost.hbm_bytes == pytest.approx(hbm_bytes)


def test_every_tensor_parallel_problem_has_a_hand_derived_cost():
    from pkb.registry import all_problems

    ours = {p.name for p in all_problems().values() if p.category == "tensor_parallel"}
    assert ours == {row[0] for row in HAND_DERIVED}
    assert {p.upstream_id for p in all_problems().values() if p.category == "tensor_parallel"} == (
        set(range(9, 21)) | {45, 46, 73, 82, 83, 84, 86})


def test_top_p_sort_adds_log2_vocab_flops_per_element():
    from pkb.problem import Case

    problem = get_problem("vocab_parallel_log_prob_topk")
    case = Case("x", {"batch": 1, "seq": 8, "vocab": 256, "top_k": None, "top_p": 0.9})
    assert problem.cost(case, 2).flops == pytest.approx(4 * 256 * (5 + 8))  # log2(256) = 8


# -- behaviour on a one-rank group -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_top_k_keeps_ties_at_the_kth_value_and_top_p_drops_the_lower_id_first():
    from pkb.problems.tensor_parallel._logprob import filter_top_k_top_p

    row = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    filtered, keep = filter_top_k_top_p(row, 2, 1.0)
    assert torch.isfinite(filtered).tolist() == keep.tolist() == [[False, True, True, True, False]]  # both 2.0s tie
    # Two equal logits hold most of the mass; with top_p just above one of them, exactly one must go:
    # the ascending stable sort puts id 0 before id 1, so id 0 is dropped.
    row = torch.tensor([[5.0, 5.0, -20.0]])
    kept = torch.isfinite(filter_top_k_top_p(row, None, 0.4)[0])
    assert kept.tolist() == [[False, True, False]]


def test_top_p_cut_is_decided_in_bf16_as_upstream():
    from pkb.problems.tensor_parallel._logprob import filter_top_k_top_p

    # Logits 0 and -0.84375 (both exact in bf16): the smaller one's probability is 0.300746 in fp32,
    # above 1 - top_p = 0.3, so fp32 keeps it; in bf16 it rounds to 0.30078125, and 0.3 rounds to
    # the same bf16 value, so "cumsum > 1 - top_p" is false and the token goes.
    row = torch.tensor([[0.0, -0.84375]])
    assert torch.isfinite(filter_top_k_top_p(row.to(torch.bfloat16), None, 0.7)[0]).tolist() == [[True, False]]
    assert torch.isfinite(filter_top_k_top_p(row, None, 0.7)[0]).tolist() == [[True, True]]


def test_fp8_quantization_rounds_to_nearest_even(one_rank_group):
    problem = get_problem("blocked_fp8_quantize")
    # amax 448 makes s = 1, so y = x: 1.0625 lies halfway between the e4m3 neighbours 1.0 and 1.125
    # and rounds to the even 1.0; 1.1875 halfway between 1.125 and 1.25 rounds to 1.25.
    block = torch.tensor([[448.0, 1.0625, 1.1875, -3.0, 0.0, 0.5, -448.0, 2.0]], dtype=torch.bfloat16)
    y, s = problem.reference(block, 8)
    assert s.tolist() == [[1.0]]
    assert y.float().tolist() == [[448.0, 1.0, 1.25, -3.0, 0.0, 0.5, -448.0, 2.0]]
    assert y.dtype == torch.float8_e4m3fn


def test_fp8_dequantize_then_quantize_round_trips(one_rank_group):
    quantize, dequantize = get_problem("blocked_fp8_quantize"), get_problem("blocked_fp8_dequantize")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y, s = quantize.reference(x, 16)
    # the dequantize problem takes the payload as bf16 and flat per-block scales [W, M*N/block], as upstream
    back = dequantize.reference(y.to(torch.bfloat16).unsqueeze(0), s.view(1, 6), 16)[0]
    # e4m3 keeps 3 mantissa bits: each value comes back within 1/16 of itself (relative), or within
    # the subnormal step of its block's scale.
    assert torch.all((back - x.float()).abs() <= x.float().abs() / 16 + s.repeat_interleave(16, 1) * 2**-9)


def test_embedding_lookup_on_one_owner_returns_rows_in_query_order(one_rank_group):
    # With several owners the rows come back grouped by owner rank (stable: query order within one).
    table = torch.arange(12.0).view(6, 2).to(torch.bfloat16)
    ids = torch.tensor([5, 0, 5, 2])
    out = get_problem("embedding_lookup").reference(ids, table)
    assert out.tolist() == [[10.0, 11.0], [0.0, 1.0], [10.0, 11.0], [4.0, 5.0]]


def test_cross_entropy_matches_torch_on_one_rank(one_rank_group):
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    target = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    loss = get_problem("vocab_parallel_cross_entropy_loss").reference(logits, target)
    expected = torch.nn.functional.cross_entropy(logits.float().view(-1, 11), target.view(-1), reduction="none")
    torch.testing.assert_close(loss.float(), expected.view(2, 5).to(torch.bfloat16).float())


def test_log_prob_backward_matches_autograd_on_one_rank(one_rank_group):
    from pkb.problems.tensor_parallel._logprob import filter_top_k_top_p

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 6, 16, generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, 16, (2, 6), generator=gen)
    grad_output = torch.randn(2, 6, generator=gen).to(torch.bfloat16)
    grad = get_problem("vocab_parallel_log_prob_topk_chunked_backward").reference(
        logits, target, grad_output, None, 5, 0.8, 4)
    _, keep = filter_top_k_top_p(logits.view(-1, 16), 5, 0.8)  # the cut is decided on the bf16 logits
    leaf = logits.float().requires_grad_(True)
    filtered = leaf.masked_fill(~keep.view(2, 6, 16), float("-inf"))
    log_probs = filtered.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    log_probs.backward(grad_output.float())
    torch.testing.assert_close(grad, leaf.grad.nan_to_num(0.0))
    forward = get_problem("vocab_parallel_log_prob_topk").reference(logits, target, None, 5, 0.8)
    assert torch.equal(forward, log_probs.detach())


def test_muon_result_is_nearly_orthogonal(one_rank_group):
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = get_problem("tp_muon_orthogonalization").reference(x, 5, "quintic", 1, None)
    singular_values = torch.linalg.svdvals(out.float())
    assert singular_values.min() > 0.6 and singular_values.max() < 1.3
    assert math.isclose(float(singular_values.mean()), 1.0, abs_tol=0.2)
