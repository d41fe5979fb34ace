"""The parent's end of a rank's channel (pkb.runtime.channel.recv_reply): what a rank sends arrives whole,
and what a candidate may write there instead (a huge size, half a message, then silence) is refused in
bounded time and memory, never waited on for ever."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

try:
    import fcntl
except ImportError:
    fcntl = None

from pkb.runtime import channel
from pkb.runtime.channel import MAX_MESSAGE_BYTES, ChannelError, recv_reply, send_reply


@pytest.fixture(params=["memory-file", "stream"])
def ends(request, monkeypatch):
    """Both ways a reply is read: into a mapped memory file (Linux) and into a stream (elsewhere)."""
    if request.param == "stream":
        monkeypatch.setattr(channel, "_MEMORY_FILES", False)
    elif not channel._MEMORY_FILES:
        pytest.skip("no memory files here (Linux only)")
    ours, theirs = socket.socketpair()
    parent, rank = Connection(ours.detach()), Connection(theirs.detach())
    yield parent, rank
    parent.close()
    if not rank.closed:
        rank.close()


def test_a_reply_larger_than_the_socket_buffers_arrives_whole(ends):
    parent, rank = ends
    reply = {"outputs": [torch.arange(3_000_000, dtype=torch.float32), {"scale": 2.5, "name": "x"}], "ok": True}
    sender = threading.Thread(target=send_reply, args=(rank, reply))
    sender.start()
    got = recv_reply(parent)
    sender.join()
    assert got["ok"] is True and got["outputs"][1] == {"scale": 2.5, "name": "x"}
    assert torch.equal(got["outputs"][0], reply["outputs"][0])
    got["outputs"][0].add_(1)  # an output the parent writes to (a mapped one is its private copy)
    assert torch.equal(got["outputs"][0], reply["outputs"][0] + 1)


def test_a_size_past_the_limit_is_refused_before_anything_is_allocated(ends):
    parent, rank = ends
    rank.send_bytes(b"")  # an empty message first: a size of 0 is a message that does not decode
    with pytest.raises(ChannelError, match="unreadable reply"):
        recv_reply(parent)
    for header in (struct.pack("!i", -1) + struct.pack("!Q", MAX_MESSAGE_BYTES + 1), struct.pack("!i", -7)):
        rank._send(header)
        with pytest.raises(ChannelError, match="announced a reply of"):
            recv_reply(parent)


def test_a_sender_that_stops_mid_message_is_refused_after_the_stall_limit(ends):
    parent, rank = ends
    rank._send(struct.pack("!i", 1 << 20) + b"x" * 1000)  # a size, a little of it, then silence
    began = time.monotonic()
    with pytest.raises(ChannelError, match="stopped for 1 s in the middle"):
        recv_reply(parent, stall_s=1.0)
    assert time.monotonic() - began < 5


def test_end_of_file_before_a_reply_is_eof_and_within_one_is_an_os_error(ends):
    parent, rank = ends
    rank._send(struct.pack("!i", 100) + b"y" * 10)
    rank.close()
    with pytest.raises(OSError, match="in the middle of a reply"):
        recv_reply(parent)
    with pytest.raises(EOFError):
        recv_reply(parent)


# -- replies passed as sealed memory files (Linux) -------------------------------------------------------

memory_files_only = pytest.mark.skipif(not channel._MEMORY_FILES, reason="no sealed memory files here (Linux only)")


@pytest.fixture
def socket_ends():
    before = _open_files()
    ours, theirs = socket.socketpair()
    parent, rank = Connection(ours.detach()), socket.socket(fileno=theirs.detach())
    yield parent, rank
    parent.close()
    rank.close()
    assert _open_files() == before, "the parent kept a file a rank passed"


def _open_files() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _memory_file(reply: dict, seals: int) -> int:
    memory_file = os.memfd_create("attacker", os.MFD_ALLOW_SEALING)
    with open(memory_file, "wb", closefd=False) as file:
        torch.save(reply, file)
    if seals:
        fcntl.fcntl(memory_file, fcntl.F_ADD_SEALS, seals)
    return memory_file


def _pass(rank: socket.socket, header: int, *files: int) -> None:
    socket.send_fds(rank, [struct.pack("!i", header)], list(files))
    for passed in files:
        os.close(passed)


ALL_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if channel._MEMORY_FILES else 0


@memory_files_only
def test_a_reply_travels_as_a_sealed_memory_file_the_parent_maps(socket_ends, monkeypatch):
    parent, rank = socket_ends
    decoded = []
    monkeypatch.setattr(channel, "_decode_sealed", lambda *a: decoded.append(a) or _real_decode_sealed(*a))
    reply = {"outputs": [torch.arange(1 << 20, dtype=torch.float64)], "ok": True}
    send_reply(Connection(os.dup(rank.fileno())), reply)
    got = recv_reply(parent)
    assert len(decoded) == 1 and torch.equal(got["outputs"][0], reply["outputs"][0])


_real_decode_sealed = channel._decode_sealed


@memory_files_only
@pytest.mark.parametrize(("seals", "refusal"), [
    (0, "had not sealed"),
    (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if channel._MEMORY_FILES else 0, "had not sealed"),
    (getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10) | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if channel._MEMORY_FILES else 0,
     "had not sealed"),  # future writes sealed, but a writable mapping made before could still change it
])
def test_a_memory_file_that_can_still_change_is_refused(socket_ends, seals, refusal):
    parent, rank = socket_ends
    _pass(rank, channel._IN_MEMORY_FILE, _memory_file({"ok": True}, seals))
    with pytest.raises(ChannelError, match=refusal):
        recv_reply(parent)


@memory_files_only
def test_a_file_that_is_not_a_memory_file_is_refused(socket_ends, tmp_path):
    parent, rank = socket_ends
    path = tmp_path / "reply.pt"
    torch.save({"ok": True}, path)
    _pass(rank, channel._IN_MEMORY_FILE, os.open(path, os.O_RDONLY))
    with pytest.raises(ChannelError, match="not a memory file"):
        recv_reply(parent)


@memory_files_only
def test_files_passed_with_anything_but_one_sealed_reply_are_refused_and_closed(socket_ends):
    parent, rank = socket_ends
    sealed = lambda: _memory_file({"ok": True}, ALL_SEALS)  # noqa: E731
    _pass(rank, channel._IN_MEMORY_FILE, sealed(), sealed())  # two files
    with pytest.raises(ChannelError, match="not one sealed memory file"):
        recv_reply(parent)
    _pass(rank, 4, sealed())  # a file beside a frame of bytes
    with pytest.raises(ChannelError, match="not one sealed memory file"):
        recv_reply(parent)
    rank.sendall(struct.pack("!i", channel._IN_MEMORY_FILE))  # the announcement, and no file
    with pytest.raises(ChannelError, match="without passing one"):
        recv_reply(parent)


@memory_files_only
def test_a_sealed_memory_file_past_the_size_limit_is_refused(socket_ends, monkeypatch):
    parent, rank = socket_ends
    monkeypatch.setattr(channel, "MAX_MESSAGE_BYTES", 1 << 16)
    _pass(rank, channel._IN_MEMORY_FILE, _memory_file({"big": torch.zeros(1 << 16)}, ALL_SEALS))
    with pytest.raises(ChannelError, match="at most 65536"):
        recv_reply(parent)


@memory_files_only
def test_a_memory_file_mapped_writable_cannot_be_sealed_so_a_sealed_one_cannot_change():
    """What the parent's check rests on (the kernel's rule): a rank that keeps a writable shared mapping of
    its reply, to change it after the parent has looked, cannot seal it, and once sealed cannot map it so."""
    memory_file = _memory_file({"ok": True}, 0)
    size = os.fstat(memory_file).st_size
    with mmap.mmap(memory_file, size) as writable:
        with pytest.raises(OSError) as refused:
            fcntl.fcntl(memory_file, fcntl.F_ADD_SEALS, ALL_SEALS)
        assert refused.value.errno == errno.EBUSY
        writable[0] = writable[0]
    fcntl.fcntl(memory_file, fcntl.F_ADD_SEALS, ALL_SEALS)
    with pytest.raises(PermissionError):
        mmap.mmap(memory_file, size)  # shared and writable
    with pytest.raises(PermissionError):
        os.write(memory_file, b"x")
    os.close(memory_file)


@memory_files_only
def test_a_reply_past_the_file_size_limit_goes_through_the_socket(socket_ends, monkeypatch):
    parent, rank = socket_ends
    monkeypatch.setattr(channel.resource, "getrlimit", lambda which: (8 << 20, 8 << 20))
    sealed = []
    monkeypatch.setattr(channel, "_decode_sealed", lambda *a: sealed.append(a) or _real_decode_sealed(*a))
    reply = {"outputs": [torch.arange(3_000_000, dtype=torch.float32)]}  # 12 MB: more than the 8 MiB limit
    sender = threading.Thread(target=send_reply, args=(Connection(os.dup(rank.fileno())), reply))
    sender.start()
    got = recv_reply(parent)
    sender.join()
    assert not sealed and torch.equal(got["outputs"][0], reply["outputs"][0])
