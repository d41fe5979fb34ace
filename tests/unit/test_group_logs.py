"""A rank group's log folder never outlives it: removed when the group ends, and when a group nobody ended
is collected (its owner dropped it) or the process exits."""

from __future__ import annotations

import gc

from pkb.runtime.group import RankGroup
from pkb.runtime.modes import Mode


def test_the_log_folder_of_a_group_nobody_ended_goes_with_it():
    group = RankGroup(Mode.CPU, 2, "candidate")  # not spawned: no process, only its log folder
    folder = group._log_dir
    assert folder.is_dir()
    del group
    gc.collect()
    assert not folder.exists()


def test_an_ended_group_removes_its_log_folder_and_keeps_the_tails():
    group = RankGroup(Mode.CPU, 2, "reference")
    folder = group._log_dir
    group.kill()
    assert group.closed and not folder.exists() and group.log_tail(0) == ""
