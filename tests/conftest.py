"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from pkb.evaluate.evaluator import Session
from pkb.runtime.modes import Mode


@pytest.fixture(scope="module")
def sessions():
    """``sessions(world_size, mode=Mode.CPU)``: a Session per (mode, world size), closed after the module."""
    opened: dict[tuple[Mode, int], Session] = {}

    def get(world_size: int, mode: Mode = Mode.CPU) -> Session:
        if (mode, world_size) not in opened:
            opened[(mode, world_size)] = Session(mode, world_size)
        return opened[(mode, world_size)]

    yield get
    for session in opened.values():
        session.close()
