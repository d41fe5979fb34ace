"""SigLIP sigmoid contrastive loss over data-parallel ranks (OpenCLIP ``SigLipLoss``).

Per rank: image_features, text_features [b, d] in the run's precision, bf16 by default (this rank's b
pairs, L2-normalised; pair i's text is correlated with its image, cosine ~0.8, and all features share
one direction, so unmatched pairs have cosine ~0.55 and every rank's negatives carry a visible part
of the loss), logit_scale (float, already exponentiated, as OpenCLIP passes it), logit_bias (float),
group (None: the world).
Loss on rank r: with every rank's texts T_s [b, d] and logits_s = logit_scale * I_r T_s^T + logit_bias
(the product a GEMM in the features' dtype with fp32 accumulation, as OpenCLIP runs it under autocast;
the rest fp32),
loss = -(1/b) * sum over s, i, k of log sigmoid(label * logits_s[i, k]), label = +1 for s = r and
i = k, else -1. OpenCLIP computes the own-block term, then passes the texts around the ring
(neighbour exchange, ``bidir=True``) adding the negative-only terms of every other rank's block; the
reference gathers the texts (all-gather) and sums the same terms in fp32, rounded once.
Output: 0-dim loss in the features' dtype. The upstream computes the logits and adds the W block
terms in that dtype: the tolerance allows (W + 3) unit roundoffs of it relative (W - 1 additions, two
roundings per block term, slack for the rounded logits; measured up to half of that in bf16), less
than one other rank's share of the loss in the upstream case (over 10% at W = 8); fp32 at least its
default rtol.

Cost per rank, features of b bytes per element: link bytes (W-1)/W * W*b*d*b (every other rank's
texts; the ring moves the same); flops 2*b*(W*b)*d (logit GEMM) + 6*b*(W*b) (scale, bias, sign,
softplus, sum); HBM (W+1)*b*d*b (features read once; a fused kernel never writes the logits).

Benchmarks: SigLIP So400m/14 (d 1152) at the paper's global batch of 32768 and SigLIP B/16 (d 768)
at 16384, split evenly over W, with logit_scale 10 and logit_bias -10 (SigLIP's initialisation).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn
from pkb.problems.data_parallel._common import dtype_of


def pairs_per_rank(case, world_size: int) -> int:
    """b: a test names it directly; a benchmark splits its global batch evenly over W."""
    return case["pairs_per_rank"] if "pairs_per_rank" in case.params else case["global_batch"] // world_size


COMMON = 1.5  # weight of the direction all features share (unit-norm) against their own (norm ~1)


def make_inputs(case, rank, world_size, gen):
    batch, dim = pairs_per_rank(case, world_size), case["dim"]
    common = F.normalize(randn(gen.shared, 1, dim), dim=-1) * COMMON
    image = F.normalize(common + randn(gen, batch, dim, scale=dim**-0.5), dim=-1)
    text = F.normalize(image + randn(gen, batch, dim, scale=0.75 / dim**0.5), dim=-1)
    dtype = dtype_of(case)
    return image.to(dtype), text.to(dtype), case["logit_scale"], case["logit_bias"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: image and text features N(0, 1) normalised in the run's dtype, independent of each
    other (so every pair is as unlike as every non-pair)."""
    batch, dim, dtype = pairs_per_rank(case, world_size), case["dim"], dtype_of(case)
    image = torch.randn(batch, dim, dtype=dtype, device=device)
    text = torch.randn(batch, dim, dtype=dtype, device=device)
    return (F.normalize(image, dim=-1).contiguous(), F.normalize(text, dim=-1).contiguous(), case["logit_scale"],
            case["logit_bias"], None)


def reference(image_features, text_features, logit_scale, logit_bias=0.0, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, dim = text_features.shape
    texts = torch.empty(world_size * batch * dim, dtype=text_features.dtype, device=text_features.device)
    dist.all_gather_into_tensor(texts, text_features.reshape(-1), group=group)
    logits = logit_scale * (image_features @ texts.view(world_size * batch, dim).T).float() + logit_bias
    labels = -torch.ones_like(logits)
    labels[:, rank * batch:(rank + 1) * batch].diagonal().fill_(1.0)
    return (-F.logsigmoid(labels * logits).sum() / batch).to(image_features.dtype)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def tolerance(case, world_size, dtype):
    return Tolerance(atol=0.0, rtol=max((world_size + 3) * UNIT_ROUNDOFF.get(dtype, 0.0), default_tolerance(dtype).rtol))


def cost(case, world_size):
    batch, dim, itemsize = pairs_per_rank(case, world_size), case["dim"], dtype_of(case).itemsize
    columns = world_size * batch
    return Cost(link_bytes=(world_size - 1) / world_size * columns * dim * itemsize,
                flops=2 * batch * columns * dim + 6 * batch * columns,
                hbm_bytes=(world_size + 1) * batch * dim * itemsize,
                pattern="all_gather")


PROBLEM = Problem(
    name="openclip_contrastive_loss", version=3, upstream_id=58, category="data_parallel",
    source="OpenCLIP open_clip/loss.py SigLipLoss (world_size > 1, neighbour-exchange of text features)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"global_batch": 1024, "dim": 1024, "logit_scale": 10.0, "logit_bias": -10.0},
             note="[1024/W, 1024] features per rank, SigLIP init scale and bias"),
    ],
    tests=[
        Case("odd_pairs_siglip_init", {"pairs_per_rank": 5, "dim": 7, "logit_scale": 10.0, "logit_bias": -10.0},
             tags=("odd_sizes",)),
        Case("one_pair_per_rank", {"pairs_per_rank": 1, "dim": 33, "logit_scale": 4.0, "logit_bias": -2.0},
             tags=("tiny", "odd_sizes", "argument_value")),  # logit_scale 4 and bias -2: upstream passes 10, -10
    ],
    benchmarks=[
        Case("siglip_so400m_batch32k", {"global_batch": 32768, "dim": 1152, "logit_scale": 10.0, "logit_bias": -10.0}),
        Case("siglip_b16_batch16k", {"global_batch": 16384, "dim": 768, "logit_scale": 10.0, "logit_bias": -10.0}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
