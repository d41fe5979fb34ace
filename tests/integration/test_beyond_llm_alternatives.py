"""The beyond-LLM problems' honest alternative kernels (gather everything, compute globally with a different
algorithm), which must match the references exactly where the problems define tie rules and exact outputs.

The alternative kernels run through the evaluator on CPU at W=2 and 4 (a few seconds each).
"""

from __future__ import annotations

import textwrap

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode


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
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, trials=2, timeout=120.0, cases="tests")
    result = evaluate(get_problem(slug), Candidate.from_file(path), config, sessions(world_size))
    assert result.status is Status.OK, result.message


def test_knn_cases_leave_no_ties_in_the_top_k(sessions, tmp_path):
    """No knife edge in k-NN: the top max_k + 1 similarities of every query are distinct, so a kernel that
    breaks equal similarities the other way (highest index first) still gets ``ok``, labels included."""
    other = ALTERNATIVES["dinov2_distributed_knn"].replace("(-row[j], j)", "(-row[j], -j)")
    assert other != ALTERNATIVES["dinov2_distributed_knn"]
    path = tmp_path / "knn_highest_index_first.py"
    path.write_text(_GATHER + textwrap.dedent(other))
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=2, timeout=120.0, cases="tests")
    result = evaluate(get_problem("dinov2_distributed_knn"), Candidate.from_file(path), config, sessions(2))
    assert result.status is Status.OK, result.message
