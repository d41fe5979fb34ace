"""Expert parallelism and MoE (upstream 24, 26-32, 49-53): routing, dispatch/combine all-to-alls, EP layers, fp8 gradient and parameter exchange."""
