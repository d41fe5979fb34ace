"""The beyond-LLM problems: cost() of one case each against numbers worked out by hand, and honest
alternative kernels (gather everything, compute globally with a different algorithm) that must match
the references exactly where the problems define tie rules and exact outputs.

The alternative kernels run through the evaluator on CPU at W=2 and 4 (a few seconds each).
"""

from __future__ import annotations

import textwrap

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.evaluator import EvalConfig, evaluate
from pkb.problem import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode


def cost_of(slug: str, case_name: str, world_size: int):
    problem = get_problem(slug)
    return problem.cost(problem.find_case(case_name), world_size)


# -- cost(), by hand ---------------------------------------------------------------------------------


def test_feature_exchange_forward_cost():
    cost = cost_of("gnn_feature_exchange_all2all", "skewed_odd_dim", 2)
    # 37 rows of 19 bf16 (38 bytes) = 1406 bytes sent, half of it off-rank; HBM 4x.
    assert cost.link_bytes == pytest.approx(703.0)
    assert cost.hbm_bytes == pytest.approx(5624.0)


def test_feature_exchange_backward_cost():
    cost = cost_of("gnn_feature_exchange_all2all_backward", "skewed_odd_dim", 4)
    # 41 rows of 13 fp32 = 2132 bytes, 3/4 off-rank; 533 adds; 3*2132 + 2*9*52 HBM.
    assert cost.link_bytes == pytest.approx(1599.0)
    assert cost.flops == pytest.approx(533.0)
    assert cost.hbm_bytes == pytest.approx(6396.0 + 936.0)


def test_sparse_embedding_cost():
    cost = cost_of("gnn_sparse_embedding_all2all", "skewed_owners", 4)
    # 45 pairs of (8-byte id + 7 bf16) = 990 bytes, 3/4 off-rank.
    assert cost.link_bytes == pytest.approx(742.5)
    assert cost.hbm_bytes == pytest.approx(3960.0)


def test_feature_fetch_projection_cost():
    cost = cost_of("gnn_sparse_feature_fetch_projection", "uneven_blocks", 2)
    # 29 ids: 8 bytes out, 12 bf16 back each, half off-rank; GEMM 29x12x7.
    assert cost.link_bytes == pytest.approx(0.5 * 29 * 32)
    assert cost.flops == pytest.approx(4872.0)
    assert cost.hbm_bytes == pytest.approx((348 + 84 + 203) * 2)


def test_negative_scoring_cost():
    cost = cost_of("gnn_negative_scoring", "citation2_1000neg", 8)
    # 86956 rankings of 8 bytes, 7/8 gathered in; 10870 local positives x 1000 comparisons.
    assert cost.link_bytes == pytest.approx(608_692.0)
    assert cost.flops == pytest.approx(10_870_000.0)
    assert cost.hbm_bytes == pytest.approx(10_870 * 1001 * 2 + 86_956 * 8)


def test_kjt_all2all_cost():
    cost = cost_of("torchrec_kjt_all2all", "dlrm_v2_criteo", 8)
    # 26 keys x 8192 lengths (8 bytes) + 8192 x 214 values (8 bytes); 7/8 leave the rank.
    assert cost.link_bytes == pytest.approx(7 / 8 * (1_703_936 + 14_024_704))


def test_conv3d_allreduce_cost():
    cost = cost_of("opensora_conv3d_allreduce", "opensora_vae_512ch_17x64x64", 8)
    # Output 512 x 17 x 64 x 64 = 35,651,584 bf16 all-reduced; 64 local input channels x 27 taps.
    assert cost.link_bytes == pytest.approx(2 * 7 / 8 * 35_651_584 * 2)
    assert cost.flops == pytest.approx(123_211_874_304)  # the catalog's "~123 GFLOP/rank at W=8"


def test_conv2d_halo_cost():
    cost = cost_of("conv2d_boundary_exchange", "sdxl_1024_c320_128x128", 8)
    # One row above and one below: 2 x batch 2 x 320 channels x 128 columns x 2 bytes; band of 16 rows.
    assert cost.link_bytes == pytest.approx(327_680)
    assert cost.flops == pytest.approx(7_549_747_200)


def test_sample_sort_cost():
    cost = cost_of("distributed_sample_sort", "keys_64Mi", 4)  # bf16, the default precision
    assert cost.link_bytes == pytest.approx(3 / 4 * 134_217_728)


def test_knn_cost():
    cost = cost_of("dinov2_distributed_knn", "dinov2_vits14_imagenet1k", 8)
    # 7 foreign ranks x 256 queries x (384 bf16 features + 200 x (bf16 sim + int64 label)).
    assert cost.link_bytes == pytest.approx(7 * 256 * 2768)
    assert cost.flops == pytest.approx(2 * 256 * 384 * 1_281_167)  # 8 ranks' queries x 1/8 of the train set


def test_sam3_cost():
    cost = cost_of("sam3_allgather_iou_suppression", "sam3_64_objects", 4)
    assert cost.link_bytes == pytest.approx(3 / 4 * 64 * 65_537 * 2)
    assert cost.flops == pytest.approx(536_870_912)


def test_magi_tile_decode_cost():
    cost = cost_of("magi1_tile_parallel_vae_decode", "catalog_720x720_chunk", 8)
    # 2 temporal x 4 x 4 spatial tiles; decoded rows per tile 256, 256, 256, 144 (the last covers 18 latents):
    # 3 channels x 12 frames x 912^2 summed over the spatial tiles, twice for time.
    assert cost.link_bytes == pytest.approx(7 / 8 * 2 * 3 * 12 * 912 * 912 * 2)


def test_rfft_cost():
    cost = cost_of("physicsnemo_distributed_rfft", "catalog_16x1024x1024", 8)
    # The real slab 16 x 1024 x 128 fp32 = 8 MiB, 7/8 of it transposed.
    assert cost.link_bytes == pytest.approx(7 / 8 * 8_388_608)


def test_irfft_cost():
    cost = cost_of("physicsnemo_distributed_irfft", "fourcastnet_era5_20x720x1440", 4)
    assert cost.link_bytes == pytest.approx(3 / 4 * 20 * 720 * 360 * 4)


def test_gsplat_cost():
    cost = cost_of("gsplat_3d_gaussian_splatting", "catalog_512x512_1m", 8)
    # 125,000 Gaussians x 8 cameras x 44-byte records (2 int64 ids, 2 int32 radii, 10 bf16), 7/8 off-rank,
    # plus 8 cameras of 25 floats.
    assert cost.link_bytes == pytest.approx(38_500_000 + 800)


def test_spherical_conv_cost():
    cost = cost_of("torchharmonics_spherical_convolution", "same_grid_odd_out", 4)
    # A = P = 2. Basis: 8 output rows, 2 + 6*3 + 2 = 22 (row, lat_in) pairs x 5 offsets x 3 kernels = 330.
    # x local 2*4*4*5*4 = 640 B; partial 2*2*3*8*10*4 = 3840 B; swapped back 1920 B.
    assert cost.link_bytes == pytest.approx(0.5 * (640 + 1920) + 0.5 * 3840)
    assert cost.flops == pytest.approx(2 * 165 * 10 * 4 + 2 * 2 * 3 * 4 * 3 * 4 * 5)


def test_neighbor_sampling_cost():
    cost = cost_of("gnn_neighbor_sampling", "ogbn_products_sage_15_10_5", 8)
    # Frontiers 1024, 15360, 153600 with fanouts 15, 10, 5: 16 + 16k bytes per request, 7/8 off-rank.
    assert cost.link_bytes == pytest.approx(7 / 8 * (1024 * 256 + 15_360 * 176 + 153_600 * 96))


# -- honest alternative kernels ----------------------------------------------------------------------

_GATHER = '''
import torch
import torch.distributed as dist


def gather(obj):
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs
'''

ALTERNATIVES = {
    "dinov2_distributed_knn": '''
def solution(test_features_rank, train_features_rank_T, train_labels_rank, max_k, group=None):
    shards = gather((train_features_rank_T, train_labels_rank))
    train = torch.cat([s[0] for s in shards], dim=1).float()
    labels = torch.cat([s[1] for s in shards], dim=1)[0]
    sims = (test_features_rank.float() @ train).to(test_features_rank.dtype)
    rows_s, rows_l = [], []
    for q in range(sims.shape[0]):
        row = sims[q].tolist()
        best = sorted(range(train.shape[1]), key=lambda j: (-row[j], j))[:max_k]
        rows_s.append(sims[q, best])
        rows_l.append(labels[best])
    if not rows_s:
        return sims.new_zeros(0, max_k), labels.new_zeros(0, max_k)
    return torch.stack(rows_s), torch.stack(rows_l)
''',
    "distributed_sample_sort": '''
def solution(local_shard, group=None):
    keys = torch.sort(torch.cat(gather(local_shard))).values
    world_size, rank = dist.get_world_size(), dist.get_rank()
    return torch.tensor_split(keys, world_size)[rank].clone()
''',
    "physicsnemo_distributed_rfft": '''
def solution(x, s, dim, norm="ortho", group=None):
    full = torch.cat(gather(x), dim=dim[1])
    spectrum = torch.fft.rfftn(full, s=s, dim=dim, norm=norm)
    return spectrum.chunk(dist.get_world_size(), dim=dim[0])[dist.get_rank()].contiguous()
''',
    "physicsnemo_distributed_irfft": '''
def solution(x, s, dim, norm="ortho", group=None):
    full = torch.cat(gather(x), dim=dim[0])
    field = torch.fft.irfftn(full, s=s, dim=dim, norm=norm)
    return field.chunk(dist.get_world_size(), dim=dim[1])[dist.get_rank()].contiguous()
''',
    "conv2d_boundary_exchange": '''
def solution(x, weight, bias, stride=1, padding=1, group=None):
    bands = gather(x)
    image = torch.cat(bands, dim=2).float()
    bias = bias.float() if bias is not None else None
    out = torch.nn.functional.conv2d(image, weight.float(), bias, padding=padding)
    start = sum(b.shape[2] for b in bands[:dist.get_rank()])
    return out[:, :, start:start + x.shape[2]].to(x.dtype)
''',
    "torchharmonics_spherical_convolution": '''
def solution(x, psi, weight, groups, nlon_out, nlon_in, azimuth_group=None, polar_group=None, bias=None):
    # Rebuild the global field and basis, then run torch-harmonics' own loop: roll the input by
    # nlon_in/nlon_out longitudes per output longitude and multiply by the dense basis.
    world_size, rank = dist.get_world_size(), dist.get_rank()
    num_polar = world_size // 2
    pieces = gather((x, psi))
    field = torch.cat([torch.cat([pieces[p * 2 + a][0] for a in range(2)], dim=3) for p in range(num_polar)], dim=2)
    batch, channels, nlat_in, _ = field.shape
    num_k, nlat_out, band_cols = psi.shape
    band = nlat_in // num_polar
    dense = torch.zeros(num_k, nlat_out, nlat_in * nlon_in)
    for p in range(num_polar):
        idx, vals = pieces[p * 2][1].indices(), pieces[p * 2][1].values()
        dense.index_put_((idx[0], idx[1], idx[2] + p * band * nlon_in), vals.float(), accumulate=True)
    rolled = field.float().reshape(batch * channels, nlat_in * nlon_in).T
    out = torch.zeros(batch * channels, num_k, nlat_out, nlon_out)
    shift = nlon_in // nlon_out
    for w in range(nlon_out):
        out[..., w] = torch.einsum("khn,nb->bkh", dense, rolled)
        rolled = torch.roll(rolled.reshape(nlat_in, nlon_in, -1), -shift, dims=1).reshape(nlat_in * nlon_in, -1)
    out = out.reshape(batch, groups, channels // groups, num_k, nlat_out, nlon_out)
    mixed = torch.einsum("bgckxy,gock->bgoxy", out, weight.float().reshape(groups, -1, weight.shape[1], num_k))
    mixed = mixed.reshape(batch, -1, nlat_out, nlon_out) + bias.float().view(1, -1, 1, 1)
    p, a = rank // 2, rank % 2
    lat, lon = nlat_out // num_polar, nlon_out // 2
    return mixed[:, :, p * lat:(p + 1) * lat, a * lon:(a + 1) * lon].contiguous()
''',
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("slug", sorted(ALTERNATIVES))
def test_an_honest_alternative_kernel_matches(slug, world_size, sessions, tmp_path):
    """A different algorithm (everything gathered, computed globally) gets ``ok``: the reference computes
    what its docstring says, and its tie rules and exact outputs can be met by an independent kernel."""
    path = tmp_path / f"{slug}_alternative.py"
    path.write_text(_GATHER + textwrap.dedent(ALTERNATIVES[slug]))
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, num_trials=2, timeout_s=120.0, cases="tests")
    result = evaluate(get_problem(slug), Candidate.from_file(path), config, sessions(world_size))
    assert result.status is Status.OK, result.message


def test_knn_cases_leave_no_ties_in_the_top_k(sessions, tmp_path):
    """No knife edge in k-NN: the top max_k + 1 similarities of every query are distinct, so a kernel that
    breaks equal similarities the other way (highest index first) still gets ``ok``, labels included."""
    other = ALTERNATIVES["dinov2_distributed_knn"].replace("(-row[j], j)", "(-row[j], -j)")
    assert other != ALTERNATIVES["dinov2_distributed_knn"]
    path = tmp_path / "knn_highest_index_first.py"
    path.write_text(_GATHER + textwrap.dedent(other))
    config = EvalConfig(world_size=2, mode=Mode.CPU, num_trials=2, timeout_s=120.0, cases="tests")
    result = evaluate(get_problem("dinov2_distributed_knn"), Candidate.from_file(path), config, sessions(2))
    assert result.status is Status.OK, result.message
