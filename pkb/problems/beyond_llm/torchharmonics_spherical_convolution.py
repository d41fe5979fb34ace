"""Distributed DISCO convolution on the sphere (torch-harmonics ``DistributedDiscreteContinuousConvS2``):
the lat/lon grid is split over a polar x azimuth process mesh; the filter-basis contraction needs whole
longitude rings, so channels and longitudes are swapped across the azimuth group (an all-to-all), the
contraction's partial sums over each rank's input latitudes are reduced over the polar group, and the
result is swapped back before the channel mixing with the weights.

Process mesh: A = 2 azimuth ranks, P = W/2 polar ranks; rank = p*A + a (azimuth group p: ranks p*A..p*A+1,
polar group a: ranks a, A+a, 2A+a, ...). make_inputs passes this rank's two groups (built once per
process, every rank creating every group in the same order); a group left None means the default group.

Per rank (p, a): x [B, C, nlat_in/P, nlon_in/A] fp32 (latitude band p, longitude band a),
psi: a coalesced sparse COO tensor [K, nlat_out, (nlat_in/P)*nlon_in] fp32, the filter basis restricted
to this rank's input latitudes (column j*nlon_in + i: local latitude j, longitude i), weight
[C_out, C/groups, K], groups, nlon_out, nlon_in, azimuth_group, polar_group, bias [C_out]
  ->  [B, C_out, nlat_out/P, nlon_out/A] fp32: latitude band p, longitude band a of
      y[b, o, h, w] = bias[o] + sum_{c in o's group, k} weight[o, c, k] * S[b, c, k, h, w],
      S[b, c, k, h, w] = sum over the nonzeros (k, h, j*nlon_in + i) of psi of all polar ranks of
      value * x_global[b, c, j, (i + w*nlon_in/nlon_out) % nlon_in]
(torch-harmonics' ``_disco_s2_contraction_torch``: the basis is rolled by nlon_in/nlon_out longitudes
per output longitude). C, nlon_in, nlon_out are divisible by A; nlat_in, nlat_out by P.

Cost: the two azimuth all-to-alls move (A-1)/A of the local input and of the contracted tensor
[B, C/A, K, nlat_out/P, nlon_out]; the polar reduction needs at least a reduce-scatter of the partial
contraction [B, C/A, K, nlat_out, nlon_out]: (P-1)/P of it (4-byte elements). flops: 2*nnz/P*nlon_out*B*C/A
for the contraction (nnz of the whole basis), plus 2*B*C_out*(C/groups)*K*(nlat_out/P)*(nlon_out/A) for the
weights. HBM: read x and the basis, write the output and the contracted tensor twice.

The basis used here is a stand-in with torch-harmonics' structure: K basis functions, each output
latitude supported on the 2r+1 input latitudes around it and 2L+1 longitudes around 0; the ``upstream``
case has upstream's pattern instead (on every rank, for each basis function k and output latitude h, 4
nonzeros at one local latitude and longitudes h + e*(k + 1), e = 0..3: 3 x 128 x 4 = 1,536).

Cases: ``upstream`` is the upstream benchmark's input (x [32, 8, 128/P, 128], psi [3, 128, (128/P)*256]
with 1,536 nonzeros, weight [8, 8, 3], groups 1, nlon 256 -> 256, bias [8]; all fp32 in every run
precision, as upstream's factory makes them). Benchmarks: a DISCO encoder that downsamples
ERA5 at 0.25 degrees (720x1440, the 721st row dropped so the polar split is even) to 360x720 with 64
channels (``era5_720x1440_to_360x720_c64``), and the upstream catalog's 128x256 grid, batch 32, 8
channels (``catalog_128x256_b32_c8``).
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, upstream_seed
from pkb.problems.beyond_llm._fft import transpose

AZIMUTH_RANKS = 2
_GROUPS: dict[tuple[int, ...], object] = {}


def mesh_groups():
    """(azimuth group, polar group) of this rank, built once per process for every mesh row and column;
    (None, None) outside a process group (e.g. when only the shapes of the inputs are shown)."""
    if not dist.is_initialized():
        return None, None
    world_size, rank = dist.get_world_size(), dist.get_rank()
    num_polar = world_size // AZIMUTH_RANKS
    rows = [tuple(p * AZIMUTH_RANKS + a for a in range(AZIMUTH_RANKS)) for p in range(num_polar)]
    columns = [tuple(p * AZIMUTH_RANKS + a for p in range(num_polar)) for a in range(AZIMUTH_RANKS)]
    for ranks in rows + columns:  # every rank creates every group, in the same order
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[rows[rank // AZIMUTH_RANKS]], _GROUPS[columns[rank % AZIMUTH_RANKS]]


def _upstream_support(case, num_polar):
    """Upstream's basis pattern: each polar band holds, for every (kernel k, output latitude h), ``entries``
    nonzeros at its local latitude (h - band start) mod band and longitudes (h + e*(k + 1)) mod nlon_in."""
    nlat_in, nlat_out = case["nlat"]
    band = nlat_in // num_polar
    kernel, rows, polar, entry = torch.meshgrid(torch.arange(case["kernel_size"]), torch.arange(nlat_out),
                                                torch.arange(num_polar), torch.arange(case["entries"]), indexing="ij")
    lat_in = polar * band + (rows - polar * band) % band
    lon = (rows + entry * (kernel + 1)) % case["nlon"][0]
    return kernel.flatten(), rows.flatten(), lat_in.flatten(), lon.flatten()


def basis_support(case, world_size):
    """(kernel, lat_out, lat_in, lon_offset) of every nonzero of the whole basis, as int64 columns."""
    if case.get("support") == "upstream":
        return _upstream_support(case, world_size // AZIMUTH_RANKS)
    nlat_in, nlat_out = case["nlat"]
    radius, lon_radius = case["lat_radius"], case["lon_radius"]
    lat_out = torch.arange(nlat_out)
    centre = (lat_out * nlat_in) // nlat_out
    lat_in = centre.view(-1, 1) + torch.arange(-radius, radius + 1).view(1, -1)
    rows = lat_out.view(-1, 1).expand_as(lat_in)
    keep = (lat_in >= 0) & (lat_in < nlat_in)
    rows, lat_in = rows[keep], lat_in[keep]
    offsets = torch.arange(-lon_radius, lon_radius + 1) % case["nlon"][0]
    num_k, num_pairs, num_offsets = case["kernel_size"], rows.numel(), offsets.numel()
    kernel = torch.arange(num_k).repeat_interleave(num_pairs * num_offsets)
    rows = rows.repeat_interleave(num_offsets).repeat(num_k)
    lat_in = lat_in.repeat_interleave(num_offsets).repeat(num_k)
    lon = offsets.repeat(num_pairs * num_k)
    return kernel, rows, lat_in, lon


def make_inputs(case, rank, world_size, gen):
    num_polar = world_size // AZIMUTH_RANKS
    polar = rank // AZIMUTH_RANKS  # x below is longitude band rank % AZIMUTH_RANKS of latitude band polar
    nlat_in, nlat_out = case["nlat"]
    nlon_in, nlon_out = case["nlon"]
    channels, channels_out, groups, num_k = case["channels"], case["channels_out"], case["groups"], case["kernel_size"]
    lat_band = nlat_in // num_polar
    x = randn(gen, case["batch"], channels, lat_band, nlon_in // AZIMUTH_RANKS)
    kernel, rows, lat_in, lon = (t.to(gen.device) for t in basis_support(case, world_size))
    per_row = kernel.numel() / (num_k * nlat_out)  # nonzeros of one basis function at one output latitude
    values = randn(gen.shared, kernel.numel(), scale=per_row ** -0.5)
    mine = (lat_in >= polar * lat_band) & (lat_in < (polar + 1) * lat_band)
    psi_idx = torch.stack([kernel[mine], rows[mine], (lat_in[mine] - polar * lat_band) * nlon_in + lon[mine]])
    psi = torch.sparse_coo_tensor(psi_idx, values[mine], (num_k, nlat_out, lat_band * nlon_in),
                                  check_invariants=True).coalesce()
    weight = randn(gen.shared, channels_out, channels // groups, num_k, scale=(channels // groups * num_k) ** -0.5)
    bias = randn(gen.shared, channels_out)
    azimuth_group, polar_group = mesh_groups()
    return x, psi, weight, groups, nlon_out, nlon_in, azimuth_group, polar_group, bias


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: the mesh's groups built first, then seeded, N(0, 1) fp32 x, weight and bias, then the basis
    values (N(0, 1) * 0.05) on upstream's pattern (``_upstream_support``) in its order."""
    azimuth_group, polar_group = mesh_groups()
    upstream_seed(PROBLEM.upstream_id, rank, trial)
    num_polar, polar = world_size // AZIMUTH_RANKS, rank // AZIMUTH_RANKS
    (nlat_in, nlat_out), (nlon_in, nlon_out) = case["nlat"], case["nlon"]
    channels, groups, num_k, lat_band = case["channels"], case["groups"], case["kernel_size"], nlat_in // num_polar
    x = torch.randn((case["batch"], channels, lat_band, nlon_in // AZIMUTH_RANKS), dtype=torch.float32, device=device)
    weight = torch.randn((case["channels_out"], channels // groups, num_k), dtype=torch.float32, device=device)
    bias = torch.randn((case["channels_out"],), dtype=torch.float32, device=device)
    kernel, rows, lat_in, lon = _upstream_support(case, num_polar)  # (k, h, polar, entry) order
    mine = lat_in // lat_band == polar
    psi_idx = torch.stack([kernel[mine], rows[mine], (lat_in[mine] - polar * lat_band) * nlon_in + lon[mine]])
    values = torch.randn((psi_idx.shape[1],), dtype=torch.float32, device=device) * 0.05
    psi = torch.sparse_coo_tensor(psi_idx.to(device), values, size=(num_k, nlat_out, lat_band * nlon_in),
                                  device=device).coalesce()
    return x, psi, weight, groups, nlon_out, nlon_in, azimuth_group, polar_group, bias


def _contract(x, psi_idx, psi_vals, size, nlon_out):
    """[B, C, lat_band, nlon_in] -> [B, C, K, nlat_out, nlon_out]: partial sums over this band's latitudes."""
    batch, channels, lat_band, nlon_in = x.shape
    num_k, nlat_out, _ = size
    stride = nlon_in // nlon_out
    kernel, lat_out, column = psi_idx
    lat_in, lon_offset = column // nlon_in, column % nlon_in
    rings = x.reshape(batch * channels, lat_band, nlon_in).permute(1, 2, 0)  # [lat_band, nlon_in, B*C]
    out = x.new_zeros(num_k * nlat_out, nlon_out * batch * channels)
    offsets = torch.unique(lon_offset).tolist()
    if len(offsets) * lat_band > lon_offset.numel():  # few nonzeros per offset: gather per nonzero instead
        longitudes = (lon_offset.view(-1, 1) + stride * torch.arange(nlon_out, device=x.device)) % nlon_in
        for part in torch.arange(lon_offset.numel(), device=x.device).split(256):
            gathered = rings[lat_in[part].view(-1, 1), longitudes[part]]  # [part, nlon_out, B*C]
            out.index_add_(0, kernel[part] * nlat_out + lat_out[part],
                           (gathered * psi_vals[part].view(-1, 1, 1)).reshape(part.numel(), -1))
        return out.view(num_k, nlat_out, nlon_out, batch, channels).permute(3, 4, 0, 1, 2)
    for offset in offsets:  # one sparse matmul per longitude offset of the basis
        sel = lon_offset == offset
        basis = torch.sparse_coo_tensor(torch.stack([kernel[sel] * nlat_out + lat_out[sel], lat_in[sel]]),
                                        psi_vals[sel], (num_k * nlat_out, lat_band), check_invariants=False)
        longitudes = (offset + stride * torch.arange(nlon_out, device=x.device)) % nlon_in
        out += torch.sparse.mm(basis, rings[:, longitudes].reshape(lat_band, -1))
    out = out.view(num_k, nlat_out, nlon_out, batch, channels)
    return out.permute(3, 4, 0, 1, 2)


def reference(x, psi, weight, groups, nlon_out, nlon_in, azimuth_group=None, polar_group=None, bias=None):
    azimuth_group = azimuth_group or dist.group.WORLD
    polar_group = polar_group or dist.group.WORLD
    psi = psi.coalesce()
    psi_idx, psi_vals, size = psi.indices(), psi.values(), psi.shape
    num_polar, polar = dist.get_world_size(polar_group), dist.get_rank(polar_group)
    x = transpose(x.float(), split_dim=1, gather_dim=-1, group=azimuth_group)  # channels split, longitudes whole
    contracted = _contract(x, psi_idx, psi_vals.float(), size, nlon_out).contiguous()
    dist.all_reduce(contracted, group=polar_group)
    contracted = contracted.chunk(num_polar, dim=3)[polar]
    contracted = transpose(contracted, split_dim=-1, gather_dim=1, group=azimuth_group)  # longitudes split
    batch, channels, num_k, lat_band, lon_band = contracted.shape
    grouped = contracted.reshape(batch, groups, channels // groups, num_k, lat_band, lon_band)
    w = weight.float().reshape(groups, -1, weight.shape[1], weight.shape[2])
    out = torch.einsum("bgckxy,gock->bgoxy", grouped, w).reshape(batch, -1, lat_band, lon_band)
    if bias is not None:
        out = out + bias.float().view(1, -1, 1, 1)
    return out.to(x.dtype)


def cost(case, world_size):
    num_azimuth, num_polar = AZIMUTH_RANKS, world_size // AZIMUTH_RANKS
    (nlat_in, nlat_out), (nlon_in, nlon_out) = case["nlat"], case["nlon"]
    batch, channels, channels_out = case["batch"], case["channels"], case["channels_out"]
    num_k = case["kernel_size"]
    nnz = basis_support(case, world_size)[0].numel()
    x_local = batch * channels * (nlat_in // num_polar) * (nlon_in // num_azimuth) * 4
    partial = batch * (channels // num_azimuth) * num_k * nlat_out * nlon_out * 4
    swapped_back = partial / num_polar
    link = ((num_azimuth - 1) / num_azimuth * (x_local + swapped_back)
            + (num_polar - 1) / num_polar * partial)
    flops = (2 * nnz / num_polar * nlon_out * batch * channels / num_azimuth
             + 2 * batch * channels_out * (channels // case["groups"]) * num_k
             * (nlat_out // num_polar) * (nlon_out // num_azimuth))
    out_bytes = batch * channels_out * (nlat_out // num_polar) * (nlon_out // num_azimuth) * 4
    return Cost(link_bytes=link, flops=flops, hbm_bytes=x_local + nnz / num_polar * 20 + out_bytes + 2 * swapped_back,
                pattern="all_to_all+reduce_scatter")


def _case(name, batch, channels, channels_out, nlat, nlon, groups=1, kernel_size=3, lat_radius=1, lon_radius=2,
          note="", tags=(), **extra):
    return Case(name, {"batch": batch, "channels": channels, "channels_out": channels_out, "nlat": nlat,
                       "nlon": nlon, "groups": groups, "kernel_size": kernel_size, "lat_radius": lat_radius,
                       "lon_radius": lon_radius, **extra}, note=note, tags=tags)


PROBLEM = Problem(
    name="torchharmonics_spherical_convolution", version=3, upstream_id=62, category="beyond_llm",
    source="torch-harmonics DistributedDiscreteContinuousConvS2 (azimuth all-to-all, polar all-reduce)",
    world_sizes=(2, 4, 8),
    upstream=[_case("upstream", 32, 8, 8, (128, 128), (256, 256), support="upstream", entries=4,
                    note="upstream's basis pattern: 3 x 128 x 4 nonzeros on every rank")],
    tests=[
        _case("same_grid_odd_out", 2, 4, 3, (8, 8), (10, 10), note="3 output channels; lon offsets wrap",
              tags=("odd_sizes", "shape_regime")),
        _case("downsample_grouped", 1, 4, 6, (8, 4), (20, 10), groups=2, kernel_size=2, lat_radius=2,
              lon_radius=1, note="nlon 20 -> 10 (the basis rolls by 2); two channel groups",
              tags=("argument_value", "shape_regime")),
    ],
    benchmarks=[
        _case("era5_720x1440_to_360x720_c64", 1, 64, 64, (720, 360), (1440, 720), lat_radius=2),
        _case("catalog_128x256_b32_c8", 32, 8, 8, (128, 128), (256, 256)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
