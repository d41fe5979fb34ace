"""The parent's end of a rank's channel (pkb.runtime.channel.recv_reply): what a rank sends arrives whole,
and what a candidate may write there instead (a huge size, half a message, then silence) is refused in
bounded time and memory, never waited on for ever."""

from __future__ import annotations

import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

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
