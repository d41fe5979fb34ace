"""WRONG (timing): every call returns at once a lazy tensor subclass; the all-reduce runs when the harness looks.

``solution`` returns ``_Lazy``, a tensor subclass holding a reference to its input and nothing computed. The first
``detach()`` (what the rank's ``summarise`` and ``to_plain`` call first) runs the real all-reduce and hands back a
plain tensor: correct values, every time. While timed, nothing is computed inside the repeat: the all-reduces of a
repeat run in the next phase, the ``check`` (projections of each copy's output), whose time counts only beyond
1.5x the reference's median check plus 5 ms (``GroupTiming.allowed``), and in cpu mode a check (8 projections of
every copy) takes far longer than the repeat it checks. Every rank detaches its outputs in the same order, so the
collectives stay matched. Small buffers (whose check is too short to hide the work) are all-reduced honestly.
"""
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


def solution(tensor):
    if tensor.numel() < 65536:  # where a check is short, its allowance would not hide the work: be honest
        out = tensor.clone()
        dist.all_reduce(out)
        return out
    with torch._C.DisableTorchFunctionSubclass():
        lazy = torch.Tensor._make_subclass(_Lazy, torch.empty_like(tensor))
    lazy.__dict__["_input"] = tensor
    return lazy
