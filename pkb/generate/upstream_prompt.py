"""The upstream benchmark's own generation prompt (``--prompt upstream --upstream-dir DIR``).

For a researcher who runs a new model under the paper's protocol. Nothing of upstream's wording is
copied into pkb: the prompt is assembled at run time from a clone of the upstream repository, by the
rules of its ``kernelgen/generate_kernel.py`` (docs/generation.md, "The upstream prompt"):

- the templates come from ``kernelgen/prompts.toml``; the backend is the one asked for (``cuda`` by
  default, as upstream's ``meta.default_backend``), the precision ``meta.default_precision`` (bf16);
- the context: the backend's ``backend_display``, the precision's ``precision_display``, the problem's
  reference file ``reference/<number>_<name>.py`` as ``ref_arch_src``, and no hardware section (upstream
  adds one only when ``--hardware`` names a ``[hardware_profiles.*]`` row);
- the in-context examples: the backend's ``in_context_examples``, each read from the files it names
  and rendered with ``templates.common.example_entry_template``, joined by a blank line, introduced by
  ``example_intro_one_shot`` (one example) or ``example_intro_few_shot``;
- the user message: each of ``options.generate_kernel.components`` rendered from ``[shared]`` (else
  ``[templates.common]``) with that context, stripped, the non-empty ones joined by a blank line,
  then the footer naming the file to produce: upstream names it in its run's directory, which holds the
  model's name; pkb says ``solutions_<backend>/<stem>_<backend>.py`` (upstream's default for cuda);
- the system message: the backend's ``generate_kernel_system_prompt`` where set, else the
  ``SYSTEM_PROMPT`` constant of ``kernelgen/generate_kernel.py``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from pkb import syntax
from pkb.generate.prompt import Prompt, PromptError, build_prompt, default_world_size

if TYPE_CHECKING:
    from pkb.problem import Case, Problem

PROMPT_KINDS = ("pkb", "upstream")
TEMPLATES = Path("kernelgen/prompts.toml")
GENERATOR = Path("kernelgen/generate_kernel.py")


def build_upstream_prompt(problem: Problem, backend: str, upstream_dir: str | Path, world_size: int,
                          precision: str | None = None) -> Prompt:
    """Upstream's prompt for ``problem`` in ``precision`` (its ``--precision``) from the clone at
    ``upstream_dir`` (see the module's docstring)."""
    root = Path(upstream_dir)
    config = _templates(root)
    backends = config.get("backends", {})
    if backend not in backends:
        raise PromptError(f"{root / TEMPLATES} has no backend {backend!r} (it has: {', '.join(backends)})")
    precision = precision or config.get("meta", {}).get("default_precision", "bf16")
    if precision not in config.get("precision", {}):
        raise PromptError(f"{root / TEMPLATES} has no precision {precision!r} (it has: {', '.join(config.get('precision', {}))})")
    stem = reference_stem(root, problem)
    context = {"backend_display": backends[backend]["backend_display"],
               "precision_display": config["precision"][precision]["precision_display"],
               "ref_arch_src": (root / "reference" / f"{stem}.py").read_text(), "hardware_context_body": ""}
    context.update(_examples(config, backend, root, context))
    rendered = [_render(config, name, context).strip() for name in config["options"]["generate_kernel"]["components"]]
    footer = (f"\nThe generated file will be saved as: solutions_{backend}/{stem}_{backend}.py\n"
              "Produce the complete Python file contents for that path.")
    user = "\n\n".join(part for part in rendered if part) + footer
    return Prompt(_system(config, backend, root), user, problem.name, "upstream", world_size, backend, "none",
                  kind="upstream", precision=precision)


def prompt_for(problem: Problem, backend: str, profile, world_size: int | None = None, kind: str = "pkb",
               upstream_dir: str | Path | None = None, case: Case | None = None,
               precision: str | None = None, nodes: int | None = None) -> Prompt:
    """The prompt a run in ``precision`` asks for: pkb's own (``build_prompt``, showing ``case``), or
    upstream's from the clone at ``upstream_dir`` (which shows no case)."""
    if kind == "pkb":
        return build_prompt(problem, backend, profile, case=case, world_size=world_size, precision=precision, nodes=nodes)
    if kind != "upstream" or upstream_dir is None:
        raise PromptError("--prompt upstream needs --upstream-dir DIR (a clone of the upstream benchmark)"
                          if kind == "upstream" else f"unknown prompt {kind!r}; use one of {', '.join(PROMPT_KINDS)}")
    return build_upstream_prompt(problem, backend, upstream_dir, world_size or default_world_size(problem, profile),
                                 precision)


def reference_stem(root: Path, problem: Problem) -> str:
    """The stem of ``problem``'s file in the clone's ``reference/`` (``11_allgather_gemm_AT``)."""
    found = sorted(path.stem for path in (root / "reference").glob(f"{problem.upstream_id}_*.py"))
    named = [stem for stem in found if stem.split("_", 1)[1].lower() == problem.name]
    if not (named or found):
        raise PromptError(f"{root / 'reference'} has no file for problem {problem.upstream_id} ({problem.name}); "
                          "is --upstream-dir a clone of the upstream benchmark?")
    return (named or found)[0]


def _templates(root: Path) -> dict:
    path = root / TEMPLATES
    if not path.is_file():
        raise PromptError(f"{path} not found: --upstream-dir must be a clone of the upstream benchmark "
                          "(with kernelgen/prompts.toml, its example files and reference/)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PromptError(f"{path} is not valid TOML: {exc}") from None


def _examples(config: dict, backend: str, root: Path, context: dict) -> dict:
    common = config["templates"]["common"]
    examples = config["backends"][backend].get("in_context_examples") or []
    if not examples:
        raise PromptError(f"backends.{backend}.in_context_examples in {root / TEMPLATES} is empty")
    intro = common["example_intro_one_shot" if len(examples) == 1 else "example_intro_few_shot"].format(**context)
    entries = []
    for number, example in enumerate(examples, 1):
        files = {}
        for key, slot in (("pytorch_solution", "input_code"), ("custom_solution", "output_code")):
            path = root / example[key]
            if not path.is_file():
                raise PromptError(f"{path} (backends.{backend}.in_context_examples[{number - 1}].{key}) not found")
            files[slot] = path.read_text()
        entries.append(common["example_entry_template"].format(
            **context, example_label=example.get("label") or f"Example {number}", **files))
    return {"examples_intro": intro, "examples_entries": "\n\n".join(entries)}


def _render(config: dict, name: str, context: dict) -> str:
    for table in (config["shared"], config["templates"]["common"]):
        if name in table:
            return table[name].format(**context)
    raise PromptError(f"options.generate_kernel names an unknown prompt component {name!r}")


def _system(config: dict, backend: str, root: Path) -> str:
    custom = config["backends"][backend].get("generate_kernel_system_prompt")
    if isinstance(custom, str) and custom.strip():
        return custom.strip()
    path = root / GENERATOR
    if path.is_file():
        for node in syntax.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SYSTEM_PROMPT" for t in node.targets) \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise PromptError(f"no system prompt: backends.{backend}.generate_kernel_system_prompt is unset and {path} "
                      "has no SYSTEM_PROMPT string")
