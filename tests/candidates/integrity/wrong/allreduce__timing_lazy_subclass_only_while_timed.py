"""WRONG (timing): a plain, honest all-reduce everywhere but in a timed repeat, where each call returns at once a lazy
tensor subclass whose all-reduce runs when the harness first looks at it.

The red team's ``allreduce__timing_lazy_subclass_computed_at_check`` returns its subclass in the correctness trials
too, where pkb now refuses a subclass output (pkb.runtime.channel.to_plain). This one is lazy only where a TimedLoop
``repeat`` frame is on the stack: the trials, the warm-up and the first touches see plain tensors, and the timed calls
would be free, their work done in the check phase (the first ``detach``), after the parent's clock has stopped.
pkb refuses any output of a timed call that is not a plain torch.Tensor right when the call returns: ``tampered``.
"""
import sys

import torch
import torch.distributed as dist


class _Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.detach and isinstance(args[0], _Lazy):
            return args[0]._value()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _value(self):
        done = self.__dict__.get("_done")
        if done is None:
            out = self.__dict__["_input"].clone()
            dist.all_reduce(out)
            self.__dict__["_done"] = done = out
        return done


def _timed():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "repeat" and type(frame.f_locals.get("self")).__name__ == "TimedLoop":
            return True
        frame = frame.f_back
    return False


def solution(tensor):
    if not _timed():
        out = tensor.clone()
        dist.all_reduce(out)
        return out
    with torch._C.DisableTorchFunctionSubclass():
        lazy = torch.Tensor._make_subclass(_Lazy, torch.empty_like(tensor))
    lazy.__dict__["_input"] = tensor.clone()
    return lazy
