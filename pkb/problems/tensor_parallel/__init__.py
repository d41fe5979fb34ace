"""Tensor, sequence and vocab parallelism: GEMMs around collectives, sharded norms, vocab-parallel losses."""
