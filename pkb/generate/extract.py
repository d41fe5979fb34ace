"""Find the solution file in a model's answer, without running it.

Every fenced code block is considered (```python, ```py, ``` or ~~~; a last block the answer
cut off counts too); the one kept is the last that defines ``solution`` at top level (a function,
an assignment or an import of that name). An answer without fences that is itself Python defining
``solution`` is taken whole. The kept source is compiled (``compile()`` runs nothing) so a syntax
error is known before evaluation; the evaluator reports it as ``compile_error``.

    >>> extract_solution("Here:\\n```python\\ndef solution(x):\\n    return x\\n```").code
    'def solution(x):\\n    return x\\n'
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from pkb import syntax

_FENCE = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<body>.*?)(?:^[ \t]*(?P=fence)[ \t]*$|\Z)",
                    re.MULTILINE | re.DOTALL)
_DEFINES_SOLUTION = re.compile(r"^(?:async\s+)?def\s+solution\s*\(|^solution\s*=", re.MULTILINE)


@dataclass(frozen=True)
class Extraction:
    """The chosen code, how many code blocks the answer had, and the compiler's complaint if any."""

    code: str
    num_blocks: int
    syntax_error: str | None


def code_blocks(text: str) -> list[str]:
    return [match.group("body") for match in _FENCE.finditer(text)]


def defines_solution(source: str) -> bool:
    try:
        tree = syntax.parse(source)
    except (SyntaxError, ValueError):
        return bool(_DEFINES_SOLUTION.search(source))  # broken code still counts: the verdict will say why
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "solution":
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "solution" for t in targets):
                return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == "solution" for a in node.names):
            return True
    return False


def syntax_error(source: str) -> str | None:
    try:
        compile(source, "solution.py", "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    except ValueError as exc:  # null bytes
        return str(exc)
    return None


def extract_solution(text: str) -> Extraction | None:
    """The solution in ``text``, or None when no code block (nor the whole answer) defines ``solution``."""
    blocks = code_blocks(text)
    candidates = [b for b in blocks if defines_solution(b)]
    if not candidates and not blocks and text.strip() and syntax_error(text) is None and defines_solution(text):
        candidates = [text]
    if not candidates:
        return None
    code = candidates[-1].rstrip() + "\n"
    return Extraction(code, len(blocks), syntax_error(code))
