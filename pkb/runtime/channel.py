"""The message channel between the parent and a rank process.

Parent -> worker: pickled job dicts (the worker trusts its parent).
Worker -> parent: ``torch.save`` bytes read back with ``torch.load(weights_only=True)``, so a
candidate that writes to the channel can send tensors, numbers, strings, lists and dicts, but never
an object whose unpickling runs code in the process that decides the verdict.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch


class ChannelError(RuntimeError):
    """A reply that is not a well-formed message (garbage on the channel)."""


def send_job(conn: Connection, job: dict) -> None:
    conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))


def recv_job(conn: Connection) -> dict:
    return pickle.loads(conn.recv_bytes())


def to_plain(value: Any) -> Any:
    """A copy of ``value`` made of plain CPU tensors, lists, dicts, numbers and strings.

    Tensors are copied to the CPU into storage of their own size (a view does not drag its whole
    base along). Tuples become lists; the parent compares structure, not container type.
    """
    if isinstance(value, torch.Tensor):
        plain = value.detach()
        if plain.layout != torch.strided:  # sparse outputs are compared as their dense values
            plain = plain.to_dense()
        if type(plain) is not torch.Tensor:
            plain = plain.as_subclass(torch.Tensor)
        return plain.to("cpu").clone(memory_format=torch.contiguous_format)
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return {"__unsupported__": type(value).__qualname__}


def send_reply(conn: Connection, reply: dict) -> None:
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    conn.send_bytes(buffer.getbuffer())


def decode_reply(data: bytes) -> dict:
    try:
        reply = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ChannelError(f"unreadable reply from a rank ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(reply, dict):
        raise ChannelError(f"a rank replied with a {type(reply).__name__}, not a message")
    return reply
