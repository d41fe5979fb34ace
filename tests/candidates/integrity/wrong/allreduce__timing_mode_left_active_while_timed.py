"""WRONG (timing): a timed call returns a plain tensor with nothing in it, and leaves a torch function mode active that
fills it in (the real all-reduce) the first time any torch function touches it: the harness's check, after the
parent's clock has stopped.

Outside a timed repeat (the trials, the warm-up, the first touches) the all-reduce is honest. The output's type is
``torch.Tensor`` exactly, so a type check alone would pass it; pkb also refuses a call that returns with torch's
function or dispatch mode stack deeper than before it (pkb.runtime.timed_loop.refusal): ``tampered``.
"""
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_pending = {}


class _FillOnTouch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        for arg in args:
            if isinstance(arg, torch.Tensor) and id(arg) in _pending:
                out, source = _pending.pop(id(arg))
                with torch._C.DisableTorchFunction():
                    out.copy_(source)
                    dist.all_reduce(out)
        return func(*args, **(kwargs or {}))


_mode = None


def _timed():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "repeat" and type(frame.f_locals.get("self")).__name__ == "TimedLoop":
            return True
        frame = frame.f_back
    return False


def solution(tensor):
    global _mode
    if not _timed():
        out = tensor.clone()
        dist.all_reduce(out)
        return out
    if _mode is None:
        _mode = _FillOnTouch()
        _mode.__enter__()  # never exited: active after the call returns
    out = torch.empty_like(tensor)
    _pending[id(out)] = (out, tensor.clone())
    return out
