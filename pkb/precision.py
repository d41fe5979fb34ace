"""The run's precision by name (upstream's ``--dtype``), importable without torch (the CLI's parser).

``pkb.problem.PRECISIONS`` maps each name to its torch dtype.
"""

NAMES = ("bf16", "fp16", "fp32")
DEFAULT = "bf16"  # the paper's
