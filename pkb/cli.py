"""The ``pkb`` command: list, show, eval, run.

Exit codes: 0 no failure (every verdict ``ok`` or ``skipped``: pkb.options.NO_FAILURE), 1 any other verdict, 2 a
usage error (unknown problem, unknown flag, missing file, an option out of its range, a mode this machine cannot
run, ``--sandbox required`` where a protection is missing, a results database pkb cannot write), with one sentence
that says what to do instead and nothing written; with ``--json`` also one JSON object on stdout (``{"status":
"usage_error", ...}``). 3 when pkb itself failed (``eval``; ``run`` counts it as 1). ``--help``, unknown problems
and flags, options out of range and a missing candidate file are said before torch is imported (pkb.registry reads
the suite's names from its source).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from pkb import __version__
from pkb.commands import (SELF_CHECK_TRIALS, add_eval_options, add_experiment_option, add_option, make_config,
                          make_executor, served_options)
from pkb.console import UsageError, print_table, shorten
from pkb.describe import describe, human_bytes, shapes_of_inputs
from pkb.options import DEFAULT_EXPERIMENT, NO_FAILURE, OPTIONS, Status

USAGE_ERROR = 2
HARNESS_FAILURE = 3  # pkb itself failed: no verdict on the candidate


# -- list / show -----------------------------------------------------------------------------------


LIST_SOURCE_WIDTH = 60  # `pkb list` fits a terminal; the whole source is in --json and `pkb show`


def cmd_list(args) -> int:
    from pkb.registry import all_problems

    problems = [p for p in all_problems().values() if args.category in (None, p.category)]
    if args.category and not problems:
        from pkb.problem import CATEGORIES

        raise UsageError(f"no problem in category {args.category!r}; categories: {', '.join(CATEGORIES)}")
    rows = [{"name": p.name, "upstream_id": p.upstream_id, "category": p.category, "source": p.source,
             "version": p.version, "world_sizes": list(p.world_sizes), "num_upstream": len(p.upstream),
             "num_tests": len(p.tests), "num_benchmarks": len(p.benchmarks)} for p in problems]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    shown = [{**row, "source": shorten(row["source"], LIST_SOURCE_WIDTH)} for row in rows]
    print_table(shown, ["upstream_id", "name", "category", "version", "world_sizes", "source"],
                headers=["#", "problem", "category", "v", "world sizes", "source"])
    print(f"\n{len(rows)} problems (each source whole: `pkb show PROBLEM` or `pkb list --json`)")
    return 0


def cmd_show(args) -> int:
    from pkb.problem import CASE_KINDS
    from pkb.registry import get_problem

    problem = get_problem(args.problem)
    world_size = args.world_size or problem.world_sizes[0]
    nodes = args.nodes or problem.nodes[0]
    if not problem.runs_on(world_size, nodes):
        raise UsageError(f"{problem.name} runs at world sizes {list(problem.world_sizes)} on "
                         f"{' or '.join(map(str, problem.nodes))} node(s) that divide them; pick --world-size and --nodes")
    case = problem.find_case(args.case, nodes=nodes) if args.case else (
        problem.cases("upstream", world_size, nodes=nodes) or problem.cases("tests", world_size, nodes=nodes))[0]
    module = sys.modules[problem.reference.__module__]
    print(f"# {problem.name} (upstream {problem.upstream_id}, {problem.category}, version {problem.version})")
    print(f"# source: {problem.source}")
    print(f"# solution({', '.join(problem.argument_names)})  world sizes {list(problem.world_sizes)}"
          + (f"  nodes {list(problem.nodes)}" if problem.nodes != (1,) else ""))
    if problem.local_answer:
        print(f"# note: the answer needs no communication ({problem.local_answer})")
    if problem.exact_dtype is None:
        print(f"# accuracy: floating outputs against the reference's by the tolerance ({problem.exact_note})")
    else:
        from pkb.evaluate.accuracy import FACTOR

        print(f"# accuracy: against the exact answer, the reference in {str(problem.exact_dtype).removeprefix('torch.')}"
              + (f" ({problem.exact_note})" if problem.exact_note else "") + f": at most {FACTOR:g}x the reference's "
              "error (docs/paper-protocol.md)")
    for kind in CASE_KINDS:
        print(f"# {kind} cases: " + (", ".join(c.name + (f" (W={','.join(map(str, c.world_sizes))})" if c.world_sizes else "")
                                         for c in getattr(problem, kind)) or "-"))
    print()
    print(inspect.getsource(module))
    print(f"## {case.kind} case {case.name} at world size {world_size}" + (f" on {nodes} nodes" if nodes > 1 else "")
          + f": {dict(case.params)}" + (f"  ({case.note})" if case.note else ""))
    for rank in range(world_size):
        described = ", ".join(f"{name}={describe(value)}" for name, value in
                              zip(problem.argument_names, shapes_of_inputs(problem, case, rank, world_size)))
        print(f"  rank {rank}: {described}")
    cost = problem.cost(case, world_size)
    print(f"## cost per rank: link {human_bytes(cost.link_bytes)}, "
          + (f"network {human_bytes(cost.network_bytes)}, " if cost.network_bytes else "") + f"{cost.flops:.3g} flop, "
          f"HBM {human_bytes(cost.hbm_bytes)}" + (f", pattern {cost.pattern}" if cost.pattern else ""))
    return 0


# -- eval / run ------------------------------------------------------------------------------------


def cmd_eval(args) -> int:
    if args.server is not None and not args.server.strip():  # `--server "$(cat url.txt)"` before the file exists
        raise UsageError("--server is empty: give the URL `pkb serve` prints (or writes with --url-file), "
                         "or leave --server out to evaluate here")
    if args.server:
        return _eval_on_server(args)
    path = None if args.candidate == "reference" else candidate_path(args.candidate)  # before torch is imported
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.evaluator import evaluate
    from pkb.registry import get_problem

    problem = get_problem(args.problem)
    candidate = Candidate.reference_of(problem) if path is None else Candidate.from_file(path)
    config = make_config(args, problem)
    result = evaluate(problem, candidate, config)
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print_verdict(result)
    return exit_status(result.status)


def exit_status(status: str) -> int:
    """``pkb eval``'s exit status for a verdict (a Status or its value): 0 where it is no failure (``ok``, or
    ``skipped``: pkb.options.NO_FAILURE), 3 where pkb or the machine failed (no verdict on the candidate), else 1."""
    if status in NO_FAILURE:
        return 0
    return 1 if Status(status).is_verdict else HARNESS_FAILURE


def candidate_path(given: str) -> Path:
    """The candidate file ``given`` names; UsageError saying what to give where it is no file."""
    path = Path(given)
    if path.is_dir():
        raise UsageError(f"{given} is a directory: give one .py file defining `solution` (a folder of solution "
                         "files is `pkb run --solutions DIR`)")
    if not path.is_file():
        raise UsageError(f"candidate file {given} not found (give a .py file defining `solution`, "
                         "or `reference` to check the problem's reference against itself)")
    return path


def _eval_on_server(args) -> int:
    """``pkb eval --server URL``: the file's text to the service, its verdict printed as here."""
    import os

    from pkb.client import Client, ServerError, result_view

    reference = args.candidate == "reference"
    if not reference:
        candidate_path(args.candidate)
    options = {**served_options(args), "name": "reference" if reference else Path(args.candidate).stem}
    if reference:
        options["reference"] = True
    try:
        source = None if reference else Path(args.candidate).read_text(encoding="utf-8", errors="replace")
        result = Client(args.server, os.environ.get("PKB_SERVE_TOKEN") or None).evaluate(args.problem, source, **options)
    except ServerError as exc:
        if exc.status == 400:
            raise UsageError(str(exc)) from None
        raise
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print_verdict(result_view(result))
    return exit_status(result["status"])


def print_verdict(result) -> None:
    nodes = getattr(result, "nodes", 1)
    ranks = f"{result.world_size} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
    print(f"{result.problem} / {result.solution}: {result.status.value}  ({result.mode}, {ranks}, {result.wall_s:.1f} s)")
    print(f"  {result.message}")
    if result.details.traceback or result.details.error:
        lines = user_traceback(result.details.traceback or result.details.error,
                               result.details.solution_path).strip().splitlines()
        if lines and lines[0].strip() and lines[0].strip() in result.message:  # said already (a syntax error's place)
            lines = lines[1:]
        if lines:
            print("  " + "\n  ".join(lines))
    if result.details.log_tail:
        tail = user_traceback(result.details.log_tail.strip(), result.details.solution_path)
        tail = shorten(tail, LOG_TAIL_CHARS, keep="end", one_line=False)
        print("  rank output (tail):\n    " + tail.replace("\n", "\n    "))
    for timing in result.timings:
        print(f"  {timing.case}: reference {timing.reference_s * 1e6:.1f} us, candidate {timing.candidate_s * 1e6:.1f} us,"
              f" speedup {timing.speedup:.2f}x" + (f", busbw {timing.busbw_gbps:.2f} GB/s" if timing.busbw_gbps else ""))
    if result.timings and not result.times_are_gpu_performance:
        print(f"  (times measured in {result.mode} mode: not GPU performance)")


_FRAME = re.compile(r'^(\s*)File "([^"]+)", line \d+')


def user_traceback(text: str, solution_path: str | None) -> str:
    """A rank's traceback as the candidate's author reads it: the frames of pkb's own code that lead into the
    candidate left out (a line says how many), so that the author's file and line come first, and the copy the
    rank imported (in its scratch folder) named by the author's file (``solution_path``, shown relative to the
    working directory where it is inside it). A traceback that never reaches code outside pkb is kept whole."""
    own = str(Path(__file__).resolve().parent) + os.sep
    blocks = re.split(r"(?m)^(?=Traceback \(most recent call last\):|(?:Current t|T)hread 0x[0-9a-f]+ )", text)
    shown = []
    for block in blocks:
        lines = block.splitlines()
        frames = [(i, match) for i, match in ((i, _FRAME.match(line)) for i, line in enumerate(lines)) if match]
        if "(most recent call first):" in block:  # a hung rank's stack (faulthandler): pkb's frames come after
            below = [i for i, match in frames if match.group(2).startswith(own) or match.group(2) == "<string>"]
            if below and len(below) < len(frames):
                count = f"{len(below)} frame{'s' * (len(below) > 1)}"
                note = f"{frames[0][1].group(1)}({count} of pkb's own code below left out)"
                lines = [line for i, line in enumerate(lines) if i not in set(below)] + [note]
            shown.append("\n".join(lines))
            continue
        first_user = next((n for n, (_, match) in enumerate(frames) if not match.group(2).startswith(own)), None)
        if first_user:
            start, indent = frames[0][0], frames[0][1].group(1)
            end = frames[first_user][0]
            note = f"{indent}({first_user} frame{'s' * (first_user > 1)} of pkb's own code before it left out)"
            lines = lines[:start] + [note] + lines[end:]
        shown.append("\n".join(lines))
    text = "\n".join(block for block in shown if block)
    if not solution_path:
        return text
    path = Path(solution_path)
    try:
        display = str(path.relative_to(Path.cwd()))
    except ValueError:
        display = str(path)
    return re.sub(rf'"[^"\n]*{re.escape(os.sep + path.name)}"',
                  lambda match: match.group(0) if match.group(0)[1:].startswith(own) else f'"{display}"', text)


def cmd_run(args) -> int:
    from pkb.loop import run_evaluations
    from pkb.solution_files import light_self_checks, plan, solution_files
    from pkb.progress import Progress
    from pkb.registry import select
    from pkb.store.db import DEFAULT_DB, ResultStore, check_store

    problems = select(args.problems)
    solutions_dir = Path(args.solutions) if args.solutions else None
    if solutions_dir is not None:
        if not solutions_dir.is_dir():
            raise UsageError(f"--solutions {solutions_dir} is not a directory")
        notes: list[str] = []
        solution_files(solutions_dir, notes)
        if not args.json:
            for note in notes:
                print(f"solutions: {note}", file=sys.stderr)
    if args.set is not None and not args.set.strip():
        raise UsageError("--set needs a name, e.g. --set gpt5-oneshot")
    self_check = solutions_dir is None or args.self_check
    evaluations = plan(problems, solutions_dir, include_reference=self_check, solution_set=args.set,
                       experiment=args.experiment)
    if not evaluations:
        raise UsageError("nothing to run: no solution file matches the selected problems")
    check_store(args.db or DEFAULT_DB)  # a --db it cannot store results in: said before any work, nothing written
    with make_executor(args) as executor:
        config = make_config(args, executor=executor)
        evaluations = light_self_checks(evaluations, config, cases=args.cases is None,
                                        trials=SELF_CHECK_TRIALS if args.trials is None else None)
        executor.capacity(config)  # decided now (a local executor's default is by the run's mode and world size)
        if not args.json and args.executor == "local":
            print(f"executor: {executor.describe()}", file=sys.stderr)
        with Progress(len(evaluations), enabled=not args.json, live=False if args.quiet else None,
                      in_flight=lambda: running_labels(executor)) as progress, \
                ResultStore(args.db or DEFAULT_DB) as store:
            results = run_evaluations(evaluations, config, store, progress.update, executor)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], default=str))
    else:
        print_run_summary(results, None if args.problems is None else problems, args.db or DEFAULT_DB,
                          checked_line(args, config, self_check, solutions_dir))
        if solutions_dir is None:
            print("\n" + what_it_means(results, config))
    return 0 if all(r.status in NO_FAILURE for r in results) else 1


def checked_line(args, config, self_check: bool, solutions_dir: Path | None) -> str:
    """What a run checked, in a sentence, and how to check the references as deeply as the solutions."""
    def depth(trials: int, cases: str) -> str:
        return f"{trials} trial{'s' if trials != 1 else ''} on " + ("every case" if cases == "all" else f"the {cases} cases")

    files = f"the files of {solutions_dir}" if solutions_dir else "pkb's shipped solutions"
    checked = f"{files}, {depth(config.trials, config.cases)}"
    if config.cases in ("all", "upstream") and config.upstream_trials > config.trials:
        checked += f" ({config.upstream_trials} on the upstream cases, which also give the paper's verdict)"
    if self_check:
        light = args.cases is None or args.trials is None
        references = (depth(SELF_CHECK_TRIALS if args.trials is None else config.trials, "upstream")
                      + " (the tests cases where this mode leaves those out)" if args.cases is None
                      else depth(SELF_CHECK_TRIALS, config.cases) if args.trials is None else "as deep")
        checked = f"each reference against itself, {references}; {checked}" + (
            f"; the references as deep: `pkb run --cases {config.cases} --trials {config.trials}`" if light else "")
    return f"checked ({config.mode} mode, W = {config.world_size}, {config.dtype}): {checked}"


def running_labels(executor) -> list[tuple[str, float]]:
    """The evaluations ``executor`` runs now, as ``(problem/solution, seconds running)``."""
    now = time.monotonic()
    return [(f"{item.evaluation.problem.name}/{item.evaluation.candidate.name}", now - item.started)
            for item in executor.in_flight()]


def print_run_summary(results, problems, db: str, checked: str = "") -> None:
    """What ``pkb run`` ends with: the results that need a look (each message shortened at a word or number
    boundary, ``MESSAGE_CHARS``, the whole of it in the database), the counts, how to report them (with
    ``--problems`` where the run's sets cover part of the suite, so that the HTML report plots what ran, and
    ``--experiment`` where the run named one), what was ``checked`` (a sentence), then the headline over the run's
    selection (``problems``; None: none was asked for, and the headline counts the paper's suite as ``pkb
    report`` does): one row per set, with what it covers.
    """
    from pkb.registry import selection_text
    from pkb.report import metrics, records
    from pkb.report.cli import headline_lines, suite_selection
    from pkb.store.db import DEFAULT_DB, REFERENCE_SET

    experiments = sorted({r.experiment for r in results if r.experiment})
    report_command = "pkb report" + ("" if db == DEFAULT_DB else f" --db {db}") + (
        f" --experiment {','.join(experiments)}" if experiments and experiments != [DEFAULT_EXPERIMENT] else "")
    failed = [r for r in results if r.status not in NO_FAILURE]
    if failed:
        print("results that need a look:")
        for r in failed:
            print(f"  {r.problem} / {r.solution} ({r.solution_set}): {r.status.value}\n"
                  f"    {shorten(r.message, MESSAGE_CHARS)}")
        if any(shorten(r.message, MESSAGE_CHARS) != " ".join(r.message.split()) for r in failed):
            print(f"  (a message ending in \u2026 is whole in `{report_command} --format json --table rows`)")
        print()
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    covered = {r.problem for r in results if r.solution_set != REFERENCE_SET}
    plotted = f"{report_command} --problems {selection_text(covered)} --html report.html" if covered else ""
    print(f"{len(results)} results in {db}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
          + f"\n(`{report_command}` for every set in the database"
          + (f"; `{plotted}` plots the {len(covered)} problem{'s' * (len(covered) > 1)} this run's sets cover)"
             if plotted else ", `--html FILE` for plots)"))
    print((checked + "\n") if checked else "")
    found = records.from_results(results)
    if problems is None:
        selection, notes = suite_selection({r.problem: r.category for r in found})
    else:
        selection, notes = {p.name: p.category for p in problems}, ()
    report = metrics.build_report(found, selection, "set", ks=(1,), notes=notes, experiments=experiments)
    headline_lines(report, "no candidate results: only the references' self-checks ran")


MESSAGE_CHARS = 400  # of a result's message in `pkb run`'s list of results that need a look
LOG_TAIL_CHARS = 1500  # of the ranks' output a verdict shows (its end; the whole is the result's details.log_tail)


def what_it_means(results, config) -> str:
    """For the main job (pkb's shipped solutions and every reference's self-check, run with ``config``): what it
    showed on this machine, in one sentence a first reader needs before the headline's percentages, e.g. ``what
    this means: 87 of 87 references passed against themselves here (cpu mode, W = 2): the suite and the harness
    work; pkb shipped is 21 worked examples, not a model's answers (19 skipped: they need a GPU or more ranks).
    Score a model's files with `pkb run --solutions DIR`.``"""
    from pkb.store.db import REFERENCE_SET, SHIPPED_SET

    def tally(solution_set: str) -> tuple[int, int, int]:
        rows = [r for r in results if r.solution_set == solution_set]
        return len(rows), sum(r.status.value == "ok" for r in rows), sum(r.status.value == "skipped" for r in rows)

    checked, ok, skipped = tally(REFERENCE_SET)
    said = (f"what this means: {ok} of {checked - skipped} references passed against themselves here"
            + (f" ({skipped} skipped)" if skipped else "") + f" ({config.mode.value} mode, W = {config.world_size}): "
            + ("the suite and the harness work" if ok == checked - skipped else "see the results that need a look"))
    shipped, _, skipped = tally(SHIPPED_SET)
    if shipped:
        said += (f"; {SHIPPED_SET} is {shipped} worked examples, not a model's answers"
                 + (f" ({skipped} skipped: they need a GPU or more ranks)" if skipped else ""))
    return said + ". Score a model's files with `pkb run --solutions DIR`."


# -- parser ------------------------------------------------------------------------------------------


class _ParseError(UsageError):
    """A command line argparse refused; ``prog`` is the command it was for (``pkb eval``)."""

    def __init__(self, message: str, prog: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse's parser (for every subcommand too), whose refusals are pkb's usage errors (``main``): one
    sentence and exit status 2, with ``--json`` one object on stdout, instead of argparse's usage block. An
    unknown flag is refused by the subcommand it was given to, with the closest of that subcommand's own flags:
    ``unrecognized arguments: --world_size 4; did you mean --world-size? (`pkb eval --help` lists what it takes)``."""

    subcommands: argparse.Action | None = None

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--trial 1` is refused with `--trials` named, never taken as it
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        wrong = re.match(r"argument command: invalid choice: '([^']*)'", message)
        if wrong and self.subcommands is not None:  # a mistyped subcommand: the closest, as for a flag
            close = difflib.get_close_matches(wrong.group(1), list(self.subcommands.choices), n=1, cutoff=0.6)
            message += f"; did you mean {close[0]}?" if close else ""
        raise _ParseError(f"{message} (`{self.prog} --help` lists what it takes)", self.prog)

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def parse_args(self, args=None, namespace=None):
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = self.command_parser(namespace)
            command.error(f"unrecognized arguments: {' '.join(unknown)}{command.closest_flag(unknown)}")
        return namespace

    def command_parser(self, namespace) -> "_Parser":
        """The parser of the subcommand ``namespace`` was parsed for (``pkb eval``'s), or this one."""
        chosen = self.subcommands.choices.get(getattr(namespace, self.subcommands.dest, None)) \
            if self.subcommands else None
        return chosen.command_parser(namespace) if chosen else self

    def closest_flag(self, words: list[str]) -> str:
        """``; did you mean --world-size?`` for the first of ``words`` close to one of this parser's flags, else ""."""
        flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        for word in (word for word in words if word.startswith("-")):
            close = difflib.get_close_matches(word.split("=", 1)[0].replace("_", "-"), flags, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pkb", description="Benchmark and evaluation harness for multi-GPU kernels.")
    parser.add_argument("--version", action="version", version=f"pkb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="every problem of the suite")
    p.add_argument("--category")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="a problem's reference, a case's per-rank inputs, its cost")
    p.add_argument("problem", help="slug or upstream number")
    p.add_argument("--case")
    add_option(p, OPTIONS["world_size"])
    add_option(p, OPTIONS["nodes"])
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("eval", help="one verdict for one candidate file")
    p.add_argument("problem", help="slug or upstream number")
    p.add_argument("candidate", help="a .py file defining solution(...), or `reference`")
    add_eval_options(p, None)
    p.add_argument("--server", help="evaluate on a `pkb serve` at this URL instead of here (this process then "
                                    "imports no torch); its token from $PKB_SERVE_TOKEN")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", help="many evaluations, stored in a database as they finish")
    p.add_argument("--solutions", help="directory of solution files (<slug>.py or <number>_<name>[_<backend>].py); "
                                       "default: pkb's shipped solutions plus each reference against itself")
    p.add_argument("--self-check", action="store_true", help="with --solutions, also check each reference against itself")
    p.add_argument("--set", help="the name results of --solutions are stored and reported under "
                                 "(default: the folder's name; pkb's own solutions are `pkb shipped`)")
    p.add_argument("--problems", help="e.g. 1-8,12,allgather_gemm or a category; default: all")
    p.add_argument("--db", help="SQLite file (default: ./pkb-results.sqlite)")
    add_experiment_option(p)
    p.add_argument("--quiet", action="store_true", help="a plain line per result instead of the live progress display "
                                                        "(what a log file or CI gets anyway)")
    add_eval_options(p, 2, executor=True)
    p.set_defaults(func=cmd_run)

    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(sub)
    return parser


# Subsystems that add their own subcommands: each module defines add_commands(subparsers) (with
# pkb.commands for the evaluation options) and imports nothing heavy at module level (parsing must stay fast).
COMMAND_MODULES: tuple[str, ...] = ("pkb.report.cli", "pkb.measure.cli", "pkb.generate.cli", "pkb.serve.cli")


INTERRUPT_GRACE_S = 15.0  # after Ctrl-C: how long pkb may take to end its groups and say so before it just exits
_INTERRUPTED_SAID = False  # main has said its line


def _exit_after_an_interrupt_that_does_not_end_pkb() -> None:
    """Ctrl-C raises KeyboardInterrupt in the main thread only when it runs Python: one stuck in a call into C (a
    wait that retries on EINTR) would never see it, and pkb would go on with the evaluation. The signal's byte also
    reaches a pipe (``signal.set_wakeup_fd``) that a thread of its own reads: ``INTERRUPT_GRACE_S`` after the first
    Ctrl-C, if pkb has not ended, it says the one line and exits 130 (its rank processes die with it: PDEATHSIG)."""
    import threading

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end)
    except ValueError:  # not the main thread: nothing to watch
        os.close(read_end)
        os.close(write_end)
        return

    def watch() -> None:
        while signal.SIGINT not in os.read(read_end, 64):
            pass
        time.sleep(INTERRUPT_GRACE_S)
        if not _INTERRUPTED_SAID:
            os.write(2, b"\npkb: interrupted\n")
        os._exit(130)

    threading.Thread(target=watch, name="pkb-interrupt", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `pkb` command (tests call main(argv) in their own process)
        _exit_after_an_interrupt_that_does_not_end_pkb()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        args = build_parser().parse_args(argv)
        check_problems(args)
        return args.func(args)
    except UsageError as exc:
        return _usage_error(str(exc), getattr(exc, "prog", "pkb"), args, argv)
    except KeyError as exc:  # an unknown problem (pkb.registry.UnknownProblem) or case name
        return _usage_error(str(exc.args[0]), "pkb", args, argv)
    except KeyboardInterrupt:
        stored = "; finished results are in the database, rerun to resume" if hasattr(args, "db") else ""
        global _INTERRUPTED_SAID
        print(f"\npkb: interrupted{stored}", file=sys.stderr)
        _INTERRUPTED_SAID = True
        return 130
    except BrokenPipeError:  # `pkb list | head`: the reader has gone, nothing to report
        sys.stderr.close()
        return 0
    except Exception as exc:  # pkb's own failure: say so (as JSON where JSON was asked for), never a candidate verdict
        import traceback

        if getattr(args, "json", False):
            print(json.dumps({"status": "harness_error", "command": args.command,
                              "message": f"pkb failed, not the candidate: {type(exc).__name__}: {exc}",
                              "details": {"error": traceback.format_exc(limit=-12)}}))
        else:
            traceback.print_exc()
            print(f"pkb: internal error ({type(exc).__name__}: {exc}); this is pkb's failure, not the candidate's",
                  file=sys.stderr)
        return HARNESS_FAILURE


def check_problems(args) -> None:
    """UnknownProblem, naming the closest problems, where ``args`` name one the suite lacks (a command's
    ``problem``, or its ``--problems`` selection): said before the command imports torch, as pkb.registry reads
    the names from the suite's source."""
    from pkb.registry import problem_name, selected_names

    if getattr(args, "problem", None) is not None:
        problem_name(args.problem)
    if getattr(args, "problems", None) is not None:
        selected_names(args.problems)


def _usage_error(message: str, prog: str, args, argv: list[str]) -> int:
    """A usage error said in one sentence on stderr, and with ``--json`` (asked for, even where the command line
    did not parse) as one object on stdout; exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False) or (args is None and "--json" in argv):
        command = getattr(args, "command", None) or next((word for word in argv if not word.startswith("-")), None)
        print(json.dumps({"status": "usage_error", "command": command, "message": message}))
    return USAGE_ERROR


if __name__ == "__main__":  # `python -m pkb.cli`: run the imported module's main, so its exception classes are the ones raised
    from pkb.cli import main as _main

    sys.exit(_main())
