"""STATUS: a candidate that cannot give the answer raises in cpu mode and is ``skipped``, not failed.

Its source holds ``x.cuda()`` on a path that never runs on a CPU tensor; the parent reads that as "code that needs a
GPU" (``Candidate.gpu_code``), and any runtime error in a mode without a GPU is then ``skipped``
(``Facts.skipped_by``). The error here has nothing to do with a GPU: the candidate simply gives up. ``skipped`` is in
``NOT_FAILURES`` (pkb.report.metrics): the sample leaves ``n`` and a problem with only such samples leaves the
denominator.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    if tensor.is_cuda:
        out = tensor.cuda().clone()
        dist.all_reduce(out)
        return out
    raise RuntimeError("this kernel gives up here")
