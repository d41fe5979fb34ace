"""Multi-GPU mask IoU suppression (SAM 3 video tracker, suppression of overlapping objects based on
recent occlusion): tracked objects are sharded over the GPUs; every GPU gathers all objects' low-res
masks and scores, computes the pairwise IoU of the binary masks and marks which objects to suppress.

Per rank: low_res_masks_local [n_r, H, W] (mask logits; n_r = num_obj_per_gpu[rank], may be 0),
obj_scores_local [n_r] (both in the run's precision, bf16 by default), num_obj_per_gpu (list of W ints,
the same on every rank), last_occluded [N] int64 (N = sum of the counts; the frame each object was last
occluded, -1 = never; the same on every rank), iou_threshold, reverse, group=None (the default group)
  ->  (masks_global [N, H, W] fp32, scores_global [N] fp32, to_suppress [N] bool), the same on every rank,
      objects in rank order; a suppressed object's mask logits are all set to -10 (SAM 3's "no object").

Suppression rule: binary mask = logit > 0; IoU(i, j) = fp32(|i and j|) / fp32(|i or j|) (0 when the
union is empty; the counts are exact, the division is IEEE-rounded, so the value is unique); a pair
overlaps when IoU >= fp32(iou_threshold). For each overlapping pair (i < j) the object occluded more
recently (larger last_occluded; smaller with ``reverse``) is suppressed, provided the other one has
been occluded at some point (last_occluded > -1); equal values suppress neither. Exact outputs. The
threshold is no knife edge: IoUs are ratios of counts below 2^17, so one that is not exactly the
threshold is at least 1/(10 * 2^17) away from it, far more than an fp32 rounding.

Cost: the masks and scores (b bytes an element) are all-gathered: link = (W-1)/W * N*(H*W + 1)*b. flops:
the IoU Gram matrix of the flattened binary masks, 2*N*N*H*W. HBM: read the gathered masks, write them in
fp32: N*H*W*(b + 4).

Benchmarks: SAM 3 tracks up to hundreds of objects per video with 256x256 low-res masks;
``sam3_64_objects`` and ``sam3_256_objects`` spread them evenly over the GPUs. The ``upstream`` case
has the upstream factory's shapes at trial 0: 1 + rank % 3 objects per rank, 256x256 masks, threshold 0.7.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import dtype_of, skewed_counts


_NO_OBJECT_LOGIT = -10.0


def object_counts(case, world_size, gen):
    if case.get("counts") == "mod3":  # the upstream factory's (at trial 0): 1 + rank % 3
        return [1 + rank % 3 for rank in range(world_size)]
    if case.get("even", False):
        return [case["objects"] // world_size + (1 if r < case["objects"] % world_size else 0)
                for r in range(world_size)]
    counts = skewed_counts(gen.shared, world_size, case["objects"], case.get("num_empty", 0))
    counts[0] = max(counts[0], 2)
    return counts


def make_inputs(case, rank, world_size, gen):
    size = case["mask_size"]
    counts = object_counts(case, world_size, gen)
    # A shared pool of blobs; objects on different ranks that pick the same blob overlap strongly.
    num_blobs = max(2, sum(counts) // 2)
    centres = torch.rand(num_blobs, 2, generator=gen.shared, device=gen.device) * size
    radii = (0.1 + 0.2 * torch.rand(num_blobs, generator=gen.shared, device=gen.device)) * size
    picks = torch.randint(0, num_blobs, (counts[rank],), generator=gen, device=gen.device)
    jitter = randn(gen, counts[rank], 2, scale=0.04 * size)
    centre = centres[picks] + jitter
    radius = radii[picks] * (1 + 0.1 * randn(gen, counts[rank]))
    grid = torch.arange(size, device=gen.device, dtype=torch.float32)
    dist_sq = (grid.view(1, -1, 1) - centre[:, 0].view(-1, 1, 1)) ** 2 + \
              (grid.view(1, 1, -1) - centre[:, 1].view(-1, 1, 1)) ** 2
    logits = (radius.view(-1, 1, 1) ** 2 - dist_sq) / radius.view(-1, 1, 1) + randn(gen, counts[rank], size, size)
    low_res_masks_local = logits.to(dtype_of(case))
    obj_scores_local = randn(gen, counts[rank], dtype=dtype_of(case))
    last_occluded = torch.randint(-1, 6, (sum(counts),), generator=gen.shared, device=gen.device)
    return (low_res_masks_local, obj_scores_local, counts, last_occluded, case.get("iou_threshold", 0.7),
            case.get("reverse", False), None)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): 1 + (r + trial) % 3 objects on rank r; N(0, 1) mask logits in the run's
    dtype, + 4 on a diagonal stripe pattern, - 1; scores linspace(-5, 5); last_occluded (i % 5) - 1."""
    dtype, size = dtype_of(case), case["mask_size"]
    counts = [1 + (r + trial) % 3 for r in range(world_size)]
    num = counts[rank]
    masks = torch.randn((num, size, size), dtype=dtype, device=device)
    rows = torch.arange(size, device=device).view(1, size, 1)
    columns = torch.arange(size, device=device).view(1, 1, size)
    objects = torch.arange(num, device=device).view(num, 1, 1)
    pattern = ((rows + columns + objects + rank) % 5 == 0).to(dtype)
    masks = masks + pattern * 4.0 - 1.0
    obj_scores_local = torch.linspace(-5.0, 5.0, num, dtype=dtype, device=device)
    last_occluded = torch.arange(sum(counts), dtype=torch.long, device=device) % 5 - 1
    return (masks, obj_scores_local, counts, last_occluded, case.get("iou_threshold", 0.7), case.get("reverse", False),
            None)


def _gather_objects(local, counts, group):
    """Every rank's rows (``counts[r]`` of them), in rank order, through a padded flat all-gather."""
    most = max(counts)
    padded = local.new_zeros((most, *local.shape[1:]))
    padded[: local.shape[0]] = local
    flat = local.new_empty(len(counts) * padded.numel())
    dist.all_gather_into_tensor(flat, padded.reshape(-1), group=group)
    gathered = flat.view(len(counts), most, *local.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])


def reference(low_res_masks_local, obj_scores_local, num_obj_per_gpu, last_occluded, iou_threshold=0.7,
              reverse=False, group=None):
    masks_global = _gather_objects(low_res_masks_local, num_obj_per_gpu, group).float()
    scores_global = _gather_objects(obj_scores_local, num_obj_per_gpu, group).float()
    binary = (masks_global > 0).flatten(1).float()
    intersection = binary @ binary.T
    area = binary.sum(dim=1)
    union = area.view(-1, 1) + area.view(1, -1) - intersection
    iou = torch.where(union > 0, intersection / union.clamp_min(1), torch.zeros_like(union))
    overlapping = torch.triu(iou >= torch.tensor(iou_threshold, dtype=torch.float32), diagonal=1)
    occluded_i, occluded_j = last_occluded.view(-1, 1), last_occluded.view(1, -1)
    more_recent = torch.lt if reverse else torch.gt
    suppress_i = overlapping & more_recent(occluded_i, occluded_j) & (occluded_j > -1)
    suppress_j = overlapping & more_recent(occluded_j, occluded_i) & (occluded_i > -1)
    to_suppress = suppress_i.any(dim=1) | suppress_j.any(dim=0)
    masks_global[to_suppress] = _NO_OBJECT_LOGIT
    return masks_global, scores_global, to_suppress


def total_objects(case, world_size):
    return sum(1 + rank % 3 for rank in range(world_size)) if case.get("counts") == "mod3" else case["objects"]


def cost(case, world_size):
    total, pixels = total_objects(case, world_size), case["mask_size"] ** 2
    itemsize = dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * total * (pixels + 1) * itemsize,
                flops=2 * total * total * pixels, hbm_bytes=total * pixels * (itemsize + 4), pattern="all_gather")


PROBLEM = Problem(
    name="sam3_allgather_iou_suppression", version=3, upstream_id=81, category="beyond_llm",
    source="SAM 3 (Meta) video tracker: suppress overlapping objects based on recent occlusion (multi-GPU)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"counts": "mod3", "mask_size": 256}, note="1 + rank % 3 objects per rank, 256x256 masks"),
    ],
    tests=[
        Case("skewed_counts", {"objects": 13, "mask_size": 24}, tags=("uneven_sizes", "skewed")),
        Case("empty_rank_reverse", {"objects": 10, "mask_size": 17, "num_empty": 1, "reverse": True,
                                    "iou_threshold": 0.5},
             tags=("empty_rank", "uneven_sizes", "argument_value", "odd_sizes")),
    ],
    benchmarks=[
        Case("sam3_64_objects", {"objects": 64, "mask_size": 256, "even": True}),
        Case("sam3_256_objects", {"objects": 256, "mask_size": 256, "even": True}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
