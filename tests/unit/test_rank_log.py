"""pkb.runtime.jail.RankLog: a sandboxed rank's output, relayed from its pipe into a log of bounded size."""

from __future__ import annotations

import os

import pytest

from pkb.runtime import jail
from pkb.runtime.jail import LOG_BYTES, LOG_KEPT_BYTES, RankLog


class Pipe:
    """The write end of a rank's pipe, as the test's rank."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def pipe_log(tmp_path):
    read, write = jail._output_pipe()  # the jail's: its end does not block
    log, rank = RankLog(read, str(tmp_path / "rank0.log")), Pipe(write)
    yield log, rank, tmp_path / "rank0.log"
    log.close()
    rank.close()


def lines(first: int, count: int) -> bytes:
    return b"".join(b"line %08d " % n + b"." * 1000 + b"\n" for n in range(first, first + count))


def relay_all(log: RankLog, rank: Pipe, data: bytes) -> None:
    """Write ``data`` into the pipe a piece at a time (a pipe holds 64 KiB), relaying as the jail would."""
    for start in range(0, len(data), 16 << 10):
        rank.write(data[start:start + (16 << 10)])
        assert log.relay(max_reads=8)


def test_output_under_the_limit_is_kept_whole(pipe_log):
    log, rank, path = pipe_log
    data = lines(0, 100)
    relay_all(log, rank, data)
    assert path.read_bytes() == data and log.dropped == 0


def test_past_the_limit_the_log_keeps_the_latest_output_and_says_what_it_dropped(pipe_log):
    log, rank, path = pipe_log
    data = lines(0, 3 * LOG_BYTES // 1010)  # about 3 MiB
    relay_all(log, rank, data)
    content = path.read_bytes()
    assert len(content) <= LOG_BYTES, len(content)
    note, _, rest = content.partition(b"\n")
    assert note.startswith(b"[pkb: ") and b"earlier bytes of this rank's output dropped" in note
    dropped = int(note.split()[1])
    assert rest == data[dropped:], "what the log holds is not the end of the output"
    assert len(rest) >= LOG_KEPT_BYTES and data.endswith(rest[-2000:])


def test_a_closed_pipe_ends_the_relay(pipe_log):
    log, rank, path = pipe_log
    rank.write(b"last words\n")
    rank.close()
    assert log.relay(max_reads=4) is False
    assert path.read_bytes() == b"last words\n"
