"""Data parallelism, FSDP/ZeRO optimizer sharding, distributed optimizers and losses (upstream 21-23, 25, 40-44, 47, 48, 58, 63, 80)."""
