"""Inter-node problems, beyond the upstream benchmark: W ranks on N nodes of W/N GPUs (pkb.topology), NVLink
inside a node and only the network between nodes. Each function takes its process groups for the
intra-node and inter-node dimensions as arguments; its cost counts NVLink and network bytes apart."""
