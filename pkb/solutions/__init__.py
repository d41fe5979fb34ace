"""Shipped solutions: files named ``<number>_<slug>[_<variant>].py``, each defining ``solution(...)``.

``pkb run`` evaluates every file here against its problem. A file that needs a GPU says so with
``REQUIRES = ("cuda",)`` and is reported ``skipped`` in ``cpu`` mode.
"""
