"""STATUS: raises ``RuntimeError("No CUDA GPUs are available")`` in cpu mode, with no GPU code in its source.

Expected (after issue 56): the parent no longer reads the error's words; this is the candidate's ``runtime_error``.
"""


def solution(tensor):
    raise RuntimeError("No CUDA GPUs are available")
