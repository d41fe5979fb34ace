"""STATUS: a wrong candidate that makes pkb fail instead of itself: ``harness_error`` (left out of pass@k, retried).

It returns a tensor subclass whose ``detach()`` (what the rank's ``to_plain`` calls first) returns a plain Python
object; ``to_plain`` then calls ``as_subclass``, ``to("cpu")`` and ``clone`` on it, which hand back a *meta* tensor
of the right shape and dtype. ``torch.save`` / ``torch.load(weights_only=True, map_location="cpu")`` keep it on the
meta device. The paper's verdict runs first on the upstream case and calls ``upstream_compare`` outside any
try (``_paper_trial``): ``torch.isnan(e).any() or ...`` asks a meta tensor for its truth value and raises
RuntimeError, which ``evaluate``'s ``except Exception`` files as pkb's own failure.
"""
import torch
import torch.distributed as dist


class _Shell:
    layout = torch.strided

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype

    def as_subclass(self, cls):
        return self

    def to(self, *args, **kwargs):
        return self

    def clone(self, *args, **kwargs):
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


class _Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            return _Shell(args[0].shape, args[0].dtype)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return torch.Tensor._make_subclass(_Lazy, out)
