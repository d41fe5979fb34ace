"""The upstream benchmark's protocol parameters, importable without torch (the CLI's parser, pkb.client).

- the run's precision by name (upstream's ``--dtype``); ``pkb.problem.PRECISIONS`` maps each to its dtype;
- the paper's verdict rule: ``UPSTREAM_TRIALS`` random-input trials, ``allclose`` at ``UPSTREAM_ATOL`` and
  ``UPSTREAM_RTOL`` (its launchers' ``--trials``, ``--atol`` and ``--rtol`` defaults); docs/paper-protocol.md.
"""

PRECISION_NAMES = ("bf16", "fp16", "fp32")
DEFAULT_PRECISION = "bf16"  # the paper's

UPSTREAM_TRIALS = 5
UPSTREAM_ATOL = UPSTREAM_RTOL = 1e-2
