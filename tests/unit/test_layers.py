"""The package's layers point down: every module of ``pkb`` imports only modules of its own layer or of
the layers below it (``LAYERS``, bottom first; docs/architecture.md states the same order), and no import
cycle exists inside ``pkb``. Imports made inside functions count too (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pkb"

# Bottom first. A name is a module or package directly under pkb; everything inside a package shares its
# layer. (The problems and the shipped solutions sit outside: they use pkb.problem and pkb.kernels.)
LAYERS = (
    ("pkb.protocol", "pkb.options", "pkb.topology", "pkb.syntax", "pkb.console", "pkb.progress", "pkb.client"),  # no torch
    ("pkb.problem",),  # the contract every problem fills
    ("pkb.registry", "pkb.describe"),  # the suite, found by discovery
    ("pkb.kernels",),  # what a candidate may use: extension builds, symmetric memory
    ("pkb.runtime",),  # rank processes: launch, sandbox, worker, the rank-side timed loop, builds
    ("pkb.hardware",),  # the machine model: profiles, detection, roofline
    ("pkb.evaluate",),  # the parent's verdict: correctness, timing, sessions of rank groups
    ("pkb.store",),  # the results database
    ("pkb.executor",),  # where evaluations run: here side by side, or on Ray
    ("pkb.loop", "pkb.commands"),  # the one evaluation loop; what evaluating commands share
    ("pkb.solution_files",),  # which file is for which problem: a run's plan
    ("pkb.report", "pkb.measure"),  # reports; calibrate and baseline, measured through the harness
    ("pkb.generate",),  # prompts, models, samples, the agent
    ("pkb.serve",),  # the evaluation service
    ("pkb.rl",),  # RL environments on the service
    ("pkb.cli", "pkb.__main__"),  # the pkb command
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The pkb modules ``path`` imports (a package import counts as its __init__)."""
    found = set()
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this and name != "pkb":
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "problems" not in p.parts and "solutions" not in p.parts]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the layer ``module`` belongs to (its top-level name under pkb)."""
    top = ".".join(module.split(".")[:2])
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module} is in no layer: add {top} to LAYERS (tests/unit/test_layers.py) and "
                         "docs/architecture.md")


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up a layer, as ``a -> b``."""
    return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported
                  if b != "pkb" and layer_of(b) > layer_of(a))


def test_there_is_no_import_cycle_inside_pkb():
    assert cycles(import_graph()) == []


def test_every_import_points_down_a_layer_or_stays_in_its_own():
    assert upward(import_graph()) == []


def test_the_direction_check_finds_an_import_that_points_up():
    assert upward({"pkb.runtime.worker": {"pkb.evaluate.timing"}, "pkb.evaluate.timing": {"pkb.runtime.group"}}) == [
        "pkb.runtime.worker -> pkb.evaluate.timing"]


def test_the_layers_in_the_docs_are_the_layers_tested():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    documented = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| ") and
                  line.split("|")[1].strip().isdigit()]
    assert documented == [", ".join(f"`{name.removeprefix('pkb.')}`" for name in layer) for layer in LAYERS]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
