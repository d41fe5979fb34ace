"""pkb: a benchmark and evaluation harness for multi-GPU kernels."""

__version__ = "0.1.0"
