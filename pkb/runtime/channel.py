"""The message channel between the parent and a rank process.

Parent -> worker: pickled job dicts (the worker trusts its parent).
Worker -> parent: ``torch.save`` bytes read back with ``torch.load(weights_only=True)``, so a
candidate that writes to the channel can send tensors, numbers, strings, lists and dicts, but never
an object whose unpickling runs code in the process that decides the verdict. The parent reads a reply
with ``recv_reply``, refusing a size past ``MAX_MESSAGE_BYTES`` and a sender that stops mid-message
(``Connection.recv_bytes`` waits for ever and allocates up to the whole remainder on every 64 KiB read).
On Linux the reply is read into an anonymous memory file of its size that ``torch.load`` then maps, so
its tensors are the very pages the kernel wrote (one copy of a reply in all; a stream of bytes costs two
more, a zero-filled buffer and every tensor copied out of it). The file is the parent's: the rank only
ever wrote into its socket, so nothing it does later can change what the parent decoded.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
import select
import struct
from multiprocessing.connection import Connection
from typing import Any

import torch


class ChannelError(RuntimeError):
    """A reply that is not a well-formed message (garbage on the channel)."""


def send_job(conn: Connection, job: dict) -> None:
    conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))


def recv_job(conn: Connection) -> dict:
    return pickle.loads(conn.recv_bytes())


_SIZE, _LONG_SIZE = struct.Struct("!i"), struct.Struct("!Q")  # Connection.send_bytes's framing
MAX_MESSAGE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
MESSAGE_STALL_S = 60.0  # a sender silent this long in the middle of a message has stopped


def recv_reply(conn: Connection, stall_s: float = MESSAGE_STALL_S) -> dict:
    """The next reply on ``conn`` (framed as ``Connection.send_bytes`` frames it), decoded. EOFError at
    end of file before it starts, OSError at end of file within it; ChannelError for a size past
    MAX_MESSAGE_BYTES, a sender silent for ``stall_s`` within a message, or a reply that does not decode."""
    fd = conn.fileno()
    size, = _SIZE.unpack(_read_into(fd, bytearray(_SIZE.size), stall_s, at_start=True))
    if size == -1:
        size, = _LONG_SIZE.unpack(_read_into(fd, bytearray(_LONG_SIZE.size), stall_s))
    if not 0 <= size <= MAX_MESSAGE_BYTES:
        raise ChannelError(f"a rank announced a reply of {size} bytes (at most {MAX_MESSAGE_BYTES} are read)")
    if size and _MEMORY_FILES:
        return _recv_into_memory_file(fd, size, stall_s)
    body = io.BytesIO()  # elsewhere: read into the stream torch.load reads from
    if size:
        body.seek(size - 1)
        body.write(b"\0")
        with body.getbuffer() as view:
            _read_into(fd, view, stall_s)
        body.seek(0)
    return decode_reply(body)


_MEMORY_FILES = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _recv_into_memory_file(fd: int, size: int, stall_s: float) -> dict:
    """Read ``size`` bytes of reply into a memory file and decode it with its tensors mapped, not copied
    (``torch.load(mmap=True)`` maps privately: writing to an output never reaches the file)."""
    memory_file = os.memfd_create("pkb-reply", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memory_file, size)
        with mmap.mmap(memory_file, size) as mapped:
            _read_into(fd, mapped, stall_s)
        return decode_reply(f"/proc/self/fd/{memory_file}", mapped=True)
    finally:
        os.close(memory_file)  # the mapped tensors keep their pages


def _read_into(fd: int, buffer, stall_s: float, at_start: bool = False):
    """Fill ``buffer`` (writable, of the size to read) from ``fd``; returns it."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    with memoryview(buffer) as raw, raw.cast("B") as view:  # released on every way out (a map can close)
        done = 0
        while done < len(view):
            if not poller.poll(stall_s * 1000):
                raise ChannelError(f"a rank stopped for {stall_s:.0f} s in the middle of a reply")
            read = os.readv(fd, [view[done:]])
            if read == 0:
                if at_start and done == 0:
                    raise EOFError
                raise OSError("end of file in the middle of a reply")
            done += read
    return buffer


MAX_FULL_ELEMENTS = 1 << 22  # larger tensors travel as a sample of elements at parent-chosen places
SAMPLE_ELEMENTS = 1 << 16


def to_plain(value: Any, sample_seed: int | None = None) -> Any:
    """A copy of ``value`` made of plain CPU tensors, lists, dicts, numbers and strings.

    Tensors are copied to the CPU into storage of their own size (a view does not drag its whole
    base along). Tuples become lists; the parent compares structure, not container type. With a
    ``sample_seed``, a tensor of more than MAX_FULL_ELEMENTS elements is sent as the values at
    SAMPLE_ELEMENTS places drawn from the seed (the parent picks the seed after the call, and the
    reference sends the same places): a cheap check of GiB-sized outputs.
    """
    counter = [0]

    def plain(value):
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if tensor.layout != torch.strided:  # sparse outputs are compared as their dense values
                tensor = tensor.to_dense()
            if type(tensor) is not torch.Tensor:
                tensor = tensor.as_subclass(torch.Tensor)
            counter[0] += 1
            if sample_seed is not None and tensor.numel() > MAX_FULL_ELEMENTS:
                gen = torch.Generator().manual_seed(sample_seed + counter[0])
                places = torch.randint(tensor.numel(), (SAMPLE_ELEMENTS,), generator=gen)
                values = tensor.reshape(-1)[places.to(tensor.device)].to("cpu")
                return {"__sampled__": True, "shape": list(tensor.shape), "places": places, "values": values}
            return tensor.to("cpu").clone(memory_format=torch.contiguous_format)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, torch.nn.Module):  # a module argument: its state, and the gradients it holds
            grads = {name: p.grad for name, p in value.named_parameters() if p.grad is not None}
            return {"__module__": type(value).__qualname__, "state": plain(dict(value.state_dict(keep_vars=True))),
                    "grads": plain(grads)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {"__dataclass__": type(value).__qualname__,
                    **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
        return {"__unsupported__": type(value).__qualname__}

    return plain(value)


def send_reply(conn: Connection, reply: dict) -> None:
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    conn.send_bytes(buffer.getbuffer())


def decode_reply(source: io.BytesIO | str, mapped: bool = False) -> dict:
    """A reply decoded from a stream or (``mapped``: its tensors mapped from) a file's path."""
    try:
        reply = torch.load(source, weights_only=True, map_location="cpu", mmap=mapped)
    except Exception as exc:
        raise ChannelError(f"unreadable reply from a rank ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(reply, dict):
        raise ChannelError(f"a rank replied with a {type(reply).__name__}, not a message")
    return reply
