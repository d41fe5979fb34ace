"""The attack folder and the containment tests agree: every attack file in tests/candidates/attacks is in the
whole-run test's order (tests/integration/test_containment.py) and has its containment check."""

from __future__ import annotations

from helpers.containment import ATTACK_ORDER, ATTACKS, CONTAINED


def test_every_attack_runs_and_is_checked():
    """Each attack file is in the `pkb run` of every attack and has its containment check."""
    assert set(CONTAINED) == set(ATTACK_ORDER) == {path.stem for path in ATTACKS.glob("[!_]*.py")}
