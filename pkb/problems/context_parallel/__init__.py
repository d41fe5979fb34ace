"""Context and sequence parallelism: Ulysses all-to-alls, ring attention, Hyena CP, linear attention CP, MAGI-1 CSO.

Precision: the floating inputs that upstream's factory builds from its ``dtype`` follow the run's
precision (``case["dtype"]``, bf16 by default: a module's "bf16" means it); a module names the inputs
whose dtype is fixed (softmax_lse fp32, the delta rules' a_log and dt_bias bf16, MAGI-1's bf16 in fp16).
"""
