"""Context and sequence parallelism: Ulysses all-to-alls, ring attention, Hyena CP, linear attention CP, MAGI-1 CSO."""
