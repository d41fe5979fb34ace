"""The expert-parallel MoE layer: its router's inputs at hidden size 7168 (exact logits, the same top-k in fp32
and bf16), and its reference against an independent dense implementation, run through the evaluator on CPU
ranks at W = 2 and 4. Drawing the router's inputs redraws near ties some 2,000 times: several seconds on an
idle two-core machine, over a minute on a busy one, too long for the unit tier.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.problem import Case, make_generator
from pkb.problems.expert_parallel import _moe
from pkb.registry import get_problem
from pkb.runtime.modes import Mode


# -- the router's inputs --------------------------------------------------------------------------------


def test_router_logits_are_exact_and_top_k_is_the_same_in_fp32_and_bf16():
    case = Case("c", {"hidden": 7168, "intermediate": 8, "skew": True})
    hidden, gate_weight, gate_bias = _moe.router_inputs(case, 64, 256, 8, 8, make_generator(5, 6))
    forward = hidden.float() @ gate_weight.float().T + gate_bias.float()
    backward = hidden.float().flip(1) @ gate_weight.float().flip(1).T + gate_bias.float()
    exact = hidden.double() @ gate_weight.double().T + gate_bias.double()
    assert torch.equal(forward, backward) and torch.equal(forward.double(), exact)
    # The upstream's router: a bf16 linear, a bf16 softmax, top-k of the rounded probabilities.
    bf16_probs = torch.softmax(torch.nn.functional.linear(hidden, gate_weight, gate_bias), dim=-1)
    chosen_fp32 = forward.topk(8).indices.sort(dim=1).values
    assert torch.equal(bf16_probs.topk(8).indices.sort(dim=1).values, chosen_fp32)
    assert set(chosen_fp32.flatten().tolist()) <= set(range(224, 256))  # skew: the last rank's experts
    top = exact.topk(9).values
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().amax(1))) - 7)
    assert bool((top[:, 7] - top[:, 8] >= 8 * ulp).all())             # k-th and (k+1)-th well apart


# -- the MoE layer against a dense implementation that shares none of its code ---------------------------

DENSE_MOE = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F


def _gather(t):
    world_size = dist.get_world_size()
    flat = torch.empty(world_size * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(flat, t.detach().contiguous().view(-1))
    return flat.view(world_size, *t.shape).float()


def solution(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    # Every rank's MLP on every rank, then each token through the MLPs of its k experts' ranks, in fp32:
    # no permutation, no all-to-all.
    mlps = [[_gather(p) for p in (layer.weight, layer.bias)] for layer in (gate_proj, up_proj, down_proj)]
    local_experts = num_experts // dist.get_world_size()
    x = hidden_states.float()
    probs = torch.softmax(x @ gate_weight.float().T + gate_bias.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    out = torch.zeros_like(x)
    for j in range(top_k):
        owner = experts[:, j] // local_experts
        for rank in range(dist.get_world_size()):
            rows = owner == rank
            (gate_w, gate_b), (up_w, up_b), (down_w, down_b) = ((w[rank], b[rank]) for w, b in mlps)
            act = F.silu(x[rows] @ gate_w.T + gate_b) * (x[rows] @ up_w.T + up_b)
            out[rows] += weights[rows, j:j + 1] * (act @ down_w.T + down_b)
    return out.to(hidden_states.dtype)
'''


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_matches_a_dense_implementation(world_size, tmp_path):
    path = tmp_path / "dense_moe.py"
    path.write_text(textwrap.dedent(DENSE_MOE))
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, trials=2, timeout=120.0, cases="tests")
    result = evaluate(get_problem("fused_moe_fwd"), Candidate.from_file(path), config)
    assert result.status is Status.OK, result.message
