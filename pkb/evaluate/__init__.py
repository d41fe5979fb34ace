"""Correctness, timing, verdicts: deciding what a candidate is worth, in the parent process."""
