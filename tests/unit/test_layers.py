"""The package's layers point down: every module of ``pkb`` imports only modules of its own layer or of
the layers below it (``LAYERS``, bottom first; docs/architecture.md states the same order), and no import
cycle exists inside ``pkb``. Imports made inside functions count too (a lazy import is still a dependency), and
so do imports through importlib (``importlib.import_module("pkb.x")``, ``__import__``, with the name written
out, a module-level constant, or a loop over one). The problem suite and the shipped solutions are in the graph:
they may use ``pkb.problem``, ``pkb.protocol`` and the ``pkb.kernels`` helpers, nothing above."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pkb"

# Bottom first. A name is a module or package directly under pkb; everything inside a package shares its
# layer.
LAYERS = (
    ("pkb.protocol", "pkb.options", "pkb.details", "pkb.topology", "pkb.syntax", "pkb.console", "pkb.progress",
     "pkb.client"),  # no torch
    ("pkb.problem",),  # the contract every problem fills
    ("pkb.kernels",),  # what a candidate may use: extension builds, symmetric memory
    ("pkb.problems", "pkb.solutions"),  # the suite and the shipped solutions: the contract and the kernels helpers
    ("pkb.registry", "pkb.describe"),  # the suite, found by discovery
    ("pkb.runtime",),  # rank processes: launch, sandbox (its plan), confine (entering it), worker, timed loop, builds
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
IMPORT_CALLS = ("importlib.import_module", "import_module", "__import__")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The pkb modules the file at ``path`` imports (a package import counts as its __init__)."""
    this = module_name(path)
    return imports_in(path.read_text(), this, this if path.name == "__init__.py" else this.rpartition(".")[0],
                      modules)


def imports_in(source: str, this: str, package: str, modules: set[str]) -> set[str]:
    """The pkb modules of ``modules`` that the source of module ``this`` (in ``package``) imports: its import
    statements anywhere, and its importlib calls whose module name can be read (``imported_by_importlib``)."""
    tree = ast.parse(source)
    found = set()
    for node in ast.walk(tree):
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
    for name in imported_by_importlib(tree):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != this and name != "pkb":
            found.add(name)
    return found


def imported_by_importlib(tree: ast.Module) -> set[str]:
    """The module names a module's importlib calls (``IMPORT_CALLS``) import, where they can be read: a string
    written out, a module-level constant (a string, or a tuple or list of them), or the variable of a ``for``
    loop over such a constant. A name computed at run time is not seen."""
    constants: dict[str, list[str]] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and node.value is not None:
            strings = _strings(node.value)
            if strings:
                constants[target.id] = strings
    for node in ast.walk(tree):  # a loop over a constant binds its variable to the constant's names
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, ast.Name) and node.iter.id in constants:
            constants.setdefault(node.target.id, constants[node.iter.id])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in IMPORT_CALLS:
            argument = node.args[0]
            named = constants.get(argument.id, []) if isinstance(argument, ast.Name) else []
            found.update(_strings(argument) or named)
    return found


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                        for e in node.elts):
        return [e.value for e in node.elts]
    return []


def import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
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


def test_the_suite_and_the_shipped_solutions_are_in_the_graph():
    graph = import_graph()
    assert "pkb.problems.collectives.allreduce" in graph and "pkb.solutions._peer_common" in graph
    assert "pkb.problems" in graph["pkb.registry"]  # discovery imports the suite through importlib


FAKE_MODULES = {"pkb.problem", "pkb.protocol", "pkb.kernels", "pkb.kernels.build", "pkb.evaluate",
                "pkb.evaluate.compare", "pkb.runtime.worker", "pkb.problems.collectives.allreduce",
                "pkb.solutions.mine", "pkb.registry", "pkb.cli", "pkb.report.cli"}


def test_a_problem_or_a_solution_that_imports_above_the_kernels_helpers_fails():
    problem = imports_in("from pkb.problem import Case\nfrom pkb.kernels import load_cuda\n"
                         "def cost(case, world_size):\n    from pkb.evaluate.compare import compare\n",
                         "pkb.problems.collectives.allreduce", "pkb.problems.collectives", FAKE_MODULES)
    solution = imports_in("import pkb.runtime.worker\nfrom pkb.kernels.build import load_cuda\n",
                          "pkb.solutions.mine", "pkb.solutions", FAKE_MODULES)
    assert upward({"pkb.problems.collectives.allreduce": problem, "pkb.solutions.mine": solution}) == [
        "pkb.problems.collectives.allreduce -> pkb.evaluate.compare", "pkb.solutions.mine -> pkb.runtime.worker"]


def test_an_importlib_import_that_points_up_fails():
    source = """
import importlib
from importlib import import_module

PLUGINS = ("pkb.report.cli",)
EVALUATOR = "pkb.evaluate"


def load(name):
    importlib.import_module("pkb.cli")
    import_module(EVALUATOR)
    for plugin in PLUGINS:
        importlib.import_module(plugin)
    importlib.import_module(name)  # computed at run time: not seen
    return __import__("pkb.kernels.build")
"""
    found = imports_in(source, "pkb.problems.collectives.allreduce", "pkb.problems.collectives", FAKE_MODULES)
    assert found == {"pkb.cli", "pkb.evaluate", "pkb.report.cli", "pkb.kernels.build"}
    assert upward({"pkb.problems.collectives.allreduce": found}) == [
        "pkb.problems.collectives.allreduce -> pkb.cli", "pkb.problems.collectives.allreduce -> pkb.evaluate",
        "pkb.problems.collectives.allreduce -> pkb.report.cli"]


def test_the_layers_in_the_docs_are_the_layers_tested():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    documented = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| ") and
                  line.split("|")[1].strip().isdigit()]
    assert documented == [", ".join(f"`{name.removeprefix('pkb.')}`" for name in layer) for layer in LAYERS]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The evaluation core talks to the rank processes in one place (issue 50): pkb.evaluate.ranks (one evaluation's
# rank groups, the rank messages, the failures of the ranks as verdicts) and pkb.evaluate.session (the warm groups
# across evaluations). The rest of pkb.evaluate judges what they return. pkb.evaluate.config asks the machine what it
# offers (pkb.runtime.modes: its GPUs; pkb.runtime.sandbox: its protections) where options are resolved, and
# pkb.evaluate.failures reads what a failure of the ranks was (the runtime's failure types, the GPU's memory as the
# driver reports it); neither starts a rank.
TALKS_TO_THE_RANKS = {"pkb.evaluate.ranks", "pkb.evaluate.session", "pkb.evaluate.config", "pkb.evaluate.failures"}


def test_only_the_ranks_and_the_session_of_the_evaluation_core_import_the_runtime():
    graph = import_graph()
    talking = {module for module, imported in graph.items() if module.startswith("pkb.evaluate")
               and any(name == "pkb.runtime" or name.startswith("pkb.runtime.") for name in imported)}
    assert talking == TALKS_TO_THE_RANKS, talking


def test_compare_walks_and_accuracy_alone_decides_which_rule_judges_a_value():
    """Inside the evaluation core (issue 55): pkb.evaluate.compare walks replies and imports nothing of
    pkb.evaluate (no call back, lazy or not), and pkb.evaluate.accuracy is the one module there that reads a problem's
    tolerance (the rule for a value: exact, bit for bit, the accuracy rule; everyone else asks it)."""
    graph = import_graph()
    assert {name for name in graph["pkb.evaluate.compare"] if name.startswith("pkb.evaluate")} == set()
    readers = sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "evaluate").glob("*.py")
                     if any(isinstance(node, ast.ImportFrom) and node.module == "pkb.problem"
                            and any(alias.name == "Tolerance" for alias in node.names)
                            for node in ast.walk(ast.parse(path.read_text()))))
    assert readers == ["evaluate/accuracy.py"]
