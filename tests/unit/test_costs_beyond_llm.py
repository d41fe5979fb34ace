"""The beyond-LLM problems: cost() of one case each against numbers worked out by hand. Honest alternative
kernels run through the evaluator: tests/integration/test_beyond_llm_alternatives.py.
"""

from __future__ import annotations

import pytest

from pkb.registry import get_problem


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
