"""The README a newcomer reads in five minutes stays short and true: at most 20,000 characters, its test command
the one CI runs, every `pkb` command line in it accepted by the command line's parser (every flag spelt out,
not abbreviated), every `pkb ...` it names inline a real command with real flags, and every document it links
present. What moved out of it lives in docs/ (the problem table: tests/unit/test_contract.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pkb.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MAX_CHARS = 20_000


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if language in languages]


def command_lines(text: str) -> list[str]:
    """The ``pkb`` command lines of ``text``'s bash blocks (after ``&&``, from ``.venv/bin/pkb`` too) and the
    ``$ pkb ...`` lines of its text blocks, comments and a trailing ``&`` left out."""
    lines = []
    for body in code_blocks(text, ("bash", "sh", "")):
        for line in body.splitlines():
            for part in line.split("&&"):
                part = part.split(" #")[0].strip().removesuffix("&").strip()
                part = re.sub(r"^(\.venv/bin/)?pkb\b", "pkb", part)
                if part.startswith("pkb "):
                    lines.append(part)
    for body in code_blocks(text, ("text",)):
        lines += [line.removeprefix("$ ").strip() for line in body.splitlines() if line.startswith("$ pkb ")]
    return lines


def inline_commands(text: str) -> list[str]:
    """Every inline code span that starts with ``pkb `` (a command named in the prose; not the solution set
    ``pkb shipped``)."""
    from pkb.store.db import SHIPPED_SET

    spans = [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)]
    return [span for span in spans if span.startswith("pkb ") and span != SHIPPED_SET]


def subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, action.choices


def flags_of(subparser) -> set[str]:
    return {flag for action in subparser._actions for flag in action.option_strings}


def words(line: str) -> list[str]:
    return shlex.split(re.sub(r'"?\$\([^)]*\)"?', "VALUE", line))[1:]  # `pkb` dropped, $(cat url.txt) a value


def test_the_readme_is_short():
    assert len(README) <= MAX_CHARS, f"README.md is {len(README)} characters: move detail to docs/"


def test_the_readmes_test_command_is_what_ci_runs():
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.startswith(".venv/bin/python -m pytest")]
    assert ci == [".venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadgroup"]
    assert f"bash scripts/setup.sh && {ci[0]}" in README
    assert "bash scripts/setup.sh && .venv/bin/pkb run\n" in README


def test_every_command_line_in_the_readme_parses():
    parser, commands = subparsers()
    lines = command_lines(README)
    assert len(lines) >= 10 and "pkb run" in lines
    for line in lines:
        argv = words(line)
        parser.parse_args(argv)  # a usage error raises (pkb.console.UsageError) and names the line's fault
        unknown = [w.split("=")[0] for w in argv[1:] if w.startswith("--") and w.split("=")[0] not in
                   flags_of(commands[argv[0]])]
        assert not unknown, f"{line}: {unknown} abbreviated or unknown"


def test_every_command_the_readme_names_inline_exists_with_its_flags():
    _, commands = subparsers()
    named = inline_commands(README)
    assert named
    for line in named:
        argv = words(line)
        assert argv and argv[0] in commands, f"`{line}`: no command {argv[:1]}"
        unknown = [w for w in argv[1:] if w.startswith("--") and w not in flags_of(commands[argv[0]])]
        assert not unknown, f"`{line}`: {argv[0]} has no {unknown}"


def test_the_command_line_check_catches_a_wrong_flag_and_a_missing_argument():
    from pkb.console import UsageError

    parser, commands = subparsers()
    with pytest.raises(UsageError, match="--problem"):  # `eval` takes no --problems
        parser.parse_args(words("pkb eval 1 my.py --problems 1-2"))
    with pytest.raises(UsageError, match="required"):
        parser.parse_args(words("pkb generate --problems 1"))
    assert command_lines("```bash\nbash scripts/setup.sh && .venv/bin/pkb run &  # comment\n```") == ["pkb run"]
    assert "--problem" not in flags_of(commands["agent"])  # `agent --problem` is an abbreviation, refused above


def test_every_document_the_readme_links_exists():
    links = re.findall(r"\]\(([^)#]+)", README)
    missing = [link for link in links if not (REPO / link).exists()]
    assert links and not missing, missing
    for moved in ("docs/usage.md", "docs/problems.md", "docs/results.md", "docs/architecture.md"):
        assert f"({moved})" in README
