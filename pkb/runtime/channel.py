"""The message channel between the parent and a rank process.

Parent -> worker: pickled job dicts (the worker trusts its parent).
Worker -> parent: ``torch.save`` bytes read back with ``torch.load(weights_only=True)``, so a
candidate that writes to the channel can send tensors, numbers, strings, lists and dicts, but never
an object whose unpickling runs code in the process that decides the verdict. The parent reads a reply
with ``recv_reply``, refusing a size past ``MAX_MESSAGE_BYTES`` and a sender that stops mid-message
(``Connection.recv_bytes`` waits for ever and allocates up to the whole remainder on every 64 KiB read).

On Linux a reply travels as a memory file, not through the socket: the rank writes it into a memory file,
seals it against every change (``F_SEAL_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``) and passes the file
itself over the socket; the parent checks the seals and maps it, so a reply of GiB costs one copy (the
rank's write), not four (a buffer, the socket both ways, the parent's file). The seals make the pages
immutable for every process, the rank included, before the parent decodes a byte: the kernel refuses a
write seal while anyone holds a writable shared mapping or a pin on them. A reply too large for the rank's
file-size limit goes through the socket, which the parent reads into a memory file of its own.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import mmap
import os
import pickle
import resource
import select
import socket
import stat
import struct
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not POSIX: replies travel in the stream
    fcntl = None


class ChannelError(RuntimeError):
    """A reply that is not a well-formed message (garbage on the channel)."""


def send_job(conn: Connection, job: dict) -> None:
    conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))


def recv_job(conn: Connection) -> dict:
    return pickle.loads(conn.recv_bytes())


_SIZE, _LONG_SIZE = struct.Struct("!i"), struct.Struct("!Q")  # Connection.send_bytes's framing
MAX_MESSAGE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
MESSAGE_STALL_S = 60.0  # a sender silent this long in the middle of a message has stopped


def recv_reply(conn: Connection, stall_s: float = MESSAGE_STALL_S, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """The next reply on ``conn`` (framed as ``Connection.send_bytes`` frames it, or a sealed memory file:
    ``send_reply``), decoded. EOFError at end of file before it starts, OSError at end of file within it;
    ChannelError for a size past ``max_bytes`` (at most MAX_MESSAGE_BYTES: the caller's bound, e.g. a few times
    the reference's reply), a sender silent for ``stall_s`` within a message, a memory file that is not sealed,
    or a reply that does not decode."""
    max_bytes = min(max_bytes, MAX_MESSAGE_BYTES)
    fd = conn.fileno()
    header, memory_file = _read_header(fd, stall_s)
    size, = _SIZE.unpack(header)
    if size == _IN_MEMORY_FILE:  # a passed file comes with no other size (``_read_header``)
        return _decode_sealed(memory_file, max_bytes)
    if size == -1:
        size, = _LONG_SIZE.unpack(_read_into(fd, bytearray(_LONG_SIZE.size), stall_s))
    if not 0 <= size <= max_bytes:
        raise ChannelError(f"a rank announced a reply of {size} bytes (at most {max_bytes} are read)")
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


_IN_MEMORY_FILE = -2  # the size field of a frame whose reply is the sealed memory file passed with it
_SEALS = (getattr(fcntl, "F_SEAL_WRITE", 0) | getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
          if fcntl is not None else 0)


def _read_header(fd: int, stall_s: float) -> tuple[bytes, int | None]:
    """A frame's size field, and the file passed with it (None if none: a reply in the stream). The
    field is read with ``recvmsg`` where ``fd`` is a socket, so a passed file is never dropped unseen; a
    sender that passes more than one, or passes one with anything else, is refused (every file closed)."""
    header = bytearray(_SIZE.size)
    try:
        sock = socket.socket(fileno=fd) if _MEMORY_FILES else None
    except OSError:  # not a socket (a pipe): no file can come with the frame
        sock = None
    if sock is None:
        return bytes(_read_into(fd, header, stall_s, at_start=True)), None
    _wait_readable(fd, stall_s)
    try:
        data, fds, flags, _ = socket.recv_fds(sock, _SIZE.size, 1)
    finally:
        sock.detach()  # the connection keeps its descriptor
    if fds and (len(fds) > 1 or flags & socket.MSG_CTRUNC or _SIZE.unpack(data.ljust(_SIZE.size, b"\0"))[0]
                != _IN_MEMORY_FILE):
        for passed in fds:
            os.close(passed)
        raise ChannelError("a rank passed files with a reply that is not one sealed memory file")
    if not data:
        raise EOFError
    header[:len(data)] = data
    if len(data) < _SIZE.size:
        with memoryview(header) as view:
            _read_into(fd, view[len(data):], stall_s)
    return bytes(header), (fds[0] if fds else None)


def _decode_sealed(memory_file: int | None, max_bytes: int) -> dict:
    """The reply in a memory file a rank passed, decoded with its tensors mapped: only a memory file
    sealed against writing, shrinking and growing, and of an allowed size, is read (closed in any case)."""
    if memory_file is None:
        raise ChannelError("a rank announced a reply in a memory file without passing one")
    try:
        try:
            seals = fcntl.fcntl(memory_file, fcntl.F_GET_SEALS)  # EINVAL: not a memory file
        except OSError:
            raise ChannelError("a rank passed a file that is not a memory file") from None
        if seals & _SEALS != _SEALS:
            raise ChannelError("a rank passed a memory file it had not sealed against writing, shrinking and growing")
        info = os.fstat(memory_file)
        if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= max_bytes:
            raise ChannelError(f"a rank passed a reply of {info.st_size} bytes (at most {max_bytes} are read)")
        return decode_reply(f"/proc/self/fd/{memory_file}", mapped=True)
    finally:
        os.close(memory_file)  # the mapped tensors keep their pages


_MEMORY_FILES = (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd") and fcntl is not None
                 and hasattr(fcntl, "F_ADD_SEALS") and hasattr(socket, "send_fds"))


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
    with memoryview(buffer) as raw, raw.cast("B") as view:  # released on every way out (a map can close)
        done = 0
        while done < len(view):
            _wait_readable(fd, stall_s)
            read = os.readv(fd, [view[done:]])
            if read == 0:
                if at_start and done == 0:
                    raise EOFError
                raise OSError("end of file in the middle of a reply")
            done += read
    return buffer


def _wait_readable(fd: int, stall_s: float) -> None:
    """Returns once ``fd`` has something to read (or its end); ChannelError after ``stall_s``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(stall_s * 1000):
        raise ChannelError(f"a rank stopped for {stall_s:.0f} s in the middle of a reply")


def to_plain(value: Any) -> Any:
    """A copy of ``value`` made of plain CPU tensors, lists, dicts, numbers and strings: every element of every
    tensor (the parent compares all of them; nothing the candidate could learn decides what is compared).

    Tensors are copied to the CPU into storage of their own size (a view does not drag its whole base along), a
    sparse one as its dense values. Only a plain ``torch.Tensor`` is copied (its type checked with ``type``, which no
    object can fake), an ``nn.Parameter`` as its ``.data`` and torch's ``AsyncCollectiveTensor`` (what functional
    collectives and DTensor's ``to_local`` return before the wait) as its plain tensor, waited on with torch's own
    op (``_waited``): torch's classes, exactly. Any other tensor subclass is never asked for its values here
    (its ``detach``, ``to`` or ``clone`` is the candidate's code, which could hand back anything, a meta tensor among
    them, or run work outside the window pkb watches), nor is a meta tensor (no values): each is sent as
    ``{"__unsupported__": "return a plain torch.Tensor (got <type>)"}``, a mismatch that says so. Tuples become
    lists; the parent compares structure, not container type. An object that is none of these is sent as its
    type's name (``{"__unsupported__": ...}``), which matches nothing the reference returns. The parent checks
    again what it receives (pkb.runtime.messages.decode: plain, strided cpu tensors only).
    """
    def plain(value):
        if isinstance(value, torch.Tensor):
            if type(value) is torch.nn.Parameter:  # a model's parameters: torch's own class, its values in .data
                value = value.data
            value = _waited(value)
            if type(value) is not torch.Tensor:
                return {"__unsupported__": f"return a plain torch.Tensor (got {type(value).__name__[:60]})"}
            if value.device.type == "meta":
                return {"__unsupported__": "return a tensor with values (got a meta tensor)"}
            tensor = value.detach()
            if tensor.layout != torch.strided:  # sparse outputs are compared as their dense values
                tensor = tensor.to_dense()
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


_FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"


def _waited(value: torch.Tensor) -> torch.Tensor:
    """An ``AsyncCollectiveTensor`` (exactly torch's class, holding a plain tensor) as that tensor once its collective
    has finished (``_c10d_functional.wait_tensor``, a no-op where it has); anything else as it is. Its slot is read
    and torch's op called: no method of the object runs."""
    module = sys.modules.get(_FUNCTIONAL_COLLECTIVES)  # not imported: no such tensor can exist
    if module is None or type(value) is not getattr(module, "AsyncCollectiveTensor", None):
        return value
    elem = value.elem
    return torch.ops._c10d_functional.wait_tensor(elem) if type(elem) is torch.Tensor else value


def send_reply(conn: Connection, reply: dict) -> None:
    """Send ``reply`` to the parent: as a sealed memory file passed over the socket where this system has
    them and the file fits under this process's file-size limit, else as bytes in the stream."""
    memory_file = _sealed_memory_file(reply) if _MEMORY_FILES else None
    if memory_file is not None:
        try:
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                socket.send_fds(sock, [_SIZE.pack(_IN_MEMORY_FILE)], [memory_file])
            return
        except OSError as exc:
            if exc.errno != errno.ENOTSOCK:  # a pipe: the stream below; anything else is the channel's end
                raise
        finally:
            os.close(memory_file)
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    conn.send_bytes(buffer.getbuffer())


def _sealed_memory_file(reply: dict) -> int | None:
    """A memory file holding ``reply``, sealed against every change; None where it cannot be made or might
    pass this process's file-size limit (a write past it ends the process: SIGXFSZ)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and 2 * tensor_bytes(reply) + (64 << 20) > limit:
        return None
    try:
        memory_file = os.memfd_create("pkb-reply", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        with open(memory_file, "wb", closefd=False) as file:
            torch.save(reply, file)
        fcntl.fcntl(memory_file, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(memory_file)
        return None
    return memory_file


def tensor_bytes(value) -> int:
    """The bytes of the tensors in ``value`` (a reply: tensors, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def decode_reply(source: io.BytesIO | str, mapped: bool = False) -> dict:
    """A reply decoded from a stream or (``mapped``: its tensors mapped from) a file's path."""
    try:
        reply = torch.load(source, weights_only=True, map_location="cpu", mmap=mapped)
    except Exception as exc:
        raise ChannelError(f"unreadable reply from a rank ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(reply, dict):
        raise ChannelError(f"a rank replied with a {type(reply).__name__}, not a message")
    return reply
