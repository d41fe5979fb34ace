"""Red-team of two small changes, in-process on small CPU tensors, by a helper who had not written them.

A. pkb.runtime.exact ``_finish`` returns the sensitivity in fp32 instead of fp64 (``Pool.add`` raises it back to fp64
   for the honest scale, the ``structural`` mask and the fit's weights). Attacked: huge fp32 outputs (~1e38, the
   sensitivity ~1e31: no overflow), fp16 outputs of tiny values, complex64 outputs, and subnormal fp32 outputs (the
   sensitivity, ~1e-48, underflows to 0 in fp32). Where the judge runs, the verdicts with the fp64 sensitivity and
   with the same tensor cast to fp32 agree (honest, 1.0005x gain, sparse corruption). The only places fp32 can flip
   ``structural`` are a relative 2^-24 band around ``tiny`` and, where the whole tensor sits at fp32's smallest binade,
   sensitivities in (2^-156, 2^-150) that round to 0; there the scale moves by under 2x of a subnormal step and the
   outlier test only gets stricter (a smaller denominator): no verdict found to flip.

   Found instead (older than change A, from the subnormal fit): any exact value that is subnormal in fp32 or bf16 (a
   softmax with a logit gap past ~87, a matmul of values ~1e-40) makes ``Pool._pool`` raise RuntimeError:
   ``torch.where(subnormal, 1.0 / step**2, 0.0)`` builds an fp32 tensor from 2^298 (fp32) or 2^266 (bf16). Only fp16
   (2^48) fits. An honest answer got no verdict; closed in the same change (the weights are built in fp64), and an
   offset of a few steps on those values is still caught.

B. pkb.solution_files: ``set_name`` renames a --solutions folder called ``reference`` / ``pkb shipped``, and
   ``light_self_checks`` lightens only candidates whose ``is_reference`` (path None: only ``Candidate.reference_of``
   makes one; ``Candidate.from_file`` always sets a path, the serve route too). Checked: ``plan(..., solution_set=
   "reference")`` (``--set reference``) and a file named ``reference.py`` in a folder named ``reference``: the files are
   never lightened.
"""

from __future__ import annotations

import pytest
import torch

from pkb.evaluate.accuracy import PERTURBATIONS, judge_one
from pkb.evaluate.config import EvalConfig
from pkb.problem import default_tolerance
from pkb.runtime.exact import perturbed, sensitivity
from pkb.runtime.modes import Mode

torch.set_num_threads(1)

F, H, C = torch.float32, torch.float16, torch.complex64


def _exact_and_sensitivity(function, inputs: tuple, precision: str):
    exact = function(*[x.to(torch.complex128 if x.is_complex() else torch.float64) for x in inputs])
    moved = [[function(*perturbed(inputs, precision, k))] for k in range(PERTURBATIONS)]
    return exact, sensitivity([exact], moved)[0]


def _gemm_inputs(dtype, x_scale, w_scale, cols=64):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 64, generator=gen), torch.randn(64, cols, generator=gen)
    if dtype.is_complex:
        x, w = torch.complex(x, x.flip(0))[:, :32], torch.complex(w, w.flip(0))[:32, :cols // 2]
    return (x * x_scale).to(dtype), (w * w_scale).to(dtype)


def _verdicts(x, w, dtype, precision):
    """For an honest answer, a 1.0005x gain and every 97th element 1.001x: (passed with fp64 sensitivity, with fp32)."""
    exact, sens = _exact_and_sensitivity(lambda a, b: a @ b, (x, w), precision)
    tolerance = default_tolerance(dtype)
    work = torch.float32 if dtype == H else dtype
    honest = (x.to(work) @ w.to(work)).to(dtype)
    gain = (honest.to(torch.complex128 if dtype.is_complex else torch.float64) * 1.0005).to(dtype)
    sparse = honest.clone()
    sparse.view(-1)[::97] *= 1.001
    out = {}
    for name, got in (("honest", honest), ("gain", gain), ("sparse", sparse)):
        out[name] = tuple(judge_one(honest, got, exact, s, tolerance, dtype) is None
                          for s in (sens.double(), sens.float()))
    return sens, out


@pytest.mark.parametrize("dtype, precision, x_scale, w_scale", [
    (F, "fp32", 4e37, 1 / 8),  # outputs ~4e37, sensitivity ~1e30: far from fp32's overflow
    (H, "fp16", 1e-3, 1e-3 / 8),  # outputs ~1e-6, many fp16 subnormals: sensitivity ~1e-10, normal in fp32
    (C, "fp32", 1.0, 1 / 8),  # complex64: the sensitivity is per real component
])
def test_fp32_sensitivity_gives_the_verdicts_fp64_gave(dtype, precision, x_scale, w_scale):
    sens, verdicts = _verdicts(*_gemm_inputs(dtype, x_scale, w_scale), dtype, precision)
    assert bool(torch.isfinite(sens.float()).all()) and bool((sens.float() > 0).all())
    for name, (with64, with32) in verdicts.items():
        assert with64 == with32, name
    assert verdicts["honest"] == (True, True)
    if dtype != H:  # fp16 at ~1e-6: the gain and the corruption are below atol, passed either way
        assert verdicts["gain"] == (False, False) and verdicts["sparse"] == (False, False)


def _judge_or_error(reference, got, exact, sens, dtype):
    try:
        return judge_one(reference, got, exact, sens, default_tolerance(dtype), dtype)
    except RuntimeError as error:  # no verdict at all
        return error


# Closed (found this round, closed in the same change: the subnormal fit's weights are built in fp64). It was: fp32
# matmul with outputs ~1e-40 (subnormal in fp32; sensitivity ~1e-48, 0 in fp32 and >0 in fp64): judge_one raises
# RuntimeError 'value cannot be converted to type float without overflow' in Pool._pool (torch.where(subnormal, 1.0
# / step**2, 0.0), step = 2^-149: 2^298 in an fp32 tensor), with either sensitivity: an honest fp32 answer gets no
# verdict; bf16 alike (2^266)
def test_an_honest_fp32_answer_with_subnormal_values_is_judged():
    x, w = _gemm_inputs(F, 1e-40, 1 / 8)
    exact, sens = _exact_and_sensitivity(lambda a, b: a @ b, (x, w), "fp32")
    honest = x @ w
    found = [_judge_or_error(honest, honest, exact, s, F) for s in (sens.double(), sens.float())]
    assert found == [None, None], f"an honest answer passes; got {found[0]!r:.120}"
    step = torch.finfo(F).tiny * torch.finfo(F).eps  # fp32's subnormal step, 2^-149
    shifted = (exact + 4 * step).float()  # every value 4 steps up: beyond the subnormal fit's one step
    found = _judge_or_error(honest, shifted, exact, sens.float(), F)
    assert found is not None and not isinstance(found, RuntimeError), found


# Closed (found this round, closed in the same change: the subnormal fit's weights are built in fp64). It was: fp32
# softmax of logits [0, -100, ...]: exp(-100) = 3.7e-44 is a subnormal fp32 exact value; judge_one raises
# RuntimeError in Pool._pool (1/step^2 = 2^298 put in an fp32 tensor): the reference itself gets no verdict
def test_the_reference_softmax_with_a_wide_logit_gap_passes_against_itself():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 64, generator=gen)
    logits[:, 1::2] -= 100.0  # half the probabilities ~e^-100: subnormal in fp32
    exact, sens = _exact_and_sensitivity(lambda a: torch.softmax(a, -1), (logits,), "fp32")
    reference = torch.softmax(logits, -1)
    assert bool(((exact > 0) & (exact < torch.finfo(F).tiny)).any())
    found = _judge_or_error(reference, reference, exact, sens, F)
    assert found is None, f"the reference's own output passes; got {found!r:.120}"


# -- change B -----------------------------------------------------------------------------------------------------


def test_files_named_or_set_as_the_reference_are_never_lightened(tmp_path):
    from pkb.registry import all_problems
    from pkb.solution_files import light_self_checks, plan, set_name
    from pkb.store.db import REFERENCE_SET, SHIPPED_SET

    folder = tmp_path / "reference"
    folder.mkdir()
    problem = next(iter(all_problems().values()))
    (folder / f"{problem.upstream_id or 0}_{problem.name}.py").write_text("x = 1\n", encoding="utf-8")
    assert set_name(folder) == "reference-files"
    assert set_name(tmp_path / SHIPPED_SET) == f"{SHIPPED_SET}-files"
    config = EvalConfig(world_size=2, mode=Mode.CPU)
    for solution_set in (None, REFERENCE_SET):  # the folder's name, and `--set reference`
        evaluations = plan([problem], folder, include_reference=True, solution_set=solution_set)
        files = [e for e in evaluations if not e.candidate.is_reference]
        assert files and all(e.candidate.path is not None for e in files)
        lightened = light_self_checks(evaluations, config, cases=False, trials=1)
        for before, after in zip(evaluations, lightened):
            if before.candidate.is_reference:
                assert after.config is not None and after.config.trials == 1
            else:
                assert after is before  # untouched, whatever the set is called
