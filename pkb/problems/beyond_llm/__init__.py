"""Beyond LLMs: GNN, scientific, vision and HPC workloads (upstream 59-62, 64-70, 76, 78, 79, 81, 85, 87)."""
