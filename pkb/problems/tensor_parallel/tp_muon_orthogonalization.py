"""Tensor-parallel Newton-Schulz orthogonalization of a sharded matrix (Muon; NVIDIA
Emerging-Optimizers ``newton_schulz_tp`` as used by Megatron-LM's Muon).

The matrix X [m, n] is split along ``partition_dim`` across the group. With partition_dim = 1 each
rank holds X_r [m, n/W] (column block r); partition_dim = 0 is the same on the transpose (each rank
holds X_r [m/W, n], and the Gram matrix is taken over rows instead). In fp32:
    X = X / max(||X||_F, 1e-7)                 (||X||_F^2: local sum of squares, all-reduced)
    for i in range(steps), with (a, b, c) = coefficients[i % len(coefficients)]:
        A = X X^T                              ([m, m] Gram matrix, all-reduced over the shards)
        X = a X + (b A + c A A) X              (each rank updates its own block)
rounded once to the input dtype. Coefficients (``COEFFICIENTS``): 'simple' (Keller Jordan's Muon,
one triple), and Emerging-Optimizers' per-step sets 'quintic' (5 triples), 'polar_express' (8) and
'aol' (4). As upstream, ``steps`` must be a multiple of the set's length (each set is applied whole),
x must be 2-D and partition_dim 0 or 1; anything else raises.

Per rank: x [m, n/W] (partition_dim=1) or [m/W, n] (partition_dim=0), bf16 in every run precision (as
upstream's factory makes it); steps; coefficient_type;
partition_dim; group (None: the default group)  ->  the orthogonalized block, same shape and dtype.

Cost per rank, with g the Gram size (m for partition_dim 1, n for 0) and l the local other size:
all-reduces of one scalar and ``steps`` fp32 [g, g] Gram matrices: 2(W-1)/W * (4 + steps*g*g*4);
flops per step 2*g*g*l (Gram) + 2*g^3 (A A, replicated) + 2*g*g*l (update) + 2*g*l (scale, add),
plus 3*g*l for the norm; HBM reads and writes the block and, per step, writes and reads the Gram
matrix twice: 2*g*l*2 + steps*4*g*g*4 (x is bf16).

Tolerance: rtol 1.6e-2 (the bf16 default) and an atol scaled to the result's entries, which are
about 1/sqrt(max(m, n)): atol = 1.6e-2 * min(1, 8 / sqrt(max(m, n))). Measured on the tests at
W = 2 and 8, fp32 in another order with TF32-rounded GEMM inputs stays within 0.36 of it; a
result that skips an all-reduce is off by the size of the entries.

Cases: ``upstream`` is the upstream factory: X [512, 512] column-sharded (x [512, 512/W] bf16), 5
quintic steps. Tests also cycle a set twice (10 quintic steps) and run the 'polar_express' and 'aol' sets.

Benchmarks: Llama-3 8B and 70B weights under TP 8 in Megatron's [out, in] layout: a column-parallel
q_proj (partition_dim 0) and row-parallel o_proj / down_proj (partition_dim 1).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn

COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4647, 0.5074), (2.2779, -1.6447, 0.4162), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
}
EPS = 1e-7
X_ITEMSIZE = 2  # x is bf16 in every run precision


def make_inputs(case, rank, world_size, gen):
    m, n, dim = case["m"], case["n"], case["partition_dim"]
    shape = (m, n // world_size) if dim == 1 else (m // world_size, n)
    # bf16 in every precision: upstream's factory makes x bf16 whatever its dtype argument
    return (randn(gen, *shape, dtype=torch.bfloat16), case["steps"], case["coefficient_type"], dim, None)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): x [512, 512/W] N(0, 1) plus 0.01 * rank, in bf16 whatever the run's
    dtype; 5 quintic steps, columns sharded, group None."""
    m, n, dim = case["m"], case["n"], case["partition_dim"]
    shape = (m, n // world_size) if dim == 1 else (m // world_size, n)
    x = torch.randn(shape, dtype=torch.bfloat16, device=device) + 0.01 * rank
    return x, case["steps"], case["coefficient_type"], dim, None


def reference(x, steps=5, coefficient_type="quintic", partition_dim=1, group=None):
    if coefficient_type not in COEFFICIENTS:
        raise ValueError(f"coefficient_type {coefficient_type!r}: use one of {sorted(COEFFICIENTS)}")
    coefficients = COEFFICIENTS[coefficient_type]
    if steps % len(coefficients) or x.ndim != 2 or partition_dim not in (0, 1):
        raise ValueError(f"steps={steps} must be a multiple of {len(coefficients)} ({coefficient_type}), "
                         f"x 2-D (got {x.ndim}-D) and partition_dim 0 or 1 (got {partition_dim})")
    block = x.float() if partition_dim == 1 else x.float().t()  # [g, l]: Gram over dim 0
    sum_squares = block.pow(2).sum().reshape(1)
    dist.all_reduce(sum_squares, op=dist.ReduceOp.SUM, group=group)
    block = block / sum_squares.sqrt().clamp_min(EPS)
    for step in range(steps):
        a, b, c = coefficients[step % len(coefficients)]
        gram = block @ block.t()
        dist.all_reduce(gram, op=dist.ReduceOp.SUM, group=group)
        block = a * block + (b * gram + c * (gram @ gram)) @ block
    out = block if partition_dim == 1 else block.t()
    return out.contiguous().to(x.dtype)


def _gram_and_local(case, world_size):
    m, n = case["m"], case["n"]
    return (m, n / world_size) if case["partition_dim"] == 1 else (n, m / world_size)


def cost(case, world_size):
    g, l = _gram_and_local(case, world_size)
    steps = case["steps"]
    per_step = 2 * g * g * l + 2 * g**3 + 2 * g * g * l + 2 * g * l
    return Cost(link_bytes=2 * (world_size - 1) / world_size * (4 + steps * g * g * 4),
                flops=steps * per_step + 3 * g * l,
                hbm_bytes=2 * g * l * X_ITEMSIZE + steps * 4 * g * g * 4, pattern="all_reduce x (1 + steps)")


def tolerance(case, world_size):
    return Tolerance(atol=1.6e-2 * min(1.0, 8.0 / math.sqrt(max(case["m"], case["n"]))), rtol=1.6e-2)


PROBLEM = Problem(
    name="tp_muon_orthogonalization", version=2, upstream_id=86, category="tensor_parallel",
    source="NVIDIA Emerging-Optimizers newton_schulz_tp (Megatron-LM Muon, tensor-parallel Newton-Schulz)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": 512, "n": 512, "partition_dim": 1, "steps": 5, "coefficient_type": "quintic"},
                   note="the upstream factory: x [512, 512/W] bf16, 5 quintic steps, columns sharded")],
    tests=[
        Case("wide_columns_quintic", {"m": 24, "n": 40, "partition_dim": 1, "steps": 5, "coefficient_type": "quintic"},
             note="5 columns per rank at W=8", tags=("odd_sizes",)),
        Case("tall_rows_simple", {"m": 40, "n": 24, "partition_dim": 0, "steps": 3, "coefficient_type": "simple"},
             note="rows sharded; Gram over the 24 columns", tags=("argument_value",)),
        Case("tall_columns_ten_steps", {"m": 37, "n": 16, "partition_dim": 1, "steps": 10,
                                        "coefficient_type": "quintic"},
             note="the quintic set twice; m > n, so the Gram is rank-deficient",
             tags=("argument_value", "odd_sizes")),
        Case("polar_express_rows", {"m": 16, "n": 56, "partition_dim": 0, "steps": 8,
                                    "coefficient_type": "polar_express"}, note="2 rows per rank at W=8",
             tags=("argument_value",)),
        Case("aol_columns", {"m": 20, "n": 24, "partition_dim": 1, "steps": 4, "coefficient_type": "aol"},
             tags=("argument_value", "odd_sizes")),
    ],
    benchmarks=[
        Case("llama3_8b_q_proj", {"m": 4096, "n": 4096, "partition_dim": 0, "steps": 5, "coefficient_type": "quintic"}),
        Case("llama3_8b_down_proj", {"m": 4096, "n": 14336, "partition_dim": 1, "steps": 5,
                                     "coefficient_type": "quintic"}),
        Case("llama3_70b_o_proj", {"m": 8192, "n": 8192, "partition_dim": 1, "steps": 5,
                                   "coefficient_type": "quintic"}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
