"""Sinkhorn-Knopp centering of the iBOT teacher's masked-patch scores over data-parallel ranks
(DINOv2 ``iBOTPatchLoss.sinkhorn_knopp_teacher``).

Per rank: teacher_output [n_r, K] fp32 whatever the run's precision, as upstream's factory makes it
(the teacher head's prototype scores of this rank's n_r masked patches; n_r differs by rank in the
tests and may be 0), teacher_temp (float), n_masked_patches_tensor [1] int64
(= n_r), n_iterations (int), group (None: the world).
Reference, as DINOv2 (Q is K x n, the transpose of the scores): Q = exp(teacher_output / temp)^T;
B = sum over ranks of n_r (all-reduce); Q /= sum of Q over all ranks (all-reduce); n_iterations
times: divide each prototype row by its sum over all ranks (all-reduce of K values) and by K, then
each sample column by its own sum and by B; finally Q *= B.
Output: [n_r, K] fp32 (Q^T: every patch's assignment, summing to 1 over prototypes). DINOv2 reduces
n_masked_patches_tensor in place; the reference reduces a copy, so the input is left unchanged.
Tolerance: entries are about 1/K, so the default fp32 atol (1e-4) would accept zeros; rtol 1e-4 with
atol 1e-9 instead.

Cost per rank: link bytes 2(W-1)/W * (8 + 4 + n_iterations*4K) (B, the total, the row sums);
flops about (2 + 4*n_iterations) n_r K (exp and scale; per iteration the row sum, the row scale, the
column sum and the column scale); HBM (n_iterations + 2) * n_r*K*4: the scores read once for the
total, once per iteration (the column normalisation of one sample and its contribution to the next
row sums can share a pass), and the result written.

Benchmarks: DINOv2 ViT-L/14 (iBOT head with 65536 prototypes) and ViT-g/14 (131072 prototypes):
about 0.3 of 2 x 256 patches of 32 (resp. 12) images per GPU masked, a little fewer on most ranks.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn

SCORE_STD = 0.1  # prototype scores of a normalised head are small; / 0.07 gives exp of N(0, 1.4^2)


def rows_of(case, rank: int) -> int:
    """n_r: the case's count, less a fixed rank-dependent amount (ranks mask different numbers)."""
    rows = case["masked_patches"]
    return max(rows - (rank * 37) % (case["spread"] + 1), 0)


def make_inputs(case, rank, world_size, gen):
    rows = rows_of(case, rank)
    teacher_output = randn(gen, rows, case["prototypes"], scale=SCORE_STD)
    n_masked = torch.tensor([rows], dtype=torch.int64, device=gen.device)
    return teacher_output, case["teacher_temp"], n_masked, case["n_iterations"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: fp32 scores 0.01 N(0, 1) [1024, 16384] on every rank, 1024 masked rows."""
    rows = rows_of(case, rank)
    teacher_output = torch.randn((rows, case["prototypes"]), dtype=torch.float32, device=device) * 0.01
    n_masked = torch.full((1,), rows, dtype=torch.long, device=device)
    return teacher_output.contiguous(), case["teacher_temp"], n_masked, case["n_iterations"], None


def reference(teacher_output, teacher_temp, n_masked_patches_tensor, n_iterations=3, group=None):
    Q = torch.exp(teacher_output.float() / teacher_temp).t()
    B = n_masked_patches_tensor.clone()
    dist.all_reduce(B, group=group)
    K = Q.shape[0]
    sum_Q = torch.sum(Q)
    dist.all_reduce(sum_Q, group=group)
    Q = Q / sum_Q
    for _ in range(n_iterations):
        sum_of_rows = torch.sum(Q, dim=1, keepdim=True)
        dist.all_reduce(sum_of_rows, group=group)
        Q = Q / sum_of_rows / K
        Q = Q / torch.sum(Q, dim=0, keepdim=True) / B
    Q = Q * B
    return Q.t().contiguous()


def cost(case, world_size):
    rows = max(rows_of(case, rank) for rank in range(world_size))
    prototypes, iterations = case["prototypes"], case["n_iterations"]
    elements = rows * prototypes
    return Cost(link_bytes=2 * (world_size - 1) / world_size * (8 + 4 + iterations * 4 * prototypes),
                flops=(2 + 4 * iterations) * elements, hbm_bytes=(iterations + 2) * elements * 4,
                pattern="all_reduce")


PROBLEM = Problem(
    name="dinov2_distributed_sinkhorn_knopp", version=2, upstream_id=80, category="data_parallel",
    source="DINOv2 dinov2/loss/ibot_patch_loss.py iBOTPatchLoss.sinkhorn_knopp_teacher (distributed)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"masked_patches": 1024, "spread": 0, "prototypes": 16384, "teacher_temp": 0.07,
                          "n_iterations": 3}, note="[1024, 16384] fp32 scores on every rank"),
    ],
    tests=[
        Case("uneven_rows", {"masked_patches": 9, "spread": 6, "prototypes": 33, "teacher_temp": 0.07,
                             "n_iterations": 3}, tags=("uneven_sizes", "odd_sizes")),
        Case("empty_rank_one_iteration", {"masked_patches": 3, "spread": 3, "prototypes": 17, "teacher_temp": 0.04,
                                          "n_iterations": 1},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "argument_value")),  # upstream: temp 0.07, 3 iterations
        Case("one_row_five_iterations", {"masked_patches": 1, "spread": 0, "prototypes": 64, "teacher_temp": 0.07,
                                         "n_iterations": 5}, tags=("tiny", "argument_value")),
    ],
    benchmarks=[
        Case("dinov2_vitl14_ibot_65536", {"masked_patches": 4915, "spread": 400, "prototypes": 65536,
                                          "teacher_temp": 0.07, "n_iterations": 3}),
        Case("dinov2_vitg14_ibot_131072", {"masked_patches": 1843, "spread": 150, "prototypes": 131072,
                                           "teacher_temp": 0.07, "n_iterations": 3}),
    ],
    tolerance=Tolerance(atol=1e-9, rtol=1e-4), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
