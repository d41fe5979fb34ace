"""pkb parses Python one parse at a time per process (pkb.syntax): CPython before 3.13 fails threads that
parse at once with ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905)."""

from __future__ import annotations

import ast
import threading
import time

from pkb import syntax
from pkb.evaluate import candidate, tripwire
from pkb.generate import extract


def test_parses_from_many_threads_never_overlap(monkeypatch):
    inside, most, lock = [0], [0], threading.Lock()
    real = ast.parse

    def slow_parse(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # lets another thread in, as a collection's finalizer can inside the real one
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(ast, "parse", slow_parse)
    source = "def solution(tensor):\n    return tensor\n"
    callers = [lambda: syntax.parse(source), lambda: tripwire.scan(source),
               lambda: candidate._declared_requirements(source), lambda: extract.defines_solution(source)]
    threads = [threading.Thread(target=lambda call=call: [call() for _ in range(20)]) for call in callers * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1, f"{most[0]} parses ran at once"
