"""Distributed layer-wise Kalman filter (LKF) weight update (DeePMD-kit ``LKFOptimizer.__update``).

The flattened model weights are cut into blocks; each rank owns k blocks (sizes n_1..n_k, the same
list on every rank; rank r owns global blocks r*k .. r*k + k - 1) with their Kalman covariances.
Every tensor is fp64 whatever the run's precision, as upstream's factory makes them.
Per rank: H, a list of k [n_i, 1] fp64 (the gradient of the prediction w.r.t. the block's weights);
error, 0-dim fp64 (the batch's error, the same on every rank); weights, a list of k [n_i, 1] fp64;
P, a list of k [n_i, n_i] fp64 (symmetric positive definite covariances); kalman_lambda (float, the
memory factor), kalman_nue (float, its decay).
Reference, as DeePMD-kit: tmp = sum over this rank's blocks of (lambda + H_i^T P_i H_i) (lambda once
per block, as the source adds it), all-reduced over ranks; A = 1 / tmp; for every own block
K_i = P_i H_i, weights[i] = weights_i + A * error * K_i and P[i] = (1 / lambda) (P_i - A K_i K_i^T):
new tensors put in the caller's lists (the tensors passed in are not written); then all ranks'
updated weights are all-gathered; lambda_next = nue * lambda + 1 - nue (in the weights' dtype).
Output: (all weights: a list of W*k [n_i, 1] fp64 in global block order, P: the caller's list, now
this rank's k updated covariances, lambda_next: 0-dim fp64). The lists passed in are checked after
the call. Upstream exchanged the shapes with all_gather_object (pickling); here every rank holds the
same block list, so the gathered shapes are known.

Cost per rank, N = sum n_i own weights: link bytes 2(W-1)/W * 8 (the scalar all-reduce) +
(W-1)/W * W*N*8 (the weight all-gather); flops sum over blocks of 5 n_i^2 (P H; the rank-1 downdate,
its scaling and the division by lambda) + O(n_i); HBM sum of 3 n_i^2 * 8 (P is read for P H, read
again after the all-reduce has fixed A, and written).

Benchmarks: DeePMD-kit's default LKF block size 5120 with 4 blocks per rank (a 164k-parameter
se_e2_a model at W = 8); the upstream case (8 blocks of 1024 per rank) can be timed as well.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn

RANK_OF_P = 64  # P = I + B B^T / r with B [n, r]: symmetric positive definite, cheap to draw


def make_inputs(case, rank, world_size, gen):
    sizes = case["block_sizes"]
    total = world_size * sum(sizes)
    H = [randn(gen, n, 1, dtype=torch.float64, scale=total**-0.5) for n in sizes]
    weights = [randn(gen, n, 1, dtype=torch.float64, scale=0.1) for n in sizes]
    P = []
    for n in sizes:
        low_rank = randn(gen, n, min(n, RANK_OF_P), dtype=torch.float64, scale=0.3)
        P.append(torch.eye(n, dtype=torch.float64, device=gen.device) + low_rank @ low_rank.T / low_rank.shape[1])
    error = randn(gen.shared, 1, dtype=torch.float64).reshape(())
    return H, error, weights, P, case["kalman_lambda"], 0.9987


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values, fp64 whatever the run's precision: per block h = 0.01 N(0, 1) and w = N(0, 1) [n, 1] and
    P the identity, then the error N(0, 1) (distinct per rank)."""
    H, weights, P = [], [], []
    for n in case["block_sizes"]:
        H.append(torch.randn((n, 1), dtype=torch.float64, device=device) * 0.01)
        weights.append(torch.randn((n, 1), dtype=torch.float64, device=device))
        P.append(torch.eye(n, dtype=torch.float64, device=device))
    return H, torch.randn((), dtype=torch.float64, device=device), weights, P, case["kalman_lambda"], 0.9987


def reference(H, error, weights, P, kalman_lambda, kalman_nue=0.9987):
    dtype, device = weights[0].dtype, weights[0].device
    lam = torch.tensor(kalman_lambda, dtype=dtype, device=device)
    err = error.to(device=device, dtype=dtype)
    tmp = sum(lam + h.T @ p @ h for h, p in zip(H, P))                               # [1, 1]
    dist.all_reduce(tmp)
    A = 1 / tmp
    for i, h in enumerate(H):
        K = P[i] @ h                                                                    # [n_i, 1]
        weights[i] = weights[i] + A * err * K
        P[i] = (1 / lam) * (P[i] - A * (K @ K.T))
    own = torch.cat([w.reshape(-1) for w in weights]).to(torch.float64)
    gathered = torch.empty(dist.get_world_size() * own.numel(), dtype=own.dtype, device=own.device)
    dist.all_gather_into_tensor(gathered, own)
    sizes = [w.shape[0] for w in weights] * dist.get_world_size()
    all_weights = [block.view(-1, 1).to(dtype) for block in gathered.split(sizes)]
    nue = torch.tensor(kalman_nue, dtype=dtype, device=device)
    return all_weights, P, nue * lam + 1 - nue


def cost(case, world_size):
    sizes = case["block_sizes"]
    own = sum(sizes)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 8 + (world_size - 1) / world_size * world_size * own * 8,
                flops=sum(5 * n * n + 6 * n for n in sizes), hbm_bytes=sum(3 * n * n * 8 for n in sizes),
                pattern="all_reduce+all_gather")


PROBLEM = Problem(
    name="deepmd_kalman_filter_optimizer", version=2, upstream_id=63, category="data_parallel",
    source="DeePMD-kit deepmd/pt/optimizer/LKF.py LKFOptimizer.__update (distributed blocks)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"block_sizes": [1024] * 8, "kalman_lambda": 0.98},
             note="8 blocks of 1024 fp64 weights per rank, each with its [1024, 1024] covariance"),
    ],
    tests=[
        Case("uneven_blocks", {"block_sizes": [7, 3, 11], "kalman_lambda": 0.98}, tags=("odd_sizes",)),
        Case("one_scalar_block", {"block_sizes": [1], "kalman_lambda": 0.995},
             tags=("tiny", "argument_value")),  # lambda 0.995: upstream passes 0.98
        Case("two_equal_blocks", {"block_sizes": [5, 5], "kalman_lambda": 0.98}, tags=("odd_sizes",)),
    ],
    benchmarks=[
        Case("deepmd_kf_block5120_4_per_rank", {"block_sizes": [5120] * 4, "kalman_lambda": 0.98}),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
