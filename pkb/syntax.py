"""``ast.parse`` that is safe when threads parse at once, and ``dotted``, the name an expression spells.

CPython before 3.13 keeps the depth counter of the C-to-Python AST conversion in interpreter-wide state, so
two threads in ``ast.parse`` at once can fail with ``SystemError: AST constructor recursion depth mismatch``
(python/cpython#106905). pkb parses from many threads: ``pkb serve`` reads each request's source in a worker
thread while its loop thread and the executor's slots check others, and the RL environments extract code
from several answers at once. Every parse in pkb goes through ``parse``, one at a time in the process (a
parse takes milliseconds). Before this, 2 of 1,000 requests to a loaded ``pkb serve`` failed so.
"""

from __future__ import annotations

import ast
import threading

_ONE_AT_A_TIME = threading.RLock()  # reentrant: a finalizer that parses, run by a collection inside a parse


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, never beside another parse of this process."""
    with _ONE_AT_A_TIME:
        return ast.parse(source, filename)


def dotted(node: ast.AST) -> str:
    """The dotted name an attribute chain spells (``torch.cuda.synchronize``), or "" where it starts with no name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))
