"""WRONG: a threshold compressor: every rank drops its gradient entries with |g| < 0.025 before encoding.

About 2 % of each rank's entries are lost. The problem has no exact answer (``exact_dtype`` None): it is judged
against the reference's output with no sensitivity, so neither the tail nor the shape test runs; each lost
contribution moves the mean by at most 0.025 (both ranks dropping the same element), under the element-wise tolerance (reduction_tolerance: atol
u n (2 + sqrt n) = 0.027 at W = 2, plus rtol 4u |x|), and the RMS of the errors is under a tenth of the tolerance's
RMS and 8x one rounding's. The amax history is unchanged (the amax comes from the large entries).
"""
import importlib

import torch

_problem = importlib.import_module("pkb.problems.expert_parallel.fp8_reduce_scatter_grads")


def solution(flat_grads, amax_history):
    kept = torch.where(flat_grads.abs() < 0.025, torch.zeros_like(flat_grads), flat_grads)
    shard, _ = _problem.reference(kept, amax_history)
    _, history = _problem.reference(flat_grads, amax_history)
    return shard, history
