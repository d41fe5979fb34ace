"""STATUS (trust boundary): writes its own reply on the rank's channel, naming ``harness_error`` / ``infra_error``.

The channel's Connection is ``conn``, a local of ``pkb.runtime.worker.worker_main``, reachable through the stack.
On its first call the candidate sends ``{"status": "harness_error", "error": "No CUDA GPUs are available"}`` in
the stream framing the parent accepts, before the worker's own reply. Expected (after issue 56): the parent takes
an unknown status as the candidate's ``runtime_error``.
"""
import io
import sys

import torch
import torch.distributed as dist


def _conn():
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "worker_main" and "conn" in f.f_locals:
            return f.f_locals["conn"]
        f = f.f_back
    return None


def solution(tensor):
    conn = _conn()
    if conn is not None:
        buffer = io.BytesIO()
        torch.save({"status": "harness_error", "error": "RuntimeError: No CUDA GPUs are available"}, buffer)
        conn.send_bytes(buffer.getbuffer())
    out = tensor.clone()
    dist.all_reduce(out)
    return out
