"""RL environments on ``pkb serve``: pkb's verdict as the reward for training kernel-writing models.

- ``verifiers_env``: a ``verifiers`` environment (``load_environment(...)``; ``pip install 'pkb[rl]'``), docs/rl.md.
- ``inspect_task``: an Inspect AI task (``pkb_kernels``).

Each talks to a running ``pkb serve`` through ``pkb.client``, so a trainer's process imports no torch.
"""
