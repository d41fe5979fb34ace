"""The eight collective primitives (upstream 1-8), in nccl-tests terms."""
