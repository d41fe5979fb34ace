"""The attack folders and their tests agree: every attack file in tests/candidates/attacks is in the whole-run
test's order (tests/integration/test_containment.py) and has its containment check; every channel of
tests/candidates/node_attacks is run (tests/integration/test_node_isolation.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from helpers.containment import ATTACK_ORDER, ATTACKS, CONTAINED
from helpers.node_attacks import ATTACKS as NODE_ATTACKS, CUDA_CHANNELS, FENCE_BYPASSES, HOST_CHANNELS, node_attack


def test_every_attack_runs_and_is_checked():
    """Each attack file is in the `pkb run` of every attack and has its containment check."""
    assert set(CONTAINED) == set(ATTACK_ORDER) == {path.stem for path in ATTACKS.glob("[!_]*.py")}


def test_every_channel_between_nodes_is_tried():
    """Each file of tests/candidates/node_attacks is in exactly one of the lists the node-isolation tests (and
    the GPU proof) run, and every file compiles as the candidate it becomes."""
    listed = [*HOST_CHANNELS, *FENCE_BYPASSES, *CUDA_CHANNELS]
    assert sorted(listed) == sorted(path.stem for path in NODE_ATTACKS.glob("[!_]*.py"))
    with tempfile.TemporaryDirectory() as folder:
        for name in listed:
            for scope in ("world", "node"):
                source = node_attack(name, scope, Path(folder)).read_text()
                compile(source, name, "exec")
                assert f'\nSCOPE = "{scope}"' in source
