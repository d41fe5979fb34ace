"""Distributed 3D Gaussian splatting projection (gsplat ``rasterization(..., packed=True, distributed=True)``,
the projection and exchange stages): every rank holds a shard of the Gaussians and its own cameras;
cameras are all-gathered, every rank projects its Gaussians into every camera, and the visible
(camera, Gaussian) records are sent to the rank that owns the camera.

Per rank: means [N_r, 3], quats [N_r, 4] (w, x, y, z; not normalised), scales [N_r, 3], opacities [N_r],
colors [N_r, 3] (bf16 in every run precision, as upstream's factory makes them; N_r >= 1 differs per rank),
viewmats [C, 4, 4] (world-to-camera), Ks [C, 3, 3] (bf16; C >= 1 cameras, the same number on every rank),
image_width, image_height, eps2d, near_plane, far_plane, camera_model='pinhole'
  ->  (camera_ids [n] int64 (index among this rank's cameras), gaussian_ids [n] int64, radii [n, 2] int32,
       means2d [n, 2], depths [n], conics [n, 3], opacities [n], colors [n, 3] (the input dtype)) for every
      visible pair whose camera is on this rank, ordered by source rank, then camera, then Gaussian.
      gaussian_ids is the sender's local index plus the number of Gaussians on the ranks before the
      *receiving* rank (the upstream reference's offset, kept as it is).

Projection (gsplat's torch ``fully_fused_projection``; computed in the inputs' dtype, step by step as
upstream's reference computes it, so it rounds where upstream's does):
  mean_c = R mean + t; cov3d = (Rq S)(Rq S)^T with Rq the rotation of the normalised quaternion and
  S = diag(scales); cov_c = R cov3d R^T; with the camera-space x/z clamped to the field of view widened
  by 0.3*tan(fov/2) on each side (gsplat's persp_proj), J = [[fx/z, 0, -fx x/z^2], [0, fy/z, -fy y/z^2]],
  cov2d = J cov_c J^T + eps2d*I = [[a, b1], [b2, c]]; mean2d = (fx x + cx z, fy y + cy z) / z (unclamped
  x, y); depth = z; det = max(a*c - b1*b2, 1e-10); conic = (c, -(b1 + b2)/2, a) / det;
  radii = ceil(3.33 * sqrt((a, c))).
  A pair is visible when near_plane < z < far_plane and the box mean2d +- radii meets the image
  (mean2d + radius > 0 and mean2d - radius < size on both axes).

No knife edges: the integer radii and the visibility test are discrete decisions, and the inputs are bf16
(the reference computes in bf16, as upstream's: up to 3 % off in 3.33*sqrt(a)). make_inputs draws a pool
of Gaussians and keeps those whose every decision, in every camera, sits a safe relative distance (6 % for
3.33*sqrt(a), 1 % for positions) from its threshold, computed in fp64 from the values as stored. The
splats are therefore small in every case (radius 2, sub-pixel, as upstream's; radius 3 in one test: a 6 %
margin leaves no room for larger radii in every camera of a case); and a visible splat's centre stays 20 %
of the image size away from 0 (bf16 means2d are ~2 px off anywhere, so near 0 no relative tolerance could
judge them).
The tests vary what bf16 leaves free: per-rank counts (down to one Gaussian), cameras per rank, image
sizes and fields of view, Gaussians outside some views, behind some cameras and before the near plane.
Tolerance: bf16 float outputs atol = rtol = 0.05 (this bf16 projection against one in fp32, cast once:
conics up to 0.03 off, means2d up to 1.3 %, depths 0.7 %; a kernel may compute in fp32).

Cost: the visible records (camera id, Gaussian id: 2 int64; 2 int32 radii; 10 floats) go to the camera's
owner; counted as if every Gaussian were visible in every camera (an upper bound: the visible fraction
depends on the scene): link = (W-1)/W * N_r * C*W * (24 + 10*2) bytes, plus the cameras' all-gather
(25 floats a camera). flops: ~200 per (Gaussian, camera) pair for the covariance, projection and conic.
HBM: read the Gaussians (14 floats) once per camera and write the records.

Cases: ``upstream`` is the upstream benchmark's input (1024 bf16 Gaussians and one camera per rank,
512x512, eps2d 0.3, near 0.01, far 1e10, 'pinhole'). Benchmarks: gsplat's distributed training
splits scenes of ~1M Gaussians (Mip-NeRF 360 scenes reach 3-6M) over the GPUs, one camera per GPU per
step, at 1297x840 (Mip-NeRF 360 garden at 1/4 resolution) and at the catalog's 512x512 (sub-pixel
splats, as bf16 requires: the projection and exchange cost the same whatever the splats' size).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, default_tolerance, randn
from pkb.problems.beyond_llm._common import all_gather_rows, all_gather_sizes, all_to_all_rows, exchange_counts

_RADIUS_EXTENT = 3.33
_FLOATS_PER_RECORD = 10  # means2d 2, depth 1, conic 3, opacity 1, color 3
_FLOPS_PER_PAIR = 200
_DTYPE = torch.bfloat16  # the inputs' dtype in every run precision: upstream's factory makes them bf16
# How far (relative) every discrete decision must sit from its threshold: about twice the largest error
# seen in the upstream reference's bf16 projection (3.33*sqrt(a): 2.7 %; means2d: 0.3 % of |mean2d| + the
# image size, since it divides fx*x + cx*z by z).
_SAFE_RADIUS = 0.06
_SAFE_POSITION = 0.01
# bf16 means2d are off by up to ~2 px anywhere: a visible splat's centre keeps this fraction of the image
# size away from 0 on each axis, so that a relative tolerance can judge it.
_CENTRE_CLEARANCE = 0.2


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


def _cameras(case, world_size, gen):
    """Every rank's cameras (drawn from ``gen.shared``): viewmats [W*C, 4, 4], Ks [W*C, 3, 3], fp32."""
    num = case["cameras_per_rank"] * world_size
    width, height = case["image_size"]
    direction = randn(gen.shared, num, 3)
    distance = 3.0 + torch.rand(num, 1, generator=gen.shared, device=gen.device)
    viewmats = _look_at(direction / direction.norm(dim=1, keepdim=True) * distance)
    focal = case["focal"] * width * (1 + 0.1 * torch.rand(num, generator=gen.shared, device=gen.device))
    Ks = torch.zeros(num, 3, 3, device=gen.device)
    Ks[:, 0, 0], Ks[:, 1, 1] = focal, focal
    Ks[:, 0, 2], Ks[:, 1, 2], Ks[:, 2, 2] = width / 2, height / 2, 1.0
    return viewmats, Ks


def _safe(means, quats, scales, viewmats, Ks, case):
    """(safe [P], visible somewhere [P]): Gaussians whose decisions in every camera are far from a tie."""
    width, height = case["image_size"]
    near, margin, position_margin = case.get("near_plane", 0.01), _SAFE_RADIUS, _SAFE_POSITION
    radius_arg, means2d, depths, _ = _project(*(t.double() for t in (means, quats, scales, viewmats, Ks)),
                                              width, height, case.get("eps2d", 0.3))
    radii, visible = _decide(radius_arg, means2d, depths, width, height, near, 1e10)
    in_depth = depths > near
    safe_depth = (depths - near).abs() > position_margin * (depths.abs() + near)
    safe_radius = ((radius_arg - radius_arg.round()).abs() > margin * radius_arg).all(-1)
    radii = radii.double()
    edges = torch.stack([means2d[..., 0] + radii[..., 0], means2d[..., 0] - radii[..., 0] - width,
                         means2d[..., 1] + radii[..., 1], means2d[..., 1] - radii[..., 1] - height], -1)
    size = torch.tensor([width, height], dtype=means2d.dtype, device=means2d.device)
    scale = (means2d.abs() + radii + size).repeat_interleave(2, dim=-1)  # x, x, y, y
    safe_box = (edges.abs() > position_margin * scale).all(-1)
    safe_centre = ~visible | (means2d.abs() >= _CENTRE_CLEARANCE * size).all(-1)
    safe = safe_depth & (~in_depth | (safe_radius & safe_box & safe_centre))
    return safe.all(0), visible.any(0)


def make_inputs(case, rank, world_size, gen):
    """This rank's Gaussians, kept from a larger pool: the first safe one visible somewhere, then the next
    safe ones in pool order (every rank then sends at least one record, as upstream needs)."""
    dtype = _DTYPE
    num = gaussian_counts(case, world_size)[rank]
    cameras = case["cameras_per_rank"]
    all_viewmats, all_Ks = (t.to(dtype) for t in _cameras(case, world_size, gen))
    pool = int(num * case.get("pool", 1.25)) + 64
    means = randn(gen, pool, 3, scale=case.get("spread", 1.0), dtype=dtype)
    quats = randn(gen, pool, 4, dtype=dtype)
    scales = (torch.exp(randn(gen, pool, 3, scale=case.get("scale_spread", 0.5))) * case["scale"]).to(dtype)
    opacities = torch.sigmoid(randn(gen, pool)).to(dtype)
    colors = torch.rand(pool, 3, generator=gen, device=gen.device).to(dtype)
    safe, visible = _safe(means, quats, scales, all_viewmats, all_Ks, case)
    first = (safe & visible).nonzero().flatten()
    rest = safe.nonzero().flatten()
    if first.numel() == 0 or rest.numel() < num:
        raise ValueError(f"case {case.name!r}: too few safe Gaussians ({rest.numel()} of {pool}, {num} needed)")
    keep = torch.cat([first[:1], rest[rest != first[0]][: num - 1]])
    mine = slice(rank * cameras, (rank + 1) * cameras)
    width, height = case["image_size"]
    return (means[keep], quats[keep], scales[keep], opacities[keep], colors[keep],
            all_viewmats[mine].contiguous(), all_Ks[mine].contiguous(), width, height, case.get("eps2d", 0.3),
            case.get("near_plane", 0.01), 1e10, "pinhole")


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed; bf16): uniform means (x, y in [-0.75, 0.75), depth in [2, 4)), normal quats,
    uniform scales, opacities and colors; one identity camera with focal ``focal * min(size)``, centred."""
    num, (width, height) = gaussian_counts(case, world_size)[rank], case["image_size"]
    means = torch.empty((num, 3), dtype=_DTYPE, device=device)
    means[:, 0] = (torch.rand(num, dtype=_DTYPE, device=device) - 0.5) * 1.5
    means[:, 1] = (torch.rand(num, dtype=_DTYPE, device=device) - 0.5) * 1.5
    means[:, 2] = torch.rand(num, dtype=_DTYPE, device=device) * 2.0 + 2.0
    quats = torch.randn((num, 4), dtype=_DTYPE, device=device)
    scales = torch.rand((num, 3), dtype=_DTYPE, device=device) * 0.02
    opacities = torch.rand((num,), dtype=_DTYPE, device=device) * 0.8 + 0.1
    colors = torch.rand((num, 3), dtype=_DTYPE, device=device)
    viewmats = torch.eye(4, dtype=_DTYPE, device=device).reshape(1, 4, 4).contiguous()
    Ks = torch.eye(3, dtype=_DTYPE, device=device).reshape(1, 3, 3).contiguous()
    focal = case["focal"] * float(min(width, height))
    Ks[:, 0, 0], Ks[:, 1, 1] = focal, focal
    Ks[:, 0, 2], Ks[:, 1, 2] = width * 0.5, height * 0.5
    return (means, quats, scales, opacities, colors, viewmats, Ks, width, height, case.get("eps2d", 0.3),
            case.get("near_plane", 0.01), 1e10, "pinhole")


def _quat_to_rotation(quats: torch.Tensor) -> torch.Tensor:
    w, x, y, z = torch.nn.functional.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([
        1 - 2 * (y**2 + z**2), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x**2 + z**2), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x**2 + y**2),
    ], dim=-1).view(*quats.shape[:-1], 3, 3)


def _project(means, quats, scales, viewmats, Ks, width, height, eps2d):
    """Every (camera, Gaussian) pair, in the inputs' dtype: (3.33*sqrt((a, c)) [C, N, 2], means2d [C, N, 2],
    depths [C, N], conics [C, N, 3]).

    Each step rounds where upstream's reference (gsplat's torch projection) rounds: the same operations
    in the same order, the einsums as upstream writes them (each accumulates in fp32 inside)."""
    rotation, translation = viewmats[:, :3, :3], viewmats[:, :3, 3]
    mean_c = torch.einsum("cij,nj->cni", rotation, means) + translation[:, None, :]
    rs = _quat_to_rotation(quats) * scales[:, None, :]
    cov3d = torch.einsum("nij,nkj->nik", rs, rs)
    cov_c = torch.einsum("cij,njk,clk->cnil", rotation, cov3d, rotation)
    tx, ty, tz = mean_c.unbind(-1)
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    tan_fov_x, tan_fov_y = 0.5 * width / fx, 0.5 * height / fy
    x_max, x_min = (width - cx) / fx + 0.3 * tan_fov_x, -(cx / fx + 0.3 * tan_fov_x)
    y_max, y_min = (height - cy) / fy + 0.3 * tan_fov_y, -(cy / fy + 0.3 * tan_fov_y)
    clamped_x = tz * torch.clamp(tx / tz, min=x_min, max=x_max)
    clamped_y = tz * torch.clamp(ty / tz, min=y_min, max=y_max)
    zeros, tz2 = torch.zeros_like(tz), tz**2
    jacobian = torch.stack([fx / tz, zeros, -fx * clamped_x / tz2,
                            zeros, fy / tz, -fy * clamped_y / tz2], dim=-1).view(*tz.shape, 2, 3)
    cov2d = torch.einsum("cnij,cnjk,cnkl->cnil", jacobian, cov_c, jacobian.transpose(-1, -2))
    cov2d = cov2d + torch.eye(2, device=cov2d.device, dtype=cov2d.dtype) * eps2d
    a, c = cov2d[..., 0, 0], cov2d[..., 1, 1]
    det = (a * c - cov2d[..., 0, 1] * cov2d[..., 1, 0]).clamp(min=1e-10)
    conics = torch.stack([c / det, -(cov2d[..., 0, 1] + cov2d[..., 1, 0]) / 2.0 / det, a / det], dim=-1)
    means2d = torch.einsum("cij,cnj->cni", Ks[:, :2, :3], mean_c) / tz[..., None]  # (fx x + cx z, fy y + cy z) / z
    return _RADIUS_EXTENT * torch.sqrt(torch.stack([a, c], dim=-1)), means2d, tz, conics


def _decide(radius_arg, means2d, depths, width, height, near_plane, far_plane):
    """(radii [C, N, 2] int32, visible [C, N]) from the projection."""
    radius = torch.ceil(radius_arg)
    visible = (depths > near_plane) & (depths < far_plane) & (radius > 0).all(-1)
    visible &= (means2d[..., 0] + radius[..., 0] > 0) & (means2d[..., 0] - radius[..., 0] < width)
    visible &= (means2d[..., 1] + radius[..., 1] > 0) & (means2d[..., 1] - radius[..., 1] < height)
    return radius.to(torch.int32), visible


def reference(means, quats, scales, opacities, colors, viewmats, Ks, image_width, image_height, eps2d=0.3,
              near_plane=0.01, far_plane=1e10, camera_model="pinhole"):
    if camera_model != "pinhole":
        raise ValueError(f"only the pinhole camera model is part of this problem, got {camera_model!r}")
    world_size = dist.get_world_size()
    device, dtype = means.device, means.dtype
    num_cameras = viewmats.shape[0]  # the same on every rank
    all_viewmats, _ = all_gather_rows(viewmats)
    all_Ks, _ = all_gather_rows(Ks)
    gaussians_before = torch.tensor([0] + all_gather_sizes(means.shape[0], device), device=device).cumsum(0)
    radius_arg, means2d, depths, conics = _project(means, quats, scales, all_viewmats, all_Ks, image_width,
                                                   image_height, eps2d)  # in the inputs' dtype, as upstream
    radii, visible = _decide(radius_arg, means2d, depths, image_width, image_height, near_plane, far_plane)
    camera_ids, gaussian_ids = visible.nonzero(as_tuple=True)  # camera-major: grouped by owner already
    owner = camera_ids // num_cameras
    send_counts = torch.bincount(owner, minlength=world_size).tolist()
    recv_counts = exchange_counts(send_counts, device)
    ids = torch.stack([camera_ids - owner * num_cameras, gaussian_ids + gaussians_before[owner]], dim=1)
    radii = radii[camera_ids, gaussian_ids]
    floats = torch.cat([means2d[camera_ids, gaussian_ids], depths[camera_ids, gaussian_ids, None],
                        conics[camera_ids, gaussian_ids], opacities.float()[gaussian_ids, None],
                        colors.float()[gaussian_ids]], dim=1)
    ids = all_to_all_rows(ids, send_counts, recv_counts)
    radii = all_to_all_rows(radii, send_counts, recv_counts)
    floats = all_to_all_rows(floats, send_counts, recv_counts).to(dtype)
    return (ids[:, 0].contiguous(), ids[:, 1].contiguous(), radii, floats[:, 0:2].contiguous(),
            floats[:, 2].contiguous(), floats[:, 3:6].contiguous(), floats[:, 6].contiguous(),
            floats[:, 7:10].contiguous())


def tolerance(case, world_size, dtype):
    """bf16 float outputs: the reference (as upstream's) computes the whole projection in bf16 (a dozen
    roundings); a projection in fp32 differs from it by up to ~3 % in conics and means2d. Integers: exact."""
    if dtype == torch.bfloat16:
        return Tolerance(atol=0.05, rtol=0.05)
    return default_tolerance(dtype)


def cost(case, world_size):
    cameras = case["cameras_per_rank"]
    per_rank_gaussians = gaussian_counts(case, world_size)
    total_cameras = cameras * world_size
    num = max(per_rank_gaussians)
    record_bytes = 2 * 8 + 2 * 4 + _FLOATS_PER_RECORD * _DTYPE.itemsize
    link = (world_size - 1) / world_size * num * total_cameras * record_bytes + total_cameras * 25 * 4
    return Cost(link_bytes=link, flops=_FLOPS_PER_PAIR * num * total_cameras,
                hbm_bytes=num * total_cameras * (14 * 4 + record_bytes), pattern="all_gather+all_to_all")


def _case(name, gaussians, cameras_per_rank, image_size=(64, 48), scale=2e-3, focal=1.0, **extra):
    """``gaussians``: an int (the scene's total, split evenly) or a tuple (a per-rank pattern)."""
    note, tags = extra.pop("note", ""), extra.pop("tags", ())
    key = "gaussians_total" if isinstance(gaussians, int) else "gaussians_per_rank"
    return Case(name, {key: gaussians, "cameras_per_rank": cameras_per_rank, "image_size": image_size,
                       "scale": scale, "focal": focal, **extra}, note=note, tags=tags)


PROBLEM = Problem(
    name="gsplat_3d_gaussian_splatting", version=4, upstream_id=61, category="beyond_llm",
    source="gsplat (nerfstudio) rasterization(packed=True, distributed=True): projection + camera-owner exchange",
    world_sizes=(2, 4, 8),
    upstream=[
        _case("upstream", (1024,), 1, image_size=(512, 512), scale=2e-4, focal=0.8, spread=0.5, scale_spread=0.3,
              pool=1.5, note="sub-pixel splats: bf16 decides only radius 2 reproducibly"),
    ],
    tests=[
        _case("skewed_gaussians_two_cameras", (37, 5, 60, 21), 2, scale_spread=0.3, pool=8.0,
              note="uneven Gaussian shards, two cameras a rank; some Gaussians fall outside some views",
              tags=("uneven_sizes", "odd_sizes", "shape_regime")),
        _case("one_gaussian_wide_fov", (1, 44, 13), 1, image_size=(31, 57), focal=0.6, scale_spread=0.3, pool=3.0,
              note="a rank with a single Gaussian; a wide field of view on an odd, tall image",
              tags=("tiny", "uneven_sizes", "odd_sizes")),
        _case("radius3_splats", (29, 64, 7), 1, spread=0.7, scale=0.025, scale_spread=0.1, pool=6.0,
              note="splats of radius 3 (upstream's are all radius 2)",
              tags=("special_values", "uneven_sizes", "odd_sizes")),
        _case("behind_cameras_near_plane", (9, 23, 4), 1, spread=2.5, near_plane=1.0, scale_spread=0.3, pool=3.0,
              note="Gaussians behind some cameras, before the near plane (1.0) and outside most views",
              tags=("argument_value", "uneven_sizes", "odd_sizes")),
    ],
    benchmarks=[
        _case("mipnerf360_garden_1m", 1_000_000, 1, image_size=(1297, 840), scale=2e-4, focal=1.1, scale_spread=0.3,
              pool=1.5),
        _case("catalog_512x512_1m", 1_000_000, 1, image_size=(512, 512), scale=2e-4, scale_spread=0.3, pool=1.5),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
