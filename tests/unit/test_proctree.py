"""pkb.runtime.proctree: the /proc reader behind the process walks (containment, memory, CPU accounting)."""

from __future__ import annotations

import os
import time

from pkb.runtime import proctree


def _gone_pid() -> int:
    """A pid no process has now (above every pid in use)."""
    return max(int(name) for name in os.listdir("/proc") if name.isdigit()) + 100_000


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path):
    stat = tmp_path / "stat"
    stat.write_bytes(b"4242 (a) (b c) S 17 4242 4242 0 -1 4194304 1 0 0 0 250 30 5 7 20 0 1 0")
    fields = proctree._stat_fields(str(stat))
    assert fields[0] == b"S" and fields[1] == b"17"
    assert [int(v) for v in fields[11:15]] == [250, 30, 5, 7]


def test_an_unreadable_or_malformed_stat_file_gives_none(tmp_path):
    assert proctree._stat_fields(str(tmp_path / "missing")) is None
    (tmp_path / "stat").write_bytes(b"4242 no parentheses here")
    assert proctree._stat_fields(str(tmp_path / "stat")) is None


def test_this_process_is_its_parents_child():
    assert os.getpid() in proctree.children_by_parent()[os.getppid()]


def test_cpu_seconds_count_this_process_and_are_zero_for_one_that_is_gone():
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert proctree.cpu_seconds(os.getpid()) >= 0.05 - 2 / os.sysconf("SC_CLK_TCK")
    assert proctree.cpu_seconds(os.getpid(), own=False, reaped=False) == 0.0
    assert proctree.cpu_seconds(_gone_pid()) == 0.0


def test_a_process_that_is_gone_counts_as_asleep_and_this_running_one_does_not():
    assert proctree.asleep([_gone_pid()], {})
    assert not proctree.asleep([os.getpid()], {})  # this thread is running while it reads its own state
