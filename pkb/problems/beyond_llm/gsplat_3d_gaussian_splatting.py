"""Distributed 3D Gaussian splatting projection (gsplat ``rasterization(..., packed=True, distributed=True)``,
the projection and exchange stages): every rank holds a shard of the Gaussians and its own cameras;
cameras are all-gathered, every rank projects its Gaussians into every camera, and the visible
(camera, Gaussian) records are sent to the rank that owns the camera.

Per rank: means [N_r, 3], quats [N_r, 4] (w, x, y, z; not normalised), scales [N_r, 3], opacities [N_r],
colors [N_r, 3] (all fp32; N_r differs per rank and may be 0), viewmats [C_r, 4, 4] (world-to-camera),
Ks [C_r, 3, 3] (C_r may be 0), image_width, image_height, eps2d, near_plane, far_plane,
camera_model='pinhole'
  ->  (camera_ids [n] int32 (index among this rank's cameras), gaussian_ids [n] int32 (global: the
       Gaussians of ranks 0..r-1 come first), radii [n, 2] int32, means2d [n, 2], depths [n],
       conics [n, 3], opacities [n], colors [n, 3]) for every visible pair whose camera is on this rank,
      ordered by source rank, then camera, then Gaussian.

Projection (gsplat ``fully_fused_projection``, fp32 throughout; upstream ran it in bf16, which made the
integer radii and the record count fragile):
  mean_c = R mean + t; cov3d = (Rq S)(Rq S)^T with Rq the rotation of the normalised quaternion and
  S = diag(scales); cov_c = R cov3d R^T; with the camera-space x/z clamped to the field of view widened
  by 0.3*tan(fov/2) on each side (gsplat's persp_proj), J = [[fx/z, 0, -fx x/z^2], [0, fy/z, -fy y/z^2]],
  cov2d = J cov_c J^T + eps2d*I; mean2d = (fx x/z + cx, fy y/z + cy); depth = z;
  conic = (c, -b, a) / det for cov2d = [[a, b], [b, c]]; radii = ceil(3.33 * sqrt((a, c))).
  A pair is visible when near_plane <= z <= far_plane, det > 0 and the box mean2d +- radii meets the image.
  Integer outputs are exact; an honest fp32 kernel only differs where 3.33*sqrt(.) sits on an integer.

Cost: the visible records (camera id, Gaussian id, 2 radii: 4 int32; 10 floats) go to the camera's
owner; counted as if every Gaussian were visible in every camera (an upper bound: the visible fraction
depends on the scene): link = (W-1)/W * N_r * C * 56 bytes, plus the cameras' all-gather.
flops: ~200 per (Gaussian, camera) pair for the covariance, projection and conic. HBM: read the
Gaussians (14 floats) once per camera and write the records.

Benchmarks: gsplat's distributed training splits scenes of ~1M Gaussians (Mip-NeRF 360 scenes reach
3-6M) over the GPUs, one camera per GPU per step, at 1297x840 (Mip-NeRF 360 garden at 1/4 resolution)
and at the catalog's 512x512.
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.beyond_llm._common import all_gather_rows, all_gather_sizes, all_to_all_rows, exchange_counts

_RADIUS_EXTENT = 3.33
_FLOATS_PER_RECORD = 10  # means2d 2, depth 1, conic 3, opacity 1, color 3
_FLOPS_PER_PAIR = 200


def _look_at(positions: torch.Tensor) -> torch.Tensor:
    """World-to-camera matrices [C, 4, 4] for cameras at ``positions`` looking at the origin (OpenCV axes)."""
    forward = -positions / positions.norm(dim=1, keepdim=True)
    up = torch.tensor([0.0, 0.0, 1.0], device=positions.device).expand_as(forward)
    right = torch.linalg.cross(forward, up)
    right = right / right.norm(dim=1, keepdim=True)
    down = torch.linalg.cross(forward, right)
    rotation = torch.stack([right, down, forward], dim=1)
    viewmats = torch.zeros(positions.shape[0], 4, 4, device=positions.device)
    viewmats[:, :3, :3] = rotation
    viewmats[:, :3, 3] = -(rotation @ positions.unsqueeze(-1)).squeeze(-1)
    viewmats[:, 3, 3] = 1.0
    return viewmats


def gaussian_counts(case, world_size):
    """Gaussians per rank: a scene total split evenly, or a per-rank pattern repeated over the ranks."""
    if "gaussians_total" in case.params:
        total = case["gaussians_total"]
        return [total // world_size + (1 if r < total % world_size else 0) for r in range(world_size)]
    counts = case["gaussians_per_rank"]
    return [counts[r % len(counts)] for r in range(world_size)]


def make_inputs(case, rank, world_size, gen):
    num = gaussian_counts(case, world_size)[rank]
    cameras = case["cameras_per_rank"]
    num_cameras = cameras[rank % len(cameras)]
    width, height = case["image_size"]
    means = randn(gen, num, 3)
    quats = randn(gen, num, 4)
    scales = torch.exp(randn(gen, num, 3, scale=0.5) + math.log(case["scale"]))
    opacities = torch.sigmoid(randn(gen, num))
    colors = torch.rand(num, 3, generator=gen, device=gen.device)
    direction = randn(gen, num_cameras, 3)
    distance = 3.0 + torch.rand(num_cameras, 1, generator=gen, device=gen.device)
    viewmats = _look_at(direction / direction.norm(dim=1, keepdim=True) * distance)
    focal = case["focal"] * width * (1 + 0.1 * torch.rand(num_cameras, generator=gen, device=gen.device))
    Ks = torch.zeros(num_cameras, 3, 3, device=gen.device)
    Ks[:, 0, 0], Ks[:, 1, 1] = focal, focal
    Ks[:, 0, 2], Ks[:, 1, 2], Ks[:, 2, 2] = width / 2, height / 2, 1.0
    return (means, quats, scales, opacities, colors, viewmats, Ks, width, height, case.get("eps2d", 0.3),
            case.get("near_plane", 0.01), 1e10, "pinhole")


def _quat_to_rotation(quats: torch.Tensor) -> torch.Tensor:
    w, x, y, z = (quats / quats.norm(dim=-1, keepdim=True)).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).view(*quats.shape[:-1], 3, 3)


def _project(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane):
    """Every (camera, Gaussian) pair: (visible [C, N], radii [C, N, 2], means2d, depths, conics)."""
    rotation, translation = viewmats[:, :3, :3], viewmats[:, :3, 3]
    mean_c = torch.einsum("cij,nj->cni", rotation, means) + translation[:, None, :]
    rs = _quat_to_rotation(quats) * scales[:, None, :]
    cov3d = rs @ rs.transpose(-1, -2)
    cov_c = rotation[:, None] @ cov3d[None] @ rotation[:, None].transpose(-1, -2)
    tx, ty, tz = mean_c.unbind(-1)
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    margin_x, margin_y = 0.3 * 0.5 * width / fx, 0.3 * 0.5 * height / fy
    clamped_x = tz * torch.minimum((width - cx) / fx + margin_x, torch.maximum(-(cx / fx + margin_x), tx / tz))
    clamped_y = tz * torch.minimum((height - cy) / fy + margin_y, torch.maximum(-(cy / fy + margin_y), ty / tz))
    zeros = torch.zeros_like(tz)
    jacobian = torch.stack([fx / tz, zeros, -fx * clamped_x / (tz * tz),
                            zeros, fy / tz, -fy * clamped_y / (tz * tz)], dim=-1).view(*tz.shape, 2, 3)
    cov2d = jacobian @ cov_c @ jacobian.transpose(-1, -2)
    a, b, c = cov2d[..., 0, 0] + eps2d, cov2d[..., 0, 1], cov2d[..., 1, 1] + eps2d
    det = a * c - b * b
    conics = torch.stack([c / det, -b / det, a / det], dim=-1)
    means2d = torch.stack([fx * tx / tz + cx, fy * ty / tz + cy], dim=-1)
    radii = torch.ceil(_RADIUS_EXTENT * torch.sqrt(torch.stack([a, c], dim=-1).clamp_min(0))).to(torch.int32)
    visible = (tz >= near_plane) & (tz <= far_plane) & (det > 0)
    visible &= (means2d[..., 0] + radii[..., 0] > 0) & (means2d[..., 0] - radii[..., 0] < width)
    visible &= (means2d[..., 1] + radii[..., 1] > 0) & (means2d[..., 1] - radii[..., 1] < height)
    return visible, radii, means2d, tz, conics


def reference(means, quats, scales, opacities, colors, viewmats, Ks, image_width, image_height, eps2d=0.3,
              near_plane=0.01, far_plane=1e10, camera_model="pinhole"):
    if camera_model != "pinhole":
        raise ValueError(f"only the pinhole camera model is part of this problem, got {camera_model!r}")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = means.device
    all_viewmats, cameras_per_rank = all_gather_rows(viewmats.float())
    all_Ks, _ = all_gather_rows(Ks.float())
    gaussian_offset = sum(all_gather_sizes(means.shape[0], device)[:rank])
    visible, radii, means2d, depths, conics = _project(means.float(), quats.float(), scales.float(), all_viewmats,
                                                       all_Ks, image_width, image_height, eps2d, near_plane,
                                                       far_plane)
    camera_ids, gaussian_ids = visible.nonzero(as_tuple=True)  # camera-major: grouped by owner already
    camera_start = torch.tensor([0] + cameras_per_rank, device=device).cumsum(0)
    owner = torch.searchsorted(camera_start[1:], camera_ids, right=True)
    send_counts = torch.bincount(owner, minlength=world_size).tolist()
    recv_counts = exchange_counts(send_counts, device)
    ints = torch.stack([camera_ids - camera_start[owner], gaussian_ids + gaussian_offset,
                        radii[camera_ids, gaussian_ids, 0], radii[camera_ids, gaussian_ids, 1]], dim=1)
    floats = torch.cat([means2d[camera_ids, gaussian_ids], depths[camera_ids, gaussian_ids, None],
                        conics[camera_ids, gaussian_ids], opacities.float()[gaussian_ids, None],
                        colors.float()[gaussian_ids]], dim=1)
    ints = all_to_all_rows(ints.to(torch.int32), send_counts, recv_counts)
    floats = all_to_all_rows(floats, send_counts, recv_counts)
    return (ints[:, 0].contiguous(), ints[:, 1].contiguous(), ints[:, 2:].contiguous(), floats[:, 0:2].contiguous(),
            floats[:, 2].contiguous(), floats[:, 3:6].contiguous(), floats[:, 6].contiguous(),
            floats[:, 7:10].contiguous())


def cost(case, world_size):
    cameras = case["cameras_per_rank"]
    per_rank_gaussians = gaussian_counts(case, world_size)
    total_cameras = sum(cameras[r % len(cameras)] for r in range(world_size))
    num = max(per_rank_gaussians)
    record_bytes = 4 * 4 + _FLOATS_PER_RECORD * 4
    link = (world_size - 1) / world_size * num * total_cameras * record_bytes + total_cameras * 25 * 4
    return Cost(link_bytes=link, flops=_FLOPS_PER_PAIR * num * total_cameras,
                hbm_bytes=num * total_cameras * (14 * 4 + record_bytes), pattern="all_gather+all_to_all")


def _case(name, gaussians, cameras_per_rank, image_size=(64, 48), scale=0.05, focal=1.0, **extra):
    """``gaussians``: an int (the scene's total, split evenly) or a tuple (a per-rank pattern)."""
    note = extra.pop("note", "")
    key = "gaussians_total" if isinstance(gaussians, int) else "gaussians_per_rank"
    return Case(name, {key: gaussians, "cameras_per_rank": cameras_per_rank,
                       "image_size": image_size, "scale": scale, "focal": focal, **extra}, note=note)


PROBLEM = Problem(
    name="gsplat_3d_gaussian_splatting", version=1, upstream_id=61, category="beyond_llm",
    source="gsplat (nerfstudio) rasterization(packed=True, distributed=True): projection + camera-owner exchange",
    world_sizes=(2, 4, 8),
    tests=[
        _case("skewed_cameras", (37, 5, 60, 21), (2, 0, 1, 3), note="a rank without cameras receives nothing"),
        _case("empty_shard_wide_fov", (0, 44, 13), (1, 2), image_size=(31, 57), scale=0.2, focal=0.6,
              note="rank 0 holds no Gaussians; large, anisotropic splats"),
    ],
    benchmarks=[
        _case("mipnerf360_garden_1m", 1_000_000, (1,), image_size=(1297, 840), scale=0.01, focal=1.1),
        _case("catalog_512x512_1m", 1_000_000, (1,), image_size=(512, 512), scale=0.01),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
